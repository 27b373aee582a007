"""The engine protocol every backend implements.

An engine owns a model and serves many requests at once. Its speculation depth is one
number, ``num_steps``: 0 decodes plainly, k > 0 drafts k tokens per step and verifies them
in one target pass. ``set_num_steps`` takes effect at the next decode step for every
running request and never changes what a request outputs under greedy sampling.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]


class EngineError(Exception):
    """Base class of the errors an engine raises to its caller."""


class InvalidRequestError(EngineError, ValueError):
    """The request cannot be served as given (bad parameters, prompt too long...).

    Raised at submission, before the request takes any engine resources; the serving
    layer turns it into an HTTP 400.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class EngineOverloadedError(EngineError):
    """The engine's queue is full; the caller should retry later (HTTP 429/503)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class EngineDeadError(EngineError):
    """The engine can serve no more (its step loop, or a process it runs on, ended without a
    shutdown). Its replica ends its own process (serve_app.serving.replica), so that the
    ingress sends the request to another replica if no token of it was sent, and Serve
    replaces the replica."""


def _number(name: str, value: object) -> float:
    """``value`` as a float, or InvalidRequestError naming ``name`` (a bool, a string, an integer
    past a float's range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", name)
    try:
        return float(value)
    except OverflowError:
        raise InvalidRequestError(f"{name} is out of range, got an integer of {value.bit_length()} bits", name) from None


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy (and then top_p and seed do not matter)."""

    max_tokens: int = 128
    temperature: float | None = 0.0
    """None: the engine's default (:meth:`with_defaults`), as a request that sets none gets."""
    top_p: float | None = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the request as end-of-sequence does (the token is in the output ids,
    not in its text)."""
    min_tokens: int = 0
    """End-of-sequence and ``stop_token_ids`` cannot be generated, and stop strings do not end the
    request, before this many tokens (vLLM's meaning)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output holds so far (OpenAI's meaning)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output holds it so far."""
    repetition_penalty: float = 1.0
    """A token of the prompt or the output so far has a positive logit divided by this, a
    negative one multiplied (vLLM's and SGLang's extension)."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to the logits of these token ids before sampling."""
    logprobs: int | None = None
    """None: no log-probabilities. k >= 0: each output token's, with the k most likely at its position."""
    prompt_logprobs: int | None = None
    """As ``logprobs``, for the prompt's tokens (the first has none): on the request's first delta."""
    echo: bool = False
    """The request's first delta carries the prompt's text (``TokenDelta.prompt_text``)."""
    spec_max_steps: int | None = None
    """The most draft tokens this request may verify per step, below the engine's ``num_steps``
    (None: no cap of its own; 0: plain decoding). Greedy output does not depend on it."""

    def with_defaults(self, temperature: float, top_p: float) -> SamplingParams:
        """These parameters with the engine's defaults where they are None."""
        return replace(
            self,
            temperature=temperature if self.temperature is None else self.temperature,
            top_p=top_p if self.top_p is None else self.top_p,
        )

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if self.temperature is not None and not 0.0 <= _number("temperature", self.temperature) <= 2.0:
            raise InvalidRequestError(f"temperature must be in [0, 2], got {self.temperature!r}", "temperature")
        if self.top_p is not None and not 0.0 < _number("top_p", self.top_p) <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop must be a list of non-empty strings", "stop")
        if len(self.stop) > 16:
            raise InvalidRequestError(f"at most 16 stop strings are allowed, got {len(self.stop)}", "stop")
        if any(len(s) > 256 for s in self.stop):
            raise InvalidRequestError("each stop string must be at most 256 characters", "stop")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise InvalidRequestError(f"seed must fit in 64 bits ([-2**63, 2**64)), got {self.seed}", "seed")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise InvalidRequestError("stop_token_ids must be a list of non-negative integers", "stop_token_ids")
        if len(ids) > 64:
            raise InvalidRequestError(f"at most 64 stop_token_ids are allowed, got {len(ids)}", "stop_token_ids")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}", "min_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _number(name, getattr(self, name)) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}", name)
        if not 0.0 < _number("repetition_penalty", self.repetition_penalty) <= 10.0:
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}", "repetition_penalty")
        self._validate_logit_bias()
        k = self.spec_max_steps
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 64):
            raise InvalidRequestError(f"speculation.max_steps must be an integer in [0, 64], got {k!r}",
                                      "speculation.max_steps")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}", name)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", "min_tokens"
            )


    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, dict):
            raise InvalidRequestError("logit_bias must map token ids to numbers", "logit_bias")
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed, got {len(bias)}",
                                      "logit_bias")
        for token, value in bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids (non-negative integers), got {token!r}",
                                          "logit_bias")
            if not -100.0 <= _number("logit_bias", value) <= 100.0:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {value!r} for {token}",
                                          "logit_bias")

    @property
    def processes_logits(self) -> bool:
        """Whether penalties or a bias change the logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


MAX_LOGPROBS = 20
"""The most alternatives per position ``logprobs`` and ``prompt_logprobs`` may ask for (vLLM's default)."""
MAX_LOGIT_BIAS = 1024


@dataclass(slots=True)
class Logprob:
    """A token's log-probability at one position, from the target model's logits before
    temperature, top_p, penalties and bias (vLLM's "raw" logprobs), with the most likely tokens
    there (``top``, best first; their own ``top`` is empty)."""

    token_id: int
    token: str
    """The token's text alone (a piece of a multi-byte character decodes to U+FFFD)."""
    bytes: list[int]
    """The token's bytes (UTF-8 pieces included)."""
    logprob: float | None
    """None only for a prompt's first token, which nothing predicts."""
    top: list[Logprob] = field(default_factory=list)


@dataclass(slots=True)
class GenerateRequest:
    """One generation: a prompt as text or token ids (ids win when both are given)."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(slots=True)
class TokenDelta:
    """One step of output for one request.

    ``token_ids`` and ``text`` are what this step added. The last delta of a request has
    ``finish_reason`` set; usage counts are cumulative and always filled.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[Logprob] | None = None
    """One per entry of ``token_ids``, where the request asked for ``logprobs``."""
    prompt_text: str | None = None
    """On the first delta of an ``echo`` request: the prompt as text."""
    prompt_logprobs: list[Logprob] | None = None
    """On the first delta, where the request asked for ``prompt_logprobs``: one per prompt token
    (the first with logprob None)."""


@dataclass(slots=True)
class EngineLoad:
    """A snapshot of how busy an engine is, for the controller and for metrics."""

    waiting: int
    running: int
    output_tokens_per_s: float
    accept_rate: float
    num_steps: int
    mean_accepted_len: float = 0.0
    active_num_steps: int | None = None
    """The draft steps the engine's last decode step really ran, where that can differ from the
    commanded ``num_steps`` (a local guard, or an engine that picks each step's draft length
    under it); None: the same as ``num_steps``."""
    mean_num_steps: float | None = None
    """Mean draft steps of the engine's decode steps over its last seconds, where it picks them
    per step; None: it runs what is commanded."""
    step_choices: dict | None = None
    """Where the engine picks each step's draft length: what it decides from (its acceptance
    estimate, the gate, its choices by reason, its learned step cost), for ``GET
    /v1/speculation``; None: it runs what is commanded."""


@runtime_checkable
class Engine(Protocol):
    """An inference engine with both the plain and the speculative decode path loaded."""

    model_name: str
    """The name clients use for this model (OpenAI ``model`` field)."""

    async def start(self) -> None:
        """Load the model and start serving; returns when requests can be accepted."""

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Render chat messages into a prompt with the model's own template."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Stream the request's output. Raises InvalidRequestError before the first delta."""

    async def set_num_steps(self, num_steps: int) -> None:
        """Set the speculation depth (0 = off) for the next decode step of every request."""

    async def set_step_policy(self, step_policy: str) -> None:
        """``fixed``: every decode step drafts ``num_steps``; ``adaptive``: ``num_steps`` is a
        ceiling and the engine picks each step's draft length under it. From the next decode
        step, without a restart."""

    def load(self) -> EngineLoad:
        """A cheap, non-blocking load snapshot."""

    async def shutdown(self) -> None:
        """Stop serving; running requests end with finish_reason "abort"."""
