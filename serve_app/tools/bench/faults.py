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
is a cluster of N nodes on this machine (:class:`LocalCluster`). The tests call the same
scenario functions with shorter settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

import httpx

HELP = "fault injection under load: replica, controller and node kills, switch storm, soak"
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "The capital of France is",
    "Repeat after me: red green blue red green blue",
]


@dataclass
class Tally:
    """What the clients saw. ``failed`` counts client-visible failures (anything but a 200 with
    the reference output, or a cut stream ended cleanly); ``retried`` counts answers the
    ingress re-dispatched after losing a replica (header ``x-specserve-attempts`` > 1)."""

    sent: int = 0
    completed: int = 0
    failed: int = 0
    retried: int = 0
    cut: int = 0
    mismatched: int = 0
    errors: list[str] = field(default_factory=list)

    def fail(self, why: str) -> None:
        self.failed += 1
        if len(self.errors) < 20:
            self.errors.append(why)


class Load:
    """``clients`` closed-loop clients in a background event loop, until :meth:`stop`."""

    def __init__(self, prefix: str, clients: int, max_tokens: int, reference: dict[str, str], timeout_s: float = 60):
        self.prefix, self.clients, self.max_tokens, self.reference = prefix, clients, max_tokens, reference
        self.timeout_s, self.tally, self._running = timeout_s, Tally(), True
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        self._futures = [asyncio.run_coroutine_threadsafe(self._client(i), self._loop) for i in range(self.clients)]
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> Tally:
        self._running = False
        for f in self._futures:
            f.result(timeout=self.timeout_s + 30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        return self.tally

    async def _client(self, i: int) -> None:
        async with httpx.AsyncClient(base_url=self.prefix, timeout=self.timeout_s) as http:
            k = i
            while self._running:
                prompt, stream = PROMPTS[k % len(PROMPTS)], k % 2 == 1
                k += 1
                self.tally.sent += 1
                try:
                    await self._one(http, prompt, stream)
                except Exception as e:  # a timeout here is a hang
                    self.tally.fail(f"{type(e).__name__}: {e}")

    async def _one(self, http: httpx.AsyncClient, prompt: str, stream: bool) -> None:
        body = {"prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
        t = self.tally
        if not stream:
            r = await http.post("/v1/completions", json=body)
            if r.status_code != 200:
                return t.fail(f"{r.status_code}: {r.text[:200]}")
            text = r.json()["choices"][0]["text"]
        else:
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                lines = [line async for line in r.aiter_lines() if line]
            if r.status_code != 200:
                return t.fail(f"{r.status_code}: {lines[:1]}")
            if lines[-1:] != ["data: [DONE]"]:
                return t.fail(f"stream without [DONE]: {lines[-1:]}")
            chunks = [json.loads(line[6:]) for line in lines[:-1]]
            errors = [c["error"] for c in chunks if "error" in c]
            if errors:  # a cut stream: fine only if a replica died under it, and said so
                if "replica serving it failed" in errors[0]["message"]:
                    t.cut += 1
                    return
                return t.fail(f"stream error: {errors[0]}")
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        if int(r.headers.get("x-specserve-attempts", "1")) > 1:
            t.retried += 1
        if self.reference.get(prompt, text) != text:
            t.mismatched += 1
            return t.fail(f"output differs from the reference for {prompt!r}")
        t.completed += 1


# -- the application under test ----------------------------------------------------------------


@dataclass
class Target:
    """A deployed application: where it answers and how to steer it."""

    app_name: str
    prefix: str
    admin_token: str
    http: httpx.Client = field(init=False)

    def __post_init__(self):
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        self.http = httpx.Client(base_url=self.prefix, headers=headers, timeout=60)

    def status(self) -> dict:
        r = self.http.get("/v1/speculation")
        r.raise_for_status()
        return r.json()

    def force(self, body: dict) -> httpx.Response:
        return self.http.put("/v1/speculation", json=body)

    def wait_converged(self, num_steps: int, replicas: int, timeout_s: float = 120) -> float:
        """Seconds until every one of ``replicas`` live replicas runs ``num_steps`` at the cluster version."""
        start = time.monotonic()
        while True:
            s = self.status()
            reps = s["replicas"]
            if (
                s["num_steps"] == num_steps
                and len(reps) == replicas
                and all(r["num_steps"] == num_steps and r["applied_version"] == s["version"] for r in reps)
            ):
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"not converged to {num_steps} on {replicas} replicas: {s['replicas']}")
            time.sleep(0.1)

    def reference(self, max_tokens: int, replicas: int) -> dict[str, str]:
        """Greedy outputs of every prompt with plain decoding, one at a time, before any fault.
        Leaves the cluster fixed at num_steps 0."""
        self.force({"mode": "fixed", "num_steps": 0}).raise_for_status()
        self.wait_converged(0, replicas)
        out = {}
        for p in PROMPTS:
            body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            r = self.http.post("/v1/completions", json=body)
            r.raise_for_status()
            out[p] = r.json()["choices"][0]["text"]
        return out

    def replica_actor_names(self) -> list[str]:
        import ray

        prefix = f"SERVE_REPLICA::{self.app_name}#LLMReplica#"
        return sorted(
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)
        )

    def replica_infos(self) -> list[dict]:
        from ray import serve

        return serve.get_deployment_handle("LLMReplica", self.app_name).broadcast("info").results(timeout_s=60)


def _result(name: str, tally: Tally, started: float, **extra) -> dict:
    return {"scenario": name, "duration_s": round(time.monotonic() - started, 1), **asdict(tally), **extra}


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
    return _result("replica_kill", load.tally, started, kills=kills, mode=mode, recovery_s=recovery)


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
    return _result(
        "controller_kill",
        load.tally,
        started,
        kills=kills,
        switches=s["version"] - v0,
        events_lost=len(lost),
        converged_to=final,
        converge_s=round(converge_s, 2),
    )


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
    return _result(
        "switch_storm",
        load.tally,
        started,
        switches=forced,
        switches_refused=refused,
        period_s=period_s,
        storm_s=duration_s,
    )


def soak(t: Target, replicas: int, clients: int = 4, max_tokens: int = 32, duration_s: float = 600) -> dict:
    """Moderate load for ``duration_s`` in auto mode; replica RSS at start and end."""
    started = time.monotonic()
    ref = t.reference(max_tokens, replicas)
    t.force({"mode": "auto"}).raise_for_status()
    rss = lambda: {i["replica_id"]: i["rss_bytes"] for i in t.replica_infos()}  # noqa: E731
    with Load(t.prefix, clients, max_tokens, ref) as load:
        time.sleep(min(10.0, duration_s / 10))  # warm: caches and allocator pools filled
        start_rss = rss()
        time.sleep(duration_s)
        end_rss = rss()
    mib = lambda b: round(b / 2**20, 1)  # noqa: E731
    per_replica = {k: {"start_mib": mib(v), "end_mib": mib(end_rss.get(k, 0))} for k, v in start_rss.items()}
    return _result("soak", load.tally, started, soak_s=duration_s, clients=clients, rss=per_replica)


# -- a multi-node cluster on this machine --------------------------------------------------------


class LocalCluster:
    """A Ray cluster of one head and ``workers`` worker nodes on this machine
    (``ray.cluster_utils.Cluster``: a raylet, object store and workers per node).

    The head offers the custom resource ``head`` (for the ingress; Serve puts its own
    controller and, with ``proxy_location="HeadOnly"``, the HTTP proxy there). Each worker
    offers a resource of its own (``node_1``, ``node_2``, ...), one ``replica`` slot (a replica
    asks for ``{replica: 1}``, so replicas land one per worker) and ``worker`` (a controller
    asking for a bit of it runs on some worker). :meth:`remove` kills a node's processes
    without a graceful shutdown, as a crash or a lost machine would; :meth:`add_worker` adds a
    fresh one, as an autoscaler replaces a lost node.

    The head checks its nodes' health every second and declares a node dead after 3 missed
    checks (Ray's defaults: 3 s and 5), so that a lost node is noticed in ~3-4 s.
    """

    HEAD, REPLICA, WORKER = "head", "replica", "worker"

    def __init__(self, workers: int, worker_cpus: float = 1, object_store_mib: int = 100):
        from ray.cluster_utils import Cluster

        if workers < 1:
            raise ValueError(f"a cluster needs at least 1 worker node, got {workers}")
        self._store = object_store_mib * 2**20
        self._cpus = worker_cpus
        self._added = 0
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "resources": {self.HEAD: 1},
                "object_store_memory": self._store,
                "include_dashboard": False,
                "_system_config": {
                    "health_check_initial_delay_ms": 1000,
                    "health_check_period_ms": 1000,
                    "health_check_failure_threshold": 3,
                },
            },
        )
        self.labels: dict[str, str] = {self.cluster.head_node.node_id: "head"}
        for _ in range(workers):
            self.add_worker()

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def head_id(self) -> str:
        return self.cluster.head_node.node_id

    def add_worker(self):
        """Start one more worker node (its own ``node_<n>`` resource, a ``replica`` slot) and wait for it."""
        self._added += 1
        label = f"node_{self._added}"
        node = self.cluster.add_node(
            num_cpus=self._cpus,
            resources={label: 1, self.REPLICA: 1, self.WORKER: 1},
            object_store_memory=self._store,
        )
        self.labels[node.node_id] = label
        return node

    def workers(self) -> dict[str, object]:
        """The live worker nodes by node id."""
        return {n.node_id: n for n in self.cluster.worker_nodes}

    def remove(self, node_id: str) -> str:
        """Lose a worker node at once: SIGKILL its workers and agents (the raylet's children),
        then its raylet and object store (``remove_node``, no graceful shutdown); its label.

        ``remove_node`` alone kills the raylet; a worker would notice that and exit only a moment
        later, and could finish the requests it holds meanwhile, which a lost machine cannot."""
        import psutil
        from ray._private import ray_constants

        node = self.workers().get(node_id)
        if node is None:
            raise ValueError(f"{node_id} is not a live worker node of this cluster (the head cannot be removed)")
        raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
        for child in raylet.children(recursive=True):
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        self.cluster.remove_node(node, allow_graceful=False)
        return self.labels[node_id]

    def label(self, node_id: str | None) -> str:
        return self.labels.get(node_id or "", str(node_id))

    def shutdown(self) -> None:
        self.cluster.shutdown()


def actor_nodes(prefix: str) -> dict[str, str]:
    """Live named actors whose name starts with ``prefix``: name -> node id (from the GCS)."""
    from ray._private import state

    return {
        a["Name"]: a["Address"]["NodeID"]
        for a in state.actors(actor_state_name="ALIVE").values()
        if a.get("Name", "").startswith(prefix)
    }


def controller_node(app_name: str, timeout_s: float = 5.0) -> str:
    """The node the application's controller runs on (raises while it is unreachable)."""
    import ray

    from serve_app.control.actor import NAMESPACE, controller_name

    ctl = ray.get_actor(controller_name(app_name), namespace=NAMESPACE)
    return ray.get(ctl.node_id.remote(), timeout=timeout_s)


def placement(t: Target, cluster: LocalCluster) -> dict:
    """Where the application's actors run, by node label."""
    replicas = actor_nodes(f"SERVE_REPLICA::{t.app_name}#LLMReplica#")
    ingress = actor_nodes(f"SERVE_REPLICA::{t.app_name}#OpenAIIngress#")
    return {
        "replicas": sorted(cluster.label(n) for n in replicas.values()),
        "ingress": sorted(cluster.label(n) for n in ingress.values()),
        "controller": cluster.label(controller_node(t.app_name)),
    }


def _live_modes(t: Target) -> list[int]:
    """num_steps of every replica that answers now (straight from the replicas, not the controller)."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMReplica", t.app_name)
    answers = handle.broadcast("info").results(timeout_s=10, return_exceptions=True)
    return [a["num_steps"] for a in answers if isinstance(a, dict)]


def _wait_back(t: Target, mode: int, replicas: int, timeout_s: float) -> None:
    """Until ``replicas`` replicas run ``mode`` at the cluster version, whatever errors the status
    route answers meanwhile (the controller may be restarting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            t.wait_converged(mode, replicas, timeout_s=max(1.0, deadline - time.monotonic()))
            return
        except (httpx.HTTPError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _busy_node(t: Target, eligible, wait_s: float = 10.0) -> tuple[str | None, int]:
    """The node of the busiest replica on one of the ``eligible`` nodes, and the requests it
    holds; waits up to ``wait_s`` for one that holds some (a node lost idle tests nothing)."""
    deadline = time.monotonic() + wait_s
    while True:
        infos = [i for i in t.replica_infos() if eligible(i["node_id"])]
        best = max(infos, key=lambda i: i["load"]["running"] + i["load"]["waiting"], default=None)
        held = 0 if best is None else best["load"]["running"] + best["load"]["waiting"]
        if held > 0 or time.monotonic() > deadline:
            return (None if best is None else best["node_id"]), held
        time.sleep(0.05)


def node_replica(
    t: Target,
    cluster: LocalCluster,
    replicas: int,
    clients: int = 4,
    max_tokens: int = 32,
    mode: int = 2,
    replace_after_s: float = 5.0,
    timeout_s: float = 300,
) -> dict:
    """Under load in a forced ``mode``, remove the worker node of the busiest replica that does
    not hold the controller (when it holds requests); after ``replace_after_s`` a fresh worker joins. Serving must go on,
    and every replica must run ``mode`` again."""
    started = time.monotonic()
    ref = t.reference(max_tokens, replicas)
    t.force({"mode": "fixed", "num_steps": mode}).raise_for_status()
    t.wait_converged(mode, replicas)
    before = placement(t, cluster)
    ctl = controller_node(t.app_name)
    with Load(t.prefix, clients, max_tokens, ref) as load:
        time.sleep(2.0)
        victim, in_flight = _busy_node(t, lambda n: n not in (ctl, cluster.head_id))
        if victim is None:
            raise RuntimeError(f"no worker node holds a replica without the controller: {before}")
        at_removal = load.tally.completed
        removed_at = time.monotonic()
        removed = cluster.remove(victim)
        time.sleep(max(0.0, replace_after_s - (time.monotonic() - removed_at)))
        added = cluster.label(cluster.add_worker().node_id)
        _wait_back(t, mode, replicas, timeout_s)
        recovery_s = round(time.monotonic() - removed_at, 1)
        during = load.tally.completed - at_removal
        time.sleep(1.0)
    after = placement(t, cluster)
    mode_after = t.status()["num_steps"]
    t.force({"mode": "auto"}).raise_for_status()
    return _result(
        "node_replica",
        load.tally,
        started,
        mode=mode,
        mode_after=mode_after,
        removed_node=removed,
        in_flight_at_removal=in_flight,
        replacement_node=added,
        recovery_s=recovery_s,
        completed_during_recovery=during,
        placement_before=before,
        placement_after=after,
    )


def node_controller(
    t: Target,
    cluster: LocalCluster,
    replicas: int,
    clients: int = 4,
    max_tokens: int = 32,
    mode: int = 3,
    replace_after_s: float = 5.0,
    timeout_s: float = 300,
) -> dict:
    """Under load in a forced ``mode``, remove the worker node that holds the controller. The
    controller must come back on a live node with the saved mode (nobody forces it again), the
    replicas on live nodes must keep ``mode`` while it is away, and after a fresh worker joins
    every replica must run ``mode``."""
    started = time.monotonic()
    ref = t.reference(max_tokens, replicas)
    t.force({"mode": "fixed", "num_steps": mode}).raise_for_status()
    t.wait_converged(mode, replicas)
    version = t.status()["version"]
    before = placement(t, cluster)
    victim = controller_node(t.app_name)
    if victim == cluster.head_id:
        raise RuntimeError("the controller runs on the head node, which cannot be removed: place it on a worker")
    modes_while_away: list[int] = []
    with Load(t.prefix, clients, max_tokens, ref) as load:
        time.sleep(2.0)
        in_flight = _busy_node(t, lambda n: n == victim)[1]  # its replica's requests, if it has one
        at_removal = load.tally.completed
        removed_at = time.monotonic()
        removed = cluster.remove(victim)
        back_on, added = None, None
        while back_on is None:
            if time.monotonic() - removed_at > timeout_s:
                raise TimeoutError(f"the controller did not come back within {timeout_s} s")
            if added is None and time.monotonic() - removed_at >= replace_after_s:
                added = cluster.label(cluster.add_worker().node_id)
            try:
                # The actor's process may answer for a moment after its raylet is killed.
                back_on = controller_node(t.app_name, timeout_s=1.0)
                back_on = None if back_on == victim else back_on
            except Exception:  # the node's death not yet noticed, or the actor restarting
                pass
            if back_on is None:
                modes_while_away.extend(_live_modes(t))
                time.sleep(0.2)
        controller_back_s = round(time.monotonic() - removed_at, 1)
        if added is None:
            time.sleep(max(0.0, replace_after_s - (time.monotonic() - removed_at)))
            added = cluster.label(cluster.add_worker().node_id)
        _wait_back(t, mode, replicas, timeout_s)
        recovery_s = round(time.monotonic() - removed_at, 1)
        during = load.tally.completed - at_removal
        time.sleep(1.0)
    after = placement(t, cluster)
    s = t.status()
    t.force({"mode": "auto"}).raise_for_status()
    return _result(
        "node_controller",
        load.tally,
        started,
        mode=mode,
        mode_after=s["num_steps"],
        version_before=version,
        version_after=s["version"],
        removed_node=removed,
        in_flight_at_removal=in_flight,
        controller_back_on=cluster.label(back_on),
        controller_back_s=controller_back_s,
        replacement_node=added,
        recovery_s=recovery_s,
        modes_while_away=sorted(set(modes_while_away)),
        mode_samples_while_away=len(modes_while_away),
        completed_during_recovery=during,
        placement_before=before,
        placement_after=after,
    )


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
    cluster = LocalCluster(workers) if workers >= 1 else None
    # A cluster of our own is set up already (LocalCluster); a local Ray is started here.
    where = (
        {"address": cluster.address} if cluster else {"include_dashboard": False, "object_store_memory": 500 * 2**20}
    )
    ray.init(log_to_driver=False, namespace="specserve-faults", **where)
    port = _free_port()
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
    keys = ("sent", "completed", "failed", "retried", "cut")
    extra = {k: v for k, v in r.items() if k not in (*keys, "scenario", "errors", "mismatched")}
    counts = " ".join(f"{k}={r[k]}" for k in keys)
    errors = f"\n  first errors: {r['errors'][:3]}" if r["errors"] else ""
    return f"{r['scenario']:<16} {counts}  {json.dumps(extra)}{errors}"


def _engine_of(path: str) -> dict:
    """``args.engine`` of the first application in a Serve config YAML."""
    import yaml

    with open(path) as f:
        config = yaml.safe_load(f)
    try:
        return config["applications"][0]["args"]["engine"]
    except (KeyError, IndexError, TypeError):
        raise SystemExit(f"--config {path}: no applications[0].args.engine in it") from None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
