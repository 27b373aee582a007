"""The two-level policy in the simulator: request classes, the engine's step choice under the
cluster's ceiling, and the cost of num_steps 0 in a speculative engine."""

import json

import numpy as np
import pytest

from serve_app.control.config import ControllerOptions, PolicyConfig, Tier
from serve_app.control.steps import GateState, StepPolicyConfig, choose_steps
from serve_app.tools.simulate.__main__ import main
from serve_app.tools.simulate.curves import SGLANG_H200_OFF_COST, load_curve, parse_off_cost
from serve_app.tools.simulate.engine_steps import CurveStepCost, EngineSteps, tokens_table
from serve_app.tools.simulate.policies import curve_policy
from serve_app.tools.simulate.sim import ClosedLoop, SimOptions, Simulation
from serve_app.tools.simulate.traces import DEFAULT_CLASSES, RequestClass, bursty, parse_classes

OPTS = ControllerOptions(report_interval_s=0.25, stale_after_s=1.0)
CLASSES = parse_classes(DEFAULT_CLASSES)


def roofline():
    return load_curve("h200-8b-roofline")


def mixed_run(policy, curve=None, replicas=4, duration=30.0, **kw):
    curve = curve or roofline()
    rps = replicas * curve.capacity() / curve.output_tokens
    trace = bursty(rps, duration, curve.output_tokens, seed=2, low=0.1, high=0.7, period_s=1e9, burst_s=10,
                   first_burst_s=10)
    opts = SimOptions(replicas=replicas, policy=policy, classes=CLASSES, **kw)
    return Simulation(curve, trace, curve_policy(curve), OPTS, opts).run()


def test_classes_parse_by_share_and_reject_a_bad_acceptance():
    assert [(c.name, c.share, c.acceptance) for c in parse_classes("a:1:0.5,b:3:0.9")] == [
        ("a", 0.25, 0.5), ("b", 0.75, 0.9)]
    with pytest.raises(ValueError):
        parse_classes("a:1:1.5")
    assert parse_off_cost("sglang-h200") == SGLANG_H200_OFF_COST and parse_off_cost("1:0.5,8:0.7") == {1: 0.5, 8: 0.7}


def test_a_class_that_accepts_more_decodes_faster_at_the_same_step_time():
    # One replica, two classes of closed-loop clients at 3 fixed steps: each class's rate is the
    # step time's rate times its own tokens per step over the curve's.
    curve = roofline()
    classes = (RequestClass("copy", 0.5, 0.9), RequestClass("sampled", 0.5, 0.3))
    opts = SimOptions(replicas=1, policy="spec", spec_steps=3, classes=classes, drain_s=1e6)
    sim = Simulation(curve, ClosedLoop(8, 64, 256), PolicyConfig(tiers=[Tier(num_steps=3)]), OPTS, opts).run()
    tpot = sim.summary()["classes"]
    ratio = tpot["sampled"]["tpot_p50_ms"] / tpot["copy"]["tpot_p50_ms"]
    expected = (1 + 0.9 + 0.81 + 0.729) / (1 + 0.3 + 0.09 + 0.027)
    assert ratio == pytest.approx(expected, rel=0.05)
    assert (sim.req.finish_count == 1).all()


def test_without_classes_a_run_is_the_same_as_one_class_accepting_as_the_curve():
    curve = roofline()
    rps = 4 * curve.capacity() / curve.output_tokens
    trace = bursty(rps, 20.0, curve.output_tokens, seed=1, period_s=30, burst_s=5, first_burst_s=5)
    plain = Simulation(curve, trace, curve_policy(curve), OPTS, SimOptions(replicas=4)).run()
    assert plain.V.shape == (4, 1) and "classes" not in plain.summary()
    assert plain.delivered_tokens.sum() == plain.req.output_tokens.sum()


def test_the_vectorized_choice_is_choose_steps_replica_by_replica():
    rng = np.random.default_rng(0)
    cfg = StepPolicyConfig(per_sequence=False)  # the simulator picks one length a step: its curves price no ragged verify
    curve = roofline()
    sim = Simulation(curve, ClosedLoop(1, 1, 8), curve_policy(curve), OPTS, SimOptions(replicas=1, policy="two-level"))
    step_time = sim.engine_steps.step_time
    accept = [0.05, 0.55, 0.9, 0.3]
    tokens = tokens_table(accept, step_time.shape[0] - 1)
    n = 64
    engine = EngineSteps(n, step_time, tokens, cfg)
    gates = [GateState() for _ in range(n)]
    cost = CurveStepCost(step_time)
    reasons = set()
    for step in range(80):  # gates shut, probe, reopen as batches change
        now = step * 0.3
        counts = rng.integers(0, 4, (n, len(accept))) * (rng.random((n, 1)) < 0.9)
        ceiling = rng.integers(0, step_time.shape[0], n)
        # a quarter of the replicas run only the class that never pays, under a ceiling
        counts[: n // 4, 0] = np.maximum(counts[: n // 4, 0], 1)
        counts[: n // 4, 1:] = 0
        ceiling[: n // 4] = np.maximum(ceiling[: n // 4], 1)
        got = engine.choose(now, ceiling, counts)
        for r in range(n):
            accs = [a for a, m in zip(accept, counts[r], strict=True) for _ in range(m)]
            choice = choose_steps(int(ceiling[r]), accs, cost, gates[r], now, cfg)
            gates[r] = choice.gate
            reasons.add(choice.reason)
            assert got[r] == choice.num_steps, (step, r, choice)
            assert engine.shut[r] == choice.gate.shut
            if hasattr(choice.gate, "steps_since_probe"):
                assert engine.since_probe[r] == choice.gate.steps_since_probe
    assert reasons == {"ceiling", "gain", "gate", "probe"}


def test_two_level_is_never_below_the_ladder_alone_on_a_mixed_workload():
    dynamic = mixed_run("dynamic").summary()
    two = mixed_run("two-level").summary()
    assert two["goodput_tokens_per_s"] >= dynamic["goodput_tokens_per_s"]
    assert two["tpot_p50_ms"] <= dynamic["tpot_p50_ms"]
    # Time in mode is the k each engine ran; the ladder's ceiling is reported beside it.
    ran = {int(k) for k, v in two["time_in_mode"].items() if v > 0}
    assert ran - {0, 1, 3, 5} and set(two["time_in_ceiling"]) == set(two["time_in_mode"])


def test_a_speculative_engine_at_steps_0_is_slower_than_a_plain_engine_when_off_costs():
    curve = roofline()
    zero = PolicyConfig(tiers=[Tier(num_steps=0)])

    def tokens_per_s(policy, off_cost):
        curve.off_cost = off_cost
        opts = SimOptions(replicas=1, policy=policy, spec_steps=5, drain_s=1e6)
        return Simulation(curve, ClosedLoop(16, 64, 256), zero, OPTS, opts).run().summary()["output_tokens_per_s"]

    plain = tokens_per_s("off", {})
    assert tokens_per_s("dynamic", {}) == pytest.approx(plain, rel=1e-6)
    assert tokens_per_s("off", SGLANG_H200_OFF_COST) == pytest.approx(plain, rel=1e-6)  # static off: a plain engine
    slow = tokens_per_s("dynamic", SGLANG_H200_OFF_COST)
    assert slow == pytest.approx(0.54 * plain, rel=0.03)  # 16 running: 0.54x


def test_the_cli_runs_two_level_with_classes_and_writes_its_json(tmp_path):
    out = tmp_path / "run.json"
    assert main(["--curves", "h200-8b-roofline", "--replicas", "2", "--duration", "10", "--policy", "dynamic,two-level",
                 "--classes", "chat:0.5:0.55,copy:0.3:0.9,sampled:0.2:0.3", "--off-cost", "sglang-h200",
                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"dynamic", "two-level"}
    assert set(data["policies"]["two-level"]["classes"]) == {"chat", "copy", "sampled"}
    assert data["meta"]["curve"]["off_cost"] == {"1": 0.37, "16": 0.54}
