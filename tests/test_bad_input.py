"""Bad input: every case of the corpus is a 4xx OpenAI error that names the problem, and the
server serves normally afterwards, on ``guard_app`` (tight limits, in conftest)."""

import json

import pytest

from tests.conftest import GUARD_LIMITS

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (id, path, body: dict → JSON, bytes → sent raw, expected status, text the error must contain)
CORPUS = [
    ("malformed-json", C, b"{oops", 400, "not valid JSON"),
    ("truncated-json", C, b'{"prompt": "x"', 400, "not valid JSON"),
    ("empty-body", C, b"", 400, "JSON"),
    ("body-is-a-list", C, [1, 2], 400, "JSON object"),
    ("body-is-a-string", C, "hello", 400, "JSON object"),
    ("invalid-utf8", C, b'{"prompt": "\xff\xfe"}', 400, "JSON"),
    ("prompt-missing", C, {"max_tokens": 2}, 400, "prompt"),
    ("prompt-is-a-number", C, {"prompt": 5}, 400, "prompt"),
    ("prompt-is-an-object", C, {"prompt": {"text": "x"}}, 400, "prompt"),
    ("prompt-empty-string", C, {"prompt": ""}, 400, "empty"),
    ("prompt-empty-token-list", C, {"prompt": []}, 400, "empty"),
    ("too-many-prompts", C, {"prompt": ["a"] * 65}, 400, "at most 64 prompts"),
    ("token-id-out-of-vocab", C, {"prompt": [1, 10**9]}, 400, "token ids"),
    ("token-id-negative", C, {"prompt": [-1]}, 400, "token ids"),
    ("prompt-over-the-limit", C, {"prompt": "word " * 200}, 400, "limit is 64"),
    ("token-prompt-over-the-context", C, {"prompt": [5] * 300}, 400, "prompt"),
    ("max-tokens-string", C, {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("max-tokens-negative", C, {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("max-tokens-zero", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-fractional", C, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    ("max-tokens-huge", C, {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("max-tokens-over-the-cap", C, {"prompt": "x", "max_tokens": 9}, 400, "limit is 8"),
    ("temperature-too-high", C, {"prompt": "x", "temperature": 9}, 400, "temperature"),
    ("temperature-string", C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("top-p-zero", C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top-p-over-one", C, {"prompt": "x", "top_p": 2}, 400, "top_p"),
    ("n-too-large", C, {"prompt": "x", "n": 65}, 400, "n must be in [1, 64]"),
    ("logprobs-too-many", C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("logprobs-negative", C, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ("logprobs-a-bool-in-completions", C, {"prompt": "x", "logprobs": True}, 400, "logprobs"),
    ("echo-not-a-bool", C, {"prompt": "x", "echo": "yes"}, 400, "echo"),
    ("best-of", C, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("presence-penalty-too-high", C, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("frequency-penalty-too-low", C, {"prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("repetition-penalty-zero", C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("logit-bias-not-an-id", C, {"prompt": "x", "logit_bias": {"hello": 10}}, 400, "logit_bias"),
    ("logit-bias-out-of-vocab", C, {"prompt": "x", "logit_bias": {"999999999": 10}}, 400, "logit_bias"),
    ("logit-bias-too-large", C, {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("chat-top-logprobs-without-logprobs", CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat-top-logprobs-too-many", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("speculation-max-steps-negative", C, {"prompt": "x", "speculation": {"max_steps": -1}}, 400,
     "speculation.max_steps"),
    ("speculation-not-an-object", C, {"prompt": "x", "speculation": 3}, 400, "speculation"),
    ("chat-logprobs-a-number", CHAT, {"messages": USER, "logprobs": 3}, 400, "logprobs"),
    ("oversized-stop-list", C, {"prompt": "x", "stop": [f"s{i}" for i in range(100)]}, 400, "stop"),
    ("empty-stop-string", C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("stop-string-too-long", C, {"prompt": "x", "stop": "z" * 1000}, 400, "stop"),
    ("stream-not-a-bool", C, {"prompt": "x", "stream": "perhaps"}, 400, "stream"),
    ("seed-string", C, {"prompt": "x", "seed": "abc"}, 400, "seed"),
    ("unknown-model", C, {"prompt": "x", "model": "gpt-9"}, 404, "gpt-9"),
    ("body-too-large", C, {"prompt": "x" * 100_000}, 413, "limit"),
    ("chat-messages-missing", CHAT, {"max_tokens": 2}, 400, "messages"),
    ("chat-messages-empty", CHAT, {"messages": []}, 400, "messages"),
    ("chat-messages-not-a-list", CHAT, {"messages": "hi"}, 400, "messages"),
    ("chat-wrong-role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("chat-role-missing", CHAT, {"messages": [{"content": "x"}]}, 400, "role"),
    ("chat-content-a-number", CHAT, {"messages": [{"role": "user", "content": 7}]}, 400, "content"),
    ("chat-tools", CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    ("chat-max-completion-tokens-negative", CHAT, {"messages": USER, "max_completion_tokens": -1}, 400, "max_tokens"),
    (
        "chat-prompt-over-the-limit",
        CHAT,
        {"messages": [{"role": "user", "content": "word " * 200}]},
        400,
        "limit is 64",
    ),
    ("chat-stream-bad-temperature", CHAT, {"messages": USER, "stream": True, "temperature": -1}, 400, "temperature"),
    ("chat-unknown-model", CHAT, {"messages": USER, "model": "nope"}, 404, "nope"),
    # Text that is not text, numbers past 64 bits or a float's range, values of the wrong JSON type.
    ("lone-surrogate-prompt", C, b'{"prompt": "a\\ud800b"}', 400, "surrogate"),
    ("lone-surrogate-chat", CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "surrogate"),
    ("lone-surrogate-stop", C, b'{"prompt": "x", "stop": ["\\ud83d"]}', 400, "stop"),
    ("lone-surrogate-model", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "model": "\\ud800"}', 400, "model"),
    ("max-tokens-true", C, {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("max-tokens-past-64-bits", C, {"prompt": "x", "max_tokens": 2**70}, 400, "max_tokens"),
    ("temperature-false", C, {"prompt": "x", "temperature": False}, 400, "temperature"),
    ("temperature-numeric-string", C, {"prompt": "x", "temperature": "0.5"}, 400, "temperature"),
    ("temperature-nan", C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("temperature-past-a-float", C, b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", 400, "temperature"),
    ("top-p-infinity", C, b'{"prompt": "x", "top_p": Infinity}', 400, "top_p"),
    ("seed-past-64-bits", C, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("seed-true", C, {"prompt": "x", "seed": True}, 400, "seed"),
    ("n-true", C, {"prompt": "x", "n": True}, 400, "n"),
    ("stream-one", CHAT, {"messages": USER, "stream": 1}, 400, "stream"),
    ("ignore-eos-string", C, {"prompt": "x", "ignore_eos": "true"}, 400, "ignore_eos"),
    ("include-usage-string", CHAT, {"messages": USER, "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "include_usage"),
    ("token-id-past-64-bits", C, {"prompt": [2**70]}, 400, "token ids"),
]


def send(app, path, body):
    if isinstance(body, bytes):
        return app.http.post(path, content=body, headers={"content-type": "application/json"})
    return app.http.post(path, json=body)


def test_the_corpus_has_at_least_30_cases():
    assert len(CORPUS) >= 30 and len({c[0] for c in CORPUS}) == len(CORPUS)


@pytest.mark.parametrize("path, body, status, names", [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_bad_input_is_a_4xx_openai_error_naming_the_problem(guard_app, path, body, status, names):
    r = send(guard_app, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert names.lower() in f"{err['message']} {err['param']}".lower(), err


def test_the_server_is_healthy_after_the_corpus(guard_app):
    for _, path, body, _, _ in CORPUS:
        send(guard_app, path, body)
    assert guard_app.http.get("/health").json() == {"status": "ok"}
    r = guard_app.http.post(C, json={"prompt": "still here", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    r = guard_app.http.post(CHAT, json={"messages": USER, "temperature": 0, "stream": True})
    lines = [line for line in r.text.splitlines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "error" not in chunks[-1]


def test_a_request_without_max_tokens_gets_the_default_cut_to_the_cap(guard_app):
    r = guard_app.http.post(CHAT, json={"messages": USER, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == GUARD_LIMITS["max_tokens"]


@pytest.mark.parametrize("body, names", [
    ({"mode": "fixed", "num_steps": True}, "num_steps"),
    ({"mode": "fixed", "num_steps": "3"}, "num_steps"),
    ({"mode": "fixed", "num_steps": 2**70}, "num_steps"),
    ({"policy": {"margin": True}}, "margin"),
    ({"policy": {"dwell_s": "1"}}, "dwell_s"),
    (b'{"mode": "\\ud800"}', "mode"),
], ids=["num-steps-true", "num-steps-string", "num-steps-past-64-bits", "margin-true", "dwell-string", "mode-surrogate"])
def test_operator_input_of_the_wrong_type_is_a_400_naming_it(guard_app, body, names):
    before = {k: guard_app.speculation()[k] for k in ("mode", "override", "policy")}
    if isinstance(body, bytes):
        r = guard_app.http.put("/v1/speculation", content=body,
                               headers={**guard_app.admin, "content-type": "application/json"})
    else:
        r = guard_app.put(body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert names in f"{err['message']} {err['param']}", err
    assert {k: guard_app.speculation()[k] for k in ("mode", "override", "policy")} == before, "nothing changed"
