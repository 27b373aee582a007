"""Lossless switching: greedy output never depends on num_steps, however often it changes."""

import random

import pytest

from serve_app.tools.bench.prompts import PROMPT_SETS

from .engine_helpers import run_greedy, sync_engine

TINY_PROMPTS = [f"Prompt {i}: " + " ".join(f"w{(i * 7 + j) % 13}" for j in range(5 + 3 * i)) for i in range(20)]


def random_schedule(seed: int, choices=(0, 1, 2, 3, 5), every=(1, 4)):
    rng = random.Random(seed)
    state = {"k": 0, "until": 0}

    def schedule(step: int) -> int:
        if step >= state["until"]:
            state["k"], state["until"] = rng.choice(choices), step + rng.randint(*every)
        return state["k"]
    return schedule


# Each format doubles this file's run: int8 and bfloat16 get one short test below. The bfloat16
# rounding of the compact formats turns any last-bit difference between a row decoded alone
# and verified in a batch into a flipped argmax, so they check that products and attention are
# row-invariant (test_linear.py, test_attention.py).
@pytest.fixture(scope="module", params=["float32", "q4_1", "gguf"])
def tiny(request):
    # A small prefill budget makes long prompts prefill in chunks while others decode.
    return sync_engine(model="tiny-random", max_num_seqs=8, max_model_len=256, max_prefill_tokens=24,
                       weights=request.param)


@pytest.mark.parametrize("together", [False, True], ids=["alone", "batched"])
def test_tiny_model_output_is_identical_for_every_num_steps_and_random_switches(tiny, together):
    reference = run_greedy(tiny, TINY_PROMPTS, lambda s: 0, max_tokens=40, together=False)
    for k in (3, 5):
        assert run_greedy(tiny, TINY_PROMPTS, lambda s, k=k: k, max_tokens=40, together=together) == reference
    for seed in range(3):
        assert run_greedy(tiny, TINY_PROMPTS, random_schedule(seed), max_tokens=40, together=together) == reference
    assert tiny.core.totals["accepted"] > 0, "drafts were never accepted: the test did not exercise verify"
    assert tiny.core.totals["proposed"] > tiny.core.totals["accepted"], "drafts were never rejected"
    counts = tiny.core.verify_counts  # (drafts, accepted) per verify, as bench acceptance reads them
    assert sum(counts.values()) == tiny.core.totals["verifies"]
    assert sum(k * n for (k, _), n in counts.items()) == tiny.core.totals["proposed"]
    assert sum(a * n for (_, a), n in counts.items()) == tiny.core.totals["accepted"]


def test_more_requests_than_slots_queue_and_still_match(tiny):
    prompts = TINY_PROMPTS * 2  # 40 requests through 8 slots: admission, compaction, chunked prefill
    reference = run_greedy(tiny, prompts[:20], lambda s: 0, max_tokens=24, together=False) * 2
    assert run_greedy(tiny, prompts, random_schedule(7), max_tokens=24, together=True) == reference


def test_stop_strings_end_at_the_same_token_with_and_without_speculation(tiny):
    reference = run_greedy(tiny, TINY_PROMPTS[:6], lambda s: 0, max_tokens=40, together=False)
    text = tiny.tokenizer.decode(reference[0][10:12])
    stop = [text.strip()[:3]] if text.strip() else ["w"]
    plain = run_greedy(tiny, TINY_PROMPTS[:6], lambda s: 0, max_tokens=40, stop=stop)
    spec = run_greedy(tiny, TINY_PROMPTS[:6], lambda s: 5, max_tokens=40, stop=stop)
    assert plain == spec
    assert len(plain[0]) < 40, "the stop string never matched: the test did not test stopping"


def test_stop_strings_wait_for_min_tokens_the_same_with_and_without_speculation(tiny):
    reference = run_greedy(tiny, TINY_PROMPTS[:6], lambda s: 0, max_tokens=40, together=False)
    text = tiny.tokenizer.decode(reference[0][10:12])
    stop = [text.strip()[:3]] if text.strip() else ["w"]
    early = run_greedy(tiny, TINY_PROMPTS[:6], lambda s: 0, max_tokens=40, stop=stop)
    assert len(early[0]) < 40, "the stop string never matched: the test did not test stopping"
    late = run_greedy(tiny, TINY_PROMPTS[:6], lambda s: 0, max_tokens=40, stop=stop, min_tokens=len(early[0]) + 1)
    assert len(late[0]) > len(early[0])  # the stop string did not end it before min_tokens
    assert run_greedy(tiny, TINY_PROMPTS[:6], lambda s: 5, max_tokens=40, stop=stop,
                      min_tokens=len(early[0]) + 1) == late


def test_a_request_that_ends_at_its_first_token_is_not_decoded_again(tiny):
    for k in (0, 3):
        assert [len(out) for out in run_greedy(tiny, TINY_PROMPTS[:6], lambda s, k=k: k, max_tokens=1)] == [1] * 6


def test_stop_token_ids_end_at_the_same_token_with_and_without_speculation(tiny):
    plain = run_greedy(tiny, TINY_PROMPTS, lambda s: 0, max_tokens=40, together=False)
    stop = sorted({out[6] for out in plain})[:4]
    reference = run_greedy(tiny, TINY_PROMPTS, lambda s: 0, max_tokens=40, together=False, stop_token_ids=stop)
    ended = [out for out in reference if len(out) < 40]
    assert ended, "no stop token id was generated: the test did not exercise them"
    for out in ended:  # the request ends at the first stop id, which is in its output ids
        assert out[-1] in stop and not set(out[:-1]) & set(stop)
    for schedule in (lambda s: 3, lambda s: 5, random_schedule(7)):
        assert run_greedy(tiny, TINY_PROMPTS, schedule, max_tokens=40, stop_token_ids=stop) == reference


def test_min_tokens_bans_stops_at_the_same_positions_with_and_without_speculation(tiny):
    plain = run_greedy(tiny, TINY_PROMPTS, lambda s: 0, max_tokens=40, together=False)
    first = sorted({out[0] for out in plain})  # every request's plain first token becomes a stop id
    reference = run_greedy(tiny, TINY_PROMPTS, lambda s: 0, max_tokens=40, together=False,
                           stop_token_ids=first, min_tokens=6)
    for out, p in zip(reference, plain, strict=True):
        assert not set(out[:6]) & set(first), "a stop id came before min_tokens"
        assert out[0] != p[0]  # the ban changed what greedy picks there
    for schedule in (lambda s: 3, lambda s: 5, random_schedule(8)):
        again = run_greedy(tiny, TINY_PROMPTS, schedule, max_tokens=40, stop_token_ids=first, min_tokens=6)
        assert again == reference


def test_per_request_draft_caps_cap_the_drafts_and_change_no_greedy_output(tiny):
    reference = run_greedy(tiny, TINY_PROMPTS, lambda s: 0, max_tokens=40, together=False)
    totals = tiny.core.totals
    before = dict(totals)
    assert run_greedy(tiny, TINY_PROMPTS, lambda s: 5, max_tokens=40, spec_max_steps=2) == reference
    proposed, verifies = totals["proposed"] - before["proposed"], totals["verifies"] - before["verifies"]
    assert 0 < proposed <= 2 * verifies  # every verify held at most 2 drafts
    before = dict(totals)
    assert run_greedy(tiny, TINY_PROMPTS, lambda s: 5, max_tokens=40, spec_max_steps=0) == reference
    assert totals["proposed"] == before["proposed"]  # "off" drafts nothing
    caps = [{"spec_max_steps": (None, 0, 1, 3)[i % 4]} for i in range(len(TINY_PROMPTS))]
    assert run_greedy(tiny, TINY_PROMPTS, random_schedule(5), max_tokens=40, per_prompt=caps) == reference


def test_long_prompts_are_capped_by_the_engine_option():
    engine = sync_engine(model="tiny-random", max_num_seqs=8, max_model_len=256, max_prefill_tokens=24,
                         long_prompt_tokens=60, long_prompt_max_steps=0)
    reference = run_greedy(engine, TINY_PROMPTS, lambda s: 0, max_tokens=24, together=False)
    lengths = [len(engine.tokenize(p)) for p in TINY_PROMPTS]
    assert min(lengths) <= 60 < max(lengths)
    assert run_greedy(engine, TINY_PROMPTS, lambda s: 4, max_tokens=24) == reference
    before = engine.core.totals["proposed"]
    long_only = [p for p, n in zip(TINY_PROMPTS, lengths, strict=True) if n > 60]
    run_greedy(engine, long_only, lambda s: 4, max_tokens=24)
    assert engine.core.totals["proposed"] == before  # none of them drafted


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_the_other_compact_formats_keep_greedy_output_for_every_num_steps(weights):
    engine = sync_engine(model="tiny-random", max_num_seqs=8, max_model_len=256, max_prefill_tokens=24,
                         weights=weights)
    reference = run_greedy(engine, TINY_PROMPTS, lambda s: 0, max_tokens=24, together=False)
    for schedule in (lambda s: 4, random_schedule(3)):
        assert run_greedy(engine, TINY_PROMPTS, schedule, max_tokens=24, together=True) == reference
    assert engine.core.totals["accepted"] > 0


@pytest.mark.real_model
@pytest.mark.parametrize("weights", ["float32", "q4_1", "gguf"])
def test_real_model_greedy_output_is_identical_for_every_num_steps_alone_and_batched(weights):
    engine = sync_engine(max_num_seqs=24, max_model_len=1024, weights=weights)
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}])
               for p in PROMPT_SETS["copy"][:6] + PROMPT_SETS["chat"][:6]]
    reference = run_greedy(engine, prompts, lambda s: 0, max_tokens=24, together=False)
    assert run_greedy(engine, prompts, lambda s: 3, max_tokens=24, together=False) == reference
    assert run_greedy(engine, prompts, random_schedule(1), max_tokens=24, together=False) == reference
    for schedule in (lambda s: 0, lambda s: 5, random_schedule(2)):
        assert run_greedy(engine, prompts, schedule, max_tokens=24, together=True) == reference
    assert engine.core.totals["accepted"] > 0


def test_adaptive_steps_vary_per_step_and_per_sequence_and_change_no_greedy_output(tiny):
    """The engine picks each step's draft lengths under the ceiling, per sequence (a ragged
    verify); requests with their own caps draft fewer inside the same batch."""
    from serve_app.control.steps import StepCost, StepPolicyConfig
    from serve_app.engines.embedded.adaptive import StepChooser

    reference = run_greedy(tiny, TINY_PROMPTS, lambda s: 0, max_tokens=40, together=False)
    caps = [{"spec_max_steps": (None, 0, 1, 3)[i % 4]} for i in range(len(TINY_PROMPTS))]
    ran: set[str] = set()
    ks: set[int] = set()
    ragged = 0
    try:
        for seed, min_gain in enumerate((1.0, 1.02, 1.2)):
            tiny.core.chooser = chooser = StepChooser(StepPolicyConfig(min_gain=min_gain, probe_interval_s=0.01))
            assert run_greedy(tiny, TINY_PROMPTS, random_schedule(seed), max_tokens=40) == reference
            assert run_greedy(tiny, TINY_PROMPTS, random_schedule(seed + 9), max_tokens=40, per_prompt=caps) == reference
            ran |= set(chooser.reasons)
            ks |= {k for _, k, _ in chooser.history}
            ragged += chooser.per_sequence_steps
            assert not chooser.requests, "finished requests left acceptance estimates behind"
        # Drafting priced near free (a long memory, so this machine's steps barely move it):
        # every sequence drafts up to its own cap, so caps of 0, 1 and 3 in one batch give
        # lengths of their own whatever this machine's speed.
        tiny.core.chooser = chooser = StepChooser(StepPolicyConfig(probe_interval_s=0.01))
        chooser.cost = StepCost(half_life=1e9, cell_half_life=1e9)
        for _ in range(200):
            for b in range(1, 9):
                for k in range(6):
                    chooser.cost.observe(b, k, 0.01 + 1e-5 * b * (1 + k))
        assert run_greedy(tiny, TINY_PROMPTS, random_schedule(7, choices=(3, 5)), max_tokens=40,
                          per_prompt=caps) == reference
        ragged += chooser.per_sequence_steps
    finally:
        tiny.core.chooser = None
    assert {"gain", "gate"} <= ran and len(ks) >= 3, f"the chooser never varied the draft length: {ran}, {ks}"
    assert ragged > 0, "no step gave its sequences lengths of their own"


def test_a_ragged_verify_gives_the_padded_ones_results_at_every_fed_position(tiny):
    """``Llama.forward(fed=...)`` runs the per-position work on the fed positions alone; what it
    returns there, and the keys and values it caches there, are the padded call's, bit for bit."""
    import torch

    from serve_app.engines.embedded.kv_cache import KVCache

    model, s = tiny.core.model, tiny.core.model.shape
    taps = tiny.core.taps or (0, s.num_layers // 2)
    torch.manual_seed(0)
    prompts = torch.randint(3, s.vocab_size, (3, 9))
    fed, q = [1, 4, 2], 4
    tokens = torch.randint(3, s.vocab_size, (3, q))
    out = {}
    for name, rows in (("padded", None), ("ragged", fed)):
        cache = KVCache(s.num_layers, 3, s.num_kv_heads, 32, s.head_dim, model.device, model.dtype)
        with torch.inference_mode():
            model.forward(prompts, torch.zeros(3, dtype=torch.long), cache)
            logits, hidden = model.forward(tokens, torch.full((3,), 9), cache, taps=taps, fed=rows)
        out[name] = logits, hidden, [k.clone() for k in cache.k], [v.clone() for v in cache.v]
    for b, n in enumerate(fed):
        assert torch.equal(out["ragged"][0][b, :n], out["padded"][0][b, :n])
        assert torch.equal(out["ragged"][1][b, :n], out["padded"][1][b, :n])
        assert not out["ragged"][0][b, n:].any()  # padding: zeros
        for layer in range(s.num_layers):
            for i in (2, 3):  # keys, values up to the last fed position
                assert torch.equal(out["ragged"][i][layer][b, :, :9 + n], out["padded"][i][layer][b, :, :9 + n])
