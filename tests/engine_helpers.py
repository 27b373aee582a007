"""Drive an EngineCore synchronously, so tests control exactly when num_steps changes."""

from __future__ import annotations

from serve_app.engines.base import GenerateRequest, SamplingParams
from serve_app.engines.embedded.engine import EmbeddedEngine


def sync_engine(**options) -> EmbeddedEngine:
    """An EmbeddedEngine whose core is built but whose step thread is not started."""
    engine = EmbeddedEngine(**options)
    engine.build()
    return engine


def run_greedy(engine: EmbeddedEngine, prompts: list[str], schedule, max_tokens: int = 32,
               together: bool = True, per_prompt: list[dict] | None = None, **params) -> list[list[int]]:
    """Greedy token ids per prompt; ``schedule(step)`` gives num_steps before every step.

    ``together`` runs all prompts as one continuous batch, else one after another;
    ``per_prompt[i]`` adds parameters of prompt i's own.
    """
    outputs: list[list[int]] = [[] for _ in prompts]
    groups = [list(range(len(prompts)))] if together else [[i] for i in range(len(prompts))]
    step = 0
    for group in groups:
        for i in group:
            own = per_prompt[i] if per_prompt else {}
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params, **own)
            seq = engine.make_sequence(GenerateRequest(f"r{i}", prompt=prompts[i], params=sp),
                                       lambda d, out=outputs[i]: out.extend(d.token_ids))
            engine.core.add(seq)
        while engine.core.has_work():
            engine.core.num_steps = schedule(step)
            engine.core.step()
            step += 1
    return outputs
