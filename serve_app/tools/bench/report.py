"""``bench report``: the serving benchmarks' results as markdown and PNG plots.

Reads a ``bench serve`` result (``--sweep``) and a ``bench trace`` result (``--trace``),
either may be missing, and writes into ``--out-dir``: ``report.md`` (tables, the acceptance
checks, and why a point falls short), ``serve_sweep.png`` (tokens/s against concurrency per
policy, dynamic / best static marked at each point) and ``serve_trace.png`` (the trace's
timeline: load, mode and per-request TPOT per policy, low/high phases shaded).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .serve import ratios as sweep_ratios

HELP = "markdown and PNG plots from bench serve / bench trace results"
COLORS = {"spec": "tab:orange", "off": "tab:blue", "dynamic": "tab:green"}
SWEEP_RATIO_TARGET = 0.95  # dynamic / max(spec, off) at every concurrency
LOW_TPOT_TOLERANCE = 1.10  # dynamic's low-load TPOT p50 / spec's


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sweep", default="bench/results/serve_sweep.json", help="bench serve result")
    p.add_argument("--trace", default="bench/results/serve_trace.json", help="bench trace result")
    p.add_argument("--calibration", default="bench/results/calibration.json",
                   help="calibrate --results JSON: cited where dynamic ran the ladder's mode and fell short")
    p.add_argument("--out-dir", default="bench/results", help="where report.md and the PNGs go")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = ["# specserve serving benchmarks", ""]
    calibration = json.loads(Path(args.calibration).read_text()) if Path(args.calibration).is_file() else None
    for path, section in ((args.sweep, lambda r, o: sweep_section(r, o, calibration)), (args.trace, trace_section)):
        if Path(path).is_file():
            parts += section(json.loads(Path(path).read_text()), out)
        else:
            parts += [f"_{path}: not found, section skipped._", ""]
    (out / "report.md").write_text("\n".join(parts))
    print("\n".join(parts))
    print(f"wrote {out / 'report.md'}")
    return 0


def _f(v, spec: str = ".1f") -> str:
    return "–" if v is None else format(v, spec)


# -- the sweep ---------------------------------------------------------------------------
def calibration_note(calibration: dict | None, load: float | None, ran: str, want: str) -> str:
    """What the calibration measured for the two modes at the calibrated load nearest ``load``
    (within half a request per replica), or ''."""
    if not calibration or load is None:
        return ""
    at = {(str(r["num_steps"]), float(r["load_per_replica"])): r["output_tokens_per_s"]
          for r in calibration.get("measurements", {}).get("rows", [])}
    loads = sorted({load_ for _, load_ in at})
    near = min(loads, key=lambda x: abs(x - load), default=None)
    if near is None or abs(near - load) > 0.5 or not at.get((ran, near)) or not at.get((want, near)):
        return ""
    return (f"; the calibration measured num_steps {ran} at {at[ran, near] / at[want, near]:.2f}x num_steps {want} "
            f"at load {near:g}, which is why the ladder runs {ran} there: the two runs disagree on the faster mode")


def why_short(rows: list[dict], c: int, best: str, calibration: dict | None = None) -> str:
    """A reason for a dynamic point under target, from what the controller did in the window
    (and, where dynamic ran the ladder's mode, what the calibration measured at that load)."""
    dyn = next(r for r in rows if r["policy"] == "dynamic" and r["concurrency"] == c)
    static = next(r for r in rows if r["policy"] == best and r["concurrency"] == c)
    want = max(static["mode_share"], key=static["mode_share"].get) if static["mode_share"] else "?"
    share = dyn["mode_share"].get(want, 0.0)
    if dyn["switches"]:
        return f"dynamic switched {dyn['switches']}x in the window; {share:.0%} of it at num_steps {want} ({best}'s mode)"
    if share < 0.9:
        ran = max(dyn["mode_share"], key=dyn["mode_share"].get) if dyn["mode_share"] else "?"
        twin = next((r for r in rows if r["concurrency"] == c and r["policy"] in ("spec", "off")
                     and r["policy"] != best and r["mode_share"].get(ran, 0.0) >= 0.9), None)
        if twin and twin["output_tokens_per_s"] >= SWEEP_RATIO_TARGET * static["output_tokens_per_s"]:
            return (f"dynamic ran {twin['policy']}'s mode (num_steps {ran}), itself "
                    f"{twin['output_tokens_per_s'] / static['output_tokens_per_s']:.2f} of {best} here; dynamic "
                    f"measured {dyn['output_tokens_per_s'] / twin['output_tokens_per_s']:.2f} of {twin['policy']} "
                    "in the same mode: run-to-run spread")
        return (f"dynamic ran num_steps {dyn['mode_share']} at load {_f(dyn['mean_load_per_replica'])}/replica, "
                f"{best} (num_steps {want}) was faster here: the ladder's boundary is off for this load"
                + calibration_note(calibration, dyn["mean_load_per_replica"], ran, want))
    return "same mode as the best static policy the whole window: run-to-run noise"


def sweep_section(result: dict, out: Path, calibration: dict | None = None) -> list[str]:
    rows, m = result["rows"], result["meta"]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    at = {(r["policy"], r["concurrency"]): r for r in rows}
    ratios = {x["concurrency"]: x for x in sweep_ratios(rows)}  # recomputed: older results gain the interval
    lines = ["## Concurrency sweep (`bench serve`)", "",
             f"{m['model']}, {m['replicas']} replicas, spec = {m['spec_steps']} steps, prompts `{m['prompt_set']}`, "
             f"max_tokens {m['max_tokens']}, {rows[0]['settle_s']:g} s settle + {rows[0]['measure_s']:g} s measured "
             f"per window, {rows[0].get('windows', 1)} window(s) per policy and concurrency; policies run back to back "
             f"at each concurrency (repeats in mirrored order). Command: `{m['command']}` ({m['date']}).", "",
             "| concurrency | " + " | ".join(f"{p} tok/s" for p in policies)
             + " | dynamic / best static | 95 % interval (paired windows) | ≥ 0.95 |",
             "|---:|" + "---:|" * len(policies) + "---:|---:|:---:|"]
    short = []
    for c in dict.fromkeys(r["concurrency"] for r in rows):
        x = ratios.get(c)
        ok = x is not None and x["dynamic_over_best_static"] >= SWEEP_RATIO_TARGET
        if x is not None and not ok:
            short.append(f"- c={c}: {x['dynamic_over_best_static']:.2f} of {x['best_static']}: "
                         f"{why_short(rows, c, x['best_static'], calibration)}")
        cells = " | ".join(_f(at[p, c]["output_tokens_per_s"]) if (p, c) in at else "–" for p in policies)
        ratio = f"{x['dynamic_over_best_static']:.2f} ({x['best_static']})" if x else "–"
        ci = x and x["dynamic_over_best_static_ci95"]
        interval = f"{ci[0]:.3f}–{ci[1]:.3f}" if ci else "–"
        lines.append(f"| {c} | {cells} | {ratio} | {interval} | {'yes' if ok else 'no' if x else '–'} |")
    lines += ["", "Latency (ms), p50 / p99:", "",
              "| concurrency | policy | TTFT | TPOT | switches | modes (share of window) | tok/s per window |",
              "|---:|---|---:|---:|---:|---|---|"]
    for r in rows:
        per_window = ", ".join(_f(v) for v in r.get("window_tokens_per_s", [r["output_tokens_per_s"]]))
        lines.append(f"| {r['concurrency']} | {r['policy']} | {_f(r['ttft_p50_ms'])} / {_f(r['ttft_p99_ms'])} | "
                     f"{_f(r['tpot_p50_ms'])} / {_f(r['tpot_p99_ms'])} | {_f(r['switches'], 'd')} | {r['mode_share']} "
                     f"| {per_window} |")
    lines += ["", "Points under 0.95:" if short else "Every point reaches 0.95 of the best static policy.", *short, ""]
    plot_sweep(result, out / "serve_sweep.png")
    return lines + ["![tokens/s against concurrency](serve_sweep.png)", ""]


def plot_sweep(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for p in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["concurrency"], r["output_tokens_per_s"]) for r in rows if r["policy"] == p)
        ax.plot(*zip(*pts, strict=True), marker="o", label=p, color=COLORS.get(p))
    dyn = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["policy"] == "dynamic"}
    for x in result["ratios"]:
        ok = x["dynamic_over_best_static"] >= SWEEP_RATIO_TARGET
        ax.annotate(f"{x['dynamic_over_best_static']:.2f}", (x["concurrency"], dyn[x["concurrency"]]),
                    textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8,
                    color="black" if ok else "red")
    ax.set_xscale("log", base=2)
    concurrencies = sorted({r["concurrency"] for r in rows})
    ax.set_xticks(concurrencies, labels=[str(c) for c in concurrencies])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens/s")
    m = result["meta"]
    ax.set_title(f"{m['model']}, {m['replicas']} replicas: labels = dynamic / best static")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the trace ---------------------------------------------------------------------------
def trace_section(result: dict, out: Path) -> list[str]:
    m, tr, pol = result["meta"], result["trace"], result["policies"]
    lines = ["## Load trace (`bench trace`)", "",
             f"{tr['kind']} trace, seed {tr.get('seed')}, {len(tr['arrivals'])} requests over {tr['duration_s']:g} s "
             f"(low {tr.get('low_rate')} req/s, high {tr.get('high_rate')} req/s{_rates_from(m)}), "
             f"{m.get('rounds', 1)} replay(s) a policy, open loop; goodput = tokens/s of "
             f"requests with TPOT ≤ {m['tpot_slo_ms']} ms. Command: `{m['command']}` ({m['date']}).", "",
             "| policy | tok/s | goodput tok/s | TTFT p50 / p99 | TPOT p50 / p99 | low-load TPOT p50 | "
             "high-load TPOT p50 | switches |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in pol.items():
        high = s["phases"].get("high", {}).get("tpot_p50_ms")
        lines.append(f"| {name} | {_f(s['output_tokens_per_s'])} | {_f(s['goodput_tokens_per_s'])} | "
                     f"{_f(s['ttft_p50_ms'])} / {_f(s['ttft_p99_ms'])} | {_f(s['tpot_p50_ms'])} / "
                     f"{_f(s['tpot_p99_ms'])} | {_f(s['tpot_p50_low_load_ms'])} | {_f(high)} | {_f(s['switches'], 'd')} |")
    lines += ["", *trace_checks(pol), "", "![load, mode and TPOT over the trace](serve_trace.png)", ""]
    plot_trace(result, out / "serve_trace.png")
    return lines


def _rates_from(m: dict) -> str:
    src = m.get("rates_from")
    return "" if not src else " from this run's probe" if src == "probe" else f" from `{src}`"


def trace_checks(pol: dict) -> list[str]:
    if not {"spec", "off", "dynamic"} <= pol.keys():
        return ["(acceptance checks need all three policies)"]
    d, s, o = pol["dynamic"], pol["spec"], pol["off"]
    good = d["goodput_tokens_per_s"] >= max(s["goodput_tokens_per_s"], o["goodput_tokens_per_s"])
    low = (d["tpot_p50_low_load_ms"] / s["tpot_p50_low_load_ms"]
           if d["tpot_p50_low_load_ms"] and s["tpot_p50_low_load_ms"] else None)
    return [f"- dynamic's goodput ≥ both static policies: {'yes' if good else 'no'} "
            f"({_f(d['goodput_tokens_per_s'])} vs spec {_f(s['goodput_tokens_per_s'])}, off {_f(o['goodput_tokens_per_s'])})"
            + ("" if good else one_mode_note(pol)),
            f"- dynamic's low-load TPOT p50 within 10% of spec: "
            f"{'–' if low is None else ('yes' if low <= LOW_TPOT_TOLERANCE else 'no')} (ratio {_f(low, '.3f')})"]


def one_mode_note(pol: dict) -> str:
    """Where dynamic never switched: the one mode it ran and the static policy that runs it."""
    def modes(p: dict) -> set[int]:
        return {int(m[1]) for m in (p.get("timeline") or {}).get("mode", [])}

    ran = modes(pol["dynamic"])
    if pol["dynamic"].get("switches") or len(ran) != 1:
        return ""
    k = next(iter(ran))
    same = "off" if k == 0 else "spec"
    static = modes(pol[same])
    if static and static != {k}:
        return ""
    return (f"; dynamic did not switch: it ran num_steps {k} throughout, as static {same} does, so the gap to "
            f"{same} is the spread between two runs of one mode, not the policy's doing")


def plot_trace(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_load, ax_mode, ax_tpot) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for phase in result["trace"]["phases"]:
        if phase["name"] == "high":
            for ax in (ax_load, ax_mode, ax_tpot):
                ax.axvspan(phase["start"], phase["end"], color="0.92", zorder=0)
    for name, s in result["policies"].items():
        mode = s["timeline"]["mode"]
        color = COLORS.get(name)
        if mode:
            t, k, load = zip(*mode, strict=True)
            ax_load.plot(t, load, color=color, label=name, lw=1)
            ax_mode.step(t, k, where="post", color=color, label=name, lw=1.2)
        reqs = [(r[0], r[3]) for r in s["timeline"]["requests"] if r[3] is not None]
        if reqs:
            ax_tpot.scatter(*zip(*reqs, strict=True), s=6, color=color, label=name, alpha=0.6)
    slo = result["meta"]["tpot_slo_ms"]
    ax_tpot.axhline(slo, color="red", lw=0.8, ls="--", label=f"SLO {slo:g} ms")
    ax_load.set_ylabel("load / replica")
    ax_mode.set_ylabel("num_steps")
    ax_tpot.set_ylabel("TPOT ms (by arrival)")
    ax_tpot.set_xlabel("seconds into the trace (high-load phases shaded)")
    for ax in (ax_load, ax_mode, ax_tpot):
        ax.grid(alpha=0.3)
    ax_load.legend(loc="upper right", fontsize=8)
    ax_tpot.legend(loc="upper right", fontsize=8)
    fig.suptitle(f"{result['trace']['kind']} trace: load, mode and TPOT per policy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
