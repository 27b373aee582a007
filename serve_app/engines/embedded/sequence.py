"""One request inside the engine: its tokens, its cache slot, its output text."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from ..base import FinishReason, Logprob, SamplingParams
from .logits import LogitsState


class Status(Enum):
    WAITING = 0
    PREFILLING = 1  # holds a slot; part of the prompt is cached
    DECODING = 2
    FINISHED = 3


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    emit: object  # callable(TokenDelta) that hands output to the request's consumer
    status: Status = Status.WAITING
    slot: int = -1
    num_cached: int = 0  # tokens whose keys/values are in the cache
    finish_reason: FinishReason | None = None
    arrival: float = field(default_factory=time.monotonic)
    detok: IncrementalDetokenizer | None = None
    logits_state: LogitsState | None = None  # penalties and bias, where the request has any
    prompt_text: str | None = None  # for an echo request's first delta
    prompt_logprobs: list[Logprob] | None = None  # filled chunk by chunk during prefill

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class IncrementalDetokenizer:
    """Turns output tokens into text step by step, and finds stop strings.

    Decodes a short window of recent tokens (as vLLM and TGI do) so that a token that only
    makes sense with its neighbours (a byte of a multi-byte character, a word-piece space)
    is emitted once it is complete. With stop strings, the last ``max(len(stop)) - 1``
    characters are held back until they cannot start a stop string.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all output text decoded so far
        self.emitted = 0  # characters of text already handed out
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def add(self, token_ids: list[int], check_stop: bool = True) -> tuple[str, bool]:
        """Add tokens; return (new text safe to emit, whether a stop string was hit). Without
        ``check_stop`` (before ``min_tokens``) no stop string is looked for."""
        for t in token_ids:
            self.ids.append(t)
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
            full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.stop and not check_stop:
            safe = max(self.emitted, len(self.text) - self.holdback)
        elif self.stop:
            start = max(0, self.emitted - self.holdback)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                return self.flush(), True
            safe = max(self.emitted, len(self.text) - self.holdback)
        else:
            safe = len(self.text)
        new, self.emitted = self.text[self.emitted:safe], safe
        return new, False

    def flush(self) -> str:
        new, self.emitted = self.text[self.emitted:], len(self.text)
        return new
