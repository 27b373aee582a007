"""The Ray metrics each replica exports (docs/metrics.md lists every metric).

Ray exports these with a ``ray_`` prefix (counters also get ``_total``) and labels every
series with its WorkerId. Metrics are created per process on first use; the objects are
cheap to call from hot paths.
"""

from __future__ import annotations

from functools import cache

from ray.util.metrics import Counter, Gauge, Histogram

# TTFT and TPOT span CPU (slow) and GPU (fast) engines.
TTFT_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
TPOT_BOUNDARIES_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]


class ReplicaMetrics:
    """What each replica exports: its mode, its load and its requests' latency."""

    def __init__(self, app: str, replica: str):
        self._tags = {"app": app, "replica": replica}
        keys = ("app", "replica")
        self.num_steps = Gauge("specserve_replica_num_steps", "Draft steps commanded to this replica's engine.", keys)
        self.active_num_steps = Gauge(
            "specserve_replica_active_num_steps",
            "Draft steps this replica's engine ran in its last decode step (a local guard or the engine's own "
            "per-step choice may run fewer than commanded).",
            keys,
        )
        self.mean_num_steps = Gauge(
            "specserve_replica_mean_num_steps",
            "Mean draft steps of this replica's decode steps over the last seconds, where its engine picks them per "
            "step under the commanded ceiling (step_policy: adaptive); else the commanded steps.",
            keys,
        )
        self.switch_failures = Counter(
            "specserve_replica_switch_failures", "Mode switches the engine refused or did not answer in time.", keys
        )
        self.waiting = Gauge("specserve_replica_waiting", "Requests waiting in this replica's engine.", keys)
        self.running = Gauge("specserve_replica_running", "Requests running in this replica's engine.", keys)
        self.ttft = Histogram(
            "specserve_ttft_seconds", "Time to first token, at the replica.", TTFT_BOUNDARIES_S, ("app", "num_steps")
        )
        self.tpot = Histogram(
            "specserve_tpot_seconds",
            "Mean time per output token after the first, per request.",
            TPOT_BOUNDARIES_S,
            ("app", "num_steps"),
        )
        self.output_tokens = Counter("specserve_output_tokens", "Output tokens generated.", keys)
        self.output_tokens_per_s = Gauge(
            "specserve_replica_output_tokens_per_second", "This engine's recent output tokens per second.", keys
        )
        self.accept_rate = Gauge(
            "specserve_replica_accept_rate", "Fraction of draft tokens this engine accepted recently.", keys
        )

    def observe_load(
        self,
        num_steps: int,
        waiting: int,
        running: int,
        output_tokens_per_s: float = 0.0,
        accept_rate: float = 0.0,
        active_num_steps: int | None = None,
        mean_num_steps: float | None = None,
    ) -> None:
        self.num_steps.set(num_steps, self._tags)
        self.active_num_steps.set(num_steps if active_num_steps is None else active_num_steps, self._tags)
        ran = active_num_steps if mean_num_steps is None else mean_num_steps
        self.mean_num_steps.set(num_steps if ran is None else ran, self._tags)
        self.waiting.set(waiting, self._tags)
        self.running.set(running, self._tags)
        self.output_tokens_per_s.set(output_tokens_per_s, self._tags)
        self.accept_rate.set(accept_rate, self._tags)

    def observe_switch_failure(self) -> None:
        self.switch_failures.inc(1, self._tags)

    def observe_request(self, num_steps: int, ttft_s: float | None, tpot_s: float | None, output_tokens: int) -> None:
        tags = {"app": self._tags["app"], "num_steps": str(num_steps)}
        if ttft_s is not None:
            self.ttft.observe(ttft_s, tags)
        if tpot_s is not None:
            self.tpot.observe(tpot_s, tags)
        if output_tokens:
            self.output_tokens.inc(output_tokens, self._tags)


@cache
def replica_metrics(app: str, replica: str) -> ReplicaMetrics:
    return ReplicaMetrics(app, replica)
