"""Causal attention over the slot KV cache that gives a query row the same bits however it is batched.

Lossless speculation compares a position decoded alone (one query row per sequence) with the
same position verified among k + 1 rows of B sequences, over a longer key length.
``F.scaled_dot_product_attention`` does not give those the same bits: its result for a row
changes with the number of query rows and with the key length, masked keys included. Here
the key length is padded to a multiple of ``BLOCK`` (masked keys weigh exactly 0) and every
reduction has a fixed shape:

- scores ``q @ k^T`` reduce over head_dim; MKL's product gives a row the same bits for 4
  rows or more (1 to 3 take another path), so a GQA group of fewer than 4 rows is padded;
- the softmax runs over the padded row: its max is exact and exact zeros add nothing;
- ``probs @ v`` reduces over the keys, whose count MKL blocks in ways that change the sum
  (192 and 256 keys differ even when keys past 151 weigh 0), so it is summed per block of
  ``BLOCK`` keys, a fixed-shape product, and the block partials are added in order.

tests/test_attention.py checks rows across query counts, batch sizes and key lengths.
"""

from __future__ import annotations

import torch

BLOCK = 64
_MIN_ROWS = 4  # MKL's product sums a row alike from 4 rows on


def padded_length(length: int) -> int:
    """The key length attention reads: ``length`` rounded up to a multiple of BLOCK."""
    return -(-length // BLOCK) * BLOCK


def attend(xq: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Attention of queries ``xq`` [B, q, H, D] over keys and values [B, KV, L, D] (L a
    multiple of BLOCK); ``visible`` [B, q, L] says which keys each query row sees. Returns
    [B, q, H * D]."""
    B, q, H, D = xq.shape
    KV, L = k.shape[1], k.shape[2]
    G, nb = H // KV, L // BLOCK
    rows = G * q
    # One GQA group's rows together, head-major: [B, KV, G * q, D]; the scale 1/8 is exact.
    qg = (xq * D**-0.5).view(B, q, KV, G, D).permute(0, 2, 3, 1, 4).reshape(B, KV, rows, D)
    if rows < _MIN_ROWS:
        qg = torch.cat([qg, qg[:, :, :1].expand(B, KV, _MIN_ROWS - rows, D)], dim=2)
    scores = qg @ k.transpose(-1, -2)  # [B, KV, M, L]
    scores[:, :, :rows].view(B, KV, G, q, L).masked_fill_(~visible[:, None, None], float("-inf"))
    probs = scores.softmax(-1)
    # Per-block products [B, KV, nb, M, D], added block by block.
    partials = probs.view(B, KV, -1, nb, BLOCK).transpose(2, 3) @ v.view(B, KV, nb, BLOCK, D)
    out = partials.sum(2)[:, :, :rows]
    return out.view(B, KV, G, q, D).permute(0, 3, 1, 2, 4).reshape(B, q, H * D)
