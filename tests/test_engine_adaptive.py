"""The adaptive step policy inside the running engine: the gate shuts on near-zero acceptance
and speculation comes back when acceptance does."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from serve_app.engines.base import GenerateRequest, SamplingParams
from serve_app.engines.embedded.engine import EmbeddedEngine
from serve_app.tools.bench.prompts import PROMPT_SETS

WORDS = "apple river stone cloud seven violet engine harbor quiet lantern".split()


@pytest.mark.real_model
def test_the_gate_shuts_on_near_zero_acceptance_and_speculation_is_back_within_5_s_of_copy_prompts():
    asyncio.run(_gate_recovers())


async def _gate_recovers():
    engine = EmbeddedEngine(drafter="ngram", step_policy="adaptive", num_threads=1, max_model_len=1024,
                            max_num_seqs=8)
    await engine.start()
    try:
        engine.core.num_steps = 4  # the cluster's ceiling
        chooser = engine.core.chooser

        async def run(i: int, prompt: str, temperature: float, n: int) -> None:
            params = SamplingParams(max_tokens=n, temperature=temperature, top_p=1.0, seed=i, ignore_eos=True)
            async for _ in engine.generate(GenerateRequest(f"r{i}", prompt=engine.apply_chat_template(
                    [{"role": "user", "content": prompt}]), params=params)):
                pass

        # Sampled at a high temperature from a prompt of random words, lookup drafts are all but
        # never accepted: the gate shuts while these run.
        rng = random.Random(0)
        junk = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(4)]
        shut_seen = False
        tasks = [asyncio.create_task(run(i, p, 1.5, 80)) for i, p in enumerate(junk)]
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
            shut_seen = shut_seen or chooser.gate.shut
        await asyncio.gather(*tasks)
        assert shut_seen, f"the gate never shut: {chooser.state()}"
        after_junk = chooser.prior(1, "lookup")[0]
        assert after_junk < 0.3  # the ngram drafter's drafts are the lookup's
        probes = chooser.reasons.get("probe", 0)

        # Copy prompts accept most drafts: speculation is back, and stays, within 5 s of their
        # arrival, their prefill included (two prompts: four take up to 4 s to prefill on one
        # thread beside another test).
        started = time.monotonic()
        tasks = [asyncio.create_task(run(10 + i, p, 0.0, 120)) for i, p in enumerate(PROMPT_SETS["copy"][:2])]
        back_after = None
        seen = []  # (seconds, reason, k, shadow drafts scored) at each change: the assertion's message
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
            c = chooser.last
            if not seen or seen[-1][1:] != (c.reason, c.num_steps, chooser.shadow_trials):
                seen.append((round(time.monotonic() - started, 2), c.reason, c.num_steps, chooser.shadow_trials))
            if engine.load().active_num_steps and c.reason == "gain" and not chooser.gate.shut:
                back_after = time.monotonic() - started
                break
        # Two more copy prompts: the engine's estimate, which the junk's long stretch pulled down,
        # gets as much copy traffic as it had junk.
        tasks += [asyncio.create_task(run(12 + i, p, 0.0, 120)) for i, p in enumerate(PROMPT_SETS["copy"][2:4])]
        await asyncio.gather(*tasks)
        assert back_after is not None and back_after < 5.0, (back_after, seen, chooser.state())
        # The engine's estimate followed the new traffic (the copy prompts' first drafts accept
        # about 0.5 to 0.6 of the time here).
        assert chooser.prior(1, "lookup")[0] > max(0.4, after_junk + 0.25), (after_junk, chooser.state())
        assert chooser.reasons["gain"] > 0 and chooser.reasons.get("probe", 0) >= probes
        # Prompt lookup's drafts are scored on the steps that do not draft them (shadow drafts):
        # the estimates moved with the gate shut, and no step probed.
        assert chooser.shadow_trials > 0 and chooser.reasons.get("probe", 0) == 0, chooser.state()
        assert engine.core.totals["accepted"] > 0
    finally:
        await engine.shutdown()


def test_the_step_policy_changes_at_run_time_between_steps():
    asyncio.run(_switch_step_policy())


async def _switch_step_policy():
    from serve_app.engines.base import InvalidRequestError

    engine = EmbeddedEngine(model="tiny-random", drafter="ngram", num_threads=1, max_model_len=256, max_num_seqs=4)
    await engine.start()
    try:
        engine.core.num_steps = 3
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

        async def run(rid: str) -> list[int]:
            out = []
            async for d in engine.generate(GenerateRequest(rid, prompt="a b a b a b a b", params=params)):
                out += d.token_ids
            return out

        fixed = await run("fixed")
        assert engine.core.chooser is None and engine.load().mean_num_steps is None
        await engine.set_step_policy("adaptive")
        adaptive = await run("adaptive")
        chooser = engine.core.chooser
        assert chooser is not None and sum(chooser.reasons.values()) > 0 and engine.load().mean_num_steps is not None
        await engine.set_step_policy("adaptive")  # the same policy again keeps the chooser and what it learned
        await run("again")
        assert engine.core.chooser is chooser
        await engine.set_step_policy("fixed")
        assert await run("fixed again") == fixed == adaptive  # greedy: the same tokens whatever the steps
        assert engine.core.chooser is None
        with pytest.raises(InvalidRequestError, match="fixed or adaptive"):
            await engine.set_step_policy("sometimes")
    finally:
        await engine.shutdown()


def test_the_steps_reported_as_run_are_those_under_the_ceiling_of_now():
    """mean_num_steps (the ``specserve_replica_mean_num_steps`` gauge, /v1/speculation's "ran")
    averages the last 5 s of steps under today's ceiling only: after a switch to 0 it reports
    nothing (the engine's load() falls back to the active steps, 0), after 3 -> 1 only the
    steps of ceiling 1."""
    from serve_app.control.steps import StepPolicyConfig
    from serve_app.engines.embedded.adaptive import StepChooser

    now = [0.0]
    chooser = StepChooser(StepPolicyConfig(), clock=lambda: now[0])
    under_3 = []
    for _ in range(4):
        under_3.append(chooser.choose(["a"], 3).num_steps)
        now[0] += 0.5
    assert chooser.mean_num_steps(3) == pytest.approx(sum(under_3) / 4)
    assert chooser.mean_num_steps(0) is None and chooser.mean_num_steps(1) is None
    under_1 = [chooser.choose(["a"], 1).num_steps for _ in range(3)]
    assert all(k <= 1 for k in under_1)
    assert chooser.mean_num_steps(1) == pytest.approx(sum(under_1) / 3)
    now[0] += 5.1  # the window passed: no step to report
    assert chooser.mean_num_steps(1) is None


def test_the_chooser_charges_the_heads_propose_to_the_head_and_the_rest_to_the_cell():
    from serve_app.control.steps import StepPolicyConfig
    from serve_app.engines.embedded.adaptive import StepChooser

    chooser = StepChooser(StepPolicyConfig())
    cost = chooser.cost
    chooser.observe(["a"], [1], [1], [True], 1, 0.030, 0.018, 60)  # "a" drafts for the first time: head catch-up
    chooser.observe(["a"], [1], [0], [True], 1, 0.013, 0.001, 3)  # drafting goes on
    assert cost.cells[(1, 1)][1] == pytest.approx(2.0, rel=0.02)  # both steps feed the cell, with 12 ms each
    assert cost.verify(1, 1) == pytest.approx(0.012, rel=0.01)
    head_base, head_per_row, _ = cost.head_coefficients()
    assert head_base + head_per_row * 60 == pytest.approx(0.018) and head_base + head_per_row * 3 == pytest.approx(0.001)
    chooser.observe(["a", "b"], [0, 0], [0, 0], [True, True], 0, 0.015)  # a plain step: no head
    assert cost.head_sums[8] < 2.0  # its count decayed, not fed
    assert chooser.state()["head_cost_per_row_s"] == pytest.approx(head_per_row, rel=0.01)


def test_the_chooser_keeps_acceptance_by_draft_source_and_prices_the_head_for_its_rows():
    """A hybrid drafter's lookup and head accept differently, on one request too: the chooser
    estimates each source apart, and a row drafted by lookup adds no head time to the step."""
    from serve_app.control.steps import StepPolicyConfig
    from serve_app.engines.embedded.adaptive import StepChooser

    chooser = StepChooser(StepPolicyConfig())
    for _ in range(40):  # the lookup drafts all 3 right, the head none
        chooser.observe(["a", "b"], [3, 3], [3, 0], [True, True], 3, 0.020, 0.004, 2 + 3, ["lookup", "head"])
        chooser.observe(["a", "b"], [3, 3], [0, 0], [True, True], 3, 0.020, 0.008, 2 * (2 + 3), ["head", "head"])
    prior = chooser.prior(3, "lookup")
    assert prior[0] > 0.9 and chooser.prior(3, "head")[0] < 0.1
    assert chooser.estimate("a", prior, "lookup")[0] > 0.9 and chooser.estimate("a", chooser.prior(3), "head")[0] < 0.1
    by_source = chooser.state()["engine_acceptance_by_source"]
    assert by_source["lookup"][0] > 0.9 and by_source["head"][0] < 0.1
    assert chooser.state()["engine_acceptance"] == by_source["head"]  # the source drafted most
    assert chooser.choose(["a", "b"], 3, [0, 0], ["lookup", "lookup"]).num_steps == 3
    assert chooser.choose(["a", "b"], 3, [0, 0], ["head", "head"]).num_steps == 0
    chooser.release("a")
    assert "a" not in chooser.requests


def test_a_shadow_draft_counts_what_a_verify_of_it_would_have_accepted():
    """Prompt lookup's draft on a step that does not draft it is scored against the tokens the
    request decodes next: the matched run, as a verify would accept, once a token differs or
    every draft token matched, over as many steps as that takes."""
    from serve_app.control.steps import StepPolicyConfig
    from serve_app.engines.embedded.adaptive import StepChooser, score_shadow

    assert score_shadow([5, 6, 7], 0, [5]) == (1, False)
    assert score_shadow([5, 6, 7], 1, [6, 9, 7]) == (2, True)  # the third differs
    assert score_shadow([5, 6, 7], 0, [4]) == (0, True)
    assert score_shadow([5, 6], 0, [5, 6, 8]) == (2, True)  # all matched
    chooser = StepChooser(StepPolicyConfig(request_half_life=1e9, engine_half_life=1e9))  # counts, not decayed
    assert chooser.wants_shadow("a")
    chooser.shadow("a", [])  # no match, no draft: nothing to score
    assert chooser.wants_shadow("a")
    chooser.shadow("a", [5, 6, 7])
    chooser.shadow("a", [1, 2])  # one at a time: the first is still being scored
    assert not chooser.wants_shadow("a")
    chooser.decoded("a", [5])
    chooser.decoded("a", [6])
    assert chooser.shadow_trials == 0 and "a" not in chooser.requests
    chooser.decoded("a", [0])
    assert chooser.shadow_trials == 1 and chooser.wants_shadow("a")
    own = chooser.requests["a"]["lookup"]
    assert (own.trials, own.accepted) == (pytest.approx([1, 1, 1]), pytest.approx([1, 1, 0]))  # tried 1..3, accepted 1..2
    assert chooser.engines["lookup"].trials == pytest.approx([1, 1, 1])
    chooser.shadow("a", [3, 4, 5])
    chooser.decoded("a", [3, 4])
    chooser.cut_short("a")  # "a" drafts for real before the shadow resolved: 2 tried, 2 accepted
    assert chooser.shadow_trials == 2 and chooser.wants_shadow("a")
    assert (own.trials, own.accepted) == (pytest.approx([2, 2, 1]), pytest.approx([2, 2, 0]))
    chooser.shadow("a", [7, 8])
    chooser.cut_short("a")  # nothing matched yet: no evidence
    assert chooser.shadow_trials == 2
    chooser.shadow("a", [7, 8])
    chooser.decoded("a", [7])
    chooser.release("a")  # a request that ends mid-match still tells the engine's estimate
    assert chooser.wants_shadow("a") and "a" not in chooser.requests
    assert chooser.shadow_trials == 3 and chooser.engines["lookup"].trials == pytest.approx([3, 2, 1])
