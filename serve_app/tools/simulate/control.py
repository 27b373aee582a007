"""The control plane in simulated time: the project's own :class:`ControlLoop`, fed like
:class:`serve_app.control.actor.ModeController` feeds it.

Cluster-wide (:class:`ClusterControl`): every replica reports (waiting, running, mode) every
``report_interval_s`` at its own phase; a report reaches the controller ``report_delay_s``
later, carrying the time it was taken (as a replica stamps ``time.time()``). The controller
ticks every ``decision_interval_s``; a switch reaches each replica after ``broadcast_delay_s``
(× a uniform 0.5–1.5 jitter per replica), or sooner through the answer to its next report, as
on the real long-poll / report paths. A replica's acknowledgement travels back like a report.

Alone (:class:`LocalControl`): each replica runs its own ControlLoop over its own queue,
reported and ticked locally, and applies its own decisions at once.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from serve_app.control.config import ControllerOptions, PolicyConfig
from serve_app.control.loop import ControlLoop, ReplicaReport


class StaticControl:
    """A fixed mode on every replica (the ``spec`` and ``off`` policies)."""

    def __init__(self, n: int, num_steps: int):
        self.steps = np.full(n, num_steps, dtype=np.int64)
        self.switches = 0

    def step(self, t: float, waiting: np.ndarray, running: np.ndarray) -> None:
        pass


class ClusterControl:
    """One ControlLoop for the whole cluster, with report, tick and broadcast delays."""

    def __init__(
        self,
        policy: PolicyConfig,
        options: ControllerOptions,
        n: int,
        rng: np.random.Generator,
        report_delay_s: float = 0.005,
        broadcast_delay_s: float = 0.01,
        record: bool = False,
        report_answers: bool = True,
    ):
        self.loop = ControlLoop(policy, options)
        self.n, self.rng, self.record = n, rng, record
        self.interval = options.report_interval_s
        self.report_delay, self.broadcast_delay = report_delay_s, broadcast_delay_s
        self.report_answers = report_answers  # False: modes travel by broadcast only
        self.ids = [f"r{i}" for i in range(n)]
        self.next_report = rng.random(n) * self.interval  # each replica's report loop has its own phase
        self.steps = np.full(n, self.loop.num_steps, dtype=np.int64)
        self.version = np.zeros(n, dtype=np.int64)
        self.switches = 0
        self._seq = itertools.count()
        self._inbox: list = []  # (time, seq, kind, payload) on the way to the controller
        self._outbox: list = []  # (time, seq, replica, version, num_steps) on the way to replicas
        self.tick_interval = options.decision_interval_s
        self._send(self._inbox, self.tick_interval, "tick", None)
        self.reports: list[tuple[float, ReplicaReport]] = []  # (delivered at, report) when recording
        self.samples: list = []  # the LoadSample of every tick when recording

    def _send(self, box: list, at: float, *item) -> None:
        heapq.heappush(box, (at, next(self._seq), *item))

    def step(self, t: float, waiting: np.ndarray, running: np.ndarray) -> None:
        """Everything that happens up to time ``t``, given the replicas' queues at ``t``."""
        for r in np.nonzero(self.next_report <= t)[0]:
            rep = ReplicaReport(
                self.ids[r], t, int(waiting[r]), int(running[r]), int(self.steps[r]), int(self.version[r])
            )
            self._send(self._inbox, t + self.report_delay, "report", (int(r), rep))
            self.next_report[r] += self.interval * max(1, int((t - self.next_report[r]) // self.interval) + 1)
        while self._inbox and self._inbox[0][0] <= t:
            at, _, kind, payload = heapq.heappop(self._inbox)
            if kind == "report":
                r, rep = payload
                if self.record:
                    self.reports.append((at, rep))
                version, k = self.loop.report(rep)
                if self.report_answers and version > self.version[r]:
                    self._send(self._outbox, at + self.report_delay, r, version, k)
            elif kind == "ack":
                self.loop.ack(self.ids[payload[0]], payload[1], at)
            else:
                self._tick(at)
        while self._outbox and self._outbox[0][0] <= t:
            _, _, r, version, k = heapq.heappop(self._outbox)
            if version > self.version[r]:
                self.version[r], self.steps[r] = version, k
                self._send(self._inbox, t + self.report_delay, "ack", (r, version))

    def _tick(self, now: float) -> None:
        event = self.loop.tick(now)
        if self.record:
            self.samples.append(self.loop.samples[-1])
        if event is not None:
            self.switches += 1
            for r, u in enumerate(self.rng.uniform(0.5, 1.5, self.n)):
                self._send(self._outbox, now + self.broadcast_delay * u, r, event.version, event.to_steps)
        self._send(self._inbox, now + self.tick_interval, "tick", None)


class LocalControl:
    """Each replica decides alone from its own queue, with the same policy and loop."""

    def __init__(self, policy: PolicyConfig, options: ControllerOptions, n: int, rng: np.random.Generator):
        self.loops = [ControlLoop(policy, options) for _ in range(n)]
        self.interval = options.report_interval_s
        self.next_report = rng.random(n) * self.interval
        self.steps = np.array([lp.num_steps for lp in self.loops], dtype=np.int64)
        self.switches = 0

    def step(self, t: float, waiting: np.ndarray, running: np.ndarray) -> None:
        for r in np.nonzero(self.next_report <= t)[0]:
            loop = self.loops[r]
            loop.report(ReplicaReport("self", t, int(waiting[r]), int(running[r]), loop.num_steps, loop.version))
            if loop.tick(t) is not None:
                self.switches += 1
                self.steps[r] = loop.num_steps
            self.next_report[r] += self.interval * max(1, int((t - self.next_report[r]) // self.interval) + 1)
