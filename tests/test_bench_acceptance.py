"""``bench acceptance``: acceptance by draft position per class of request, and the bound on
what a draft length per sequence adds over one length a step."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from serve_app.tools.bench.__main__ import main
from serve_app.tools.bench.acceptance import LinearCost, best_lengths, bound, class_of, position_acceptance

COST = LinearCost(base=10.0, per_row=2.0, per_draft=0.0, head_base=0.5, head_per_row=0.05, head_per_pass=0.1)


def test_the_classes_follow_bench_steps_mixed_workload():
    assert [class_of(i) for i in range(6)] == ["chat t=0", "copy t=0", "chat t=1", "copy t=0", "chat t=0", "copy t=1"]


def test_acceptance_by_position_counts_only_the_verifies_that_tried_it():
    # 3-draft verifies: 4 accepted none, 2 accepted one, 1 accepted all; a 1-draft verify accepted its one
    counts = Counter({(3, 0): 4, (3, 1): 2, (3, 3): 1, (1, 1): 1})
    assert position_acceptance(counts, 3) == [0.5, round(1 / 3, 4), 1.0]  # 4/8 at 1; 1/3 at 2; 1/1 at 3
    assert position_acceptance(Counter(), 2) == [None, None]


def test_a_ragged_step_is_priced_by_its_rows_and_the_sequences_that_draft():
    assert COST.seconds((0, 0)) == 10.0 + 2.0 * 2
    assert COST.seconds((2, 0)) == pytest.approx(10.0 + 2.0 * 4 + 0.5 + 0.05 * 1 * 5 + 0.1 * 2)


def test_one_length_for_like_sequences_is_the_best_per_sequence_too_and_a_hopeless_one_drafts_none():
    good, bad = [0.9, 0.9, 0.9], [0.0, 0.0, 0.0]
    rate, lengths = best_lengths([good, good], 3, COST, per_sequence=False)
    assert best_lengths([good, good], 3, COST, per_sequence=True) == (rate, lengths)
    one, _ = best_lengths([good, bad], 3, COST, per_sequence=False)
    each, ks = best_lengths([good, bad], 3, COST, per_sequence=True)
    assert ks[1] == 0 and ks[0] > 0 and each > one  # the hopeless sequence is fed no draft


def test_the_bound_spans_every_offset_of_the_mix_and_never_falls_below_one_length():
    acc = {"chat t=0": [0.5, 0.6, 0.6], "copy t=0": [0.6, 0.4, 0.4], "chat t=1": [0.27, 0.3, 0.35],
           "copy t=1": [0.22, 0.24, 0.24]}
    rows = bound(acc, COST, [1, 2], [1, 3])
    assert [(r["batch"], r["ceiling"]) for r in rows] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    for r in rows:
        assert len(r["per_sequence_over_one_length"]) == 6 and min(r["per_sequence_over_one_length"]) >= 1.0
    assert rows[0]["per_sequence_over_one_length"] == [1.0] * 6  # one sequence: one length is its own


def test_bench_acceptance_measures_every_class_and_bounds_on_a_steps_result(tmp_path, capsys):
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps({"meta": {"chooser": {
        "step_cost_base_s": 0.01, "step_cost_per_row_s": 0.002, "step_cost_per_draft_s": 0.0,
        "head_cost_base_s": 0.0005, "head_cost_per_row_s": 0.00004, "head_cost_per_pass_s": 0.0001}}}))
    out = tmp_path / "acceptance.json"
    assert main(["acceptance", "--model", "tiny-random", "--drafter", "ngram", "--weights", "float32",
                 "--num-steps", "2", "--requests", "2", "--max-tokens", "12", "--cost-from", str(steps),
                 "--batches", "1,2", "--ceilings", "1,2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["classes"]) == ["chat t=0", "chat t=1", "copy t=0", "copy t=1"]
    for c in result["classes"].values():
        assert c["requests"] == 2 and c["output_tokens"] > 0 and len(c["a_by_position"]) == 2
        assert all(a is None or 0.0 <= a <= 1.0 for a in c["a_by_position"])
    assert [(r["batch"], r["ceiling"]) for r in result["bound"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert result["meta"]["cost"]["base"] == 0.01
    assert "acceptance by position" in capsys.readouterr().out


def test_lengths_per_distinct_acceptance_find_what_a_search_over_every_sequence_finds():
    import itertools

    from serve_app.control.steps import expected_tokens

    accs = [[0.9, 0.8, 0.7], [0.3, 0.2, 0.2], [0.9, 0.8, 0.7], [0.6, 0.5, 0.5], [0.3, 0.2, 0.2]]
    every = max((sum(expected_tokens(a, k) for a, k in zip(accs, ks, strict=True)) / COST.seconds(ks), ks)
                for ks in itertools.product(range(4), repeat=len(accs)))
    rate, ks = best_lengths(accs, 3, COST, per_sequence=True)
    assert rate == pytest.approx(every[0]) and ks[0] == ks[2] and ks[1] == ks[4]
