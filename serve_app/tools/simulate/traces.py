"""Arrival traces: when requests come, how long their outputs are, and where a burst lands first.

A trace is arrays sorted by arrival time. Rates are in units of the cluster's capacity (the
request rate the replicas sustain at full batch), so one trace shape fits any curve and any
number of replicas. ``hot`` marks requests that only reach the first ``hot_fraction`` of the
replicas: the first seconds of a burst arriving through one ingress before it spreads.

Request classes (:class:`RequestClass`) split a workload by how well drafts are accepted: chat,
copy-heavy prompts, sampled output. Each request draws its class by share.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Trace:
    arrival: np.ndarray
    output_tokens: np.ndarray
    hot: np.ndarray
    duration_s: float
    hot_fraction: float = 1.0
    phases: list[tuple[float, float, str]] | None = None
    """(start, end, 'low'|'high') spans, for per-phase figures."""

    def __len__(self) -> int:
        return len(self.arrival)


@dataclass(frozen=True)
class RequestClass:
    """Requests whose draft tokens are each accepted with probability ``acceptance`` (after the
    ones before it), ``share`` of the traffic."""

    name: str
    share: float
    acceptance: float | None
    """None: as the curve's own measurement (its tokens per step)."""

    def __post_init__(self):
        if self.share < 0 or (self.acceptance is not None and not 0 <= self.acceptance <= 1):
            raise ValueError(f"class {self.name}: share must be >= 0 and acceptance in [0, 1]")


DEFAULT_CLASSES = "chat:0.5:0.55,copy:0.3:0.9,sampled:0.2:0.3"


def parse_classes(text: str) -> tuple[RequestClass, ...]:
    """``name:share:acceptance,...`` (``--classes``); shares are normalized to sum to 1."""
    classes = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, share, acceptance = item.split(":")
        classes.append(RequestClass(name, float(share), float(acceptance)))
    total = sum(c.share for c in classes)
    if not classes or total <= 0:
        raise ValueError(f"--classes {text!r}: at least one class with a share > 0")
    return tuple(RequestClass(c.name, c.share / total, c.acceptance) for c in classes)


def draw_classes(n: int, classes: tuple[RequestClass, ...], seed: int) -> np.ndarray:
    """Each of ``n`` requests' class index, drawn by share (an rng of its own, so that classes
    leave the arrivals and routing of a run unchanged)."""
    rng = np.random.default_rng([seed, 0xC1A55])
    return rng.choice(len(classes), size=n, p=[c.share for c in classes]).astype(np.int64)


def _poisson(rate_at, duration_s: float, rng: np.random.Generator, bin_s: float = 0.1) -> np.ndarray:
    """Arrival times of a Poisson process whose rate (per second) is piecewise constant per bin."""
    starts = np.arange(0.0, duration_s, bin_s)
    counts = rng.poisson(np.maximum(rate_at(starts + bin_s / 2), 0) * bin_s)
    t = np.repeat(starts, counts) + rng.random(counts.sum()) * bin_s
    return np.sort(t)


def _lengths(n: int, mean: float, rng: np.random.Generator, sigma: float = 0.6) -> np.ndarray:
    if sigma == 0:
        return np.full(n, int(round(mean)), dtype=np.int64)
    x = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)
    return np.clip(np.round(x), 1, 8 * mean).astype(np.int64)


def bursty(
    capacity_rps: float,
    duration_s: float,
    mean_tokens: float,
    seed: int = 0,
    low: float = 0.2,
    high: float = 1.0,
    period_s: float = 300.0,
    burst_s: float = 90.0,
    first_burst_s: float = 100.0,
    hot_fraction: float = 0.25,
    hot_s: float = 5.0,
) -> Trace:
    """Low load with bursts: ``burst_s`` at ``high`` × capacity every ``period_s``; the first
    ``hot_s`` of each burst's extra traffic reaches only ``hot_fraction`` of the replicas."""
    rng = np.random.default_rng(seed)

    def in_burst(t):
        return (t >= first_burst_s) & ((t - first_burst_s) % period_s < burst_s)

    t = _poisson(lambda t: capacity_rps * np.where(in_burst(t), high, low), duration_s, rng)
    since = (t - first_burst_s) % period_s
    hot = in_burst(t) & (since < hot_s) & (rng.random(len(t)) < (high - low) / high)
    phases, start = [], 0.0
    for b in np.arange(first_burst_s, duration_s, period_s):
        phases += [(start, b, "low"), (b, min(b + burst_s, duration_s), "high")]
        start = b + burst_s
    if start < duration_s:
        phases.append((start, duration_s, "low"))
    return Trace(t, _lengths(len(t), mean_tokens, rng), hot, duration_s, hot_fraction, phases)


def diurnal(
    capacity_rps: float, duration_s: float, mean_tokens: float, seed: int = 0, low: float = 0.05, high: float = 0.9
) -> Trace:
    """One day compressed into ``duration_s``: load rises from ``low`` to ``high`` and back."""
    rng = np.random.default_rng(seed)
    level = lambda t: low + (high - low) * (1 - np.cos(2 * np.pi * t / duration_s)) / 2  # noqa: E731
    t = _poisson(lambda t: capacity_rps * level(t), duration_s, rng)
    edges = [0, duration_s / 4, 3 * duration_s / 4, duration_s]
    phases = [(edges[0], edges[1], "low"), (edges[1], edges[2], "high"), (edges[2], edges[3], "low")]
    return Trace(t, _lengths(len(t), mean_tokens, rng), np.zeros(len(t), bool), duration_s, 1.0, phases)


def from_file(path: str | Path, mean_tokens: float, seed: int = 0) -> Trace:
    """A JSON list (or {"requests": [...]}) of {"arrival_s", "output_tokens"?}, a CSV with
    those columns (header row), or a trace of ``bench trace`` (bare, or inside a result it
    wrote): the simulator then replays the arrivals and phases the live stack was given."""
    text = Path(path).read_text()
    if str(path).endswith(".csv"):
        lines = [ln.split(",") for ln in text.strip().splitlines()]
        head = [h.strip() for h in lines[0]]
        rows = [dict(zip(head, (float(v) for v in ln), strict=True)) for ln in lines[1:]]
    else:
        data = json.loads(text)
        if isinstance(data, dict) and ("arrivals" in data or "arrivals" in data.get("trace", {})):
            return from_bench_trace(data.get("trace", data), mean_tokens, seed)
        rows = data["requests"] if isinstance(data, dict) else data
    rng = np.random.default_rng(seed)
    rows = sorted(rows, key=lambda r: r["arrival_s"])
    t = np.array([r["arrival_s"] for r in rows], float)
    drawn = _lengths(len(rows), mean_tokens, rng)
    n = np.array([int(r.get("output_tokens") or d) for r, d in zip(rows, drawn, strict=True)], np.int64)
    return Trace(t, n, np.zeros(len(t), bool), float(t[-1]) if len(t) else 0.0)


def from_bench_trace(trace: dict, mean_tokens: float, seed: int = 0) -> Trace:
    """The arrivals and phases of a ``bench trace`` trace (``{"arrivals": [{"t", "phase"}],
    "phases": [{"name", "start", "end"}], "duration_s"}``); output lengths drawn around
    ``mean_tokens``, as the bench's prompts set them."""
    t = np.array(sorted(a["t"] for a in trace["arrivals"]), float)
    duration = float(trace.get("duration_s") or (t[-1] if len(t) else 0.0))
    phases = [(float(p["start"]), float(p["end"]), p["name"]) for p in trace.get("phases", [])] or None
    lengths = _lengths(len(t), mean_tokens, np.random.default_rng(seed))
    return Trace(t, lengths, np.zeros(len(t), bool), duration, 1.0, phases)


def make_trace(kind: str, capacity_rps: float, duration_s: float, mean_tokens: float, seed: int = 0, **kw) -> Trace:
    if kind == "bursty":
        return bursty(capacity_rps, duration_s, mean_tokens, seed, **kw)
    if kind == "diurnal":
        return diurnal(capacity_rps, duration_s, mean_tokens, seed, **kw)
    return from_file(kind, mean_tokens, seed)
