"""The Llama forward pass over a slot KV cache, in plain PyTorch.

One function serves prefill, plain decode and speculative verify: every call feeds ``q``
tokens to each of ``B`` sequences (slot ``b`` of the cache holds sequence ``b``), writes
their keys and values at positions ``lens[b] .. lens[b]+q-1`` and attends causally to
everything before, through ``attention.py``'s row-invariant attention. Right-padded prefill
works the same way: padding writes past a sequence's length, which the mask hides and later
steps overwrite. So does rollback of
rejected draft tokens: a sequence's length simply does not advance over them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import qmm
from .attention import attend, padded_length
from .kv_cache import KVCache
from .linear import make_linear
from .quant import Q4Blocks, quantize_q8_0
from .weights import LlamaShape


class Llama:
    """Weights of a Llama-family model, fused for fewer kernel launches; the matrix products
    are ``linear.py``'s in the format ``weights`` (float32: oneDNN with weights reordered
    once). ``blocks`` are Q4_1 blocks as a GGUF shipped them, used by the ``q4_1`` and ``gguf``
    formats for the layers' projections; ``q8_0`` the Q8_0 tensors it shipped, the ``gguf``
    format's LM head (``q4_1``'s is bfloat16)."""

    def __init__(self, shape: LlamaShape, state: dict[str, torch.Tensor], device, dtype,
                 weights: str = "float32", blocks: dict[str, Q4Blocks] | None = None,
                 q8_0: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.shape = shape
        self.device, self.dtype, self.weights = device, dtype, weights
        blocks = blocks or {}

        def t(name):
            # A copy: a tensor loaded from safetensors is a view of the file's mapping, and
            # one kept view (the embedding) would keep the whole file mapped.
            return state[name].to(device=device, dtype=dtype, copy=True).contiguous()

        def linear(names, bias=None, fmt=weights):
            weight = torch.cat([t(n) for n in names])
            shipped = [blocks.get(n) for n in names]
            return make_linear(fmt, weight, bias, None if None in shipped else Q4Blocks.cat(shipped))

        self.embed = t("model.embed_tokens.weight")
        head = "model.embed_tokens.weight" if shape.tie_word_embeddings or "lm_head.weight" not in state \
            else "lm_head.weight"
        # Q4_1 blocks of the LM head would coarsen it (SmolLM2 ships it as Q8_0): on the chat
        # prompts, 15 % of float32's greedy tokens stayed the same against 53 % in bfloat16.
        if weights == "gguf":  # the LM head in Q8_0, as llama.cpp runs it: shipped, else made from float32
            from .qmm import Q8_0Linear
            self.lm_head_linear = Q8_0Linear(*((q8_0 or {}).get(head) or quantize_q8_0(state[head])))
        else:
            self.lm_head_linear = linear([head], fmt="bfloat16" if weights == "q4_1" else weights)
        self.lm_head = self.embed if head == "model.embed_tokens.weight" else t(head)  # the float weight, for the head trainer
        self.norm = t("model.norm.weight")
        self.layers = []
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            bias = None
            if p + "self_attn.q_proj.bias" in state:  # Qwen2
                bias = torch.cat([t(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.layers.append(dict(
                ln1=t(p + "input_layernorm.weight"),
                qkv=linear([p + f"self_attn.{n}_proj.weight" for n in "qkv"], bias),
                o=linear([p + "self_attn.o_proj.weight"]),
                ln2=t(p + "post_attention_layernorm.weight"),
                gate_up=linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=linear([p + "mlp.down_proj.weight"]),
            ))
        self.cos, self.sin = rope_tables(shape.head_dim, shape.rope_theta, shape.max_position_embeddings + 64,
                                         device, dtype)
        # The gguf format runs each layer's attention in qmm.c (RoPE, cache write, attention).
        self.fused_attention = weights == "gguf" and dtype == torch.float32

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, lens: torch.Tensor, cache: KVCache, slot0: int = 0,
                logit_index: torch.Tensor | None = None,
                taps: tuple[int, ...] | None = None,
                fed: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``tokens`` [B, q] of the sequences in slots ``slot0 .. slot0+B-1`` at positions
        ``lens[b] + i``; return (logits, hidden).

        ``logit_index`` [B, n] picks which of the q positions get logits (all if None);
        hidden is the final-norm hidden state of every fed position, [B, q, hidden], or, with
        ``taps``, the inputs of those layers concatenated, [B, q, len(taps) * hidden].

        ``fed`` (with ``logit_index`` None): row b's tokens are its first ``fed[b]``, the rest
        padding. The per-position work (projections, MLPs, norms, the LM head) then runs on the
        fed positions alone, packed into one matrix; attention sees the padded layout with
        zeros at the padding (keys written past a sequence's length, which no query of it sees
        and later steps overwrite). Logits and hidden states at padding are zeros. The matrix
        products are row-invariant, so a fed position's results are those of the padded call.
        """
        s = self.shape
        B, q = tokens.shape
        pos = lens[:, None] + torch.arange(q, device=tokens.device)  # [B, q]
        L = padded_length(int(lens.max()) + q)
        cache.reserve(slot0 + B, L)
        attention = self._fused_attention if self.fused_attention else self._attention(pos, L, slot0)
        if fed is not None and logit_index is None and sum(fed) < B * q:
            return self._ragged(tokens, pos, cache, slot0, attention, taps, fed)

        x = F.embedding(tokens, self.embed)
        tapped = []
        for i, w in enumerate(self.layers):
            if taps and i in taps:
                tapped.append(x)
            qkv = w["qkv"].normed(x, w["ln1"], s.rms_norm_eps)
            x = x + w["o"](attention(qkv, pos, *cache.layer(i), slot0))
            gate, up = w["gate_up"].normed(x, w["ln2"], s.rms_norm_eps).chunk(2, dim=-1)
            x = x + w["down"](F.silu(gate) * up)
        hidden = F.rms_norm(x, (s.hidden_size,), self.norm, s.rms_norm_eps)
        picked = hidden if logit_index is None else hidden[torch.arange(B)[:, None], logit_index]
        return self.lm_head_linear(picked).float(), torch.cat(tapped, dim=-1) if taps else hidden

    def _ragged(self, tokens, pos, cache, slot0, attention, taps, fed):
        """:meth:`forward` of the first ``fed[b]`` positions of each row (a ragged verify)."""
        s = self.shape
        B, q = tokens.shape
        at = (torch.arange(q)[None, :] < torch.tensor(fed)[:, None]).view(-1).nonzero().squeeze(1).to(tokens.device)

        def padded(rows: torch.Tensor) -> torch.Tensor:  # [N, C] at the fed positions -> [B, q, C]
            out = rows.new_zeros(B * q, rows.shape[-1])
            out[at] = rows
            return out.view(B, q, -1)

        x = F.embedding(tokens.reshape(-1)[at], self.embed)  # [N, hidden]
        tapped = []
        for i, w in enumerate(self.layers):
            if taps and i in taps:
                tapped.append(x)
            qkv = padded(w["qkv"].normed(x, w["ln1"], s.rms_norm_eps))
            x = x + w["o"](attention(qkv, pos, *cache.layer(i), slot0).reshape(B * q, -1)[at])
            gate, up = w["gate_up"].normed(x, w["ln2"], s.rms_norm_eps).chunk(2, dim=-1)
            x = x + w["down"](F.silu(gate) * up)
        hidden = F.rms_norm(x, (s.hidden_size,), self.norm, s.rms_norm_eps)
        logits = padded(self.lm_head_linear(hidden).float())
        return logits, padded(torch.cat(tapped, dim=-1) if taps else hidden)

    def _fused_attention(self, qkv, pos, k_cache, v_cache, slot0):
        """One layer's attention in qmm.c (the gguf format): RoPE, the cache write, attention."""
        s = self.shape
        return qmm.attention(qkv, pos, s.num_heads, s.num_kv_heads, self.cos, self.sin, k_cache, v_cache, slot0)

    def _attention(self, pos: torch.Tensor, L: int, slot0: int):
        """One layer's attention in PyTorch for this forward's positions: RoPE, the cache write
        at ``pos``, and ``attention.py``'s row-invariant attention over L keys."""
        s = self.shape
        B, q = pos.shape
        visible = torch.arange(L, device=pos.device)[None, None, :] <= pos[:, :, None]  # [B, q, L]
        cos, sin = self.cos[pos].unsqueeze(2), self.sin[pos].unsqueeze(2)  # [B, q, 1, D]
        rows = torch.arange(slot0, slot0 + B, device=pos.device)[:, None].expand(B, q)
        nq, nkv, d = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.head_dim

        def attention(qkv, pos, k_cache, v_cache, slot0):
            xq = qkv[..., :nq].view(B, q, s.num_heads, d)
            xk = qkv[..., nq:nq + nkv].view(B, q, s.num_kv_heads, d)
            xv = qkv[..., nq + nkv:].view(B, q, s.num_kv_heads, d)
            xq, xk = rope(xq, cos, sin), rope(xk, cos, sin)
            k_cache[rows, :, pos] = xk
            v_cache[rows, :, pos] = xv
            return attend(xq, k_cache[slot0:slot0 + B, :, :L], v_cache[slot0:slot0 + B, :, :L], visible)

        return attention


def rope_tables(head_dim: int, theta: float, positions: int, device=None, dtype=torch.float32):
    """cos, sin [positions, head_dim] (the halves layout), computed in float64 and then cast."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (the halves layout), shared by the target and the draft head."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
