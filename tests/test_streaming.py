"""The replica's stream pacing: the first delta at once, later ones merged per interval, every
token kept in order, the end and errors passed on, the engine's stream closed when the client
goes."""

import asyncio
import itertools
import time

import pytest

from serve_app.engines.base import TokenDelta
from serve_app.serving.config import AppArgs, StreamOptions
from serve_app.serving.streaming import StreamPacer, merge


async def engine_stream(n: int, every_s: float, log: list, fail_after: int | None = None):
    """n deltas of one token each, ``every_s`` apart, the last one finished; ``log`` records
    what happened to the stream (made, closed)."""
    try:
        for i in range(n):
            if fail_after is not None and i == fail_after:
                raise RuntimeError("engine died")
            await asyncio.sleep(every_s)
            log.append(("made", i, time.perf_counter()))
            yield TokenDelta("r", [i], f"<{i}>", "length" if i == n - 1 else None, 5, i + 1)
    finally:
        log.append(("closed", None, time.perf_counter()))


async def collect(pacer: StreamPacer, source) -> list[tuple[TokenDelta, float]]:
    return [(chunk, time.perf_counter()) async for chunk in pacer.pace(source)]


def test_merge_keeps_every_token_in_order_and_the_last_usage():
    a = TokenDelta("r", [1, 2], "ab", None, 7, 2)
    b = TokenDelta("r", [3], "c", "stop", 7, 3)
    assert merge([a, b]) == TokenDelta("r", [1, 2, 3], "abc", "stop", 7, 3)
    assert merge([a]) is a


def test_without_a_budget_every_engine_delta_is_its_own_chunk():
    log = []
    chunks = asyncio.run(collect(StreamPacer(StreamOptions(chunks_per_s=0)), engine_stream(20, 0.001, log)))
    assert [c.token_ids for c, _ in chunks] == [[i] for i in range(20)]


def test_under_load_deltas_merge_per_interval_and_the_first_and_last_go_at_once():
    pacer = StreamPacer(StreamOptions(chunks_per_s=100, max_interval_s=1.0))
    pacer.open = 3  # with this stream 4 open: one chunk every 40 ms
    assert pacer.interval_s() == 0.0 + 3 / 100
    log = []
    chunks = asyncio.run(collect(pacer, engine_stream(60, 0.002, log)))
    made = {i: t for kind, i, t in log if kind == "made"}
    tokens = [t for c, _ in chunks for t in c.token_ids]
    assert tokens == list(range(60))
    assert "".join(c.text for c, _ in chunks) == "".join(f"<{i}>" for i in range(60))
    assert chunks[0][0].token_ids == [0], "the first delta is not held back"
    assert 3 <= len(chunks) <= 15, f"{len(chunks)} chunks for 60 deltas over ~0.15 s at one per 40 ms"
    last, sent = chunks[-1]
    assert last.finish_reason == "length" and last.completion_tokens == 60
    assert sent - made[59] < 0.03, "the final delta waited for the interval"
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(chunks[1:-1])]
    assert all(g > 0.03 for g in gaps), gaps
    assert pacer.open == 3


def test_an_engine_error_reaches_the_consumer_after_the_deltas_before_it():
    pacer = StreamPacer(StreamOptions(chunks_per_s=0))
    got = []

    async def run():
        async for chunk in pacer.pace(engine_stream(10, 0.001, [], fail_after=4)):
            got.extend(chunk.token_ids)

    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(run())
    assert got == [0, 1, 2, 3]
    assert pacer.open == 0


def test_a_client_that_goes_away_closes_the_engine_stream():
    pacer = StreamPacer(StreamOptions(chunks_per_s=1000))
    log = []

    async def run():
        stream = pacer.pace(engine_stream(1000, 0.001, log))
        async for chunk in stream:
            if chunk.completion_tokens >= 3:
                break
        await stream.aclose()
        made = sum(1 for kind, *_ in log if kind == "made")
        await asyncio.sleep(0.05)  # a reader left running would go on making deltas
        return made

    made = asyncio.run(run())
    assert ("closed", None) in [(k, i) for k, i, _ in log]
    assert sum(1 for kind, *_ in log if kind == "made") == made
    assert pacer.open == 0


def test_app_args_take_a_streaming_section_and_refuse_bad_values():
    assert AppArgs().streaming.chunks_per_s == 200.0
    assert AppArgs(streaming={"chunks_per_s": 0}).streaming.chunks_per_s == 0
    with pytest.raises(ValueError, match="chunks_per_s"):
        AppArgs(streaming={"chunks_per_s": -1})
    with pytest.raises(ValueError, match="extra"):
        AppArgs(streaming={"chunk_per_s": 5})
