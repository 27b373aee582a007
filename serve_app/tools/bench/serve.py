"""``bench serve``: static spec vs static off vs dynamic through the whole serving stack.

For each concurrency c, each policy in turn (spec, off, dynamic: back to back, so the ratios
between them see the same machine conditions) runs c closed-loop streaming clients over HTTP
(``/v1/chat/completions``, greedy) on the same prompt sequence: requests started in the
measured window take prompts 0, 1, 2, ... at every point (warm-up requests take others),
since the prompts' speed-ups differ widely and a window holds few requests at low load.
``spec`` pins the ladder's top tier and ``off`` pins num_steps 0 through
``PUT /v1/speculation``; ``dynamic`` hands the mode back to the policy (``mode: auto``).

A point runs continuously. Its first ``--settle-s`` seconds, and at least until every client
has finished its first request, are warm-up and are not measured: the load reaches c, the
clients fall out of the step they started in, and under ``dynamic`` the controller has time
to reach the tier of that load (dwell + min switch interval). Then ``--measure-s`` seconds
are measured (a row's ``settle_s`` is the longest settle its windows took):

- output tokens/s: tokens delivered in the window (from every request, whenever it started);
- TTFT / TPOT p50 and p99: requests submitted in the window; the clients keep sending
  (unmeasured) requests until the last of them ends, so they all see load c;
- switches: controller mode changes in the window; ``mode_share``: the share of the window
  spent in each commanded num_steps (the ceiling, under ``two-level``); ``steps_ran``: the
  mean draft steps the replicas ran (``mean_num_steps``, else ``active_num_steps``);
  ``mean_load_per_replica``: what the controller saw.

With ``--repeats N`` each policy runs N such windows per concurrency, in mirrored order
(spec, off, dynamic, dynamic, off, spec, ...), so that a drift of the shared machine over a
point weighs on every policy alike; a row pools its windows (tokens over the summed measured
time, percentiles over all their requests) and lists each window's tokens/s.

``--target llamacpp`` measures llama.cpp's ``llama-server`` instead, on the same GGUF (see
llamacpp.py; built once if absent) with ``--threads``, one slot per client at the largest
concurrency and no prompt cache (specserve has none), through the same client and windows.
A server without specserve's operator API (llama-server, or any OpenAI-compatible ``--url``)
has no policy to set: it gets one row per concurrency, policy ``none``, as it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from tqdm import tqdm

from . import llamacpp
from .client import (
    DEFAULT_POLICIES,
    POLICIES,
    Poller,
    Target,
    add_target_arguments,
    prompt_messages,
    run_against_target,
)
from .engine import _f as f
from .engine import _int_list, cpu_model
from .prompts import PROMPT_SETS
from .stats import RequestTiming, emit, mean, paired_ratio_ci, summarize

HELP = "spec vs off vs dynamic over a concurrency sweep, through the HTTP serving stack"


def policy_list(allowed: tuple[str, ...] = POLICIES) -> Callable[[str], list[str]]:
    """An argparse type: a comma list of policies, each one of ``allowed``."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names or any(n not in allowed for n in names):
            raise argparse.ArgumentTypeError(f"policies are {', '.join(allowed)}; got {text!r}")
        return names

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_arguments(p)
    p.add_argument("--policies", type=policy_list(), default=list(DEFAULT_POLICIES),
                   help="comma list of spec, off, dynamic, two-level (default spec,off,dynamic)")
    p.add_argument("--concurrency", type=_int_list, default=[1, 2, 4, 8, 16, 32], help="comma list")
    p.add_argument("--settle-s", type=float, default=15.0, help="unmeasured seconds at the start of each point")
    p.add_argument("--measure-s", type=float, default=30.0, help="measured seconds of each window")
    p.add_argument("--repeats", type=int, default=1,
                   help="windows per policy and concurrency, in mirrored order (default 1)")
    p.add_argument("--stagger-s", type=float, default=0.0,
                   help="spread the clients' first requests evenly over this many seconds (default 0: all at once)")
    p.add_argument("--spec-steps", type=int, default=None, help="num_steps of 'spec' (default: the ladder's top tier)")
    p.add_argument("--target", choices=["specserve", "llamacpp"], default="specserve",
                   help="llamacpp: start llama.cpp's llama-server on the same GGUF instead of --config (default specserve)")
    p.add_argument("--threads", type=int, default=None,
                   help="with --target llamacpp: llama-server's threads (default: all cores)")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")


def run(args: argparse.Namespace) -> int:
    if 0 in args.concurrency:
        sys.exit("concurrency must be positive")
    if args.repeats < 1:
        sys.exit("--repeats must be at least 1")
    if args.stagger_s < 0:
        sys.exit("--stagger-s must be >= 0")
    if args.target == "llamacpp":
        if args.url or args.overrides:
            sys.exit("--target llamacpp starts its own llama-server: for a running one give --url alone")
        result = run_llamacpp(args)
    else:
        result = run_against_target(args, lambda target: sweep(target, args))
    return emit(result, format_table(result), args.out)


def run_llamacpp(args: argparse.Namespace) -> dict:
    """The sweep against a llama-server of our own on the engine's GGUF."""
    from serve_app.engines.embedded.weights import smollm2_gguf_path

    for name in args.prompt_set.split(","):
        if name not in PROMPT_SETS:
            raise SystemExit(f"prompt sets are {', '.join(PROMPT_SETS)}; got {name!r}")
    binaries = llamacpp.ensure_binaries()
    threads, slots = args.threads or os.cpu_count(), max(args.concurrency)
    ctx = llamacpp.slot_context(llamacpp.longest_prompt_tokens(prompt_messages(args.prompt_set.split(","))),
                                args.max_tokens)
    server = {"llama_cpp": binaries.version(), "binaries": binaries.found_in, "threads": threads, "slots": slots,
              "ctx_per_slot": ctx, "cache_prompt": False}

    async def main(url: str) -> dict:
        target = Target(url, None)
        target.extra_body = {"cache_prompt": False}
        try:
            await target.start()
            result = await sweep(target, args)
        finally:
            await target.aclose()
        result["meta"]["server"] = server
        return result

    with llamacpp.llama_server(binaries, smollm2_gguf_path(), threads, slots, ctx) as url:
        return asyncio.run(main(url))


# -- one point ---------------------------------------------------------------------------
@dataclass(slots=True)
class Window:
    """One measured window of a point: what ``point_row`` pools over a point's windows."""

    timings: list[RequestTiming]
    tokens: float
    completed: int
    errors: int
    settle_s: float
    measure_s: float
    poll: dict


async def measure_window(target: Target, poller: Poller, prompts: list[list[dict]], concurrency: int,
                         settle_s: float, measure_s: float, max_tokens: int, ignore_eos: bool,
                         stagger_s: float = 0.0) -> Window:
    """c closed-loop clients: settle, then measure (see the module docstring). The window opens
    ``settle_s`` after the start, and never before every client has finished one request: the
    clients start together, and until their first requests end they run in step (one wave of
    prefills, then a batch that ends together), which a window must not catch. With
    ``stagger_s`` client j sends its first request j·stagger_s/c seconds after the start:
    requests of one length at one speed (plain decoding) otherwise stay in step for good."""
    start = time.perf_counter()
    t0 = t1 = math.inf
    records, measured = [], []
    open_measured = first_done = 0
    # Requests started in the window take prompts 0, 1, 2, ... at every point, so every policy is
    # measured on the same prompts (their speed-ups differ a lot); warm-up ones take others.
    window_indices, other_indices = itertools.count(), itertools.count(len(prompts) // 2)

    async def client(j: int) -> None:
        nonlocal open_measured, first_done, t0, t1
        first = True
        await asyncio.sleep(j * stagger_s / concurrency)
        while time.perf_counter() < t1 or open_measured:
            in_window = t0 <= time.perf_counter() < t1
            i = next(window_indices if in_window else other_indices)
            open_measured += in_window
            rec = await target.chat(i, prompts[i % len(prompts)], max_tokens, ignore_eos)
            open_measured -= in_window
            records.append(rec)
            if in_window:
                measured.append(rec)
            if first:
                first, first_done = False, first_done + 1
                if first_done == concurrency:
                    t0 = max(start + settle_s, time.perf_counter())
                    t1 = t0 + measure_s

    await asyncio.gather(*(client(j) for j in range(concurrency)))
    return Window(timings=[r.timing for r in measured if r.ok],
                  tokens=sum(r.tokens_between(t0, t1) for r in records),
                  completed=sum(1 for r in records if r.ok and t0 <= r.end < t1),
                  errors=sum(1 for r in measured if not r.ok),
                  settle_s=round(t0 - start, 3), measure_s=measure_s, poll=poller.summary(t0, t1))


def point_row(windows: list[Window]) -> dict:
    """A point's row from its windows: tokens and requests over the summed measured time,
    latency percentiles over every measured request, each window's tokens/s listed."""
    timings = [t for w in windows for t in w.timings]
    measured_s = sum(w.measure_s for w in windows)
    share: dict[str, float] = {}
    for w in windows:
        for k, v in w.poll["mode_share"].items():
            share[k] = share.get(k, 0.0) + v / len(windows)
    loads = [w.poll["mean_load_per_replica"] for w in windows if w.poll["mean_load_per_replica"] is not None]
    ran = [w.poll["steps_ran"] for w in windows if w.poll.get("steps_ran") is not None]
    switches = [w.poll["switches"] for w in windows]
    return summarize(timings, measured_s) | {
        "output_tokens_per_s": round(sum(w.tokens for w in windows) / measured_s, 3),
        "requests_per_s": round(sum(w.completed for w in windows) / measured_s, 4),
        "mean_output_tokens": round(sum(t.output_tokens for t in timings) / len(timings), 2) if timings else None,
        "errors": sum(w.errors for w in windows),
        "settle_s": round(max(w.settle_s for w in windows), 3),
        "measure_s": windows[0].measure_s,
        "windows": len(windows),
        "window_tokens_per_s": [round(w.tokens / w.measure_s, 3) for w in windows],
        "switches": None if None in switches else sum(switches),
        "mean_load_per_replica": mean(loads),
        "mode_share": {k: round(v, 3) for k, v in sorted(share.items())},
        "steps_ran": mean(ran),
    }


async def run_point(target: Target, poller: Poller, prompts: list[list[dict]], concurrency: int, settle_s: float,
                    measure_s: float, max_tokens: int, ignore_eos: bool) -> dict:
    """One window's row."""
    return point_row([await measure_window(target, poller, prompts, concurrency, settle_s, measure_s,
                                           max_tokens, ignore_eos)])


# -- the sweep ---------------------------------------------------------------------------
async def spec_steps_of(target: Target, explicit: int | None) -> tuple[int, dict]:
    status = await target.status()
    return (explicit if explicit is not None else status["policy"]["tiers"][0]["num_steps"]), status


def window_order(policies: list[str], repeats: int) -> list[str]:
    """The policies' windows at one concurrency: every repeat after the first reverses the order
    of the one before (spec, off, dynamic, dynamic, off, spec), so a drift of the machine over a
    point weighs on every policy alike."""
    return [p for r in range(repeats) for p in (policies if r % 2 == 0 else policies[::-1])]


async def sweep(target: Target, args: argparse.Namespace) -> dict:
    status = await target.status_or_none()
    if status is None:  # no operator API: one policy, the server's own
        policies, spec_steps = ["none"], None
    else:
        policies, (spec_steps, status) = args.policies, await spec_steps_of(target, args.spec_steps)
    prompts = prompt_messages(args.prompt_set.split(","))
    rows: list[dict] = []
    order = window_order(policies, args.repeats)
    async with Poller(target, every_s=0.25 if status else None) as poller:
        # One-off costs (first forward, tokenizer) before any point.
        await asyncio.gather(*(target.chat(i, prompts[i], 8, True) for i in range(2)))
        with tqdm(total=len(args.concurrency) * len(order), desc="bench serve", unit="window",
                  file=sys.stderr) as bar:
            for c in args.concurrency:
                windows: dict[str, list[Window]] = {p: [] for p in policies}
                for policy in order:  # innermost: the ratios at one concurrency are side by side
                    bar.set_postfix_str(f"c={c} {policy}")
                    if status:
                        await target.apply_policy(policy, spec_steps)
                    windows[policy].append(await measure_window(target, poller, prompts, c, args.settle_s,
                                                                args.measure_s, args.max_tokens, args.ignore_eos,
                                                                args.stagger_s))
                    bar.update(1)
                rows += [{"policy": p, "concurrency": c} | point_row(windows[p]) for p in policies]
        if status:
            await target.restore(status)
    windows_meta = {"repeats": args.repeats, "settle_s": args.settle_s, "measure_s": args.measure_s,
                    "stagger_s": args.stagger_s}
    return {"meta": meta(args, target, status, spec_steps) | windows_meta, "rows": rows, "ratios": ratios(rows)}


def meta(args: argparse.Namespace, target: Target, status: dict | None, spec_steps: int | None) -> dict:
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m serve_app.tools.bench", *sys.argv[1:]]),
        "config": None if args.url else args.config,
        "overrides": args.overrides,
        "url": args.url,
        "model": target.model,
        "replicas": len(status["replicas"]) if status else None,
        "policy": status["policy"] if status else None,
        "spec_steps": spec_steps,
        "prompt_set": args.prompt_set,
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "sampled_every": args.sampled_every,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
    }


def ratios(rows: list[dict]) -> list[dict]:
    """Per concurrency where dynamic ran: its tokens/s over the better static policy's; where
    two-level ran too, its tokens/s over the better static policy's and over dynamic's. With
    repeated windows, ``*_ci95``: the 95 % interval of that ratio from the windows paired by
    repeat (``stats.paired_ratio_ci``; None with one window)."""
    out = []
    for c in dict.fromkeys(r["concurrency"] for r in rows):
        tps = {r["policy"]: r["output_tokens_per_s"] for r in rows if r["concurrency"] == c}
        windows = {r["policy"]: r.get("window_tokens_per_s", [r["output_tokens_per_s"]])
                   for r in rows if r["concurrency"] == c}
        static = {p: tps[p] for p in ("spec", "off") if tps.get(p)}
        if "dynamic" not in tps or not static:
            continue
        best = max(static, key=static.get)
        x = {"concurrency": c, "best_static": best, "dynamic_over_best_static": round(tps["dynamic"] / static[best], 4),
             "dynamic_over_best_static_ci95": paired_ratio_ci(windows["dynamic"], windows[best])}
        if tps.get("two-level"):
            x |= {"two_level_over_best_static": round(tps["two-level"] / static[best], 4),
                  "two_level_over_best_static_ci95": paired_ratio_ci(windows["two-level"], windows[best]),
                  "two_level_over_dynamic": round(tps["two-level"] / tps["dynamic"], 4) if tps["dynamic"] else None}
        out.append(x)
    return out


def format_table(result: dict) -> str:
    m = result["meta"]
    server = (f"{m['replicas']} replicas, spec = {m['spec_steps']} steps" if m["replicas"] is not None
              else (f"llama-server {s['llama_cpp']}, {s['threads']} threads, {s['slots']} slots"
                    if (s := m.get("server")) else "no operator API"))
    lines = [f"model {m['model']}, {server}, prompts {m['prompt_set']}, max_tokens {m['max_tokens']}; latencies in ms",
             f"{'conc':>4} {'policy':>8} {'tok/s':>8} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} "
             f"{'tpot p99':>9} {'load':>5} {'switch':>6}  modes"]
    for r in result["rows"]:
        lines.append(f"{r['concurrency']:>4} {r['policy']:>8} {f(r['output_tokens_per_s'], '8.1f')} "
                     f"{f(r['ttft_p50_ms'], '9.1f')} {f(r['ttft_p99_ms'], '9.1f')} {f(r['tpot_p50_ms'], '9.1f')} "
                     f"{f(r['tpot_p99_ms'], '9.1f')} {f(r['mean_load_per_replica'], '5.1f')} "
                     f"{f(r['switches'], '6d')}  {r['mode_share']}")
    if result["ratios"]:
        lines.append("dynamic / best static (95 % interval of paired windows): " + ", ".join(
            f"c={x['concurrency']}: {x['dynamic_over_best_static']:.2f} ({x['best_static']}{_ci(x.get('dynamic_over_best_static_ci95'))})"
            for x in result["ratios"]))
    if any("two_level_over_best_static" in x for x in result["ratios"]):
        lines.append("two-level / best static, / dynamic: " + ", ".join(
            f"c={x['concurrency']}: {x['two_level_over_best_static']:.2f}{_ci(x.get('two_level_over_best_static_ci95'))}, "
            f"{f(x['two_level_over_dynamic'], '.2f')}"
            for x in result["ratios"] if "two_level_over_best_static" in x))
    return "\n".join(lines)


def _ci(interval: list[float] | None) -> str:
    return f" {interval[0]:.2f}-{interval[1]:.2f}" if interval else ""
