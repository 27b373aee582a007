"""Server-sent events of the OpenAI streaming endpoints: one generator for chat and
completions, each with its own chunk shape."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from serve_app.engines.base import TokenDelta
from serve_app.serving import openai_protocol as oai
from serve_app.serving.errors import stream_error

Chunk = Callable[[TokenDelta | None, dict | None], dict]
"""A chunk for a delta (usage None), or the usage-only final chunk (delta None)."""


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def chain(first: TokenDelta, rest: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta]:
    yield first
    async for delta in rest:
        yield delta


def chat_chunks(rid: str, model: str, include_usage: bool) -> tuple[dict, Chunk]:
    """The opening chunk (the assistant role) and the chunk maker of a chat stream."""
    created = int(time.time())

    def chunk(delta: TokenDelta | None, usage: dict | None = None) -> dict:
        content = None if delta is None else ({"content": delta.text} if delta.text else {})
        c = oai.chat_chunk(rid, model, created, content, delta.finish_reason if delta else None, usage)
        if not include_usage:
            c.pop("usage")
        return c

    opening = oai.chat_chunk(rid, model, created, {"role": "assistant", "content": ""})
    if not include_usage:
        opening.pop("usage")
    return opening, chunk


def completion_chunks(rid: str, model: str, include_usage: bool) -> tuple[None, Chunk]:
    """No opening chunk, and the chunk maker of a completions stream."""
    created = int(time.time())

    def chunk(delta: TokenDelta | None, usage: dict | None = None) -> dict:
        text = None if delta is None else delta.text
        c = oai.completion_chunk(rid, model, created, text, delta.finish_reason if delta else None, usage)
        if not include_usage:
            c.pop("usage")
        return c

    return None, chunk


def chat_events(rid: str, model: str, include_usage: bool, first: TokenDelta, rest: AsyncIterator[TokenDelta]):
    """The events of a ``/v1/chat/completions`` stream."""
    return _events(rid, chat_chunks(rid, model, include_usage), include_usage, first, rest)


def completion_events(rid: str, model: str, include_usage: bool, first: TokenDelta, rest: AsyncIterator[TokenDelta]):
    """The events of a ``/v1/completions`` stream."""
    return _events(rid, completion_chunks(rid, model, include_usage), include_usage, first, rest)


async def _events(
    rid: str,
    chunks: tuple[dict | None, Chunk],
    include_usage: bool,
    first: TokenDelta,
    rest: AsyncIterator[TokenDelta],
) -> AsyncIterator[str]:
    """The stream's events: the opening chunk, a chunk per delta with text or a finish reason,
    an error event if the stream is cut (the status line is gone: reported in-band, as
    OpenAI does), the usage chunk if asked for, then ``[DONE]``."""
    opening, chunk = chunks
    if opening is not None:
        yield sse(opening)
    last = first
    try:
        async for delta in chain(first, rest):
            last = delta
            if delta.text or delta.finish_reason:
                yield sse(chunk(delta))
    except Exception as e:
        yield sse(stream_error(rid, e, last.completion_tokens))
    if include_usage:
        yield sse(chunk(None, oai.usage(last.prompt_tokens, last.completion_tokens)))
    yield sse("[DONE]")
