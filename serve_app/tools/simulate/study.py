"""``simulate study``: the runs and plots behind docs/simulation.md.

One short bursty trace (low load 0.1 of capacity, one burst at 0.7 from 40 s to 100 s whose
first 5 s reach a quarter of the replicas only) on a preset curve; the ladder calibrated from the curve:

- scale: spec / off / dynamic at 8, 64 and 256 replicas;
- sensitivity: dynamic at 64 replicas, report interval 0.05–5 s, then broadcast delay 0.01–5 s
  (with and without the mode riding on the answers to load reports);
- cluster-wide decision vs each replica deciding alone, at 64 replicas.

Writes ``bench/results/sim_study.json`` and ``docs/img/sim_*.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from serve_app.control.config import ControllerOptions

from .curves import PRESETS, load_curve
from .policies import curve_policy
from .sim import SimOptions, Simulation
from .traces import bursty

KEYS = (
    "output_tokens_per_s",
    "goodput_tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "tpot_p50_low_load_ms",
    "tpot_p50_high_load_ms",
    "switches",
    "time_in_mode",
    "requests",
    "wall_s",
)


LOW, HIGH, BURST_AT = 0.1, 0.7, 40.0


def reaction(sim) -> float | None:
    """Seconds from the burst's start to the first switch after it (any replica, when alone)."""
    control = sim.control
    loops = [control.loop] if hasattr(control, "loop") else getattr(control, "loops", [])
    times = [e.time for lp in loops for e in lp.events if e.time >= BURST_AT]
    return round(min(times) - BURST_AT, 3) if times else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--curves", default="h200-8b-roofline", choices=list(PRESETS))
    p.add_argument("--duration", type=float, default=150.0)
    p.add_argument("--replicas", default="8,64,256")
    p.add_argument("--dt", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/sim_study.json")
    p.add_argument("--img", default="docs/img")


def run(args: argparse.Namespace) -> int:
    curve = load_curve(args.curves)
    policy = curve_policy(curve)
    spec = policy.spec_steps
    results: dict = {
        "meta": {
            "curve": curve.describe(),
            "policy": policy.model_dump(),
            "duration_s": args.duration,
            "dt_s": args.dt,
            "command": f"python -m serve_app.tools.simulate study --curves {args.curves}",
        }
    }

    def sim(replicas, name, interval=0.25, broadcast=0.01, timeline=False, answers=True):
        rps = replicas * curve.capacity() / curve.output_tokens
        trace = bursty(
            rps,
            args.duration,
            curve.output_tokens,
            args.seed,
            low=LOW,
            high=HIGH,
            period_s=1e9,
            burst_s=60,
            first_burst_s=BURST_AT,
        )
        options = ControllerOptions(report_interval_s=interval, stale_after_s=max(1.0, 4 * interval))
        opts = SimOptions(
            replicas=replicas,
            policy=name,
            spec_steps=spec,
            dt_s=min(args.dt, interval / 2),
            broadcast_delay_s=broadcast,
            report_answers=answers,
            seed=args.seed,
            timeline_s=1.0 if timeline else None,
        )
        started = time.perf_counter()
        s = Simulation(curve, trace, policy, options, opts).run()
        out = {k: s.summary().get(k) for k in KEYS}
        out["reaction_s"] = reaction(s)
        if timeline:
            out["timeline"] = [[round(x, 3) for x in row] for row in s.timeline]
        print(
            f"{replicas:4d} {name:8s} interval {interval:5.2f} broadcast {broadcast:5.2f}: "
            f"tok/s {out['output_tokens_per_s']:.0f} goodput {out['goodput_tokens_per_s']:.0f} "
            f"TPOT p50 low/high {out['tpot_p50_low_load_ms']}/{out['tpot_p50_high_load_ms']} ms "
            f"TTFT p99 {out['ttft_p99_ms']} ms switches {out['switches']} reaction {out['reaction_s']} s "
            f"({out['requests']} requests, {time.perf_counter() - started:.1f} s)",
            flush=True,
        )
        return out

    results["scale"] = {
        str(n): {p: sim(n, p, timeline=(n == 64)) for p in ("spec", "off", "dynamic")}
        for n in [int(x) for x in args.replicas.split(",")]
    }
    results["report_interval"] = {str(i): sim(64, "dynamic", interval=i) for i in (0.05, 0.25, 1.0, 2.0, 5.0)}
    results["broadcast_delay"] = {str(b): sim(64, "dynamic", broadcast=b) for b in (0.01, 0.5, 2.0, 5.0)}
    results["broadcast_only"] = {str(b): sim(64, "dynamic", broadcast=b, answers=False) for b in (0.01, 0.5, 2.0, 5.0)}
    results["local"] = {
        "cluster": results["scale"].get("64", {}).get("dynamic") or sim(64, "dynamic"),
        "local": sim(64, "local"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    plot(results, Path(args.img))
    return 0


def plot(results: dict, img: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    policies = ("spec", "off", "dynamic")

    # scale: goodput and TPOT p50 per policy and cluster size
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    sizes = list(results["scale"])
    for i, p in enumerate(policies):
        xs = [j + (i - 1) * 0.27 for j in range(len(sizes))]
        rows = [results["scale"][n][p] for n in sizes]
        axes[0].bar(xs, [r["goodput_tokens_per_s"] / int(n) for r, n in zip(rows, sizes, strict=True)], 0.27, label=p)
        axes[1].bar(xs, [r["tpot_p50_low_load_ms"] for r in rows], 0.27, label=p)
        axes[2].bar(xs, [r["ttft_p99_ms"] / 1000 for r in rows], 0.27, label=p)
    for ax, title in zip(axes, ("goodput per replica (tok/s)", "TPOT p50, low load (ms)", "TTFT p99 (s)"), strict=True):
        ax.set_xticks(range(len(sizes)), [f"{n} replicas" for n in sizes])
        ax.set_title(title)
    axes[2].set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(img / "sim_scale.png", dpi=110)
    plt.close(fig)

    if "64" not in results["scale"]:
        return
    # timeline at 64 replicas
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    for p in policies:
        tl = results["scale"]["64"][p]["timeline"]
        t = [r[0] for r in tl]
        axes[0].plot(t, [r[1] for r in tl], label=p)
        axes[1].plot(t, [r[2] for r in tl], label=p)
        axes[2].plot(t, [r[3] / 64 for r in tl], label=p)
    axes[0].set_ylabel("queue per replica")
    axes[1].set_ylabel("mean num_steps")
    axes[2].set_ylabel("tok/s per replica")
    axes[2].set_xlabel("time (s)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(img / "sim_timeline.png", dpi=110)
    plt.close(fig)

    # sensitivity
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, key, label in (
        (axes[0], "report_interval", "report interval (s)"),
        (axes[1], "broadcast_only", "broadcast delay (s), no mode in report answers"),
    ):
        xs = [float(x) for x in results[key]]
        rows = list(results[key].values())
        ax.plot(xs, [r["goodput_tokens_per_s"] / 64 for r in rows], "o-", label="goodput / replica (tok/s)")
        ax.set_ylim(bottom=0)
        twin = ax.twinx()
        twin.plot(xs, [r["ttft_p99_ms"] / 1000 for r in rows], "s--", color="tab:orange", label="TTFT p99 (s)")
        twin.set_ylim(bottom=0)
        twin.set_ylabel("TTFT p99 (s)")
        ax.set_ylabel("goodput / replica (tok/s)")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        for x, r in zip(xs, rows, strict=True):
            ax.annotate(f"{r['switches']} sw", (x, r["goodput_tokens_per_s"] / 64), fontsize=8)
    fig.tight_layout()
    fig.savefig(img / "sim_sensitivity.png", dpi=110)
    plt.close(fig)
