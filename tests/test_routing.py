"""serve_app.serving.routing: an ingress spreads a burst evenly over the replicas."""

import asyncio
import time
from collections import Counter

import pytest

from serve_app.serving.app import LEAST_LOADED_ROUTER, build_app
from serve_app.serving.config import AppArgs


def _deploy_front(name: str, max_ongoing_requests: int):
    """An ingress over two replicas of a deployment that holds each request for the seconds it
    is given and answers with its replica's id, routed by the least-loaded router. The
    ingress sends a plan of groups of requests, each group sent at once, without waiting
    between groups, and answers with each group's replica ids."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    @serve.deployment(num_replicas=2, max_ongoing_requests=max_ongoing_requests, ray_actor_options={"num_cpus": 0},
                      request_router_config=RequestRouterConfig(request_router_class=LEAST_LOADED_ROUTER))
    class Hold:
        async def __call__(self, seconds: float) -> str:
            await asyncio.sleep(seconds)
            return serve.get_replica_context().replica_id.unique_id

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Front:
        def __init__(self, hold):
            self._hold = hold

        async def __call__(self, plan: list[tuple[int, float]]) -> list[list[str]]:
            groups = [[self._hold.remote(seconds) for _ in range(n)] for n, seconds in plan]
            return [[await r for r in group] for group in groups]

        def counted(self) -> int:
            """Requests the handle's router counts on any replica: sent and not seen finish, or
            chosen and not sent."""
            router = self._hold._router._asyncio_router.request_router
            return sum(router.load(replica) for replica in {*router._sent, *router._chosen})

    handle = serve.run(Front.bind(Hold.bind()), name=name, route_prefix=None)
    # Before a burst, both replicas known to the router and their queue lengths in Serve's cache
    # (a replica takes a request to get there): a replica the cache lacks is probed, its probe
    # awaited, and the routing tasks of a burst interleave around the wait (16 went 7 and 9).
    deadline = time.monotonic() + 30
    while len(set(handle.remote([(2, 0.0)]).result()[0])) < 2:
        assert time.monotonic() < deadline, "the warm-up requests never reached both replicas"
    _until_nothing_counted(handle)
    return handle


def _until_nothing_counted(front, timeout_s: float = 10.0) -> None:
    """Waits until the router has seen every request end. The caller has its results before
    the router does: Serve hands a request's end from Ray's worker thread to the router's event
    loop, and on a loaded host a burst routed at once can run before the last ends of the one
    before it (16 went 6 and 10)."""
    deadline = time.monotonic() + timeout_s
    while (left := front.counted.remote().result()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == 0, f"the router still counts {left} requests {timeout_s} s after they ended"


@pytest.fixture(scope="module")
def front(serve_http):
    from ray import serve

    yield _deploy_front("routing-hold", 64)
    serve.delete("routing-hold")


def test_a_burst_is_split_evenly_and_finished_requests_stop_counting(front):
    for _ in range(2):  # the second burst comes after the first finished: nothing left counted
        (ids,) = front.remote([(16, 1.0)]).result()
        assert sorted(Counter(ids).values()) == [8, 8]
        _until_nothing_counted(front)


def test_requests_in_flight_count_against_their_replica(front):
    first, (lone,), rest = front.remote([(6, 2.0), (1, 3.0), (5, 1.0)]).result()
    assert sorted(Counter(first).values()) == [3, 3]
    # the lone one tips a replica to 4; of the 5 after it, 1 evens them and 4 go 2 and 2: 6 each
    assert sorted(Counter(first + [lone] + rest).values()) == [6, 6]
    assert Counter(rest)[lone] == 2


def test_requests_past_every_replicas_limit_wait_for_a_free_one(serve_http):
    from ray import serve

    narrow = _deploy_front("routing-narrow", 1)  # one request at a time per replica
    try:
        started = time.monotonic()
        (ids,) = narrow.remote([(6, 0.5)]).result()
        # both serve, one at a time each: three rounds of two at least (which replica frees
        # first and takes a waiting request is a race on a loaded host: 3 and 3, or 2 and 4)
        assert len(ids) == 6 and min(Counter(ids).values()) >= 2 and len(Counter(ids)) == 2
        assert time.monotonic() - started >= 1.5
    finally:
        serve.delete("routing-narrow")


def _replica_router(args: dict) -> str:
    replica = build_app(args)._bound_deployment.init_args[0]._bound_deployment
    return replica._deployment_config.request_router_config.request_router_class


def test_the_replicas_are_routed_least_loaded_unless_the_config_asks_for_serves_default():
    assert _replica_router({}) == LEAST_LOADED_ROUTER
    assert _replica_router({"request_router": "power_of_two"}).endswith("PowerOfTwoChoicesRequestRouter")
    with pytest.raises(ValueError, match="request_router"):
        AppArgs.model_validate({"request_router": "round_robin"})
