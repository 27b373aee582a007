"""How the ingress answers errors: every one as an OpenAI error object with its status code,
the engine's and Ray's errors mapped to 4xx/5xx, and the request body limit."""

from __future__ import annotations

import logging
import math

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.engines.base import EngineDeadError, EngineOverloadedError, InvalidRequestError
from serve_app.serving import openai_protocol as oai

logger = logging.getLogger(__name__)

REJECTED = (InvalidRequestError, EngineOverloadedError, BackPressureError)
"""Errors that answer a request (4xx/503) instead of sending it to another replica."""
LOST_CALL_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
"""gRPC codes of a call the replica's side ended: its server stopped (a replica past its
graceful shutdown, which cancels the calls still running) or the connection broke. Ray maps
UNAVAILABLE to ActorUnavailableError itself, but lets CANCELLED through; a cancellation on
this side raises asyncio.CancelledError, never these."""


def replica_lost(e: BaseException) -> bool:
    """The replica died, became unreachable or cut the call off, or its engine can serve no
    more: the request may go to another one if no token was sent."""
    return isinstance(e, RayActorError | EngineDeadError) or (
        isinstance(e, grpc.aio.AioRpcError) and e.code() in LOST_CALL_CODES
    )


class APIError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, type_: oai.ErrorType, param: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers

    def response(self) -> JSONResponse:
        code = {429: "rate_limit_exceeded", 404: "model_not_found"}.get(self.status)
        body = oai.error_body(self.message, self.type, self.param, code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class ReplicasUnavailableError(RuntimeError):
    """Every replica a request was sent to failed before it produced anything."""


async def retrying(start, retries: int, what: str):
    """``await start()``, again (up to ``retries`` more times) while the replica it went to is
    lost (:func:`replica_lost`); other errors pass through. Returns (result, attempts); raises
    ReplicasUnavailableError when every attempt lost its replica. ``what`` names the call in logs."""
    for attempt in range(1, retries + 2):
        try:
            return await start(), attempt
        except Exception as e:
            if not replica_lost(e):
                raise
            logger.warning("%s: replica lost (%s), attempt %d", what, type(e).__name__, attempt)
    raise ReplicasUnavailableError(f"{what}: the replicas serving it failed {retries + 1} times; retry later")


def engine_error(e: Exception) -> APIError | None:
    """The APIError for an engine error (as raised locally or re-raised by Ray), else None."""
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(getattr(e, "message", e)), "invalid_request_error", getattr(e, "param", None))
    if isinstance(e, EngineOverloadedError):
        retry = max(1, math.ceil(getattr(e, "retry_after_s", 1.0)))
        msg = str(getattr(e, "message", e))
        return APIError(429, msg, "rate_limit_error", headers={"Retry-After": str(retry)})
    if isinstance(e, oai.UnsupportedParameter):
        return APIError(400, str(e), "invalid_request_error", e.param)
    if isinstance(e, BackPressureError):
        return APIError(
            503,
            "every replica is busy and the queue is full; retry later",
            "server_error",
            headers={"Retry-After": "1"},
        )
    return None


def replicas_unavailable() -> APIError:
    return APIError(503, "the replicas serving this request failed; retry later", "server_error", headers={"Retry-After": "1"})


def stream_error(rid: str, e: Exception, tokens: int) -> dict:
    """The in-band error event of a stream cut after ``tokens`` tokens (the status line is gone)."""
    lost = replica_lost(e)
    logger.warning("stream %s cut after %d tokens: %s", rid, tokens, type(e).__name__, exc_info=not lost)
    why = "the replica serving it failed" if lost else f"an internal error ({type(e).__name__})"
    return oai.error_body(f"the stream was cut after {tokens} tokens: {why}; the output is incomplete", "server_error")


_body_limit: int | None = None


def set_body_limit(limit: int) -> None:
    """Refuse request bodies over ``limit`` bytes with a 413. A module global read by a module
    function: Serve pickles the ingress class and its FastAPI app by value, and a function
    defined here travels by reference, so the ingress and its middleware see the same value."""
    global _body_limit
    _body_limit = limit


async def limit_body_size(request: Request, call_next):
    limit = _body_limit
    if limit and request.method in ("POST", "PUT"):
        size = request.headers.get("content-length", "")  # Serve's proxy may stream without one
        size = int(size) if size.isdigit() else len(await request.body())
        if size > limit:
            msg = f"the request body has {size} bytes; the limit is {limit}"
            return APIError(413, msg, "invalid_request_error").response()
    return await call_next(request)


async def api_error(_: Request, e: APIError) -> JSONResponse:
    return e.response()


async def unexpected_error(_: Request, e: Exception) -> JSONResponse:
    """A failure nothing above answers, as a 500 error object naming it (Starlette logs it)."""
    message = f"an internal error ({type(e).__name__}); the request may be retried"
    return APIError(500, message, "server_error").response()


async def request_validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    return validation_error(e.errors()[0]).response()


async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    message = str(e.detail)
    if e.status_code == 400 and message == "There was an error parsing the body":  # FastAPI's words for bad UTF-8
        message = "the request body could not be parsed: it must be JSON encoded as UTF-8"
    return APIError(e.status_code, message, type_).response()


def install(app: FastAPI) -> None:
    """Answer every error of ``app`` as an OpenAI error object (an unexpected one as a 500
    naming its type), and refuse bodies over the limit (:func:`set_body_limit`) before they are parsed."""
    app.middleware("http")(limit_body_size)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, request_validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected_error)


def validation_error(err: dict) -> APIError:
    """The 400 for the first of a request model's validation errors, naming its parameter."""
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        message = f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}"
        param = None
    elif not loc:
        is_value_error = err.get("type") == "value_error"
        message = (
            err["msg"].removeprefix("Value error, ") if is_value_error else "the request body must be a JSON object"
        )
    else:
        message = f"{param}: {err['msg'].removeprefix('Value error, ')}"
    return APIError(400, message, "invalid_request_error", param)
