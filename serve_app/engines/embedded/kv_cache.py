"""A slot KV cache: one row per running sequence, kept compact, sized to what runs.

Running sequences always occupy slots 0..B-1, so a decode step reads the cache as a
view (``k[:B, :, :L]``) instead of gathering. When a sequence leaves, the last slot's
contents move into its place: one copy per finished request, none per step.

Memory follows the load: a layer's keys are one tensor [rows, KV, length, D] that grows
in chunks of slots and positions when a step needs more (``reserve``) and shrinks when
the running sequences need less than half of it (``fit``); an idle engine holds none. A resize
copies what the slots hold, one layer at a time, so it briefly needs one layer more. On
the CPU each layer is an anonymous mapping of its own, returned whole when it is freed; after
a shrink glibc is also asked to return the free heap the steps' activations left (without
that, SmolLM2 stayed at 1.8 GB after 32 requests of 256 tokens instead of 1.2 GB).
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
        self.num_slots, self.capacity = num_slots, padded_length(capacity)  # attention reads whole blocks
        self.num_kv_heads, self.head_dim, self.device, self.dtype = num_kv_heads, head_dim, device, dtype
        self.rows = self.length = 0  # what is allocated now
        self.k = [self._zeros(0, 0) for _ in range(num_layers)]
        self.v = [self._zeros(0, 0) for _ in range(num_layers)]

    def _zeros(self, rows: int, length: int) -> torch.Tensor:
        # Zeros, not empty: attention reads masked keys too, and 0 x NaN would not weigh 0.
        shape = (rows, self.num_kv_heads, length, self.head_dim)
        nbytes = rows * self.num_kv_heads * length * self.head_dim * self.dtype.itemsize
        if torch.device(self.device).type != "cpu" or nbytes == 0:
            return torch.zeros(shape, device=self.device, dtype=self.dtype)
        # On the CPU, a mapping of its own: its pages are zero until written, cost nothing
        # until then, and go back to the system when the layer is freed (from the C heap,
        # freed layers would stay resident).
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=self.dtype).view(shape)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def reserve(self, num_rows: int, length: int) -> None:
        """Make room for slots 0..num_rows-1 of ``length`` positions each; grows, never shrinks."""
        if num_rows > self.num_slots or length > self.capacity:
            raise ValueError(f"{num_rows} slots of {length} positions exceed the cache's "
                             f"{self.num_slots} of {self.capacity}")
        if num_rows > self.rows or length > self.length:
            self._resize(max(self.rows, _chunked(num_rows, ROW_CHUNK, self.num_slots)),
                         max(self.length, _chunked(length, POS_CHUNK, self.capacity)))

    def fit(self, num_rows: int, length: int) -> bool:
        """Shrink to slots 0..num_rows-1 holding ``length`` positions (in chunks) when that is
        less than half of what is allocated; returns whether it shrank."""
        rows, length = _chunked(num_rows, ROW_CHUNK, self.num_slots), _chunked(length, POS_CHUNK, self.capacity)
        if 2 * rows * length >= self.rows * self.length:  # at half or more: keep it, for the next arrivals
            return False
        self._resize(rows, length)
        release_free_heap()
        return True

    def _resize(self, rows: int, length: int) -> None:
        r, n = min(rows, self.rows), min(length, self.length)
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                new = self._zeros(rows, length)
                new[:r, :, :n] = old[:r, :, :n]
                store[i] = new
                del old
        self.rows, self.length = rows, length

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        if src != dst and length > 0:
            for k, v in zip(self.k, self.v, strict=True):
                k[dst, :, :length] = k[src, :, :length]
                v[dst, :, :length] = v[src, :, :length]

    def nbytes(self) -> int:
        """Bytes allocated now, keys and values."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
