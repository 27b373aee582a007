"""A replica's output streams, paced: the first delta of a request goes out at once, later ones
are merged so that the replica sends at most about ``chunks_per_s`` chunks a second over all
of its streams.

Every chunk a replica yields travels as one Ray object to the ingress and as one server-sent
event through Serve's proxy, and that path costs the same per chunk whatever it carries. An
engine that makes tokens faster than the path carries chunks (on an H200, 12,000-18,000 tok/s
against ~1,700 chunks/s through one ingress) then idles while its output queues downstream
(docs/serving.md, "Streaming"). So each stream's interval between chunks is the number of open
streams over the budget, capped at ``max_interval_s``: at one stream an engine step's delta
goes alone, at 256 streams and a 1,000/s budget each stream sends a chunk every 0.25 s.

Merging keeps every token and its text in order, and usage from the last delta: what a client
reads is the same, in fewer pieces. A final delta (``finish_reason`` set) goes out at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from serve_app.engines.base import TokenDelta
from serve_app.serving.config import StreamOptions


def merge(deltas: list[TokenDelta]) -> TokenDelta:
    """One delta holding ``deltas`` in order (usage and finish reason from the last, the prompt's
    echo and logprobs from the first)."""
    if len(deltas) == 1:
        return deltas[0]
    first, last = deltas[0], deltas[-1]
    logprobs = None if first.logprobs is None else [lp for d in deltas for lp in d.logprobs or []]
    return TokenDelta(
        last.request_id,
        [t for d in deltas for t in d.token_ids],
        "".join(d.text for d in deltas),
        last.finish_reason,
        last.prompt_tokens,
        last.completion_tokens,
        logprobs,
        first.prompt_text,
        first.prompt_logprobs,
    )


class StreamPacer:
    """The open streams of one replica and the interval each keeps between its chunks."""

    def __init__(self, options: StreamOptions | None = None):
        self.options = options or StreamOptions()
        self.open = 0

    def interval_s(self) -> float:
        o = self.options
        return 0.0 if o.chunks_per_s <= 0 else min(o.max_interval_s, self.open / o.chunks_per_s)

    def pace(self, deltas: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta]:
        """``deltas`` paced, or as they are when there is no budget (``chunks_per_s`` 0)."""
        return self._paced(deltas) if self.options.chunks_per_s > 0 else deltas

    async def _paced(self, deltas: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta]:
        """``deltas`` as chunks: the first at once, then whatever arrived, at most one per interval.

        The engine's stream is read by a task of its own, so it never waits for the consumer; an
        error it raises reaches the consumer after the deltas before it. Closing this generator
        cancels that task and closes ``deltas`` (which aborts the request in the engine)."""
        loop = asyncio.get_running_loop()
        buffered: list[TokenDelta] = []
        arrived, finished = asyncio.Event(), asyncio.Event()
        failure: list[BaseException] = []

        async def pump() -> None:
            try:
                async for delta in deltas:
                    buffered.append(delta)
                    arrived.set()
                    if delta.finish_reason is not None:
                        break
            except Exception as e:  # noqa: BLE001 - handed to the consumer, in order
                failure.append(e)
            finally:
                finished.set()
                arrived.set()

        self.open += 1
        reader = asyncio.create_task(pump())
        try:
            sent_at = None
            while True:
                while not buffered and not finished.is_set():
                    arrived.clear()
                    await arrived.wait()
                if sent_at is not None and not finished.is_set():
                    wait = sent_at + self.interval_s() - loop.time()
                    if wait > 0:
                        try:  # the request's end cuts the wait short
                            await asyncio.wait_for(finished.wait(), wait)
                        except TimeoutError:
                            pass
                if buffered:
                    chunk = merge(buffered[:])
                    buffered.clear()
                    sent_at = loop.time()
                    yield chunk
                    continue
                if failure:
                    raise failure[0]
                return
        finally:
            self.open -= 1
            if not reader.done():
                reader.cancel()
            try:
                await reader
            except asyncio.CancelledError:
                pass
            aclose = getattr(deltas, "aclose", None)
            if aclose is not None:
                await aclose()
