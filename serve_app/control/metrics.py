"""The Ray metrics the controller exports (docs/metrics.md lists every metric).

Ray exports these with a ``ray_`` prefix (counters also get ``_total``) and labels every
series with its WorkerId. Metrics are created per process on first use.
"""

from __future__ import annotations

from functools import cache

from ray.util.metrics import Counter, Gauge, Histogram

# Switch propagation is ~ms.
PROPAGATION_BOUNDARIES_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
DECISION_BOUNDARIES_S = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1]


class ControllerMetrics:
    """What the controller exports: the cluster's mode, load and switches."""

    def __init__(self, app: str):
        self._tags = {"app": app}
        # Ray drops a gauge from its export once it goes unset for a while: the switch times
        # are set again on every tick (observe_state), not only when a switch happens.
        self._switch_times: dict[tuple[str, str, str], float] = {}
        self.num_steps = Gauge(
            "specserve_cluster_num_steps", "Draft steps the controller asks every replica to run.", ("app",)
        )
        self.cluster_queue = Gauge(
            "specserve_cluster_queue", "Waiting + running requests over live replicas.", ("app",)
        )
        self.live_replicas = Gauge("specserve_live_replicas", "Replicas with a fresh load report.", ("app",))
        self.switches = Counter(
            "specserve_switches", "Mode switches decided by the controller.", ("app", "from", "to", "reason")
        )
        self.last_switch_time = Gauge(
            "specserve_last_switch_timestamp_seconds", "Unix time of the last mode switch.", ("app",)
        )
        # One series per kind of switch, its value the time of the latest such switch: a
        # Grafana annotation query with useValueForTime draws one marker per switch from it
        # (a counter's first increment is invisible to increase()).
        self.switch_time = Gauge(
            "specserve_switch_timestamp_seconds",
            "Unix time of the latest switch of this kind (from, to, reason).",
            ("app", "from", "to", "reason"),
        )
        self.load_per_replica = Gauge(
            "specserve_load_per_replica", "Cluster queue over live replicas: what the policy compares.", ("app",)
        )
        self.tier_bound = Gauge(
            "specserve_policy_tier_bound",
            "Upper load-per-replica bound of a tier of the current policy (the last tier has none).",
            ("app", "tier", "num_steps"),
        )
        self.decision = Histogram(
            "specserve_controller_decision_seconds",
            "Time one controller tick takes to aggregate reports and decide.",
            DECISION_BOUNDARIES_S,
            ("app",),
        )
        self.grafana_annotations = Counter(
            "specserve_grafana_annotations",
            "HTTP annotations sent to Grafana, by result (sent, failed, dropped).",
            ("app", "result"),
        )
        self.propagation = Histogram(
            "specserve_switch_propagation_seconds",
            "Time from a switch decision to its application on the last live replica.",
            PROPAGATION_BOUNDARIES_S,
            ("app",),
        )

    def observe_state(
        self, num_steps: int, queue: float, replicas: int, tier_bounds: list[tuple[float, int]] = ()
    ) -> None:
        """The tick's state; ``tier_bounds`` is the policy's (below, num_steps) per bounded tier."""
        self.num_steps.set(num_steps, self._tags)
        self.cluster_queue.set(queue, self._tags)
        self.live_replicas.set(replicas, self._tags)
        if replicas:
            self.load_per_replica.set(queue / replicas, self._tags)
        for i, (below, steps) in enumerate(tier_bounds):
            self.tier_bound.set(below, {**self._tags, "tier": str(i), "num_steps": str(steps)})
        for (from_steps, to_steps, reason), time_s in self._switch_times.items():
            self.switch_time.set(time_s, {**self._tags, "from": from_steps, "to": to_steps, "reason": reason})
        if self._switch_times:
            self.last_switch_time.set(max(self._switch_times.values()), self._tags)

    def observe_switch(self, from_steps: int, to_steps: int, reason: str, time_s: float) -> None:
        tags = {**self._tags, "from": str(from_steps), "to": str(to_steps), "reason": reason}
        self.switches.inc(1, tags)
        self._switch_times[(str(from_steps), str(to_steps), reason)] = time_s
        self.switch_time.set(time_s, tags)
        self.last_switch_time.set(time_s, self._tags)

    def observe_decision(self, seconds: float) -> None:
        self.decision.observe(seconds, self._tags)

    def observe_annotation(self, result: str) -> None:
        self.grafana_annotations.inc(1, {**self._tags, "result": result})

    def observe_propagation(self, seconds: float) -> None:
        self.propagation.observe(seconds, self._tags)


@cache
def controller_metrics(app: str) -> ControllerMetrics:
    return ControllerMetrics(app)
