"""Which failures send a request to another replica: the ingress's ``replica_lost``."""

import asyncio

import grpc
import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from serve_app.engines.base import EngineDeadError
from serve_app.serving.errors import replica_lost, stream_error


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="from the replica's side")


def test_a_call_the_replicas_side_cut_off_counts_as_a_lost_replica():
    assert replica_lost(ActorUnavailableError("unreachable", None))
    assert replica_lost(ActorDiedError())
    # A replica past its graceful shutdown stops its gRPC server, which cancels the calls still
    # running; Ray passes that CANCELLED through as it is.
    assert replica_lost(rpc_error(grpc.StatusCode.CANCELLED))
    assert replica_lost(rpc_error(grpc.StatusCode.UNAVAILABLE))
    # An engine that can serve no more ends its replica's process; its error, should it reach the
    # ingress first, sends the request elsewhere too.
    assert replica_lost(EngineDeadError("the engine's step thread ended"))


def test_other_failures_are_not_retried():
    assert not replica_lost(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED))  # a message over the limit: no retry helps
    assert not replica_lost(rpc_error(grpc.StatusCode.INTERNAL))
    assert not replica_lost(asyncio.CancelledError())  # the caller went away
    assert not replica_lost(RuntimeError("a bug"))


def test_a_stream_cut_by_a_cancelled_call_says_the_replica_failed():
    event = stream_error("cmpl-1", rpc_error(grpc.StatusCode.CANCELLED), tokens=7)
    assert "cut after 7 tokens: the replica serving it failed" in event["error"]["message"]
    event = stream_error("cmpl-2", rpc_error(grpc.StatusCode.INTERNAL), tokens=7)
    assert "an internal error (AioRpcError)" in event["error"]["message"]


def test_a_call_whose_replica_is_lost_is_sent_again_and_other_errors_pass_through():
    from serve_app.serving.errors import ReplicasUnavailableError, retrying

    def calls(*outcomes):
        """A start function that raises or returns each outcome in turn, and the attempts it saw."""
        seen = []

        async def start():
            seen.append(len(seen) + 1)
            out = outcomes[len(seen) - 1]
            if isinstance(out, BaseException):
                raise out
            return out

        return start, seen

    # e.g. the model-name lookup of a new ingress that reached an old replica as a rolling update stopped it
    start, seen = calls(ActorDiedError(), rpc_error(grpc.StatusCode.CANCELLED), "model")
    assert asyncio.run(retrying(start, 2, "the model name")) == ("model", 3)
    start, seen = calls(RuntimeError("a bug"), "never")
    with pytest.raises(RuntimeError, match="a bug"):
        asyncio.run(retrying(start, 2, "request r"))
    assert seen == [1]
    start, seen = calls(*[ActorDiedError()] * 3)
    with pytest.raises(ReplicasUnavailableError, match="request r: the replicas serving it failed 3 times"):
        asyncio.run(retrying(start, 2, "request r"))
    assert seen == [1, 2, 3]


def test_an_unexpected_failure_is_a_500_error_object_naming_it():
    import httpx
    from fastapi import FastAPI

    from serve_app.serving import errors

    app = FastAPI()
    errors.install(app)

    @app.get("/boom")
    async def boom():
        raise KeyError("model")

    async def get():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.get("/boom")

    r = asyncio.run(get())
    assert r.status_code == 500
    assert r.json()["error"] == {
        "message": "an internal error (KeyError); the request may be retried",
        "type": "server_error",
        "param": None,
        "code": None,
    }
