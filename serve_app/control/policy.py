"""Where the decision is made: cluster load history and time in, ``num_steps`` out.

Pure: no Ray, no I/O, no clock. The controller calls :func:`decide` on every tick with the
load samples it has collected; the simulator calls the same function with synthetic load.

The ladder (``PolicyConfig.tiers``) maps load per replica to a number of draft steps. Three
things keep it from flapping:

- hysteresis: a tier is left only when the load is past its boundary by ``margin``;
- dwell: the (smoothed) load must have stayed past the boundary for ``dwell_s`` without a break
  (``fall_dwell_s``, where set, before a switch to more draft steps: a load that falls for a
  moment near capacity costs little at fewer steps, a switch back to more steps while the
  queue is still long costs the whole burst);
- a minimum time between two switches (``rise_min_interval_s``, where set, before a switch to
  fewer draft steps: a burst that crossed one boundary reaches the next tier without waiting
  out the interval a return to more steps keeps).

An operator override pins ``num_steps`` until it is released. After a release (or a policy
change) the current ``num_steps`` may not be on the ladder; the policy then moves straight
to the tier of the current load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from serve_app.control.config import PolicyConfig


@dataclass(slots=True, frozen=True)
class LoadSample:
    """The cluster queue (waiting + running over live replicas) seen at ``time``."""

    time: float
    queue: float
    replicas: int

    @property
    def load(self) -> float:
        """Load per replica."""
        return self.queue / self.replicas


@dataclass(slots=True, frozen=True)
class ModeState:
    """What the policy needs to know about the cluster's current mode."""

    num_steps: int
    last_switch_time: float | None = None
    override: int | None = None


@dataclass(slots=True, frozen=True)
class Decision:
    """The policy's answer. ``switch`` is True when ``num_steps`` differs from the state's."""

    num_steps: int
    switch: bool
    reason: str
    """A short code, fit for a metric tag: load_rise, load_fall, operator, off_ladder (switches);
    steady, dwell, min_interval, no_data (holds)."""
    load: float | None = None
    """Smoothed load per replica at decision time, when there was any."""
    detail: str = ""


def target_tier(load: float, current: int, config: PolicyConfig) -> int:
    """The tier ``load`` calls for, seen from tier ``current`` (hysteresis applied)."""
    bounds = config.bounds
    tier = current
    while tier < len(bounds) and load >= bounds[tier] + config.margin:
        tier += 1
    while tier > 0 and load < bounds[tier - 1] - config.margin:
        tier -= 1
    return tier


def raw_tier(load: float, config: PolicyConfig) -> int:
    """The tier ``load`` falls in, without hysteresis."""
    return sum(1 for bound in config.bounds if load >= bound)


def smoothed_load(samples: Sequence[LoadSample], at: float, window_s: float) -> float | None:
    """Mean load per replica of the samples in (at - window_s, at]; the latest one if window_s is 0."""
    if window_s <= 0:
        past = [s for s in samples if s.time <= at]
        return past[-1].load if past else None
    loads = [s.load for s in samples if at - window_s < s.time <= at]
    return sum(loads) / len(loads) if loads else None


def decide(state: ModeState, samples: Sequence[LoadSample], now: float, config: PolicyConfig) -> Decision:
    """Decide the cluster's ``num_steps`` at time ``now``.

    ``samples`` is the load history, oldest first; samples with no live replica are ignored.
    History older than ``config.history_s`` does not change the answer.
    """
    if state.override is not None:
        k = state.override
        return Decision(k, k != state.num_steps, "operator", None, f"pinned to {k} by the operator")

    samples = [s for s in samples if s.replicas > 0 and now - config.history_s <= s.time <= now]
    load = smoothed_load(samples, now, config.smoothing_s)
    if load is None:
        return Decision(state.num_steps, False, "no_data", None, "no recent load report")

    current = config.tier_of(state.num_steps)
    if current is None:
        k = config.tiers[raw_tier(load, config)].num_steps
        return Decision(k, k != state.num_steps, "off_ladder", load, f"{state.num_steps} steps is not on the ladder")

    target = target_tier(load, current, config)
    if target == current:
        return Decision(state.num_steps, False, "steady", load)

    rising = target > current
    interval = config.min_switch_interval_s
    if rising and config.rise_min_interval_s is not None:
        interval = config.rise_min_interval_s
    if state.last_switch_time is not None and now - state.last_switch_time < interval:
        return Decision(state.num_steps, False, "min_interval", load, "too soon after the last switch")

    # Dwell: the smoothed load at every sample in the last dwell has been past the current
    # tier's boundary on the same side, and the history reaches back that far.
    dwell = config.dwell_s if rising or config.fall_dwell_s is None else config.fall_dwell_s
    if dwell > 0:
        if samples[0].time > now - dwell:
            return Decision(state.num_steps, False, "dwell", load, "not enough history yet")
        for t in [s.time for s in samples if s.time >= now - dwell]:
            past = target_tier(smoothed_load(samples, t, config.smoothing_s), current, config)  # type: ignore[arg-type]
            if past == current or (past > current) != rising:
                return Decision(state.num_steps, False, "dwell", load, f"load not past the boundary for {dwell:g}s")

    k = config.tiers[target].num_steps
    bound = config.bounds[current] if rising else config.bounds[current - 1]
    sign = ">=" if rising else "<"
    detail = (
        f"load {load:.2f}/replica {sign} {bound:g} {'+' if rising else '-'} {config.margin:g} for {dwell:g}s"
    )
    return Decision(k, k != state.num_steps, "load_rise" if rising else "load_fall", load, detail)
