"""The reordered linear computes what F.linear computes, for every row count a step feeds."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from serve_app.engines.embedded.linear import WEIGHT_FORMATS, Linear, Q4Linear, make_linear, pack_linears
from serve_app.engines.embedded.quant import quantize_q4_1


@pytest.mark.parametrize("rows", [1, 3, 4, 16, 33, 200])
def test_reordered_linear_matches_f_linear_at_any_row_count(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(2, rows, 64, generator=g)
    lin = Linear(w, b)
    if torch.backends.mkldnn.is_available():
        assert lin.packed is not None and lin.weight is None, "the CPU float32 path should keep only the reordered weight"
    reference = F.linear(x.double(), w.double(), b.double())
    with torch.inference_mode():
        out = lin(x)
    assert out.shape == (2, rows, 96) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-4)


def test_other_dtypes_take_f_linear():
    w = torch.randn(8, 4, dtype=torch.float64)
    lin = Linear(w)
    assert lin.packed is None and lin.weight is w
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(lin(x), F.linear(x, w))


def test_pack_linears_swaps_a_modules_linears_and_keeps_its_output():
    m = nn.Sequential()
    m.a, m.act, m.b = nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False)
    x = torch.randn(5, 16)
    with torch.no_grad():
        expected = m(x)
        pack_linears(m)
        assert not any(isinstance(c, nn.Linear) for c in m.children())
        torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-5)


# SmolLM2's projections (fused qkv, o, fused gate/up, down) and a short stand-in for its LM head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 576)]


# Decode and verify steps feed 1 to max_num_seqs x (draft steps + 1) rows (32 x 6): every
# count to 40 and around each multiple of 16 up to 192.
PROBE_ROWS = 192
PROBE_COUNTS = sorted({*range(1, 41), *(m + d for m in range(48, PROBE_ROWS + 1, 16) for d in (-1, 0, 1))} - {PROBE_ROWS + 1})


def _weight(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k**-0.5


@pytest.mark.parametrize("weights", WEIGHT_FORMATS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_every_format_gives_a_row_the_same_bits_whatever_the_rows_beside_it(weights, n, k):
    """Verify (k + 1 rows per sequence, B sequences) and plain decode (one row) must agree."""
    lin = make_linear(weights, _weight(n, k))
    x = torch.randn(PROBE_ROWS, k, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = lin(x)
        for rows in PROBE_COUNTS:
            assert torch.equal(lin(x[:rows]), full[:rows]), f"{rows} rows differ from the same rows among {PROBE_ROWS}"
        assert torch.equal(lin(x[:40].view(8, 5, k)), full[:40].view(8, 5, n))
        assert torch.equal(lin(x[:1].view(1, 1, k)), full[:1].view(1, 1, n))


def test_bfloat16_lm_head_keeps_each_rows_bits():
    lin = make_linear("bfloat16", _weight(49152, 576))
    x = torch.randn(PROBE_ROWS, 576, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        full = lin(x)
        for rows in (1, 2, 5, 17, 33, 63, 64, 65, 100, 128, 129, 191):
            assert torch.equal(lin(x[:rows]), full[:rows]), f"{rows} rows differ from the same rows among {PROBE_ROWS}"


@pytest.mark.parametrize("weights,tolerance", [("bfloat16", 0.02), ("int8", 0.03), ("q4_1", 0.1)])
def test_compact_formats_stay_near_the_float32_product(weights, tolerance):
    w = _weight(576, 1536)
    x = torch.randn(3, 1536)
    with torch.inference_mode():
        out = make_linear(weights, w)(x)
    assert out.dtype == torch.float32 and out.shape == (3, 576)
    reference = x @ w.T
    assert ((out - reference).norm() / reference.norm()).item() < tolerance


def test_q4_1_uses_the_blocks_as_given_exactly_up_to_bfloat16_scales():
    w = _weight(256, 576)
    blocks = quantize_q4_1(w)
    assert torch.equal(quantize_q4_1(blocks.dequantize()).codes, blocks.codes)
    # With scale and zero exact in bfloat16, the kernel's weights are exactly d * q + m.
    blocks.scale = blocks.scale.bfloat16().float()
    blocks.min = (blocks.min + 8 * blocks.scale).bfloat16().float() - 8 * blocks.scale
    exact = (blocks.min + 8 * blocks.scale).bfloat16().float() == blocks.min + 8 * blocks.scale
    lin = Q4Linear(blocks)
    with torch.inference_mode():
        kernel_weights = lin(torch.eye(576)).T  # [N, K]: the identity's rows pick the weights out
    expected = blocks.dequantize().bfloat16().float()
    mask = exact.repeat_interleave(32, dim=1)
    assert mask.float().mean() > 0.5
    assert torch.equal(kernel_weights[mask], expected[mask])


def test_q4_1_bias_is_added_in_the_models_dtype():
    w, b = _weight(64, 64), torch.randn(64)
    x = torch.randn(2, 64)
    with torch.inference_mode():
        torch.testing.assert_close(make_linear("q4_1", w, b)(x), make_linear("q4_1", w)(x) + b)
