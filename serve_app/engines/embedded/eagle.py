"""An EAGLE-3 style draft head and the drafter that runs it.

The head is one Llama decoder layer. At head position ``p`` it reads the target's fused
features of position ``p - 1`` (the inputs of a low, a middle and a high layer, projected by
``fc`` from 3·d to d) and the embedding of token ``p`` (the target's own, frozen), and
predicts token ``p + 1`` over a reduced draft vocabulary (``d2t`` maps it back to full
ids). Drafting k tokens runs the head k times; after the first, the feature input is the
head's own output hidden state of the previous position, as in EAGLE.

Head index ``i`` (= ``p - 1``) is both the head's KV-cache index and its RoPE position.

The drafter keeps, per sequence, the head's KV cache of every verified position and the
projected features the target produced since the head last ran. ``observe`` (every step,
speculative or not) only projects and stores features; ``propose`` first runs the head
over the stored positions in one batched pass (catch-up: after a speculative step that
is the 1 + accepted verified positions, after a stretch without speculation it is every
token decoded meanwhile), then drafts. Draft positions are written past the verified
length and simply overwritten next time, as the target's cache does with rejected tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import qmm
from .linear import pack_linears
from .model import rope as apply_rope
from .model import rope_tables as rope_tables_for

HEADS_DIR = Path(__file__).parent / "heads"


@dataclass(slots=True)
class HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    target_vocab_size: int
    feature_layers: tuple[int, ...]
    rms_norm_eps: float
    rope_theta: float

    @classmethod
    def for_target(cls, shape, draft_vocab_size: int) -> HeadConfig:
        L = shape.num_layers
        layers = tuple(sorted({min(2, L - 1), L // 2, max(L - 3, 0)}))
        return cls(shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size,
                   draft_vocab_size, shape.vocab_size, layers, shape.rms_norm_eps, shape.rope_theta)


class EagleHead(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.config = c
        d, nq, nkv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.fc = nn.Linear(len(c.feature_layers) * d, d, bias=False)
        self.norm_embed = nn.Parameter(torch.ones(d))
        self.norm_feature = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(2 * d, nq + 2 * nkv, bias=False)
        self.o = nn.Linear(nq, d, bias=False)
        self.norm_mlp = nn.Parameter(torch.ones(d))
        self.gate_up = nn.Linear(d, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, d, bias=False)
        self.norm_out = nn.Parameter(torch.ones(d))
        self.lm_head = nn.Linear(d, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.arange(c.draft_vocab_size), persistent=True)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        self._inv_freq = inv

    def rope(self, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., 1, D] for integer positions ``pos``."""
        freqs = pos.to(torch.float64)[..., None] * self._inv_freq.to(pos.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype).unsqueeze(-2), emb.sin().to(dtype).unsqueeze(-2)

    def qkv_rows(self, g: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The layer's q, k and v projections, before RoPE, [B, q, (H + 2 KV) * D], from feature
        ``g`` and token embedding ``e`` [B, q, d]."""
        eps, d = self.config.rms_norm_eps, self.config.hidden_size
        h = torch.cat([F.rms_norm(e, (d,), self.norm_embed, eps), F.rms_norm(g, (d,), self.norm_feature, eps)], -1)
        return self.qkv(h)

    def qkv_proj(self, g: torch.Tensor, e: torch.Tensor, cos, sin):
        """q [B,q,H,D], k, v [B,q,KV,D] from feature ``g`` and token embedding ``e`` [B,q,d]."""
        c = self.config
        qkv = self.qkv_rows(g, e)
        B, q = g.shape[:2]
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        xq = qkv[..., :nq].view(B, q, c.num_heads, c.head_dim)
        xk = qkv[..., nq:nq + nkv].view(B, q, c.num_kv_heads, c.head_dim)
        xv = qkv[..., nq + nkv:].view(B, q, c.num_kv_heads, c.head_dim)
        return apply_rope(xq, cos, sin), apply_rope(xk, cos, sin), xv

    def finish(self, g: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output hidden state from its residual input ``g`` and attention [B,H,q,D]."""
        B, _, q, _ = attn.shape
        return self.finish_rows(g, attn.transpose(1, 2).reshape(B, q, -1))

    def finish_rows(self, g: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """``finish`` with the attention as rows, [B, q, H * D]."""
        c = self.config
        x = g + self.o(attn)
        gate, up = self.gate_up(F.rms_norm(x, (c.hidden_size,), self.norm_mlp, c.rms_norm_eps)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)

    def logits(self, a: torch.Tensor) -> torch.Tensor:
        return self.lm_head(F.rms_norm(a, (self.config.hidden_size,), self.norm_out, self.config.rms_norm_eps))


# -- files --------------------------------------------------------------------------------
def save_head(head: EagleHead, path: Path, meta: dict) -> Path:
    """Write ``path`` (.safetensors) and its .json (config, sha256, how it was made)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous().cpu()
             for k, v in head.state_dict().items()}
    save_file(state, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    info = {"sha256": digest, "config": asdict(head.config)} | meta
    path.with_suffix(".json").write_text(json.dumps(info, indent=2) + "\n")
    return path


def load_head(path: Path, device="cpu", dtype=torch.float32) -> tuple[EagleHead, dict]:
    """Load a head, refusing a file whose sha256 differs from its .json."""
    from safetensors.torch import load

    path = Path(path)
    info = json.loads(path.with_suffix(".json").read_text())
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != info["sha256"]:
        raise ValueError(f"draft head {path} has sha256 {digest}, its manifest says {info['sha256']}")
    cfg = dict(info["config"])
    cfg["feature_layers"] = tuple(cfg["feature_layers"])
    head = EagleHead(HeadConfig(**cfg))
    head.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in load(data).items()})
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False), info


def default_head_path(model_name: str) -> Path:
    return HEADS_DIR / f"{model_name}.safetensors"


# -- the drafter --------------------------------------------------------------------------
class EagleDrafter:
    """Drafts with an EAGLE-style head; see the module docstring for its state."""

    needs_hidden = True

    def __init__(self, head: EagleHead, embed: torch.Tensor, max_num_seqs: int, capacity: int,
                 rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None):
        c = head.config
        self.head, self.embed = head, embed
        # With the target's RoPE tables (cos, sin [positions, D], float32), the head's attention
        # runs in qmm.c, as the gguf target's layers do: RoPE, the cache write and attention in
        # one call instead of some twenty PyTorch ops a draft step.
        self.rope_tables = rope_tables
        # With them and the head's products in qmm.c as well, ``propose`` is one C call past its
        # bookkeeping (``_FusedHead``, ``self.fused``); the PyTorch modules' small ops cost more
        # than the head's products.
        self.feature_layers = c.feature_layers
        p = next(head.parameters())
        self.scratch = capacity  # one index past the rest: where padding rows write
        shape = (max_num_seqs, c.num_kv_heads, capacity + 1, c.head_dim)
        self.k = torch.zeros(shape, device=p.device, dtype=p.dtype)
        self.v = torch.zeros(shape, device=p.device, dtype=p.dtype)
        self.fused = None if rope_tables is None else _FusedHead.of(head, embed, rope_tables, self.k, self.v)
        self.free = list(range(max_num_seqs - 1, -1, -1))
        self.slot: dict[str, int] = {}
        self.length: dict[str, int] = {}  # head positions in the cache (verified)
        self.pending: dict[str, list[torch.Tensor]] = {}  # projected target features not yet run
        self.pending_rows: dict[str, int] = {}  # their positions

    @torch.inference_mode()
    def observe(self, seq_ids: Sequence[str], hidden: torch.Tensor, num_valid: Sequence[int]) -> None:
        g = self.head.fc(hidden) if self.fused is None else self.fused.fc(hidden)
        for row, (sid, n) in enumerate(zip(seq_ids, num_valid, strict=True)):
            if sid not in self.slot:
                self.slot[sid], self.length[sid], self.pending[sid] = self.free.pop(), 0, []
                self.pending_rows[sid] = 0
            self.pending[sid].append(g[row, :n])
            self.pending_rows[sid] += n

    def backlog(self, seq_ids: Sequence[str]) -> list[int]:
        return [self.pending_rows.get(s, 0) for s in seq_ids]

    def sources(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> list[str]:
        return ["head"] * len(seq_ids)

    def lookup_drafts(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        return [[] for _ in seq_ids]  # no sequence is the lookup's

    def release(self, seq_id: str) -> None:
        if seq_id in self.slot:
            self.free.append(self.slot.pop(seq_id))
            del self.length[seq_id], self.pending[seq_id], self.pending_rows[seq_id]

    @torch.inference_mode()
    def propose(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        if k <= 0 or not seq_ids:
            return [[] for _ in seq_ids]
        # Catch up: run the head over every verified position it has not seen (1 + accepted
        # after a speculative step, every token decoded meanwhile after plain steps).
        feats = [torch.cat(self.pending[s]) for s in seq_ids]
        starts = [self.length[s] for s in seq_ids]
        n = [len(f) for f in feats]
        # head index i reads feature i and token i + 1
        tokens = [list(ids[start + 1:start + 1 + m]) for ids, start, m in zip(token_ids, starts, n, strict=True)]
        slots = [self.slot[s] for s in seq_ids]
        if self.fused is not None:
            drafts = self.fused.propose(torch.cat(feats), tokens, starts, n, slots, k)
        else:
            drafts = self._propose(feats, tokens, starts, n, slots, k)
        for s, m in zip(seq_ids, n, strict=True):
            self.length[s] += m
            self.pending[s], self.pending_rows[s] = [], 0
        return drafts

    def _propose(self, feats: list[torch.Tensor], tokens: list[list[int]], starts: list[int], n: list[int],
                 slots: list[int], k: int) -> list[list[int]]:
        """``propose`` in PyTorch modules: the catch-up in groups of sequences, each padded to
        its longest (:func:`catch_up_groups`), then the ``k`` draft passes over the batch."""
        head, dev, B = self.head, self.k.device, len(feats)
        a = torch.empty((B, 1, feats[0].shape[-1]), device=dev, dtype=self.k.dtype)
        for group in catch_up_groups(n):
            width = max(n[b] for b in group)
            g = torch.zeros((len(group), width, feats[0].shape[-1]), device=dev, dtype=self.k.dtype)
            tok = torch.zeros((len(group), width), dtype=torch.long)
            for row, b in enumerate(group):
                g[row, :n[b]] = feats[b]
                tok[row, :n[b]] = torch.tensor(tokens[b])
            num = torch.tensor([n[b] for b in group], device=dev)
            out = self._run(g, tok.to(dev), torch.tensor([starts[b] for b in group], device=dev),
                            torch.tensor([slots[b] for b in group], device=dev), num)
            a[torch.tensor(group, device=dev)] = out[torch.arange(len(group), device=dev), num - 1][:, None]
        lens = torch.tensor(starts, device=dev) + torch.tensor(n, device=dev)
        slot = torch.tensor(slots, device=dev)
        drafts = []
        for j in range(k):
            t = head.logits(a[:, 0]).argmax(-1)
            drafts.append(head.d2t[t])
            if j + 1 < k:
                a = self._run(a, drafts[-1][:, None], lens + j, slot)
        return torch.stack(drafts, 1).tolist()

    def _run(self, g: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor,
             num: torch.Tensor | None = None) -> torch.Tensor:
        """The head over ``g``/``tokens`` [B, q] at cache indices ``lens[b] + i`` (the first
        ``num[b]`` of them; the rest is padding); returns hidden [B, q, d]."""
        B, q = tokens.shape
        pos = lens[:, None] + torch.arange(q, device=lens.device)
        if self.rope_tables is not None:
            c = self.head.config
            # Padding rows write past their sequence's verified length, which later steps
            # overwrite before any query reads it (as in the target's cache); only a row past
            # the cache's end is held at the scratch index.
            qkv = self.head.qkv_rows(g, F.embedding(tokens, self.embed))
            attn = qmm.attention(qkv, pos.clamp(max=self.scratch), c.num_heads, c.num_kv_heads, *self.rope_tables,
                                 self.k, self.v, slots=slots)
            return self.head.finish_rows(g, attn)
        cos, sin = self.head.rope(pos, g.dtype)
        xq, xk, xv = self.head.qkv_proj(g, F.embedding(tokens, self.embed), cos, sin)
        rows = slots[:, None].expand(B, q)
        wpos = pos if num is None else torch.where(pos < (lens + num)[:, None], pos, self.scratch)
        self.k[rows, :, wpos] = xk
        self.v[rows, :, wpos] = xv
        L = int(pos.max()) + 1 if num is None else int((lens + num).max())
        mask = (torch.arange(L, device=lens.device)[None, None, :] <= pos[:, :, None]).unsqueeze(1)
        attn = F.scaled_dot_product_attention(xq.transpose(1, 2), self.k[slots, :, :L], self.v[slots, :, :L],
                                              attn_mask=mask, enable_gqa=True)
        return self.head.finish(g, attn)


PASS_ROWS = 16
"""What a catch-up pass of its own counts for, in padded rows. The float32 head's fit in
docs/benchmarks.md (`bench steps`) is 2.3 ms a pass and 0.074 ms a position, a pass worth ~30
rows; the split pays where lengths differ by hundreds (a prompt against 1 + accepted), and
below that a few rows either way cost little."""


def catch_up_groups(n: Sequence[int], pass_rows: int = PASS_ROWS) -> list[list[int]]:
    """The sequences' catch-up in padded passes: indices into ``n`` (each sequence's positions),
    grouped by length so that the padded rows plus ``pass_rows`` a pass are fewest. A sequence
    resuming after plain steps (or new, with its prompt) catches up on hundreds of positions
    where the rest catch up on ``1 + accepted``; one pass would pad every row to its length."""
    lengths = sorted(set(n), reverse=True)
    tally = Counter(n)
    count = [tally[length] for length in lengths]
    # best[i]: the fewest rows for the sequences of lengths[i:], in groups of neighbouring lengths
    best, cut = [0] * (len(lengths) + 1), [0] * len(lengths)
    for i in range(len(lengths) - 1, -1, -1):
        best[i], cut[i] = min((sum(count[i:j]) * lengths[i] + pass_rows + best[j], j)
                              for j in range(i + 1, len(lengths) + 1))
    groups, i = [], 0
    while i < len(lengths):
        members = set(lengths[i:cut[i]])
        groups.append([b for b, m in enumerate(n) if m in members])
        i = cut[i]
    return groups


class _FusedHead:
    """A Q4_1 head with qmm.c's attention: ``propose``'s passes in one C call (qmm.c's
    ``qmm_eagle_propose``) over the sequences' catch-up rows unpadded; its float rounding is
    qmm.c's (norms, SiLU) instead of PyTorch's."""

    __slots__ = ("fc", "parts", "slots", "vocab", "_keep")

    def __init__(self, head: EagleHead, linears: list, embed: torch.Tensor, rope_tables, k: torch.Tensor,
                 v: torch.Tensor):
        c = head.config
        self.fc = linears[0]
        floats = [w.detach().float().contiguous() for w in  # in eagle_t's order: norms, embed, cos, sin
                  (torch.stack([head.norm_embed, head.norm_feature]), head.norm_mlp, head.norm_out, embed,
                   *rope_tables)]
        d2t = head.d2t.to(torch.int64).contiguous()
        self.slots, self.vocab = k.shape[0], embed.shape[0]
        if not (k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype == torch.float32):
            raise ValueError("the fused draft head needs contiguous float32 caches")
        if rope_tables[0].shape[0] < k.shape[2]:  # the scratch index's RoPE is read, if never used
            raise ValueError(f"RoPE tables of {rope_tables[0].shape[0]} positions for a head cache of {k.shape[2]}")
        if int(d2t.min()) < 0 or int(d2t.max()) >= self.vocab:
            raise ValueError(f"the draft head maps to token ids outside the target's {self.vocab}")
        self._keep = (linears, floats, d2t, k, v)  # the addresses below stay valid while this lives
        ptrs = [x.packed.data_ptr() for x in linears[1:]] + [t.data_ptr() for t in floats[:4]] + \
            [d2t.data_ptr()] + [t.data_ptr() for t in floats[4:]] + [k.data_ptr(), v.data_ptr()]
        self.parts = qmm.EagleParts(*ptrs, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                    c.intermediate_size, c.draft_vocab_size, k.shape[2], c.rms_norm_eps)

    @classmethod
    def of(cls, head: EagleHead, embed, rope_tables, k, v) -> _FusedHead | None:
        """The fused head when every product of ``head`` runs in qmm.c's Q4_1 without a bias, else None."""
        names = ("fc", "qkv", "o", "gate_up", "down", "lm_head")
        linears = [getattr(getattr(head, name), "linear", None) for name in names]
        if not all(isinstance(x, qmm.Q4_1Linear) and x.bias is None for x in linears) or embed.device.type != "cpu":
            return None
        return cls(head, linears, embed, rope_tables, k, v)

    def propose(self, g: torch.Tensor, tokens: list[list[int]], starts: list[int], n: list[int], slots: list[int],
                k: int) -> list[list[int]]:
        """The catch-up over ``g`` [sum(n), d], sequence b's ``n[b]`` rows with ``tokens[b]``
        from cache index ``starts[b]`` in slot ``slots[b]``, and ``k`` drafts per sequence."""
        flat = [t for row in tokens for t in row]
        if [len(row) for row in tokens] != list(n) or min(n) < 1 or min(starts) < 0 \
                or g.shape != (len(flat), self.parts.d) or not all(0 <= s < self.slots for s in slots) \
                or not all(0 <= t < self.vocab for t in flat):
            raise ValueError(f"qmm eagle: rows {list(n)} from {list(starts)} in slots {list(slots)} for features "
                             f"{tuple(g.shape)}")
        drafts = torch.empty((len(n), k), dtype=torch.int64)
        index = torch.tensor([*starts, *n, *slots], dtype=torch.int64)
        qmm.eagle_propose(self.parts, g.float().contiguous(), torch.tensor(flat, dtype=torch.int64), index, k, drafts)
        return drafts.tolist()


def make_eagle_drafter(model, head_path: str | Path | None, model_name: str, max_num_seqs: int,
                       capacity: int) -> EagleDrafter:
    path = Path(head_path) if head_path else default_head_path(model_name)
    if not path.exists():
        raise FileNotFoundError(f"no draft head at {path}: train one with "
                                "python -m serve_app.tools.train_draft_head")
    head, _ = load_head(path, model.device, model.dtype)
    c, s = head.config, model.shape
    if (c.hidden_size, c.target_vocab_size) != (s.hidden_size, s.vocab_size) or max(c.feature_layers) >= s.num_layers:
        raise ValueError(f"draft head {path} does not fit the model (hidden {c.hidden_size}, vocab "
                         f"{c.target_vocab_size}, layers {c.feature_layers})")
    rope_tables = None
    if model.fused_attention and (c.rope_theta, c.head_dim) == (s.rope_theta, s.head_dim):
        # the target's tables, made longer where the head's cache (its scratch index included) runs past them
        rope_tables = (model.cos, model.sin) if model.cos.shape[0] > capacity else \
            rope_tables_for(c.head_dim, c.rope_theta, capacity + 1, model.device, model.dtype)
    return EagleDrafter(pack_linears(head, "gguf" if model.weights == "gguf" else "float32"), model.embed,
                        max_num_seqs, capacity, rope_tables)
