"""The ingress: OpenAI-compatible HTTP, the operator API, and the Ray handle API.

HTTP routes (FastAPI): ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health``, ``GET|PUT /v1/speculation``. Every error is an OpenAI
error object. Handle API (``serve.get_app_handle(app)``): :meth:`OpenAIIngress.generate` and
:meth:`OpenAIIngress.generate_stream`.

Requests go to a replica through Serve's router (least ongoing requests of two random picks);
streams come back through the handle with ``stream=True``.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.control import ControllerOptions, PolicyConfig, get_or_create_controller
from serve_app.engines.base import (
    EngineOverloadedError,
    GenerateRequest,
    InvalidRequestError,
    SamplingParams,
    TokenDelta,
)
from serve_app.serving import openai_protocol as oai
from serve_app.serving.config import Limits

logger = logging.getLogger(__name__)

app = FastAPI(title="specserve", description="OpenAI-compatible LLM serving with load-adaptive speculative decoding")


class APIError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, type_: oai.ErrorType, param: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers

    def response(self) -> JSONResponse:
        code = {429: "rate_limit_exceeded", 404: "model_not_found"}.get(self.status)
        body = oai.error_body(self.message, self.type, self.param, code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _engine_error(e: Exception) -> APIError | None:
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


_REJECTED = (InvalidRequestError, EngineOverloadedError, BackPressureError)
# The replica died or became unreachable: the request may go to another one if no token was sent.
_REPLICA_LOST = (RayActorError,)


class ReplicasUnavailableError(RuntimeError):
    """Every replica a request was sent to failed before it produced anything."""


def _set_body_limit(limit: int) -> None:
    # A module function, so that it reaches this module's app: Serve pickles the ingress class
    # by value, and a global named in its methods would be a copy.
    app.state.max_request_bytes = limit


@app.middleware("http")
async def _limit_body_size(request: Request, call_next):
    limit = getattr(app.state, "max_request_bytes", None)
    if limit and request.method in ("POST", "PUT"):
        size = request.headers.get("content-length", "")  # Serve's proxy may stream without one
        size = int(size) if size.isdigit() else len(await request.body())
        if size > limit:
            msg = f"the request body has {size} bytes; the limit is {limit}"
            return APIError(413, msg, "invalid_request_error").response()
    return await call_next(request)


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return e.response()


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    err = e.errors()[0]
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
    return APIError(400, message, "invalid_request_error", param).response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    message = str(e.detail)
    if e.status_code == 400 and message == "There was an error parsing the body":  # FastAPI's words for bad UTF-8
        message = "the request body could not be parsed: it must be JSON encoded as UTF-8"
    return APIError(e.status_code, message, type_).response()


def _attempts_header(attempts: int) -> dict[str, str]:
    """How many replicas a request took (more than 1: a replica died and it was re-dispatched)."""
    return {"x-specserve-attempts": str(attempts)}


def _stream_error(rid: str, e: Exception, tokens: int) -> dict:
    lost = isinstance(e, _REPLICA_LOST)
    logger.warning("stream %s cut after %d tokens: %s", rid, tokens, type(e).__name__, exc_info=not lost)
    why = "the replica serving it failed" if lost else f"an internal error ({type(e).__name__})"
    return oai.error_body(f"the stream was cut after {tokens} tokens: {why}; the output is incomplete", "server_error")


class _TokenBucket:
    """``rate`` events a second on average, in bursts of up to ``burst``."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst, self.tokens, self.at = rate, burst, float(burst), time.monotonic()

    def take(self, now: float) -> float:
        """Take one token: 0 if granted, else the seconds until one is due."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=2048)
@serve.ingress(app)
class OpenAIIngress:
    """HTTP and handle entry point of a specserve application."""

    def __init__(
        self,
        replica: DeploymentHandle,
        replica_deployment: str,
        policy: PolicyConfig,
        controller: ControllerOptions,
        admin_token_env: str,
        served_model_name: str | None = None,
        limits: Limits | None = None,
    ):
        ctx = serve.get_replica_context()
        self._limits = limits or Limits()
        _set_body_limit(self._limits.max_request_bytes)
        self._put_bucket = _TokenBucket(self._limits.admin_puts_per_s, self._limits.admin_burst)
        self._replica = replica
        self._admin_token_env = admin_token_env
        self._model = served_model_name
        self._created = int(time.time())
        self._controller = get_or_create_controller(ctx.app_name, replica_deployment, policy, controller)

    async def _model_name(self) -> str:
        if self._model is None:
            try:
                self._model = (await self._replica.info.remote())["model"]
            except BackPressureError as e:
                raise _engine_error(e) from None
        return self._model

    async def _check_model(self, requested: str | None) -> str:
        served = await self._model_name()
        if requested and requested != served:
            raise APIError(
                404,
                f"the model '{requested}' does not exist; this server serves '{served}'",
                "not_found_error",
                "model",
            )
        return served

    # -- OpenAI routes --------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self) -> dict:
        return oai.model_list(await self._model_name(), self._created)

    @app.post("/v1/completions")
    async def completions(self, body: oai.CompletionRequest):
        model = await self._check_model(body.model)
        prompt, token_ids = body.prompt_text_or_ids()
        request = GenerateRequest(oai.new_id("cmpl"), prompt, token_ids, self._params(body))
        if body.stream:
            first, rest, attempts = await self._start_stream(request, None)
            events = self._completion_events(request.request_id, model, body.include_usage, first, rest)
            return self._sse_response(events, attempts)
        result, attempts = await self._call(request, None)
        usage = oai.usage(result.prompt_tokens, result.completion_tokens)
        out = oai.completion_response(request.request_id, model, result.text, result.finish_reason, usage)
        return JSONResponse(out, headers=_attempts_header(attempts))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: oai.ChatCompletionRequest):
        model = await self._check_model(body.model)
        request = GenerateRequest(oai.new_id("chatcmpl"), params=self._params(body))
        messages = body.message_dicts()
        if body.stream:
            first, rest, attempts = await self._start_stream(request, messages)
            events = self._chat_events(request.request_id, model, body.include_usage, first, rest)
            return self._sse_response(events, attempts)
        result, attempts = await self._call(request, messages)
        usage = oai.usage(result.prompt_tokens, result.completion_tokens)
        out = oai.chat_response(request.request_id, model, result.text, result.finish_reason, usage)
        return JSONResponse(out, headers=_attempts_header(attempts))

    def _params(self, body: oai.CompletionRequest | oai.ChatCompletionRequest) -> SamplingParams:
        try:
            params = body.sampling_params()
        except (InvalidRequestError, oai.UnsupportedParameter) as e:
            raise _engine_error(e) from None
        cap = self._limits.max_tokens
        if params.max_tokens > cap:
            explicit = body.max_tokens is not None or getattr(body, "max_completion_tokens", None) is not None
            if explicit:
                raise APIError(
                    400, f"max_tokens is {params.max_tokens}; the limit is {cap}", "invalid_request_error", "max_tokens"
                )
            params.max_tokens = cap  # the default, cut to the cap
        return params

    async def _retrying(self, start, request: GenerateRequest):
        """``await start()``, again on another replica if the one it went to died (nothing was
        sent to the caller yet). Returns (result, attempts); engine errors pass through."""
        for attempt in range(1, self._limits.retries + 2):
            try:
                return await start(), attempt
            except _REPLICA_LOST as e:
                logger.warning(
                    "request %s: replica lost (%s), attempt %d", request.request_id, type(e).__name__, attempt
                )
        raise ReplicasUnavailableError(
            f"request {request.request_id}: the replicas serving it failed {self._limits.retries + 1} times; retry later"
        )

    async def _with_retries(self, start, request: GenerateRequest):
        """:meth:`_retrying` with its failures as HTTP errors."""
        try:
            return await self._retrying(start, request)
        except _REJECTED as e:
            raise _engine_error(e) from None
        except ReplicasUnavailableError:
            raise APIError(
                503,
                "the replicas serving this request failed; retry later",
                "server_error",
                headers={"Retry-After": "1"},
            ) from None

    async def _call(self, request: GenerateRequest, messages) -> tuple[Any, int]:
        return await self._with_retries(lambda: self._replica.generate.remote(request, messages), request)

    async def _start_stream(
        self, request: GenerateRequest, messages
    ) -> tuple[TokenDelta, AsyncIterator[TokenDelta], int]:
        """Start a stream and wait for its first delta, so that errors still get a status code
        and a replica lost before it sent anything is replaced invisibly."""

        (first, it), attempts = await self._with_retries(self._stream_starter(request, messages), request)
        return first, it, attempts

    def _stream_starter(self, request: GenerateRequest, messages):
        """A function that opens the request's stream on a replica and waits for its first delta."""

        async def start():
            it = self._replica.options(stream=True).stream.remote(request, messages).__aiter__()
            return await it.__anext__(), it

        return start

    @staticmethod
    def _sse_response(events: AsyncIterator[str], attempts: int = 1) -> StreamingResponse:
        headers = {"Cache-Control": "no-cache", **_attempts_header(attempts)}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    @staticmethod
    async def _deltas(first: TokenDelta, rest: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta]:
        yield first
        async for delta in rest:
            yield delta

    async def _chat_events(self, rid, model, include_usage, first, rest) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(delta, finish=None, usage=None) -> dict:
            c = oai.chat_chunk(rid, model, created, delta, finish, usage)
            if not include_usage:
                c.pop("usage")
            return c

        yield _sse(chunk({"role": "assistant", "content": ""}))
        last = first
        try:
            async for delta in self._deltas(first, rest):
                last = delta
                if delta.text or delta.finish_reason:
                    yield _sse(chunk({"content": delta.text} if delta.text else {}, delta.finish_reason))
        except Exception as e:  # the status line is gone: report in-band, as OpenAI does
            yield _sse(_stream_error(rid, e, last.completion_tokens))
        if include_usage:
            yield _sse(chunk(None, usage=oai.usage(last.prompt_tokens, last.completion_tokens)))
        yield _sse("[DONE]")

    async def _completion_events(self, rid, model, include_usage, first, rest) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(text, finish=None, usage=None) -> dict:
            c = oai.completion_chunk(rid, model, created, text, finish, usage)
            if not include_usage:
                c.pop("usage")
            return c

        last = first
        try:
            async for delta in self._deltas(first, rest):
                last = delta
                if delta.text or delta.finish_reason:
                    yield _sse(chunk(delta.text, delta.finish_reason))
        except Exception as e:
            yield _sse(_stream_error(rid, e, last.completion_tokens))
        if include_usage:
            yield _sse(chunk(None, usage=oai.usage(last.prompt_tokens, last.completion_tokens)))
        yield _sse("[DONE]")

    # -- operator API ---------------------------------------------------------------------------

    @app.get("/v1/speculation")
    async def get_speculation(self) -> dict:
        return await self._controller.status.remote()

    @app.put("/v1/speculation")
    async def put_speculation(self, body: oai.SpeculationUpdate, authorization: str | None = Header(default=None)):
        wait_s = self._put_bucket.take(time.monotonic())
        if wait_s > 0:  # before the token check, so that guessing is throttled too
            raise APIError(
                429,
                "too many operator requests; retry later",
                "rate_limit_error",
                headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
            )
        self._authorize(authorization)
        out = await self._controller.update.remote(body.mode, body.num_steps, body.policy)
        if "error" in out:
            raise APIError(400, out["error"], "invalid_request_error", out.get("param"))
        return out

    def _authorize(self, authorization: str | None) -> None:
        expected = os.environ.get(self._admin_token_env)
        if not expected:
            raise APIError(
                403,
                f"the operator API is disabled: set the environment variable {self._admin_token_env} "
                "to a secret token where the Ray cluster runs, then send 'Authorization: Bearer <token>'",
                "permission_error",
            )
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "missing bearer token", "authentication_error", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), expected.encode()):
            raise APIError(403, "invalid bearer token", "permission_error")

    # -- Ray handle API -------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
        **sampling: Any,
    ) -> dict:
        """One-shot generation through a handle: ``await handle.generate.remote("Hello", max_tokens=32)``.

        Give ``prompt`` (text), ``prompt_token_ids`` or chat ``messages``; ``sampling`` takes the
        fields of :class:`SamplingParams` (max_tokens, temperature, top_p, stop, seed, ignore_eos).
        Returns ``{"text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "num_steps"}``.
        Raises InvalidRequestError / EngineOverloadedError; a replica lost on the way is replaced
        (``Limits.retries`` times), after which ReplicasUnavailableError.
        """
        request = self._handle_request(prompt, messages, prompt_token_ids, sampling)
        result, _ = await self._retrying(lambda: self._replica.generate.remote(request, messages), request)
        return asdict(result)

    async def generate_stream(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
        **sampling: Any,
    ) -> AsyncIterator[dict]:
        """Streaming generation through a handle:
        ``async for d in handle.options(stream=True).generate_stream.remote("Hello")``.
        Yields ``{"text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens"}`` per step."""
        request = self._handle_request(prompt, messages, prompt_token_ids, sampling)
        # a replica lost before the first delta is replaced; after it, the stream raises as Ray reports it
        (first, rest), _ = await self._retrying(self._stream_starter(request, messages), request)
        async for delta in self._deltas(first, rest):
            d = asdict(delta)
            d.pop("request_id")
            yield d

    def _handle_request(self, prompt, messages, prompt_token_ids, sampling) -> GenerateRequest:
        if sum(x is not None for x in (prompt, messages, prompt_token_ids)) != 1:
            raise InvalidRequestError("give exactly one of prompt, messages, prompt_token_ids", "prompt")
        try:
            params = SamplingParams(**sampling)
        except TypeError as e:
            raise InvalidRequestError(f"unknown sampling field: {e}", "sampling") from None
        params.validate()
        if params.max_tokens > self._limits.max_tokens:
            raise InvalidRequestError(
                f"max_tokens is {params.max_tokens}; the limit is {self._limits.max_tokens}", "max_tokens"
            )
        return GenerateRequest(oai.new_id("handle"), prompt, prompt_token_ids, params)
