"""The ingress: OpenAI-compatible HTTP, the operator API, and the Ray handle API.

HTTP routes (FastAPI): ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health``, ``GET|PUT /v1/speculation``. Every error is an OpenAI
error object (:mod:`.errors`); streams are server-sent events (:mod:`.sse`); the operator
API's guards are in :mod:`.admin`. Handle API (``serve.get_app_handle(app)``):
:meth:`OpenAIIngress.generate` and :meth:`OpenAIIngress.generate_stream`.

Requests go to a replica through Serve's router (least ongoing requests of two random picks),
over Serve's gRPC data plane unless ``replica_transport`` is ``ray``; streams come back through
the handle with ``stream=True``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from typing import Any

from fastapi import FastAPI, Header
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.control import ControllerOptions, PolicyConfig, get_or_create_controller
from serve_app.engines.base import GenerateRequest, InvalidRequestError, SamplingParams, TokenDelta
from serve_app.serving import admin, errors, sse
from serve_app.serving import openai_protocol as oai
from serve_app.serving.config import Limits
from serve_app.serving.errors import REJECTED, APIError, ReplicasUnavailableError, engine_error

logger = logging.getLogger(__name__)

app = FastAPI(title="specserve", description="OpenAI-compatible LLM serving with load-adaptive speculative decoding")
errors.install(app)


def _attempts_header(attempts: int) -> dict[str, str]:
    """How many replicas a request took (more than 1: a replica died and it was re-dispatched)."""
    return {"x-specserve-attempts": str(attempts)}


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
        replica_transport: str = "grpc",
    ):
        ctx = serve.get_replica_context()
        self._limits = limits or Limits()
        errors.set_body_limit(self._limits.max_request_bytes)
        self._put_bucket = admin.TokenBucket(self._limits.admin_puts_per_s, self._limits.admin_burst)
        # Serve's gRPC data plane (what RAY_SERVE_USE_GRPC_BY_DEFAULT=1 selects for every handle)
        # costs the ingress about a third less CPU a streamed chunk than Ray actor calls.
        self._replica = replica.options(_by_reference=replica_transport != "grpc")
        self._admin_token_env = admin_token_env
        self._model = served_model_name
        self._created = int(time.time())
        self._controller = get_or_create_controller(ctx.app_name, replica_deployment, policy, controller)

    async def _model_name(self) -> str:
        if self._model is None:  # asked of a replica, which may be stopping (a rolling update)
            info, _ = await self._with_retries(self._replica.info.remote, "the model name")
            self._model = info["model"]
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
        params, rid = self._params(body), oai.new_id("cmpl")
        prompts = body.prompts()
        requests = self._choices(rid, params, prompts, body.choices_per_prompt)
        wanted = params.logprobs is not None

        def respond(results, usage):
            choices = [oai.completion_choice(r, oai.CompletionLogprobs(wanted)) for r in results]
            outputs = [(text, r.finish_reason) for (text, _), r in zip(choices, results, strict=True)]
            return oai.completion_response(rid, model, outputs, usage, logprobs=[lp for _, lp in choices])

        events = functools.partial(sse.completion_events, logprobs=wanted)
        return await self._answer(body, model, rid, requests, None, events, respond)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: oai.ChatCompletionRequest):
        model = await self._check_model(body.model)
        params, rid = self._params(body), oai.new_id("chatcmpl")
        requests = self._choices(rid, params, [(None, None)], body.choices_per_prompt)
        wanted = params.logprobs is not None

        def respond(results, usage):
            logprobs = [oai.chat_logprobs(r.logprobs or []) if wanted else None for r in results]
            return oai.chat_response(rid, model, [(r.text, r.finish_reason) for r in results], usage, logprobs)

        events = functools.partial(sse.chat_events, logprobs=wanted)
        return await self._answer(body, model, rid, requests, body.message_dicts(), events, respond)

    @staticmethod
    def _choices(rid: str, params: SamplingParams, prompts, n: int) -> list[GenerateRequest]:
        """One engine request per choice: ``n`` per prompt, in order. Choice j of a prompt samples
        with ``seed + j`` (a seeded request stays reproducible, its choices differ)."""
        try:
            oai.check_choices(len(prompts), n)
        except oai.UnsupportedParameter as e:
            raise engine_error(e) from None
        if len(prompts) * n == 1:
            return [GenerateRequest(rid, prompts[0][0], prompts[0][1], params)]
        out = []
        for i, (text, ids) in enumerate(prompts):
            for j in range(n):
                seed = None if params.seed is None else (params.seed + j if params.seed + j < 2**64 else params.seed - j)
                out.append(GenerateRequest(f"{rid}-{i * n + j}", text, ids, replace(params, seed=seed)))
        return out

    async def _answer(self, body, model: str, rid: str, requests: list[GenerateRequest], messages, events, respond):
        """Run the requests of a response's choices on replicas and answer: as one stream of
        ``events`` or as one object, ``respond(results, usage)``, with the most replicas one took
        in a header."""
        n = body.choices_per_prompt
        start = self._start_stream if body.stream else self._call
        calls = [lambda opened, r=r: start(r, messages, opened) for r in requests]
        if body.stream:
            started = await self._all_or_none(calls)
            streams = [(first, rest) for first, rest, _ in started]
            stream = events(rid, model, body.include_usage, streams, n)
            return self._sse_response(stream, max(a for _, _, a in started))
        answered = await self._all_or_none(calls)
        results = [result for result, _ in answered]
        prompt_tokens = sum(r.prompt_tokens for i, r in enumerate(results) if i % n == 0)  # n choices share a prompt
        usage = oai.usage(prompt_tokens, sum(r.completion_tokens for r in results))
        out = respond(results, usage)
        return JSONResponse(out, headers=_attempts_header(max(a for _, a in answered)))

    def _params(self, body: oai.CompletionRequest | oai.ChatCompletionRequest) -> SamplingParams:
        try:
            params = body.sampling_params()
        except (InvalidRequestError, oai.UnsupportedParameter) as e:
            raise engine_error(e) from None
        cap = self._limits.max_tokens
        if params.max_tokens > cap:
            explicit = body.max_tokens is not None or getattr(body, "max_completion_tokens", None) is not None
            if explicit:
                raise APIError(
                    400, f"max_tokens is {params.max_tokens}; the limit is {cap}", "invalid_request_error", "max_tokens"
                )
            params.max_tokens = cap  # the default, cut to the cap
            try:
                params.validate()  # min_tokens against the cut max_tokens
            except InvalidRequestError as e:
                raise engine_error(e) from None
        return params

    async def _retrying(self, start, request: GenerateRequest | str):
        """``await start()``, again on another replica if the one it went to died (nothing was
        sent to the caller yet). Returns (result, attempts); engine errors pass through."""
        what = request if isinstance(request, str) else f"request {request.request_id}"
        return await errors.retrying(start, self._limits.retries, what)

    async def _with_retries(self, start, request: GenerateRequest | str):
        """:meth:`_retrying` with its failures as HTTP errors."""
        try:
            return await self._retrying(start, request)
        except REJECTED as e:
            raise engine_error(e) from None
        except ReplicasUnavailableError:
            raise errors.replicas_unavailable() from None

    async def _call(self, request: GenerateRequest, messages, opened: list | None = None) -> tuple[Any, int]:
        def start():
            response = self._replica.generate.remote(request, messages)
            if opened is not None:
                opened.append(response)
            return response

        return await self._with_retries(start, request)

    async def _start_stream(
        self, request: GenerateRequest, messages, opened: list | None = None
    ) -> tuple[TokenDelta, AsyncIterator[TokenDelta], int]:
        """Start a stream and wait for its first delta, so that errors still get a status code
        and a replica lost before it sent anything is replaced invisibly."""

        (first, it), attempts = await self._with_retries(self._stream_starter(request, messages, opened), request)
        return first, it, attempts

    def _stream_starter(self, request: GenerateRequest, messages, opened: list | None = None):
        """A function that opens the request's stream on a replica and waits for its first delta
        (each stream opened is added to ``opened``, so that a caller can cancel it)."""

        async def start():
            stream = self._replica.options(stream=True).stream.remote(request, messages)
            if opened is not None:
                opened.append(stream)
            it = stream.__aiter__()
            return await it.__anext__(), it

        return start

    @staticmethod
    async def _all_or_none(calls) -> list:
        """Await ``calls`` (coroutines, each given a list to add the Ray requests it opens to):
        their results in order, or, at the first failure, every request cancelled and that
        failure raised, without waiting for the others."""
        opened: list = []
        # One choice is awaited here: awaited in a task, a BackPressureError reached the client as
        # Serve's own plain 503, not as the error object (tests/test_reliability_operator.py).
        if len(calls) == 1:
            return [await calls[0](opened)]
        tasks = [asyncio.ensure_future(call(opened)) for call in calls]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((task for task in tasks if task in done and task.exception() is not None), None)
        if failed is None:
            return [task.result() for task in tasks]
        for task in pending:
            task.cancel()
        for response in opened:  # cancelling a waiting task does not cancel its Ray request
            response.cancel()
        raise failed.exception()

    @staticmethod
    def _sse_response(events: AsyncIterator[str], attempts: int = 1) -> StreamingResponse:
        headers = {"Cache-Control": "no-cache", **_attempts_header(attempts)}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    # -- operator API ---------------------------------------------------------------------------

    @app.get("/v1/speculation")
    async def get_speculation(self) -> dict:
        return await self._controller.status.remote()

    @app.put("/v1/speculation")
    async def put_speculation(self, body: oai.SpeculationUpdate, authorization: str | None = Header(default=None)):
        admin.throttle(self._put_bucket)  # before the token check, so that guessing is throttled too
        admin.authorize(self._admin_token_env, authorization)
        out = await self._controller.update.remote(body.mode, body.num_steps, body.policy)
        if "error" in out:
            raise APIError(400, out["error"], "invalid_request_error", out.get("param"))
        return out

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
        fields of :class:`SamplingParams` (max_tokens, temperature, top_p, stop, seed, ignore_eos,
        stop_token_ids, min_tokens, the penalties, logit_bias, logprobs, prompt_logprobs, echo).
        Returns ``{"text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "num_steps",
        "logprobs", "prompt_text", "prompt_logprobs"}`` (the last three None unless asked for).
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
        async for delta in sse.chain(first, rest):
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
