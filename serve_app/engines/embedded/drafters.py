"""Drafters propose the tokens a speculative step verifies.

A drafter sees the sequences of one decode step and returns, for each, up to k proposed
next tokens. Drafters that read the target's hidden states (an EAGLE-style head) set
``needs_hidden`` (and ``feature_layers``: the layers whose inputs they read) and get every
target forward's hidden states through ``observe``; the engine calls it on every step,
speculative or not, so such a drafter's state never falls behind while speculation is off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch


class Drafter(Protocol):
    needs_hidden: bool
    feature_layers: tuple[int, ...] | None  # None: the final-norm hidden state

    def propose(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """Up to k draft tokens for each sequence (its full prompt + output so far)."""

    def observe(self, seq_ids: Sequence[str], hidden: torch.Tensor, num_valid: Sequence[int]) -> None:
        """The target's hidden states [B, q, ...] of a step; the first ``num_valid[b]`` positions
        of row b are now in the cache (a prefill chunk, or the fed token + accepted drafts)."""

    def release(self, seq_id: str) -> None:
        """A sequence finished; drop any state kept for it."""

    def backlog(self, seq_ids: Sequence[str]) -> list[int]:
        """Each sequence's positions the next ``propose`` runs its model over before it drafts
        (what was decoded since it last ran); 0 for a drafter that keeps no state."""


class NgramDrafter:
    """Prompt lookup: find the sequence's last n tokens earlier in it, propose what followed.

    Tries n from ``max_n`` down to ``min_n`` and takes the most recent earlier match. No
    weights and no state, so switching speculation off and on costs nothing.
    """

    needs_hidden = False
    feature_layers = None

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        return [self._lookup(np.asarray(ids, dtype=np.int64), k) for ids in token_ids]

    def _lookup(self, ids: np.ndarray, k: int) -> list[int]:
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            suffix = ids[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return ids[start:start + k].tolist()
        return []

    def observe(self, seq_ids, hidden, num_valid) -> None:
        pass

    def release(self, seq_id: str) -> None:
        pass

    def backlog(self, seq_ids: Sequence[str]) -> list[int]:
        return [0] * len(seq_ids)


class HybridDrafter:
    """Prompt lookup where it has a long match, the EAGLE-style head elsewhere.

    For each sequence of a step: when its last ``match_n`` tokens occur earlier in it (the
    answer is copying its prompt or itself), the lookup's continuation is the draft; otherwise
    the head drafts. The head observes every forward as it does alone, so a sequence it skipped
    for lookup steps only has more positions to catch up on when it drafts for it again
    (``backlog``). Lookup accepts far more than the head on copy-heavy answers and far less on
    open chat, where it rarely finds a long match.
    """

    needs_hidden = True

    def __init__(self, head: Drafter, match_n: int = 3):
        self.head, self.lookup = head, NgramDrafter(max_n=match_n, min_n=match_n)
        self.feature_layers = head.feature_layers
        self.counts = {"lookup": 0, "head": 0}  # sequences drafted by each, over the engine's life

    def propose(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        if k <= 0 or not seq_ids:
            return [[] for _ in seq_ids]
        drafts = self.lookup.propose(seq_ids, token_ids, k)
        rest = [b for b, d in enumerate(drafts) if not d]
        if rest:
            for b, d in zip(rest, self.head.propose([seq_ids[b] for b in rest], [token_ids[b] for b in rest], k),
                            strict=True):
                drafts[b] = d
        self.counts["head"] += len(rest)
        self.counts["lookup"] += len(seq_ids) - len(rest)
        return drafts

    def observe(self, seq_ids: Sequence[str], hidden: torch.Tensor, num_valid: Sequence[int]) -> None:
        self.head.observe(seq_ids, hidden, num_valid)

    def release(self, seq_id: str) -> None:
        self.head.release(seq_id)

    def backlog(self, seq_ids: Sequence[str]) -> list[int]:
        return self.head.backlog(seq_ids)


def make_drafter(name: str, **kwargs) -> Drafter:
    if name == "ngram":
        return NgramDrafter(max_n=kwargs.get("ngram_max", 3), min_n=kwargs.get("ngram_min", 1))
    if name in ("eagle", "hybrid"):
        from .eagle import make_eagle_drafter

        head = make_eagle_drafter(kwargs["model"], kwargs.get("draft_head"), kwargs["model_name"],
                                  kwargs["max_num_seqs"], kwargs["capacity"])
        return head if name == "eagle" else HybridDrafter(head, kwargs.get("ngram_max", 3))
    raise ValueError(f"unknown drafter {name!r}")
