"""``simulate validate``: predict the serving benchmark's sweep and report the error per point.

The serving benchmark (``python -m serve_app.bench serve``) runs closed-loop clients against
the local deployment (2 replicas) for each policy and concurrency. This simulates the same
sweep (same replicas, concurrencies, policies, the config's policy and controller options,
the engine's slots) on curves from this machine's engine benchmark, and compares output
tokens/s point by point. Requests per point: the row's ``num_requests``, else the sweep's
``meta.requests_per_point``, else max(2 × concurrency, 8) like the engine benchmark. Output
tokens per request: the row's mean, else the curve's.

With ``--host-cores`` the replicas share that many cores with the host's work, which costs
``--host-ms-per-chunk`` of CPU per streamed chunk (see ``SimOptions.host_cores``): on one small
machine the ingress, the HTTP proxy and the clients run beside the engines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from serve_app.config import ControllerOptions
from serve_app.policy import raw_tier

from .__main__ import load_policy
from .curves import from_bench
from .sim import ClosedLoop, SimOptions, Simulation

ALIASES = {"auto": "dynamic", "static-spec": "spec", "static-off": "off"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--curves", required=True, help="engine bench JSON from this machine")
    p.add_argument("--serve", required=True, help="serve bench JSON (rows: policy, concurrency, output_tokens_per_s)")
    p.add_argument("--config", default="configs/local.yaml", help="the serve config the sweep ran")
    p.add_argument("--prompt-set", default=None, help="engine bench prompt set (default: the sweep's, else the first)")
    p.add_argument("--replicas", type=int, default=None, help="default: the sweep's meta, else 2")
    p.add_argument("--spec-steps", type=int, default=None, help="num_steps of 'spec' (default: the top tier)")
    p.add_argument("--host-cores", type=float, default=None,
                   help="cores the replicas share with the host's work (the machine's; default: none shared)")
    p.add_argument("--host-ms-per-chunk", type=float, default=0.0,
                   help="host CPU ms per streamed chunk, measured with scripts/cpu_share.py")
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--dt", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/sim_validate.json")


def simulate_sweep(curve, rows, policy, options, replicas, spec_steps, requests_per_point=None, dt=0.02, seed=0,
                   host_cores=None, host_s_per_chunk=0.0):
    """One simulated closed-loop point per row (each from a fresh cluster; dynamic starts in the
    tier the previous, lower concurrency called for, as the benchmark's controller would)."""
    out = []
    for row in rows:
        name = ALIASES.get(row["policy"], row["policy"])
        c = int(row["concurrency"])
        total = row.get("num_requests") or requests_per_point or max(2 * c, 8)
        tokens = (
            row.get("output_tokens") / row["num_requests"]
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
            drain_s=1e6,
            initial_steps=initial,
            host_cores=host_cores,
            host_s_per_chunk=host_s_per_chunk,
        )
        sim = Simulation(curve, ClosedLoop(c, int(total), int(round(tokens))), policy, options, opts).run()
        s = sim.summary()
        err = s["output_tokens_per_s"] / row["output_tokens_per_s"] - 1 if row["output_tokens_per_s"] else None
        out.append(
            {
                "policy": row["policy"],
                "concurrency": c,
                "measured_tokens_per_s": row["output_tokens_per_s"],
                "simulated_tokens_per_s": s["output_tokens_per_s"],
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
    curve = from_bench(args.curves, args.prompt_set or meta.get("prompt_set"), max_running=max_seqs or 32)
    replicas = args.replicas or meta.get("num_replicas") or meta.get("replicas") or 2
    spec = args.spec_steps if args.spec_steps is not None else policy.tiers[0].num_steps
    rows = sorted(serve["rows"], key=lambda r: (r["policy"], r["concurrency"]))
    points = simulate_sweep(
        curve, rows, policy, options, replicas, spec, meta.get("requests_per_point"), args.dt, args.seed,
        args.host_cores, args.host_ms_per_chunk / 1000,
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
