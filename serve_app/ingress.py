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
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app import openai_protocol as oai
from serve_app.config import ControllerOptions, PolicyConfig
from serve_app.controller import get_or_create_controller
from serve_app.engines.base import (
    EngineOverloadedError,
    GenerateRequest,
    InvalidRequestError,
    SamplingParams,
    TokenDelta,
)

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
    return None


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
    return APIError(e.status_code, str(e.detail), type_).response()


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
    ):
        ctx = serve.get_replica_context()
        self._replica = replica
        self._admin_token_env = admin_token_env
        self._model = served_model_name
        self._created = int(time.time())
        self._controller = get_or_create_controller(ctx.app_name, replica_deployment, policy, controller)

    async def _model_name(self) -> str:
        if self._model is None:
            self._model = (await self._replica.info.remote())["model"]
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
            first, rest = await self._start_stream(request, None)
            return self._sse_response(
                self._completion_events(request.request_id, model, body.include_usage, first, rest)
            )
        result = await self._call(self._replica.generate.remote(request))
        usage = oai.usage(result.prompt_tokens, result.completion_tokens)
        return oai.completion_response(request.request_id, model, result.text, result.finish_reason, usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: oai.ChatCompletionRequest):
        model = await self._check_model(body.model)
        request = GenerateRequest(oai.new_id("chatcmpl"), params=self._params(body))
        messages = body.message_dicts()
        if body.stream:
            first, rest = await self._start_stream(request, messages)
            return self._sse_response(self._chat_events(request.request_id, model, body.include_usage, first, rest))
        result = await self._call(self._replica.generate.remote(request, messages))
        usage = oai.usage(result.prompt_tokens, result.completion_tokens)
        return oai.chat_response(request.request_id, model, result.text, result.finish_reason, usage)

    @staticmethod
    def _params(body: oai.CompletionRequest | oai.ChatCompletionRequest) -> SamplingParams:
        try:
            return body.sampling_params()
        except (InvalidRequestError, oai.UnsupportedParameter) as e:
            raise _engine_error(e) from None

    @staticmethod
    async def _call(response):
        try:
            return await response
        except (InvalidRequestError, EngineOverloadedError) as e:
            raise _engine_error(e) from None

    async def _start_stream(self, request: GenerateRequest, messages) -> tuple[TokenDelta, AsyncIterator[TokenDelta]]:
        """Start a stream and wait for its first delta, so that errors still get a status code."""
        stream = self._replica.options(stream=True).stream.remote(request, messages)
        it = stream.__aiter__()
        try:
            first = await it.__anext__()
        except (InvalidRequestError, EngineOverloadedError) as e:
            raise _engine_error(e) from None
        return first, it

    @staticmethod
    def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

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
            logger.exception("stream %s failed", rid)
            yield _sse(oai.error_body(str(e), "server_error"))
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
            logger.exception("stream %s failed", rid)
            yield _sse(oai.error_body(str(e), "server_error"))
        if include_usage:
            yield _sse(chunk(None, usage=oai.usage(last.prompt_tokens, last.completion_tokens)))
        yield _sse("[DONE]")

    # -- operator API ---------------------------------------------------------------------------

    @app.get("/v1/speculation")
    async def get_speculation(self) -> dict:
        return await self._controller.status.remote()

    @app.put("/v1/speculation")
    async def put_speculation(self, body: oai.SpeculationUpdate, authorization: str | None = Header(default=None)):
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
        Raises InvalidRequestError / EngineOverloadedError.
        """
        request = self._handle_request(prompt, messages, prompt_token_ids, sampling)
        return asdict(await self._replica.generate.remote(request, messages))

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
        async for delta in self._replica.options(stream=True).stream.remote(request, messages):
            d = asdict(delta)
            d.pop("request_id")
            yield d

    @staticmethod
    def _handle_request(prompt, messages, prompt_token_ids, sampling) -> GenerateRequest:
        if sum(x is not None for x in (prompt, messages, prompt_token_ids)) != 1:
            raise InvalidRequestError("give exactly one of prompt, messages, prompt_token_ids", "prompt")
        try:
            params = SamplingParams(**sampling)
        except TypeError as e:
            raise InvalidRequestError(f"unknown sampling field: {e}", "sampling") from None
        params.validate()
        return GenerateRequest(oai.new_id("handle"), prompt, prompt_token_ids, params)
