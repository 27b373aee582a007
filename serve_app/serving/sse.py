"""Server-sent events of the OpenAI streaming endpoints: one generator for chat and
completions, each with its own chunk shape, over one stream per choice."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable

from serve_app.engines.base import TokenDelta
from serve_app.serving import openai_protocol as oai
from serve_app.serving.errors import stream_error

Stream = tuple[TokenDelta, AsyncIterator[TokenDelta]]
"""A started stream: its first delta and the rest."""
Chunk = Callable[[int, TokenDelta | None, dict | None], dict]
"""The chunk of choice ``index`` for a delta (usage None), or the usage-only final chunk (delta None)."""


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def chain(first: TokenDelta, rest: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta]:
    yield first
    async for delta in rest:
        yield delta


def chat_chunks(rid: str, model: str, include_usage: bool, logprobs: bool = False
                ) -> tuple[Callable[[int], dict], Chunk]:
    """The opening chunk of a choice (the assistant role) and the chunk maker of a chat stream."""
    created = int(time.time())

    def chunk(index: int, delta: TokenDelta | None, usage: dict | None = None) -> dict:
        content = None if delta is None else ({"content": delta.text} if delta.text else {})
        lp = oai.chat_logprobs(delta.logprobs or []) if logprobs and delta is not None else None
        c = oai.chat_chunk(rid, model, created, content, delta.finish_reason if delta else None, usage, index, lp)
        if not include_usage:
            c.pop("usage")
        return c

    def opening(index: int) -> dict:
        c = oai.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, index=index)
        if not include_usage:
            c.pop("usage")
        return c

    return opening, chunk


def completion_chunks(rid: str, model: str, include_usage: bool, logprobs: bool = False) -> tuple[None, Chunk]:
    """No opening chunk, and the chunk maker of a completions stream (an echoed prompt opens its
    choice's first chunk)."""
    created = int(time.time())
    renderers: dict[int, oai.CompletionLogprobs] = {}

    def chunk(index: int, delta: TokenDelta | None, usage: dict | None = None) -> dict:
        text, lp = None, None
        if delta is not None:
            text, lp = oai.completion_choice(delta, renderers.setdefault(index, oai.CompletionLogprobs(logprobs)))
        c = oai.completion_chunk(rid, model, created, text, delta.finish_reason if delta else None, usage, index, lp)
        if not include_usage:
            c.pop("usage")
        return c

    return None, chunk


def chat_events(rid: str, model: str, include_usage: bool, streams: list[Stream], n: int = 1,
                logprobs: bool = False):
    """The events of a ``/v1/chat/completions`` stream: choice ``i`` from ``streams[i]``."""
    return _events(rid, chat_chunks(rid, model, include_usage, logprobs), include_usage, streams, n)


def completion_events(rid: str, model: str, include_usage: bool, streams: list[Stream], n: int = 1,
                      logprobs: bool = False):
    """The events of a ``/v1/completions`` stream: choice ``i`` from ``streams[i]``, ``n`` per prompt."""
    return _events(rid, completion_chunks(rid, model, include_usage, logprobs), include_usage, streams, n)


async def _merged(streams: list[Stream]) -> AsyncIterator[tuple[int, TokenDelta | Exception]]:
    """(choice, delta) as each stream delivers; (choice, exception) where one fails."""
    if len(streams) == 1:  # no tasks for the common case
        try:
            async for delta in chain(*streams[0]):
                yield 0, delta
        except Exception as e:
            yield 0, e
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: Stream) -> None:
        try:
            async for delta in chain(*stream):
                await queue.put((index, delta))
        except Exception as e:
            await queue.put((index, e))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    ended: set[int] = set()
    try:
        while len(ended) < len(streams):
            index, item = await queue.get()
            if item is None:
                ended.add(index)
            else:
                yield index, item
    finally:  # the client went away: stop the choices still running, on their replicas too
        for index, task in enumerate(tasks):
            if index not in ended:
                task.cancel()
                rest = streams[index][1]
                if hasattr(rest, "cancel"):
                    rest.cancel()


async def _events(rid: str, chunks: tuple, include_usage: bool, streams: list[Stream], n: int) -> AsyncIterator[str]:
    """The stream's events: each choice's opening chunk, a chunk per delta with text or a finish
    reason, an error event for a choice whose stream is cut (the status line is gone: reported
    in-band, as OpenAI does), the usage chunk if asked for, then ``[DONE]``."""
    opening, chunk = chunks
    if opening is not None:
        for index in range(len(streams)):
            yield sse(opening(index))
    last = [first for first, _ in streams]
    async with contextlib.aclosing(_merged(streams)) as merged:
        async for index, item in merged:
            if isinstance(item, Exception):
                yield sse(stream_error(rid, item, last[index].completion_tokens))
                continue
            last[index] = item
            if item.text or item.finish_reason or item.logprobs or item.prompt_text or item.prompt_logprobs:
                yield sse(chunk(index, item))
    if include_usage:
        prompt_tokens = sum(d.prompt_tokens for i, d in enumerate(last) if i % n == 0)  # n choices share a prompt
        usage = oai.usage(prompt_tokens, sum(d.completion_tokens for d in last))
        yield sse(chunk(0, None, usage))
    yield sse("[DONE]")
