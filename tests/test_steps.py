"""The engine-level step choice (serve_app.control.steps), as a pure function."""

from __future__ import annotations

import itertools
import math

import pytest

from serve_app.control.steps import (
    Acceptance,
    GateState,
    StepCost,
    StepPolicyConfig,
    best_group_lengths,
    best_lengths,
    choose_steps,
    expected_tokens,
    pick_probe_rows,
    probe_spacing,
)

CFG = StepPolicyConfig()
ONE = StepPolicyConfig(per_sequence=False)  # one draft length for the whole batch


def fitted(base: float, per_row: float, per_draft: float = 0.0) -> StepCost:
    cost = StepCost()
    for batch in (1, 2, 4, 8, 16):
        for k in (0, 1, 3):
            cost.observe(batch, k, base + per_row * batch * (1 + k) + per_draft * k)
    return cost


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(-1.0, 3) == 1.0 and expected_tokens(2.0, 3) == 4.0


def test_expected_tokens_by_position_multiplies_the_positions_acceptance():
    assert expected_tokens([0.9, 0.5], 2) == pytest.approx(1 + 0.9 + 0.45)
    assert expected_tokens([0.9, 0.5], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.225)  # the last stands for the rest
    assert expected_tokens([0.5], 3) == pytest.approx(expected_tokens(0.5, 3))
    assert expected_tokens([], 2) == 1.0 and expected_tokens([0.7], 0) == 1.0


def test_acceptance_counts_tries_and_hits_per_position_and_forgets():
    a = Acceptance(half_life=1e9)
    a.observe(4, 2)  # positions 1 and 2 accepted, 3 tried and rejected, 4 never tried
    assert a.estimate(0.0, 0.0, 4) == pytest.approx([1.0, 1.0, 0.0, 0.0])
    a.observe(4, 0)  # position 1 rejected
    assert a.estimate(0.0, 0.0, 3) == pytest.approx([0.5, 1.0, 0.0])
    a.observe(0, 0)  # no drafts: no evidence
    assert a.trials == pytest.approx([2, 1, 1])
    assert a.estimate(0.3, 1.0, 4)[3] == pytest.approx(0.3)  # never tried: the prior
    assert a.estimate([0.8, 0.2], 2.0, 4)[1:] == pytest.approx([(1 + 0.4) / 3, 0.4 / 3, 0.2])
    quick = Acceptance(half_life=2.0)
    for _ in range(20):
        quick.observe(4, 0)
    for _ in range(5):
        quick.observe(4, 4)
    assert quick.estimate(0.0, 0.0, 1)[0] > 0.8  # recent evidence dominates


def test_step_cost_fits_base_per_row_and_per_draft_and_keeps_the_prior_shape_before():
    cost = fitted(0.010, 0.001, 0.004)
    base, per_row, per_draft = cost.coefficients()
    assert (base, per_row, per_draft) == pytest.approx((0.010, 0.001, 0.004), rel=1e-6)
    assert cost.seconds(8, 3) == pytest.approx(0.010 + 0.001 * 32 + 0.004 * 3)
    rows_only = StepCost()
    for batch in (1, 4, 16):  # k never varies: no draft term to fit
        rows_only.observe(batch, 0, 0.010 + 0.001 * batch)
    assert rows_only.coefficients() == pytest.approx((0.010, 0.001, 0.0), rel=1e-6)
    one = StepCost(prior_rows=10.0)
    for _ in range(3):
        one.observe(1, 0, 0.011)
    assert one.seconds(1, 0) == pytest.approx(0.011)
    assert one.seconds(10, 0) / one.seconds(1, 0) == pytest.approx(20 / 11)
    assert StepCost(prior_rows=4.0).seconds(4, 0) == pytest.approx(2.0)


def kinked(b: int, k: int) -> float:
    """A step linear in fed rows, except one sequence's 2-position verify, which costs far less
    than the line through the others gives (a kink no straight line fits)."""
    return 0.0105 if (b, k) == (1, 1) else 0.010 + 0.002 * b * (1 + k)


def learned(step_time, cells, rounds: int = 100, cost: StepCost | None = None) -> StepCost:
    cost = cost or StepCost()
    for _ in range(rounds):
        for b, k in cells:
            cost.observe(b, k, step_time(b, k))
    return cost


CELLS = [(1, 0), (1, 1), (1, 3), (2, 0), (2, 1), (4, 0), (4, 3)]


def test_step_cost_cells_learn_the_shape_the_linear_model_misses():
    cost = learned(kinked, CELLS)
    assert cost.model(1, 1) > 1.2 * kinked(1, 1)  # the straight line cannot bend there
    for b, k in CELLS:
        assert cost.seconds(b, k) == pytest.approx(kinked(b, k), rel=0.03)
    assert cost.seconds(8, 2) == cost.model(8, 2)  # a cell never seen is the model's
    # So a lone request accepting 1 draft in 10 drafts one: 1.1 tokens for a step of 10.5 ms
    # against a plain step's 12 ms. The model alone prices that draft above 12.6 ms, and keeps
    # the gate shut.
    assert choose_steps(3, [0.1], cost, GateState(), 0.0, CFG).num_steps == 1
    cost.cells.clear()
    assert choose_steps(3, [0.1], cost, GateState(), 0.0, CFG).reason == "gate"


def test_step_cost_follows_the_hosts_speed_and_keeps_the_cells_shape():
    cost = learned(kinked, CELLS)
    for _ in range(10):  # the host slows down 2x: what the choice compares, k against k at one batch, holds
        learned(lambda b, k: 2 * kinked(b, k), CELLS, rounds=20, cost=cost)
        for b, k in CELLS:
            assert cost.seconds(b, k) / cost.seconds(b, 0) == pytest.approx(kinked(b, k) / kinked(b, 0), rel=0.02)
    for b, k in CELLS:  # and the scale settles on the new speed
        assert cost.seconds(b, k) == pytest.approx(2 * kinked(b, k), rel=0.05)


def test_the_heads_catch_up_is_the_heads_and_a_probes_verify_teaches_its_cell():
    """The gate is shut at batch 4 and one draft runs only as a probe, whose head first catches
    up on ~50 positions a sequence. Measured as this engine's `gguf` steps were (bench steps,
    4 clients, ceiling 1): plain 26 ms, a one-draft verify 32 ms, the head 0.9 ms + 0.047 ms a
    position. Charging the catch-up to the head leaves the cell the verify's own time, so the
    cost of drafting that goes on is learned from probes alone, and at acceptance 0.46 the gate
    opens: 1.46 tokens for ~33.5 ms against 1 for 26."""

    def head(rows: int) -> float:
        return 0.0009 + 0.000047 * rows

    verify = {(4, 0): 0.026, (4, 1): 0.032, (1, 0): 0.0175, (2, 0): 0.022}

    def shut_gate(head_apart: bool) -> StepCost:
        cost = StepCost()
        for round_ in range(40):
            for b in (1, 2, 4, 4, 4, 4):
                cost.observe(b, 0, verify[(b, 0)])
            if round_ % 2 == 0:  # a probe: the head catches up on 200 positions, then drafts
                h = head(200 + 4)
                cost.observe(4, 1, verify[(4, 1)] + h, *((h, 200 + 4) if head_apart else ()))
        return cost

    cost = shut_gate(head_apart=True)
    assert cost.verify(4, 1) == pytest.approx(verify[(4, 1)], rel=0.02)
    going_on = verify[(4, 1)] + head(4 * 3)  # catch-up of at most 2 positions a sequence, one draft pass
    assert cost.seconds(4, 1) == pytest.approx(going_on, rel=0.02)
    assert cost.head_coefficients() == pytest.approx((0.0, 0.0009 / 204 + 0.000047, 0.0), rel=1e-6)  # one count seen
    assert choose_steps(1, [0.46] * 4, cost, GateState(shut=True), 0.0, CFG).num_steps == 1
    # Charged to the cell instead, the catch-up prices one draft at 42 ms and keeps the gate shut.
    whole = shut_gate(head_apart=False)
    assert whole.seconds(4, 1) > 0.040
    assert choose_steps(1, [0.46] * 4, whole, GateState(shut=True), 0.0, CFG).num_steps == 0


def test_the_head_fit_separates_its_base_its_positions_and_its_passes():
    cost = StepCost()
    for rows in (4, 12, 40, 200, 12, 4):  # one draft length: its passes fold into the base
        cost.observe(4, 1, 0.030 + 0.001 + 0.00005 * rows, head_s=0.001 + 0.00005 * rows, head_rows=rows)
    assert cost.head_coefficients() == pytest.approx((0.001, 0.00005, 0.0), rel=1e-6)
    assert cost.verify(4, 1) == pytest.approx(0.030, rel=1e-6)

    def head(rows: int, k: int) -> float:  # each draft pass run one after the other costs 3 ms
        return 0.001 + 0.00005 * rows + 0.003 * k

    cost = StepCost()
    for k in (1, 2, 3, 5):
        for rows in (4 * (1 + 2 * k), 200):
            cost.observe(4, k, 0.030 + head(rows, k), head_s=head(rows, k), head_rows=rows)
    assert cost.head_coefficients() == pytest.approx((0.001, 0.00005, 0.003), rel=1e-4)
    assert cost.head(4, 5) == pytest.approx(head(4 * 11, 5), rel=1e-4)  # drafting that goes on
    assert cost.head(4, 0) == 0.0 and StepCost().head(4, 3) == 0.0  # no head in a plain step; none seen yet


def test_the_head_is_priced_for_the_rows_it_drafts_for():
    """Rows drafted by prompt lookup run no head: a batch the head drafts for none of costs the
    verify alone, and one where it drafts for some costs its passes over those rows."""
    cost = fitted(0.010, 0.0002)
    for k in (1, 3, 5):  # each pass 4 ms, each position 0.5 ms: a dear head
        for rows in (2 * (1 + 2 * k), 40):
            cost.observe(2, k, 0.011 + 0.004 * k + 0.0005 * rows, head_s=0.004 * k + 0.0005 * rows, head_rows=rows)
    assert cost.seconds(2, 3, head_batch=2) == pytest.approx(cost.seconds(2, 3))
    assert cost.seconds(2, 3, head_batch=0) == pytest.approx(cost.verify(2, 3))
    assert cost.verify(2, 3) < cost.seconds(2, 3, head_batch=1) < cost.seconds(2, 3)
    accs = [0.6, 0.6]
    with_head = choose_steps(5, accs, cost, GateState(), 0.0, ONE)
    by_lookup = choose_steps(5, accs, cost, GateState(), 0.0, ONE, heads=[False, False])
    assert with_head.num_steps < by_lookup.num_steps == 5
    assert by_lookup.expected_tokens_per_s == pytest.approx(
        2 * expected_tokens(0.6, 5) / cost.verify(2, 5))


def test_high_acceptance_and_a_small_batch_draft_up_to_the_ceiling():
    cost = fitted(0.010, 0.0002)  # memory-bound: rows are cheap
    choice = choose_steps(5, [0.9], cost, GateState(), 0.0, CFG)
    assert (choice.num_steps, choice.reason) == (5, "gain")
    assert choose_steps(3, [0.9], cost, GateState(), 0.0, CFG).num_steps == 3


def test_a_large_compute_bound_batch_stops_drafting():
    cost = fitted(0.010, 0.002)
    assert choose_steps(5, [0.6] * 32, cost, GateState(), 0.0, CFG).num_steps == 0
    assert choose_steps(5, [0.6], cost, GateState(), 0.0, CFG).num_steps > 0


@pytest.mark.parametrize("accs", [[0.7, 0.2, 0.95, 0.5], [[0.9, 0.6, 0.3], [0.4], [0.95, 0.9, 0.8, 0.7], 0.5]])
def test_the_choice_is_the_argmax_of_expected_tokens_per_second(accs):
    cost = fitted(0.010, 0.001)
    rates = {k: sum(expected_tokens(a, k) for a in accs) / cost.seconds(4, k) for k in range(6)}
    best = max(rates, key=rates.get)
    assert best not in (0, 5)  # the case is interior, so the test tells a wrong argmax apart
    assert choose_steps(5, accs, cost, GateState(), 0.0, ONE).num_steps == best
    # Each its own length: the brute-force best of the ragged step, better than one length.
    every = max(itertools.product(range(6), repeat=4), key=lambda ks: (ragged_rate(accs, ks, cost), [-k for k in ks]))
    choice = choose_steps(5, accs, cost, GateState(), 0.0, CFG)
    assert choice.lengths == every and choice.num_steps == max(every)
    assert choice.expected_tokens_per_s == pytest.approx(ragged_rate(accs, every, cost))
    assert choice.expected_tokens_per_s > rates[best]


def test_the_vectorized_gains_are_expected_tokens():
    from serve_app.control.steps import _gains

    accs = [0.0, 0.37, 1.0, [], [0.9], [0.8, 0.5, 0.2], [0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5]]
    for width in (0, 1, 3, 6):
        table = _gains(accs, width)
        assert table.shape == (len(accs), width + 1)
        for i, a in enumerate(accs):
            assert list(table[i]) == pytest.approx([expected_tokens(a, k) for k in range(width + 1)], rel=1e-12)


def ragged_rate(accs, lengths, cost: StepCost, heads=None) -> float:
    return sum(expected_tokens(a, k) for a, k in zip(accs, lengths, strict=True)) / cost.seconds_for(lengths, heads)


def test_per_sequence_lengths_are_the_brute_force_best_of_a_ragged_step():
    """best_lengths against every combination, on random batches, caps and head rows, with a
    head and cells of their own in the cost."""
    import random

    rng = random.Random(0)
    cost = learned(kinked, CELLS, cost=fitted(0.010, 0.0015, 0.0005))
    for k in (1, 2, 3):
        for rows in (3, 30):
            cost.observe(3, k, 0.02 + 0.003 * k + 0.0002 * rows, head_s=0.003 * k + 0.0002 * rows, head_rows=rows)
    for _ in range(150):
        batch, ceiling = rng.randint(1, 4), rng.randint(1, 4)
        accs = [rng.choice([rng.random(), [rng.random() for _ in range(3)]]) for _ in range(batch)]
        heads = [rng.random() < 0.5 for _ in range(batch)]
        caps = [rng.randint(0, ceiling + 1) for _ in range(batch)]
        options = [range(min(c, ceiling) + 1) for c in caps]
        brute = max(ragged_rate(accs, ks, cost, heads) for ks in itertools.product(*options))
        rate_, lengths = best_lengths(accs, ceiling, cost, heads, caps)
        assert rate_ == pytest.approx(brute, rel=1e-9), (accs, heads, caps, lengths)
        assert all(n <= min(c, ceiling) for n, c in zip(lengths, caps, strict=True))


def test_a_copy_row_drafts_long_beside_a_sampled_chat_row_that_drafts_none():
    """The hybrid drafter's mixed batch: lookup accepts 0.9 on a copy-heavy answer, the head
    0.25 on a sampled chat one. One length a step drafts 3 for both, the chat row's padded
    rows costing as much as the copy row's; each its own gives the chat row none, and 18 % more
    tokens a second."""
    cost = fitted(0.0112, 0.0018)  # the gguf chooser's fit: 11.2 ms a step, 1.8 ms a fed row
    accs, heads = [0.9, 0.25], [False, True]
    one = choose_steps(3, accs, cost, GateState(), 0.0, ONE, heads=heads)
    each = choose_steps(3, accs, cost, GateState(), 0.0, CFG, heads=heads)
    assert one.num_steps == 3 and one.lengths is None
    assert each.lengths == (3, 0) and each.num_steps == 3
    assert each.expected_tokens_per_s > 1.15 * one.expected_tokens_per_s


def test_ceiling_zero_or_an_empty_batch_is_plain_and_opens_the_gate():
    cost = fitted(0.010, 0.0002)
    for ceiling, accs in ((0, [0.9]), (4, [])):
        choice = choose_steps(ceiling, accs, cost, GateState(True, 3.0), 5.0, CFG)
        assert (choice.num_steps, choice.reason, choice.gate.shut) == (0, "ceiling", False)


def test_the_gate_shuts_on_low_acceptance_probes_each_interval_and_reopens():
    cost = fitted(0.010, 0.001)
    cfg = StepPolicyConfig(probe_interval_s=1.0, probe_steps=2, probe_every_steps=1, probe_budget=1.0)
    low = [0.01] * 4
    c = choose_steps(4, low, cost, GateState(), 10.0, cfg)
    assert (c.num_steps, c.reason, c.gate.shut) == (0, "gate", True)
    c = choose_steps(4, low, cost, c.gate, 10.5, cfg)
    assert (c.num_steps, c.reason) == (0, "gate")
    c = choose_steps(4, low, cost, c.gate, 11.0, cfg)
    assert (c.num_steps, c.reason, c.gate.last_probe_at) == (2, "probe", 11.0)
    c = choose_steps(1, low, cost, c.gate, 12.5, cfg)
    assert (c.num_steps, c.reason) == (1, "probe")  # a probe never passes the ceiling
    c = choose_steps(4, [0.95] * 4, cost, c.gate, 12.6, cfg)
    assert (c.num_steps > 0, c.reason, c.gate.shut) == (True, "gain", False)


def test_a_shut_gate_probes_a_request_with_no_verify_of_its_own_at_once_and_first():
    """A request that arrives while the gate is shut carries only the engine's estimate, made
    by the requests that shut it: a probe is due for it at once (within the probe spacing), not
    an interval after the last, and drafts for it before the rest."""
    cost = fitted(0.010, 0.001)
    cfg = StepPolicyConfig(probe_interval_s=1.0, probe_steps=1, probe_rows=1, probe_every_steps=1, probe_budget=1.0)
    low = [0.01] * 3
    c = choose_steps(2, low, cost, GateState(), 10.0, cfg)
    c = choose_steps(2, low, cost, c.gate, 11.0, cfg)
    assert (c.reason, c.gate.last_probe_at) == ("probe", 11.0)
    c = choose_steps(2, low, cost, c.gate, 11.1, cfg, fresh=[False, False, False])
    assert c.reason == "gate"  # no new request: the next probe is an interval away
    c = choose_steps(2, low, cost, c.gate, 11.2, cfg, backlogs=[0, 0, 40], fresh=[False, False, True])
    assert (c.num_steps, c.reason, c.rows) == (1, "probe", (2,))  # the new one, though its head lags most
    c = choose_steps(2, low, cost, c.gate, 11.3, cfg, fresh=[False, False, True], free=[False, False, True])
    assert c.reason == "gate"  # one the engine scores for free needs no probe
    c = choose_steps(2, low, cost, c.gate, 11.4, cfg, fresh=[False, False, True], caps=[2, 2, 0])
    assert c.reason == "gate"  # nor one that may draft nothing (it would stay new, and probe every step)
    c = choose_steps(2, low, cost, c.gate, 12.3, cfg, fresh=[False, False, True], caps=[2, 2, 0])
    assert c.reason == "probe" and 2 not in c.rows  # the interval's probe drafts for the others


def test_a_probe_drafts_for_the_sequences_whose_head_has_least_to_catch_up_on():
    """A shut gate's probe drafts for ``probe_rows`` sequences: those with the fewest positions
    the draft head has not run over (a new request's prompt, every token since the gate shut),
    the earliest on a tie. The rest verify no draft, and count one token each in its rate."""
    cost = fitted(0.010, 0.001)
    cfg = StepPolicyConfig(probe_every_steps=1, probe_budget=1.0, probe_rows=2)
    backlogs = [300, 5, 200, 5, 0, 40]
    c = choose_steps(3, [0.01] * 6, cost, GateState(True, 0.0), 2.0, cfg, backlogs)
    assert (c.num_steps, c.reason, c.rows) == (1, "probe", (1, 4))
    assert c.expected_tokens_per_s == pytest.approx((2 * 1.01 + 4) / cost.seconds(6, 1))
    assert pick_probe_rows(None, 6, cfg) == (0, 1)  # no backlogs known: the first ones
    assert pick_probe_rows(backlogs[:2], 2, cfg) is None  # a batch of probe_rows or fewer: every sequence
    gain = choose_steps(3, [0.95] * 6, cost, GateState(True, 0.0), 2.0, cfg, backlogs)
    assert (gain.reason, gain.rows) == ("gain", None)  # drafting that pays drafts for all


def test_no_probe_drafts_for_a_sequence_the_engine_measures_for_free():
    """Prompt lookup's sequences are scored without drafting (shadow drafts): a probe drafts
    for the others only, and with every sequence free no step probes."""
    cost = fitted(0.010, 0.001)
    cfg = StepPolicyConfig(probe_every_steps=1, probe_budget=1.0, probe_rows=2)
    backlogs = [300, 5, 200, 5, 0, 40]
    free = [False, True, False, False, True, False]
    c = choose_steps(3, [0.01] * 6, cost, GateState(True, 0.0), 2.0, cfg, backlogs, free=free)
    assert (c.num_steps, c.reason, c.rows) == (1, "probe", (3, 5))
    assert pick_probe_rows(backlogs[:2], 2, cfg, [False, True]) == (0,)  # a small batch: the ones not free
    assert pick_probe_rows(backlogs, 6, cfg, [True] * 6) == ()
    c = choose_steps(3, [0.01] * 6, cost, GateState(True, 0.0), 2.0, cfg, backlogs, free=[True] * 6)
    assert (c.num_steps, c.reason, c.gate.shut, c.gate.last_probe_at) == (0, "gate", True, 0.0)


def test_min_gain_keeps_a_marginal_draft_off():
    cost = fitted(0.010, 0.001)
    accs = [0.12]
    gains = max(sum(expected_tokens(a, k) for a in accs) / cost.seconds(1, k) for k in range(1, 4))
    plain = 1 / cost.seconds(1, 0)
    assert 1.0 < gains / plain < 1.5
    assert choose_steps(3, accs, cost, GateState(), 0.0, StepPolicyConfig(min_gain=1.0)).num_steps > 0
    assert choose_steps(3, accs, cost, GateState(), 0.0, StepPolicyConfig(min_gain=1.5)).num_steps == 0


def test_slow_steps_probe_at_most_one_step_in_probe_every_steps():
    cost = fitted(0.010, 0.001)
    cfg = StepPolicyConfig(probe_interval_s=1.0, probe_every_steps=4, probe_budget=1.0)
    gate, kinds = GateState(), []
    for step in range(13):  # a step every 2 s: every step is past the interval
        c = choose_steps(4, [0.01] * 4, cost, gate, 2.0 * step, cfg)
        gate = c.gate
        kinds.append(c.reason)
    assert kinds == ["gate", "gate", "gate", "gate", "probe"] + ["gate"] * 3 + ["probe"] + ["gate"] * 3 + ["probe"]


def test_probes_that_cost_more_are_spaced_further_apart_within_the_budget():
    cfg = StepPolicyConfig(probe_every_steps=4, probe_budget=0.02)
    cheap, dear = fitted(0.010, 0.00001), fitted(0.010, 0.001)
    assert probe_spacing(1, 1, cheap, cfg) == 4  # the floor
    extra = dear.seconds(16, 1) / dear.seconds(16, 0) - 1  # 16 more rows: 0.016 / 0.026
    assert probe_spacing(16, 1, dear, cfg) == math.ceil(extra / 0.02)
    gate, probes = GateState(), 0
    for step in range(300):
        c = choose_steps(4, [0.01] * 16, dear, gate, 2.0 * step, cfg)
        gate, probes = c.gate, probes + (c.reason == "probe")
    assert probes == 300 // math.ceil(extra / 0.02)


def test_best_group_lengths_searches_one_length_or_one_per_group_and_ties_keep_fewer_drafts():
    gain = {0: (0, 1, 2, 3), 1: (0, 3, 1, 0)}  # group 0 gains most at 3, group 1 at 1

    def rate(lengths):
        return sum(gain[g][k] for g, k in enumerate(lengths))

    assert best_group_lengths(2, 3, True, rate) == (6, (3, 1))
    assert best_group_lengths(2, 3, False, rate) == (4, (1, 1))  # 1+3 at one, 2+1 at two, 3+0 at three
    assert best_group_lengths(1, 3, True, lambda lengths: 1.0) == (1.0, (0,))
    seen = []
    best_group_lengths(3, 2, False, lambda lengths: seen.append(lengths) or 0.0)
    assert seen == [(0, 0, 0), (1, 1, 1), (2, 2, 2)]
