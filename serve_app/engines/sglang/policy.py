"""The step policy the plugin gives SGLang's ``AdaptiveController``: it obeys the controller.

SGLang's own policy (``AdaptiveSpeculativeParams``) picks steps from an acceptance EMA per
batch-size slot. Ours implements the same ``AdaptiveSpecPolicy`` protocol
(srt/speculative/adaptive_runtime_state.py) but returns the step count the specserve
controller commanded, optionally capped to 0 above a local batch-size guard, and only
records acceptance. Pure Python: no sglang import, tested on CPU against the real controller.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class AcceptanceStats:
    """Per step count: decode verifies, requests verified, draft tokens accepted."""

    verifies: dict[int, int] = field(default_factory=dict)
    requests: dict[int, int] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)

    def record(self, num_steps: int, num_correct_drafts_per_req: list[int]) -> None:
        self.verifies[num_steps] = self.verifies.get(num_steps, 0) + 1
        self.requests[num_steps] = self.requests.get(num_steps, 0) + len(num_correct_drafts_per_req)
        self.accepted[num_steps] = self.accepted.get(num_steps, 0) + sum(num_correct_drafts_per_req)

    def mean_accepted(self, num_steps: int) -> float:
        """Mean accepted draft tokens per request per step at ``num_steps`` (0.0 if never run)."""
        return self.accepted.get(num_steps, 0) / max(1, self.requests.get(num_steps, 0))


class RecentAcceptance:
    """Acceptance over the last ``window_s`` of verifies at k > 0 steps, as the embedded engine
    reports it (SGLang's load snapshot averages over the engine's lifetime, across step counts)."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self.events: deque[tuple[float, int, int, int]] = deque()  # time, requests, proposed, accepted

    def record(self, num_steps: int, num_correct_drafts_per_req: list[int], now: float) -> None:
        if num_steps > 0:
            n = len(num_correct_drafts_per_req)
            self.events.append((now, n, num_steps * n, sum(num_correct_drafts_per_req)))
        while self.events and self.events[0][0] < now - self.window_s:
            self.events.popleft()

    def snapshot(self, now: float) -> dict[str, int]:
        """Requests verified, and draft tokens proposed and accepted, in the window."""
        live = [e for e in self.events if e[0] >= now - self.window_s]
        return {k: sum(e[i] for e in live) for i, k in enumerate(("verified", "proposed", "accepted"), 1)}


class StatePublisher:
    """Writes what one scheduler's policy runs to ``<folder>/<pid>.json`` (atomic replace), at
    each change of the steps commanded or run and at most every ``interval_s`` otherwise.

    ``collective_rpc`` cannot return data, so this is how the engine learns the steps SGLang
    really ran and the recent acceptance. A write that fails is logged once and never reaches
    SGLang's scheduler loop.
    """

    def __init__(self, folder: str | Path | None, interval_s: float = 0.25):
        self.path = Path(folder) / f"{os.getpid()}.json" if folder else None
        self.interval_s = interval_s
        self._last_at = float("-inf")
        self._last_seen: tuple[int, int] | None = None
        self._failed = False

    def maybe_publish(self, policy: CommandedStepsPolicy, now: float) -> None:
        seen = (policy.commanded, policy.active)
        if self.path is None or (seen == self._last_seen and now - self._last_at < self.interval_s):
            return
        self._last_at, self._last_seen = now, seen
        state = {
            "pid": os.getpid(),
            "time": time.time(),
            "commanded": policy.commanded,
            "active": policy.active,
            "max_batch_size": policy.max_batch_size,
            "last_batch_size": policy.last_batch_size,
            "recent": policy.recent.snapshot(now),
            "window_s": policy.recent.window_s,
        }
        try:
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.path)
        except OSError as e:
            if not self._failed:
                logger.warning("specserve: cannot publish the policy's state to %s: %s", self.path, e)
            self._failed = True


def read_states(folder: Path) -> list[dict]:
    """Every scheduler's published state (one per TP rank), freshest first; unreadable ones skipped."""
    states = []
    for path in Path(folder).glob("*.json"):
        try:
            states.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # a rank that has not written yet, or a file being replaced
            continue
    return sorted(states, key=lambda s: s.get("time", 0.0), reverse=True)


class CommandedStepsPolicy:
    """An ``AdaptiveSpecPolicy`` that returns the commanded step count, or, while ``adaptive``
    (``step_policy: adaptive``), what SGLang's own acceptance-EMA policy (``sglang_policy``)
    picks for the batch size, capped at the command: the command is then a ceiling.

    SGLang calls ``get_steps_for_batch`` before every decode batch and swaps runtime states
    when the answer changes, so a command takes effect at the next decode batch on every TP
    rank (each rank runs its own copy, commanded by the same collective RPC).
    """

    def __init__(self, candidate_steps: list[int], initial_steps: int, publisher: StatePublisher | None = None,
                 sglang_policy=None, adaptive: bool = False):
        if adaptive and sglang_policy is None:
            raise ValueError("adaptive steps need SGLang's own policy")
        self.sglang_policy, self.adaptive = sglang_policy, adaptive
        self._candidate_steps = sorted(set(candidate_steps))
        if initial_steps not in self._candidate_steps:
            raise ValueError(f"initial steps {initial_steps} not in candidate steps {self._candidate_steps}")
        self.commanded = initial_steps
        self.max_batch_size: int | None = None
        self.active = initial_steps
        self.last_batch_size = 0
        self.stats = AcceptanceStats()
        self.recent = RecentAcceptance()
        self._publisher = publisher or StatePublisher(None)
        self._cuda_graph_bs: list[int] | None = None

    # -- specserve side -------------------------------------------------------------------

    @property
    def inner(self):
        """SGLang's policy while it picks under the ceiling; else None."""
        return self.sglang_policy if self.adaptive else None

    def command(self, num_steps: int, max_batch_size: int | None = None, adaptive: bool | None = None) -> None:
        """Set the step count for the next decode batches (and the batch-size guard); with
        ``adaptive`` given, whether SGLang's policy picks under it from now on."""
        if num_steps not in self._candidate_steps:
            raise ValueError(f"num_steps {num_steps} is not a candidate step count {self._candidate_steps}")
        if adaptive is not None:
            if adaptive and self.sglang_policy is None:
                raise ValueError("adaptive steps need SGLang's own policy, which this controller did not build")
            self.adaptive = adaptive
        if num_steps != self.commanded:
            logger.info(
                "specserve: num_steps %d -> %d (accepted %.2f drafts/request/step at %d)",
                self.commanded,
                num_steps,
                self.stats.mean_accepted(self.commanded),
                self.commanded,
            )
        self.commanded = num_steps
        self.max_batch_size = max_batch_size
        self._publisher.maybe_publish(self, time.monotonic())

    # -- AdaptiveSpecPolicy ---------------------------------------------------------------

    @property
    def candidate_steps(self) -> list[int]:
        return list(self._candidate_steps)

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None
        if self.sglang_policy is not None and hasattr(self.sglang_policy, "set_cuda_graph_bs"):
            self.sglang_policy.set_cuda_graph_bs(cuda_graph_bs)  # it pads batch sizes to the captured ones

    def _under_ceiling(self, steps: int) -> int:
        """The largest candidate at most ``steps`` and the command."""
        cap = min(steps, self.commanded)
        return max((s for s in self._candidate_steps if s <= cap), default=self._candidate_steps[0])

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        # Any step count may be commanded at any batch size: capture every batch size for every step.
        return None if self._cuda_graph_bs is None else list(self._cuda_graph_bs)

    def get_steps_for_batch(self, batch_size: int) -> int:
        guarded = self.max_batch_size is not None and batch_size > self.max_batch_size
        if guarded:
            self.active = self._candidate_steps[0]
        elif self.inner is not None:
            self.active = self._under_ceiling(self.inner.get_steps_for_batch(batch_size))
        else:
            self.active = self.commanded
        self.last_batch_size = batch_size
        self._publisher.maybe_publish(self, time.monotonic())
        return self.active

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> int | None:
        self.stats.record(self.active, num_correct_drafts_per_req)
        self.recent.record(self.active, num_correct_drafts_per_req, time.monotonic())
        if self.inner is None:
            return None  # never switches on its own
        # SGLang's EMA sees what ran; capped by the ceiling, it sees at most the ceiling's drafts.
        moved = self.inner.on_verify_complete(num_correct_drafts_per_req, batch_size)
        if moved is None or self.max_batch_size is not None and batch_size > self.max_batch_size:
            return None
        steps = self._under_ceiling(moved)
        if steps == self.active:
            return None
        self.active = steps
        return steps
