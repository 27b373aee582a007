"""``simulate validate``: predict the serving benchmark's sweep and report the error per point.

The serving benchmark (``python -m serve_app.tools.bench serve``) runs closed-loop clients against
the local deployment (2 replicas) for each policy and concurrency. This simulates the same
sweep (same replicas, concurrencies, policies, the ladder the sweep's meta records, else the
config's, the config's controller options, the engine's slots) on curves from this machine's
engine benchmark, and compares output tokens/s point by point.

Each point is simulated as the benchmark measures one window: c clients start together on a
fresh cluster (with the sweep's ``stagger_s``, from ``bench serve --stagger-s``, client j starts
j·stagger_s/c seconds in, as there) and keep sending; the window opens ``settle_s`` after the
start (the sweep's meta), and never before every client has finished its first request; it
lasts the row's ``measure_s`` (default 30 s), and its output tokens/s is compared. Output
tokens per request: the row's mean, else the curve's.

With ``--host-cores`` the replicas share that many cores with the host's work, which costs
``--host-ms-per-chunk`` of CPU per streamed chunk (see ``SimOptions.host_cores``): on one small
machine the ingress, the HTTP proxy and the clients run beside the engines.

With ``--stack-efficiency-from FILE`` (a ``bench serve`` JSON with ``spec`` and ``off`` rows,
run apart from the sweep) an engine runs at the share of the curve's speed that the stack
measured there (``SimOptions.stack_efficiency``): at concurrency c <= replicas, one request per
busy replica, X_stack(c) / (c · X_curve(1, k)) for c busy replicas; at c = b · replicas,
X_stack(c) / (replicas · X_curve(b, k)) for b requests on every replica, held for larger
batches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from serve_app.control.config import ControllerOptions, PolicyConfig
from serve_app.control.policy import raw_tier

from .curves import from_bench
from .policies import load_policy
from .sim import ClosedLoop, SimOptions, Simulation, by_batch

ALIASES = {"auto": "dynamic", "static-spec": "spec", "static-off": "off"}


def stack_efficiency(rows: list[dict], curve, replicas: int,
                     spec_steps: int) -> dict[int, tuple[float | tuple[float, ...], ...]]:
    """``SimOptions.stack_efficiency`` from ``bench serve`` rows, run apart from the sweep: at
    concurrency c <= replicas (c busy replicas, one request each) e = X(c) / (c · X_curve(1, k));
    at c = b · replicas (every replica busy with b requests) e = X(c) / (replicas · X_curve(b, k)).
    Entries for the busy counts and batches not measured take the ones below them; batches
    above the largest measured one take its value (the simulation holds the last entry)."""
    out: dict[int, tuple[float | tuple[float, ...], ...]] = {}
    for policy, k in (("off", 0), ("spec", spec_steps)):
        by_c = {int(r["concurrency"]): r["output_tokens_per_s"] for r in rows
                if ALIASES.get(r["policy"], r["policy"]) == policy}
        if 1 not in by_c:
            continue
        per_busy, last = [], None
        for c in range(1, replicas + 1):
            if c in by_c:
                last = by_c[c] / (c * curve.throughput(1, k))
            per_busy.append(round(last, 4))
        batches = sorted(c // replicas for c in by_c if c > replicas and c % replicas == 0)
        if batches:
            values = [per_busy[-1]]
            for b in range(2, batches[-1] + 1):
                if b in batches:
                    last = by_c[b * replicas] / (replicas * curve.throughput(b, k))
                values.append(round(last, 4))
            per_busy[-1] = tuple(values)
        out[k] = tuple(per_busy)
    if not out:
        raise ValueError("no spec or off rows at concurrency 1 to measure the stack's efficiency on")
    return out


def efficiency_values(eff) -> list[float]:
    """Every number in a ``stack_efficiency`` mapping."""
    return [x for row in (eff or {}).values() for e in row for x in by_batch(e)]


def describe_efficiency(eff) -> str:
    """One line: by num_steps, by busy replicas, by running requests where measured."""
    return "; ".join(f"k={k}: {', '.join('/'.join(f'{x:.3f}' for x in by_batch(e)) for e in row)}"
                     for k, row in sorted(eff.items()))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--curves", required=True, help="engine bench JSON from this machine")
    p.add_argument("--serve", required=True, help="serve bench JSON (rows: policy, concurrency, output_tokens_per_s)")
    p.add_argument("--config", default="configs/local.yaml",
                   help="the serve config the sweep ran (controller options, max_num_seqs; its ladder where the "
                        "sweep's meta does not record one)")
    p.add_argument("--prompt-set", default=None, help="engine bench prompt set (default: the sweep's, else the first)")
    p.add_argument("--replicas", type=int, default=None, help="default: the sweep's meta, else 2")
    p.add_argument("--spec-steps", type=int, default=None, help="num_steps of 'spec' (default: the top tier)")
    p.add_argument("--host-cores", type=float, default=None,
                   help="cores the replicas share with the host's work (the machine's; default: none shared)")
    p.add_argument("--host-ms-per-chunk", type=float, default=0.0,
                   help="host CPU ms per streamed chunk, measured with scripts/cpu_share.py")
    p.add_argument("--stack-efficiency-from", default=None, metavar="FILE",
                   help="a bench serve JSON with spec/off rows at concurrency 1 .. replicas and multiples of replicas, "
                        "run apart from the sweep: engines run at the share of the curve's speed measured there, by busy "
                        "replicas and requests per replica (default: the curve's speed)")
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--dt", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/sim_validate.json")


def simulate_window(curve, policy, options, opts: SimOptions, clients: int, tokens: int, settle_s: float,
                    measure_s: float, stagger_s: float = 0.0) -> tuple[float, dict]:
    """(output tokens/s in the benchmark's window, the run's summary) of ``clients`` closed-loop
    clients from a cold start: the window opens at ``settle_s``, and never before every client
    has finished its first request, and lasts ``measure_s``."""
    per_replica = max(clients / opts.replicas, 1.0)
    slowest = min(curve.throughput(per_replica, k) for k in curve.steps) / per_replica  # tokens/s a request
    slack = min(efficiency_values(opts.stack_efficiency), default=1.0)
    slack *= 0.5 if opts.host_cores else 1.0
    rounds = int((settle_s + stagger_s + 2 * measure_s) * slowest * slack / max(tokens, 1)) + 4
    for _ in range(6):
        o = dataclasses.replace(opts, timeline_s=opts.dt_s, drain_s=1e6)
        sim = Simulation(curve, ClosedLoop(clients, clients * rounds, tokens, stagger_s), policy, options, o).run()
        first_wave = float(sim.req.finish[:clients].max())
        t0 = max(settle_s, first_wave)
        t1 = t0 + measure_s
        if float(sim.req.arrival[np.isfinite(sim.req.arrival)].max()) >= t1:  # still loaded at the end
            return sim.tokens_between(t0, t1) / measure_s, sim.summary()
        rounds *= 2
    raise RuntimeError(f"could not keep {clients} clients busy past the window ({rounds} rounds)")


def simulate_sweep(curve, rows, policy, options, replicas, spec_steps, dt=0.02, seed=0, host_cores=None,
                   host_s_per_chunk=0.0, settle_s=0.0, stack_efficiency=None, stagger_s=0.0):
    """One simulated window per row (each from a fresh cluster; dynamic starts in the tier the
    previous, lower concurrency called for, as the benchmark's controller would)."""
    out = []
    for row in rows:
        name = ALIASES.get(row["policy"], row["policy"])
        c = int(row["concurrency"])
        tokens = row.get("mean_output_tokens") or (
            row["output_tokens"] / row["num_requests"]
            if row.get("output_tokens") and row.get("num_requests")
            else curve.output_tokens
        )
        lower = [int(r["concurrency"]) for r in rows if r["policy"] == row["policy"] and r["concurrency"] < c]
        initial = policy.tiers[raw_tier(max(lower) / replicas, policy)].num_steps if lower else None
        opts = SimOptions(
            replicas=replicas,
            policy=name,
            spec_steps=spec_steps,
            dt_s=dt,
            seed=seed,
            max_running=curve.max_running,
            initial_steps=initial,
            host_cores=host_cores,
            host_s_per_chunk=host_s_per_chunk,
            stack_efficiency=stack_efficiency,
        )
        x, s = simulate_window(curve, policy, options, opts, c, int(round(tokens)), settle_s,
                               float(row.get("measure_s") or 30.0), stagger_s)
        err = x / row["output_tokens_per_s"] - 1 if row["output_tokens_per_s"] else None
        out.append(
            {
                "policy": row["policy"],
                "concurrency": c,
                "measured_tokens_per_s": row["output_tokens_per_s"],
                "simulated_tokens_per_s": round(x, 2),
                "error": None if err is None else round(err, 4),
                "simulated_switches": s["switches"],
                "measured_switches": row.get("switches"),
            }
        )
    return out


def run(args: argparse.Namespace) -> int:
    serve = json.loads(Path(args.serve).read_text())
    meta = serve.get("meta", {})
    policy, options, max_seqs = load_policy(args.config)
    options = options or ControllerOptions()
    if isinstance(meta.get("policy"), dict) and meta["policy"].get("tiers"):
        policy = PolicyConfig.model_validate(meta["policy"])  # the ladder the sweep ran, not today's file
        print(f"dynamic runs the sweep's ladder: {policy.tiers}")
    curve = from_bench(args.curves, args.prompt_set or meta.get("prompt_set"), max_running=max_seqs or 32)
    replicas = args.replicas or meta.get("num_replicas") or meta.get("replicas") or 2
    spec = args.spec_steps if args.spec_steps is not None else meta.get("spec_steps") or policy.spec_steps
    rows = sorted(serve["rows"], key=lambda r: (r["policy"], r["concurrency"]))
    efficiency = None
    if args.stack_efficiency_from:
        efficiency = stack_efficiency(json.loads(Path(args.stack_efficiency_from).read_text())["rows"], curve,
                                      replicas, spec)
        print("stack efficiency (share of the curve's speed, by busy replicas; a/b/..: by requests per replica): "
              + describe_efficiency(efficiency))
    points = simulate_sweep(
        curve, rows, policy, options, replicas, spec, args.dt, args.seed, args.host_cores,
        args.host_ms_per_chunk / 1000, float(meta.get("settle_s") or 0.0), efficiency,
        float(meta.get("stagger_s") or 0.0),
    )
    print(f"{'policy':10s} {'conc':>5s} {'measured':>10s} {'simulated':>10s} {'error':>8s}")
    for p in points:
        err = "n/a" if p["error"] is None else f"{100 * p['error']:+.1f}%"
        print(
            f"{p['policy']:10s} {p['concurrency']:5d} {p['measured_tokens_per_s']:10.2f} "
            f"{p['simulated_tokens_per_s']:10.2f} {err:>8s}"
        )
    errors = [abs(p["error"]) for p in points if p["error"] is not None]
    worst = max(errors) if errors else None
    within = sum(e <= args.tolerance for e in errors)
    print(
        f"{within}/{len(errors)} points within {100 * args.tolerance:.0f}%; worst {100 * (worst or 0):.1f}%; "
        f"curve notes: {curve.notes or 'none'}"
    )
    result = {
        "meta": {
            "curves": args.curves,
            "serve": args.serve,
            "config": args.config,
            "replicas": replicas,
            "spec_steps": spec,
            "prompt_set": curve.name.rsplit(":", 1)[-1],
            "tolerance": args.tolerance,
            "host_cores": args.host_cores,
            "host_ms_per_chunk": args.host_ms_per_chunk,
            "stack_efficiency_from": args.stack_efficiency_from,
            "stack_efficiency": None if efficiency is None else {str(k): v for k, v in efficiency.items()},
            "settle_s": float(meta.get("settle_s") or 0.0),
            "stagger_s": float(meta.get("stagger_s") or 0.0),
            "worst_error": worst,
            "within_tolerance": within,
            "points_compared": len(errors),
        },
        "points": points,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if worst is not None and worst <= args.tolerance else 1
