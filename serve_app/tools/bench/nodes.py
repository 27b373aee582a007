"""A multi-node Ray cluster on this machine, and the node-loss scenarios of ``bench faults``:
``node_replica`` (lose a worker node that holds a replica) and ``node_controller`` (lose the
worker node that holds the controller)."""

from __future__ import annotations

import time

import httpx

from .fault_load import Load, Target, result


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


def _busy_node(t: Target, eligible, want: int = 2, wait_s: float = 10.0) -> tuple[str | None, int]:
    """The node of the busiest replica on one of the ``eligible`` nodes, and the requests it
    holds; waits up to ``wait_s`` for one that holds ``want`` (a node lost idle tests nothing,
    and a lone request may finish between this look and the removal), then takes the busiest
    at that moment."""
    deadline = time.monotonic() + wait_s
    while True:
        infos = [i for i in t.replica_infos() if eligible(i["node_id"])]
        best = max(infos, key=lambda i: i["load"]["running"] + i["load"]["waiting"], default=None)
        held = 0 if best is None else best["load"]["running"] + best["load"]["waiting"]
        if held >= want or time.monotonic() > deadline:
            return (None if best is None else best["node_id"]), held
        time.sleep(0.05)


def _forced(t: Target, cluster: LocalCluster, replicas: int, max_tokens: int, mode: int) -> tuple[dict, dict]:
    """The reference outputs, then every replica forced into ``mode``; where the actors run then."""
    ref = t.reference(max_tokens, replicas)
    t.force({"mode": "fixed", "num_steps": mode}).raise_for_status()
    t.wait_converged(mode, replicas)
    return ref, placement(t, cluster)


def _recover(t: Target, cluster: LocalCluster, load: Load, at_removal: int, removed_at: float, added: str | None,
             mode: int, replicas: int, replace_after_s: float, timeout_s: float) -> dict:
    """A fresh worker ``replace_after_s`` after the removal (unless one was ``added``), then
    until every replica runs ``mode`` again: the figures of the recovery."""
    if added is None:
        time.sleep(max(0.0, replace_after_s - (time.monotonic() - removed_at)))
        added = cluster.label(cluster.add_worker().node_id)
    _wait_back(t, mode, replicas, timeout_s)
    figures = {
        "replacement_node": added,
        "recovery_s": round(time.monotonic() - removed_at, 1),
        "completed_during_recovery": load.tally.completed - at_removal,
    }
    time.sleep(1.0)
    return figures


def _after(t: Target, cluster: LocalCluster, name: str, load: Load, started: float, mode: int, **extra) -> dict:
    """The scenario's result once its load stopped; back to auto mode."""
    after, s = placement(t, cluster), t.status()
    t.force({"mode": "auto"}).raise_for_status()
    return result(name, load.tally, started, mode=mode, mode_after=s["num_steps"], version_after=s["version"],
                  **extra, placement_after=after)


def node_replica(t: Target, cluster: LocalCluster, replicas: int, clients: int = 4, max_tokens: int = 32,
                 mode: int = 2, replace_after_s: float = 5.0, timeout_s: float = 300) -> dict:
    """Under load in a forced ``mode``, remove the worker node of the busiest replica that does
    not hold the controller (when it holds requests); after ``replace_after_s`` a fresh worker
    joins. Serving must go on, and every replica must run ``mode`` again."""
    started = time.monotonic()
    ref, before = _forced(t, cluster, replicas, max_tokens, mode)
    ctl = controller_node(t.app_name)
    with Load(t.prefix, clients, max_tokens, ref) as load:
        time.sleep(2.0)
        victim, in_flight = _busy_node(t, lambda n: n not in (ctl, cluster.head_id))
        if victim is None:
            raise RuntimeError(f"no worker node holds a replica without the controller: {before}")
        at_removal, removed_at = load.tally.completed, time.monotonic()
        removed = cluster.remove(victim)
        recovery = _recover(t, cluster, load, at_removal, removed_at, None, mode, replicas, replace_after_s, timeout_s)
    return _after(t, cluster, "node_replica", load, started, mode, removed_node=removed,
                  in_flight_at_removal=in_flight, **recovery, placement_before=before)


def node_controller(t: Target, cluster: LocalCluster, replicas: int, clients: int = 4, max_tokens: int = 32,
                 mode: int = 3, replace_after_s: float = 5.0, timeout_s: float = 300) -> dict:
    """Under load in a forced ``mode``, remove the worker node that holds the controller. The
    controller must come back on a live node with the saved mode (nobody forces it again), the
    replicas on live nodes must keep ``mode`` while it is away, and after a fresh worker joins
    every replica must run ``mode``."""
    started = time.monotonic()
    ref, before = _forced(t, cluster, replicas, max_tokens, mode)
    version = t.status()["version"]
    victim = controller_node(t.app_name)
    if victim == cluster.head_id:
        raise RuntimeError("the controller runs on the head node, which cannot be removed: place it on a worker")
    modes_while_away: list[int] = []
    with Load(t.prefix, clients, max_tokens, ref) as load:
        time.sleep(2.0)
        in_flight = _busy_node(t, lambda n: n == victim)[1]  # its replica's requests, if it has one
        at_removal, removed_at = load.tally.completed, time.monotonic()
        removed = cluster.remove(victim)
        back_on, added = None, None
        while back_on is None:
            if time.monotonic() - removed_at > timeout_s:
                raise TimeoutError(f"the controller did not come back within {timeout_s} s")
            if added is None and time.monotonic() - removed_at >= replace_after_s:
                added = cluster.label(cluster.add_worker().node_id)
            # Sampled before each look for the controller: Ray may restart it on a live node
            # within the first look, and the replicas' modes right after the removal count.
            modes_while_away.extend(_live_modes(t))
            try:
                # The actor's process may answer for a moment after its raylet is killed.
                back_on = controller_node(t.app_name, timeout_s=1.0)
                back_on = None if back_on == victim else back_on
            except Exception:  # the node's death not yet noticed, or the actor restarting
                pass
            if back_on is None:
                time.sleep(0.2)
        controller_back_s = round(time.monotonic() - removed_at, 1)
        recovery = _recover(t, cluster, load, at_removal, removed_at, added, mode, replicas, replace_after_s, timeout_s)
    return _after(t, cluster, "node_controller", load, started, mode, version_before=version, removed_node=removed,
                  in_flight_at_removal=in_flight, controller_back_on=cluster.label(back_on),
                  controller_back_s=controller_back_s, **recovery, modes_while_away=sorted(set(modes_while_away)),
                  mode_samples_while_away=len(modes_while_away), placement_before=before)
