"""Penalties, logit bias and logprobs: lossless under speculation, and what they claim to be."""

import pytest
import torch

from serve_app.engines.base import GenerateRequest, SamplingParams
from serve_app.engines.embedded.logits import LogitsState

from .engine_helpers import run_greedy, sync_engine
from .test_engine_lossless import TINY_PROMPTS, random_schedule

PENALTIES = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 2.0},
    {"repetition_penalty": 1.2},
    {"repetition_penalty": 0.8},
    {"logit_bias": {1001: 6.0, 1005: 3.0}},
    {"frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 0.9, "logit_bias": {1010: 4.0}},
]
# Each set changes the output yet leaves repeats for the lookup drafter to find: drafts get accepted.


@pytest.fixture(scope="module")
def tiny():
    return sync_engine(model="tiny-random", max_num_seqs=8, max_model_len=256, max_prefill_tokens=24)


@pytest.mark.parametrize("params", PENALTIES, ids=lambda p: "+".join(p))
def test_penalised_greedy_output_is_identical_for_every_num_steps_and_switches(tiny, params):
    plain = run_greedy(tiny, TINY_PROMPTS, lambda s: 0, max_tokens=40, together=False)
    reference = run_greedy(tiny, TINY_PROMPTS, lambda s: 0, max_tokens=40, together=False, **params)
    assert reference != plain, "the parameters changed nothing: the test did not test them"
    accepted = tiny.core.totals["accepted"]
    for schedule in (lambda s: 3, lambda s: 5, random_schedule(4)):
        assert run_greedy(tiny, TINY_PROMPTS, schedule, max_tokens=40, **params) == reference
    assert tiny.core.totals["accepted"] > accepted, "no draft was accepted: verify was not exercised"


def test_each_verify_position_is_penalised_as_the_plain_step_there_would_be():
    vocab, prompt, out, draft = 50, [3, 4, 4], [7, 7, 9], [9, 3, 11]
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.5,
                            logit_bias={2: 5.0, 9: -1.0})
    verify = LogitsState(params, prompt, vocab)
    verify.append(out)
    logits = torch.randn(len(draft) + 1, vocab)
    verified = logits.clone()
    verify.apply(verified, draft)
    for i in range(len(draft) + 1):
        seen = out + draft[:i]  # the output a plain step at position i follows
        expected = logits[i].clone()
        for t, b in params.logit_bias.items():
            expected[t] += b
        for t in set(prompt) | set(seen):
            expected[t] = expected[t] / 1.5 if expected[t] > 0 else expected[t] * 1.5
        for t in set(seen):
            expected[t] -= 0.3 * seen.count(t) + 0.7
        plain = LogitsState(params, prompt, vocab)
        plain.append(seen)
        one = logits[i:i + 1].clone()
        plain.apply(one, [])
        assert torch.equal(one[0], verified[i])  # bit for bit: the same arithmetic either way
        assert torch.allclose(verified[i], expected, atol=1e-6)


def _run(engine, schedule, **params) -> list[list]:
    """Every request's deltas, all prompts in one batch, ``schedule(step)`` num_steps per step."""
    outs: list[list] = [[] for _ in TINY_PROMPTS]
    for i, prompt in enumerate(TINY_PROMPTS):
        sp = SamplingParams(max_tokens=30, ignore_eos=True, **params)
        engine.core.add(engine.make_sequence(GenerateRequest(f"r{i}", prompt=prompt, params=sp), outs[i].append))
    step = 0
    while engine.core.has_work():
        engine.core.num_steps = schedule(step)
        engine.core.step()
        step += 1
    return outs


def test_logprobs_are_the_same_with_speculation_on_off_and_switched(tiny):
    plain = _run(tiny, lambda s: 0, logprobs=3, prompt_logprobs=2, echo=True)
    for schedule in (lambda s: 4, random_schedule(1)):
        spec = _run(tiny, schedule, logprobs=3, prompt_logprobs=2, echo=True)
        for p, s in zip(plain, spec, strict=True):
            p_lp = [e for d in p for e in d.logprobs]
            s_lp = [e for d in s for e in d.logprobs]
            assert [e.token_id for e in p_lp] == [e.token_id for e in s_lp] == [t for d in p for t in d.token_ids]
            assert p_lp == s_lp  # bit for bit: every position's logits do not depend on its neighbours
            assert p[0].prompt_text == s[0].prompt_text
            assert [e.token_id for e in p[0].prompt_logprobs] == [e.token_id for e in s[0].prompt_logprobs]


def test_logprobs_are_log_softmax_of_the_models_logits_with_the_best_on_top(tiny):
    prompt = TINY_PROMPTS[3]
    deltas = _run(tiny, lambda s: 0, logprobs=4, prompt_logprobs=1, echo=True)[3]
    ids = tiny.tokenize(prompt)
    first = deltas[0]
    assert first.prompt_text == prompt
    assert [e.token_id for e in first.prompt_logprobs] == ids
    assert first.prompt_logprobs[0].logprob is None and all(e.logprob <= 0 for e in first.prompt_logprobs[1:])
    out = [t for d in deltas for t in d.token_ids]
    entries = [e for d in deltas for e in d.logprobs]
    # The reference: one forward pass over prompt + output, every position's logits.
    from serve_app.engines.embedded.kv_cache import KVCache

    model, s = tiny.core.model, tiny.core.model.shape
    cache = KVCache(s.num_layers, 1, s.num_kv_heads, 256, s.head_dim, "cpu", torch.float32)
    tokens = torch.tensor([ids + out])
    logits, _ = model.forward(tokens, torch.tensor([0]), cache)
    lp = torch.log_softmax(logits[0].float(), -1)
    for j, e in enumerate(first.prompt_logprobs[1:], start=1):
        assert abs(e.logprob - float(lp[j - 1, ids[j]])) < 1e-4
    for i, e in enumerate(entries):
        row = lp[len(ids) - 1 + i]
        assert e.token_id == int(row.argmax())  # greedy: the chosen token is the best one
        assert abs(e.logprob - float(row[e.token_id])) < 1e-4
        assert [t.token_id for t in e.top] == row.topk(4).indices.tolist()
        assert e.top[0].token_id == e.token_id and e.token == tiny.tokenizer.decode([e.token_id])


def test_logprobs_survive_a_stop_string_and_name_every_emitted_token(tiny):
    deltas = _run(tiny, lambda s: 3, logprobs=0, stop=["w1"])
    for ds in deltas:
        ids = [t for d in ds for t in d.token_ids]
        entries = [e for d in ds for e in d.logprobs]
        assert [e.token_id for e in entries] == ids and all(e.top == [] for e in entries)


def test_a_logit_bias_outside_the_vocabulary_is_refused_naming_it(tiny):
    from serve_app.engines.base import InvalidRequestError

    with pytest.raises(InvalidRequestError) as e:
        tiny.make_sequence(GenerateRequest("x", prompt="hi", params=SamplingParams(logit_bias={10**6: 1.0})), print)
    assert e.value.param == "logit_bias"


@pytest.mark.real_model
def test_repetition_penalty_matches_transformers_greedy_on_the_real_model():
    from transformers import AutoModelForCausalLM

    from serve_app.engines.embedded.weights import resolve_model_dir

    engine = sync_engine(model="smollm2-135m-instruct", max_num_seqs=4, max_model_len=512)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir("smollm2-135m-instruct"), dtype=torch.float32)
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}])
               for p in ("Repeat after me: red, red, red, blue.", "List five fruits.")]
    ours = run_greedy(engine, prompts, lambda s: 3, max_tokens=32, repetition_penalty=1.3)
    for prompt, out in zip(prompts, ours, strict=True):
        ids = torch.tensor([engine.tokenize(prompt)])
        ref = hf.generate(ids, max_new_tokens=32, do_sample=False, repetition_penalty=1.3, min_new_tokens=32)
        assert out == ref[0, ids.shape[1]:].tolist()
