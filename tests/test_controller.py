"""The control plane: report aggregation, switches, propagation, persistence, the Ray actor."""

import time

import pytest

from serve_app.control.actor import delete_controller, get_or_create_controller
from serve_app.control.config import ControllerOptions, PolicyConfig, Tier
from serve_app.control.loop import ControlLoop, ReplicaReport

FAST = PolicyConfig(
    tiers=[Tier(below=4, num_steps=5), Tier(below=12, num_steps=3), Tier(num_steps=0)],
    margin=1.0,
    dwell_s=0.5,
    min_switch_interval_s=1.0,
    smoothing_s=0.0,
)
OPTS = ControllerOptions(report_interval_s=0.25, stale_after_s=1.0)


def report(rid, now, waiting=0, running=0, num_steps=5, applied_version=0):
    return ReplicaReport(rid, now, waiting, running, num_steps, applied_version)


def test_cluster_queue_sums_waiting_and_running_over_live_replicas():
    loop = ControlLoop(FAST, OPTS)
    loop.report(report("a", 10.0, waiting=3, running=4))
    loop.report(report("b", 10.5, waiting=1, running=2))
    loop.report(report("dead", 8.0, waiting=100, running=100))  # older than stale_after_s
    assert loop.cluster_queue(10.6) == (10.0, 2)
    assert [r["id"] for r in loop.status(10.6)["replicas"]] == ["a", "b"]


def test_stale_replicas_are_forgotten_eventually():
    loop = ControlLoop(FAST, OPTS)
    loop.report(report("a", 0.0))
    loop.tick(5.0)
    assert "a" in loop.replicas
    loop.tick(11.0)
    assert "a" not in loop.replicas


def drive(loop, t0, t1, per_replica_queue, replicas=("a", "b"), tick=0.25):
    """Replicas report and the loop ticks from t0 to t1; returns the switches."""
    events, t = [], t0
    while t <= t1:
        for rid in replicas:
            loop.report(report(rid, t, running=per_replica_queue, applied_version=loop.version))
        if (e := loop.tick(t)) is not None:
            events.append(e)
        t = round(t + tick, 6)
    return events


def test_a_switch_bumps_the_version_and_records_an_event():
    loop = ControlLoop(FAST, OPTS)
    assert (loop.num_steps, loop.version) == (5, 0)
    (event,) = drive(loop, 0.0, 2.0, per_replica_queue=20)
    assert (loop.num_steps, loop.version) == (0, 1)
    assert (event.from_steps, event.to_steps, event.reason, event.version) == (5, 0, "load_rise", 1)
    assert event.load == pytest.approx(20.0)
    d = loop.status(2.0)["events"][0]
    assert {"time", "from", "to", "reason", "load", "propagation_s"} <= d.keys()


def test_slow_reports_still_switch_because_decisions_run_on_their_own_clock():
    # Reports every 5 s (longer than the policy's whole history window); decisions every 0.25 s.
    slow = ControllerOptions(report_interval_s=5.0, stale_after_s=12.0)
    loop = ControlLoop(FAST, slow)
    events, t = [], 0.0
    while t <= 12.0 and not events:
        if t % 5.0 == 0:
            for rid in ("a", "b"):
                loop.report(report(rid, t, running=20, applied_version=loop.version))
        if (e := loop.tick(t)) is not None:
            events.append(e)
        t = round(t + slow.decision_interval_s, 6)
    assert [(e.from_steps, e.to_steps) for e in events] == [(5, 0)]


def test_propagation_is_measured_when_the_last_live_replica_applies_it():
    loop = ControlLoop(FAST, OPTS)
    drive(loop, 0.0, 0.25, per_replica_queue=0)
    loop.report(report("a", 0.5, running=20))
    loop.report(report("b", 0.5, running=20))
    for t in (0.75, 1.0):
        loop.report(report("a", t, running=20))
        loop.report(report("b", t, running=20))
        event = loop.tick(t)
    assert event is not None and event.propagation_s is None
    loop.ack("a", event.version, 1.004)
    assert event.propagation_s is None
    loop.ack("b", event.version, 1.010)
    assert event.propagation_s == pytest.approx(0.010)
    assert [e.version for e in loop.pop_propagated()] == [event.version]
    assert loop.propagation_stats()["count"] == 1


def test_a_replica_that_dies_before_applying_does_not_block_the_measure():
    loop = ControlLoop(FAST, OPTS)
    loop.report(report("a", 0.0))
    loop.report(report("b", 0.0))
    event = loop.set_mode("fixed", 0, 0.1)
    loop.ack("a", event.version, 0.2)
    loop.report(report("a", 1.5, applied_version=event.version))
    loop.tick(1.5)  # b's last report is 1.5 s old: stale, dropped from the waiting set
    assert event.propagation_s == pytest.approx(1.4)


def test_operator_pins_a_mode_and_auto_hands_back_to_the_policy():
    loop = ControlLoop(FAST, OPTS)
    drive(loop, 0.0, 1.0, per_replica_queue=0)
    event = loop.set_mode("fixed", 3, 1.1)
    assert (loop.mode, loop.num_steps, event.reason) == ("fixed", 3, "operator")
    assert drive(loop, 1.25, 5.0, per_replica_queue=0) == []  # the pin holds against low load
    back = loop.set_mode("auto", None, 5.1)  # the load has been low for longer than the dwell
    assert loop.mode == "auto"
    assert (back.to_steps, back.reason) == (5, "load_fall")


def test_policy_changes_at_run_time():
    loop = ControlLoop(FAST, OPTS)
    drive(loop, 0.0, 2.0, per_replica_queue=2)
    assert loop.num_steps == 5
    # The load seen before the change already satisfies the new ladder's dwell.
    event = loop.set_policy({"tiers": [{"below": 1, "num_steps": 5}, {"num_steps": 0}], "margin": 0.5}, 2.1)
    assert (event.to_steps, event.reason) == (0, "load_rise")
    assert loop.policy.dwell_s == FAST.dwell_s  # fields not in the patch are kept


def test_state_survives_a_round_trip_through_persistence():
    loop = ControlLoop(FAST, OPTS)
    drive(loop, 0.0, 2.0, per_replica_queue=20)
    loop.set_mode("fixed", 3, 2.1)
    loop.set_policy({"margin": 2.0}, 2.2)
    back = ControlLoop.from_persisted(loop.to_persisted(), FAST, OPTS)
    assert (back.num_steps, back.override, back.version, back.policy.margin) == (3, 3, 2, 2.0)
    assert [e.to_dict() for e in back.events] == [e.to_dict() for e in loop.events]


def test_a_redeploy_with_a_new_configured_policy_wins_over_run_time_edits():
    loop = ControlLoop(FAST, OPTS)
    loop.set_policy({"margin": 2.0}, 0.0)
    redeployed = FAST.model_copy(update={"margin": 0.5})
    back = ControlLoop.from_persisted(loop.to_persisted(), redeployed, OPTS)
    assert back.policy.margin == 0.5


# -- the Ray actor ------------------------------------------------------------------------------


@pytest.fixture
def controller(ray_session):
    app = f"ctl-test-{time.monotonic_ns()}"
    handle = get_or_create_controller(app, "NoSuchDeployment", FAST, OPTS)
    yield app, handle
    delete_controller(app)


def test_long_poll_returns_on_a_switch_and_times_out_otherwise(controller, ray_session):
    _, ctl = controller
    ray = ray_session
    assert ray.get(ctl.get_num_steps.remote()) == (0, 5, None)
    t0 = time.monotonic()
    assert ray.get(ctl.wait_for_mode.remote(0, 0.3)) == (0, 5, None)
    assert 0.25 < time.monotonic() - t0 < 2.0

    waiter = ctl.wait_for_mode.remote(0, 30.0)
    time.sleep(0.2)
    status = ray.get(ctl.update.remote("fixed", 0, None))
    assert (status["mode"], status["num_steps"], status["version"]) == ("fixed", 0, 1)
    t0 = time.monotonic()
    assert ray.get(waiter, timeout=5) == (1, 0, None)
    assert time.monotonic() - t0 < 0.5

    # The engines' step policy travels with the mode: a version of its own, same num_steps.
    waiter = ctl.wait_for_mode.remote(1, 30.0)
    time.sleep(0.2)
    status = ray.get(ctl.update.remote(None, None, {"engine_step_policy": "adaptive"}))
    assert ray.get(waiter, timeout=5) == (2, 0, "adaptive")
    assert (status["events"][-1]["reason"], status["events"][-1]["to"]) == ("step_policy", 0)


def test_bad_operator_input_comes_back_as_an_error_naming_the_field(controller, ray_session):
    _, ctl = controller
    out = ray_session.get(ctl.update.remote(None, None, {"margin": -1}))
    assert out["param"] == "policy.margin"
    out = ray_session.get(ctl.update.remote("sometimes", None, None))
    assert "mode" in out["error"]


def test_the_controller_comes_back_from_a_kill_with_its_state(controller, ray_session):
    app, ctl = controller
    ray = ray_session
    ray.get(ctl.report.remote({"replica_id": "r1", "waiting": 0, "running": 0, "num_steps": 5, "applied_version": 0}))
    ray.get(ctl.update.remote("fixed", 3, {"margin": 0.25}))
    ray.kill(ctl, no_restart=False)
    status = ray.get(ctl.status.remote(), timeout=60)  # same handle: the actor restarts
    assert (status["mode"], status["num_steps"], status["version"]) == ("fixed", 3, 1)
    assert status["policy"]["margin"] == 0.25
    assert [(e["from"], e["to"], e["reason"]) for e in status["events"]] == [(5, 3, "operator")]
    # And it still switches.
    status = ray.get(ctl.update.remote("fixed", 0, None))
    assert (status["num_steps"], status["version"]) == (0, 2)


def test_many_long_polls_wait_concurrently(controller, ray_session):
    _, ctl = controller
    ray = ray_session
    waiters = [ctl.wait_for_mode.remote(0, 30.0) for _ in range(50)]
    time.sleep(0.3)
    ray.get(ctl.update.remote("fixed", 3, None))
    assert ray.get(waiters, timeout=10) == [(1, 3, None)] * 50


def test_a_step_policy_change_is_a_version_that_leaves_the_ladder_s_timing_alone():
    loop = ControlLoop(FAST, OPTS)
    assert drive(loop, 0.0, 3.0, per_replica_queue=8)[0].to_steps == 3
    switched_at, version = loop.last_switch_time, loop.version
    event = loop.set_policy({"engine_step_policy": "adaptive"}, 3.5)
    assert (event.reason, event.from_steps, event.to_steps, event.version) == ("step_policy", 3, 3, version + 1)
    assert loop.mode_tuple == (version + 1, 3, "adaptive") and loop.last_switch_time == switched_at
    assert loop.set_policy({"margin": 0.5}, 3.6) is None  # the same step policy: no new version
    assert loop.set_policy({"engine_step_policy": None}, 3.7).detail.endswith("adaptive -> configured")


def test_pure_loop_has_no_event_loop_dependency():
    # The simulator runs ControlLoop in plain synchronous code.
    loop = ControlLoop(FAST, OPTS)
    assert drive(loop, 0.0, 3.0, per_replica_queue=8)[0].to_steps == 3
