"""The KV cache follows the load: nothing when idle, grown in chunks by steps that need more,
shrunk when sequences leave, with every slot's contents kept."""

import psutil
import torch

from serve_app.engines.base import GenerateRequest, SamplingParams
from serve_app.engines.embedded.kv_cache import POS_CHUNK, ROW_CHUNK, KVCache
from serve_app.engines.embedded.scheduler import Scheduler
from serve_app.engines.embedded.sequence import Sequence, Status

from .engine_helpers import sync_engine


def filled_cache(rows: int, length: int) -> KVCache:
    cache = KVCache(2, 32, 2, 1000, 4, "cpu", torch.float32)
    cache.reserve(rows, length)
    for k, v in zip(cache.k, cache.v, strict=True):
        k[:rows, :, :length] = torch.randn(rows, 2, length, 4)
        v[:rows, :, :length] = torch.randn(rows, 2, length, 4)
    return cache


def held(cache: KVCache, rows: int, length: int) -> list[torch.Tensor]:
    return [t[:rows, :, :length].clone() for t in cache.k + cache.v]


def test_finished_requests_move_one_decoding_sequence_each_at_most_and_every_sequence_keeps_its_own():
    cache = filled_cache(8, 50)
    statuses = [Status.DECODING] * 7 + [Status.PREFILLING]
    seqs = [Sequence(f"r{i}", [0] * 10, 10, SamplingParams(), None, print, status=st, slot=i, num_cached=50)
            for i, st in enumerate(statuses)]
    contents = {s.request_id: [t[s.slot, :, :50].clone() for t in cache.k + cache.v] for s in seqs}
    scheduler = Scheduler(cache, 8, 64)
    scheduler.running = list(seqs)
    moves = []
    move = cache.move
    cache.move = lambda src, dst, n: (moves.append((src, dst)), move(src, dst, n))  # counts, then copies
    for i in (1, 4):
        seqs[i].status = Status.FINISHED

    scheduler.remove_finished()

    # 5 decoding ones stay: those at 5 and 6 fill the holes at 1 and 4, the prefilling one
    # moves from 7 to 5, after them; 2, 3 and 0 stay put (compacting in order moved 5).
    assert moves == [(5, 1), (6, 4), (7, 5)]
    assert [(s.request_id, s.slot) for s in scheduler.running] == [
        ("r0", 0), ("r5", 1), ("r2", 2), ("r3", 3), ("r6", 4), ("r7", 5)]
    for s in scheduler.running:
        assert all(torch.equal(a, t[s.slot, :, :50]) for a, t in zip(contents[s.request_id], cache.k + cache.v,
                                                                      strict=True))


def test_a_new_cache_holds_nothing_and_grows_in_chunks_up_to_its_limits():
    cache = KVCache(2, 20, 2, 1000, 4, "cpu", torch.float32)
    assert cache.nbytes() == 0
    cache.reserve(3, 64)
    assert (cache.rows, cache.length) == (ROW_CHUNK, POS_CHUNK)
    cache.reserve(1, 64)  # less than it has: unchanged
    assert (cache.rows, cache.length) == (ROW_CHUNK, POS_CHUNK)
    cache.reserve(19, 1000)
    assert (cache.rows, cache.length) == (20, 1024) == (cache.num_slots, cache.capacity)
    assert cache.nbytes() == 2 * 2 * 20 * 2 * 1024 * 4 * 4


def test_growing_keeps_every_slots_keys_and_values():
    cache = filled_cache(5, 200)
    before = held(cache, 5, 200)
    cache.reserve(12, 600)
    assert all(torch.equal(a, b) for a, b in zip(before, held(cache, 5, 200), strict=True))
    assert all(not t[:, :, 200:].any() and not t[5:].any() for t in cache.k + cache.v)  # the rest is zeros


def test_fit_shrinks_only_below_half_and_keeps_what_the_slots_hold():
    cache = filled_cache(20, 700)
    assert not cache.fit(13, 700)  # 16 of 24 rows: over half
    before = held(cache, 6, 300)
    assert cache.fit(6, 300)
    assert (cache.rows, cache.length) == (ROW_CHUNK, 2 * POS_CHUNK)
    assert all(torch.equal(a, b) for a, b in zip(before, held(cache, 6, 300), strict=True))
    assert cache.fit(0, 0) and cache.nbytes() == 0
    half = filled_cache(16, 512)
    assert not half.fit(8, 512)  # exactly half: kept for the next arrivals
    assert half.fit(8, 256) and (half.rows, half.length) == (8, 256)


def test_fit_hands_the_pages_outside_its_bound_back():
    cache = filled_cache(20, 700)  # 24 slots of 768 positions in bound, 20 x 700 written
    kept = held(cache, 6, 300)
    assert cache.fit(6, 300)  # 8 slots of 512 positions
    assert all(torch.equal(a, b) for a, b in zip(kept, held(cache, 6, 300), strict=True))
    assert all(not t[8:].any() and not t[:, :, 512:].any() for t in cache.k + cache.v)  # zeros again


def test_growing_copies_nothing_and_a_release_lowers_the_rss():
    mib = 1 << 20
    cache = KVCache(1, 32, 2, 2048, 64, "cpu", torch.float32)  # 32 MiB of keys, 32 of values
    cache.reserve(8, 256)
    k0 = cache.k[0]
    rss = psutil.Process().memory_info().rss
    cache.reserve(32, 2048)
    assert cache.k[0] is k0  # the same tensor: growing moved nothing
    for t in cache.k + cache.v:
        t.fill_(1.0)
    written = psutil.Process().memory_info().rss
    assert written - rss > 56 * mib
    assert cache.fit(0, 0) and cache.nbytes() == 0
    assert written - psutil.Process().memory_info().rss > 56 * mib


def test_the_engine_cache_grows_with_the_requests_and_is_released_when_they_finish():
    engine = sync_engine(model="tiny-random", max_num_seqs=16, max_model_len=1024)
    core = engine.core
    assert core.cache.nbytes() == 0
    for i in range(12):
        params = SamplingParams(max_tokens=300, ignore_eos=True, temperature=0)
        core.add(engine.make_sequence(GenerateRequest(f"r{i}", prompt=f"Count {i}:", params=params), lambda d: None))
    seen = set()
    while core.has_work():
        core.step()
        running = core.scheduler.running
        if running:
            assert core.cache.rows >= len(running)
            assert core.cache.length >= max(s.num_cached for s in running)
        seen.add((core.cache.rows, core.cache.length))
    assert {(16, POS_CHUNK), (16, 2 * POS_CHUNK)} <= seen  # 12 rows in chunks of 8; past 256 positions
    assert core.cache.nbytes() == 0
