"""Shared fixtures. ``ray_session`` starts one local Ray for the whole test session, on demand."""

import functools
import os
import re
from pathlib import Path

import pytest

from serve_app.serving.config import set_ray_env
from serve_app.tools.bench.client import free_port  # the tests' servers take ports as the benchmarks' do

# Set before Ray starts so that every Ray worker inherits them.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray exports metrics every 10 s by default; the observability test reads them within seconds.
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
# The stack's HTTP front and transport (serve_app.serving.config.RAY_ENV); each pytest-xdist worker
# starts a Ray of its own, and takes its ingress ports from a half of the windows of its own.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
set_ray_env(own_ports=True, worker=int(_WORKER[2:]) if _WORKER.startswith("gw") else None)
TEST_ADMIN_TOKEN_ENV = "SPECSERVE_TEST_ADMIN_TOKEN"
TEST_ADMIN_TOKEN = "test-admin-token"
os.environ[TEST_ADMIN_TOKEN_ENV] = TEST_ADMIN_TOKEN


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with 2 CPUs and 8 fake GPUs; Serve is shut down at the end."""
    import ray

    ray.init(
        num_cpus=2,
        num_gpus=8,
        include_dashboard=False,
        object_store_memory=200 * 1024 * 1024,
        log_to_driver=False,
        namespace="specserve-tests",
    )
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def serve_http(ray_session):
    """Serve's HTTP proxy on a free local port (other test runs may hold 8000)."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


# A policy that moves fast enough for tests: load/replica < 2 → 4 steps, else 0.
TEST_POLICY = {
    "tiers": [{"below": 2, "num_steps": 4}, {"num_steps": 0}],
    "margin": 0.5,
    "dwell_s": 0.5,
    "min_switch_interval_s": 1.0,
    "smoothing_s": 0.5,
}


def app_args(model: str = "tiny-random", **overrides) -> dict:
    args = {
        "engine": {"embedded": {"model": model, "device": "cpu", "num_threads": 1, "max_num_seqs": 16}},
        "num_replicas": 2,
        "replica_ray_actor_options": {"num_cpus": 0},
        "admin_token_env": TEST_ADMIN_TOKEN_ENV,
        "policy": TEST_POLICY,
    }
    args.update(overrides)
    return args


class LiveApp:
    """A deployed specserve application and the ways tests talk to it."""

    def __init__(self, name: str, base_url: str, args: dict):
        import httpx

        self.name, self.base_url, self.args = name, base_url, args
        self.prefix = f"{base_url}/{name}"
        self.http = httpx.Client(base_url=self.prefix, timeout=120)
        self.admin = {"Authorization": f"Bearer {TEST_ADMIN_TOKEN}"}

    def speculation(self) -> dict:
        r = self.http.get("/v1/speculation")
        r.raise_for_status()
        return r.json()

    def put(self, body: dict, headers: dict | None = None):
        return self.http.put("/v1/speculation", json=body, headers=self.admin if headers is None else headers)

    def wait_until(self, predicate, timeout_s: float = 30.0, every_s: float = 0.05) -> dict:
        """Poll GET /v1/speculation until predicate(status) holds; returns that status."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            status = self.speculation()
            if predicate(status):
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met in {timeout_s}s; last status: {status}")
            time.sleep(every_s)

    def all_replicas_at(self, num_steps: int, count: int | None = None):
        def check(s):
            reps = s["replicas"]
            return (
                s["num_steps"] == num_steps
                and (count is None or len(reps) == count)
                and bool(reps)
                and all(r["num_steps"] == num_steps and r["applied_version"] == s["version"] for r in reps)
            )

        return check

    def reset(self) -> None:
        """Back to auto mode with the configured policy, idle."""
        r = self.put({"mode": "auto", "policy": {"engine_step_policy": None, **self.args["policy"]}})
        r.raise_for_status()
        first = self.args["policy"]["tiers"][0]["num_steps"]
        self.wait_until(self.all_replicas_at(first))


def deploy(name: str, base_url: str, args: dict, replica_options: dict | None = None) -> LiveApp:
    from ray import serve

    from serve_app.control.actor import delete_controller
    from serve_app.serving.app import bind_app

    delete_controller(name)
    serve.run(bind_app(args, replica_options), name=name, route_prefix=f"/{name}")
    return LiveApp(name, base_url, args)


def undeploy(app: LiveApp) -> None:
    from ray import serve

    from serve_app.control.actor import delete_controller

    serve.delete(app.name)
    delete_controller(app.name)


@pytest.fixture(scope="session")
def tiny_app(serve_http):
    """One application on the tiny random model with 2 replicas, shared by the app tests."""
    app = deploy("tiny", serve_http, app_args())
    yield app
    undeploy(app)


@pytest.fixture
def fresh_tiny_app(tiny_app):
    """The shared tiny app, reset to auto mode and its configured policy before and after."""
    tiny_app.reset()
    yield tiny_app
    tiny_app.reset()


def _sglang_releases() -> list[str]:
    from serve_app.engines.sglang.compat import RELEASES

    return sorted(RELEASES)


@pytest.fixture(scope="module", params=_sglang_releases())
def sglang_release(request) -> str:
    """Each supported sglang release in turn (the tests that take it run once per release)."""
    return request.param


@pytest.fixture(scope="module")
def sglang_src(sglang_release):
    """That release's wheel source, unpacked; a failure in CI, a skip elsewhere, if absent."""
    from serve_app.tools.sglang_pins import source_tree

    path = source_tree(sglang_release)
    if path is None:
        reason = f"sglang {sglang_release} wheel not found: run .ci/fetch_sglang_wheel.sh"
        pytest.fail(reason) if os.environ.get("CI", "").lower() in ("true", "1") else pytest.skip(reason)
    return path


# Tight limits, so that the limits themselves are exercised and the fuzzer's requests are short;
# shared by the bad-input, fuzz and operator-API tests.
GUARD_LIMITS = {"max_prompt_tokens": 64, "max_tokens": 8, "max_request_bytes": 65536, "max_waiting_per_replica": 2}


@pytest.fixture(scope="session")
def guard_app(serve_http):
    engine = {
        "embedded": {"model": "tiny-random", "device": "cpu", "num_threads": 1, "max_num_seqs": 2, "max_model_len": 128}
    }
    app = deploy("guard", serve_http, app_args(num_replicas=1, engine=engine, limits=GUARD_LIMITS))
    yield app
    undeploy(app)


# -- the fast default run and the full one ------------------------------------------------------
# A test is slow when it starts Ray, trains a draft head (through these fixtures, or itself: then
# it is marked `slow`) or loads the real model (`real_model`). `pytest` runs the rest; `pytest
# --full` (what CI runs) runs all.
_SESSION_RAY_FIXTURES = ("ray_session", "serve_http", "tiny_app", "fresh_tiny_app", "guard_app")
_SLOW_FIXTURES = {*_SESSION_RAY_FIXTURES, "tiny_head"}


def pytest_addoption(parser):
    parser.addoption(
        "--full", action="store_true", help="also run the slow tests: those that start Ray or load the real model"
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("real_model") or _SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if config.getoption("--full"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


# -- two workers (scripts/test.sh: pytest-xdist's -n 2) ---------------------------------------------
# The modules that use the session's Ray run in one worker, one after the other, so that one Ray
# serves them all; every other module is a work unit of its own (its module-scoped fixtures set
# up once), handed to whichever worker is free, in file order.


@functools.cache
def _uses_session_ray(path: Path) -> bool:
    text = path.read_text() if path.is_file() else ""
    return any(re.search(rf"\b{name}\b", text) for name in _SESSION_RAY_FIXTURES)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "session-ray" if _uses_session_ray(config.rootpath / module) else module

    config.option.loadscopereorder = False  # file order: the session's Ray (tests/test_app_*) first
    return ByModule(config, log)
