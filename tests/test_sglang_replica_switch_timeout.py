"""A switch whose SGLang RPC hangs, end to end: the real app on Ray Serve with the sglang backend.

The replica imports a stand-in ``sglang`` package this test writes to a temporary folder (put
on the replica's PYTHONPATH through its runtime_env), shaped as tests/test_sglang_engine.py's
FakeEngine, with a ``sglang-0.5.23.dist-info`` so that ``compat.installed()`` answers 0.5.23.
Its ``collective_rpc`` blocks while a flag file exists. While it does, the replica keeps its
step count and keeps serving, and GET /v1/speculation shows the failed switch; once the flag
is gone, the retries bring the replica to the commanded mode.
"""

import os
import textwrap
import time

import pytest

from serve_app.engines.sglang.plugin import RPC_METHOD

from .conftest import TEST_ADMIN_TOKEN_ENV, TEST_POLICY, LiveApp, deploy, undeploy

APP = "sglang-switch-timeout"
HANG_ENV = "SPECSERVE_TEST_SGLANG_HANG_FILE"
CALLS_ENV = "SPECSERVE_TEST_SGLANG_CALLS_FILE"
RPC_TIMEOUT_S = 0.5

STAND_IN = textwrap.dedent(
    f'''
    """Stand-in for sglang's Engine, written by tests/test_sglang_replica_switch_timeout.py."""

    import os
    import time
    from types import SimpleNamespace


    def _log(line):
        with open(os.environ["{CALLS_ENV}"], "a") as f:
            f.write(line + "\\n")


    class _TokenizerManager:
        def __init__(self):
            idle = SimpleNamespace(num_waiting_reqs=0, num_running_reqs=0, gen_throughput=0.0)
            self.load_snapshot_reader = SimpleNamespace(read_all=lambda: [idle])

        def abort_request(self, rid="", abort_all=False):
            pass


    class Engine:
        def __init__(self, **kwargs):
            self.kwargs = kwargs
            self.server_args = SimpleNamespace(
                speculative_adaptive=True, resolved_dict=lambda: {{"speculative_adaptive": True}}
            )
            self.tokenizer_manager = _TokenizerManager()

        def collective_rpc(self, method, **kwargs):
            _log(f"start {{method}} {{kwargs['num_steps']}}")
            while os.path.exists(os.environ["{HANG_ENV}"]):  # the schedulers do not answer
                time.sleep(0.02)
            _log(f"end {{method}} {{kwargs['num_steps']}}")

        async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, stream=False, rid=None):
            async def chunks():
                yield {{
                    "text": "Hel",
                    "output_ids": [1, 2],
                    "meta_info": {{"finish_reason": None, "prompt_tokens": 3, "completion_tokens": 2}},
                }}
                yield {{
                    "text": "lo",
                    "output_ids": [3],
                    "meta_info": {{
                        "finish_reason": {{"type": "length", "length": 3}},
                        "prompt_tokens": 3,
                        "completion_tokens": 3,
                    }},
                }}

            return chunks()

        def shutdown(self):
            pass
    '''
)


@pytest.fixture
def stand_in_sglang(tmp_path):
    """A folder holding the stand-in sglang package and its dist-info; the flag and call log paths."""
    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text(STAND_IN)
    dist = site / "sglang-0.5.23.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n")
    return site, tmp_path / "hang", tmp_path / "calls.log"


def sglang_app_args(site, hang, calls, adaptive_dir) -> dict:
    steps = sorted(t["num_steps"] for t in TEST_POLICY["tiers"])  # the policy's tiers must be candidates
    # Ray sets a runtime_env's env_vars over the worker's environment (a PYTHONPATH replaces the
    # cluster's), so the stand-in goes first and the driver's PYTHONPATH, if any, follows.
    python_path = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {
        "engine": {
            "backend": "sglang",
            "sglang": {
                "model_path": "stand-in/target",
                "draft_model_path": "stand-in/draft",
                "tp_size": 1,
                "candidate_steps": steps,
                "rpc_timeout_s": RPC_TIMEOUT_S,
                "adaptive_config_dir": str(adaptive_dir),
            },
        },
        "num_replicas": 1,
        "replica_ray_actor_options": {
            "num_cpus": 0,
            "runtime_env": {"env_vars": {"PYTHONPATH": python_path, HANG_ENV: str(hang), CALLS_ENV: str(calls)}},
        },
        "admin_token_env": TEST_ADMIN_TOKEN_ENV,
        "policy": TEST_POLICY,
    }


def rpcs(calls) -> list[str]:
    return calls.read_text().splitlines() if calls.exists() else []


def test_a_hung_switch_rpc_times_out_the_replica_keeps_serving_and_catches_up(serve_http, stand_in_sglang, tmp_path):
    site, hang, calls = stand_in_sglang
    started = time.monotonic()
    try:
        app = deploy(APP, serve_http, sglang_app_args(site, hang, calls, tmp_path / "adaptive"))
        old = TEST_POLICY["tiers"][0]["num_steps"]  # idle: the first tier, and the engine's initial steps
        new = TEST_POLICY["tiers"][-1]["num_steps"]
        s = app.wait_until(app.all_replicas_at(old, count=1), timeout_s=30)
        assert s["replicas"][0]["switch_failures"] == 0 and s["replicas"][0]["last_switch_error"] is None
        log = rpcs(calls)  # the start-up switches were answered
        assert log and sum(x.startswith("start ") for x in log) == sum(x.startswith("end ") for x in log)
        deployed = time.monotonic()

        hang.touch()  # from now on the schedulers do not answer
        r = app.put({"mode": "fixed", "num_steps": new})
        assert r.status_code == 200, r.text
        commanded = r.json()["version"]

        def failed(s):
            reps = s["replicas"]
            return len(reps) == 1 and reps[0]["switch_failures"] >= 1

        s = app.wait_until(failed, timeout_s=5)
        rep = s["replicas"][0]
        assert (s["mode"], s["num_steps"], s["version"]) == ("fixed", new, commanded)
        assert rep["num_steps"] == old and rep["active_num_steps"] == old and rep["applied_version"] < commanded
        assert rep["last_switch_error"].startswith("SwitchTimeoutError: ")
        assert f"{RPC_TIMEOUT_S:g} s" in rep["last_switch_error"]
        assert f"staying at num_steps={old}" in rep["last_switch_error"]

        # Still serving, in the old mode, and still reporting (the controller keeps it live).
        t0 = time.monotonic()
        r = app.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "Hello" and r.json()["choices"][0]["finish_reason"] == "length"
        assert time.monotonic() - t0 < 5
        failures = rep["switch_failures"]
        until = time.monotonic() + 4 * RPC_TIMEOUT_S
        while time.monotonic() < until:
            s = app.speculation()
            assert len(s["replicas"]) == 1, f"the hung switch stalled the replica's load reports: {s}"
            rep = s["replicas"][0]
            assert rep["num_steps"] == old and rep["applied_version"] < commanded
            assert rep["switch_failures"] >= failures
            assert s["events"][-1]["propagation_s"] is None  # the switch has not reached the replica
            failures = rep["switch_failures"]
            time.sleep(0.05)
        assert failures >= 2  # the long-poll and the reports retried
        # The stuck call owns the engine's RPC socket: the retries waited for it, none started another.
        assert [line for line in rpcs(calls) if line.endswith(f" {new}")] == [f"start {RPC_METHOD} {new}"]

        hang.unlink()  # the schedulers answer again
        released = time.monotonic()
        s = app.wait_until(app.all_replicas_at(new, count=1), timeout_s=10)
        caught_up = time.monotonic() - released
        assert s["replicas"][0]["applied_version"] == s["version"] == commanded
        app.wait_until(lambda s: s["events"][-1]["propagation_s"] is not None, timeout_s=5)
        assert rpcs(calls)[-1] == f"end {RPC_METHOD} {new}"
        r = app.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello"
        print(
            f"\ndeploy {deployed - started:.1f} s; {failures} timed-out switch attempts while hung; "
            f"caught up {caught_up * 1000:.0f} ms after the RPC answered"
        )
    finally:
        hang.unlink(missing_ok=True)  # first: a blocked RPC thread would hold up the replica's shutdown
        undeploy(LiveApp(APP, serve_http, {}))  # the app and its controller (actor and saved state)
