"""The policy as a function: load history and time in, num_steps out."""

import random

import pytest
from pydantic import ValidationError

from serve_app.control.config import PolicyConfig, Tier
from serve_app.control.policy import LoadSample, ModeState, decide, raw_tier, target_tier

# load/replica < 4 → 5 steps, < 12 → 3 steps, else 0.
LADDER = PolicyConfig(margin=1.0, dwell_s=2.0, min_switch_interval_s=5.0, smoothing_s=1.0)
TICK = 0.25


def history(loads_per_replica, start=0.0, replicas=2, tick=TICK):
    return [LoadSample(start + i * tick, load * replicas, replicas) for i, load in enumerate(loads_per_replica)]


def run(config, load_at, duration_s, start_steps=5, tick=TICK):
    """Drive the policy like the controller does; return the switches as (time, from, to)."""
    state = ModeState(start_steps)
    samples, switches = [], []
    t = 0.0
    while t <= duration_s:
        samples.append(LoadSample(t, load_at(t) * 2, 2))
        samples = [s for s in samples if s.time >= t - config.history_s]
        d = decide(state, samples, t, config)
        if d.switch:
            switches.append((t, state.num_steps, d.num_steps))
            state = ModeState(d.num_steps, last_switch_time=t)
        t = round(t + tick, 6)
    return switches


def test_each_load_maps_to_its_tier_without_hysteresis():
    assert [raw_tier(x, LADDER) for x in (0, 3.9, 4, 11.9, 12, 500)] == [0, 0, 1, 1, 2, 2]


def test_a_tier_is_left_only_past_its_boundary_plus_margin():
    assert target_tier(4.5, 0, LADDER) == 0  # past 4 but not past 4 + 1
    assert target_tier(5.0, 0, LADDER) == 1
    assert target_tier(3.5, 1, LADDER) == 1  # below 4 but not below 4 - 1
    assert target_tier(2.9, 1, LADDER) == 0
    assert target_tier(20, 0, LADDER) == 2  # a jump crosses several tiers at once


def test_steady_load_keeps_the_mode():
    d = decide(ModeState(5), history([1.0] * 20), 19 * TICK, LADDER)
    assert (d.num_steps, d.switch, d.reason) == (5, False, "steady")


def test_high_load_switches_after_dwell():
    samples = history([20.0] * 20)  # 0 .. 4.75 s
    early = decide(ModeState(5), samples[:6], 5 * TICK, LADDER)  # 1.25 s of history
    assert (early.switch, early.reason) == (False, "dwell")
    d = decide(ModeState(5), samples, 19 * TICK, LADDER)
    assert (d.num_steps, d.switch, d.reason) == (0, True, "load_rise")
    assert d.load == pytest.approx(20.0)
    assert "load 20.00/replica" in d.detail


def test_a_single_dip_restarts_the_dwell():
    loads = [20.0] * 20
    loads[15] = 0.0  # one report of an empty queue, 1 s before now, with 1 s smoothing
    cfg = LADDER.model_copy(update={"smoothing_s": 0.0})
    assert decide(ModeState(5), history(loads), 19 * TICK, cfg).reason == "dwell"


def test_a_jump_crosses_several_tiers_once_the_dwell_is_over():
    loads = [1.0] * 4 + [8.0] * 4 + [20.0] * 12  # the dwell window sees mid-tier and top-tier loads
    d = decide(ModeState(5), history(loads), 19 * TICK, LADDER)
    assert (d.num_steps, d.reason) == (0, "load_rise")


def test_no_switch_sooner_than_min_interval():
    samples = history([20.0] * 20)
    d = decide(ModeState(5, last_switch_time=1.0), samples, 19 * TICK, LADDER)
    assert (d.switch, d.reason) == (False, "min_interval")


def test_low_load_switches_back_down():
    d = decide(ModeState(0, last_switch_time=-10), history([0.5] * 20), 19 * TICK, LADDER)
    assert (d.num_steps, d.reason) == (5, "load_fall")


def test_operator_override_wins_immediately():
    d = decide(ModeState(5, last_switch_time=4.0, override=0), history([0.0] * 20), 19 * TICK, LADDER)
    assert (d.num_steps, d.switch, d.reason) == (0, True, "operator")
    held = decide(ModeState(0, override=0), history([0.0] * 20), 19 * TICK, LADDER)
    assert not held.switch


def test_off_ladder_mode_goes_straight_to_the_current_tier():
    # e.g. the operator pinned 7 steps and then released it: no dwell, no min interval.
    d = decide(ModeState(7, last_switch_time=4.0), history([8.0] * 20), 19 * TICK, LADDER)
    assert (d.num_steps, d.switch, d.reason) == (3, True, "off_ladder")


def test_no_recent_report_holds_the_mode():
    d = decide(ModeState(3), history([50.0] * 4), 100.0, LADDER)
    assert (d.num_steps, d.switch, d.reason) == (3, False, "no_data")
    assert decide(ModeState(3), [LoadSample(1.0, 0, 0)], 1.0, LADDER).reason == "no_data"


def test_load_held_at_a_boundary_for_60s_switches_at_most_once():
    rng = random.Random(0)
    # Noisy load around the 4/replica boundary: ±1.5 uniform noise plus bursts.
    switches = run(LADDER, lambda t: 4.0 + rng.uniform(-1.5, 1.5) + (3 if int(t) % 7 == 0 else 0), 60.0)
    assert len(switches) <= 1, switches


@pytest.mark.parametrize("boundary", [4.0, 12.0])
def test_load_at_each_boundary_does_not_flap_from_either_side(boundary):
    for start in (5, 3, 0):
        rng = random.Random(int(boundary) * 10 + start)
        switches = run(LADDER, lambda t, rng=rng: boundary + rng.gauss(0, 0.7), 60.0, start_steps=start)
        assert len(switches) <= 1, (start, switches)


def test_a_ramp_walks_down_the_ladder_and_back():
    def load(t):
        return 1.0 if t < 10 else 30.0 if t < 30 else 1.0

    switches = run(LADDER, load, 60.0)
    assert [(a, b) for _, a, b in switches] == [(5, 0), (0, 5)]
    up, down = switches[0][0], switches[1][0]
    assert 10 + LADDER.dwell_s <= up <= 10 + LADDER.dwell_s + LADDER.smoothing_s + 0.5
    assert 30 + LADDER.dwell_s <= down <= 30 + LADDER.dwell_s + LADDER.smoothing_s + 0.5


def test_fall_dwell_holds_fewer_steps_through_a_dip_and_rise_keeps_dwell_s():
    slow_fall = LADDER.model_copy(update={"fall_dwell_s": 8.0})

    def burst_with_dips(t):  # a burst from 10 s to 50 s whose queue dips for 4 s twice
        return 30.0 if 10 <= t < 50 and not (20 <= t < 24 or 32 <= t < 36) else 1.0

    flaps = run(LADDER, burst_with_dips, 70.0)
    assert [(a, b) for _, a, b in flaps] == [(5, 0), (0, 5), (5, 0), (0, 5), (5, 0), (0, 5)]
    switches = run(slow_fall, burst_with_dips, 70.0)
    assert [(a, b) for _, a, b in switches] == [(5, 0), (0, 5)]
    rise, fall = switches[0][0], switches[1][0]
    assert 10 + LADDER.dwell_s <= rise <= 10 + LADDER.dwell_s + LADDER.smoothing_s + 0.5  # as without it
    assert 50 + 8.0 <= fall <= 50 + 8.0 + LADDER.smoothing_s + 0.5
    assert slow_fall.history_s == 8.0 + LADDER.smoothing_s + 1.0


def test_fall_dwell_unset_is_dwell_s_both_ways():
    assert LADDER.fall_dwell_s is None and LADDER.history_s == LADDER.dwell_s + LADDER.smoothing_s + 1.0
    same = LADDER.model_copy(update={"fall_dwell_s": LADDER.dwell_s})

    def load(t):
        return 1.0 if t < 10 else 30.0 if t < 30 else 1.0

    assert run(same, load, 60.0) == run(LADDER, load, 60.0)
    with pytest.raises(ValidationError, match="fall_dwell_s"):
        PolicyConfig(fall_dwell_s=-1)


def test_rise_min_interval_lets_a_burst_take_the_next_tier_within_dwell():
    quick_rise = LADDER.model_copy(update={"rise_min_interval_s": 0.0})

    def burst(t):  # up past 4 + 1 at 10 s (→ 3 steps), past 12 + 1 at 14 s (→ 0), down at 40 s
        return 1.0 if t < 10 else 8.0 if t < 14 else 30.0 if t < 40 else 1.0

    held = run(LADDER, burst, 70.0)
    switches = run(quick_rise, burst, 70.0)
    assert [(a, b) for _, a, b in held] == [(5, 3), (3, 0), (0, 5)]
    assert [(a, b) for _, a, b in switches] == [(5, 3), (3, 0), (0, 5)]
    first = switches[0][0]
    assert held[0][0] == first and held[1][0] >= first + LADDER.min_switch_interval_s  # waited out the interval
    assert 14 + LADDER.dwell_s <= switches[1][0] <= 14 + LADDER.dwell_s + LADDER.smoothing_s + 0.5
    assert switches[1][0] < first + LADDER.min_switch_interval_s
    assert switches[2][0] == held[2][0]  # the return to more steps is as without it


def test_rise_min_interval_does_not_shorten_a_return_to_more_steps():
    quick_rise = LADDER.model_copy(update={"rise_min_interval_s": 0.0})
    low = history([1.0] * 20)
    d = decide(ModeState(0, last_switch_time=3.0), low, 19 * TICK, quick_rise)
    assert (d.switch, d.reason) == (False, "min_interval")
    high = history([20.0] * 20)
    d = decide(ModeState(5, last_switch_time=4.0), high, 19 * TICK, quick_rise)
    assert (d.num_steps, d.switch, d.reason) == (0, True, "load_rise")
    with pytest.raises(ValidationError, match="rise_min_interval_s"):
        PolicyConfig(rise_min_interval_s=-1)


def test_two_tier_on_off_is_the_special_case():
    on_off = PolicyConfig(tiers=[Tier(below=8, num_steps=4), Tier(num_steps=0)], dwell_s=0, min_switch_interval_s=0)
    assert decide(ModeState(4), history([10.0]), 0.0, on_off).num_steps == 0
    assert decide(ModeState(0), history([7.5]), 0.0, on_off).num_steps == 0  # inside the margin
    assert decide(ModeState(0), history([7.5]), 0.0, on_off.model_copy(update={"margin": 0})).num_steps == 4


@pytest.mark.parametrize(
    "tiers, field",
    [
        ([{"below": 4, "num_steps": 5}], "last tier"),
        ([{"num_steps": 5}, {"num_steps": 0}], "tiers[0]"),
        ([{"below": 8, "num_steps": 5}, {"below": 4, "num_steps": 3}, {"num_steps": 0}], "tiers[1].below"),
        ([{"below": 8, "num_steps": 3}, {"num_steps": 3}], "own num_steps"),
        ([{"below": 8, "num_steps": -1}, {"num_steps": 0}], "num_steps"),
    ],
)
def test_a_bad_ladder_is_rejected_naming_the_field(tiers, field):
    with pytest.raises(ValidationError, match=field.replace("[", r"\[").replace("]", r"\]")):
        PolicyConfig(tiers=tiers)
