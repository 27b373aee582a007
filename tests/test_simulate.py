"""The cluster simulator: its invariants, what its controller may see, its curves and validate."""

import json
from pathlib import Path

import numpy as np
import pytest

from serve_app.control.config import ControllerOptions, PolicyConfig, Tier, load_policy_file
from serve_app.tools.simulate.__main__ import curve_policy, main
from serve_app.tools.simulate.curves import from_bench, load_curve, mean_accepted
from serve_app.tools.simulate.sim import ClosedLoop, SimOptions, Simulation
from serve_app.tools.simulate.traces import Trace, bursty
from serve_app.tools.simulate.validate import stack_efficiency

BENCH = Path(__file__).parent / "data" / "engine_bench_sample.json"
ROOF = load_curve("h200-8b-roofline")
LADDER = curve_policy(ROOF)
OPTS = ControllerOptions(report_interval_s=0.25, stale_after_s=1.0)


def roofline_run(policy="dynamic", replicas=4, duration=40.0, **kw):
    rps = replicas * ROOF.capacity() / ROOF.output_tokens
    trace = bursty(rps, duration, ROOF.output_tokens, seed=1, period_s=30, burst_s=10, first_burst_s=10)
    opts = SimOptions(replicas=replicas, policy=policy, **kw)
    return Simulation(ROOF, trace, LADDER, OPTS, opts).run()


@pytest.mark.parametrize("policy", ["spec", "off", "dynamic", "local"])
def test_every_request_finishes_exactly_once_and_in_order_of_its_life(policy):
    sim = roofline_run(policy)
    req = sim.req
    assert (req.finish_count == 1).all()
    assert (req.replica >= 0).all() and (req.replica < 4).all()
    assert (req.arrival <= req.admit).all() and (req.admit <= req.first).all() and (req.first <= req.finish).all()
    assert (sim.slot_req == -1).all() and not sim.waiting.any() and not sim.running.any()


def test_tokens_are_conserved():
    sim = roofline_run("dynamic")
    assert sim.delivered_tokens.sum() == sim.req.output_tokens.sum() == sim.summary()["output_tokens"]
    # The replicas' decode rates, integrated, produce the delivered tokens: each request may differ
    # only by what one step holds at its start and end (finish times are interpolated inside a step).
    slack = 2 * len(sim.req.arrival) * sim.rate_lut.max() * sim.opts.dt_s
    assert abs(sim.decode_tokens.sum() - sim.delivered_tokens.sum()) <= slack


def test_closed_loop_clients_reproduce_the_measured_curve():
    curve = from_bench(BENCH, "chat")
    policy = PolicyConfig(tiers=[Tier(num_steps=5)])
    for k, c in [(0, 1), (0, 16), (5, 4)]:
        opts = SimOptions(replicas=1, policy="spec" if k else "off", spec_steps=5, drain_s=1e6)
        s = Simulation(curve, ClosedLoop(c, 4 * c, 64), policy, OPTS, opts).run().summary()
        assert s["output_tokens_per_s"] == pytest.approx(curve.throughput(c, k), rel=0.02)


def closed_loop_tokens_per_s(curve, k, clients, replicas=1, **host):
    policy = PolicyConfig(tiers=[Tier(num_steps=5)])
    opts = SimOptions(replicas=replicas, policy="spec" if k else "off", spec_steps=5, drain_s=1e6, **host)
    return Simulation(curve, ClosedLoop(clients, 8 * clients, 64), policy, OPTS, opts).run().summary()["output_tokens_per_s"]


def test_a_host_that_costs_nothing_or_has_cores_to_spare_leaves_the_curve_alone():
    curve = from_bench(BENCH, "chat")
    alone = closed_loop_tokens_per_s(curve, 0, 8)
    assert closed_loop_tokens_per_s(curve, 0, 8, host_cores=1, host_s_per_chunk=0.0) == pytest.approx(alone)
    assert closed_loop_tokens_per_s(curve, 0, 8, host_cores=64, host_s_per_chunk=1e-3) == pytest.approx(alone)


def test_a_host_sharing_the_cores_slows_the_engines_by_cores_over_demand():
    curve = from_bench(BENCH, "chat")
    h = 2e-3  # CPU seconds per chunk
    x = curve.throughput(8, 0)  # one replica, 8 clients, k = 0: one chunk per token
    shared = closed_loop_tokens_per_s(curve, 0, 8, host_cores=1, host_s_per_chunk=h)
    assert shared == pytest.approx(x / (1 + h * x), rel=0.02)  # demand: 1 core + h·x, all slowed alike
    # Speculation streams fewer chunks per token, so the same host slows it less.
    k = 5
    per_chunk = curve.tokens_per_step(k)
    assert per_chunk > 1
    spec = closed_loop_tokens_per_s(curve, k, 8, host_cores=1, host_s_per_chunk=h)
    xk = curve.throughput(8, k)
    assert spec == pytest.approx(xk / (1 + h * xk / per_chunk), rel=0.02)


def test_the_stack_efficiency_scales_an_engine_by_its_mode_and_the_replicas_busy_at_once():
    curve = from_bench(BENCH, "chat")
    for k in (0, 5):
        alone = closed_loop_tokens_per_s(curve, k, 8)
        half = closed_loop_tokens_per_s(curve, k, 8, stack_efficiency={k: (0.5,)})
        assert half == pytest.approx(alone / 2, rel=0.01)  # decode and prefill both at half speed
    # Two replicas: one client keeps one busy (e1), two clients keep both busy (e2); a k not
    # listed takes the nearest listed one.
    eff = {0: (0.9, 0.6), 3: (1.0, 1.0)}
    one = closed_loop_tokens_per_s(curve, 0, 1, replicas=2, stack_efficiency=eff)
    assert one == pytest.approx(0.9 * curve.throughput(1, 0), rel=0.02)
    two = closed_loop_tokens_per_s(curve, 0, 2, replicas=2, stack_efficiency=eff)
    assert two == pytest.approx(2 * 0.6 * curve.throughput(1, 0), rel=0.02)
    assert closed_loop_tokens_per_s(curve, 5, 2, replicas=2, stack_efficiency={0: (0.5, 0.5)}) == pytest.approx(
        2 * 0.5 * curve.throughput(1, 5), rel=0.02)


def test_the_stack_efficiency_can_depend_on_the_requests_a_replica_runs():
    curve = from_bench(BENCH, "chat")
    # Both replicas busy: 0.6 with one request each, 0.8 with two, held at 0.8 for more.
    eff = {0: (0.9, (0.6, 0.8))}
    two = closed_loop_tokens_per_s(curve, 0, 2, replicas=2, stack_efficiency=eff)
    assert two == pytest.approx(2 * 0.6 * curve.throughput(1, 0), rel=0.02)
    four = closed_loop_tokens_per_s(curve, 0, 4, replicas=2, stack_efficiency=eff)
    assert four == pytest.approx(2 * 0.8 * curve.throughput(2, 0), rel=0.03)
    eight = closed_loop_tokens_per_s(curve, 0, 8, replicas=2, stack_efficiency=eff)
    assert eight == pytest.approx(2 * 0.8 * curve.throughput(4, 0), rel=0.03)


def test_validate_measures_the_stack_efficiency_by_busy_replicas_and_requests_per_replica():
    curve = from_bench(BENCH, "chat")
    x0, x5 = curve.throughput(1, 0), curve.throughput(1, 5)
    rows = [{"policy": "off", "concurrency": 1, "output_tokens_per_s": 0.9 * x0},
            {"policy": "off", "concurrency": 2, "output_tokens_per_s": 2 * 0.6 * x0},
            {"policy": "spec", "concurrency": 1, "output_tokens_per_s": 0.8 * x5},
            {"policy": "dynamic", "concurrency": 2, "output_tokens_per_s": 1.0},
            {"policy": "off", "concurrency": 3, "output_tokens_per_s": 1.0}]  # not b per replica: unused
    assert stack_efficiency(rows, curve, 2, 5) == {0: (0.9, 0.6), 5: (0.8, 0.8)}
    # Every replica busy with b requests (c = 2b): e = X(c) / (2 · X_curve(b)); b = 2 not
    # measured takes b = 1's value.
    rows.append({"policy": "off", "concurrency": 6, "output_tokens_per_s": 2 * 0.7 * curve.throughput(3, 0)})
    assert stack_efficiency(rows, curve, 2, 5) == {0: (0.9, (0.6, 0.6, 0.7)), 5: (0.8, 0.8)}
    with pytest.raises(ValueError, match="no spec or off rows"):
        stack_efficiency(rows[3:5], curve, 2, 5)


def test_staggered_clients_start_one_after_another():
    curve = from_bench(BENCH, "chat")
    policy = PolicyConfig(tiers=[Tier(num_steps=5)])
    opts = SimOptions(replicas=2, policy="off", spec_steps=5, drain_s=1e6)
    gap = 2 * 64 / curve.throughput(1, 0)  # twice one request's time
    sim = Simulation(curve, ClosedLoop(4, 4, 64, stagger_s=4 * gap), policy, OPTS, opts).run()
    assert sim.req.arrival.tolist() == pytest.approx([0.0, gap, 2 * gap, 3 * gap])
    assert (sim.req.admit >= sim.req.arrival).all() and (sim.req.finish_count == 1).all()
    # Each client's first request runs alone: no batching.
    tpot = (sim.req.finish - sim.req.first) / 63
    assert tpot == pytest.approx(np.full(4, 1 / curve.throughput(1, 0)), rel=0.02)
    with pytest.raises(ValueError, match="stagger_s"):
        ClosedLoop(4, 4, 64, stagger_s=-1)


def test_the_controller_sees_each_report_only_after_its_delay_and_as_it_was_taken():
    delay = 0.3
    sim = roofline_run("dynamic", report_delay_s=delay, record=True)
    control = sim.control
    history = {round(t, 6): (w, r) for t, w, r in sim.history}
    ids = {rid: i for i, rid in enumerate(control.ids)}
    assert control.reports
    for delivered, rep in control.reports:
        assert delivered == pytest.approx(rep.time + delay)
        waiting, running = history[round(rep.time, 6)]
        assert (rep.waiting, rep.running) == (waiting[ids[rep.replica_id]], running[ids[rep.replica_id]])

    # Every load sample the policy got is the sum of the reports delivered by then, and no later.
    stale = OPTS.stale_after_s
    for sample in control.samples:
        latest = {}
        for delivered, rep in control.reports:
            if delivered <= sample.time + 1e-9:
                latest[rep.replica_id] = rep
        live = [r for r in latest.values() if r.time >= sample.time - stale]
        assert sample.queue == sum(r.waiting + r.running for r in live)
        assert sample.replicas == len(live)


def test_a_burst_reaches_the_policy_no_sooner_than_the_report_delay():
    replicas, delay = 4, 3.0
    rps = replicas * ROOF.capacity() / ROOF.output_tokens
    n = int(rps * 20)
    rng = np.random.default_rng(0)
    trace = Trace(np.sort(10 + rng.random(n) * 20), np.full(n, 256), np.zeros(n, bool), 30.0)
    policy = LADDER.model_copy(update={"dwell_s": 0.0, "smoothing_s": 0.0, "min_switch_interval_s": 0.0})
    sim = Simulation(
        ROOF,
        trace,
        policy,
        ControllerOptions(report_interval_s=0.25, stale_after_s=5.0),
        SimOptions(replicas=replicas, policy="dynamic", report_delay_s=delay),
    ).run()
    events = list(sim.control.loop.events)
    assert events and events[0].time >= 10 + delay


def test_replicas_deciding_alone_switch_only_on_their_own_queue():
    replicas = 8
    rps = replicas * ROOF.capacity() / ROOF.output_tokens
    n = int(rps * 0.3 * 30)
    rng = np.random.default_rng(0)
    # all traffic lands on the first quarter of the replicas (hot_fraction 0.25)
    trace = Trace(np.sort(rng.random(n) * 30), np.full(n, 256), np.ones(n, bool), 30.0, hot_fraction=0.25)
    sim = Simulation(ROOF, trace, LADDER, OPTS, SimOptions(replicas=replicas, policy="local")).run()
    assert (sim.control.steps[2:] == LADDER.tiers[0].num_steps).all()  # idle replicas keep the top tier
    assert (sim.control.steps[:2] < LADDER.tiers[0].num_steps).all()


def test_presets_pass_through_their_published_points():
    seed = load_curve("seed-8gpu-pcie")
    assert [round(seed.throughput(b, k), 1) for k in (0, 3) for b in (1, 250)] == [92.6, 772.1, 77.5, 340.9]
    eagle = load_curve("eagle3-sglang-h100")
    assert eagle.throughput(64, 3) / eagle.throughput(64, 0) == pytest.approx(1.38)
    assert 100 <= ROOF.crossover(3) <= 200  # the design brief's estimate for k=3, τ≈3
    assert mean_accepted(3) == pytest.approx(2.952)


def test_validate_reports_each_point_and_fails_past_the_tolerance(tmp_path):
    curve = from_bench(BENCH, "chat")
    spec_steps = load_policy_file("configs/policies/local.yaml")["tiers"][0]["num_steps"]  # validate's "spec"
    rows = [
        {"policy": p, "concurrency": c, "output_tokens_per_s": 2 * curve.throughput(c / 2, k)}
        for p, k in (("off", 0), ("spec", spec_steps))
        for c in (2, 8)
    ]
    serve = tmp_path / "serve.json"
    serve.write_text(json.dumps({"meta": {"prompt_set": "chat", "spec_steps": spec_steps}, "rows": rows}))
    out = tmp_path / "v.json"
    args = ["validate", "--curves", str(BENCH), "--serve", str(serve), "--out", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["points_compared"] == 4 and result["meta"]["worst_error"] <= 0.05

    serve.write_text(json.dumps({"rows": [{**r, "output_tokens_per_s": 1.3 * r["output_tokens_per_s"]} for r in rows]}))
    assert main(args) == 1


def test_validate_simulates_the_ladder_the_sweep_recorded(tmp_path):
    curve = from_bench(BENCH, "chat")
    rows = [{"policy": p, "concurrency": 2, "output_tokens_per_s": 2 * curve.throughput(1, 0)} for p in ("off", "dynamic")]
    serve, out = tmp_path / "serve.json", tmp_path / "v.json"
    args = ["validate", "--curves", str(BENCH), "--serve", str(serve), "--out", str(out), "--tolerance", "10"]

    def simulated(meta):
        serve.write_text(json.dumps({"meta": {"prompt_set": "chat", **meta}, "rows": rows}))
        assert main(args) == 0
        return {p["policy"]: p["simulated_tokens_per_s"] for p in json.loads(out.read_text())["points"]}

    # The config's ladder speculates at one request per replica; a sweep that ran plain decoding
    # only is simulated as it ran.
    config_ladder = simulated({})
    assert config_ladder["dynamic"] != config_ladder["off"]
    recorded = simulated({"policy": {"tiers": [{"below": None, "num_steps": 0}]}})
    assert recorded["dynamic"] == recorded["off"] == config_ladder["off"]


def test_the_simulator_replays_a_bench_trace_result_with_its_arrivals_and_phases(tmp_path):
    from serve_app.tools.bench.trace import make_trace as bench_trace
    from serve_app.tools.simulate.traces import make_trace as sim_trace

    trace = bench_trace("bursty", seed=3, low_rate=2.0, high_rate=8.0, phase_s=5.0, phases=4)
    path = tmp_path / "serve_trace.json"
    path.write_text(json.dumps({"meta": {}, "trace": trace, "policies": {}}))
    replay = sim_trace(str(path), capacity_rps=1.0, duration_s=0.0, mean_tokens=32, seed=0)
    assert len(replay) == len(trace["arrivals"]) > 0
    assert list(replay.arrival) == sorted(a["t"] for a in trace["arrivals"])
    assert replay.duration_s == 20.0
    assert [name for _, _, name in replay.phases] == ["low", "high", "low", "high"]
