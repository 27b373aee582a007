"""Who runs next: admission, chunked prefill, and keeping cache slots compact.

Running sequences sit in slots 0..N-1 in ``running``; decoding ones first, then at most
one sequence whose long prompt is being prefilled in chunks. New requests are admitted
in arrival order while slots are free; a prompt longer than the prefill budget is
prefilled over several steps while the others keep decoding.
"""

from __future__ import annotations

from collections import deque

from .kv_cache import KVCache
from .sequence import Sequence, Status


class Scheduler:
    def __init__(self, cache: KVCache, max_num_seqs: int, max_prefill_tokens: int):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def decoding(self) -> list[Sequence]:
        """The sequences of the next decode step: slots 0..D-1."""
        n = len(self.running)
        if n and self.running[-1].status is Status.PREFILLING:
            n -= 1
        return self.running[:n]

    def schedule_prefill(self) -> list[tuple[Sequence, int]]:
        """Sequences to prefill now with how many prompt tokens each (slots are consecutive)."""
        if self.running and self.running[-1].status is Status.PREFILLING:
            seq = self.running[-1]
            return [(seq, min(self.max_prefill_tokens, seq.num_prompt_tokens - seq.num_cached))]
        batch, budget = [], self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            need = seq.num_prompt_tokens
            if need > budget and batch:
                break
            self.waiting.popleft()
            seq.slot, seq.status = len(self.running), Status.PREFILLING
            self.running.append(seq)
            batch.append((seq, min(need, budget)))
            budget -= need
            if budget <= 0:
                break
        return batch

    def remove_finished(self) -> None:
        """Drop finished sequences, compact the rest into slots 0..N-1 (decoding first) and
        let the cache shrink to them.

        Only the sequences past the kept count move: each decoding one from a slot >= D (D
        decoding sequences kept) into a slot below D that a finished one left, then the
        prefilling ones (the last slots) to D, D+1, ... So each request that ends moves at
        most one decoding sequence's cache, not every one above it."""
        if not any(s.status is Status.FINISHED for s in self.running):
            return
        decoding = [s for s in self.running if s.status is Status.DECODING]
        prefilling = [s for s in self.running if s.status is Status.PREFILLING]
        d = len(decoding)
        holes = sorted(set(range(d)) - {s.slot for s in decoding})  # below D: finished ones' slots
        movers = [s for s in decoding if s.slot >= d]
        # Every destination is free when written: a hole below D, or (prefilling, at the end of
        # running, so at a slot >= D + its index) a slot >= D that a mover or a finished one left.
        for hole, seq in zip(holes, movers, strict=True):
            self._move(seq, hole)
        for i, seq in enumerate(prefilling):
            self._move(seq, d + i)
        self.running = sorted(decoding, key=lambda s: s.slot) + prefilling
        self.cache.fit(len(self.running), max((s.num_cached for s in self.running), default=0))

    def _move(self, seq: Sequence, slot: int) -> None:
        self.cache.move(seq.slot, slot, seq.num_cached)
        seq.slot = slot

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        return None
