"""``python -m serve_app.tools.simulate``: run the cluster simulation; ``validate``, ``study``, ``steps`` and ``bound`` subcommands.

    python -m serve_app.tools.simulate --curves h200-8b-roofline --replicas 64 --trace bursty \\
        --policy spec,off,dynamic --out bench/results/sim_run.json
    python -m serve_app.tools.simulate validate --curves bench/results/engine_cpu_eagle_t1.json \\
        --serve bench/results/serve_sweep.json
    python -m serve_app.tools.simulate study          # the runs and plots of docs/simulation.md
    python -m serve_app.tools.simulate --curves h200-8b-roofline --replicas 64 --policy dynamic,two-level \
        --classes chat:0.5:0.55,copy:0.3:0.9,sampled:0.2:0.3 --off-cost sglang-h200
    python -m serve_app.tools.simulate steps          # the two-level study of docs/simulation.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from serve_app.control.config import ControllerOptions, PolicyConfig

from .curves import OFF_COSTS, PRESETS, Curve, load_curve, parse_off_cost
from .policies import curve_policy, load_policy
from .sim import POLICIES, SimOptions, Simulation
from .traces import make_trace, parse_classes


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--curves", required=True, help=f"engine bench JSON or a preset: {', '.join(PRESETS)}")
    p.add_argument("--prompt-set", default=None, help="prompt set of a bench JSON (default: its first)")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--trace", default="bursty", help="bursty | diurnal | FILE (.json or .csv with arrival_s)")
    p.add_argument("--duration", type=float, default=600.0, help="trace seconds (bursty/diurnal)")
    p.add_argument("--load", type=float, default=None, help="scale of the trace's rate (1 = as defined)")
    p.add_argument("--policy", default="spec,off,dynamic", help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument(
        "--policy-config",
        default=None,
        help="YAML/JSON: a serve config, AppArgs or bare PolicyConfig (default: calibrated from the curve)",
    )
    p.add_argument("--spec-steps", type=int, default=None, help="num_steps of 'spec' (default: top tier)")
    p.add_argument(
        "--classes",
        default=None,
        help="request classes name:share:acceptance,... (e.g. chat:0.5:0.55,copy:0.3:0.9,sampled:0.2:0.3; "
        "default: one class accepting as the curve)",
    )
    p.add_argument(
        "--off-cost",
        default=None,
        help=f"speed of num_steps 0 in a speculative engine over a plain one: {', '.join(OFF_COSTS)}, a number, "
        "or batch:ratio,... (default: the curve's, 1.0 for every preset)",
    )
    p.add_argument("--ceiling", default="ladder", choices=("ladder", "top"), help="two-level: the ceiling")
    p.add_argument(
        "--ladder-for-classes",
        action="store_true",
        help="calibrate the ladder for the class mix and the off_cost (default: for the curve's own acceptance)",
    )
    p.add_argument("--report-interval", type=float, default=None, help="seconds (default 0.25)")
    p.add_argument("--stale-after", type=float, default=None, help="seconds (default max(1, 4 × interval))")
    p.add_argument("--report-delay", type=float, default=0.005, help="report transit seconds")
    p.add_argument("--broadcast-delay", type=float, default=0.01, help="mode broadcast seconds (±50%% jitter)")
    p.add_argument(
        "--no-report-answers",
        action="store_true",
        help="modes reach replicas by broadcast only, not also by the answers to their reports",
    )
    p.add_argument("--max-running", type=int, default=None, help="slots per replica (default: the curve's)")
    p.add_argument("--dt", type=float, default=0.02, help="time step, seconds")
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON")


def setup(args) -> tuple[Curve, PolicyConfig, ControllerOptions]:
    curve = load_curve(args.curves, args.prompt_set, args.max_running)
    if args.off_cost:
        curve.off_cost = parse_off_cost(args.off_cost)
    policy, options = None, None
    if args.policy_config:
        policy, options, max_seqs = load_policy(args.policy_config)
        if max_seqs and args.max_running is None and args.curves not in PRESETS:
            curve.max_running = max_seqs
    if policy is None and args.ladder_for_classes:
        policy = curve_policy(curve, args.spec_steps, parse_classes(args.classes) if args.classes else None, True)
    policy = policy or curve_policy(curve, args.spec_steps)
    if args.report_interval is not None or options is None:
        interval = args.report_interval or (options.report_interval_s if options else 0.25)
        stale = args.stale_after or max(1.0, 4 * interval)
        options = ControllerOptions(report_interval_s=interval, stale_after_s=stale)
    return curve, policy, options


def run_one(curve, policy, options, args, policy_name: str, replicas: int | None = None, **trace_kw):
    n = replicas or args.replicas
    spec = args.spec_steps if args.spec_steps is not None else policy.spec_steps or curve.spec_steps
    rps = n * curve.capacity() / curve.output_tokens * (args.load or 1.0)
    trace = make_trace(args.trace, rps, args.duration, curve.output_tokens, args.seed, **trace_kw)
    opts = SimOptions(
        replicas=n,
        policy=policy_name,
        spec_steps=spec,
        dt_s=args.dt,
        report_delay_s=args.report_delay,
        broadcast_delay_s=args.broadcast_delay,
        report_answers=not args.no_report_answers,
        max_running=args.max_running,
        seed=args.seed,
        slo_tpot_s=args.slo_tpot_ms / 1000 if args.slo_tpot_ms else None,
        slo_ttft_s=args.slo_ttft_ms / 1000 if args.slo_ttft_ms else None,
        classes=parse_classes(args.classes) if args.classes else None,
        ceiling=args.ceiling,
    )
    sim = Simulation(curve, trace, policy, options, opts).run()
    return sim, sim.summary()


def run(args) -> int:
    curve, policy, options = setup(args)
    results = {}
    for name in [p.strip() for p in args.policy.split(",") if p.strip()]:
        sim, s = run_one(curve, policy, options, args, name)
        s["timeline"] = [[round(x, 3) for x in row] for row in sim.timeline]
        results[name] = s
        print(
            f"{name:8s} tok/s {s['output_tokens_per_s']:>10.1f}  goodput {s['goodput_tokens_per_s']:>10.1f}  "
            f"TTFT p50/p99 {s['ttft_p50_ms']}/{s['ttft_p99_ms']} ms  TPOT p50/p99 {s['tpot_p50_ms']}/"
            f"{s['tpot_p99_ms']} ms  switches {s['switches']}  modes {s['time_in_mode']}  "
            f"[{s['requests']} requests, {s['sim_time_s']:.0f} s simulated in {s['wall_s']:.1f} s]"
        )
    meta = {
        "command": "python -m serve_app.tools.simulate " + " ".join(sys.argv[1:]),
        "curve": curve.describe(),
        "policy": policy.model_dump(),
        "controller": options.model_dump(),
        "trace": args.trace,
        "duration_s": args.duration,
        "load": args.load or 1.0,
        "report_delay_s": args.report_delay,
        "broadcast_delay_s": args.broadcast_delay,
        "dt_s": args.dt,
        "classes": args.classes,
        "ceiling": args.ceiling,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "policies": results}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("validate", "study", "steps", "bound"):
        from . import bound, study, study_steps, validate

        module = {"validate": validate, "study": study, "steps": study_steps, "bound": bound}[argv[0]]
        p = argparse.ArgumentParser(
            prog=f"python -m serve_app.tools.simulate {argv[0]}",
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        return module.run(p.parse_args(argv[1:]))
    p = argparse.ArgumentParser(
        prog="python -m serve_app.tools.simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
