"""``bench faults``: fault injection under load, against a live specserve application.

Closed-loop clients send greedy requests (half streaming, half one-shot) over a fixed prompt
set and check every answer against a reference computed before the faults, while:

- ``replica_kill``: a replica actor is killed (``ray.kill``). Requests that had not streamed a
  token are re-dispatched by the ingress (``retried``); streams cut mid-way must end with an
  error event and ``[DONE]`` (``cut``), never hang; the replacement must run the current mode.
- ``controller_kill``: the controller is killed ``--kills`` times, each after a forced switch.
  No request may fail, the mode must converge, and no switch event may be missing.
- ``switch_storm``: a forced switch every ``--storm-period-s`` for ``--storm-s``: zero
  failures, every output identical to the reference.
- ``soak`` (``--soak``): ``--soak-s`` at moderate concurrency in auto mode: zero errors,
  replica RSS at start and end.
- ``node_replica`` (``--nodes 3`` or more): a worker node that holds a replica (not the
  controller) is removed, raylet and workers killed; a replacement node joins (as an
  autoscaler would add one) and the cluster must come back to the same mode on all replicas.
- ``node_controller`` (``--nodes 3`` or more): the worker node that holds the controller is
  removed; the controller must restart on a live node from its saved state, the replicas on
  live nodes keep their last mode meanwhile, and the cluster comes back to the same mode.

Each scenario reports requests sent, completed, failed (client-visible), retried, cut.
The run starts its own Ray and Serve (HTTP on a free local port); with ``--nodes N`` that Ray
is a cluster of N nodes on this machine (:class:`.nodes.LocalCluster`). The tests call the same
scenario functions with shorter settings.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import time
from datetime import UTC, datetime

from serve_app.serving.config import read_serve_config, set_ray_env

from .client import free_port
from .fault_load import Load, Target, result
from .nodes import LocalCluster, node_controller, node_replica, placement

HELP = "fault injection under load: replica, controller and node kills, switch storm, soak"


# -- scenarios -----------------------------------------------------------------------------------


def replica_kill(
    t: Target, replicas: int, clients: int = 4, max_tokens: int = 32, kills: int = 1, mode: int = 2
) -> dict:
    """Kill the busiest replica under load (``kills`` times, one at a time); it must come back in ``mode``."""
    import ray

    started = time.monotonic()
    ref = t.reference(max_tokens, replicas)
    t.force({"mode": "fixed", "num_steps": mode}).raise_for_status()
    t.wait_converged(mode, replicas)
    recovery = []
    with Load(t.prefix, clients, max_tokens, ref) as load:
        for _ in range(kills):
            time.sleep(2.0)
            busiest = max(t.replica_infos(), key=lambda info: info["load"]["running"] + info["load"]["waiting"])
            victim = next(n for n in t.replica_actor_names() if n.endswith(f"#{busiest['replica_id']}"))
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            killed_at = time.monotonic()
            time.sleep(1.0)
            while victim in t.replica_actor_names():
                time.sleep(0.2)
            t.wait_converged(mode, replicas, timeout_s=180)
            recovery.append(round(time.monotonic() - killed_at, 1))
        time.sleep(1.0)
    t.force({"mode": "auto"}).raise_for_status()
    return result("replica_kill", load.tally, started, kills=kills, mode=mode, recovery_s=recovery)


def controller_kill(t: Target, replicas: int, clients: int = 4, max_tokens: int = 32, kills: int = 5) -> dict:
    """Force a switch, then kill the controller, ``kills`` times under load."""
    import ray

    from serve_app.control.actor import NAMESPACE, controller_name

    started = time.monotonic()
    ref = t.reference(max_tokens, replicas)
    v0 = t.status()["version"]
    ladder = [4, 0, 2, 1, 3]
    with Load(t.prefix, clients, max_tokens, ref) as load:
        for i in range(kills):
            t.force({"mode": "fixed", "num_steps": ladder[i % len(ladder)]}).raise_for_status()
            time.sleep(0.3)
            ray.kill(ray.get_actor(controller_name(t.app_name), namespace=NAMESPACE), no_restart=False)
            time.sleep(1.0)
        final = ladder[kills % len(ladder)]
        t.force({"mode": "fixed", "num_steps": final}).raise_for_status()
        converge_s = t.wait_converged(final, replicas)
        time.sleep(1.0)
    s = t.status()
    versions = {e["version"] for e in s["events"]}
    lost = sorted(set(range(v0 + 1, s["version"] + 1)) - versions)
    t.force({"mode": "auto"}).raise_for_status()
    return result("controller_kill", load.tally, started, kills=kills, switches=s["version"] - v0,
                  events_lost=len(lost), converged_to=final, converge_s=round(converge_s, 2))


def switch_storm(
    t: Target, replicas: int, clients: int = 4, max_tokens: int = 32, duration_s: float = 60, period_s: float = 0.1
) -> dict:
    """A forced switch every ``period_s`` for ``duration_s`` under load; outputs must equal the reference."""
    started = time.monotonic()
    ref = t.reference(max_tokens, replicas)
    ladder, forced, refused = [4, 0, 3, 1, 2], 0, 0
    with Load(t.prefix, clients, max_tokens, ref) as load:
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            tick = time.monotonic()
            r = t.force({"mode": "fixed", "num_steps": ladder[forced % len(ladder)]})
            forced += r.status_code == 200
            refused += r.status_code != 200
            time.sleep(max(0.0, period_s - (time.monotonic() - tick)))
        last = ladder[(forced - 1) % len(ladder)]
        t.wait_converged(last, replicas)
    t.force({"mode": "auto"}).raise_for_status()
    return result(
        "switch_storm",
        load.tally,
        started,
        switches=forced,
        switches_refused=refused,
        period_s=period_s,
        storm_s=duration_s,
    )


def soak(t: Target, replicas: int, clients: int = 4, max_tokens: int = 32, duration_s: float = 600,
         sample_s: float = 30.0) -> dict:
    """Moderate load for ``duration_s`` in auto mode, after a warm-up: every replica's RSS idle
    before the load, every ``sample_s`` under it (its largest drift from the first sample, in
    percent) and idle again ``sample_s`` / 6 after it, and the p99 of the streams' TTFT in the
    first and in the last minute."""
    from .stats import percentile

    started = time.monotonic()
    ref = t.reference(max_tokens, replicas)
    t.force({"mode": "auto"}).raise_for_status()
    rss = lambda: {i["replica_id"]: i["rss_bytes"] / 2**20 for i in t.replica_infos()}  # noqa: E731
    samples: list[dict[str, float]] = []
    idle_before = rss()
    with Load(t.prefix, clients, max_tokens, ref) as load:
        time.sleep(min(30.0, duration_s / 10))  # warm: caches and allocator pools filled
        begin = time.monotonic()
        while (now := time.monotonic()) < begin + duration_s:
            samples.append(rss())
            time.sleep(min(sample_s, max(0.0, begin + duration_s - now)))
        samples.append(rss())
    time.sleep(min(5.0, sample_s / 6))  # the last streams end; an engine with no requests shrinks its cache
    idle_after = rss()
    per_replica = {}
    for rid, first in samples[0].items():
        series = [s[rid] for s in samples if rid in s]
        drift = max(abs(v - first) for v in series) / first * 100
        per_replica[rid] = {"first_mib": round(first, 1), "last_mib": round(series[-1], 1),
                            "max_mib": round(max(series), 1), "max_drift_pct": round(drift, 2),
                            "idle_before_mib": round(idle_before.get(rid, float("nan")), 1),
                            "idle_after_mib": round(idle_after.get(rid, float("nan")), 1)}
    minute = lambda lo, hi: [s for at, s in load.ttft if lo <= at - begin < hi]  # noqa: E731
    first_min, last_min = minute(0, 60), minute(max(0.0, duration_s - 60), duration_s)
    p99 = lambda xs: None if not xs else round(percentile(xs, 99) * 1000, 1)  # noqa: E731
    ttft = {"first_minute_p99_ms": p99(first_min), "last_minute_p99_ms": p99(last_min),
            "first_minute_streams": len(first_min), "last_minute_streams": len(last_min)}
    if ttft["first_minute_p99_ms"] and ttft["last_minute_p99_ms"]:
        ttft["last_over_first"] = round(ttft["last_minute_p99_ms"] / ttft["first_minute_p99_ms"], 3)
    return result("soak", load.tally, started, soak_s=duration_s, clients=clients, rss_samples=len(samples),
                  rss=per_replica, ttft=ttft)


# -- the command ---------------------------------------------------------------------------------


SCENARIOS = ("replica_kill", "controller_kill", "switch_storm", "node_replica", "node_controller")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-random", help="embedded engine model (default tiny-random)")
    p.add_argument(
        "--config",
        help="a Serve config YAML whose first application's args.engine to use instead of --model",
    )
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--clients", type=int, default=4, help="concurrent clients during the faults")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kills", type=int, default=5, help="controller kills (replica kills: --replica-kills)")
    p.add_argument("--replica-kills", type=int, default=2)
    p.add_argument("--storm-s", type=float, default=60.0)
    p.add_argument("--storm-period-s", type=float, default=0.1)
    p.add_argument("--soak", action="store_true", help="also run the soak (not in CI)")
    p.add_argument("--soak-s", type=float, default=600.0)
    p.add_argument("--soak-clients", type=int, default=4)
    p.add_argument(
        "--scenarios",
        default="replica_kill,controller_kill,switch_storm",
        help="comma-separated subset of " + ",".join(SCENARIOS) + " (the node_* ones need --nodes 3 or more)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="run on a Ray cluster of this many nodes on this machine: the head (proxy, ingress) and "
        "nodes-1 workers, one replica each (default 1: a single local Ray)",
    )
    p.add_argument(
        "--controller-on",
        choices=("worker", "head", "any"),
        default="worker",
        help="with --nodes: the controller's placement (controller.ray_actor_options); default worker",
    )
    p.add_argument(
        "--replace-after-s",
        type=float,
        default=5.0,
        help="node scenarios: seconds after a node is removed until a fresh worker joins",
    )
    p.add_argument("--out", default="faults.json", help="where to write the JSON results")


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from serve_app.control.actor import delete_controller
    from serve_app.serving.app import build_app

    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    workers = args.nodes - 1
    if any(s.startswith("node_") for s in scenarios) and workers < 2:
        raise SystemExit("the node_* scenarios need --nodes 3 or more (a head and 2 workers)")
    if workers >= 1 and args.replicas > workers:
        raise SystemExit(
            f"--replicas {args.replicas} needs --nodes {args.replicas + 1} or more (one replica per worker)"
        )
    if "node_controller" in scenarios and args.controller_on == "head":
        raise SystemExit("node_controller removes the controller's node: it needs --controller-on worker or any")

    token_env = "SPECSERVE_FAULTS_ADMIN_TOKEN"
    os.environ[token_env] = token = secrets.token_urlsafe(24)  # before Ray starts: workers inherit it
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    set_ray_env(own_ports=True)
    cluster = LocalCluster(workers) if workers >= 1 else None
    # A cluster of our own is set up already (LocalCluster); a local Ray is started here.
    where = (
        {"address": cluster.address} if cluster else {"include_dashboard": False, "object_store_memory": 500 * 2**20}
    )
    ray.init(log_to_driver=False, namespace="specserve-faults", **where)
    port = free_port()
    proxy = {"proxy_location": "HeadOnly"} if cluster else {}  # every node shares this host's ports
    serve.start(http_options={"host": "127.0.0.1", "port": port}, **proxy)
    name = "faults"
    engine = (
        _engine_of(args.config)
        if args.config
        else {"embedded": {"model": args.model, "device": "cpu", "num_threads": 1, "max_num_seqs": 16}}
    )
    app_args = {
        "engine": engine,
        "num_replicas": args.replicas,
        "replica_ray_actor_options": {"num_cpus": 0},
        "admin_token_env": token_env,
    }
    if cluster:
        app_args["replica_ray_actor_options"] = {"num_cpus": 0, "resources": {LocalCluster.REPLICA: 1}}
        app_args["ingress_ray_actor_options"] = {"num_cpus": 0, "resources": {LocalCluster.HEAD: 0.001}}
        homes = {"worker": {LocalCluster.WORKER: 0.001}, "head": {LocalCluster.HEAD: 0.001}, "any": {}}
        app_args["controller"] = {"ray_actor_options": {"resources": homes[args.controller_on]}}
    results = []
    try:
        delete_controller(name)
        serve.run(build_app(app_args), name=name, route_prefix=f"/{name}")
        t = Target(name, f"http://127.0.0.1:{port}/{name}", token)
        common = {"clients": args.clients, "max_tokens": args.max_tokens}
        if cluster:
            print(f"placement: {json.dumps(placement(t, cluster))}", flush=True)
        for s in scenarios:
            if s == "replica_kill":
                results.append(replica_kill(t, args.replicas, kills=args.replica_kills, **common))
            elif s == "controller_kill":
                results.append(controller_kill(t, args.replicas, kills=args.kills, **common))
            elif s == "switch_storm":
                results.append(
                    switch_storm(t, args.replicas, duration_s=args.storm_s, period_s=args.storm_period_s, **common)
                )
            elif s == "node_replica":
                results.append(node_replica(t, cluster, args.replicas, replace_after_s=args.replace_after_s, **common))
            elif s == "node_controller":
                results.append(
                    node_controller(t, cluster, args.replicas, replace_after_s=args.replace_after_s, **common)
                )
            print(format_row(results[-1]), flush=True)
        if args.soak:
            results.append(
                soak(t, args.replicas, clients=args.soak_clients, max_tokens=args.max_tokens, duration_s=args.soak_s)
            )
            print(format_row(results[-1]), flush=True)
    finally:
        serve.delete(name)
        delete_controller(name)
        serve.shutdown()
        ray.shutdown()
        if cluster:
            cluster.shutdown()
    used = {k: v for k, v in vars(args).items() if k != "run"}
    report = {"when": datetime.now(UTC).isoformat(timespec="seconds"), "args": used, "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 0 if all(r["failed"] == 0 for r in results) else 1


def format_row(r: dict) -> str:
    keys = ("sent", "completed", "failed", "retried", "cut", "resent")
    extra = {k: v for k, v in r.items() if k not in (*keys, "scenario", "errors", "mismatched")}
    counts = " ".join(f"{k}={r[k]}" for k in keys)
    errors = f"\n  first errors: {r['errors'][:3]}" if r["errors"] else ""
    return f"{r['scenario']:<16} {counts}  {json.dumps(extra)}{errors}"


def _engine_of(path: str) -> dict:
    """``args.engine`` of the first application in a Serve config YAML."""
    engine = read_serve_config(path)[1].get("engine")
    if not engine:
        raise SystemExit(f"--config {path}: no applications[0].args.engine in it")
    return engine
