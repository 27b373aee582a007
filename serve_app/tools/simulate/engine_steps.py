"""The engine's half of the two-level policy in the simulation: every replica, every step,
picks its draft length under the cluster's ceiling as :func:`serve_app.control.steps.choose_steps`
does, for all replicas at once.

What a simulated engine knows: the acceptance of each running request's class, exactly (the
simulator knows the class; a real engine estimates it per request online, ``Acceptance``), and
its own step time T(B, k) read off the curve (a real engine learns it, ``StepCost``). The choice
is choose_steps' argmax of expected tokens per second and its gate, vectorized over replicas:
``tests/test_simulate_steps.py`` checks it against choose_steps itself, fed a
:class:`CurveStepCost`, replica by replica.

A probing step lasts one simulation step (``dt``) here, not one engine step, and every running
request drafts in it, where a real engine drafts for ``probe_rows`` of them: a probe costs the
simulated engine more than a real one, and gains it more tokens. The draft head's catch-up is
not simulated (a curve's T(B, k) is a step of drafting that goes on).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from serve_app.control.steps import StepPolicyConfig, expected_tokens


@dataclass(frozen=True)
class CurveStepCost:
    """Seconds per step read off the curve's step time table ``[k, batch]``: what
    choose_steps asks of a cost (``seconds(batch, k)``)."""

    table: np.ndarray

    def seconds(self, batch: int, k: int) -> float:
        return float(self.table[k, min(batch, self.table.shape[1] - 1)])


def tokens_table(acceptances: list[float], top: int) -> np.ndarray:
    """Expected tokens per verify, ``[class, k]`` for k in 0..top."""
    return np.array([[expected_tokens(a, k) for k in range(top + 1)] for a in acceptances])


class EngineSteps:
    """Each replica's gate and its draft length under the ceiling, by choose_steps' rule.

    ``step_time[k, B]``: seconds per step at k drafts and batch B (k in 0..top); ``tokens[c, k]``:
    expected tokens per verify of a request of class c.
    """

    def __init__(self, replicas: int, step_time: np.ndarray, tokens: np.ndarray, config: StepPolicyConfig):
        self.step_time, self.tokens, self.config = step_time, tokens, config
        self.shut = np.zeros(replicas, bool)
        self.last_probe = np.full(replicas, np.nan)  # nan: never probed
        self.since_probe = np.zeros(replicas, np.int64)  # steps since the gate shut or last probed
        # at most one probe in this many steps, where the config has that rule (1: no such rule)
        self.probe_every = getattr(config, "probe_every_steps", 1)

    def choose(self, now: float, ceiling: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Draft length per replica; ``counts[r, c]``: running requests of class c on replica r."""
        cfg, n = self.config, len(ceiling)
        batch = counts.sum(axis=1)
        rate = (counts @ self.tokens) / self.step_time[:, batch].T  # (replicas, k)
        allowed = np.arange(rate.shape[1])[None, :] <= ceiling[:, None]
        masked = np.where(allowed, rate, -np.inf)
        best_k = masked.argmax(axis=1)  # the first maximum: ties keep the fewer drafts, as choose_steps
        best = masked[np.arange(n), best_k]
        active = (ceiling > 0) & (batch > 0)
        gain = active & (best_k > 0) & (best >= cfg.min_gain * rate[:, 0])
        k = np.where(gain, best_k, 0)
        self.shut &= active & ~gain
        gated = active & ~gain
        closing = gated & ~self.shut
        self.shut |= closing
        self.last_probe[closing] = now
        due = gated & ~closing & (np.isnan(self.last_probe) | (now - self.last_probe >= cfg.probe_interval_s))
        probe_k = np.minimum(ceiling, cfg.probe_steps)
        # choose_steps' probe_spacing: the floor, and the probes' extra cost within the budget
        extra = self.step_time[probe_k, batch] / self.step_time[0, batch] - 1.0
        spacing = np.maximum(self.probe_every, np.ceil(extra / getattr(cfg, "probe_budget", np.inf) - 1e-9))
        due &= self.since_probe + 1 >= spacing
        k[due] = probe_k[due]
        self.last_probe[due] = now
        self.since_probe += 1
        self.since_probe[closing | due] = 0
        return k
