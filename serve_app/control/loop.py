"""The control loop, plain Python (time is an argument): it aggregates the replicas' reports
into the cluster queue, asks :func:`serve_app.control.policy.decide`, records switch events
and measures how long each switch takes to reach every replica. The simulator drives it
directly; :mod:`serve_app.control.actor` runs it in a Ray actor.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from serve_app.control.config import ControllerOptions, PolicyConfig
from serve_app.control.policy import Decision, LoadSample, ModeState, decide


@dataclass(slots=True)
class ReplicaReport:
    """The last load report of one replica."""

    replica_id: str
    time: float
    waiting: int
    running: int
    num_steps: int
    applied_version: int
    output_tokens_per_s: float = 0.0
    accept_rate: float = 0.0
    active_num_steps: int | None = None
    mean_num_steps: float | None = None
    """Where the engine picks each step's draft length under ``num_steps`` (its ceiling): the
    mean it ran over its last seconds."""
    step_policy: str | None = None
    """fixed: the engine drafts ``num_steps`` every decode step; adaptive: ``num_steps`` is its
    ceiling."""
    step_choices: dict | None = None
    """Where the engine picks each step's draft length: what it picks from (EngineLoad.step_choices)."""
    switch_failures: int = 0
    last_switch_error: str | None = None


@dataclass(slots=True)
class SwitchEvent:
    """One mode switch: when, from what, to what, why, at what load, and how fast it spread."""

    time: float
    from_steps: int
    to_steps: int
    reason: str
    version: int
    load: float | None = None
    detail: str = ""
    propagation_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["from"], d["to"] = d.pop("from_steps"), d.pop("to_steps")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SwitchEvent:
        d = dict(d)
        d["from_steps"], d["to_steps"] = d.pop("from"), d.pop("to")
        return cls(**d)


@dataclass(slots=True)
class _Pending:
    """A switch on its way to the replicas that were live when it was decided."""

    event: SwitchEvent
    waiting_for: set[str]


class ControlLoop:
    """The controller's state and logic, without Ray."""

    def __init__(self, policy: PolicyConfig, options: ControllerOptions):
        self.policy = policy
        self.configured_policy = policy
        self.options = options
        self.num_steps = policy.spec_steps
        self.override: int | None = None
        self.version = 0
        self.last_switch_time: float | None = None
        self.events: deque[SwitchEvent] = deque(maxlen=options.max_events)
        self.replicas: dict[str, ReplicaReport] = {}
        self.samples: deque[LoadSample] = deque()
        self.last_decision: Decision | None = None
        self._pending: list[_Pending] = []
        self._propagated: list[SwitchEvent] = []

    @property
    def mode(self) -> str:
        return "auto" if self.override is None else "fixed"

    # -- replicas ---------------------------------------------------------------------------

    def report(self, report: ReplicaReport) -> tuple[int, int]:
        """Take a replica's load report; answer the current (version, num_steps)."""
        self.replicas[report.replica_id] = report
        self.ack(report.replica_id, report.applied_version, report.time)
        return self.version, self.num_steps

    def ack(self, replica_id: str, version: int, now: float) -> None:
        """A replica says it runs the mode of ``version`` (or a later one)."""
        for pending in self._pending:
            if pending.event.version <= version:
                pending.waiting_for.discard(replica_id)
        self._settle(now)

    def live_replicas(self, now: float) -> list[ReplicaReport]:
        """Replicas whose last report is fresh; the others drop out of the cluster queue."""
        fresh = now - self.options.stale_after_s
        return [r for r in self.replicas.values() if r.time >= fresh]

    def cluster_queue(self, now: float) -> tuple[float, int]:
        """(waiting + running summed over live replicas, number of live replicas)."""
        live = self.live_replicas(now)
        return float(sum(r.waiting + r.running for r in live)), len(live)

    # -- decisions --------------------------------------------------------------------------

    def tick(self, now: float) -> SwitchEvent | None:
        """Sample the cluster queue, forget dead replicas, ask the policy; returns a switch if any."""
        live = {r.replica_id for r in self.live_replicas(now)}
        for rid in [rid for rid in self.replicas if rid not in live]:
            if self.replicas[rid].time < now - 10 * self.options.stale_after_s:
                del self.replicas[rid]
        for pending in self._pending:
            pending.waiting_for &= live
        self._settle(now)

        queue, n = self.cluster_queue(now)
        self.samples.append(LoadSample(now, queue, n))
        while self.samples and self.samples[0].time < now - self.policy.history_s:
            self.samples.popleft()
        return self._decide(now)

    def _decide(self, now: float) -> SwitchEvent | None:
        state = ModeState(self.num_steps, self.last_switch_time, self.override)
        decision = decide(state, list(self.samples), now, self.policy)
        self.last_decision = decision
        if not decision.switch:
            return None
        return self._switch(decision, now)

    def _switch(self, decision: Decision, now: float) -> SwitchEvent:
        self.version += 1
        event = SwitchEvent(
            now, self.num_steps, decision.num_steps, decision.reason, self.version, decision.load, decision.detail
        )
        self.num_steps = decision.num_steps
        self.last_switch_time = now
        self.events.append(event)
        live = {r.replica_id for r in self.live_replicas(now)}
        if live:
            self._pending.append(_Pending(event, live))
        return event

    def _settle(self, now: float) -> None:
        for p in self._pending:
            if not p.waiting_for:
                p.event.propagation_s = now - p.event.time
                self._propagated.append(p.event)
        self._pending = [p for p in self._pending if p.waiting_for]

    def pop_propagated(self) -> list[SwitchEvent]:
        """Switches that reached every replica since the last call."""
        done, self._propagated = self._propagated, []
        return done

    # -- operator ---------------------------------------------------------------------------

    def set_mode(self, mode: str, num_steps: int | None, now: float) -> SwitchEvent | None:
        """``fixed`` pins ``num_steps`` (default: the current one); ``auto`` hands back to the policy."""
        if mode == "fixed":
            self.override = self.num_steps if num_steps is None else num_steps
        elif mode == "auto":
            self.override = None
        else:
            raise ValueError(f"mode must be 'auto' or 'fixed', got {mode!r}")
        return self._decide(now)

    def set_policy(self, patch: dict[str, Any], now: float) -> SwitchEvent | None:
        """Change policy fields at run time (``tiers`` is replaced whole). Raises ValidationError.

        A change of ``engine_step_policy`` is a switch of its own (reason ``step_policy``, the
        same num_steps): it gets a version, so the replicas hear of it the way they hear of a
        new num_steps. Returns the last switch, if any."""
        before = self.policy.engine_step_policy
        self.policy = PolicyConfig.model_validate({**self.policy.model_dump(), **patch})
        event = None
        if self.policy.engine_step_policy != before:
            step_policy = self.policy.engine_step_policy or "configured"
            last = self.last_switch_time  # not a change of num_steps: the ladder's timing stays
            event = self._switch(Decision(self.num_steps, True, "step_policy", None,
                                          f"engines' step_policy {before or 'configured'} -> {step_policy}"), now)
            self.last_switch_time = last
        return self._decide(now) or event

    @property
    def mode_tuple(self) -> tuple[int, int, str | None]:
        """What the replicas apply: (version, num_steps, engine_step_policy)."""
        return self.version, self.num_steps, self.policy.engine_step_policy

    # -- reading and persistence -----------------------------------------------------------

    def propagation_stats(self) -> dict[str, Any]:
        times = sorted(e.propagation_s for e in self.events if e.propagation_s is not None)
        if not times:
            return {"count": 0, "p50_s": None, "p99_s": None, "max_s": None}

        def pct(q: float) -> float:
            return times[min(len(times) - 1, int(q * len(times)))]

        return {"count": len(times), "p50_s": pct(0.5), "p99_s": pct(0.99), "max_s": times[-1]}

    def status(self, now: float) -> dict[str, Any]:
        """The body of ``GET /v1/speculation``."""
        queue, n = self.cluster_queue(now)
        d = self.last_decision
        return {
            "mode": self.mode,
            "num_steps": self.num_steps,
            "override": self.override,
            "version": self.version,
            "cluster_queue": queue,
            "load_per_replica": queue / n if n else None,
            "replicas": [
                {
                    "id": r.replica_id,
                    "num_steps": r.num_steps,
                    "step_policy": r.step_policy,
                    "active_num_steps": r.num_steps if r.active_num_steps is None else r.active_num_steps,
                    "mean_num_steps": r.mean_num_steps,
                    "step_choices": r.step_choices,
                    "applied_version": r.applied_version,
                    "waiting": r.waiting,
                    "running": r.running,
                    "output_tokens_per_s": r.output_tokens_per_s,
                    "accept_rate": r.accept_rate,
                    "switch_failures": r.switch_failures,
                    "last_switch_error": r.last_switch_error,
                    "report_age_s": round(now - r.time, 3),
                }
                for r in sorted(self.live_replicas(now), key=lambda r: r.replica_id)
            ],
            "events": [e.to_dict() for e in self.events],
            "policy": self.policy.model_dump(),
            "last_decision": None if d is None else {"reason": d.reason, "detail": d.detail, "load": d.load},
            "propagation": self.propagation_stats(),
            "time": now,
        }

    def to_persisted(self) -> dict[str, Any]:
        """What survives a restart: mode, override, policy, version and events."""
        return {
            "num_steps": self.num_steps,
            "override": self.override,
            "version": self.version,
            "last_switch_time": self.last_switch_time,
            "policy": self.policy.model_dump(),
            "configured_policy": self.configured_policy.model_dump(),
            "events": [e.to_dict() for e in self.events],
        }

    @classmethod
    def from_persisted(cls, data: dict[str, Any], policy: PolicyConfig, options: ControllerOptions) -> ControlLoop:
        """Rebuild the loop. If the application's configured policy changed since the state was
        saved (a redeploy with new args), the new configured policy wins over run-time edits."""
        loop = cls(policy, options)
        if PolicyConfig.model_validate(data["configured_policy"]) == policy:
            loop.policy = PolicyConfig.model_validate(data["policy"])
        loop.num_steps = data["num_steps"]
        loop.override = data["override"]
        loop.version = data["version"]
        loop.last_switch_time = data["last_switch_time"]
        loop.events.extend(SwitchEvent.from_dict(e) for e in data["events"])
        return loop
