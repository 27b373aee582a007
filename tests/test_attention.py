"""Attention gives a query row the same bits whatever the rows, sequences and key length beside it."""

import pytest
import torch
import torch.nn.functional as F

from serve_app.engines.embedded.attention import BLOCK, attend, padded_length

H, KV, D = 9, 3, 64  # SmolLM2-135M's attention
T = 2200


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    # Queries for every (sequence, position); keys past a row's position are random, not zeros,
    # as in the cache after rejected drafts.
    return tuple(torch.randn(16, *shape, generator=g) for shape in [(T, H, D), (KV, T, D), (KV, T, D)])


def attend_sdpa(xq: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The reference: ``F.scaled_dot_product_attention`` (faster in the engine, not row-invariant)."""
    B, q, H, D = xq.shape
    out = F.scaled_dot_product_attention(xq.transpose(1, 2), k, v, attn_mask=visible.unsqueeze(1), enable_gqa=True)
    return out.transpose(1, 2).reshape(B, q, H * D)


def _attend(data, lens, q, fn=attend, extra=0):
    queries, keys, values = data
    B, lens = len(lens), torch.tensor(lens)
    pos = lens[:, None] + torch.arange(q)
    L = padded_length(int(lens.max()) + q) + extra
    visible = torch.arange(L)[None, None, :] <= pos[:, :, None]
    xq = torch.stack([queries[b, pos[b]] for b in range(B)])
    with torch.inference_mode():
        return fn(xq, keys[:B, :, :L], values[:B, :, :L], visible), pos


# (lens, q): plain decode (q = 1), verify (q = k + 1), batches of other lengths, long keys, prefill chunks.
CASES = [([100], 1), ([101], 1), ([99], 2), ([100], 4), ([95], 9), ([98, 100, 37], 4), ([100, 500], 4),
         ([97, 3, 60, 120, 99, 100, 101, 5, 6, 7, 8, 9, 10, 11, 12, 13], 9), ([100] * 16, 1), ([100, 590], 9),
         ([100, 1000], 2), ([100, 2000], 1), ([0], 200), ([90], 900), ([60], 50)]


def test_a_rows_attention_is_the_same_bits_for_every_query_count_batch_and_key_length(data):
    seen, checked = {}, 0
    for lens, q in CASES:
        out, pos = _attend(data, lens, q)
        for i in range(q):
            p = int(pos[0, i])
            if p in (0, 63, 100, 101, 102, 150):
                if p in seen:
                    assert torch.equal(out[0, i], seen[p]), f"position {p} differs at lens={lens[:3]} q={q}"
                    checked += 1
                else:
                    seen[p] = out[0, i]
    assert checked >= 15


def test_whole_blocks_of_masked_keys_change_nothing(data):
    out, _ = _attend(data, [100, 7], 4)
    for extra in (BLOCK, 3 * BLOCK, 16 * BLOCK):
        assert torch.equal(_attend(data, [100, 7], 4, extra=extra)[0], out)


@pytest.mark.parametrize("lens,q", [([100], 1), ([98, 100, 37], 4), ([0], 200)])
def test_it_computes_what_sdpa_computes(data, lens, q):
    out, _ = _attend(data, lens, q)
    torch.testing.assert_close(out, _attend(data, lens, q, fn=attend_sdpa)[0], rtol=1e-5, atol=1e-5)
