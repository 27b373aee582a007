"""``bench steps``: the engine's own choice of draft length against every fixed one, on a mixed
workload.

One embedded engine serves, per concurrency, the same request sequence under each side in
turn: ``fixed k`` (every decode step drafts k) for each ``--num-steps``, and ``adaptive``
(``step_policy: adaptive`` with the largest of them as the ceiling: the engine picks each
step's draft length, serve_app/control/steps.py). Sides alternate in mirrored rounds, so the
ratios see the same machine. The engine's learned step cost and acceptance carry over between
points, as in a running replica.

The workload mixes what acceptance differs on: request i takes the chat prompts when i is
even and the copy-heavy ones when odd, and every third request samples at temperature 1
(seeded), the rest greedy. Each row gives tokens/s, latency percentiles and acceptance;
``vs_best_fixed`` is adaptive's tokens/s over the best fixed side's at that concurrency;
``vs_one_length`` (with ``--one-length``) adaptive's over ``adaptive one``'s, the same policy
picking one draft length a step for the whole batch; ``step_ms`` the median wall time of the
side's decode steps by batch and the longest draft length of the step (``"batch,k"``: [steps, median ms]; a request near its ``max_tokens``
drafts fewer inside it), so a plain step under ``adaptive`` can be set beside one
under ``fixed 0``, and the chooser's fitted cost (``meta.chooser``) beside what steps took.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import sys
import time
from collections import Counter, defaultdict

from tqdm import tqdm

from serve_app.engines.base import SamplingParams
from serve_app.engines.embedded.config import DRAFTERS

from .client import sampling_for
from .engine import IGNORE_EOS, Tally, _int_list, closed_loop, cpu_model, mirrored, timed_request
from .prompts import PROMPT_SETS, chat_messages
from .stats import RequestTiming, emit

HELP = "the engine's per-step draft length against every fixed one, on a mixed workload"
ONE_LENGTH = "adaptive one"  # the side that picks one draft length a step for the whole batch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--drafter", choices=DRAFTERS, default="eagle")
    p.add_argument("--weights", default="float32")
    p.add_argument("--concurrency", type=_int_list, default=[1, 4, 16, 32])
    p.add_argument("--num-steps", type=_int_list, default=[0, 1, 3, 5],
                   help="the fixed sides; the largest is the adaptive side's ceiling")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=8, help="requests per side and point: max(this, 2 x concurrency)")
    p.add_argument("--rounds", type=int, default=2, help="mirrored rounds per point (the requests split over them)")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--one-length", action="store_true",
                   help="also run 'adaptive one': the adaptive policy with one draft length a step for the "
                   "whole batch (per_sequence false), beside 'adaptive', each sequence its own")
    p.add_argument("--out", help="write the results as JSON to this file")


def mixed_prompt_set(i: int) -> str:
    """The prompt set of request i of the mixed workload: chat when i is even, copy when odd."""
    return "chat" if i % 2 == 0 else "copy"


def mixed(i: int, rendered: dict[str, list[str]], max_tokens: int) -> tuple[str, SamplingParams]:
    """Request i of the mixed workload: its prompt and sampling."""
    prompts = rendered[mixed_prompt_set(i)]
    temperature, seed = sampling_for(i, 3)
    return prompts[(i // 2) % len(prompts)], SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=1.0, seed=seed, ignore_eos=IGNORE_EOS)


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(benchmark(args))
    return emit(result, format_report(result), args.out)


async def benchmark(args) -> dict:
    import torch

    from serve_app.control.steps import StepPolicyConfig
    from serve_app.engines.embedded import EmbeddedEngine, EmbeddedOptions
    from serve_app.engines.embedded.adaptive import StepChooser

    torch.set_num_threads(args.num_threads)
    ceiling = max(args.num_steps)
    engine = EmbeddedEngine(EmbeddedOptions(model=args.model, drafter=args.drafter, weights=args.weights,
                                            num_threads=args.num_threads, max_num_seqs=max(32, *args.concurrency),
                                            max_num_steps=max(8, ceiling)))
    await engine.start()
    choosers = {"adaptive": StepChooser(StepPolicyConfig())}
    if args.one_length:
        choosers[ONE_LENGTH] = StepChooser(StepPolicyConfig(per_sequence=False))
    rendered = {name: [engine.apply_chat_template(chat_messages(p)) for p in prompts]
                for name, prompts in PROMPT_SETS.items()}
    sides = [*(f"fixed {k}" for k in args.num_steps), *choosers]
    core = engine.core
    step_s: dict[tuple[str, int], defaultdict] = {}  # (side, c) -> (batch, k) -> decode step seconds
    timing = {"into": None}
    decode = core._decode

    def timed_decode(seqs, ceiling):  # the step thread's decode, timed; what it ran is last_num_steps
        t = time.perf_counter()
        decode(seqs, ceiling)
        if timing["into"] is not None:
            timing["into"][len(seqs), core.last_num_steps].append(time.perf_counter() - t)

    core._decode = timed_decode

    async def point(side: str, c: int, indices: range, tally: Tally) -> None:
        engine.core.chooser = choosers.get(side)
        engine.core.num_steps = ceiling if side in choosers else int(side.split()[1])
        before = dict(engine.core.totals)

        async def send(i: int) -> RequestTiming:
            prompt, params = mixed(i, rendered, args.max_tokens)
            return await timed_request(engine, prompt, args.max_tokens, params)

        timing["into"] = step_s.setdefault((side, c), defaultdict(list))
        await closed_loop(send, c, indices, progress, tally)
        while engine.core.has_work():
            await asyncio.sleep(0.001)
        timing["into"] = None
        tally.drafts.update({k: engine.core.totals[k] - before[k] for k in ("proposed", "accepted", "verifies")})

    rows: list[dict] = []
    total = sum(max(args.requests, 2 * c) for c in args.concurrency) * len(sides)
    try:
        with tqdm(total=total, desc="bench steps", unit="req", file=sys.stderr) as progress:
            for side in sides:  # warm-up: every path once, and the chooser's first cost samples
                await point(side, 2, range(4), Tally())
            step_s.clear()
            progress.reset(total)
            for c in args.concurrency:
                n = max(args.requests, 2 * c)
                per_round = -(-n // args.rounds)
                tallies = {side: Tally() for side in sides}
                chosen: dict[str, Counter] = {side: Counter() for side in choosers}
                for r, side in mirrored(sides, args.rounds):
                    progress.set_postfix_str(f"c={c} {side}")
                    chooser = choosers.get(side)
                    reasons = dict(chooser.reasons) if chooser else {}
                    await point(side, c, range(r * per_round, min(n, (r + 1) * per_round)), tallies[side])
                    if chooser:
                        chosen[side].update({k: v - reasons.get(k, 0) for k, v in chooser.reasons.items()})
                best = max((s for s in sides if s not in choosers),
                           key=lambda s: tallies[s].row()["output_tokens_per_s"] or 0)
                for side in sides:
                    row = {"concurrency": c, "side": side} | tallies[side].row()
                    row["step_ms"] = {f"{b},{k}": [len(v), round(statistics.median(v) * 1000, 2)]
                                      for (b, k), v in sorted(step_s.get((side, c), {}).items())}
                    if side in choosers:
                        row["best_fixed"] = best
                        row["vs_best_fixed"] = round(row["output_tokens_per_s"]
                                                     / tallies[best].row()["output_tokens_per_s"], 3)
                        row["step_reasons"] = dict(chosen[side])
                    if side == "adaptive" and ONE_LENGTH in choosers:
                        row["vs_one_length"] = round(row["output_tokens_per_s"]
                                                     / tallies[ONE_LENGTH].row()["output_tokens_per_s"], 3)
                    rows.append(row)
    finally:
        await engine.shutdown()
    return {"meta": {"model": args.model, "drafter": args.drafter, "weights": args.weights,
                     "num_threads": args.num_threads, "max_tokens": args.max_tokens, "rounds": args.rounds,
                     "ceiling": ceiling, "workload": "request i: chat if i even else copy; temperature 1 if i % 3 == 2",
                     "chooser": choosers["adaptive"].state(),
                     **({"chooser_one_length": choosers[ONE_LENGTH].state()} if ONE_LENGTH in choosers else {}),
                     "cpu_model": cpu_model(),
                     "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")},
            "rows": rows}


def format_report(result: dict) -> str:
    lines = [f"{'c':>3} {'side':>12} {'tok/s':>8} {'TPOT p50':>9} {'accept':>7}  vs best fixed"]
    for r in result["rows"]:
        extra = f"{r['vs_best_fixed']:.3f} ({r['best_fixed']})" if "vs_best_fixed" in r else ""
        extra += f"  vs one length {r['vs_one_length']:.3f}" if "vs_one_length" in r else ""
        tpot = r.get("tpot_p50_ms")
        lines.append(f"{r['concurrency']:>3} {r['side']:>12} {r['output_tokens_per_s'] or 0:>8.1f} "
                     f"{tpot if tpot is not None else float('nan'):>9.1f} {r.get('accept_rate') or 0:>7.2f}  {extra}")
    return "\n".join(lines)
