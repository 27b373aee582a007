"""The reordered linear computes what F.linear computes, for every row count a step feeds."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from serve_app.engines.embedded.linear import Linear, pack_linears


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
