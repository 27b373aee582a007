"""Which failures send a request to another replica: the ingress's ``replica_lost``."""

import asyncio

import grpc
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
