"""EmbeddedEngine: the engine protocol over EngineCore, stepping in a background thread.

Requests are validated and tokenized on the caller's side, queued to the step thread, and
their output flows back through an asyncio queue per request. PyTorch releases the GIL
inside its kernels, so the event loop stays responsive while the model runs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator

import torch

from ..base import (
    EngineDeadError,
    EngineLoad,
    EngineOverloadedError,
    GenerateRequest,
    InvalidRequestError,
    TokenDelta,
)
from .adaptive import make_chooser
from .config import EmbeddedOptions
from .core import EngineCore
from .drafters import make_drafter
from .kv_cache import KVCache, release_free_heap
from .logits import LogitsState
from .model import Llama
from .quant import gguf_q4_1_blocks, gguf_q8_0_tensors, read_gguf
from .sequence import Sequence, Status
from .weights import generation_defaults, load_model

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def build_core(o: EmbeddedOptions) -> EngineCore:
    """Load the model and build the synchronous engine core."""
    if o.num_threads:
        torch.set_num_threads(o.num_threads)
    device = "cuda" if o.device == "cuda" or (o.device == "auto" and torch.cuda.is_available()) else "cpu"
    loaded = load_model(o.model, tiny_layers=o.tiny_layers, seed=o.seed)
    s = loaded.shape
    if o.max_model_len > s.max_position_embeddings:
        raise ValueError(f"max_model_len {o.max_model_len} exceeds the model's {s.max_position_embeddings} positions")
    dtype = _DTYPES[o.dtype]
    blocks, q8_0 = None, None
    if o.weights in ("q4_1", "gguf") and loaded.gguf is not None:
        gguf = read_gguf(loaded.gguf)
        blocks = gguf_q4_1_blocks(gguf, s.num_heads, s.num_kv_heads)
        q8_0 = gguf_q8_0_tensors(gguf) if o.weights == "gguf" else None
    model = Llama(s, loaded.state_dict, device, dtype, weights=o.weights, blocks=blocks, q8_0=q8_0)
    cache = KVCache(s.num_layers, o.max_num_seqs, s.num_kv_heads, o.max_model_len + o.max_num_steps + 1,
                    s.head_dim, device, dtype)
    eos = set(s.eos_token_ids)
    if loaded.tokenizer.eos_token_id is not None:
        eos.add(loaded.tokenizer.eos_token_id)
    drafter = make_drafter(o.drafter, ngram_max=o.ngram_max, ngram_min=o.ngram_min, model=model,
                           model_name=loaded.name, draft_head=o.draft_head, max_num_seqs=o.max_num_seqs,
                           capacity=cache.capacity)
    core = EngineCore(model, loaded.tokenizer, drafter, cache, max_num_seqs=o.max_num_seqs,
                      max_prefill_tokens=o.max_prefill_tokens, eos_token_ids=eos,
                      chooser=make_chooser(o.step_policy, o.adaptive))
    del loaded, blocks, q8_0  # the loaded weights: the model holds its own copies
    release_free_heap()
    return core


def _emitter(loop: asyncio.AbstractEventLoop, out: asyncio.Queue):
    """Hand deltas from the step thread to the request's event loop; a closed loop (its
    consumer is gone) drops them rather than failing the step."""

    def emit(delta: TokenDelta) -> None:
        try:
            loop.call_soon_threadsafe(out.put_nowait, delta)
        except RuntimeError:
            pass

    return emit


def _name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the OS too (top -H, /proc, py-spy), where it can."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


class EmbeddedEngine:
    """A compact batched engine with lookup-drafted speculative decoding."""

    def __init__(self, options: EmbeddedOptions | None = None, **kwargs):
        self.options = options or EmbeddedOptions(**kwargs)
        self.model_name = self.options.model
        self.core: EngineCore | None = None
        self.tokenizer = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: str | None = None  # why the step thread ended, if it ended without a shutdown
        self._num_waiting = 0  # requests submitted but not yet handed to the step thread

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self.start_sync)

    def build(self) -> None:
        """Build the core (model, tokenizer, cache) without starting the step thread: callers
        that drive ``core.step()`` themselves (tests, ``bench ops``) stop here."""
        self.core = build_core(self.options)
        self.tokenizer = self.core.tokenizer
        self.vocab_size = self.core.model.shape.vocab_size

    def start_sync(self) -> None:
        """Load the model and start the step thread (the blocking half of start())."""
        t0 = time.monotonic()
        self.build()
        _ = self.sampling_defaults  # read the model's defaults now: a bad file fails start-up, not requests
        self._thread = threading.Thread(target=self._loop, name="specserve-engine", daemon=True)
        self._thread.start()
        log.info("embedded engine ready: %s on %s/%s, %s weights, in %.1fs", self.options.model, self.core.device,
                 self.options.dtype, self.options.weights, time.monotonic() - t0)

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    def check_health(self) -> None:
        """Raise EngineDeadError once the step thread has ended without a shutdown."""
        if self._dead is None and self._thread is not None and not self._thread.is_alive() and not self._stopping:
            self._dead = "the engine's step thread has ended"
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    # -- requests ---------------------------------------------------------------------
    @functools.cached_property
    def sampling_defaults(self) -> tuple[float, float]:
        """(temperature, top_p) for requests that set none: the options', else the model's
        generation_config.json, else 1.0 (OpenAI's)."""
        shipped = generation_defaults(self.options.model)
        o = self.options
        return (
            next(v for v in (o.default_temperature, shipped.get("temperature"), 1.0) if v is not None),
            next(v for v in (o.default_top_p, shipped.get("top_p"), 1.0) if v is not None),
        )

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def make_sequence(self, request: GenerateRequest, emit) -> Sequence:
        """Validate a request and build its sequence; raises InvalidRequestError."""
        if self.core is None:
            raise RuntimeError("engine not started")
        p = request.params.with_defaults(*self.sampling_defaults)
        p.validate()
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.vocab_size})", "prompt")
        elif isinstance(request.prompt, str):
            ids = self.tokenize(request.prompt)
        else:
            raise InvalidRequestError("a prompt (text or token ids) is required", "prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        limit = self.options.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; this model's context is {limit} tokens", "prompt")
        if len(ids) + p.max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) exceeds the context of {limit} tokens",
                "max_tokens")
        outside = [t for t in p.logit_bias if t >= self.vocab_size]
        if outside:
            raise InvalidRequestError(f"logit_bias names token {outside[0]}; token ids are in [0, {self.vocab_size})",
                                      "logit_bias")
        gen = None
        if p.temperature > 0:
            gen = torch.Generator()
            gen.manual_seed(p.seed if p.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        long = self.options.long_prompt_tokens
        if long is not None and len(ids) > long:  # long contexts accept fewer drafts: cap them
            cap = self.options.long_prompt_max_steps
            p.spec_max_steps = cap if p.spec_max_steps is None else min(cap, p.spec_max_steps)
        seq = Sequence(request.request_id, ids, len(ids), p, gen, emit)
        if p.processes_logits:
            seq.logits_state = LogitsState(p, ids, self.vocab_size)
        if p.echo:
            seq.prompt_text = request.prompt if request.prompt_token_ids is None else self.tokenizer.decode(ids)
        return seq

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Validate and queue the request now; stream its deltas from the returned iterator."""
        self.check_health()
        if self.core is not None and self._num_waiting + len(self.core.scheduler.waiting) >= self.options.max_waiting:
            raise EngineOverloadedError(f"the engine queue is full ({self.options.max_waiting} waiting requests)")
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[TokenDelta] = asyncio.Queue()
        seq = self.make_sequence(request, _emitter(loop, out))
        self._submit(("add", seq))
        return self._stream(seq.request_id, out)

    async def _stream(self, request_id: str, out: asyncio.Queue) -> AsyncIterator[TokenDelta]:
        done = False
        try:
            while not done:
                delta = await out.get()
                if isinstance(delta, EngineDeadError):  # the step thread ended: nothing more comes
                    done = True
                    raise delta
                done = delta.finish_reason is not None
                yield delta
        finally:
            if not done:  # the consumer went away: free the slot
                self._submit(("abort", request_id))

    def _submit(self, item) -> None:
        if item[0] == "add":
            self._num_waiting += 1
        self._inbox.put(item)
        self._wake.set()

    async def set_num_steps(self, num_steps: int) -> None:
        if not isinstance(num_steps, int) or not 0 <= num_steps <= self.options.max_num_steps:
            raise InvalidRequestError(f"num_steps must be an integer in [0, {self.options.max_num_steps}]", "num_steps")
        self.core.num_steps = num_steps

    async def set_step_policy(self, step_policy: str) -> None:
        """``fixed`` or ``adaptive`` from the next decode step, without a restart. The step
        thread swaps the chooser between steps; a new adaptive chooser starts from the
        configured settings (no acceptance or step cost carried over)."""
        if step_policy not in ("fixed", "adaptive"):
            raise InvalidRequestError(f"step_policy must be fixed or adaptive, got {step_policy!r}", "step_policy")
        self._submit(("step_policy", step_policy))

    def load(self) -> EngineLoad:
        core = self.core
        if core is None:
            return EngineLoad(0, 0, 0.0, 0.0, 0)
        tps, accept, mean_len = core.stats.snapshot()
        sched = core.scheduler
        # A request that just finished leaves its slot at the end of the step: not running.
        running = sum(1 for s in sched.running if s.status is not Status.FINISHED)
        chooser = core.chooser
        return EngineLoad(waiting=len(sched.waiting) + max(self._num_waiting, 0), running=running,
                          output_tokens_per_s=tps, accept_rate=accept, num_steps=core.num_steps,
                          mean_accepted_len=mean_len,
                          active_num_steps=core.active_num_steps() if running else core.num_steps,
                          mean_num_steps=None if chooser is None else chooser.mean_num_steps(core.num_steps),
                          step_choices=None if chooser is None else chooser.summary())

    # -- the step thread --------------------------------------------------------------
    def _loop(self) -> None:
        _name_os_thread("specserve-step")
        core = self.core
        try:
            while not self._stopping:
                try:
                    self._drain()
                    if not core.has_work():
                        self._wake.wait(0.05)
                        self._wake.clear()
                        continue
                    core.step()
                except Exception:  # a bug must not take the engine down with every request in it
                    log.exception("engine step failed; aborting its requests")
                    core.abort_all()
        except BaseException as e:  # the thread ends (SystemExit, MemoryError in abort_all...)
            self._dead = f"the engine's step thread ended: {type(e).__name__}: {e}"
            log.critical("%s; failing its requests", self._dead)
            self._fail_all(EngineDeadError(self._dead))
            return
        self._drain()
        core.abort_all()

    def _fail_all(self, error: EngineDeadError) -> None:
        """Hand ``error`` to every request the engine holds or has yet to take: their streams
        raise it instead of waiting for deltas that will not come."""
        queued = [arg for kind, arg in self._take_inbox() if kind == "add"]
        for seq in [*self.core.scheduler.waiting, *self.core.scheduler.running, *queued]:
            if seq.status is not Status.FINISHED:
                seq.emit(error)

    def _take_inbox(self) -> Iterator[tuple[str, object]]:
        """The inbox's items, taken until it is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain(self) -> None:
        for kind, arg in self._take_inbox():
            if kind == "add":
                self._num_waiting -= 1
                self.core.add(arg)
            elif kind == "step_policy":
                if (arg == "adaptive") != (self.core.chooser is not None):
                    self.core.chooser = make_chooser(arg, self.options.adaptive)
            else:
                self.core.abort(arg)
