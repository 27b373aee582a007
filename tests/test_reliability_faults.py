"""Faults under load, with the scenarios of ``python -m serve_app.tools.bench faults`` at short settings:
a replica killed, the controller killed 5 times, a 10 s switch storm, a short soak. No client-visible failure,
greedy outputs identical to the reference throughout."""

import pytest

from serve_app.tools.bench.faults import Target, controller_kill, replica_kill, soak, switch_storm
from tests.conftest import TEST_ADMIN_TOKEN, app_args, deploy, undeploy

REPLICAS = 2


@pytest.fixture(scope="module")
def target(serve_http):
    app = deploy("faults", serve_http, app_args(num_replicas=REPLICAS))
    yield Target(app.name, app.prefix, TEST_ADMIN_TOKEN)
    undeploy(app)


def report(r: dict) -> None:
    keys = ("sent", "completed", "failed", "retried", "cut", "resent")
    print(f"\n{r['scenario']}: " + " ".join(f"{k}={r[k]}" for k in keys), {k: r[k] for k in r if k not in keys})


def test_a_killed_replica_costs_no_request_and_comes_back_in_the_current_mode(target):
    r = replica_kill(target, REPLICAS, clients=6, max_tokens=48, kills=1, mode=2)
    report(r)
    assert r["failed"] == 0, r["errors"]  # no hang, no error but a cleanly cut stream
    assert r["retried"] + r["cut"] >= 1  # the kill hit requests in flight...
    assert r["completed"] + r["cut"] == r["sent"]  # ...and only streams past their first token saw it
    # The replacement runs the forced mode: replica_kill waits for it and raises on a timeout.


def test_killing_the_controller_5_times_during_switches_fails_no_request_and_loses_no_event(target):
    r = controller_kill(target, REPLICAS, clients=4, max_tokens=24, kills=5)
    report(r)
    assert r["failed"] == 0 and r["cut"] == 0, r["errors"]
    assert r["events_lost"] == 0 and r["switches"] == 6


def test_a_switch_storm_fails_nothing_and_changes_no_output(target):
    r = switch_storm(target, REPLICAS, clients=4, max_tokens=24, duration_s=10, period_s=0.1)
    report(r)
    assert r["failed"] == 0 and r["mismatched"] == 0 and r["cut"] == 0, r["errors"]
    assert r["switches"] >= 30 and r["switches_refused"] == 0  # each PUT waits for its broadcast: 0.1-0.25 s
    assert r["completed"] > 10


def handle_clients_through(target, fault, label: str) -> None:
    """4 Ray handle clients calling ``generate`` (greedy, 48 tokens) while ``fault(actor name)``
    hits the busiest replica; every call must complete with its reference output, and a new
    replica must take the place of the one hit."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from ray import serve

    handle = serve.get_app_handle(target.app_name)
    prompts = [f"{label} client {i} counts:" for i in range(4)]
    kw = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}
    reference = {p: handle.generate.remote(p, **kw).result(timeout_s=120)["text"] for p in prompts}
    stop, done, errors = threading.Event(), [], []

    def client(prompt: str) -> None:
        while not stop.is_set():
            try:
                out = handle.generate.remote(prompt, **kw).result(timeout_s=120)
                done.append(out["text"] == reference[prompt] and out["completion_tokens"] == 48)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(client, p) for p in prompts]
        time.sleep(2.0)
        busiest = max(target.replica_infos(), key=lambda info: info["load"]["running"] + info["load"]["waiting"])
        assert busiest["load"]["running"] > 0
        victim = next(n for n in target.replica_actor_names() if n.endswith(f"#{busiest['replica_id']}"))
        fault(victim)
        # The clients complete 8 more calls, those the fault hit and later ones. A loaded host takes
        # seconds a call, so the test waits for the calls (120 s at most: a hang) and not a fixed time.
        wanted, deadline = len(done) + 2 * len(prompts), time.monotonic() + 120
        while len(done) + len(errors) < wanted and time.monotonic() < deadline:
            time.sleep(0.2)
        stop.set()
        for f in futures:
            f.result(timeout=180)
    assert not errors, errors[:3]
    assert len(done) >= wanted and all(done), (len(done), wanted)
    deadline = time.monotonic() + 120  # a new replica in its place; the module's app whole for the next test
    while victim in (names := target.replica_actor_names()) or len(names) < REPLICAS:
        assert time.monotonic() < deadline, names
        time.sleep(0.5)


def test_handle_calls_survive_a_killed_replica(target):
    """The Ray handle API retries like HTTP: one-shot calls in flight when a replica dies
    complete on another replica, with the same greedy output."""
    import ray

    handle_clients_through(target, lambda name: ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True),
                           "handle")


def test_a_replica_whose_step_thread_ends_costs_no_request_and_is_replaced(target):
    """SystemExit raised in one replica's engine step thread, under load: the replica ends its
    process, the one-shot calls in flight and after complete on the other replica with the same
    greedy output, and Serve starts a replica in its place."""
    import ray

    def end_step_thread(_actor) -> int:  # runs in the replica's process (cloudpickled by value)
        import ctypes
        import threading

        step = next(t for t in threading.enumerate() if t.name == "specserve-engine")

        def raise_in_step_thread() -> None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(step.ident), ctypes.py_object(SystemExit))

        # Raised 0.2 s after this call returns, so its reply does not race the process's exit.
        threading.Timer(0.2, raise_in_step_thread).start()
        return step.ident

    def fault(name: str) -> None:
        replica = ray.get_actor(name, namespace="serve")
        assert ray.get(replica.__ray_call__.remote(end_step_thread), timeout=60) > 0

    handle_clients_through(target, fault, "step thread")


def test_a_short_soak_fails_nothing_and_samples_rss_and_ttft(target):
    r = soak(target, REPLICAS, clients=4, max_tokens=16, duration_s=40, sample_s=3)
    report(r)
    assert r["failed"] == 0 and r["cut"] == 0, r["errors"]
    assert r["rss_samples"] >= 12 and len(r["rss"]) == REPLICAS
    for replica in r["rss"].values():
        assert replica["first_mib"] > 0 and replica["max_drift_pct"] >= 0
        assert replica["idle_before_mib"] > 0 and replica["idle_after_mib"] > 0
    assert r["ttft"]["first_minute_streams"] > 0 and r["ttft"]["first_minute_p99_ms"] > 0


def test_a_rolling_update_under_load_loses_no_request(serve_http):
    """`serve run` of a new version replaces every replica while clients run. Each stopping
    replica has 1 s to finish (``graceful_shutdown_timeout_s``), less than a request takes, so
    it cuts off the requests it still runs. The ingress sends the one-shot ones and the streams
    that had sent no token to another replica; a stream cut mid-way ends with an error event.
    The new replicas come up in the cluster's forced mode."""
    import time

    from ray import serve

    from serve_app.serving.app import bind_app
    from serve_app.tools.bench.fault_load import Load, result

    opts = {"graceful_shutdown_timeout_s": 1.0, "graceful_shutdown_wait_loop_s": 0.2}
    # ~2 s a request alone on an AVX512 host, ~7 s on an AVX2 one, several times that beside another
    # test's load: the clients' timeouts (which tell a hang) leave room for it
    args, max_tokens, mode, timeout_s = app_args(num_replicas=REPLICAS), 1200, 2, 300
    app = deploy("rolling", serve_http, args, replica_options=opts)
    try:
        t = Target(app.name, app.prefix, TEST_ADMIN_TOKEN, timeout_s)
        ref = t.reference(max_tokens, REPLICAS)
        t.force({"mode": "fixed", "num_steps": mode}).raise_for_status()
        t.wait_converged(mode, REPLICAS)
        before = set(t.replica_actor_names())
        started = time.monotonic()
        with Load(t.prefix, 4, max_tokens, ref, timeout_s) as load:
            time.sleep(2.0)
            serve.run(bind_app(args, opts), name=app.name, route_prefix=f"/{app.name}")
            t.wait_converged(mode, REPLICAS, timeout_s=120)
            time.sleep(2.0)
        r = result("rolling_update", load.tally, started)
        report(r)
        assert not before & set(t.replica_actor_names())  # every replica was replaced
        assert r["failed"] == 0, r["errors"]
        assert r["retried"] + r["cut"] >= 1  # the stopping replicas cut requests off...
        assert r["completed"] + r["cut"] == r["sent"]  # ...and only streams past their first token saw it
    finally:
        undeploy(app)
