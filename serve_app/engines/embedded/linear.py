"""Matrix products of the forward passes, one class per weight format.

``float32``: on the CPU, oneDNN with each weight reordered once. ``F.linear`` calls a BLAS
sgemm that re-packs the weight on every call; for the few rows of a decode or verify step
that packing costs more than the product: on this project's 2-core AMD machine (one thread,
the 30 gate/up projections of SmolLM2), 1 row took 11.0 ms and 4 rows 17.4 ms through
``F.linear``, against 5.2 and 6.1 ms with the weight reordered once for oneDNN. The reorder
is laid out for 16 rows: one laid out for a single row is slower at every row count (6.9 ms
for 1 row, 11.5 for 4), layouts for 4 to 64 rows are alike. A verify of k + 1 positions then
costs about what one position does, as speculation on a memory-bound model assumes.
Elsewhere (CUDA, other dtypes, a build without oneDNN) it is ``F.linear``.

The compact formats read fewer bytes per step (CPU only): ``bfloat16`` (oneDNN, reordered),
``int8`` (one scale per output row, ``_weight_int8pack_mm``) and ``q4_1`` (4-bit codes with
a scale and a minimum per 32 weights, ``_weight_int4pack_mm_for_cpu``), and ``gguf`` (Q4_1
blocks times int8 activations in ``qmm.c``, llama.cpp's arithmetic; qmm.py). The first three's kernels are
fast for bfloat16 inputs only (float32 ones take a scalar path, 20x slower), so each casts
its input to bfloat16 and its output back; the rest of the model stays in its dtype. The
int4 kernel computes ``w = (q - 8) * scale + zero``, so Q4_1's ``d * q + m`` is scale d and
zero ``m + 8 d``, both rounded to bfloat16.

Lossless speculation needs every product to give a row the same bits whatever the number
of rows beside it. oneDNN's product does not for one row (its single-row path sums a long K
in another order: SmolLM2's down projection, K = 1536, differs in the last bits, in float32
and bfloat16), so one row goes in paired with a copy of itself. In bfloat16 its kernel also
changes with the row count, so that format feeds it 16 rows at a time (``BF16Linear``). The int8 and int4 kernels are row-invariant as they are
(tests/test_linear.py checks 1 to 192 rows for every format).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from .quant import GROUP, Q4Blocks, quantize_q4_1

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "q4_1", "gguf")


def _reorder(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout, or None where that path does not apply."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) \
            or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size=16)
    except (RuntimeError, AttributeError) as e:  # an op this torch build or CPU lacks: the plain path
        if weight.dtype == torch.float32:  # (BF16Linear says what it does instead)
            log.warning("oneDNN linear unavailable (%s); using F.linear", e)
        return None


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product with a reordered weight; one row goes in paired with a copy of itself."""
    if x.numel() != x.shape[-1]:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    pair = x.reshape(1, -1).expand(2, -1).contiguous()
    return torch.ops.mkldnn._linear_pointwise(pair, packed, bias, "none", [], "")[:1].view(*x.shape[:-1], -1)


class Linear:
    """``y = x @ weight.T + bias`` in float32. Where oneDNN applies, only the reordered
    weight is kept."""

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.packed = _reorder(weight) if weight.dtype == torch.float32 else None
        self.weight = weight if self.packed is None else None
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return _onednn(x, self.packed, self.bias)

    def normed(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The product of ``rms_norm(x) * weight``."""
        return self(F.rms_norm(x, (x.shape[-1],), weight, eps))


class _CompactLinear:
    """A product whose kernel takes bfloat16 rows [M, K]: casts in and out, adds the bias."""

    __slots__ = ("bias",)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._product(x.reshape(-1, x.shape[-1]).to(torch.bfloat16)).to(x.dtype)
        out = out.view(*x.shape[:-1], -1)
        return out if self.bias is None else out + self.bias

    normed = Linear.normed


@functools.cache
def _warn_bf16_in_float32() -> None:
    log.warning("this CPU has no bfloat16 product kernel (oneDNN's needs AVX512 or AVX-NE-CONVERT): "
                "bfloat16 weights are multiplied in float32 here, from the same rounded weights and inputs, "
                "at twice their memory")


BF16_ROWS = 16  # rows per oneDNN call in bfloat16: the layout the weight is reordered for


class BF16Linear(_CompactLinear):
    """The weight rounded to bfloat16, reordered once for oneDNN, in calls of 16 rows.

    oneDNN picks its bfloat16 kernel by the row count, and the kernels sum K in different
    orders (on this project's machine, K = 1536 from 13 rows on, K = 576 from 24; other CPUs
    differ elsewhere, and a bfloat16 output hides most differences, so a probe cannot rule
    them out). So every call has exactly 16 rows, the last one padded with zeros: a row's bits
    then depend on nothing beside it. Each call reads the weight once. Measured on this
    machine, one thread, against one call of all the rows: 576 x 1536, 1.3-1.6x at 1 to 16
    rows and about 3x at 64 to 128; the LM head (49152 x 576), 1.1x at 1 to 16 rows (2.7
    against 2.5 ms) and 2.7x at 64. Calls of 64 rows would cost the LM head 1.6x at 1 row."""

    __slots__ = ("packed", "wide")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        rounded = weight.to(torch.bfloat16)
        self.packed, self.bias, self.wide = _reorder(rounded), bias, None
        if self.packed is None:  # no bfloat16 kernel on this CPU (oneDNN's needs AVX512 or AVX-NE-CONVERT)
            _warn_bf16_in_float32()
            self.wide = Linear(rounded.float())

    def _product(self, rows):
        if self.wide is not None:  # the same rounded operands, summed in float32, rounded as the kernel's output
            return self.wide(rows.float()).to(torch.bfloat16)
        m = rows.shape[0]
        if m % BF16_ROWS:
            rows = F.pad(rows, (0, 0, 0, BF16_ROWS - m % BF16_ROWS))
        outs = [torch.ops.mkldnn._linear_pointwise(r, self.packed, None, "none", [], "")
                for r in rows.split(BF16_ROWS)]
        return (outs[0] if len(outs) == 1 else torch.cat(outs))[:m]


class Int8Linear(_CompactLinear):
    """The weight as int8 codes with one bfloat16 scale per output row (absmax / 127)."""

    __slots__ = ("codes", "scales")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        self.codes = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scales, self.bias = scale.to(torch.bfloat16), bias

    def _product(self, rows):
        return torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)


class Q4Linear(_CompactLinear):
    """Q4_1 blocks (codes, scale d, min m per 32 weights) packed for the CPU int4 kernel."""

    __slots__ = ("packed", "scales_and_zeros")

    def __init__(self, blocks: Q4Blocks, bias: torch.Tensor | None = None):
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.codes.to(torch.int32), 2)
        zero = blocks.min + 8 * blocks.scale  # the kernel's w = (q - 8) * scale + zero
        self.scales_and_zeros = torch.stack([blocks.scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()
        self.bias = bias

    def _product(self, rows):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_and_zeros)


def make_linear(weights: str, weight: torch.Tensor, bias: torch.Tensor | None = None,
                blocks: Q4Blocks | None = None):
    """The product of ``weight`` in format ``weights``; for ``q4_1``, ``blocks`` where the
    weight was shipped as Q4_1, else blocks are made from it."""
    if weights == "float32":
        return Linear(weight, bias)
    if weight.device.type != "cpu":
        raise ValueError(f"the {weights} weight format runs on the CPU only")
    if weights == "bfloat16":
        return BF16Linear(weight, bias)
    if weights == "int8":
        return Int8Linear(weight, bias)
    if weights == "q4_1":
        return Q4Linear(blocks if blocks is not None else quantize_q4_1(weight), bias)
    if weights == "gguf":
        from .qmm import Q4_1Linear
        return Q4_1Linear(blocks if blocks is not None else quantize_q4_1(weight), bias)
    raise ValueError(f"unknown weight format {weights!r}; known: {', '.join(WEIGHT_FORMATS)}")


class _LinearModule(nn.Module):
    def __init__(self, linear: nn.Linear, weights: str):
        super().__init__()
        weight, bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
        if weights == "gguf":  # a draft head has no shipped blocks: Q4_1 made from its weights
            from .qmm import Q4_1Linear
            self.linear = Q4_1Linear(quantize_q4_1(weight), bias)
        else:
            self.linear = Linear(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def pack_linears(module: nn.Module, weights: str = "float32") -> nn.Module:
    """Swap ``module``'s direct ``nn.Linear`` children for reordered ones (inference only); with
    ``weights`` "gguf", for Q4_1 products made from their weights (a draft head's: the target's
    output does not depend on its drafts; on SmolLM2's chat prompts, 3 steps, its head in Q4_1
    accepted 1.177 drafts a verify against 1.185 in Q8_0, in 0.92 of the step time)."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, _LinearModule(child, weights))
    return module
