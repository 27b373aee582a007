"""The OpenAI HTTP protocol, as far as specserve speaks it: requests, responses, errors.

Unknown request fields are ignored (clients send many); known fields with values we cannot
honour (``best_of``, ``suffix``, ``tools``...) are rejected with a 400 that names them.
docs/serving.md has the table of every parameter.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.engines.base import Logprob, SamplingParams


def _text_only(value: Any) -> Any:
    """``value`` as it is, if every string in it is text that UTF-8 can carry (JSON's ``\\ud800``
    escapes make lone surrogates, which no tokenizer or response can encode)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the string holds {value[e.start]!r} at {e.start}, which is not text (a lone "
                             "UTF-16 surrogate)") from None
    elif isinstance(value, list):
        for item in value:
            _text_only(item)
    elif isinstance(value, dict):
        for item in value.values():
            _text_only(item)
    return value


class _Lenient(BaseModel):
    """Unknown fields are ignored; known ones take their JSON type only (no ``true`` for a
    number, no ``"0.5"`` for a float: those are 400s naming the field, not silent coercions)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _strings_are_text(cls, value: Any) -> Any:
        return _text_only(value)


MAX_CHOICES = 64
"""Completions one request may ask for: prompts × n."""


class UnsupportedParameter(ValueError):
    """A known OpenAI parameter with a value specserve does not serve."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class StreamOptions(_Lenient):
    include_usage: bool = False


class Speculation(_Lenient):
    """The ``speculation`` extension: this request's own cap on draft tokens per step."""

    max_steps: int | None = None


class _Sampling(_Lenient):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions, under vLLM's and SGLang's names: keep generating past the end-of-sequence token;
    # token ids that stop as it does; no end-of-sequence or stop token before min_tokens tokens;
    # the multiplicative penalty of tokens seen in the prompt or output.
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    speculation: Speculation | None = None

    default_max_tokens: ClassVar[int] = 16

    def sampling_params(self) -> SamplingParams:
        """The engine's SamplingParams; raises UnsupportedParameter for what we do not serve."""
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise UnsupportedParameter(f"n must be in [1, {MAX_CHOICES}], got {self.n}", "n")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params = SamplingParams(
            max_tokens=self._max_tokens(),
            temperature=self.temperature,  # None: the engine's default (the model's, or as configured)
            top_p=self.top_p,
            stop=stop,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or []),
            min_tokens=self.min_tokens or 0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self._logit_bias(),
            logprobs=self._logprobs(),
            spec_max_steps=self.speculation.max_steps if self.speculation else None,
        )
        params.validate()
        return params

    def _logit_bias(self) -> dict[int, float]:
        """OpenAI's map of token ids, as JSON strings, to biases."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise UnsupportedParameter(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            out[token] = value
        return out

    def _logprobs(self) -> int | None:
        """How many alternatives per output token the engine reports; None: no logprobs."""
        raise NotImplementedError

    def _max_tokens(self) -> int:
        return self.default_max_tokens if self.max_tokens is None else self.max_tokens

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. The prompt: a string, a list of token ids, or a list of those
    (one completion each, ``n`` choices per prompt, in order)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt):
        if not prompt and prompt != "":
            raise ValueError("the prompt is empty")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) > MAX_CHOICES:
                raise ValueError(f"at most {MAX_CHOICES} prompts per request, got {len(prompt)}")
            if any(not p and p != "" for p in prompt):
                raise ValueError("a prompt of the list is empty")
        return prompt

    def prompts(self) -> list[tuple[str | None, list[int] | None]]:
        """Each prompt as (text, None) or (None, token ids)."""
        p = self.prompt
        many = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        return [(x, None) if isinstance(x, str) else (None, list(x)) for x in many]  # type: ignore[arg-type]

    def sampling_params(self) -> SamplingParams:
        if self.best_of not in (None, 1):
            raise UnsupportedParameter("best_of is not supported", "best_of")
        if self.suffix:
            raise UnsupportedParameter("suffix is not supported", "suffix")
        params = super().sampling_params()
        params.echo = self.echo
        if self.echo:  # the prompt's tokens are part of the text returned: they get logprobs too
            params.prompt_logprobs = params.logprobs
        return params

    def _logprobs(self) -> int | None:
        return self.logprobs


def check_choices(prompts: int, n: int) -> None:
    """Raise UnsupportedParameter when ``prompts`` × ``n`` choices are more than one request may ask."""
    if prompts * n > MAX_CHOICES:
        raise UnsupportedParameter(
            f"{prompts} prompts × n={n} asks for {prompts * n} completions; at most {MAX_CHOICES} per request", "n"
        )


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    default_max_tokens: ClassVar[int] = 512

    def _max_tokens(self) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super()._max_tokens()

    def sampling_params(self) -> SamplingParams:
        if self.tools:
            raise UnsupportedParameter("tools are not supported", "tools")
        return super().sampling_params()

    def _logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedParameter("top_logprobs needs logprobs set to true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise UnsupportedParameter(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict[str, str]]:
        # The chat templates know "system", not OpenAI's newer "developer".
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


# -- responses --------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_logprobs(entries: list[Logprob] | None) -> dict[str, Any] | None:
    """A chat choice's ``logprobs``: the content's tokens, each with its ``top_logprobs``."""
    if entries is None:
        return None

    def one(e: Logprob) -> dict[str, Any]:
        return {"token": e.token, "logprob": e.logprob, "bytes": e.bytes}

    return {"content": [one(e) | {"top_logprobs": [one(t) for t in e.top]} for e in entries], "refusal": None}


class CompletionLogprobs:
    """A completions choice's ``logprobs``, chunk by chunk: ``text_offset`` runs on across chunks."""

    def __init__(self, wanted: bool):
        self.wanted = wanted
        self.offset = 0

    def render(self, entries: list[Logprob] | None) -> dict[str, Any] | None:
        """``entries`` as tokens, token_logprobs, top_logprobs and text_offset. The top dict holds
        the chosen token too, as vLLM's does; an echoed prompt's first token has None for both."""
        if not self.wanted:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries or []:
            out["tokens"].append(e.token)
            out["token_logprobs"].append(e.logprob)
            top = None if e.logprob is None else {t.token: t.logprob for t in e.top} | {e.token: e.logprob}
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(e.token)
        return out


def completion_choice(output, render: CompletionLogprobs) -> tuple[str, dict[str, Any] | None]:
    """A completions choice's text and ``logprobs`` from an output (a whole result or one delta:
    anything with ``text``, ``logprobs``, ``prompt_text`` and ``prompt_logprobs``); an echoed
    prompt comes first in both."""
    text = (output.prompt_text or "") + output.text
    return text, render.render((output.prompt_logprobs or []) + (output.logprobs or []))


def completion_response(
    rid: str, model: str, outputs: list[tuple[str, str | None]], usage_: dict | None, created: int | None = None,
    logprobs: list[dict | None] | None = None,
) -> dict[str, Any]:
    """A ``text_completion`` with a choice per (text, finish_reason), indexed in order."""
    logprobs = logprobs or [None] * len(outputs)
    choices = [{"index": i, "text": text, "finish_reason": f, "logprobs": lp}
               for i, ((text, f), lp) in enumerate(zip(outputs, logprobs, strict=True))]
    return {
        "id": rid,
        "object": "text_completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def chat_response(rid: str, model: str, outputs: list[tuple[str, str | None]], usage_: dict,
                  logprobs: list[dict | None] | None = None) -> dict[str, Any]:
    """A ``chat.completion`` with a choice per (text, finish_reason), indexed in order."""
    logprobs = logprobs or [None] * len(outputs)
    choices = [
        {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": f, "logprobs": lp}
        for i, ((text, f), lp) in enumerate(zip(outputs, logprobs, strict=True))
    ]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage_}


def chat_chunk(
    rid: str, model: str, created: int, delta: dict | None, finish_reason: str | None = None, usage_: dict | None = None,
    index: int = 0, logprobs: dict | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` of choice ``index``; ``delta=None`` gives the usage-only final chunk (no choices)."""
    choices = [] if delta is None else [{"index": index, "delta": delta, "finish_reason": finish_reason,
                                         "logprobs": logprobs}]
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def completion_chunk(
    rid: str, model: str, created: int, text: str | None, finish_reason: str | None = None, usage_: dict | None = None,
    index: int = 0, logprobs: dict | None = None,
) -> dict[str, Any]:
    choices = [] if text is None else [{"index": index, "text": text, "finish_reason": finish_reason,
                                        "logprobs": logprobs}]
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def model_list(model: str, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "specserve"}],
    }


ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "server_error",
]


def error_body(message: str, type_: ErrorType, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# -- operator API -----------------------------------------------------------------------------


class SpeculationUpdate(BaseModel):
    """``PUT /v1/speculation``: force a mode, return to auto, and/or change policy fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    mode: Literal["auto", "fixed"] | None = None
    num_steps: int | None = Field(default=None, ge=0, le=64)
    policy: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _something_to_do(self) -> SpeculationUpdate:
        if self.num_steps is not None and self.mode != "fixed":
            raise ValueError("num_steps is only valid with mode 'fixed'")
        if self.mode is None and self.policy is None:
            raise ValueError("give 'mode' and/or 'policy'")
        return self
