"""The async engine: validation at submission, streaming, aborts, switching while serving."""

import asyncio
import random

import pytest

from serve_app.engines.base import (
    EngineOverloadedError,
    GenerateRequest,
    InvalidRequestError,
    SamplingParams,
)
from serve_app.engines.embedded import EmbeddedEngine

from .engine_helpers import run_greedy, sync_engine

PROMPTS = [f"Request {i}: " + " ".join(f"t{(i * 5 + j) % 11}" for j in range(4 + 2 * i)) for i in range(12)]


@pytest.fixture(scope="module")
def engine():
    eng = EmbeddedEngine(model="tiny-random", max_num_seqs=8, max_model_len=128, max_waiting=64)
    eng.start_sync()
    yield eng
    asyncio.run(eng.shutdown())


async def collect(engine, request):
    deltas = [d async for d in engine.generate(request)]
    return deltas


def req(i, prompt=None, **params):
    params.setdefault("ignore_eos", True)
    return GenerateRequest(f"q{i}", prompt=PROMPTS[i % len(PROMPTS)] if prompt is None else prompt,
                           params=SamplingParams(**params))


@pytest.mark.parametrize("bad, param", [
    (dict(prompt=""), "prompt"),
    (dict(prompt="word " * 200), "prompt"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=120), "max_tokens"),  # prompt + max_tokens over the context
    (dict(stop=[""]), "stop"),
    (dict(stop="not a list"), "stop"),
    (dict(stop=[1, 2]), "stop"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
])
def test_bad_requests_fail_at_submission_naming_the_field(engine, bad, param):
    async def main():
        prompt = bad.pop("prompt", None)
        with pytest.raises(InvalidRequestError) as err:
            engine.generate(req(0, prompt=prompt, **bad))
        assert err.value.param == param and err.value.message
    asyncio.run(main())


def test_the_engine_keeps_serving_others_around_bad_requests(engine):
    async def main():
        good = [asyncio.create_task(collect(engine, req(i, max_tokens=12))) for i in range(4)]
        for _ in range(4):
            with pytest.raises(InvalidRequestError):
                engine.generate(req(9, prompt=""))
        results = await asyncio.gather(*good)
        for deltas in results:
            assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 12
    asyncio.run(main())


def test_streams_match_the_synchronous_reference_while_num_steps_changes_underneath(engine):
    reference = run_greedy(sync_engine(model="tiny-random", max_num_seqs=8, max_model_len=128),
                           PROMPTS, lambda s: 0, max_tokens=30, together=False)

    async def main():
        rng = random.Random(3)
        stop = asyncio.Event()

        async def switcher():
            while not stop.is_set():
                await engine.set_num_steps(rng.choice([0, 2, 3, 5]))
                await asyncio.sleep(0.003)
        task = asyncio.create_task(switcher())
        results = await asyncio.gather(*(collect(engine, req(i, max_tokens=30)) for i in range(len(PROMPTS))))
        stop.set()
        await task
        await engine.set_num_steps(0)
        return [[t for d in deltas for t in d.token_ids] for deltas in results], results
    outputs, results = asyncio.run(main())
    assert outputs == reference
    for deltas in results:
        assert deltas[-1].finish_reason == "length"
        assert deltas[-1].prompt_tokens > 0 and deltas[-1].completion_tokens == 30
        assert "".join(d.text for d in deltas)


def test_a_consumer_that_goes_away_frees_its_slot(engine):
    async def main():
        stream = engine.generate(req(1, max_tokens=100))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):
            if engine.load().running == 0:
                return True
            await asyncio.sleep(0.02)
        return False
    assert asyncio.run(main())


def test_a_consumer_that_goes_away_beside_others_leaves_the_engine_serving(engine):
    """Aborting slot 0 moves the next sequence's cache into it, off the step."""
    async def main():
        first = engine.generate(req(2, max_tokens=100))
        second = asyncio.ensure_future(collect(engine, req(3, max_tokens=40)))
        n = 0
        async for _ in first:
            n += 1
            if n == 5:
                break
        await first.aclose()
        deltas = await asyncio.wait_for(second, 60)
        after = await asyncio.wait_for(collect(engine, req(4, max_tokens=8)), 60)
        return deltas[-1].completion_tokens, after[-1].completion_tokens
    assert asyncio.run(main()) == (40, 8)


def test_seeded_sampling_is_reproducible(engine):
    async def main():
        a = await collect(engine, req(2, max_tokens=16, temperature=0.9, top_p=0.9, seed=42))
        b = await collect(engine, req(2, max_tokens=16, temperature=0.9, top_p=0.9, seed=42))
        return [t for d in a for t in d.token_ids], [t for d in b for t in d.token_ids]
    a, b = asyncio.run(main())
    assert a == b and len(a) == 16


def test_a_switch_shows_in_the_steps_a_running_engine_reports_before_its_next_step():
    eng = sync_engine(model="tiny-random", max_num_seqs=8, max_model_len=128)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    eng.core.add(eng.make_sequence(GenerateRequest("r0", prompt=PROMPTS[0], params=sp), lambda d: None))
    asyncio.run(eng.set_num_steps(4))
    while eng.core.last_num_steps != 4:  # its prefill, then a decode step of 4 drafts
        eng.core.step()
    assert (eng.load().running, eng.load().active_num_steps) == (1, 4)
    asyncio.run(eng.set_num_steps(0))  # no step has run under it yet: the report is the new mode's
    assert (eng.load().running, eng.load().active_num_steps) == (1, 0)
    eng.core.step()
    assert eng.core.last_num_steps == 0 and eng.load().active_num_steps == 0
    asyncio.run(eng.set_num_steps(2))
    assert eng.load().active_num_steps == 2
    eng.core.step()
    assert eng.load().active_num_steps == eng.core.last_num_steps == 2


def test_load_reports_queue_and_num_steps(engine):
    async def main():
        await engine.set_num_steps(3)
        tasks = [asyncio.create_task(collect(engine, req(i, max_tokens=20))) for i in range(12)]
        await asyncio.sleep(0.05)
        busy = engine.load()
        await asyncio.gather(*tasks)
        await engine.set_num_steps(0)
        return busy, engine.load()
    busy, idle = asyncio.run(main())
    assert busy.num_steps == 3 and busy.running + busy.waiting > 0
    assert idle.running == 0 and idle.output_tokens_per_s > 0


def test_a_full_queue_refuses_new_requests_with_overloaded():
    eng = EmbeddedEngine(model="tiny-random", max_num_seqs=1, max_model_len=64, max_waiting=0)
    eng.start_sync()
    try:
        async def main():
            with pytest.raises(EngineOverloadedError):
                eng.generate(req(0, max_tokens=4))
        asyncio.run(main())
    finally:
        asyncio.run(eng.shutdown())


def test_num_steps_out_of_range_is_refused(engine):
    with pytest.raises(InvalidRequestError):
        asyncio.run(engine.set_num_steps(99))


def test_the_waiting_queue_is_bounded_once_requests_reach_the_scheduler():
    eng = EmbeddedEngine(model="tiny-random", max_num_seqs=1, max_model_len=2100, max_waiting=2)
    eng.start_sync()
    try:
        async def main():
            accepted, refused = [], 0
            for i in range(8):
                try:
                    accepted.append(eng.generate(req(i, max_tokens=2000)))
                except EngineOverloadedError:
                    refused += 1
                await asyncio.sleep(0.05)  # let the step thread move requests into its queue
            for stream in accepted:
                await stream.aclose()
            return len(accepted), refused
        accepted, refused = asyncio.run(main())
        assert accepted <= 1 + 2 and refused >= 8 - 3
    finally:
        asyncio.run(eng.shutdown())


def end_thread(thread, exc=SystemExit) -> None:
    """Raise ``exc`` in ``thread`` at its next Python bytecode (CPython's async exception)."""
    import ctypes

    assert ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc)) == 1


def test_an_ended_step_thread_fails_its_requests_and_every_new_one_and_the_health_check():
    """No request waits forever on a step thread that is gone: those it held raise
    EngineDeadError, and so do check_health and every request after."""
    from serve_app.engines.base import EngineDeadError

    eng = EmbeddedEngine(model="tiny-random", max_num_seqs=4, max_model_len=128)
    eng.start_sync()

    async def main():
        eng.check_health()
        streams = [eng.generate(req(i, max_tokens=100)) for i in range(3)]
        first = [await anext(s) for s in streams]  # all running
        assert all(d.finish_reason is None for d in first)
        end_thread(eng._thread)
        await asyncio.to_thread(eng._thread.join, 10)
        assert not eng._thread.is_alive()
        for s in streams:
            with pytest.raises(EngineDeadError, match="SystemExit"):
                async for _ in s:
                    pass
        with pytest.raises(EngineDeadError):
            eng.check_health()
        with pytest.raises(EngineDeadError):
            eng.generate(req(9, max_tokens=4))

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        asyncio.run(eng.shutdown())
