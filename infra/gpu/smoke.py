"""GPU smoke benchmark of the SGLang backend on one 8-GPU node (never run in CI).

    python infra/gpu/smoke.py --model meta-llama/Llama-3.3-70B-Instruct \
        --draft yuhuili/EAGLE3-LLaMA3.3-Instruct-70B [--config configs/prod.yaml]

Starts the engine exactly as configs/prod.yaml configures it (model and draft overridden),
then 1. checks that greedy outputs are identical with num_steps fixed at every candidate and
with num_steps forced to switch every few milliseconds mid-generation; 2. measures output
tokens/s for every num_steps at concurrency 1, 8, 64 and 250, printed beside the seed
deployment's figures. Exit status 1 if any output differs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from serve_app.engines.base import GenerateRequest, SamplingParams  # noqa: E402
from serve_app.engines.sglang import SGLangEngine, SGLangOptions  # noqa: E402

CONCURRENCY = (1, 8, 64, 250)
# The seed deployment (8 GPUs, TP-8, SGLang + EAGLE-3), output tokens/s: plain vs EAGLE-3.
SEED = {1: (92.6, 77.5), 250: (772.1, 340.9)}
PROMPTS = [
    "Explain how a hash map handles collisions.",
    "Write a Python function that merges two sorted lists.",
    "Summarize the causes of the French Revolution in five sentences.",
    "What is the difference between TCP and UDP?",
    "Translate to German: The weather is nice today and we are going for a walk.",
    "List ten prime numbers and explain how you found them.",
    "Describe the water cycle to a ten-year-old.",
    "Give three arguments for and against remote work.",
]


async def run(engine, prompt: str, rid: str, max_tokens: int, ignore_eos: bool = False) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    return [t async for d in engine.generate(GenerateRequest(rid, prompt=prompt, params=params)) for t in d.token_ids]


async def check_lossless(engine, steps: list[int], max_tokens: int = 128, switch_every_s: float = 0.005) -> list[str]:
    """Greedy outputs at every fixed num_steps and under forced switches, against steps=0."""
    outputs = {}
    for n in steps:
        await engine.set_num_steps(n)
        outputs[n] = await asyncio.gather(*(run(engine, p, f"fix{n}-{i}", max_tokens) for i, p in enumerate(PROMPTS)))

    async def flip():
        for n in itertools.cycle(steps):
            await engine.set_num_steps(n)
            await asyncio.sleep(switch_every_s)

    flipper = asyncio.create_task(flip())
    try:
        outputs["switching"] = await asyncio.gather(
            *(run(engine, p, f"sw-{i}", max_tokens) for i, p in enumerate(PROMPTS))
        )
    finally:
        flipper.cancel()
    reference = outputs[0]
    return [
        f"num_steps={mode} prompt {i}: differs from steps=0 at token {first_difference(o, r)}"
        for mode, outs in outputs.items()
        for i, (o, r) in enumerate(zip(outs, reference, strict=True))
        if o != r
    ]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


async def throughput(engine, num_steps: int, concurrency: int, max_tokens: int = 256, rounds: int = 2) -> float:
    """Output tokens/s with ``concurrency`` requests in flight (each generates max_tokens)."""
    await engine.set_num_steps(num_steps)
    n = concurrency * rounds
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with sem:
            return len(
                await run(engine, PROMPTS[i % len(PROMPTS)], f"tp{num_steps}-{concurrency}-{i}", max_tokens, True)
            )

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(n))))
    return tokens / (time.perf_counter() - start)


def table(results: dict[tuple[int, int], float], steps: list[int]) -> str:
    head = ["concurrency"] + [f"steps={n}" for n in steps] + ["seed plain", "seed EAGLE-3"]
    rows = [head]
    for c in CONCURRENCY:
        seed = SEED.get(c, (None, None))
        rows.append([str(c)] + [f"{results[n, c]:.1f}" for n in steps] + [f"{s}" if s else "-" for s in seed])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows)


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--config", default=str(ROOT / "configs" / "prod.yaml"))
    ap.add_argument("--tp-size", type=int, default=None, help="override the config's tp_size (e.g. a smaller node)")
    args = ap.parse_args(argv)

    app = yaml.safe_load(Path(args.config).read_text())["applications"][0]
    options = {**app["args"]["engine"]["sglang"], "model_path": args.model, "draft_model_path": args.draft}
    if args.tp_size:
        options["tp_size"] = args.tp_size
    opts = SGLangOptions.model_validate(options)
    engine = SGLangEngine(opts)
    t0 = time.perf_counter()
    await engine.start()
    print(f"engine up in {time.perf_counter() - t0:.0f} s (candidate steps {opts.candidate_steps})", flush=True)
    try:
        problems = await check_lossless(engine, opts.candidate_steps)
        print("greedy outputs identical across fixed and switched num_steps" if not problems else "\n".join(problems))
        results = {}
        for n in opts.candidate_steps:
            for c in CONCURRENCY:
                results[n, c] = await throughput(engine, n, c)
                print(f"  steps={n} concurrency={c}: {results[n, c]:.1f} tok/s", flush=True)
        print("\noutput tokens/s\n" + table(results, opts.candidate_steps))
        return 1 if problems else 0
    finally:
        await engine.shutdown()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
