"""Turning request timings into benchmark numbers (percentiles, acceptance, crossover), and
writing a benchmark's result."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class RequestTiming:
    """When one request's output arrived, relative to its submission."""

    output_tokens: int
    ttft_s: float  # submission -> first delta that carries tokens
    last_token_s: float  # submission -> last delta that carries tokens

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.last_token_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values, q: float) -> float | None:
    """The q-th percentile of a list or array (linear interpolation, numpy's default); None if
    empty. The one definition the benchmarks and the simulator use."""
    return float(np.percentile(values, q)) if len(values) else None


def mean(values) -> float | None:
    """The mean of a list, to 3 decimals; None if empty (a window without samples)."""
    return round(sum(values) / len(values), 3) if values else None


def paired_ratio_ci(num: list[float], den: list[float], level: float = 0.95) -> list[float] | None:
    """A ``level`` confidence interval of the ratio num / den from paired windows (window i of
    each side ran next to the other's, so a drift of the machine weighs on both): Student's t
    on the logs of the per-pair ratios, given back as ratios. None with fewer than two pairs or
    a window without tokens."""
    from scipy.stats import t

    if len(num) != len(den):
        raise ValueError(f"paired windows need as many on each side, got {len(num)} and {len(den)}")
    if len(num) < 2 or min(*num, *den) <= 0:
        return None
    logs = np.log(np.asarray(num, dtype=float) / np.asarray(den, dtype=float))
    half = t.ppf(0.5 + level / 2, len(logs) - 1) * logs.std(ddof=1) / np.sqrt(len(logs))
    return [round(float(np.exp(logs.mean() - half)), 4), round(float(np.exp(logs.mean() + half)), 4)]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def summarize(timings: list[RequestTiming], wall_s: float) -> dict:
    """Throughput and latency percentiles of one benchmark point."""
    ttft = [t.ttft_s for t in timings]
    tpot = [t.tpot_s for t in timings if t.tpot_s is not None]
    tokens = sum(t.output_tokens for t in timings)
    return {
        "num_requests": len(timings),
        "output_tokens": tokens,
        "wall_s": round(wall_s, 4),
        "output_tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else None,
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "tpot_p50_ms": _ms(percentile(tpot, 50)),
        "tpot_p99_ms": _ms(percentile(tpot, 99)),
    }


def acceptance(before: dict[str, int], after: dict[str, int]) -> dict:
    """Draft acceptance between two snapshots of the engine's counters.

    ``accept_rate`` is accepted / proposed draft tokens; ``mean_accepted_len`` is accepted
    draft tokens per verify step (the engine's definition, without the bonus token). Both
    are None when nothing was drafted (num_steps 0, or no lookup match), not a misleading 0.
    """
    proposed = after["proposed"] - before["proposed"]
    accepted = after["accepted"] - before["accepted"]
    verifies = after["verifies"] - before["verifies"]
    return {
        "accept_rate": round(accepted / proposed, 4) if proposed else None,
        "mean_accepted_len": round(accepted / verifies, 4) if verifies else None,
    }


def crossover(rows: list[dict]) -> dict[str, dict]:
    """Per prompt set: the lowest concurrency where speculation stops beating num_steps 0.

    ``by_num_steps`` gives it for each num_steps > 0; ``best`` for the best num_steps > 0 at
    each concurrency. None means speculation won at every concurrency measured.
    """
    out: dict[str, dict] = {}
    for prompt_set in dict.fromkeys(r["prompt_set"] for r in rows):
        tps = {(r["num_steps"], r["concurrency"]): r["output_tokens_per_s"]
               for r in rows if r["prompt_set"] == prompt_set}
        plain = {c: v for (k, c), v in tps.items() if k == 0}
        spec_steps = sorted({k for k, _ in tps if k > 0})
        if not plain or not spec_steps:
            continue
        out[prompt_set] = {"by_num_steps": {str(k): _first_loss(tps, [k]) for k in spec_steps},
                           "best": _first_loss(tps, spec_steps)}
    return out


def _first_loss(tps: dict[tuple[int, int], float], steps: list[int]) -> int | None:
    """The lowest concurrency where none of ``steps`` beats num_steps 0."""
    for c in sorted(c for k, c in tps if k == 0):
        spec = [tps[k, c] for k in steps if (k, c) in tps]
        if spec and max(spec) <= tps[0, c]:
            return c
    return None


def emit(result: dict, table: str, out: str | None) -> int:
    """Print a benchmark's table and write its JSON result to ``out`` (if given); exit status 0."""
    print(table)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {out}")
    return 0
