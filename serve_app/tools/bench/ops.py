"""``bench ops``: where an embedded engine's decode step spends its time, op by op.

Builds the embedded engine (``--model``, ``--weights``, ``--num-threads``, ``--drafter``) in
this process and drives its core directly, with no step thread: ``--batch`` chat prompts
decode together, greedy, at ``--num-steps`` draft steps. A first pass of ``--tokens`` output
tokens per request is timed without the profiler (tokens per second and milliseconds per
step); a second, identical pass runs under ``torch.profiler``, whose self CPU time is summed
per op and per group of ops (the matrix products by kernel, attention's products, the rest).
The table prints, then the JSON result. Prefill and warm-up run before either pass.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from serve_app.engines.base import GenerateRequest, SamplingParams
from serve_app.engines.embedded.sequence import Status

from .prompts import PROMPT_SETS, chat_messages
from .stats import emit

HELP = "per-op profile of the embedded engine's decode steps (torch.profiler), with tok/s unprofiled"

# Self CPU time by op name, grouped: the products of each weight format's kernel, then the rest.
GROUPS = {
    "aten::_weight_int4pack_mm_for_cpu": "int4 products (q4_1 layers)",
    "aten::_weight_int8pack_mm": "int8 products",
    "qmm": "qmm products (gguf: Q4_1 layers, Q8_0 LM head)",
    "qmm eagle": "the draft head (gguf: its catch-up and drafts in one qmm.c call)",
    "mkldnn::_linear_pointwise": "oneDNN products (float32, bfloat16, LM head)",
    "aten::addmm": "other matrix products",
    "aten::mm": "other matrix products",
    "aten::bmm": "attention products (bmm)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="model (default smollm2-135m-instruct)")
    p.add_argument("--weights", default="float32", help="weight format: float32, bfloat16, int8, q4_1 or gguf")
    p.add_argument("--drafter", default="eagle", help="drafter for --num-steps > 0 (default eagle)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together (default 1)")
    p.add_argument("--num-steps", type=int, default=0, help="draft steps (default 0)")
    p.add_argument("--tokens", type=int, default=48, help="output tokens per request and pass (default 48)")
    p.add_argument("--top", type=int, default=15, help="ops listed (default 15)")
    p.add_argument("--out", default=None, help="write the JSON result here too")


def run(args: argparse.Namespace) -> int:
    if args.batch < 1 or args.tokens < 2 or args.num_steps < 0:
        raise SystemExit("--batch must be >= 1, --tokens >= 2 and --num-steps >= 0")
    result = measure(args)
    return emit(result, format_report(result) + "\n" + json.dumps(result), args.out)


def _engine(args):
    from serve_app.engines.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(model=args.model, weights=args.weights, drafter=args.drafter,
                            num_threads=args.num_threads, max_num_seqs=args.batch, max_model_len=1024)
    engine.build()
    return engine


def _pass(engine, prompts: list[str], tokens: int, num_steps: int, tag: str, prof=None) -> tuple[int, float, int]:
    """Prefill every prompt, then decode ``tokens`` each (under ``prof``, a started-and-stopped
    profiler, if given); returns (tokens, decode seconds, steps)."""
    core, out = engine.core, [0]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        seq = engine.make_sequence(GenerateRequest(f"{tag}{i}", prompt=prompt, params=params),
                                   lambda d: out.__setitem__(0, out[0] + len(d.token_ids)))
        core.add(seq)
    core.num_steps = num_steps
    while core.scheduler.waiting or any(s.status is not Status.DECODING for s in core.scheduler.running):
        core.step()  # the prefills: not part of the decode figures
    if prof is not None:
        prof.start()
    before, steps, start = out[0], 0, time.perf_counter()
    while core.has_work():
        core.step()
        steps += 1
    seconds = time.perf_counter() - start
    if prof is not None:
        prof.stop()
    return out[0] - before, seconds, steps


def measure(args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine = _engine(args)
    if args.weights == "gguf":
        from serve_app.engines.embedded import qmm
        qmm.profile_calls(True)
    chat = [engine.apply_chat_template(chat_messages(p)) for p in PROMPT_SETS["chat"]]
    prompts = [chat[i % len(chat)] for i in range(args.batch)]
    _pass(engine, prompts, 8, args.num_steps, "w")
    tokens, seconds, steps = _pass(engine, prompts, args.tokens, args.num_steps, "t")
    prof = profile(activities=[ProfilerActivity.CPU])
    p_tokens, p_seconds, p_steps = _pass(engine, prompts, args.tokens, args.num_steps, "p", prof)
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.key_averages():
        by_op[ev.key][0] += ev.self_cpu_time_total / 1e3
        by_op[ev.key][1] += ev.count
    total = sum(ms for ms, _ in by_op.values())
    groups: dict[str, float] = defaultdict(float)
    for name, (ms, _) in by_op.items():
        groups[GROUPS.get(name, "everything else")] += ms
    ops = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:args.top]
    return {
        "model": args.model, "weights": args.weights, "drafter": args.drafter if args.num_steps else None,
        "num_threads": args.num_threads, "torch": torch.__version__, "batch": args.batch,
        "num_steps": args.num_steps, "tokens_per_request": args.tokens,
        "unprofiled": {"output_tokens": tokens, "decode_s": round(seconds, 3), "steps": steps,
                       "tok_per_s": round(tokens / seconds, 1), "ms_per_step": round(1e3 * seconds / steps, 2),
                       "ms_per_token": round(1e3 * seconds / tokens, 2)},
        "profiled": {"output_tokens": p_tokens, "decode_s": round(p_seconds, 3), "steps": p_steps,
                     "self_cpu_ms": round(total, 1)},
        "groups_ms_per_step": {g: round(ms / p_steps, 3) for g, ms in sorted(groups.items(), key=lambda kv: -kv[1])},
        "groups_share": {g: round(ms / total, 3) for g, ms in groups.items()},
        "ops": [{"op": name, "ms_per_step": round(ms / p_steps, 3), "calls_per_step": round(n / p_steps, 1),
                 "share": round(ms / total, 3)} for name, (ms, n) in ops],
    }


def format_report(r: dict) -> str:
    u = r["unprofiled"]
    lines = [f"{r['model']} {r['weights']}, {r['num_threads']} thread(s), batch {r['batch']}, "
             f"num_steps {r['num_steps']}: {u['tok_per_s']} tok/s, {u['ms_per_step']} ms/step, "
             f"{u['ms_per_token']} ms/token (unprofiled)", "", f"{'group':48s} {'ms/step':>8s} {'share':>6s}"]
    lines += [f"{g:48s} {ms:8.3f} {r['groups_share'][g]:6.1%}" for g, ms in r["groups_ms_per_step"].items()]
    lines += ["", f"{'op':48s} {'ms/step':>8s} {'calls':>6s} {'share':>6s}"]
    lines += [f"{o['op']:48s} {o['ms_per_step']:8.3f} {o['calls_per_step']:6.1f} {o['share']:6.1%}" for o in r["ops"]]
    return "\n".join(lines)
