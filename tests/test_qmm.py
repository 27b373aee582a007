"""qmm.c, the ``gguf`` weight format's kernels: what each compiled path computes, and that a row's
result has the same bits whatever rows are computed beside it (lossless speculative decoding).

Every path this CPU can run is compiled once per module into a temporary folder and swapped in
through ``qmm._lib``: AVX512-VNNI (when the default ``-march=native`` build is that path, i.e.
when ``qmm.kernel_path() == "avx512-vnni"``), AVX2 (when the CPU has it) and plain C.
"""

import math
from pathlib import Path

import pytest
import torch

from serve_app.engines.embedded import qmm
from serve_app.engines.embedded.model import rope
from serve_app.engines.embedded.quant import GROUP, Q4Blocks, gguf_q8_0_tensors

PATHS = ["avx512-vnni", "avx2", "c"]
AVX2_FLAGS = ("-DQMM_NO_AVX512", "-mno-avx512f")
C_FLAGS = ("-DQMM_NO_AVX512", "-mno-avx512f", "-mno-avx2", "-mno-avx")
FORMATS = ["q4_1", "q8_0"]
# N not a multiple of 16 (the AVX512 path's 16 output rows a vector), K of 1, 3 and 18 blocks.
SHAPES = [(40, 32), (40, 96), (17, 64), (96, 576)]
ROWS = 70
ROW_COUNTS = [*range(1, 21), 31, 33, 64, 65]


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict:
    """The compiled paths this CPU runs, by name (qmm_path())."""
    out = tmp_path_factory.mktemp("qmm-kernels")
    native = qmm.load(qmm.compile_library(out / "native.so"))  # the flags library() uses
    found = {native.qmm_path().decode(): native}
    if "avx2" not in found and "avx2" in _cpu_flags():
        found["avx2"] = qmm.load(qmm.compile_library(out / "avx2.so", AVX2_FLAGS))
    if "c" not in found:
        found["c"] = qmm.load(qmm.compile_library(out / "c.so", C_FLAGS))
    for name, lib in found.items():
        assert lib.qmm_path().decode() == name, f"the {name} build runs the {lib.qmm_path().decode()} path"
    return found


@pytest.fixture(params=PATHS)
def path(request, libs, monkeypatch) -> str:
    """Run the test with one compiled path as qmm's library."""
    if request.param not in libs:
        pytest.skip(f"this CPU does not run qmm.c's {request.param} path")
    monkeypatch.setattr(qmm, "_lib", libs[request.param])
    return request.param


# ---- products ----


def _blocks(fmt: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random weight blocks over the format's whole code range: (codes, scale, min), the scales
    and minimums float16-exact as a GGUF holds them (min is zero for Q8_0)."""
    g = torch.Generator().manual_seed(seed)
    nb = k // GROUP
    scale = (torch.rand(n, nb, generator=g) * 0.02 + 1e-4).half().float()
    if fmt == "q4_1":
        codes = torch.randint(0, 16, (n, k), generator=g).to(torch.uint8)
        mn = (-torch.rand(n, nb, generator=g) * 0.15 + 0.01).half().float()
    else:
        codes = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
        mn = torch.zeros(n, nb)
    return codes, scale, mn


def _linear(fmt: str, blocks, bias: torch.Tensor | None = None):
    codes, scale, mn = blocks
    if fmt == "q4_1":
        return qmm.Q4_1Linear(Q4Blocks(codes, scale, mn), bias)
    return qmm.Q8_0Linear(codes, scale, bias)


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows of different magnitudes, one with an outlier, one with a zero block, one all zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[torch.randperm(m, generator=g)][:, None]
    x[1, 3] = 40.0
    x[2, :GROUP] = 0.0
    x[4] = 0.0
    return x


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's int8 codes per block of 32 and their scales xd = amax / 127 (float32, as the kernel
    computes them): q = nearbyint(x * (1 / xd)), 0 for an all-zero block."""
    xb = x.float().reshape(x.shape[0], -1, GROUP)
    xd = xb.abs().amax(-1) / 127
    inv = torch.where(xd != 0, torch.ones_like(xd) / xd, torch.zeros_like(xd))
    q = torch.round(xb * inv[..., None])  # half to even, as nearbyintf
    assert q.abs().max() <= 127
    return q.double(), xd.double()


def _reference(x: torch.Tensor, blocks, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """y[m, n] = sum_b d[n,b] xd[m,b] dot_b + min[n,b] xs[m,b] (+ bias) in float64, and the size
    that a float32 rounding error is relative to: the same sum over the magnitudes of the
    products q * code and of the min terms (the AVX2 and C paths scale a block's dot in 8 parts,
    which may cancel)."""
    codes, scale, mn = blocks
    n, k = codes.shape
    q, xd = _quantize_rows(x)
    w = codes.double().reshape(n, k // GROUP, GROUP)
    dot = torch.einsum("mbj,nbj->mnb", q, w)  # exact integers
    magnitude = torch.einsum("mbj,nbj->mnb", q.abs(), w.abs())
    xs = xd * q.sum(-1)
    scaled, mins = scale.double()[None] * xd[:, None], mn.double()[None] * xs[:, None]
    y, size = (scaled * dot + mins).sum(-1), (scaled * magnitude + mins.abs()).sum(-1)
    if bias is not None:
        y, size = y + bias.double(), size + bias.double().abs()
    return y, size


def _assert_near(y: torch.Tensor, ref: torch.Tensor, size: torch.Tensor, rel: float = 1e-5) -> None:
    err = (y.double() - ref).abs()
    worst = (err - rel * size).argmax()
    m, n = divmod(worst.item(), ref.shape[1])
    assert (err <= rel * size).all(), (
        f"y[{m}, {n}] = {y[m, n].item()!r}, reference {ref[m, n].item()!r} (error {err[m, n].item():.3g}, "
        f"allowed {rel * size[m, n].item():.3g})")


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(path, fmt, n, k):
    lin = _linear(fmt, _blocks(fmt, n, k, seed=n + k))
    x = _activations(ROWS, k, seed=k)
    norm = 1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(3))
    full, full_normed = lin(x), lin.normed(x, norm, 1e-5)
    for m in ROW_COUNTS:
        for rows in (slice(0, m), slice(ROWS - m, ROWS), slice(7, 7 + m)):
            assert torch.equal(lin(x[rows]), full[rows]), f"{path}: rows {rows} alone differ from among {ROWS}"
            assert torch.equal(lin.normed(x[rows], norm, 1e-5), full_normed[rows]), (
                f"{path}: normed rows {rows} alone differ from among {ROWS}")
    assert torch.equal(lin(x[:60].view(6, 10, k)), full[:60].view(6, 10, n))


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_product_is_the_block_formula_on_int8_quantized_rows(path, fmt, n, k):
    blocks = _blocks(fmt, n, k, seed=2 * n + k)
    x = _activations(ROWS, k, seed=k + 1)
    y = _linear(fmt, blocks)(x)
    assert y.shape == (ROWS, n) and y.dtype == torch.float32
    ref, size = _reference(x, blocks)
    _assert_near(y, ref, size)
    assert torch.equal(y[4], torch.zeros(n)), "an all-zero row gives zeros"


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bias_is_added_to_the_product(path, fmt):
    n, k = 40, 96
    blocks = _blocks(fmt, n, k, seed=5)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(6))
    x = _activations(12, k, seed=7)
    y = _linear(fmt, blocks, bias)(x)
    ref, size = _reference(x, blocks, bias)
    _assert_near(y, ref, size)
    assert torch.equal(y[4], bias)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_product_keeps_the_leading_dimensions_and_dtype_of_its_input(path, fmt):
    lin = _linear(fmt, _blocks(fmt, 40, 64, seed=8))
    x = _activations(24, 64, seed=9)
    y = lin(x.view(2, 3, 4, 64).bfloat16())
    assert y.shape == (2, 3, 4, 40) and y.dtype == torch.bfloat16
    assert torch.equal(y, lin(x.bfloat16().float()).bfloat16().view(2, 3, 4, 40))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_normed_product_is_rms_norm_then_the_product(path, fmt):
    n, k, eps = 96, 576, 1e-5
    blocks = _blocks(fmt, n, k, seed=10)
    lin = _linear(fmt, blocks)
    x = _activations(ROWS, k, seed=11)
    x[4] = 1.0  # the norm of an all-zero row is eps-bound; keep rows the norm scales normally
    norm = 1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(12))
    normed = torch.nn.functional.rms_norm(x, (k,), norm, eps)
    y = lin.normed(x, norm, eps)
    ref, size = _reference(normed, blocks)
    # The kernel's norm (squares summed in order) may differ from F.rms_norm's by an ulp, which can
    # move a code by one: about 1 / sum|q| (~4e-5 here) of the size, so a looser bound than the product's.
    _assert_near(y, ref, size, rel=1e-4)
    _assert_near(lin(normed), ref, size)


@pytest.mark.parametrize("fmt", FORMATS)
def test_in_features_not_a_multiple_of_32_are_refused(path, fmt):
    codes, scale, mn = _blocks(fmt, 16, 64, seed=13)
    with pytest.raises(ValueError, match="divisible by 32"):
        _linear(fmt, (codes[:, :48], scale[:, :1], mn[:, :1]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_compiled_path_computes_the_same_product_closely(libs, monkeypatch, fmt):
    if len(libs) < 2:
        pytest.skip("this CPU runs a single path")
    n, k = 96, 576
    blocks = _blocks(fmt, n, k, seed=14)
    x = _activations(ROWS, k, seed=15)
    norm = 1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(16))
    ys = {}
    for name, lib in libs.items():
        monkeypatch.setattr(qmm, "_lib", lib)
        lin = _linear(fmt, blocks)
        ys[name] = (lin(x), lin.normed(x, norm, 1e-5))
    _, size = _reference(x, blocks)
    first, (y0, yn0) = next(iter(ys.items()))
    for name, (y, yn) in ys.items():
        err = (y.double() - y0.double()).abs()
        assert (err <= 2e-6 * size).all(), f"{name} and {first} differ by up to {err.max().item():.3g}"
        torch.testing.assert_close(yn, yn0, rtol=1e-4, atol=1e-4, msg=f"normed: {name} and {first} differ")


# ---- the real GGUF's Q8_0 tensor ----


def test_gguf_q8_0_tensors_give_exactly_ggufs_own_dequantization():
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    from serve_app.engines.embedded.weights import smollm2_gguf_path

    try:
        file = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tensors = gguf_q8_0_tensors(file)
    assert set(tensors) == {"model.embed_tokens.weight"}  # SmolLM2 ties its LM head to the embedding
    codes, scale = tensors["model.embed_tokens.weight"]
    assert codes.shape == (49152, 576) and codes.dtype == torch.int8
    assert scale.shape == (49152, 576 // GROUP) and scale.dtype == torch.float32
    assert torch.equal(scale.half().float(), scale), "scales are the file's float16 values"
    (raw,) = [t for t in gguf.GGUFReader(str(file)).tensors if t.name == "token_embd.weight"]
    rows = 3000
    expected = torch.from_numpy(dequantize(raw.data[:rows], raw.tensor_type)).reshape(rows, 576)
    mine = (codes[:rows].float().view(rows, -1, GROUP) * scale[:rows, :, None]).view(rows, 576)
    assert torch.equal(mine, expected)


# ---- attention ----

# SmolLM2's heads (D = 64: a KV head's queries in groups, scores 16 keys at a time); 4 query heads a KV
# head (8 queries of a verify block: more than a group); one KV head, D % 16 != 0 (row by row).
# 7 query heads a KV head: one position's heads split across groups of 6, groups of 1 and 5.
ATTENTION_SHAPES = [(9, 3, 64), (8, 2, 64), (7, 1, 64), (4, 1, 24)]
LENGTH = 64


def _rope_tables(length: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    emb = torch.cat([torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)] * 2, dim=-1)
    return emb.cos().float().contiguous(), emb.sin().float().contiguous()


def _split(qkv: torch.Tensor, heads: int, kv_heads: int):
    B, q, width = qkv.shape
    d = width // (heads + 2 * kv_heads)
    xq = qkv[..., :heads * d].reshape(B, q, heads, d)
    xk = qkv[..., heads * d:(heads + kv_heads) * d].reshape(B, q, kv_heads, d)
    return xq, xk, qkv[..., (heads + kv_heads) * d:].reshape(B, q, kv_heads, d)


def _reference_attention(qkv, pos, heads, kv_heads, cos, sin, k_cache, v_cache, slot0, slots=None):
    """Float64: RoPE, the cache write, then each query's causal softmax attention over its
    sequence's keys 0 .. its position, query head h reading KV head h // (heads / kv_heads);
    sequence b in slot ``slots[b]``, else ``slot0 + b``."""
    B, q, _ = qkv.shape
    slot = list(slots) if slots is not None else [slot0 + b for b in range(B)]
    xq, xk, xv = _split(qkv.double(), heads, kv_heads)
    d = xq.shape[-1]
    c, s = cos.double()[pos][:, :, None], sin.double()[pos][:, :, None]
    xq, xk = rope(xq, c, s), rope(xk, c, s)
    kc, vc = k_cache.double().clone(), v_cache.double().clone()
    for b in range(B):
        for i in range(q):
            kc[slot[b], :, pos[b, i]], vc[slot[b], :, pos[b, i]] = xk[b, i], xv[b, i]
    out = torch.empty(B, q, heads, d, dtype=torch.float64)
    for b in range(B):
        for i in range(q):
            p = int(pos[b, i])
            for h in range(heads):
                g = h // (heads // kv_heads)
                weights = torch.softmax(kc[slot[b], g, :p + 1] @ xq[b, i, h] / math.sqrt(d), dim=0)
                out[b, i, h] = weights @ vc[slot[b], g, :p + 1]
    return out.reshape(B, q, heads * d)


@pytest.mark.parametrize("heads,kv_heads,d", ATTENTION_SHAPES)
def test_attention_matches_rope_and_causal_softmax_attention_in_float64(path, heads, kv_heads, d):
    g = torch.Generator().manual_seed(d)
    cos, sin = _rope_tables(LENGTH, d)
    k_cache = torch.randn(5, kv_heads, LENGTH, d, generator=g)  # earlier keys and values of every slot
    v_cache = torch.randn(5, kv_heads, LENGTH, d, generator=g)
    qkv = torch.randn(3, 4, (heads + 2 * kv_heads) * d, generator=g) * 2
    pos = torch.tensor([[0, 1, 2, 3], [13, 14, 15, 16], [46, 47, 48, 49]])  # 1 to 50 keys: whole blocks of 16 and not
    expected = _reference_attention(qkv, pos, heads, kv_heads, cos, sin, k_cache, v_cache, slot0=1)
    out = qmm.attention(qkv, pos, heads, kv_heads, cos, sin, k_cache, v_cache, 1)
    assert out.shape == (3, 4, heads * d) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,d", ATTENTION_SHAPES)
def test_attention_takes_each_sequence_s_slot_from_a_list(path, heads, kv_heads, d):
    """The draft head's caches keep a sequence in a slot of its own, in no order: ``slots``
    names each sequence's, and the other slots stay as they were."""
    g = torch.Generator().manual_seed(d + 7)
    cos, sin = _rope_tables(LENGTH, d)
    k_cache = torch.randn(5, kv_heads, LENGTH, d, generator=g)
    v_cache = torch.randn(5, kv_heads, LENGTH, d, generator=g)
    qkv = torch.randn(3, 2, (heads + 2 * kv_heads) * d, generator=g)
    pos = torch.tensor([[4, 5], [0, 1], [17, 18]])
    slots = torch.tensor([4, 0, 2])
    expected = _reference_attention(qkv, pos, heads, kv_heads, cos, sin, k_cache, v_cache, 0, slots.tolist())
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out = qmm.attention(qkv, pos, heads, kv_heads, cos, sin, k_cache, v_cache, slots=slots)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    for untouched in (1, 3):
        assert torch.equal(k_cache[untouched], k_before[untouched]) and torch.equal(v_cache[untouched], v_before[untouched])
    with pytest.raises(ValueError, match="slots"):
        qmm.attention(qkv, pos, heads, kv_heads, cos, sin, k_cache, v_cache, slots=slots[:2])


@pytest.mark.parametrize("heads,kv_heads,d", ATTENTION_SHAPES)
def test_attention_writes_the_roped_keys_and_the_raw_values_and_nothing_else(path, heads, kv_heads, d):
    g = torch.Generator().manual_seed(d + 1)
    cos, sin = _rope_tables(LENGTH, d)
    k_cache = torch.randn(5, kv_heads, LENGTH, d, generator=g)
    v_cache = torch.randn(5, kv_heads, LENGTH, d, generator=g)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    qkv = torch.randn(3, 4, (heads + 2 * kv_heads) * d, generator=g)
    pos = torch.tensor([[0, 1, 2, 3], [9, 10, 11, 12], [19, 20, 21, 22]])
    qmm.attention(qkv, pos, heads, kv_heads, cos, sin, k_cache, v_cache, 1)
    _, xk, xv = _split(qkv, heads, kv_heads)
    roped = rope(xk, cos[pos][:, :, None], sin[pos][:, :, None])  # float32, the model's own RoPE
    written = torch.zeros_like(k_cache, dtype=torch.bool)
    for b in range(3):
        for i in range(4):
            p = int(pos[b, i])
            assert torch.equal(k_cache[1 + b, :, p], roped[b, i]), f"key of sequence {b} at {p}"
            assert torch.equal(v_cache[1 + b, :, p], xv[b, i]), f"value of sequence {b} at {p}"
            written[1 + b, :, p] = True
    assert torch.equal(k_cache[~written], k_before[~written]) and torch.equal(v_cache[~written], v_before[~written])


@pytest.mark.parametrize("heads,kv_heads,d", ATTENTION_SHAPES)
def test_an_attention_row_has_the_same_bits_alone_in_a_block_and_in_a_batch(path, heads, kv_heads, d):
    """Decoding one position at a time, verifying 4 as a block, and that block among other
    sequences (at other positions, in other slots) give each position the same bits."""
    g = torch.Generator().manual_seed(d + 2)
    cos, sin = _rope_tables(LENGTH, d)
    width, steps, p0 = (heads + 2 * kv_heads) * d, 36, 29  # the verify block's keys cross 32
    seq = torch.randn(steps, width, generator=g)

    def caches(fill: bool):
        shape = (5, kv_heads, LENGTH, d)
        if fill:
            return torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        # Positions not yet written hold NaN: a row that read past its own keys would show it.
        return torch.full(shape, float("nan")), torch.full(shape, float("nan"))

    k1, v1 = caches(False)
    alone = torch.stack([
        qmm.attention(seq[t].view(1, 1, width), torch.tensor([[t]]), heads, kv_heads, cos, sin, k1, v1, 0)[0, 0]
        for t in range(steps)])

    k2, v2 = caches(False)
    prefill = qmm.attention(seq[:p0][None], torch.arange(p0)[None], heads, kv_heads, cos, sin, k2, v2, 0)
    assert torch.equal(prefill[0], alone[:p0]), "a prefill block differs from decoding one position at a time"
    block = qmm.attention(seq[p0:p0 + 4][None], torch.arange(p0, p0 + 4)[None], heads, kv_heads, cos, sin, k2, v2, 0)
    assert torch.equal(block[0], alone[p0:p0 + 4]), "a verify block differs from decoding one position at a time"
    assert torch.equal(k2[0, :, :p0 + 4], k1[0, :, :p0 + 4]) and torch.equal(v2[0, :, :p0 + 4], v1[0, :, :p0 + 4])

    k3, v3 = caches(True)  # other sequences' earlier keys and values in slots 1 and 3
    qmm.attention(seq[:p0][None], torch.arange(p0)[None], heads, kv_heads, cos, sin, k3, v3, 2)
    batch = torch.randn(3, 4, width, generator=g)
    batch[1] = seq[p0:p0 + 4]
    pos = torch.stack([torch.arange(3, 7), torch.arange(p0, p0 + 4), torch.arange(50, 54)])
    out = qmm.attention(batch, pos, heads, kv_heads, cos, sin, k3, v3, 1)
    assert torch.equal(out[1], alone[p0:p0 + 4]), "a verify block differs among other sequences"


def test_attention_refuses_positions_outside_the_caches():
    cos, sin = _rope_tables(LENGTH, 64)
    k_cache, v_cache = torch.zeros(2, 3, LENGTH, 64), torch.zeros(2, 3, LENGTH, 64)
    qkv = torch.randn(1, 2, 15 * 64)
    for pos in ([[LENGTH - 1, LENGTH]], [[-1, 0]]):
        with pytest.raises(ValueError, match="position outside the caches"):
            qmm.attention(qkv, torch.tensor(pos), 9, 3, cos, sin, k_cache, v_cache)


# ---- building ----


def test_a_machine_without_a_c_compiler_gets_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc-xyz")
    out = tmp_path / "kernels" / "qmm.so"
    with pytest.raises(RuntimeError, match="C compiler"):
        qmm.compile_library(out)
    assert not out.exists()


def test_a_failed_compile_raises_and_leaves_no_file_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a "compiler" that exits 1
    out = tmp_path / "kernels" / "qmm.so"
    with pytest.raises(RuntimeError, match="compiling qmm.c failed"):
        qmm.compile_library(out)
    assert list(out.parent.iterdir()) == []


def test_the_prefetch_benchmark_compares_the_two_builds_and_writes_its_figures(tmp_path):
    """scripts/qmm_prefetch.py on one layer: both builds' outputs checked equal, a row per row count;
    with --against, another version of qmm.c, packed in its own layout."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("qmm_prefetch", Path(__file__).parents[1] / "scripts/qmm_prefetch.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "pf.json"
    assert bench.main(["--layers", "1", "--rows", "1,4", "--repeats", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["rows"] for r in result["rows"]] == [1, 4]
    assert all(r["this_ms"] > 0 and r["baseline_ms"] > 0 for r in result["rows"])
    assert result["meta"]["layers"] == 1 and result["meta"]["path"] == qmm.kernel_path() and "cpu_model" in result["meta"]
    assert result["meta"]["baseline"] == "no prefetch"
    with pytest.raises(SystemExit, match="--repeats"):
        bench.main(["--repeats", "1"])
    # another version of qmm.c (a copy here): its own build, packing its own weights
    other = tmp_path / "qmm_other.c"
    other.write_text(qmm._SOURCE.read_text())
    assert bench.main(["--layers", "1", "--rows", "3", "--repeats", "2", "--against", str(other), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["baseline"] == "qmm_other.c" and [r["rows"] for r in result["rows"]] == [3]
