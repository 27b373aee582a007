"""A slot KV cache: one row per running sequence, kept compact, holding memory only where it is written.

Running sequences always occupy slots 0..B-1, so a decode step reads the cache as a
view (``k[:B, :, :L]``) instead of gathering. When a sequence leaves, the last slot's
contents move into its place: one copy per finished request, none per step.

Memory follows the load without copies. On the CPU a layer's keys are one tensor
[num_slots, KV, capacity, D] over an anonymous mapping of its own: the whole shape is
address space, and a page costs memory only once a step writes it (attention reads a
sequence's keys up to its position, and never-written pages read as zeros). So a step that
needs more slots or positions costs nothing but the pages it writes (reallocating the layers
and copying the slots over instead stalls a step 0.1 to 0.4 s at 24 to 32 slots). ``rows``
and ``length`` bound what has been written (in chunks of slots and positions); ``fit`` hands
the pages outside a smaller bound back to the system (``madvise(MADV_DONTNEED)``; they read as
zeros again) when the running sequences need less than half of it, and an idle engine holds
none. After a release glibc is also asked to return the free heap the steps' activations left
(without that, SmolLM2 stayed at 1.8 GB after 32 requests of 256 tokens instead of 1.2 GB).
On other devices the cache is allocated whole, zeros, by the first step that needs it, and kept.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

from .attention import padded_length

ROW_CHUNK = 8  # slots are added 8 at a time
POS_CHUNK = 256  # and positions 256 at a time (4 attention blocks)


def _load_malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc, which alone needs asking
        return None


_malloc_trim = _load_malloc_trim()


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _chunked(n: int, chunk: int, limit: int) -> int:
    return min(-(-n // chunk) * chunk, limit)


class KVCache:
    """Keys and values of at most ``num_slots`` sequences of at most ``capacity`` positions."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, capacity: int,
                 head_dim: int, device, dtype):
        self.num_layers, self.num_slots = num_layers, num_slots
        self.capacity = padded_length(capacity)  # attention reads whole blocks
        self.num_kv_heads, self.head_dim, self.device, self.dtype = num_kv_heads, head_dim, device, dtype
        self.rows = self.length = 0  # the bound of what may be written: slots 0..rows-1, positions 0..length-1
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._maps: list[mmap.mmap] = []  # on the CPU: each layer's mapping, k then v

    def _allocate(self) -> None:
        shape = (self.num_slots, self.num_kv_heads, self.capacity, self.head_dim)
        if torch.device(self.device).type != "cpu":
            # Zeros, not empty: attention reads masked keys too, and 0 x NaN would not weigh 0.
            self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.num_layers)]
            self.v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.num_layers)]
            return
        nbytes = self.num_slots * self.num_kv_heads * self.capacity * self.head_dim * self.dtype.itemsize
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # private: MADV_DONTNEED frees it (shared keeps it)
        self._maps = [mmap.mmap(-1, nbytes, flags=flags) for _ in range(2 * self.num_layers)]
        tensors = [torch.frombuffer(m, dtype=self.dtype).view(shape) for m in self._maps]
        self.k, self.v = tensors[:self.num_layers], tensors[self.num_layers:]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def reserve(self, num_rows: int, length: int) -> None:
        """Make room for slots 0..num_rows-1 of ``length`` positions each; grows, never shrinks."""
        if num_rows > self.num_slots or length > self.capacity:
            raise ValueError(f"{num_rows} slots of {length} positions exceed the cache's "
                             f"{self.num_slots} of {self.capacity}")
        if not self.k:
            self._allocate()
        self.rows = max(self.rows, _chunked(num_rows, ROW_CHUNK, self.num_slots))
        self.length = max(self.length, _chunked(length, POS_CHUNK, self.capacity))

    def fit(self, num_rows: int, length: int) -> bool:
        """Hand back what lies outside slots 0..num_rows-1 and ``length`` positions (in chunks)
        when that bound is less than half of the present one; returns whether it released."""
        rows, length = _chunked(num_rows, ROW_CHUNK, self.num_slots), _chunked(length, POS_CHUNK, self.capacity)
        if 2 * rows * length >= self.rows * self.length:  # at half or more: keep it, for the next arrivals
            return False
        if self._maps:
            self._release(rows, length)
        self.rows, self.length = rows, length
        release_free_heap()
        return True

    def _release(self, rows: int, length: int) -> None:
        """madvise(MADV_DONTNEED) on each layer: slots from ``rows`` on, and positions from
        ``length`` on in the slots below (page-aligned; what a page straddles is kept)."""
        item = self.dtype.itemsize
        pos_bytes = self.head_dim * item
        head_bytes = self.capacity * pos_bytes
        row_bytes = self.num_kv_heads * head_bytes
        ranges = [(rows * row_bytes, self.rows * row_bytes)]
        if length < self.length:
            starts = [r * row_bytes + h * head_bytes for r in range(rows) for h in range(self.num_kv_heads)]
            ranges += [(a + length * pos_bytes, a + self.length * pos_bytes) for a in starts]
        page = mmap.PAGESIZE
        ranges = [(-(-a // page) * page, b // page * page) for a, b in ranges]
        ranges = [(a, b - a) for a, b in ranges if b > a]
        for m in self._maps:
            for start, size in ranges:
                m.madvise(mmap.MADV_DONTNEED, start, size)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        if src != dst and length > 0:
            for k, v in zip(self.k, self.v, strict=True):
                k[dst, :, :length] = k[src, :, :length]
                v[dst, :, :length] = v[src, :, :length]

    def nbytes(self) -> int:
        """Bytes the cache may hold: its keys and values within ``rows`` and ``length`` (on other
        devices than the CPU, the whole allocation once made)."""
        if self.k and not self._maps:
            return sum(t.numel() * t.element_size() for t in self.k + self.v)
        return 2 * self.num_layers * self.rows * self.num_kv_heads * self.length * self.head_dim * self.dtype.itemsize
