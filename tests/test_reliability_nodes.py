"""Node loss under load on a real 3-node Ray cluster on this machine (``ray.cluster_utils.Cluster``:
a head with the proxy and the ingress, 2 workers with one replica each, the controller on a
worker). The scenarios are those of ``python -m serve_app.tools.bench faults --nodes 3``, run
in a process of their own (a driver joins one Ray cluster only, and other tests share the
session's local Ray), on tiny-random with configs/tiny-random.yaml's engine args:

- ``node_replica``: the worker node of a replica is removed (raylet and workers killed).
- ``node_controller``: the worker node that holds the controller (and a replica) is removed.

In both, a fresh worker joins a few seconds later, as an autoscaler would add one.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from serve_app.control.config import ControllerActorOptions, ControllerOptions

ROOT = Path(__file__).resolve().parents[1]
REPLICAS = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("nodes") / "faults_nodes.json"
    cmd = [
        sys.executable,
        "-m",
        "serve_app.tools.bench",
        "faults",
        "--nodes",
        "3",
        "--replicas",
        str(REPLICAS),
        "--config",
        str(ROOT / "configs" / "tiny-random.yaml"),
        "--scenarios",
        "node_replica,node_controller",
        "--clients",
        "4",
        "--max-tokens",
        "48",
        "--replace-after-s",
        "3",
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    # A session of its own, so that a run past the timeout takes its cluster's processes with it.
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the bench ran past 420 s:\n{stdout[-2000:]}\n{stderr[-2000:]}")
    print(stdout[-4000:])
    assert out.exists(), f"the bench wrote no results (rc {proc.returncode}):\n{stderr[-4000:]}"
    report = json.loads(out.read_text())
    return {r["scenario"]: r for r in report["results"]}


def check_served_through(r: dict) -> None:
    # Nothing lost: every request completed with the reference output, or was a stream cut
    # past its first token that ended with an error event and [DONE] (a hang counts as failed).
    assert r["failed"] == 0, r["errors"]
    assert r["completed"] + r["cut"] == r["sent"]
    # The node held a busy replica: requests were in flight on it, and were retried or cut.
    assert r["in_flight_at_removal"] >= 1
    assert r["retried"] + r["cut"] >= 1, r
    assert r["completed_during_recovery"] > 0  # serving went on while the node was missing
    assert r["mode_after"] == r["mode"]
    assert 0 < r["recovery_s"] < 300
    before, after = r["placement_before"], r["placement_after"]
    assert before["ingress"] == ["head"] and after["ingress"] == ["head"]
    for where in (before, after):  # one replica per worker node, none on the head
        assert len(set(where["replicas"])) == REPLICAS and "head" not in where["replicas"], where
    assert r["removed_node"] in before["replicas"] and r["removed_node"] not in after["replicas"]
    assert r["replacement_node"] in after["replicas"]


def test_losing_a_replicas_node_loses_no_request_and_returns_to_the_mode(results):
    r = results["node_replica"]
    check_served_through(r)
    assert r["removed_node"] != r["placement_before"]["controller"]


def test_losing_the_controllers_node_restores_it_elsewhere_with_its_mode(results):
    r = results["node_controller"]
    check_served_through(r)
    assert r["removed_node"] == r["placement_before"]["controller"]
    assert r["controller_back_on"] != r["removed_node"] and r["controller_back_on"] != "head"
    assert 0 < r["controller_back_s"] <= r["recovery_s"]
    # Replicas on live nodes kept their mode while the controller was away...
    assert r["mode_samples_while_away"] > 0 and r["modes_while_away"] == [r["mode"]]
    # ...and the restarted controller came back at the same version: nobody forced it again.
    assert r["version_after"] == r["version_before"]


def test_controller_placement_options_are_strict():
    assert ControllerOptions().ray_actor_options.actor_options() == {"num_cpus": 0.0}
    pinned = ControllerOptions.model_validate({"ray_actor_options": {"num_cpus": 0.5, "resources": {"head": 0.001}}})
    assert pinned.ray_actor_options.actor_options() == {"num_cpus": 0.5, "resources": {"head": 0.001}}
    bad = [
        {"num_cpus": -1},
        {"num_cpus": True},
        {"num_cpus": float("nan")},
        {"resources": {"CPU": 1}},
        {"resources": {"GPU": 1}},
        {"resources": {"head": 0}},
        {"resources": {"head": float("inf")}},
        {"resources": {"head": "1"}},
        {"resource": {"head": 1}},
        {"scheduling_strategy": "SPREAD"},
    ]
    for options in bad:
        with pytest.raises(ValidationError):
            ControllerActorOptions.model_validate(options)
