"""The step policy the plugin gives SGLang's ``AdaptiveController``: it obeys the controller.

SGLang's own policy (``AdaptiveSpeculativeParams``) picks steps from an acceptance EMA per
batch-size slot. Ours implements the same ``AdaptiveSpecPolicy`` protocol
(srt/speculative/adaptive_runtime_state.py) but returns the step count the specserve
controller commanded, optionally capped to 0 above a local batch-size guard, and only
records acceptance. Pure Python: no sglang import, tested on CPU against the real controller.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

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


class CommandedStepsPolicy:
    """An ``AdaptiveSpecPolicy`` that returns the commanded step count.

    SGLang calls ``get_steps_for_batch`` before every decode batch and swaps runtime states
    when the answer changes, so a command takes effect at the next decode batch on every TP
    rank (each rank runs its own copy, commanded by the same collective RPC).
    """

    def __init__(self, candidate_steps: list[int], initial_steps: int):
        self._candidate_steps = sorted(set(candidate_steps))
        if initial_steps not in self._candidate_steps:
            raise ValueError(f"initial steps {initial_steps} not in candidate steps {self._candidate_steps}")
        self.commanded = initial_steps
        self.max_batch_size: int | None = None
        self.active = initial_steps
        self.stats = AcceptanceStats()
        self._cuda_graph_bs: list[int] | None = None

    # -- specserve side -------------------------------------------------------------------

    def command(self, num_steps: int, max_batch_size: int | None = None) -> None:
        """Set the step count for the next decode batches (and the batch-size guard)."""
        if num_steps not in self._candidate_steps:
            raise ValueError(f"num_steps {num_steps} is not a candidate step count {self._candidate_steps}")
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

    # -- AdaptiveSpecPolicy ---------------------------------------------------------------

    @property
    def candidate_steps(self) -> list[int]:
        return list(self._candidate_steps)

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        # Any step count may be commanded at any batch size: capture every batch size for every step.
        return None if self._cuda_graph_bs is None else list(self._cuda_graph_bs)

    def get_steps_for_batch(self, batch_size: int) -> int:
        guarded = self.max_batch_size is not None and batch_size > self.max_batch_size
        self.active = self._candidate_steps[0] if guarded else self.commanded
        return self.active

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> int | None:
        self.stats.record(self.active, num_correct_drafts_per_req)
        return None  # never switches on its own
