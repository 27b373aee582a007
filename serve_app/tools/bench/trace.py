"""``bench trace``: an open-loop arrival trace with low- and high-load phases, replayed per policy.

Traces (seeded, so every policy sees the very same arrivals):

- ``bursty``: ``--phases`` phases of ``--phase-s`` seconds, alternating low, high, low, ...;
  Poisson arrivals at ``--low-rate`` / ``--high-rate`` requests per second.
- ``diurnal``: one smooth day over the same length: the rate rises from low to high and back
  (a raised cosine); arrivals while the rate is above the midpoint belong to the high phase.
- a JSON file: ``{"arrivals": [{"t": seconds, "phase": "low"}, ...], "phases": [...]}``
  (the ``trace`` field of this command's output is such a file).

``--rates-from SWEEP.json`` sets the rates from a ``bench serve`` sweep of the same machine:
low = half the request rate of ``spec`` at the sweep's lowest concurrency, high = 0.9 x the
request rate of ``off`` at its highest concurrency (near what plain decoding sustains).

Each policy replays the trace from an idle application (``dynamic`` from its top tier).
Per policy: output tokens/s, goodput (tokens/s of the requests whose TPOT met
``--tpot-slo-ms``), TTFT/TPOT p50/p99 overall and per phase, switches, and a timeline of
load, mode and per-request TPOT for the report's plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time

import numpy as np
from tqdm import tqdm

from .client import (
    DEFAULT_POLICIES,
    Poller,
    Target,
    add_target_arguments,
    all_replicas_at,
    prompt_messages,
    run_against_target,
)
from .engine import _f as f
from .serve import meta, policy_list, spec_steps_of
from .stats import emit, summarize

HELP = "an open-loop bursty or diurnal trace replayed against spec, off and dynamic"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_arguments(p)
    p.add_argument("--trace", default="bursty", help="bursty, diurnal, or a JSON trace file (default bursty)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", type=policy_list(), default=list(DEFAULT_POLICIES),
                   help="comma list of spec, off, dynamic, two-level (default spec,off,dynamic)")
    p.add_argument("--phases", type=int, default=5, help="phases of the bursty trace, low first (default 5)")
    p.add_argument("--phase-s", type=float, default=40.0, help="seconds per phase (default 40)")
    p.add_argument("--low-rate", type=float, default=0.3, help="requests/s in low phases (default 0.3)")
    p.add_argument("--high-rate", type=float, default=3.0, help="requests/s in high phases (default 3)")
    p.add_argument("--rates-from", default=None, help="a `bench serve` JSON: derive both rates from it")
    p.add_argument("--tpot-slo-ms", type=float, default=None,
                   help="TPOT SLO of goodput (default: 1.5 x off's TPOT p50 at the sweep's lowest concurrency "
                        "with --rates-from, else 100)")
    p.add_argument("--spec-steps", type=int, default=None, help="num_steps of 'spec' (default: the ladder's top tier)")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")


def run(args: argparse.Namespace) -> int:
    slo = 100.0
    if args.rates_from:
        with open(args.rates_from) as f:
            args.low_rate, args.high_rate, slo = rates_from_sweep(json.load(f))
    args.tpot_slo_ms = args.tpot_slo_ms or slo
    trace = load_or_make_trace(args)
    result = run_against_target(args, lambda target: replay_all(target, trace, args))
    return emit(result, format_table(result), args.out)


# -- traces (pure) -----------------------------------------------------------------------
def rates_from_sweep(sweep: dict) -> tuple[float, float, float]:
    """(low rate, high rate, TPOT SLO ms) from a ``bench serve`` result (see the module docstring)."""
    rows = sweep["rows"]
    lo, hi = min(r["concurrency"] for r in rows), max(r["concurrency"] for r in rows)
    at = {(r["policy"], r["concurrency"]): r for r in rows}
    low = 0.5 * at["spec", lo]["requests_per_s"]
    high = 0.9 * at["off", hi]["requests_per_s"]
    return round(low, 4), round(high, 4), round(1.5 * at["off", lo]["tpot_p50_ms"], 1)


def make_trace(kind: str, seed: int, low_rate: float, high_rate: float, phase_s: float, phases: int) -> dict:
    """Seeded Poisson arrivals: ``bursty`` (alternating phases) or ``diurnal`` (a raised cosine)."""
    rng = np.random.default_rng(seed)
    duration = phase_s * phases
    if kind == "bursty":
        spans = [("low" if i % 2 == 0 else "high", i * phase_s, (i + 1) * phase_s) for i in range(phases)]

        def rate(t: float) -> float:
            return low_rate if int(t // phase_s) % 2 == 0 else high_rate
    elif kind == "diurnal":
        spans = [("low", 0.0, duration / 4), ("high", duration / 4, 3 * duration / 4), ("low", 3 * duration / 4, duration)]

        def rate(t: float) -> float:
            return low_rate + (high_rate - low_rate) * (1 - math.cos(2 * math.pi * t / duration)) / 2
    else:
        raise ValueError(f"unknown trace {kind!r}: bursty, diurnal or a JSON file")
    # Thinning: candidates at the peak rate, each kept with probability rate(t) / peak.
    peak, t, arrivals = max(low_rate, high_rate), 0.0, []
    while (t := t + rng.exponential(1 / peak)) < duration:
        if rng.random() < rate(t) / peak:
            phase = next(name for name, a, b in spans if a <= t < b)
            arrivals.append({"t": round(t, 4), "phase": phase})
    return {"kind": kind, "seed": seed, "low_rate": low_rate, "high_rate": high_rate, "duration_s": duration,
            "phases": [{"name": n, "start": a, "end": b} for n, a, b in spans], "arrivals": arrivals}


def load_or_make_trace(args: argparse.Namespace) -> dict:
    if args.trace in ("bursty", "diurnal"):
        return make_trace(args.trace, args.seed, args.low_rate, args.high_rate, args.phase_s, args.phases)
    with open(args.trace) as f:
        trace = json.load(f)
    trace = trace.get("trace", trace)  # a previous result, or a bare trace
    trace.setdefault("duration_s", max(a["t"] for a in trace["arrivals"]))
    trace.setdefault("phases", [])
    for a in trace["arrivals"]:
        a.setdefault("phase", "all")
    return trace


def policy_stats(records: list, wall_s: float, slo_ms: float) -> dict:
    """Throughput, goodput and latency of one replay, overall and per phase."""
    ok = [r for r in records if r.ok]

    def meets(r) -> bool:
        tpot = r.timing.tpot_s
        return tpot is None or tpot * 1000 <= slo_ms

    def latency(rs: list) -> dict:
        s = summarize([r.timing for r in rs], wall_s)
        keys = ("num_requests", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
        return {k: s[k] for k in keys} | {"slo_attainment": round(sum(map(meets, rs)) / len(rs), 4) if rs else None}

    phases = {name: latency([r for r in ok if r.phase == name]) for name in dict.fromkeys(r.phase for r in records)}
    return latency(ok) | {
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / wall_s, 3),
        "goodput_tokens_per_s": round(sum(r.output_tokens for r in ok if meets(r)) / wall_s, 3),
        "tpot_p50_low_load_ms": phases.get("low", {}).get("tpot_p50_ms"),
        "errors": len(records) - len(ok),
        "wall_s": round(wall_s, 3),
        "phases": phases,
    }


# -- replay ------------------------------------------------------------------------------
async def replay(target: Target, trace: dict, prompts: list[list[dict]], args: argparse.Namespace,
                 bar: tqdm) -> dict:
    """One policy's replay of the trace (the policy is already applied)."""
    async def one(i: int, arrival: dict):
        await asyncio.sleep(max(0.0, start + arrival["t"] - time.perf_counter()))
        rec = await target.chat(i, prompts[i % len(prompts)], args.max_tokens, args.ignore_eos)
        rec.phase = arrival["phase"]
        bar.update(1)
        return rec

    async with Poller(target) as poller:
        start = time.perf_counter()
        records = await asyncio.gather(*(one(i, a) for i, a in enumerate(trace["arrivals"])))
        end = max([start + trace["duration_s"], *(r.end for r in records)])
    stats = policy_stats(records, end - start, args.tpot_slo_ms)
    stats["switches"] = poller.summary(start, end + 1)["switches"]
    stats["timeline"] = {
        "mode": [[round(t - start, 3), k, round(load, 3)] for t, k, load, *_ in poller.window(start, end + 1)],
        "requests": [[round(r.start - start, 3), r.phase, round(r.timing.ttft_s * 1000, 2),
                      None if r.timing.tpot_s is None else round(r.timing.tpot_s * 1000, 2), r.output_tokens]
                     for r in records if r.ok],
    }
    return stats


async def replay_all(target: Target, trace: dict, args: argparse.Namespace) -> dict:
    spec_steps, status = await spec_steps_of(target, args.spec_steps)
    top = status["policy"]["tiers"][0]["num_steps"]
    prompts = prompt_messages(args.prompt_set.split(","))
    await asyncio.gather(*(target.chat(i, prompts[i], 8, True) for i in range(2)))  # one-off costs
    policies = {}
    n = len(trace["arrivals"])
    with tqdm(total=n * len(args.policies), desc="bench trace", unit="req", file=sys.stderr) as bar:
        for policy in args.policies:
            bar.set_postfix_str(policy)
            await target.apply_policy(policy, spec_steps)
            # Start idle; dynamic from its low-load tier, as after a quiet spell.
            idle = (lambda s: s["cluster_queue"] == 0 and all_replicas_at(s, top)) if policy in (
                "dynamic", "two-level") else (
                lambda s: s["cluster_queue"] == 0)
            await target.wait_for(idle, 60)
            policies[policy] = await replay(target, trace, prompts, args, bar)
    await target.restore(status)
    return {"meta": meta(args, target, status, spec_steps) | {"tpot_slo_ms": args.tpot_slo_ms},
            "trace": trace, "policies": policies}


def format_table(result: dict) -> str:
    m, tr = result["meta"], result["trace"]
    lines = [f"trace {tr['kind']} (seed {tr.get('seed')}), {len(tr['arrivals'])} requests over {tr['duration_s']:.0f}s, "
             f"TPOT SLO {m['tpot_slo_ms']} ms; latencies in ms",
             f"{'policy':>8} {'tok/s':>7} {'goodput':>7} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>8} "
             f"{'tpot p99':>8} {'low tpot50':>10} {'switch':>6} {'err':>4}"]
    for name, s in result["policies"].items():
        lines.append(f"{name:>8} {s['output_tokens_per_s']:>7.1f} {s['goodput_tokens_per_s']:>7.1f} "
                     f"{f(s['ttft_p50_ms'], '9.1f')} {f(s['ttft_p99_ms'], '9.1f')} {f(s['tpot_p50_ms'], '8.1f')} "
                     f"{f(s['tpot_p99_ms'], '8.1f')} {f(s['tpot_p50_low_load_ms'], '10.1f')} "
                     f"{f(s['switches'], '6d')} {s['errors']:>4}")
    return "\n".join(lines)

