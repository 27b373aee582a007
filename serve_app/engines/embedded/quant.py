"""Q4_1 weight blocks: read from a GGUF file as shipped, or made from float32 weights.

Q4_1 (llama.cpp's format) stores each run of 32 weights of a row as 4-bit codes ``q`` with
a float16 scale ``d`` and minimum ``m``: ``w = d * q + m``. ``gguf_q4_1_blocks`` reads the
tensors a GGUF ships as Q4_1 without changing a value, under the Hugging Face names, with
the rows of q and k projections in Hugging Face's order (llama.cpp permutes them for its
rotary layout; transformers undoes that on loading, and so do we). ``gguf_q8_0_tensors``
reads the Q8_0 ones (SmolLM2's embedding, which is also its LM head) the same way. Where a
format needs blocks that a file did not ship, ``quantize_q4_1`` and ``quantize_q8_0`` make
them from float32 weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

GROUP = 32  # weights per Q4_1 block
_BLOCK_BYTES = 2 + 2 + GROUP // 2  # d, m (float16), 32 codes of 4 bits
_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(slots=True)
class Q4Blocks:
    """A [N, K] weight as Q4_1 blocks along K: codes [N, K] (uint8, 0..15), scale and min
    [N, K / 32] (float32, exact copies of the float16 values)."""

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        q = self.codes.view(n, k // GROUP, GROUP).float()
        return (self.scale[..., None] * q + self.min[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list[Q4Blocks]) -> Q4Blocks:
        """The blocks of the weights stacked along N (a fused projection)."""
        return Q4Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "min")))


def quantize_q4_1(weight: torch.Tensor) -> Q4Blocks:
    """Q4_1 blocks of a float32 weight as llama.cpp makes them (min and range per block,
    float16 d and m, codes rounded to nearest)."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"Q4_1 needs in-features divisible by {GROUP}, got {k}")
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    lo, hi = w.amin(-1), w.amax(-1)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = ((w - m[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Q4Blocks(codes.reshape(n, k), d, m)


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks of a float weight as llama.cpp makes them: (codes [N, K] int8, scale
    [N, K / 32] float32 holding the float16 value llama.cpp stores)."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"Q8_0 needs in-features divisible by {GROUP}, got {k}")
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    d = (w.abs().amax(-1) / 127).half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = (w * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
    return codes.reshape(n, k).contiguous(), d.contiguous()


def read_gguf(path: Path):
    """The file's ``gguf.GGUFReader`` (parsing SmolLM2's takes seconds: read it once and hand
    it to both readers below, which also take a path)."""
    from gguf import GGUFReader

    return GGUFReader(str(path))


def _tensors(source):
    return (source if hasattr(source, "tensors") else read_gguf(source)).tensors


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    """Float16 values stored as the last axis's 2 bytes, as float32 (exact)."""
    return two_bytes.copy().view(np.float16)[..., 0].astype(np.float32)


def gguf_q8_0_tensors(source) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The Q8_0 tensors of a Llama GGUF file (a path or ``read_gguf``'s reader) that are not
    per-head permuted (SmolLM2's tied embedding and LM head), keyed by Hugging Face weight
    name: (codes [N, K] int8, scale [N, K / 32] float32, exact copies of the float16 values)."""
    from gguf import GGMLQuantizationType

    names = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
    out = {}
    for t in _tensors(source):
        if t.tensor_type == GGMLQuantizationType.Q8_0 and t.name in names:
            raw = np.asarray(t.data)
            blocks = raw.reshape(raw.shape[0], -1, 2 + GROUP)
            codes = blocks[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1)
            out[names[t.name]] = (torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(_f16(blocks[..., 0:2]))))
    return out


def gguf_q4_1_blocks(source, num_heads: int, num_kv_heads: int) -> dict[str, Q4Blocks]:
    """The Q4_1 tensors of a Llama GGUF file (a path or ``read_gguf``'s reader), keyed by
    Hugging Face weight name."""
    from gguf import GGMLQuantizationType

    blocks = {}
    for t in _tensors(source):
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
        if t.tensor_type != GGMLQuantizationType.Q4_1 or not match or match[2] not in _GGUF_NAMES:
            continue
        raw = np.asarray(t.data)
        n, nb = raw.shape[0], raw.shape[1] // _BLOCK_BYTES
        raw = raw.reshape(n, nb, _BLOCK_BYTES)
        d, m = _f16(raw[..., 0:2]), _f16(raw[..., 2:4])
        qs = raw[..., 4:]  # byte j: code j in its low nibble, code j + 16 in its high one
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, nb * GROUP)
        if match[2] in ("attn_q", "attn_k"):
            heads = num_heads if match[2] == "attn_q" else num_kv_heads
            codes, d, m = (_unpermute_rows(a, heads) for a in (codes, d, m))
        name = f"model.layers.{match[1]}.{_GGUF_NAMES[match[2]]}.weight"
        blocks[name] = Q4Blocks(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (codes, d, m)))
    return blocks


def _unpermute_rows(a: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of q/k projections (as transformers does)."""
    return a.reshape(heads, a.shape[0] // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
