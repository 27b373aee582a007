"""Matrix products of the forward passes: on the CPU, oneDNN with each weight reordered once.

In float32 on the CPU, ``F.linear`` calls a BLAS sgemm that re-packs the weight on every
call. For the few rows of a decode or verify step that packing costs more than the product:
on this project's 2-core AMD machine (one thread, the 30 gate/up projections of SmolLM2),
1 row took 11.0 ms and 4 rows 17.4 ms through ``F.linear``, against 5.2 and 6.1 ms with the
weight reordered once for oneDNN. The reorder is laid out for 16 rows: one laid out for a
single row is slower at every row count (6.9 ms for 1 row, 11.5 for 4), layouts for 4 to 64
rows are alike. A verify of k + 1 positions then costs about what one position does, as
speculation on a memory-bound model assumes. Elsewhere (CUDA, other dtypes, a build without
oneDNN) it is ``F.linear``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


def _reorder(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout, or None where that path does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size=16)
    except (RuntimeError, AttributeError) as e:  # an op this torch build lacks: the plain path
        log.warning("oneDNN linear unavailable (%s); using F.linear", e)
        return None


class Linear:
    """``y = x @ weight.T + bias``. Where oneDNN applies, only the reordered weight is kept."""

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.packed = _reorder(weight)
        self.weight = weight if self.packed is None else None
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class _LinearModule(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = Linear(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def pack_linears(module: nn.Module) -> nn.Module:
    """Swap ``module``'s direct ``nn.Linear`` children for reordered ones (inference only)."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, _LinearModule(child))
    return module
