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
``--rates-from probe`` measures those two request rates in this run, before the replays: one
closed-loop window of ``spec`` at the lowest of ``--probe-concurrency`` and one of ``off`` at
the highest (as ``bench serve``'s windows: ``--probe-settle-s`` unmeasured, the clients' first
requests spread over it, then ``--probe-measure-s`` measured), on the trace's own requests, so
the rates follow the machine's speed in this hour (a sweep's hour may have been faster).

Each policy replays the trace from an idle application (``dynamic`` from its top tier),
``--rounds`` times, every round after the first in the reverse order of the one before (spec,
off, dynamic, dynamic, off, spec), so a drift of the machine's speed over the run weighs on
every policy alike. Per policy, its rounds pooled: output tokens/s, goodput (tokens/s of the
requests whose TPOT met the SLO), TTFT/TPOT p50/p99 overall and per phase, switches, goodput at
other multiples of the SLO, each round's own figures, and the first round's timeline of load,
mode and per-request TPOT for the report's plot.

The TPOT SLO (``--tpot-slo-from``): ``run``, 1.5 x off's TPOT p50 over the low phases of this
very run, so that it moves with the machine's speed as the replays do; ``sweep``, 1.5 x off's
TPOT p50 at the ``--rates-from`` sweep's lowest concurrency (the default with ``--rates-from``;
else ``run`` where ``off`` runs); or ``--tpot-slo-ms``.

``meta.off_overloaded``: off's low-phase requests waited over a second (p50) for their first
token, so the bursts' backlog outlived them: the high rate is past what plain decoding serves
in this run's hour (rates come from a sweep, which may have run in a faster one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass

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
from .engine import _int_list
from .serve import measure_window, meta, point_row, policy_list, spec_steps_of, window_order
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
    p.add_argument("--rates-from", default=None,
                   help="a `bench serve` JSON: derive both rates from it; probe: measure them in this run first")
    p.add_argument("--probe-concurrency", type=_int_list, default=[1, 32],
                   help="with --rates-from probe: clients of spec's window, of off's (default 1,32)")
    p.add_argument("--probe-settle-s", type=float, default=8.0,
                   help="with --rates-from probe: unmeasured seconds at the start of each window (default 8)")
    p.add_argument("--probe-measure-s", type=float, default=20.0,
                   help="with --rates-from probe: measured seconds of each window (default 20)")
    p.add_argument("--tpot-slo-ms", type=float, default=None, help="TPOT SLO of goodput, in ms (default: --tpot-slo-from)")
    p.add_argument("--tpot-slo-from", choices=SLO_SOURCES, default=None,
                   help="run: 1.5 x off's TPOT p50 in this run's low phases; sweep: 1.5 x off's TPOT p50 at "
                        "the lowest concurrency of --rates-from (the default with --rates-from, else run where "
                        "off runs, else 100 ms)")
    p.add_argument("--rounds", type=int, default=1,
                   help="replays of the trace per policy, in mirrored order (default 1)")
    p.add_argument("--spec-steps", type=int, default=None, help="num_steps of 'spec' (default: the ladder's top tier)")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")


SLO_SOURCES = ("run", "sweep")
PROBE = "probe"  # --rates-from probe
LOW_SHARE, HIGH_SHARE = 0.5, 0.9  # low rate: of spec's at the fewest clients; high: of off's at the most
SLO_SCALE = 1.5  # the SLO: off's TPOT p50 at low load, plus 50 %
GOODPUT_AT = (0.75, 1.0, 1.5, 2.0)  # goodput is also given at these multiples of the SLO
OVERLOAD_TTFT_MS = 1000.0  # off's low-phase TTFT p50 past this: the bursts overloaded plain decoding


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    sweep_slo = None
    probing = args.rates_from == PROBE
    if args.rates_from and args.trace not in ("bursty", "diurnal"):
        raise SystemExit("--rates-from sets the rates of a bursty or diurnal trace; a trace file has its own")
    if probing:
        if len(args.probe_concurrency) != 2 or 0 in args.probe_concurrency:
            raise SystemExit(f"--probe-concurrency takes two positive client counts, got {args.probe_concurrency}")
        if args.probe_measure_s <= 0 or args.probe_settle_s < 0:
            raise SystemExit("--probe-measure-s must be > 0 and --probe-settle-s >= 0")
    elif args.rates_from:
        with open(args.rates_from) as f:
            sweep = json.load(f)
        args.low_rate, args.high_rate = rates_from_rows(sweep["rows"])
        sweep_slo = slo_from_sweep(sweep["rows"])
    args.slo_source = slo_source(args.tpot_slo_ms, args.tpot_slo_from, args.policies, sweep_slo)
    if args.slo_source == "sweep":
        args.tpot_slo_ms = sweep_slo
    elif args.slo_source == "default":
        args.tpot_slo_ms = 100.0
    trace = None if probing else load_or_make_trace(args)  # a probe's trace is made once its rates are known
    if trace and args.slo_source == "run" and not any(a["phase"] == "low" for a in trace["arrivals"]):
        raise SystemExit("the SLO of this run is read off off's low phases, and this trace has none: "
                         "give --tpot-slo-ms")
    result = run_against_target(args, lambda target: replay_all(target, trace, args))
    return emit(result, format_table(result), args.out)


# -- traces (pure) -----------------------------------------------------------------------
def slo_source(slo_ms: float | None, source: str | None, policies: list[str], sweep_slo: float | None) -> str:
    """Where the SLO comes from: ``ms`` (given), ``run``, ``sweep`` or ``default`` (100 ms)."""
    if slo_ms is not None:
        if source is not None:
            raise SystemExit("give --tpot-slo-ms or --tpot-slo-from, not both")
        return "ms"
    if source == "run" and "off" not in policies:
        raise SystemExit("--tpot-slo-from run reads off's TPOT in this run: add off to --policies")
    if source == "sweep" and sweep_slo is None:
        raise SystemExit("--tpot-slo-from sweep reads the sweep of --rates-from: give a sweep's JSON file")
    return source or ("sweep" if sweep_slo is not None else "run" if "off" in policies else "default")


def run_slo(off_records: list) -> float | None:
    """1.5 x the TPOT p50 of off's requests in the low phases (None: none of them had a TPOT)."""
    tpots = [r.timing.tpot_s for r in off_records if r.ok and r.phase == "low" and r.timing.tpot_s is not None]
    return round(SLO_SCALE * 1000 * float(np.median(tpots)), 1) if tpots else None


def rates_from_rows(rows: list[dict]) -> tuple[float, float]:
    """(low rate, high rate) from ``bench serve`` rows, a sweep's or a probe's (see the module
    docstring): half of spec's request rate at the lowest concurrency, 0.9 x off's at the highest."""
    lo, hi = min(r["concurrency"] for r in rows), max(r["concurrency"] for r in rows)
    at = {(r["policy"], r["concurrency"]): r for r in rows}
    return round(LOW_SHARE * at["spec", lo]["requests_per_s"], 4), round(HIGH_SHARE * at["off", hi]["requests_per_s"], 4)


def slo_from_sweep(rows: list[dict]) -> float:
    """The sweep's TPOT SLO: 1.5 x off's TPOT p50 at the sweep's lowest concurrency, in ms."""
    lo = min(r["concurrency"] for r in rows)
    off = next(r for r in rows if r["policy"] == "off" and r["concurrency"] == lo)
    return round(SLO_SCALE * off["tpot_p50_ms"], 1)


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


def goodput(records: list, wall_s: float, slo_ms: float) -> float:
    """Tokens/s of the requests that succeeded with a TPOT within ``slo_ms``."""
    return round(sum(r.output_tokens for r in records if r.ok and _meets(r, slo_ms)) / wall_s, 3)


def _meets(r, slo_ms: float) -> bool:
    tpot = r.timing.tpot_s
    return tpot is None or tpot * 1000 <= slo_ms


def policy_stats(records: list, wall_s: float, slo_ms: float) -> dict:
    """Throughput, goodput and latency of one replay (or of rounds pooled), overall and per phase."""
    ok = [r for r in records if r.ok]

    def latency(rs: list) -> dict:
        s = summarize([r.timing for r in rs], wall_s)
        keys = ("num_requests", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
        met = sum(_meets(r, slo_ms) for r in rs)
        return {k: s[k] for k in keys} | {"slo_attainment": round(met / len(rs), 4) if rs else None}

    phases = {name: latency([r for r in ok if r.phase == name]) for name in dict.fromkeys(r.phase for r in records)}
    return latency(ok) | {
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / wall_s, 3),
        "goodput_tokens_per_s": goodput(ok, wall_s, slo_ms),
        "tpot_p50_low_load_ms": phases.get("low", {}).get("tpot_p50_ms"),
        "errors": len(records) - len(ok),
        "wall_s": round(wall_s, 3),
        "phases": phases,
    }


# -- replay ------------------------------------------------------------------------------
@dataclass(slots=True)
class Replay:
    """One replay of the trace under one policy: its records, wall time, switches and timeline."""

    records: list
    wall_s: float
    switches: int | None
    timeline: dict


def pooled_stats(replays: list[Replay], slo_ms: float) -> dict:
    """A policy's figures over its rounds pooled; ``rounds``: each round's own headline figures."""
    records = [r for rp in replays for r in rp.records]
    wall = sum(rp.wall_s for rp in replays)
    stats = policy_stats(records, wall, slo_ms)
    switches = [rp.switches for rp in replays]
    stats["switches"] = None if None in switches else sum(switches)
    stats["goodput_at_slo_x"] = {f"{x:g}": goodput(records, wall, x * slo_ms) for x in GOODPUT_AT}
    stats["rounds"] = []
    for rp in replays:
        s = policy_stats(rp.records, rp.wall_s, slo_ms)
        stats["rounds"].append({k: s[k] for k in ("output_tokens_per_s", "goodput_tokens_per_s", "tpot_p50_ms")}
                               | {"tpot_p50_by_phase_ms": {n: ph["tpot_p50_ms"] for n, ph in s["phases"].items()},
                                  "switches": rp.switches})
    stats["timeline"] = replays[0].timeline
    return stats


async def replay(target: Target, trace: dict, prompts: list[list[dict]], args: argparse.Namespace,
                 bar: tqdm) -> Replay:
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
    timeline = {
        "mode": [[round(t - start, 3), k, round(load, 3)] for t, k, load, *_ in poller.window(start, end + 1)],
        "requests": [[round(r.start - start, 3), r.phase, round(r.timing.ttft_s * 1000, 2),
                      None if r.timing.tpot_s is None else round(r.timing.tpot_s * 1000, 2), r.output_tokens]
                     for r in records if r.ok],
    }
    return Replay(records, end - start, poller.summary(start, end + 1)["switches"], timeline)


async def probe(target: Target, prompts: list[list[dict]], args: argparse.Namespace, spec_steps: int) -> list[dict]:
    """``--rates-from probe``: one window of spec at the fewest clients, one of off at the most."""
    lo, hi = sorted(args.probe_concurrency)
    rows = []
    async with Poller(target) as poller:
        for policy, c in (("spec", lo), ("off", hi)):
            print(f"probe: {policy} at {c} client(s), {args.probe_settle_s:g} s settle + {args.probe_measure_s:g} s",
                  file=sys.stderr)
            await target.apply_policy(policy, spec_steps)
            window = await measure_window(target, poller, prompts, c, args.probe_settle_s, args.probe_measure_s,
                                          args.max_tokens, args.ignore_eos, stagger_s=args.probe_settle_s)
            rows.append({"policy": policy, "concurrency": c} | point_row([window]))
            print(f"probe: {policy} at {c}: {rows[-1]['requests_per_s']} req/s", file=sys.stderr)
    return rows


async def replay_all(target: Target, trace: dict | None, args: argparse.Namespace) -> dict:
    spec_steps, status = await spec_steps_of(target, args.spec_steps)
    top = status["policy"]["tiers"][0]["num_steps"]
    prompts = prompt_messages(args.prompt_set.split(","))
    await asyncio.gather(*(target.chat(i, prompts[i], 8, True) for i in range(2)))  # one-off costs
    probe_rows = None
    if trace is None:
        probe_rows = await probe(target, prompts, args, spec_steps)
        args.low_rate, args.high_rate = rates_from_rows(probe_rows)
        if min(args.low_rate, args.high_rate) <= 0:
            await target.restore(status)
            raise SystemExit(f"the probe completed no request in a window ({probe_rows}): no rates to replay at")
        print(f"probe: rates low {args.low_rate}, high {args.high_rate} req/s", file=sys.stderr)
        trace = load_or_make_trace(args)
    replays: dict[str, list[Replay]] = {p: [] for p in args.policies}
    order = window_order(args.policies, args.rounds)
    n = len(trace["arrivals"])
    with tqdm(total=n * len(order), desc="bench trace", unit="req", file=sys.stderr) as bar:
        for i, policy in enumerate(order):
            bar.set_postfix_str(f"{policy} (round {i // len(args.policies) + 1} of {args.rounds})")
            await target.apply_policy(policy, spec_steps)
            # Start idle; dynamic from its low-load tier, as after a quiet spell.
            idle = (lambda s: s["cluster_queue"] == 0 and all_replicas_at(s, top)) if policy in (
                "dynamic", "two-level") else (
                lambda s: s["cluster_queue"] == 0)
            await target.wait_for(idle, 60)
            replays[policy].append(await replay(target, trace, prompts, args, bar))
    await target.restore(status)
    if args.slo_source == "run":
        args.tpot_slo_ms = run_slo([r for rp in replays["off"] for r in rp.records])
        if args.tpot_slo_ms is None:  # keep the run: its figures under the default SLO
            print("off's low phases gave no TPOT (no request of more than one token): the SLO is 100 ms",
                  file=sys.stderr)
            args.slo_source, args.tpot_slo_ms = "default", 100.0
    policies = {p: pooled_stats(rs, args.tpot_slo_ms) for p, rs in replays.items()}
    return {"meta": meta(args, target, status, spec_steps) | {"tpot_slo_ms": args.tpot_slo_ms,
                                                                "tpot_slo_from": args.slo_source,
                                                                "rounds": args.rounds,
                                                                "rates_from": args.rates_from,
                                                                "off_overloaded": off_overloaded(policies)},
            "trace": trace, "policies": policies} | ({"probe": probe_rows} if probe_rows else {})


def off_overloaded(policies: dict) -> bool | None:
    """Whether plain decoding fell behind the trace: off's requests of the low phases waited more
    than ``OVERLOAD_TTFT_MS`` (p50) for their first token, a backlog of the bursts that outlived
    them (None: off did not run or the trace has no low phase)."""
    low = policies.get("off", {}).get("phases", {}).get("low")
    if not low or low.get("ttft_p50_ms") is None:
        return None
    return low["ttft_p50_ms"] > OVERLOAD_TTFT_MS


def format_table(result: dict) -> str:
    m, tr = result["meta"], result["trace"]
    rounds = m.get("rounds", 1)
    lines = [f"trace {tr['kind']} (seed {tr.get('seed')}), {len(tr['arrivals'])} requests over {tr['duration_s']:.0f}s, "
             f"{rounds} round(s) a policy, TPOT SLO {m['tpot_slo_ms']} ms ({m.get('tpot_slo_from', 'given')}); "
             "latencies in ms",
             *([f"rates low {tr['low_rate']}, high {tr['high_rate']} req/s from this run's probe: "
                + ", ".join(f"{r['policy']} at {r['concurrency']} client(s) {r['requests_per_s']} req/s"
                            for r in result["probe"])] if result.get("probe") else []),
             f"{'policy':>8} {'tok/s':>7} {'goodput':>7} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>8} "
             f"{'tpot p99':>8} {'low tpot50':>10} {'switch':>6} {'err':>4}"]
    for name, s in result["policies"].items():
        lines.append(f"{name:>8} {s['output_tokens_per_s']:>7.1f} {s['goodput_tokens_per_s']:>7.1f} "
                     f"{f(s['ttft_p50_ms'], '9.1f')} {f(s['ttft_p99_ms'], '9.1f')} {f(s['tpot_p50_ms'], '8.1f')} "
                     f"{f(s['tpot_p99_ms'], '8.1f')} {f(s['tpot_p50_low_load_ms'], '10.1f')} "
                     f"{f(s['switches'], '6d')} {s['errors']:>4}")
    xs = list(GOODPUT_AT)
    lines.append("goodput at multiples of the SLO" + (", and each round's goodput" if rounds > 1 else ""))
    lines.append(f"{'policy':>8} " + " ".join(f"{f'{x:g}x':>7}" for x in xs) + ("  rounds" if rounds > 1 else ""))
    for name, s in result["policies"].items():
        at = s.get("goodput_at_slo_x", {})
        row = f"{name:>8} " + " ".join(f(at.get(f"{x:g}"), "7.1f") for x in xs)
        if rounds > 1:
            row += "  " + ", ".join(f"{r['goodput_tokens_per_s']:.1f}" for r in s.get("rounds", []))
        lines.append(row)
    if m.get("off_overloaded"):
        low = result["policies"]["off"]["phases"]["low"]
        lines.append(f"off's low-phase requests waited {low['ttft_p50_ms']:.0f} ms (p50) for their first token: the "
                     "high phases overloaded plain decoding here; rates measured in this hour (--rates-from probe) "
                     "keep the trace near capacity")
    return "\n".join(lines)

