"""OpenAI parameters through the official client and the local app: logprobs, echo, penalties,
logit bias; for greedy requests the same outputs, logprobs and usage with speculation forced on,
off, and switched while they run."""

import threading
import time

import openai
import pytest

MODEL = "tiny-random"
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story about w1 w2 w3 w1 w2 w3"}]

# Each a greedy request through the client: (endpoint, keyword arguments).
CASES = {
    "completions-logprobs": ("completions", {"prompt": PROMPT, "logprobs": 3}),
    "completions-echo-logprobs": ("completions", {"prompt": PROMPT, "logprobs": 2, "echo": True}),
    "completions-penalties": ("completions", {"prompt": PROMPT, "presence_penalty": 0.8, "frequency_penalty": 0.6,
                                              "extra_body": {"repetition_penalty": 1.2}}),
    "completions-logit-bias": ("completions", {"prompt": PROMPT, "logit_bias": {"1001": 8, "1003": 5}}),
    "chat-logprobs": ("chat", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 3}),
    "completions-own-draft-cap": ("completions", {"prompt": PROMPT, "logprobs": 1,
                                                  "extra_body": {"speculation": {"max_steps": 1}}}),
    "completions-two-prompts-n2-stop-ids": ("completions", {"prompt": [PROMPT, "The quick brown"], "n": 2,
                                                            "extra_body": {"stop_token_ids": [1003, 1010],
                                                                           "min_tokens": 3}}),
    "chat-penalties-logprobs": ("chat", {"messages": MESSAGES, "frequency_penalty": 1.0, "logprobs": True,
                                         "logit_bias": {"1010": 4}}),
}


@pytest.fixture(scope="module")
def client(tiny_app):
    return openai.OpenAI(base_url=f"{tiny_app.prefix}/v1", api_key="unused", max_retries=0)


def _call(client, endpoint: str, kwargs: dict, stream: bool) -> dict:
    """One greedy request, whole or streamed, reduced to what must not depend on speculation:
    each choice's text and logprobs, and the usage."""
    kwargs = {"model": MODEL, "max_tokens": 24, "temperature": 0, **kwargs}
    kwargs["extra_body"] = {"ignore_eos": True, **kwargs.get("extra_body", {})}
    api = client.completions if endpoint == "completions" else client.chat.completions
    if not stream:
        out = api.create(**kwargs)
        texts = [c.text if endpoint == "completions" else c.message.content for c in out.choices]
        return {"texts": texts, "logprobs": [_logprobs(endpoint, [c.logprobs]) for c in out.choices],
                "usage": out.usage.model_dump()}
    chunks = list(api.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    parts: dict[int, list] = {}
    for chunk in chunks:
        for c in chunk.choices:
            parts.setdefault(c.index, []).append(c)
    texts = ["".join((c.text if endpoint == "completions" else c.delta.content) or "" for c in parts[i])
             for i in sorted(parts)]
    logprobs = [_logprobs(endpoint, [c.logprobs for c in parts[i]]) for i in sorted(parts)]
    return {"texts": texts, "logprobs": logprobs, "usage": chunks[-1].usage.model_dump()}


def _logprobs(endpoint: str, parts: list) -> list[tuple] | None:
    """(token, logprob, top tokens in order with logprobs) per token, over a response's parts."""
    if all(p is None for p in parts):
        return None
    out = []
    for p in parts:
        if p is None:
            continue
        if endpoint == "completions":
            for tok, lp, top in zip(p.tokens, p.token_logprobs, p.top_logprobs, strict=True):
                out.append((tok, lp, sorted((top or {}).items(), key=lambda kv: -kv[1])))
        else:
            for e in p.content:
                out.append((e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]))
    return out


def _same(a: dict, b: dict) -> bool:
    """Equal text, usage, tokens, alternatives and logprobs (bit for bit: the engine computes a
    position's logits alike alone and inside a verify)."""
    return a == b


def _force(app, num_steps: int) -> None:
    app.put({"mode": "fixed", "num_steps": num_steps}).raise_for_status()
    app.wait_until(app.all_replicas_at(num_steps), timeout_s=20)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_greedy_outputs_logprobs_and_usage_are_the_same_with_speculation_on_off_and_switched(
        fresh_tiny_app, client, stream):
    _force(fresh_tiny_app, 0)
    reference = {name: _call(client, *case, stream) for name, case in CASES.items()}
    for name in CASES:  # the parameters are honoured, not ignored
        if "logprobs" in name:
            assert all(reference[name]["logprobs"]), name
    plain = _call(client, "completions", {"prompt": PROMPT}, stream)["texts"]
    assert reference["completions-penalties"]["texts"] != plain
    assert len(reference["completions-two-prompts-n2-stop-ids"]["texts"]) == 4
    _force(fresh_tiny_app, 4)
    for name, case in CASES.items():
        assert _same(_call(client, *case, stream), reference[name]), name

    stop, flips = threading.Event(), []

    def flip():
        k = 0
        while not stop.is_set():
            fresh_tiny_app.put({"mode": "fixed", "num_steps": k})
            flips.append(k)
            k = 4 - k
            time.sleep(0.05)

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        for name, case in CASES.items():
            assert _same(_call(client, *case, stream), reference[name]), name
    finally:
        stop.set()
        flipper.join()
    assert len(flips) > 4, "the mode did not switch while the requests ran"


def test_completions_logprobs_and_echo_have_openais_shape(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == plain.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and tok in top and len(top) <= 3 and max(top.values()) == value  # greedy: the best

    # lm-evaluation-harness's loglikelihood request: echo, one token, logprobs 1.
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice = echo.choices[0]
    assert choice.text.startswith(PROMPT)
    elp = choice.logprobs
    prompt_tokens = echo.usage.prompt_tokens
    assert len(elp.tokens) == prompt_tokens + 1
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(v <= 0 for v in elp.token_logprobs[1:])
    assert "".join(elp.tokens) == choice.text
    assert elp.tokens[-1] == lp.tokens[0] and abs(elp.token_logprobs[-1] - lp.token_logprobs[0]) < 1e-4


def test_echo_streams_the_prompt_first_and_works_for_token_id_prompts(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                            stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0].startswith(PROMPT)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert "".join(texts) == whole.choices[0].text
    ids = [1000, 1001, 1002]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True, logprobs=0)
    assert len(out.choices[0].logprobs.tokens) == 5 and out.choices[0].logprobs.top_logprobs[1].keys() == {
        out.choices[0].logprobs.tokens[1]}


def test_chat_logprobs_have_openais_shape_and_follow_the_content(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(e.token for e in content) == out.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token and bytes(e.bytes).decode("utf-8", "replace") == e.token
    without = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert without.choices[0].logprobs is None
    assert without.choices[0].message.content == out.choices[0].message.content


def test_a_logit_bias_of_100_forces_a_token_and_minus_100_bans_one(tiny_app, ray_session, client):
    from tests.test_app_http import _greedy_ids

    ids = _greedy_ids(ray_session, tiny_app.name, PROMPT, 5)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    forced = client.completions.create(**kw, logit_bias={"1005": 100}).choices[0].logprobs.tokens
    assert len(set(forced)) == 1  # every position: the forced token
    plain = client.completions.create(**kw).choices[0].logprobs.tokens
    banned = client.completions.create(**kw, logit_bias={str(ids[0]): -100}).choices[0].logprobs.tokens
    assert banned[0] != plain[0]
