"""The engine protocol on an in-process ``sglang.Engine`` (TP-8, EAGLE-3, adaptive steps).

sglang is imported in :meth:`SGLangEngine.start` only: it needs CUDA and is not installed on
CPU machines. The replica holds all the engine's GPUs; SGLang spawns one scheduler process
per TP rank inside it. The speculation depth is switched by the specserve plugin
(:mod:`serve_app.engines.sglang.plugin`) through ``Engine.collective_rpc``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from importlib.metadata import entry_points
from typing import Any

from serve_app.engines.base import (
    EngineDeadError,
    EngineError,
    EngineLoad,
    GenerateRequest,
    InvalidRequestError,
    SamplingParams,
    TokenDelta,
)
from serve_app.engines.sglang import compat, plugin
from serve_app.engines.sglang.config import SGLangOptions, build_server_args
from serve_app.engines.sglang.policy import read_states

logger = logging.getLogger(__name__)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
SKIP_ZERO_STEP_DRAFT_EXTEND = "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND"


class SwitchTimeoutError(EngineError):
    """SGLang's schedulers did not answer a switch within ``rpc_timeout_s``; the engine keeps
    running its last step count."""


class SGLangEngine:
    """:class:`serve_app.engines.base.Engine` backed by SGLang."""

    def __init__(self, opts: SGLangOptions):
        self.opts = opts
        self.model_name = opts.model_path  # what SGLang's own server names it by default
        self.release: compat.Release | None = None
        self._engine: Any = None
        self._num_steps = opts.start_steps
        self._adaptive = opts.step_policy == "adaptive"
        self._rpc_lock = asyncio.Lock()
        # collective_rpc has no timeout: a call that timed out may still be blocked in its ZMQ
        # receive. It owns the socket until it returns, so no second call may start before.
        self._rpc_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specserve-rpc")
        self._rpc_pending: concurrent.futures.Future | None = None
        self._state_dir: str | None = None
        self._closing = False
        self._processes: list[multiprocessing.process.BaseProcess] = []  # SGLang's schedulers and detokenizer

    async def start(self) -> None:
        check_plugin_installed()
        self.release = compat.installed()  # before any weights load: a clear error names the range
        kwargs = build_server_args(self.opts)
        self._state_dir = tempfile.mkdtemp(
            prefix="specserve-sglang-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        )
        # Inherited by the scheduler processes SGLang spawns.
        os.environ[plugin.ENABLE_ENV] = "1"
        os.environ[plugin.STATE_DIR_ENV] = self._state_dir
        os.environ[plugin.STEP_POLICY_ENV] = self.opts.step_policy
        if self.opts.draft_context_overwrite:
            os.environ["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
        if not self.opts.zero_step_draft_extend:
            os.environ[SKIP_ZERO_STEP_DRAFT_EXTEND] = "1"
        import sglang  # noqa: PLC0415 - needs CUDA; only on GPU machines

        # Loads weights and captures CUDA graphs for every candidate step count: minutes.
        before = {p.pid for p in multiprocessing.active_children()}
        self._engine = await asyncio.to_thread(sglang.Engine, **kwargs)
        # The processes SGLang started for this engine (multiprocessing keeps every child it
        # starts, from any thread): the schedulers, one a TP rank, and the detokenizer.
        self._processes = [p for p in multiprocessing.active_children() if p.pid not in before]
        try:
            check_adaptive_active(self._engine.server_args, self.release)
            await self.set_num_steps(self._num_steps)  # also proves the plugin runs in the schedulers
        except Exception:
            await asyncio.to_thread(self._engine.shutdown)
            self._engine = None
            raise

    def check_health(self) -> None:
        """Raise EngineDeadError once a process of SGLang's (a scheduler, the detokenizer) has
        ended with a failure while the engine runs: its requests would otherwise wait for
        output that never comes. The replica then ends its own process (the ingress re-sends
        what it can, Serve starts a replacement). SGLang 0.5.17's own subprocess watchdog
        polls once a second and sends this process a SIGQUIT, whose default action ends it too."""
        if self._engine is None or self._closing:
            return
        if failed := failed_processes(self._processes):
            raise EngineDeadError("SGLang's " + "; ".join(failed) + ": the engine can serve no more")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The prompt of chat ``messages``, rendered with the model's own template by the
        tokenizer SGLang loaded (its tokenizer manager's)."""
        return self._tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def tokenize(self, text: str) -> list[int]:
        """Token ids as SGLang counts them (the replica's prompt limit uses it)."""
        return self._tokenizer()(text, add_special_tokens=False)["input_ids"]

    def _tokenizer(self) -> Any:
        tokenizer = getattr(getattr(self._engine, "tokenizer_manager", None), "tokenizer", None)
        if tokenizer is None:
            raise EngineError("the SGLang engine is not running, or runs without a tokenizer")
        return tokenizer

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        request.params.validate()  # InvalidRequestError here, before any streaming
        if request.prompt_token_ids is None and not request.prompt:
            raise InvalidRequestError("a prompt or prompt_token_ids is required", "prompt")
        if request.params.seed is not None and request.params.temperature != 0 and not self.opts.deterministic:
            raise InvalidRequestError(
                "seed is not honoured by this SGLang engine: SGLang samples with a per-request seed only "
                "with deterministic inference on (engine.sglang.extra_server_args.enable_deterministic_inference)",
                "seed",
            )
        if request.params.spec_max_steps is not None:
            raise InvalidRequestError(
                "speculation.max_steps is not served with the SGLang engine: SGLang verifies every request of a "
                "batch with the same draft length", "speculation.max_steps")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(request.params, name) is not None:
                raise InvalidRequestError(
                    f"{name} are not served with the SGLang engine: specserve does not map SGLang's logprob "
                    "output (the embedded engine serves them)", name)
        if self._engine is None or self._closing:
            raise EngineError("the SGLang engine is not running")
        return self._stream(request)

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        ids = request.prompt_token_ids
        prompt = {"input_ids": ids} if ids is not None else {"prompt": request.prompt}
        rid, finished, last = request.request_id, False, (0, 0)
        echo = request.params.echo
        try:
            chunks = await self._engine.async_generate(
                **prompt, sampling_params=sampling_dict(request.params), stream=True, rid=rid
            )
            async for chunk in chunks:
                delta = to_delta(rid, chunk)
                if echo:  # the prompt's text on the first delta
                    delta.prompt_text = request.prompt if ids is None else self._tokenizer().decode(ids)
                    echo = False
                finished, last = delta.finish_reason is not None, (delta.prompt_tokens, delta.completion_tokens)
                yield delta
        except Exception:
            if not self._closing:
                raise
        finally:
            if not finished and self._engine is not None:
                self._engine.tokenizer_manager.abort_request(rid)
        if not finished:  # shut down under us: end the request as the protocol says
            yield TokenDelta(rid, [], "", "abort", *last)

    async def set_num_steps(self, num_steps: int) -> None:
        if num_steps not in self.opts.candidate_steps:
            raise ValueError(f"num_steps {num_steps} is not one of candidate_steps {self.opts.candidate_steps}")
        if self._engine is None:
            raise EngineError("the SGLang engine is not running")
        guard = self.opts.spec_max_batch_size or 0
        timeout = self.opts.rpc_timeout_s
        async with self._rpc_lock:  # one ZMQ socket: one RPC at a time
            if self._rpc_pending is not None and not self._rpc_pending.done():
                # The last call that timed out still holds the socket: give it one more timeout.
                stuck = f"the previous {plugin.RPC_METHOD} call is still unanswered after a further {timeout:g} s"
                try:
                    await self._await_rpc(timeout, stuck)
                except SwitchTimeoutError:
                    raise
                except Exception:  # its late failure was already reported as a timeout
                    pass
            # A blocking send/recv plus a barrier on every TP rank: keep it off the event loop.
            self._rpc_pending = self._rpc_pool.submit(
                self._engine.collective_rpc, plugin.RPC_METHOD, num_steps=num_steps, max_batch_size=guard,
                adaptive=int(self._adaptive),
            )
            try:
                await self._await_rpc(
                    timeout,
                    f"SGLang's schedulers did not answer {plugin.RPC_METHOD}({num_steps}) within {timeout:g} s "
                    "(rpc_timeout_s)",
                )
            except AssertionError as e:  # collective_rpc asserts success with the scheduler's message
                raise EngineError(f"SGLang schedulers refused {plugin.RPC_METHOD}({num_steps}): {e}") from e
        self._num_steps = num_steps

    async def set_step_policy(self, step_policy: str) -> None:
        """``fixed`` or ``adaptive`` from the next decode batch (SGLang's policy picks under the
        command), without a restart."""
        if step_policy not in ("fixed", "adaptive"):
            raise ValueError(f"step_policy must be fixed or adaptive, got {step_policy!r}")
        previous, self._adaptive = self._adaptive, step_policy == "adaptive"
        try:
            await self.set_num_steps(self._num_steps)
        except Exception:
            self._adaptive = previous
            raise

    async def _await_rpc(self, timeout: float, unanswered: str) -> None:
        """Wait for the pending RPC at most ``timeout``; past it, SwitchTimeoutError (the call
        itself goes on, holding the socket, until SGLang answers)."""
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._rpc_pending)), timeout)
        except TimeoutError:
            raise SwitchTimeoutError(f"{unanswered}; staying at num_steps={self._num_steps}") from None

    def load(self) -> EngineLoad:
        """Queue and throughput from SGLang's load snapshot (shared memory, no scheduler
        round-trip); the steps run and recent acceptance from the plugin's published state."""
        reader = getattr(getattr(self._engine, "tokenizer_manager", None), "load_snapshot_reader", None)
        snapshots = reader.read_all() if reader is not None else []
        running = sum(s.num_running_reqs for s in snapshots)
        state = next(iter(self.policy_states()), None)  # the freshest rank's
        fresh = state is not None and time.time() - state["time"] <= state["window_s"]
        recent = state["recent"] if fresh else {}
        verified, proposed, accepted = (recent.get(k, 0) for k in ("verified", "proposed", "accepted"))
        runs = state["active"] if state and running else self._num_steps  # idle: the next batch runs the command
        return EngineLoad(
            waiting=sum(s.num_waiting_reqs for s in snapshots),
            running=running,
            output_tokens_per_s=float(sum(s.gen_throughput for s in snapshots)),
            accept_rate=accepted / proposed if proposed else 0.0,
            num_steps=self._num_steps,
            mean_accepted_len=accepted / verified if verified else 0.0,
            active_num_steps=runs,
        )

    def policy_states(self) -> list[dict]:
        """What each scheduler's policy published (one per TP rank), freshest first."""
        return read_states(self._state_dir) if self._state_dir else []

    async def shutdown(self) -> None:
        if self._engine is None:
            return
        self._closing = True
        self._engine.tokenizer_manager.abort_request(abort_all=True)
        await asyncio.sleep(0.2)  # let the abort outputs reach the streams
        await asyncio.to_thread(self._engine.shutdown)
        self._engine = None
        self._rpc_pool.shutdown(wait=False, cancel_futures=True)
        if self._state_dir:
            shutil.rmtree(self._state_dir, ignore_errors=True)


def failed_processes(processes: list[multiprocessing.process.BaseProcess]) -> list[str]:
    """Each process that has ended with a nonzero exit code or by a signal, described; as
    SGLang's own watchdog, an exit code 0 is a process that finished its work."""
    out = []
    for p in processes:
        code = p.exitcode  # None while it runs (a non-blocking waitpid)
        if code is None or code == 0:
            continue
        how = f"signal {signal_name(-code)}" if code < 0 else f"exit code {code}"
        out.append(f"process {p.name} (pid {p.pid}) ended by {how}")
    return out


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def sampling_dict(params: SamplingParams) -> dict[str, Any]:
    """Our sampling parameters as SGLang's ``sampling_params`` dict."""
    out: dict[str, Any] = {"max_new_tokens": params.max_tokens, "ignore_eos": params.ignore_eos}
    # Unset: SGLang applies the model's generation_config defaults (its --sampling-defaults model).
    if params.temperature is not None:
        out["temperature"] = float(params.temperature)
    if params.top_p is not None:
        out["top_p"] = float(params.top_p)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.min_tokens:
        out["min_new_tokens"] = params.min_tokens
    if params.stop:
        out["stop"] = list(params.stop)
    if params.seed is not None:  # honoured only with deterministic inference (generate() refuses it otherwise)
        out["sampling_seed"] = params.seed
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(params, name):
            out[name] = float(getattr(params, name))
    if params.repetition_penalty != 1.0:
        out["repetition_penalty"] = float(params.repetition_penalty)
    if params.logit_bias:  # SGLang's keys are token ids as strings, as OpenAI's
        out["logit_bias"] = {str(k): float(v) for k, v in params.logit_bias.items()}
    return out


def to_delta(rid: str, chunk: dict) -> TokenDelta:
    """One streamed SGLang output (``incremental_streaming_output``: only what this step added)."""
    meta = chunk.get("meta_info", {})
    finish = meta.get("finish_reason")
    reason = None if finish is None else _FINISH.get(finish.get("type"), "stop")
    return TokenDelta(
        request_id=rid,
        token_ids=list(chunk.get("output_ids") or []),
        text=chunk.get("text") or "",
        finish_reason=reason,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        completion_tokens=int(meta.get("completion_tokens", 0)),
    )


def check_plugin_installed() -> None:
    """Fail before loading any weights if SGLang's schedulers would not load our plugin."""
    ours = [ep for ep in entry_points(group=plugin.ENTRY_POINT_GROUP) if ep.value == plugin.ENTRY_POINT_VALUE]
    if not ours:
        raise EngineError(
            f"entry point {plugin.ENTRY_POINT_GROUP}:{plugin.ENTRY_POINT_NAME} = {plugin.ENTRY_POINT_VALUE} is "
            "not installed: install specserve (pip install .) so SGLang's load_plugins() finds it"
        )
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed and ours[0].name not in {x.strip() for x in allowed.split(",")}:
        raise EngineError(f"SGLANG_PLUGINS={allowed!r} excludes the {ours[0].name!r} plugin")


def check_adaptive_active(server_args: Any, release: compat.Release) -> None:
    """SGLang turns --speculative-adaptive off with only a log warning (topk > 1, attention DP,
    two-batch overlap, pdmux, ...). From 0.5.19 the raw field keeps the input and the resolved
    view tells; before, SGLang sets the field itself."""
    if release.resolves_server_args:
        on = server_args.resolved_dict().get("speculative_adaptive")
    else:
        on = server_args.speculative_adaptive
    if on:
        return
    try:
        from sglang.srt.speculative.adaptive_spec_params import adaptive_unsupported_reason

        reason = adaptive_unsupported_reason(server_args) or "unknown reason (see SGLang's log)"
    except Exception as e:  # the reason is a courtesy; the failure is the point
        reason = f"unknown reason ({e})"
    raise EngineError(f"SGLang turned adaptive speculation off: {reason}")
