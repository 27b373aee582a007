"""Engine speed curves: how fast one replica decodes at batch B with ``num_steps`` k.

A curve answers two things per (k, B), B = requests running on the replica:

- ``rate``: tokens/s that each running request gains while it decodes;
- ``prefill_s``: how long a newly admitted request waits for its first token.

Curves come from an engine benchmark JSON (``python -m serve_app.tools.bench engine --out``; any
machine) or from a preset. A measured point is the closed-loop output throughput X(c, k) of
c concurrent clients and its TTFT; the simulator turns it back into a per-request rate with
Little's law, so that c closed-loop clients in the simulation reproduce X(c, k):
one request takes c·n/X seconds (n = mean output tokens of the point), of which the TTFT is
prefill, so ``rate = n / (c·n/X − ttft)``.

A step of batch B at k drafts takes ``T(B, k) = tokens_per_step(k) / rate(B, k)``: the rate is
the curve's mean tokens per request per second, ``tokens_per_step`` the curve's own mean
tokens per request per step (1 + accepted drafts). A request class whose drafts are accepted
with another probability gains its own tokens per step in the same step time (``sim.py``).

``off_cost``: the speed of k = 0 inside a speculative engine relative to a plain engine, by
batch (1.0: as fast). A cluster that switches speculation off keeps its speculative engine and
pays it; the static ``off`` policy is a plain engine and does not.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# A copy of the measured H200 GEMM cost table (shared/data/), shipped with the package.
GEMM_COST = Path(__file__).resolve().parent / "data" / "gemm_cost_h200_llama8b.json"


@dataclass
class Curve:
    """Closed-loop throughput X(B, k) and prefill time d(B, k), as functions over a grid.

    ``points[k]`` is a list of (batch, tokens_per_s, prefill_s), ascending in batch. Between
    points X is linear in B; below the first point X grows linearly from 0; past the last it
    stays flat (the engine is saturated). A k without points is interpolated linearly
    between the nearest measured k's (clamped at the ends); ``notes`` records where.
    """

    name: str
    points: dict[int, list[tuple[float, float, float]]]
    output_tokens: float
    """Mean output tokens per request of the measured points (Little's law needs it)."""
    max_running: int = 256
    source: str = ""
    notes: list[str] = field(default_factory=list)
    accepted: dict[int, float] = field(default_factory=dict)
    """Mean accepted draft tokens per verify by num_steps, where measured (or assumed: notes)."""
    off_cost: dict[int, float] = field(default_factory=dict)
    """Speed of num_steps 0 in a speculative engine over a plain engine's, by batch: linear
    between the listed batches, flat outside; empty: 1.0 (as fast as a plain engine)."""

    @property
    def steps(self) -> list[int]:
        return sorted(self.points)

    def tokens_per_step(self, k: int) -> float:
        """Output tokens per request per engine step: 1 plus the accepted drafts; a k not listed
        is linear between the listed ones (the nearest at the top; 1 when none is listed)."""
        if k <= 0 or not self.accepted:
            return 1.0
        if k in self.accepted:
            return 1.0 + self.accepted[k]
        ks = sorted(self.accepted)
        return 1.0 + float(np.interp(k, [0, *ks], [0.0, *(self.accepted[j] for j in ks)]))

    def off_speed(self, batches: np.ndarray) -> np.ndarray:
        """``off_cost`` at each batch (1.0 where none is given)."""
        if not self.off_cost:
            return np.ones(len(batches))
        bs = sorted(self.off_cost)
        return np.interp(batches, bs, [self.off_cost[b] for b in bs])

    @property
    def spec_steps(self) -> int:
        """The speculative k that is fastest for a lone request (0 if none measured)."""
        spec = [k for k in self.steps if k > 0]
        return max(spec, key=lambda k: self.throughput(1, k)) if spec else 0

    def _measured(self, b: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        pts = np.array(self.points[k], dtype=float)
        bs, xs, ds = pts[:, 0], pts[:, 1], pts[:, 2]
        x = np.interp(b, bs, xs)
        x = np.where(b < bs[0], xs[0] * b / bs[0], x)
        return x, np.interp(b, bs, ds)

    def _at(self, b: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if k in self.points:
            return self._measured(b, k)
        lower = [s for s in self.steps if s < k]
        upper = [s for s in self.steps if s > k]
        if not lower or not upper:
            near = (lower or upper)[-1 if lower else 0]
            self._note(f"num_steps {k} not measured: using {near}")
            return self._measured(b, near)
        lo, hi = lower[-1], upper[0]
        w = (k - lo) / (hi - lo)
        self._note(f"num_steps {k} not measured: linear between {lo} and {hi}")
        (xl, dl), (xh, dh) = self._measured(b, lo), self._measured(b, hi)
        return (1 - w) * xl + w * xh, (1 - w) * dl + w * dh

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def throughput(self, batch: float, k: int) -> float:
        """Closed-loop output tokens/s of ``batch`` concurrent requests at num_steps k."""
        return float(self._at(np.array([float(batch)]), k)[0][0])

    def tables(self, ks: list[int], max_running: int) -> tuple[np.ndarray, np.ndarray]:
        """(rate, prefill_s), each shaped (len(ks), max_running + 1), indexed [k index, B]."""
        b = np.arange(max_running + 1, dtype=float)
        b[0] = 1.0  # B=0 has no request to serve; any finite value does
        rate = np.empty((len(ks), max_running + 1))
        prefill = np.empty_like(rate)
        n = self.output_tokens
        for i, k in enumerate(ks):
            x, d = self._at(b, k)
            latency = b * n / np.maximum(x, 1e-9)
            d = np.minimum(d, 0.5 * latency)  # a TTFT above half the latency is queueing, not prefill
            rate[i], prefill[i] = n / (latency - d), d
        return rate, prefill

    def crossover(self, k: int) -> int | None:
        """The smallest batch at which plain decode is at least as fast as k steps; None if never."""
        for b in range(1, self.max_running + 1):
            if self.throughput(b, 0) >= self.throughput(b, k):
                return b
        return None

    def capacity(self) -> float:
        """Output tokens/s of one replica at full batch, in the faster mode there."""
        return max(self.throughput(self.max_running, k) for k in self.steps)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "source": self.source,
            "steps": self.steps,
            "output_tokens": self.output_tokens,
            "max_running": self.max_running,
            "notes": self.notes,
            "accepted": self.accepted,
            "off_cost": self.off_cost,
            "tokens_per_s": {
                k: {int(b): round(self.throughput(b, k), 1) for b in (1, 8, 32, 64, 128, 256) if b <= self.max_running}
                for k in self.steps
            },
        }


# -- from an engine benchmark -------------------------------------------------------------------


def from_bench(path: str | Path, prompt_set: str | None = None, max_running: int = 32) -> Curve:
    """A curve from ``bench engine`` JSON rows (one prompt set; default: the first in the file)."""
    data = json.loads(Path(path).read_text())
    rows = data["rows"]
    sets = list(dict.fromkeys(r["prompt_set"] for r in rows))
    prompt_set = prompt_set or sets[0]
    rows = [r for r in rows if r["prompt_set"] == prompt_set and r.get("output_tokens_per_s")]
    if not rows:
        raise ValueError(f"{path}: no rows for prompt set {prompt_set!r} (sets: {', '.join(sets)})")
    points: dict[int, list] = {}
    for r in sorted(rows, key=lambda r: r["concurrency"]):
        ttft = (r.get("ttft_p50_ms") or 0.0) / 1000
        points.setdefault(r["num_steps"], []).append((r["concurrency"], r["output_tokens_per_s"], ttft))
    out = sum(r["output_tokens"] for r in rows) / sum(r["num_requests"] for r in rows)
    accepted = {}
    for k in points:
        measured = [r["mean_accepted_len"] for r in rows if r["num_steps"] == k and r.get("mean_accepted_len")]
        if k > 0 and measured:
            accepted[k] = sum(measured) / len(measured)
    return Curve(
        f"bench:{Path(path).name}:{prompt_set}",
        points,
        out,
        max_running,
        source=f"{path} ({data.get('meta', {}).get('command', '')})",
        accepted=accepted,
    )


# -- presets ----------------------------------------------------------------------------------


def _affine(x1: float, x250: float, batches) -> list[tuple[float, float, float]]:
    # Step time linear in batch through the two published points: t(B) = a + b·B, X = B / t(B).
    t1, t250 = 1 / x1, 250 / x250
    b = (t250 - t1) / 249
    a = t1 - b
    return [(B, B / (a + b * B), 0.05) for B in batches]


def seed_8gpu_pcie(alpha: float | None = None) -> Curve:
    """The seed deployment's two published points per mode. Its acceptance is not published:
    ``alpha`` per draft token (the roofline's 0.8 by default) gives the tokens per step from
    which the step time, and each request class's speed, follow."""
    alpha = ACCEPT_ALPHA if alpha is None else alpha
    grid = [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 250]
    return Curve(
        "seed-8gpu-pcie",
        {0: _affine(92.6, 772.1, grid), 3: _affine(77.5, 340.9, grid)},
        output_tokens=256,
        max_running=256,
        accepted={k: mean_accepted(k, alpha) - 1 for k in (1, 2, 3)},
        source="seed deployment (8 GPUs over PCIe, TP-8, SGLang + EAGLE-3): 92.6 / 772.1 tok/s without "
        "speculation, 77.5 / 340.9 with EAGLE-3, at 1 / 250 concurrent requests (docs/DESIGN brief)",
        notes=[
            "between the two published points the step time is taken linear in batch (t = a + b·B, "
            "X = B/t), fitted per mode through both points; flat past 250",
            "EAGLE-3's step count is not published: taken as num_steps 3",
            "prefill 50 ms and 256 output tokens per request assumed",
            f"acceptance not published: α = {alpha} per draft token assumed, τ(3) = {mean_accepted(3, alpha):.2f} "
            "(τ(1), τ(2) for the num_steps 1 and 2 that lie between the measured 0 and 3)",
            "off_cost not measured: num_steps 0 in the speculative engine as fast as a plain engine",
        ],
    )


@functools.cache
def _gemm_ms() -> tuple[np.ndarray, np.ndarray]:
    rows = json.loads(GEMM_COST.read_text())["rows"]
    return np.array([r["tokens_per_forward"] for r in rows], float), np.array([r["ms"] for r in rows], float)


ACCEPT_ALPHA = 0.8  # per-draft-token acceptance of EAGLE-3 chains: tau(3) = 2.95, tau(5) = 3.69
DRAFT_FRACTION = 0.06  # one draft step ≈ 6% of a target forward (1 layer + fused fc + 32k lm_head vs 8B)
DRAFT_FIXED_MS = 0.2
KV_BYTES_PER_TOKEN = 131072  # Llama-3-8B: 32 layers × 8 kv heads × 128 × (K, V) × 2 bytes
HBM_BYTES_PER_S = 3.8e12


def gemm_ms(tokens: float) -> float:
    """The H200 GEMM time of a Llama-3-8B forward over ``tokens`` tokens (linear between the
    table's rows, proportional past its last)."""
    tok, ms = _gemm_ms()
    return float(np.interp(tokens, tok, ms)) if tokens <= tok[-1] else float(ms[-1] * tokens / tok[-1])


def roofline_step_ms(fed_tokens: float, drafting: list[float] | tuple[float, ...] = ()) -> float:
    """The roofline's decode step without attention: the target's forward over ``fed_tokens``
    tokens, after one draft pass per entry of ``drafting`` (the rows that draft in that pass),
    each ``DRAFT_FRACTION`` of a target forward over its rows plus ``DRAFT_FIXED_MS``."""
    return gemm_ms(fed_tokens) + sum(DRAFT_FRACTION * gemm_ms(n) + DRAFT_FIXED_MS for n in drafting)


def mean_accepted(k: int, alpha: float = ACCEPT_ALPHA) -> float:
    """Tokens gained per verify step with a chain of k drafts (bonus token included)."""
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def h200_8b_roofline(
    steps=(0, 1, 3, 5), output_tokens: int = 256, prompt_tokens: int = 512, context_tokens: int = 0
) -> Curve:
    """Decode step times from the measured H200 GEMM cost of a Llama-3-8B forward.

    Attention is left out by default, as in the cost file; ``context_tokens`` > 0 adds one read
    of that many tokens' KV cache per request and step (the same for plain and verify steps)."""
    grid = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    prefill_s = gemm_ms(prompt_tokens) / 1000
    points = {}
    for k in steps:
        pts = []
        for b in grid:
            attn_ms = 1000 * b * context_tokens * KV_BYTES_PER_TOKEN / HBM_BYTES_PER_S
            step_ms = roofline_step_ms(b * (k + 1), [b] * k) + attn_ms
            decode_s = output_tokens / mean_accepted(k) * step_ms / 1000  # one request's decode time
            pts.append((b, b * output_tokens / (prefill_s + decode_s), prefill_s))
        points[k] = pts
    return Curve(
        "h200-8b-roofline",
        points,
        output_tokens,
        max_running=256,
        accepted={k: mean_accepted(k) - 1 for k in steps if k},
        source=f"{GEMM_COST.name}: GEMM time of a Llama-3-8B forward by tokens per forward, one H200",
        notes=[
            f"step(B, k) = T(B·(k+1)) + attention + k·({DRAFT_FRACTION}·T(B) + {DRAFT_FIXED_MS} ms); "
            f"step(B, 0) = T(B) + attention",
            f"mean accepted length τ(k) = (1 − α^(k+1))/(1 − α), α = {ACCEPT_ALPHA}: "
            + ", ".join(f"τ({k}) = {mean_accepted(k):.2f}" for k in steps if k),
            f"attention: one read of {context_tokens} tokens' KV (128 KiB each) per request and step at 3.8 TB/s",
            f"prefill = T({prompt_tokens}) = {1000 * prefill_s:.1f} ms; {output_tokens} output tokens",
            "off_cost: num_steps 0 in the speculative engine as fast as a plain engine (step(B, 0) above)",
        ],
    )


# EAGLE-3 paper (Li et al., arXiv:2503.01840v3), §4.3 Table 3: throughput of SGLang v0.4.4 + EAGLE-3
# (chain of 3, no tree) relative to SGLang without speculation, LLaMA-Instruct 3.1 8B, MT-Bench,
# one H100, by batch size; Table 4: 158.34 tok/s without speculation at batch 1.
EAGLE3_TABLE3 = {2: 1.81, 4: 1.82, 8: 1.62, 16: 1.48, 24: 1.39, 32: 1.32, 48: 1.38, 56: 1.34, 64: 1.38}
EAGLE3_BS1_TOKENS_PER_S = 158.34


def eagle3_sglang_h100() -> Curve:
    tok, ms = _gemm_ms()
    grid = [1, *EAGLE3_TABLE3]
    base = {b: EAGLE3_BS1_TOKENS_PER_S * b * np.interp(1, tok, ms) / np.interp(b, tok, ms) for b in grid}
    ratio = {1: EAGLE3_TABLE3[2], **EAGLE3_TABLE3}
    return Curve(
        "eagle3-sglang-h100",
        {0: [(b, base[b], 0.02) for b in grid], 3: [(b, base[b] * ratio[b], 0.02) for b in grid]},
        output_tokens=256,
        max_running=64,
        accepted={k: mean_accepted(k) - 1 for k in (1, 2, 3)},
        source="Li et al., EAGLE-3 (arXiv:2503.01840v3), §4.3: Table 3 (SGLang v0.4.4, H100, LLaMA-Instruct "
        "3.1 8B, MT-Bench, chain length 3: 1.81x at batch 2 … 1.38x at 64) and Table 4 (158.34 tok/s "
        "without speculation at batch 1)",
        notes=[
            "the speculative curve is Table 3's ratio times the plain curve; batch 1 takes batch 2's ratio",
            "the plain curve's growth with batch is assumed to follow the H200 GEMM cost shape, "
            "scaled to 158.34 tok/s at batch 1",
            "max_running 64: the paper's range; prefill 20 ms and 256 output tokens assumed",
            f"tokens per step of the chain of 3 not taken from the paper: α = {ACCEPT_ALPHA} assumed, "
            f"τ(3) = {mean_accepted(3):.2f}",
            "off_cost: num_steps 0 in the speculative engine as fast as a plain engine",
        ],
    )


# The speed of num_steps 0 in SGLang's speculative engine (EAGLE-3, H200) over a plain engine's,
# first H200 measurement: 0.37x at batch 1, 0.54x at batch 16. The speculative engine still runs
# its draft-extend path and overlap scheduling differs (docs/sglang.md).
SGLANG_H200_OFF_COST = {1: 0.37, 16: 0.54}
# The same ratio in bench/results/gpu_sglang_h200.json's engine_speed run (SGLang 0.5.17,
# "spec steps 0" over "plain"): 164.9 / 610.2, 8770.4 / 28115.9, 21160.1 / 64905.4 tok/s.
SGLANG_H200_OFF_COST_ENGINE_SPEED = {1: 0.27, 64: 0.31, 256: 0.33}
OFF_COSTS = {"plain": {}, "sglang-h200": SGLANG_H200_OFF_COST, "sglang-h200-engine-speed": SGLANG_H200_OFF_COST_ENGINE_SPEED}


def parse_off_cost(text: str) -> dict[int, float]:
    """``--off-cost``: a name of :data:`OFF_COSTS`, one number (any batch) or ``batch:ratio,...``."""
    if text in OFF_COSTS:
        return dict(OFF_COSTS[text])
    if ":" not in text:
        return {1: float(text)}
    pairs = (item.split(":") for item in text.split(",") if item.strip())
    return {int(b): float(r) for b, r in pairs}


PRESETS = {
    "seed-8gpu-pcie": seed_8gpu_pcie,
    "h200-8b-roofline": h200_8b_roofline,
    "eagle3-sglang-h100": eagle3_sglang_h100,
}


def load_curve(spec: str, prompt_set: str | None = None, max_running: int | None = None) -> Curve:
    """A preset by name, or a bench JSON file."""
    curve = PRESETS[spec]() if spec in PRESETS else from_bench(spec, prompt_set)
    if max_running is not None:
        curve.max_running = max_running
    return curve
