"""The EAGLE-style draft head: trained by its command, checksummed, lossless in the engine."""

import json

import pytest
import torch

from serve_app.engines.embedded.eagle import catch_up_groups, default_head_path, load_head
from serve_app.tools import train_draft_head
from serve_app.tools.bench.prompts import PROMPT_SETS, chat_messages

from .engine_helpers import run_greedy, sync_engine
from .test_engine_lossless import TINY_PROMPTS, random_schedule


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory):
    """A head for tiny-random, trained by the real command on the target's own answers to the
    test prompts (a random model generalises to nothing else), in a few seconds."""
    out = tmp_path_factory.mktemp("head") / "tiny.safetensors"
    engine = sync_engine(model="tiny-random")
    prompts = tmp_path_factory.getbasetemp() / "samples.pt"
    ids = [engine.tokenize(p) for p in TINY_PROMPTS]
    samples = train_draft_head.generate(engine.core.model, ids, 40, set(), batch=20)
    flat = [torch.tensor(x, dtype=torch.int32) for s in samples for x in s]
    torch.save({"ids": torch.cat(flat), "lengths": torch.tensor([len(x) for x in flat])}, prompts)
    assert train_draft_head.main(["--model", "tiny-random", "--device", "cpu", "--out", str(out), "--samples",
                                  str(prompts), "--draft-vocab", "2048", "--batch", "4", "--max-updates", "150",
                                  "--lr", "3e-3"]) == 0
    return out


@pytest.fixture(scope="module", params=["float32", "gguf"])
def tiny(tiny_head, request):
    # gguf: the head's products in Q4_1 as well (its drafts change, the output must not)
    return sync_engine(model="tiny-random", max_num_seqs=8, max_model_len=256, max_prefill_tokens=24,
                       drafter="eagle", draft_head=str(tiny_head), weights=request.param)


@pytest.mark.parametrize("together", [False, True], ids=["alone", "batched"])
def test_eagle_output_is_identical_for_every_num_steps_and_random_switches(tiny, together):
    reference = run_greedy(tiny, TINY_PROMPTS, lambda s: 0, max_tokens=40, together=False)
    for k in (3, 5):
        assert run_greedy(tiny, TINY_PROMPTS, lambda s, k=k: k, max_tokens=40, together=together) == reference
    for seed in range(2):
        assert run_greedy(tiny, TINY_PROMPTS, random_schedule(seed), max_tokens=40, together=together) == reference
    totals = tiny.core.totals
    assert totals["accepted"] > 0.2 * totals["verifies"], "the head barely drafts right: verify went untested"
    assert totals["proposed"] > totals["accepted"], "drafts were never rejected"


@pytest.mark.parametrize("weights", ["float32", "gguf"])
def test_hybrid_drafts_by_lookup_where_the_suffix_repeats_by_the_head_elsewhere_and_is_lossless(tiny_head, weights):
    engine = sync_engine(model="tiny-random", max_num_seqs=8, max_model_len=256, max_prefill_tokens=24,
                         drafter="hybrid", draft_head=str(tiny_head), weights=weights)
    drafter = engine.core.drafter
    reference = run_greedy(engine, TINY_PROMPTS, lambda s: 0, max_tokens=40, together=False)
    assert run_greedy(engine, TINY_PROMPTS, lambda s: 3, max_tokens=40, together=True) == reference
    for seed in range(2):
        assert run_greedy(engine, TINY_PROMPTS, random_schedule(seed), max_tokens=40, together=True) == reference
    assert drafter.counts["lookup"] > 0 and drafter.counts["head"] > 0, drafter.counts
    assert engine.core.totals["proposed"] > engine.core.totals["accepted"] > 0
    assert not drafter.head.slot  # every sequence's head state released, lookup or not

    # the lookup it routes by: a repeated 3-gram drafts what followed it; no such match drafts nothing,
    # and the head drafts for that sequence instead (the counts above)
    ids = [5, 6, 7, 8, 9, 5, 6, 7]
    assert drafter.lookup.propose(["a"], [ids], 2) == [[8, 9]]
    assert drafter.lookup.propose(["b"], [[5, 6, 7, 8, 9, 6, 7]], 2) == [[]]  # a 2-gram match is not enough
    assert drafter.sources(["a", "b"], [ids, [5, 6, 7, 8, 9, 6, 7]]) == ["lookup", "head"]
    assert drafter.sources(["a"], [ids + [8]]) == ["lookup"] and drafter.propose(["a"], [ids + [8]], 2) == [[9, 5]]
    drafter.release("a"), drafter.release("b")
    assert not drafter._matches


def test_a_hybrid_step_charges_the_head_only_its_own_rows(tiny_head):
    """Under the adaptive chooser a hybrid engine tells the chooser each row's source, and the
    head positions it reports for a step are those of the rows the head drafted for."""
    from serve_app.control.steps import StepPolicyConfig
    from serve_app.engines.embedded.adaptive import StepChooser

    engine = sync_engine(model="tiny-random", max_num_seqs=8, max_model_len=256, max_prefill_tokens=24,
                         drafter="hybrid", draft_head=str(tiny_head), weights="float32")
    drafter, seen = engine.core.drafter, []
    reference = run_greedy(engine, TINY_PROMPTS, lambda s: 0, max_tokens=40, together=False)
    chooser = engine.core.chooser = StepChooser(StepPolicyConfig(probe_interval_s=1e-9, probe_every_steps=1))
    observe, backlog = chooser.observe, drafter.backlog

    def spy_observe(ids, proposed, accepted, live, k, seconds, head_s=0.0, head_rows=0, sources=None, fed=None):
        rows = range(len(ids)) if chooser.last.rows is None else chooser.last.rows  # a probe's are a few
        if chooser.last.lengths is not None:  # lengths of their own: the rows given none draft nothing
            rows = [r for r in rows if chooser.last.lengths[r] > 0]
        seen.append((rows, k, head_rows, list(sources or []), backlogs.pop()))
        return observe(ids, proposed, accepted, live, k, seconds, head_s, head_rows, sources, fed)

    backlogs = []

    def spy_backlog(ids):
        backlogs.append(backlog(ids))
        return backlogs[-1]

    chooser.observe, drafter.backlog = spy_observe, spy_backlog
    try:
        assert run_greedy(engine, TINY_PROMPTS, lambda s: 3, max_tokens=40, together=True) == reference
    finally:
        engine.core.chooser = None
        del drafter.backlog
    drafting = [s for s in seen if s[1] > 0]
    assert drafting and any("lookup" in s[3] for s in drafting) and any("head" in s[3] for s in drafting)
    for rows, k, head_rows, sources, pending in drafting:
        head = [r for r in rows if sources[r] == "head"]
        assert head_rows == sum(pending[r] for r in head) + len(head) * k
    state = chooser.state()["engine_acceptance_by_source"]
    assert set(state) == {"lookup", "head"}


def test_eagle_sequences_release_their_head_state_and_slots_are_reused(tiny):
    prompts = TINY_PROMPTS * 2  # 40 requests through 8 slots
    reference = run_greedy(tiny, prompts[:20], lambda s: 0, max_tokens=16, together=False) * 2
    assert run_greedy(tiny, prompts, random_schedule(5), max_tokens=16, together=True) == reference
    drafter = tiny.core.drafter
    assert not drafter.slot and len(drafter.free) == 8


def test_a_shut_gates_probes_draft_for_the_sequences_with_least_backlog_and_change_no_output(tiny):
    """Every step a probe (the gate never opens): each drafts for two sequences, those with no
    verify of their own first (a new request, probed once), then those whose head has the fewest
    positions to catch up on; the rest verify none, and greedy output is the output of plain
    decoding."""
    from serve_app.control.steps import StepPolicyConfig
    from serve_app.engines.embedded.adaptive import StepChooser

    reference = run_greedy(tiny, TINY_PROMPTS[:8], lambda s: 0, max_tokens=32, together=False)
    drafter, calls = tiny.core.drafter, []
    backlog, propose = drafter.backlog, drafter.propose

    def spy_backlog(ids):
        calls.append({"backlogs": dict(zip(ids, backlog(ids), strict=True)),
                      "fresh": {r for r in ids if r not in tiny.core.chooser.requests}})
        return list(calls[-1]["backlogs"].values())

    def spy_propose(ids, token_ids, k):
        calls[-1]["drafted"] = list(ids)
        return propose(ids, token_ids, k)

    tiny.core.chooser = StepChooser(StepPolicyConfig(min_gain=1e3, probe_interval_s=1e-9, probe_every_steps=1,
                                                     probe_budget=1.0, probe_rows=2))
    drafter.backlog, drafter.propose = spy_backlog, spy_propose
    accepted = tiny.core.totals["accepted"]
    try:
        assert run_greedy(tiny, TINY_PROMPTS[:8], lambda s: 3, max_tokens=32) == reference
    finally:
        tiny.core.chooser = None
        del drafter.backlog, drafter.propose
    assert tiny.core.totals["accepted"] > accepted, "no probe's draft was accepted: verify went untested"
    probes = [c for c in calls if "drafted" in c and len(c["backlogs"]) > 2]
    assert len(probes) > 10, calls
    for c in probes:
        def key(r, c=c):
            return r not in c["fresh"], c["backlogs"][r]
        assert len(c["drafted"]) == 2 and sorted(map(key, c["drafted"])) == sorted(map(key, c["backlogs"]))[:2], c
    assert sum(len(c["fresh"] & set(c["drafted"])) for c in probes) <= 8  # each new request once
    # past each new request's one probe (its prompt to catch up on), the head ran over a
    # fraction of the positions a probe of the whole batch catches up on
    caught_up = sum(c["backlogs"][r] for c in probes for r in c["drafted"] if r not in c["fresh"])
    assert caught_up < 0.25 * sum(sum(c["backlogs"].values()) for c in probes)


def test_the_catch_up_runs_in_groups_of_like_lengths():
    assert catch_up_groups([2] * 30 + [300]) == [[30], list(range(30))]  # not 31 rows of 300
    assert catch_up_groups([2, 3, 2, 3]) == [[0, 1, 2, 3]]  # a pass costs more than a row of padding
    groups = catch_up_groups([1, 4] * 40, pass_rows=16)
    assert groups == [list(range(1, 80, 2)), list(range(0, 80, 2))]
    assert sorted(b for g in catch_up_groups([7, 90, 3, 3, 250, 12]) for b in g) == list(range(6))


@pytest.mark.parametrize("other", ["pytorch attention", "pytorch modules"])
def test_the_head_in_qmm_drafts_what_the_pytorch_head_drafts(tiny_head, other):
    """Under gguf the head's passes run in one qmm.c call (qmm_eagle_propose) with the target's
    RoPE tables; its drafts are those of the PyTorch modules, with qmm.c's attention or
    PyTorch's, but for float rounding near ties."""
    drafts = {}
    for fused in (True, False):
        engine = sync_engine(model="tiny-random", max_num_seqs=8, max_model_len=256, max_prefill_tokens=24,
                             drafter="eagle", draft_head=str(tiny_head), weights="gguf")
        drafter = engine.core.drafter
        assert drafter.rope_tables is not None and drafter.fused is not None
        if not fused:
            drafter.fused = None
            if other == "pytorch attention":
                drafter.rope_tables = None
        seen = drafts[fused] = []
        propose = drafter.propose
        drafter.propose = lambda ids, tokens, k, propose=propose, seen=seen: seen.append(propose(ids, tokens, k)) or seen[-1]
        run_greedy(engine, TINY_PROMPTS, random_schedule(1), max_tokens=40, together=True)
    pairs = [(a, b) for x, y in zip(drafts[True], drafts[False], strict=True) for a, b in zip(x, y, strict=True)]
    same = sum(a == b for a, b in pairs)
    assert len(pairs) > 100 and same >= 0.95 * len(pairs), f"{same} of {len(pairs)} drafts agree"


def test_the_fused_head_refuses_rows_it_was_not_given(tiny_head):
    engine = sync_engine(model="tiny-random", max_num_seqs=2, max_model_len=64, drafter="eagle",
                         draft_head=str(tiny_head), weights="gguf")
    fused, d = engine.core.drafter.fused, engine.core.drafter.head.config.hidden_size
    g = torch.zeros(2, d)
    for tokens, starts, n, slots in (([[1, 2]], [0], [3], [0]), ([[], [1, 2]], [0, 0], [0, 2], [0, 1]),
                                     ([[1, 2]], [-1], [2], [0]), ([[1, 2]], [0], [2], [2]),
                                     ([[1, 10 ** 6]], [0], [2], [0])):
        with pytest.raises(ValueError, match="qmm eagle"):
            fused.propose(g, tokens, starts, n, slots, 2)
    assert len(fused.propose(g, [[1, 2]], [0], [2], [1], 3)[0]) == 3


def test_the_head_s_rope_tables_cover_its_scratch_index(tiny_head):
    """The head's cache runs a scratch index past the target's positions; where the target's
    RoPE tables end before it, the head gets longer ones (the same values where both have them)."""
    engine = sync_engine(model="tiny-random", max_num_seqs=2, max_model_len=4096, drafter="eagle",
                         draft_head=str(tiny_head), weights="gguf")
    drafter, model = engine.core.drafter, engine.core.model
    cos, sin = drafter.rope_tables
    assert cos.shape[0] >= drafter.k.shape[2] > model.cos.shape[0]
    assert torch.equal(cos[:model.cos.shape[0]], model.cos) and torch.equal(sin[:model.sin.shape[0]], model.sin)


def test_eagle_head_with_a_wrong_checksum_is_refused(tiny_head, tmp_path):
    bad = tmp_path / "bad.safetensors"
    data = bytearray(tiny_head.read_bytes())
    data[-1] ^= 1
    bad.write_bytes(bytes(data))
    bad.with_suffix(".json").write_text(tiny_head.with_suffix(".json").read_text())
    with pytest.raises(ValueError, match="sha256"):
        load_head(bad)


def test_shipped_head_matches_its_manifest_and_records_how_it_was_made():
    path = default_head_path("smollm2-135m-instruct")
    head, info = load_head(path)
    assert info["data"]["answer_tokens"] > 1_000_000 and info["hardware"]
    assert head.config.feature_layers == (2, 15, 27) and len(head.d2t) == head.config.draft_vocab_size
    assert json.loads(path.with_suffix(".json").read_text())["sha256"] == info["sha256"]


@pytest.mark.real_model
@pytest.mark.parametrize("weights,drafter", [("float32", "eagle"), ("gguf", "eagle"), ("gguf", "hybrid")])
def test_real_model_with_the_shipped_head_is_lossless_and_accepts_drafts(weights, drafter):
    engine = sync_engine(max_num_seqs=8, max_model_len=1024, drafter=drafter, weights=weights)
    sets = ("chat",) if drafter == "eagle" else ("chat", "copy")  # copy-heavy answers: where lookup drafts
    prompts = [engine.apply_chat_template(chat_messages(p)) for name in sets for p in PROMPT_SETS[name][:6 // len(sets)]]
    reference = run_greedy(engine, prompts, lambda s: 0, max_tokens=24, together=True)
    assert run_greedy(engine, prompts, random_schedule(3), max_tokens=24, together=True) == reference
    totals = engine.core.totals
    assert totals["accepted"] > 0.5 * totals["verifies"]
    if drafter == "hybrid":
        assert min(engine.core.drafter.counts.values()) > 0, engine.core.drafter.counts


def test_pick_is_greedy_at_temperature_zero_and_samples_the_nucleus_only():
    logits = torch.tensor([[0.0, 3.0, 2.9, -5.0]]).repeat(400, 1)
    assert train_draft_head.pick(logits, 0.0, 1.0, None).eq(1).all()
    gen = torch.Generator().manual_seed(0)
    drawn = train_draft_head.pick(logits, 1.0, 0.9, gen)
    assert set(drawn.tolist()) == {1, 2}  # tokens 0 and 3 lie outside the 0.9 nucleus


def test_magpie_prompts_are_distinct_sampled_user_turns_and_the_search_is_bounded():
    engine = sync_engine(model="tiny-random")
    model, tok = engine.core.model, engine.tokenizer
    # tiny-random favours ids 1000-1200: let a few of them end a turn, so turns are short
    prompts = train_draft_head.magpie_prompts(model, tok, 6, ["Be brief.", None], set(range(1150, 1200)),
                                              batch=16, max_new=24, seed=1)
    assert len(prompts) == len(set(prompts)) > 0
    assert all(3 <= len(p.split()) <= 80 for p in prompts)
    # a model that never ends its turn yields nothing, and the search still stops
    assert train_draft_head.magpie_prompts(model, tok, 4, [None], set(), batch=8, max_new=4) == []
