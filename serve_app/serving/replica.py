"""The replica: owns one engine, serves generate and stream, follows the controller's mode.

The replica is glue. It knows neither how speculation works (the engine does) nor when to
switch (the controller does): it reports the engine's load every ``report_interval_s`` and
applies every ``(version, num_steps)`` it hears of, from three paths, whichever comes first:
the long-poll on the controller (what guarantees delivery), the controller's direct
broadcast to ``apply_num_steps``, and the answer to each load report. It reads the current mode
before it takes any traffic.

An engine that can serve no more (``EngineDeadError``: the embedded engine's step thread ended)
takes the replica's process down with it, found by the next load report or request: the
ingress then sends the requests that had not streamed a token to another replica, as after any
replica death, and Serve starts a new one. A replica that answered errors instead would draw
the least-loaded router's traffic, finishing its requests fastest.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import NoReturn

import psutil
from ray import serve

from serve_app.control import ControllerOptions, PolicyConfig, ReplicaReport, get_or_create_controller
from serve_app.engines import make_engine
from serve_app.engines.base import (
    EngineDeadError,
    EngineOverloadedError,
    GenerateRequest,
    InvalidRequestError,
    Logprob,
    TokenDelta,
)
from serve_app.engines.config import EngineConfig
from serve_app.serving.config import Limits, StreamOptions
from serve_app.serving.metrics import replica_metrics
from serve_app.serving.streaming import StreamPacer, merge

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GenerateResult:
    """A whole generation, as the one-shot ``generate`` returns it."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    num_steps: int
    """The replica's mode when the request finished (it may have switched meanwhile)."""
    logprobs: list[Logprob] | None = None
    prompt_text: str | None = None
    prompt_logprobs: list[Logprob] | None = None


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=512, health_check_period_s=5)
class LLMReplica:
    """One engine behind Ray Serve."""

    async def __init__(
        self,
        engine: EngineConfig,
        policy: PolicyConfig,
        controller: ControllerOptions,
        limits: Limits | None = None,
        streaming: StreamOptions | None = None,
    ):
        ctx = serve.get_replica_context()
        self._limits = limits or Limits()
        self._pacer = StreamPacer(streaming)
        self._app, self._id = ctx.app_name, ctx.replica_id.unique_id
        self._options = controller
        self._metrics = replica_metrics(self._app, self._id)
        self._version, self._num_steps = -1, -1
        self._mode_lock = asyncio.Lock()
        self._switch_failures, self._last_switch_error = 0, None

        self._engine = make_engine(engine)
        self._configured_step_policy = self._step_policy = getattr(engine.options, "step_policy", "fixed")
        await self._engine.start()
        self._engine_ready_at = time.time()

        self._controller = get_or_create_controller(self._app, ctx.deployment, policy, controller)
        await self._controller.configure.remote(policy.model_dump(), controller.model_dump())
        await self.apply_num_steps(*await self._controller.get_num_steps.remote())
        self._mode_applied_at = time.time()
        logger.info(
            "replica %s ready in mode %d (version %d), %.0f ms after the engine",
            self._id,
            self._num_steps,
            self._version,
            1000 * (self._mode_applied_at - self._engine_ready_at),
        )
        self._tasks = [asyncio.create_task(self._long_poll()), asyncio.create_task(self._report_loop())]

    # -- mode -------------------------------------------------------------------------------

    async def apply_num_steps(self, version: int, num_steps: int, step_policy: str | None = None) -> int:
        """Run ``num_steps`` from the next decode step, if ``version`` is newer than ours, with
        the engines' ``step_policy`` (None: the engine's configured one). Returns the version
        now applied. Called by the controller's direct broadcast too."""
        step_policy = step_policy or self._configured_step_policy
        async with self._mode_lock:
            if version <= self._version:
                return self._version
            try:
                if step_policy != self._step_policy:
                    await self._engine.set_step_policy(step_policy)
                    self._step_policy = step_policy
                if num_steps != self._num_steps:
                    await self._engine.set_num_steps(num_steps)
            except Exception as e:  # keep serving in the last mode; the next broadcast or poll retries
                self._switch_failures += 1
                self._last_switch_error = f"{type(e).__name__}: {e}"
                self._metrics.observe_switch_failure()
                logger.warning("replica %s: switch to %d steps (%s) failed (%s)", self._id, num_steps, step_policy, e)
                raise
            self._version, self._num_steps = version, num_steps
        if hasattr(self, "_tasks"):  # after start-up; the first report tells the controller
            self._controller.ack.remote(self._id, version)
        return version

    async def _long_poll(self) -> None:
        timeout = self._options.long_poll_timeout_s
        while True:
            try:
                ref = self._controller.wait_for_mode.remote(self._version, timeout)
                await self.apply_num_steps(*await asyncio.wait_for(ref, timeout + 30))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # controller restarting: keep the last mode, retry
                logger.info("long-poll on the controller failed (%s); retrying", e)
                await asyncio.sleep(self._options.report_interval_s)

    async def _report_loop(self) -> None:
        interval = self._options.report_interval_s
        applying: asyncio.Task | None = None
        while True:
            await asyncio.sleep(interval)
            self.check_health()
            try:
                report = self.report()
                self._metrics.observe_load(
                    report.num_steps,
                    report.waiting,
                    report.running,
                    report.output_tokens_per_s,
                    report.accept_rate,
                    report.active_num_steps,
                    report.mean_num_steps,
                )
                answer = await asyncio.wait_for(self._controller.report.remote(report), 4 * interval)
                # A switch may wait up to the engine's RPC timeout: apply it beside the loop, one at
                # a time, so that the reports (which carry its failure) keep their pace and the
                # replica stays live for the controller meanwhile.
                if answer[0] > self._version and (applying is None or applying.done()):
                    applying = asyncio.create_task(self.apply_num_steps(*answer))
                    applying.add_done_callback(_ignore_failure)  # apply_num_steps counts and logs it
            except asyncio.CancelledError:
                if applying is not None:
                    applying.cancel()
                raise
            except Exception as e:
                logger.debug("load report failed: %s", e)

    def report(self) -> ReplicaReport:
        """The load report sent to the controller."""
        load = self._engine.load()
        return ReplicaReport(
            replica_id=self._id,
            time=time.time(),
            waiting=load.waiting,
            running=load.running,
            num_steps=self._num_steps,
            applied_version=self._version,
            output_tokens_per_s=load.output_tokens_per_s,
            accept_rate=load.accept_rate,
            active_num_steps=self._num_steps if load.active_num_steps is None else load.active_num_steps,
            mean_num_steps=load.mean_num_steps,
            step_choices=load.step_choices,
            step_policy=self._step_policy,
            switch_failures=self._switch_failures,
            last_switch_error=self._last_switch_error,
        )

    def info(self) -> dict:
        """Identity, mode and start-up timings of this replica."""
        import ray

        return {
            "replica_id": self._id,
            "node_id": ray.get_runtime_context().get_node_id(),
            "model": self._engine.model_name,
            "num_steps": self._num_steps,
            "step_policy": self._step_policy,
            "version": self._version,
            "engine_ready_at": self._engine_ready_at,
            "mode_applied_at": self._mode_applied_at,
            "load": asdict(self._engine.load()),
            "rss_bytes": psutil.Process().memory_info().rss,
        }

    def check_health(self) -> None:
        """Serve's health check (every ``health_check_period_s``), and the report loop's: an
        engine that can serve no more ends the replica's process (see the module)."""
        check = getattr(self._engine, "check_health", None)
        if check is not None:
            try:
                check()
            except EngineDeadError as e:
                _end_process(self._id, e)

    # -- requests -----------------------------------------------------------------------------

    async def stream(self, request: GenerateRequest, messages: list[dict] | None = None) -> AsyncIterator[TokenDelta]:
        """Stream a request's deltas. ``messages`` (chat) are rendered with the model's template.
        Raises InvalidRequestError / EngineOverloadedError before the first delta."""
        if messages is not None:
            request.prompt = self._engine.apply_chat_template(messages)
        self._admit(request, messages)
        start = time.perf_counter()
        first_at = last_at = None
        completion_tokens = 0
        try:
            deltas = self._pacer.pace(self._engine.generate(request))
        except EngineDeadError as e:
            _end_process(self._id, e)
        try:
            async for delta in deltas:
                last_at = time.perf_counter()
                if first_at is None and delta.token_ids:
                    first_at = last_at
                completion_tokens = delta.completion_tokens
                yield delta
        except EngineDeadError as e:
            _end_process(self._id, e)
        finally:
            aclose = getattr(deltas, "aclose", None)
            if aclose is not None:
                await aclose()
            ttft = None if first_at is None else first_at - start
            tpot = (last_at - first_at) / (completion_tokens - 1) if first_at and completion_tokens > 1 else None
            self._metrics.observe_request(self._num_steps, ttft, tpot, completion_tokens)

    def _admit(self, request: GenerateRequest, messages: list[dict] | None) -> None:
        """Enforce the queue bound and the prompt limit before the engine takes the request."""
        limits = self._limits
        waiting = self._engine.load().waiting
        if waiting >= limits.max_waiting_per_replica:
            raise EngineOverloadedError(f"the replica's queue is full ({waiting} waiting requests); retry later")
        if limits.max_prompt_tokens is None:
            return
        tokenize = getattr(self._engine, "tokenize", None)  # engines without one check their own context
        ids = request.prompt_token_ids
        n = len(ids) if ids is not None else len(tokenize(request.prompt)) if tokenize and request.prompt else 0
        if n > limits.max_prompt_tokens:
            param = "prompt" if messages is None else "messages"
            raise InvalidRequestError(f"the prompt has {n} tokens; the limit is {limits.max_prompt_tokens}", param)

    async def generate(self, request: GenerateRequest, messages: list[dict] | None = None) -> GenerateResult:
        """Run a request to completion."""
        deltas = [delta async for delta in self.stream(request, messages)]
        assert deltas, "the engine ended a request without a final delta"
        d = merge(deltas)
        return GenerateResult(d.text, d.token_ids, d.finish_reason, d.prompt_tokens, d.completion_tokens,
                              self._num_steps, d.logprobs, d.prompt_text, d.prompt_logprobs)

    async def __del__(self):
        for task in getattr(self, "_tasks", []):
            task.cancel()
        engine = getattr(self, "_engine", None)
        if engine is not None:
            await engine.shutdown()


def _end_process(replica_id: str, e: EngineDeadError) -> NoReturn:
    """End this replica's process at once (see the module): its calls in flight fail as after a
    replica death, which the ingress retries, and Serve replaces it."""
    logger.critical("replica %s: %s; ending the replica's process", replica_id, e)
    for handler in logging.getLogger().handlers + logger.handlers:
        handler.flush()
    os._exit(1)


def _ignore_failure(task: asyncio.Task) -> None:
    """Retrieve a background switch's exception, already counted and logged by apply_num_steps."""
    if not task.cancelled():
        task.exception()
