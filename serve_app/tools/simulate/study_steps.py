"""``simulate steps``: the two-level policy against the cluster ladder alone, behind docs/simulation.md.

A workload of request classes (default chat 0.5 at acceptance 0.55, copy-heavy 0.3 at 0.9,
sampled 0.2 at 0.3) on the seed and roofline curves:

- acceptance: off, spec, dynamic (the cluster ladder alone), two-level (the ladder's num_steps is
  the ceiling, each engine picks k under it), two-level with the engine's top as the ceiling,
  and both again on a ladder calibrated for the class mix; over the study's bursty trace (goodput
  also by phase), a sweep of constant loads (goodput of the requests arriving after a warm-up:
  every policy serves the offered load, so tokens/s only tell them apart past saturation) and
  a sweep of closed-loop clients per replica (tokens/s and goodput in a window: throughput at a
  given concurrency);
- off_cost: the bursty trace on the roofline with num_steps 0 in the speculative engine as
  fast as a plain engine, then at SGLang's measured speeds; static off is a plain engine.

Writes ``bench/results/sim_two_level.json`` and ``docs/img/sim_two_level.png``, ``docs/img/sim_off_cost.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from serve_app.control.config import ControllerOptions

from .curves import OFF_COSTS, load_curve, seed_8gpu_pcie
from .policies import curve_policy
from .sim import ClosedLoop, SimOptions, Simulation
from .study import BURST_AT, HIGH, LOW
from .traces import DEFAULT_CLASSES, bursty, parse_classes

KEYS = ("output_tokens_per_s", "goodput_tokens_per_s", "ttft_p99_ms", "tpot_p50_ms", "tpot_p50_low_load_ms",
        "tpot_p50_high_load_ms", "switches", "time_in_mode", "time_in_ceiling", "classes", "requests", "wall_s")
# (label, policy, ceiling, ladder calibrated for the class mix and off_cost)
VARIANTS = {
    "off": ("off", "ladder", False),
    "spec": ("spec", "ladder", False),
    "dynamic": ("dynamic", "ladder", False),
    "two-level": ("two-level", "ladder", False),
    "two-level top": ("two-level", "top", False),
    "dynamic mix-ladder": ("dynamic", "ladder", True),
    "two-level mix-ladder": ("two-level", "ladder", True),
}
SWEEP_VARIANTS = ("off", "dynamic", "two-level", "two-level top", "dynamic mix-ladder")
CLOSED_VARIANTS = ("off", "dynamic", "two-level", "two-level top")
WARMUP_S = 10.0


def good_tokens(sim, mask) -> float:
    """Output tokens of the requests in ``mask`` whose TPOT meets the run's SLO."""
    r = sim.req
    tpot = (r.finish - r.first) / np.maximum(r.output_tokens - 1, 1)
    slo = sim.opts.slo_tpot_s or sim.default_slo_tpot()
    return float(r.output_tokens[mask & np.isfinite(r.finish) & (tpot <= slo)].sum())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--curves", default="seed-8gpu-pcie,h200-8b-roofline",
                   help="presets; seed-8gpu-pcie@A: the seed with acceptance A per draft token assumed")
    p.add_argument("--classes", default=DEFAULT_CLASSES, help="name:share:acceptance,...")
    p.add_argument("--replicas", type=int, default=256)
    p.add_argument("--duration", type=float, default=150.0, help="the bursty trace's seconds")
    p.add_argument("--loads", default="0.1,0.3,0.5,0.7,0.9", help="constant loads of the sweep (of capacity)")
    p.add_argument("--sweep-duration", type=float, default=40.0, help="seconds of each sweep point (10 s warm-up)")
    p.add_argument("--clients", default="1,8,32,128,256", help="closed-loop clients per replica")
    p.add_argument("--off-cost-replicas", type=int, default=64, help="0: no off_cost runs")
    p.add_argument("--dt", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/sim_two_level.json")
    p.add_argument("--img", default="docs/img", help="none: no plots")


def simulate(curve, classes, variant: str, replicas: int, duration: float, low: float, high: float, args,
             off_cost: dict | None = None, clients: int | None = None) -> dict:
    """One run: the bursty trace (low != high), a constant load (low == high: goodput also of
    the arrivals after the warm-up) or ``clients`` closed-loop clients per replica (tokens/s
    and goodput of the requests finished between the warm-up and ``duration``)."""
    policy_name, ceiling, mix = VARIANTS[variant]
    curve.off_cost = dict(off_cost or {})
    spec = max(curve.steps)
    ladder = curve_policy(curve, spec, classes, True) if mix else curve_policy(curve, spec)
    warmup = WARMUP_S
    if clients:  # warm-up and window of several requests' time at this concurrency, plain decoding
        request_s = clients * curve.output_tokens / curve.throughput(clients, 0)
        warmup, window = max(WARMUP_S, 2 * request_s), max(duration - WARMUP_S, 4 * request_s)
        duration = warmup + window
        total = replicas * clients
        workload = ClosedLoop(total, total * (int(3 * duration / request_s) + 4), int(curve.output_tokens))
    else:
        rps = replicas * curve.capacity() / curve.output_tokens
        workload = bursty(rps, duration, curve.output_tokens, args.seed, low=low, high=high, period_s=1e9,
                          burst_s=60, first_burst_s=BURST_AT if high != low else 1e9)
    opts = SimOptions(replicas=replicas, policy=policy_name, spec_steps=spec, dt_s=args.dt, seed=args.seed,
                      classes=classes, ceiling=ceiling, drain_s=duration if clients else 600.0,
                      timeline_s=1.0 if clients else None)
    started = time.perf_counter()
    s = Simulation(curve, workload, ladder, ControllerOptions(report_interval_s=0.25, stale_after_s=1.0), opts).run()
    out = {k: v for k, v in s.summary().items() if k in KEYS}
    out["ladder"] = [[t.below, t.num_steps] for t in ladder.tiers]
    r = s.req
    if clients:  # tokens decoded in the window; goodput: that × the share of good tokens among requests done in it
        done = (r.finish >= warmup) & (r.finish < duration)
        decoded = s.tokens_between(warmup, duration) / window
        share = good_tokens(s, done) / max(float(r.output_tokens[done].sum()), 1.0)
        out["window_s"] = [round(warmup, 1), round(duration, 1)]
        out["window_tokens_per_s"] = round(decoded, 1)
        out["window_goodput_tokens_per_s"] = round(decoded * share, 1)
        out["output_tokens_per_s"], out["goodput_tokens_per_s"] = out["window_tokens_per_s"], out[
            "window_goodput_tokens_per_s"]
    elif high == low:
        out["steady_goodput_tokens_per_s"] = round(good_tokens(s, r.arrival >= WARMUP_S) / (duration - WARMUP_S), 1)
    else:
        spans = {"low": (0.0, BURST_AT), "burst_first_10s": (BURST_AT, BURST_AT + 10),
                 "burst_rest": (BURST_AT + 10, BURST_AT + 60), "after": (BURST_AT + 60, duration)}
        out["good_tokens_by_phase"] = {
            k: [good_tokens(s, (r.arrival >= a) & (r.arrival < b)), float(r.output_tokens[(r.arrival >= a) & (r.arrival < b)].sum())]
            for k, (a, b) in spans.items()}
    print(f"{curve.name:16s} {replicas:4d} {f'clients {clients}' if clients else f'load {low}/{high}'} off_cost {curve.off_cost or 1.0} {variant:20s} "
          f"tok/s/replica {out['output_tokens_per_s'] / replicas:8.0f} goodput {out['goodput_tokens_per_s'] / replicas:8.0f} "
          f"TPOT p50 {out['tpot_p50_ms']} TTFT p99 {out['ttft_p99_ms']} ({time.perf_counter() - started:.1f} s)",
          flush=True)
    return out


def run(args: argparse.Namespace) -> int:
    classes = parse_classes(args.classes)
    results: dict = {"meta": {
        "command": "python -m serve_app.tools.simulate steps",
        "classes": [c.__dict__ for c in classes],
        "replicas": args.replicas, "duration_s": args.duration, "sweep_duration_s": args.sweep_duration,
        "dt_s": args.dt, "bursty": {"low": LOW, "high": HIGH, "burst_at_s": BURST_AT, "burst_s": 60},
        "variants": {k: dict(zip(("policy", "ceiling", "ladder_for_mix"), v, strict=True)) for k, v in VARIANTS.items()},
    }, "curves": {}}
    n = args.replicas
    for name in args.curves.split(","):
        curve = seed_8gpu_pcie(float(name.split("@")[1])) if name.startswith("seed-8gpu-pcie@") else load_curve(name)
        results["curves"][name] = {
            "curve": curve.describe(),
            "bursty": {v: simulate(curve, classes, v, n, args.duration, LOW, HIGH, args) for v in VARIANTS},
            "sweep": {str(x): {v: simulate(curve, classes, v, n, args.sweep_duration, x, x, args) for v in SWEEP_VARIANTS}
                      for x in (float(s) for s in args.loads.split(","))},
            "closed": {str(c): {v: simulate(curve, classes, v, n, args.sweep_duration, 0, 0, args, clients=c)
                                for v in CLOSED_VARIANTS}
                       for c in (int(s) for s in args.clients.split(","))},
        }
    m = args.off_cost_replicas
    if m:
        off_cost_runs(results, classes, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print("\n".join(tables(results)))
    if args.img != "none":
        plot(results, Path(args.img))
    return 0


def _ratio(x: float, base: float, digits: int = 2) -> str:
    return f"{x / base:.{digits}f}" if base >= 1.0 else "–"


def tables(results: dict) -> list[str]:
    """The comparison tables of docs/simulation.md, in markdown; goodput and tokens/s per replica."""
    n = results["meta"]["replicas"]
    lines = []
    for name, r in results["curves"].items():
        b, dyn = r["bursty"], r["bursty"]["dynamic"]
        lines += [f"\n{name}, {n} replicas, bursty trace", "",
                  "| policy | goodput tok/s | / dynamic | goodput low / burst (share of tokens) | tok/s | / dynamic | "
                  "TPOT p50 low / high ms | TTFT p99 ms | time in k |", "|---|---|---|---|---|---|---|---|---|"]
        for v, x in b.items():
            ph = x["good_tokens_by_phase"]
            low = (ph["low"][0] + ph["after"][0]) / max(ph["low"][1] + ph["after"][1], 1)
            burst = (ph["burst_first_10s"][0] + ph["burst_rest"][0]) / max(ph["burst_first_10s"][1] + ph["burst_rest"][1], 1)
            modes = ", ".join(f"{k}: {t:.2f}" for k, t in x["time_in_mode"].items() if t >= 0.01)
            lines.append(
                f"| {v} | {x['goodput_tokens_per_s'] / n:,.0f} | {x['goodput_tokens_per_s'] / max(dyn['goodput_tokens_per_s'], 1e-9):.3f} "
                f"| {low:.2f} / {burst:.2f} | {x['output_tokens_per_s'] / n:,.0f} "
                f"| {x['output_tokens_per_s'] / max(dyn['output_tokens_per_s'], 1e-9):.3f} "
                f"| {x['tpot_p50_low_load_ms']} / {x['tpot_p50_high_load_ms']} | {x['ttft_p99_ms']:,.0f} | {modes} |")
        sweep = r["sweep"]
        variants = list(next(iter(sweep.values())))
        lines += [f"\n{name}, {n} replicas, constant load: goodput of arrivals after {WARMUP_S:.0f} s, "
                  "tok/s per replica (/ dynamic's)", "", "| load | " + " | ".join(variants) + " |",
                  "|---" * (len(variants) + 1) + "|"]
        for x, row in sweep.items():
            d = row["dynamic"]["steady_goodput_tokens_per_s"]
            lines.append(f"| {x} | " + " | ".join(
                f"{row[v]['steady_goodput_tokens_per_s'] / n:,.0f} ({_ratio(row[v]['steady_goodput_tokens_per_s'], d)})"
                for v in variants) + " |")
        closed = r["closed"]
        variants = list(next(iter(closed.values())))
        lines += [f"\n{name}, {n} replicas, closed loop: tok/s and goodput per replica in the window (/ dynamic's)",
                  "", "| clients per replica | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
        for c, row in closed.items():
            dt, dg = (row["dynamic"][k] for k in ("window_tokens_per_s", "window_goodput_tokens_per_s"))
            lines.append(f"| {c} | " + " | ".join(
                f"{row[v]['window_tokens_per_s'] / n:,.0f} ({_ratio(row[v]['window_tokens_per_s'], dt, 3)}); "
                f"{row[v]['window_goodput_tokens_per_s'] / n:,.0f} ({_ratio(row[v]['window_goodput_tokens_per_s'], dg)})"
                for v in variants) + " |")
    if "off_cost" in results:
        oc = results["off_cost"]
        m, off = oc["replicas"], oc["runs"]["off"]
        lines += [f"\noff_cost, h200-8b-roofline, {m} replicas, bursty trace: goodput per replica (/ static off's); "
                  "tok/s (/ static off's); TTFT p99 s", "",
                  f"static off (plain engine): {off['goodput_tokens_per_s'] / m:,.0f}; {off['output_tokens_per_s'] / m:,.0f}; "
                  f"{off['ttft_p99_ms'] / 1000:.1f}", ""]
        variants = list(oc["runs"][next(iter(oc["costs"]))])
        lines += ["| off_cost | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
        for cost in oc["costs"]:
            row = oc["runs"][cost]
            lines.append(f"| {cost} | " + " | ".join(
                f"{row[v]['goodput_tokens_per_s'] / m:,.0f} ({row[v]['goodput_tokens_per_s'] / off['goodput_tokens_per_s']:.2f}); "
                f"{row[v]['output_tokens_per_s'] / m:,.0f} ({row[v]['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}); "
                f"{row[v]['ttft_p99_ms'] / 1000:.1f}" for v in variants) + " |")
    return lines


def off_cost_runs(results: dict, classes, args) -> None:
    roof = load_curve("h200-8b-roofline")
    m = args.off_cost_replicas
    results["off_cost"] = {"replicas": m, "costs": {k: OFF_COSTS[k] for k in OFF_COSTS}, "runs": {}}
    results["off_cost"]["runs"]["off"] = simulate(roof, classes, "off", m, args.duration, LOW, HIGH, args)
    for cost in OFF_COSTS:
        results["off_cost"]["runs"][cost] = {
            v: simulate(roof, classes, v, m, args.duration, LOW, HIGH, args, OFF_COSTS[cost])
            for v in ("dynamic", "two-level", "dynamic mix-ladder", "two-level mix-ladder")
        }


def plot(results: dict, img: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    curves = list(results["curves"])
    fig, axes = plt.subplots(2, len(curves) + 1, figsize=(5 * (len(curves) + 1), 7.2))
    for i, name in enumerate(curves):
        sweep = results["curves"][name]["sweep"]
        closed = results["curves"][name]["closed"]
        ax = axes[0, i]
        for v in SWEEP_VARIANTS[1:]:
            ratio = [sweep[x][v]["steady_goodput_tokens_per_s"]
                     / max(sweep[x]["dynamic"]["steady_goodput_tokens_per_s"], 1e-9) for x in sweep]
            ax.plot([float(x) for x in sweep], ratio, "o-", label=v)
        ax.set_title(f"{name}: goodput / dynamic's", fontsize=9)
        ax.set_xlabel("constant load (of capacity), arrivals after 10 s")
        ax.legend(fontsize=7)
        ax = axes[1, i]
        for v in CLOSED_VARIANTS[1:]:
            for key, style in (("window_tokens_per_s", "o-"), ("window_goodput_tokens_per_s", "s--")):
                base = [closed[c]["dynamic"][key] for c in closed]  # no ratio where dynamic has ~nothing
                ratio = [closed[c][v][key] / b if b >= 1.0 else np.nan for c, b in zip(closed, base, strict=True)]
                ax.plot([int(c) for c in closed], ratio, style, label=f"{v}, {key.split('_')[1]}")
        ax.set_xscale("log")
        ax.set_title(f"{name}: closed loop, / dynamic's", fontsize=9)
        ax.set_xlabel("clients per replica")
        ax.legend(fontsize=7)
    axes[1, -1].axis("off")
    for ax in [*axes[0], *axes[1, :-1]]:
        ax.axhline(1.05, color="grey", ls=":", lw=1)
    ax = axes[0, -1]
    labels = list(VARIANTS)
    for i, name in enumerate(curves):
        b = results["curves"][name]["bursty"]
        ax.bar([j + (i - 0.5) * 0.4 for j in range(len(labels))],
               [b[v]["goodput_tokens_per_s"] / max(b["dynamic"]["goodput_tokens_per_s"], 1e-9) for v in labels],
               0.4, label=name)
    ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=8)
    ax.set_title("bursty trace: goodput / dynamic's")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(img / "sim_two_level.png", dpi=110)
    plt.close(fig)

    runs = results["off_cost"]["runs"]
    off = runs["off"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    costs = list(OFF_COSTS)
    variants = list(runs[costs[0]])
    for key, ax, title in (("goodput_tokens_per_s", axes[0], "goodput / static off's (plain engine)"),
                           ("output_tokens_per_s", axes[1], "tokens/s / static off's")):
        for i, v in enumerate(variants):
            ax.bar([j + (i - 1.5) * 0.2 for j in range(len(costs))],
                   [runs[c][v][key] / max(off[key], 1e-9) for c in costs], 0.2, label=v)
        ax.axhline(1.0, color="grey", ls=":", lw=1)
        ax.set_xticks(range(len(costs)), costs, fontsize=8)
        ax.set_xlabel("off_cost")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(img / "sim_off_cost.png", dpi=110)
    plt.close(fig)
