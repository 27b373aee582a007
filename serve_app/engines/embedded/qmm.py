"""The ``gguf`` weight format's kernels (``qmm.c``): Q4_1 and Q8_0 weights as a GGUF ships
them, times activations quantized to int8 per block of 32, and a layer's attention.

That is llama.cpp's arithmetic (Q4_1 x Q8_1, Q8_0 x Q8_0): each block's dot product is an exact
integer sum (AVX512-VNNI, else AVX2), so a product reads 5 (Q4_1) or 9.5 (Q8_0, with its
correction term) bits a weight and does little float work. PyTorch's int4 kernel (the ``q4_1``
format) keeps bfloat16 activations and converts every weight to float. ggml itself (through
ggml-python) multiplies one row of activations at a time, so 4 rows cost it 3.7x one row,
where a verify of 4 positions needs near 1x: ``qmm.c`` shares each weight load between rows.

The C file is compiled on first use with the machine's compiler and ``-march=native`` into
the cache (``SPECSERVE_CACHE``, default ~/.cache/specserve), keyed by the source and the CPU,
and loaded with ctypes. A machine without a C compiler gets a clear error naming the format.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from .quant import GROUP, Q4Blocks

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("qmm.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_profiled = False  # bench ops: each call shows in torch.profiler as "qmm"


def profile_calls(on: bool) -> None:
    """Name each product "qmm" for torch.profiler (ctypes calls are invisible to it otherwise)."""
    global _profiled
    _profiled = on


def _cpu_key() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return "\n".join(lines)


def library_path() -> Path:
    """Where the compiled kernels for this source and this CPU live."""
    from .weights import cache_dir

    key = hashlib.sha256(_SOURCE.read_bytes() + _cpu_key().encode() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"qmm-{key}.so"


def compile_library(out: Path, extra_flags: tuple[str, ...] = (), source: Path = _SOURCE) -> Path:
    """Compile qmm.c (or another version of it, ``source``) into ``out`` (``extra_flags``: e.g.
    ``-DQMM_NO_AVX512 -mno-avx512f`` for the AVX2 path, as tests do); written whole or not at all."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None or shutil.which(cc) is None:
        raise RuntimeError("the gguf weight format compiles its kernels with a C compiler, and none was found "
                           "(install gcc, or choose weights: q4_1)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        run = subprocess.run([cc, *_FLAGS, *extra_flags, str(source), "-o", tmp, "-lm"], capture_output=True,
                             text=True)
        if run.returncode:
            raise RuntimeError(f"compiling {source.name} failed:\n{run.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: replicas starting together each see a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def library() -> ctypes.CDLL:
    """The compiled kernels (compiled once per source and CPU, then loaded)."""
    global _lib
    with _lock:
        if _lib is None:
            path = library_path()
            if not path.exists():
                log.info("compiling %s into %s (once)", _SOURCE.name, path)
                compile_library(path)
            _lib = load(path)
        return _lib


class EagleParts(ctypes.Structure):
    """qmm.c's ``eagle_t``: a Q4_1 draft head's weights, tables and caches, by address."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("qkv", "o", "gate_up", "down", "lm_head", "norm_in", "norm_mlp", "norm_out", "embed", "d2t",
                 "cos", "sin", "kc", "vc")] + \
               [(name, ctypes.c_int64) for name in
                ("d", "heads", "kv_heads", "head_dim", "inter", "draft_vocab", "length")] + [("eps", ctypes.c_float)]


def load(path: Path) -> ctypes.CDLL:
    """A compiled qmm library, its functions typed."""
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in ("qmm_q4_1_packed_size", "qmm_q8_0_packed_size"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [i64, i64], i64
    lib.qmm_pack_q4_1.argtypes = [ptr, ptr, ptr, i64, i64, ptr]
    lib.qmm_pack_q8_0.argtypes = [ptr, ptr, i64, i64, ptr]
    for name in ("qmm_linear_q4_1", "qmm_linear_q8_0"):
        getattr(lib, name).argtypes = [ptr, ptr, ctypes.c_float, i64, i64, ptr, i64, ptr]
        getattr(lib, name).restype = ctypes.c_int
    lib.qmm_path.restype = ctypes.c_char_p
    lib.qmm_attention.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr]
    lib.qmm_attention.restype = ctypes.c_int
    lib.qmm_eagle_propose.argtypes = [ctypes.POINTER(EagleParts), ptr, ptr, ptr, ptr, ptr, i64, i64, ptr]
    lib.qmm_eagle_propose.restype = ctypes.c_int
    return lib


def kernel_path() -> str:
    """Which of qmm.c's paths this CPU runs: avx512-vnni, avx2 or c."""
    return library().qmm_path().decode()


class _QuantLinear:
    """A product ``y = x @ W.T (+ bias)`` in float32 through one of qmm.c's kernels, with the
    weight repacked once into the layout of the kernel compiled for this CPU."""

    __slots__ = ("n", "k", "bias", "packed", "_run")

    def __init__(self, n: int, k: int, bias: torch.Tensor | None, kind: str, *pack_args: torch.Tensor):
        if k % GROUP:
            raise ValueError(f"the gguf format needs in-features divisible by {GROUP}, got {k}")
        lib = library()
        self.n, self.k, self.bias = n, k, bias
        self.packed = torch.empty(getattr(lib, f"qmm_{kind}_packed_size")(n, k), dtype=torch.uint8)
        args = [a.contiguous() for a in pack_args]
        getattr(lib, f"qmm_pack_{kind}")(*(a.data_ptr() for a in args), n, k, self.packed.data_ptr())
        self._run = getattr(lib, f"qmm_linear_{kind}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, None, 0.0)

    def normed(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The product of ``rms_norm(x) * weight``, the norm computed row by row in the kernel."""
        return self._product(x, weight, eps)

    def _product(self, x: torch.Tensor, norm: torch.Tensor | None, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, self.k)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        if norm is not None and (norm.dtype != torch.float32 or not norm.is_contiguous()):
            norm = norm.float().contiguous()
        m = rows.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32)
        _call(self._run, "qmm", rows.data_ptr(), None if norm is None else norm.data_ptr(), eps, m, self.k,
              self.packed.data_ptr(), self.n, y.data_ptr())
        y = y.view(*x.shape[:-1], self.n).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Q4_1Linear(_QuantLinear):
    """Q4_1 blocks (as shipped, or made from float32) times int8 activations."""

    __slots__ = ()

    def __init__(self, blocks: Q4Blocks, bias: torch.Tensor | None = None):
        n, k = blocks.codes.shape
        super().__init__(n, k, bias, "q4_1", blocks.codes.to(torch.uint8), blocks.scale.float(), blocks.min.float())


class Q8_0Linear(_QuantLinear):
    """Q8_0 blocks (int8 codes, one float16 scale per 32 weights) times int8 activations."""

    __slots__ = ()

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        n, k = codes.shape
        super().__init__(n, k, bias, "q8_0", codes.to(torch.int8), scale.float())


def attention(qkv: torch.Tensor, pos: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor,
              sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot0: int = 0,
              slots: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's attention in qmm.c: RoPE on ``qkv`` [B, q, (H + 2 KV) * D]'s queries and
    keys, keys and values written into the caches [slots, KV, length, D] at ``pos`` [B, q]
    (sequence b in slot ``slots[b]``, or ``slot0 + b`` without ``slots``), and each query
    attending to its sequence's keys up to its position. Returns [B, q, H * D]. float32 on the
    CPU only."""
    B, q, width = qkv.shape
    d = width // (heads + 2 * kv_heads)
    qkv, pos = qkv.float().contiguous(), pos.to(torch.int64).contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == torch.float32):
        raise ValueError("qmm attention needs contiguous float32 caches")
    if slots is not None:
        slots = slots.to(torch.int64).contiguous()
        if slots.shape != (B,):
            raise ValueError(f"qmm attention: {tuple(slots.shape)} slots for {B} sequences")
    out = torch.empty(B, q, heads * d, dtype=torch.float32)
    _call(library().qmm_attention, "qmm attention", qkv.data_ptr(), pos.data_ptr(), B, q, heads, kv_heads, d,
          cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot0,
          None if slots is None else slots.data_ptr(), k_cache.shape[2], out.data_ptr())
    return out


def eagle_propose(parts: EagleParts, g: torch.Tensor, tokens: torch.Tensor, index: torch.Tensor, k: int,
                  drafts: torch.Tensor) -> None:
    """qmm.c's draft head (``qmm_eagle_propose``) into ``drafts`` [B, k]: features ``g`` [R, d]
    (float32) and ``tokens`` [R], ``index`` [3 B] the sequences' first cache indices, row counts
    (summing to R) and slots, int64; all contiguous (eagle.py's ``_FusedHead`` checks them)."""
    B = drafts.shape[0]
    _call(library().qmm_eagle_propose, "qmm eagle", ctypes.byref(parts), g.data_ptr(), tokens.data_ptr(),
          index.data_ptr(), index[B:].data_ptr(), index[2 * B:].data_ptr(), B, k, drafts.data_ptr())


def _call(kernel, name: str, *args) -> None:
    """Run a kernel (named ``name`` for torch.profiler under ``profile_calls``); it fails when
    its scratch memory cannot be allocated (-1) or on a position outside the caches (-2)."""
    if _profiled:
        with torch.profiler.record_function(name):
            failed = kernel(*args)
    else:
        failed = kernel(*args)
    if failed == -2:
        raise ValueError(f"{name}: a position outside the caches")
    if failed:
        raise MemoryError(f"{name}: no memory for the kernel's scratch buffers")
