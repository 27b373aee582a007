"""A slot KV cache: one row of fixed capacity per running sequence, kept compact.

Running sequences always occupy slots 0..B-1, so a decode step reads the cache as a
view (``k[:B, :, :L]``) instead of gathering. When a sequence leaves, the last slot's
contents move into its place: one copy per finished request, none per step.
"""

from __future__ import annotations

import torch

from .attention import padded_length


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, capacity: int,
                 head_dim: int, device, dtype):
        capacity = padded_length(capacity)  # attention reads whole blocks of keys
        shape = (num_layers, num_slots, num_kv_heads, capacity, head_dim)
        # torch.zeros on CPU maps pages lazily: untouched capacity costs no memory.
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.num_slots, self.capacity = num_slots, capacity

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        if src != dst and length > 0:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
