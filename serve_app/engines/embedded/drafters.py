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

    def sources(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> list[str]:
        """What the next ``propose`` drafts each sequence with: ``"head"`` (a model, which first
        catches up on its ``backlog``, at a cost per position) or ``"lookup"`` (prompt lookup:
        no model, nothing to catch up on). Acceptance differs by source, so the adaptive
        chooser keeps an estimate per source, and prices the head for the head's rows only."""

    def lookup_drafts(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """What ``propose`` would draft now for sequences whose source is ``"lookup"``: no model
        runs and nothing is counted as drafted. The adaptive chooser scores such drafts against
        the tokens steps that do not draft decode instead (shadow drafts)."""


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
        return [self._lookup(ids, k) for ids in token_ids]

    def _lookup(self, ids: Sequence[int], k: int) -> list[int]:
        return self.continuation(ids, self.match(ids), k)

    @staticmethod
    def continuation(ids: Sequence[int], start: int | None, k: int) -> list[int]:
        """Up to k tokens from ``start`` (a ``match``); none where there is no match."""
        return [] if start is None else [int(t) for t in ids[start:start + k]]

    def match(self, ids: Sequence[int]) -> int | None:
        """Where the continuation of the most recent earlier occurrence of the sequence's last n
        tokens starts (n from ``max_n`` down to ``min_n``); None: no match."""
        arr = np.asarray(ids, dtype=np.int64)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if len(hits):
                return int(hits[-1]) + n
        return None

    def observe(self, seq_ids, hidden, num_valid) -> None:
        pass

    def release(self, seq_id: str) -> None:
        pass

    def backlog(self, seq_ids: Sequence[str]) -> list[int]:
        return [0] * len(seq_ids)

    def sources(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> list[str]:
        return ["lookup"] * len(seq_ids)

    def lookup_drafts(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        return self.propose(seq_ids, token_ids, k)


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
        self._matches: dict[str, tuple[int, int | None]] = {}  # seq -> (its length, match) of sources()

    def _match(self, seq_id: str, ids: Sequence[int]) -> int | None:
        """The lookup's match for the sequence as it stands, found once per step (``sources``
        and ``propose`` of one step share it)."""
        known = self._matches.get(seq_id)
        if known is None or known[0] != len(ids):
            known = self._matches[seq_id] = (len(ids), self.lookup.match(ids))
        return known[1]

    def sources(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> list[str]:
        return ["head" if self._match(s, ids) is None else "lookup" for s, ids in zip(seq_ids, token_ids, strict=True)]

    def propose(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        if k <= 0 or not seq_ids:
            return [[] for _ in seq_ids]
        starts = [self._match(s, ids) for s, ids in zip(seq_ids, token_ids, strict=True)]
        drafts = [self.lookup.continuation(ids, at, k) for ids, at in zip(token_ids, starts, strict=True)]
        rest = [b for b, at in enumerate(starts) if at is None]
        if rest:
            for b, d in zip(rest, self.head.propose([seq_ids[b] for b in rest], [token_ids[b] for b in rest], k),
                            strict=True):
                drafts[b] = d
        self.counts["head"] += len(rest)
        self.counts["lookup"] += len(seq_ids) - len(rest)
        return drafts

    def lookup_drafts(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        return [self.lookup.continuation(ids, self._match(s, ids), k) for s, ids in zip(seq_ids, token_ids, strict=True)]

    def observe(self, seq_ids: Sequence[str], hidden: torch.Tensor, num_valid: Sequence[int]) -> None:
        self.head.observe(seq_ids, hidden, num_valid)

    def release(self, seq_id: str) -> None:
        self._matches.pop(seq_id, None)
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
