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


def make_drafter(name: str, **kwargs) -> Drafter:
    if name == "ngram":
        return NgramDrafter(max_n=kwargs.get("ngram_max", 3), min_n=kwargs.get("ngram_min", 1))
    if name == "eagle":
        from .eagle import make_eagle_drafter

        return make_eagle_drafter(kwargs["model"], kwargs.get("draft_head"), kwargs["model_name"],
                                  kwargs["max_num_seqs"], kwargs["capacity"])
    raise ValueError(f"unknown drafter {name!r}")
