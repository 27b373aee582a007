"""The OpenAI-compatible HTTP API and the Ray handle API, on the shared tiny-model app."""

import json
import os

import openai
import pytest

from tests.conftest import TEST_ADMIN_TOKEN, app_args, deploy, undeploy


@pytest.fixture(scope="module")
def client(tiny_app):
    return openai.OpenAI(base_url=f"{tiny_app.prefix}/v1", api_key="unused", max_retries=0)


def test_openai_client_lists_the_model(client):
    assert [m.id for m in client.models.list()] == ["tiny-random"]


def test_openai_client_completion(client):
    out = client.completions.create(model="tiny-random", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0
    again = client.completions.create(model="tiny-random", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert again.choices[0].text == out.choices[0].text  # greedy is deterministic


def test_openai_client_chat(client):
    out = client.chat.completions.create(
        model="tiny-random", messages=[{"role": "user", "content": "Say hi"}], max_tokens=6, temperature=0
    )
    assert out.choices[0].message.role == "assistant"
    assert isinstance(out.choices[0].message.content, str)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_openai_client_streaming_chat_matches_non_streaming(client):
    kwargs = dict(model="tiny-random", messages=[{"role": "user", "content": "Count"}], max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_the_replicas_answer_the_same_over_grpc_and_over_actor_calls(tiny_app, serve_http):
    """The shared app reaches its replicas over Serve's gRPC data plane (the default); an app
    with ``replica_transport: ray`` over Ray actor calls serves the same greedy output."""
    actor_calls = deploy("tiny-actor-calls", serve_http, app_args(num_replicas=1, replica_transport="ray"))
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}
        chat = {"messages": [{"role": "user", "content": "Count"}], "max_tokens": 10, "temperature": 0, "stream": True}
        outputs = []
        for app in (tiny_app, actor_calls):
            whole = app.http.post("/v1/completions", json=body).json()["choices"][0]["text"]
            with app.http.stream("POST", "/v1/chat/completions", json=chat) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            outputs.append((whole, "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])))
        assert outputs[0] == outputs[1] and outputs[0][0] and outputs[0][1]
    finally:
        undeploy(actor_calls)


@pytest.mark.skipif(
    os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1", reason="HAProxy is off (no binary, or turned off by hand)"
)
def test_haproxy_takes_the_stacks_http(serve_http):
    """With RAY_ENV's RAY_SERVE_ENABLE_HA_PROXY, HAProxy listens on the HTTP port, not Serve's proxy."""
    import psutil

    port = int(serve_http.rsplit(":", 1)[1])
    listeners = {psutil.Process(c.pid).name() for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid}
    assert listeners == {"haproxy"}


def test_a_response_over_grpcs_default_4_mib_limit_arrives(tiny_app):
    """8 choices of 400 tokens with 20 top logprobs each make a ~5 MB body. Through Serve's
    Python proxy (HAProxy's fallback, called here directly) it crosses gRPC from the ingress
    whole, and arrives only with RAY_ENV's larger message limit. Through HAProxy there is no
    such hop (each choice crosses gRPC from its replica alone): there it arrives either way."""
    import httpx

    body = {"messages": [{"role": "user", "content": "hi"}], "n": 8, "logprobs": True, "top_logprobs": 20,
            "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    fallback = os.environ.get("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT")
    fronts = [tiny_app.prefix] + ([f"http://127.0.0.1:{fallback}/{tiny_app.name}"] if fallback else [])
    for front in fronts:
        r = httpx.post(f"{front}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, (front, r.text[:300])
        assert len(r.content) > 4 * 2**20
        assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 8


def test_streaming_completion_ends_with_done(tiny_app):
    body = {"prompt": "abc", "max_tokens": 5, "temperature": 0, "stream": True}
    with tiny_app.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "usage" not in chunks[0]  # only with stream_options.include_usage


def test_token_id_prompts_are_accepted(tiny_app):
    r = tiny_app.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"max_tokens": 4}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": 9}, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 99}, "n"),
        ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "temperature": 9, "stream": True},
            "temperature",
        ),
    ],
)
def test_bad_input_is_a_400_openai_error_naming_the_field(tiny_app, path, body, param):
    r = tiny_app.http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert param in (err["param"] or "") or param in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}


def test_malformed_json_is_a_400(tiny_app):
    r = tiny_app.http.post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


def test_unknown_model_and_route_are_404s(tiny_app, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    r = tiny_app.http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_operator_api_requires_the_bearer_token(tiny_app):
    body = {"mode": "auto"}
    assert tiny_app.put(body, headers={}).status_code == 401
    assert tiny_app.put(body, headers={"Authorization": "Bearer nope"}).status_code == 403
    assert tiny_app.put(body, headers={"Authorization": f"Bearer {TEST_ADMIN_TOKEN}"}).status_code == 200
    assert tiny_app.http.get("/v1/speculation").status_code == 200  # reading needs no token


@pytest.mark.parametrize(
    "body, param",
    [
        ({"mode": "sometimes"}, "mode"),
        ({"num_steps": 3}, "num_steps"),
        ({"policy": {"margin": -1}}, "policy.margin"),
        ({"policy": {"tiers": [{"below": 2, "num_steps": 4}]}}, "policy"),
        ({"policy": {"engine_step_policy": "sometimes"}}, "policy.engine_step_policy"),
    ],
)
def test_bad_operator_input_is_a_400(tiny_app, body, param):
    r = tiny_app.put(body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in (err["param"] or "") or param in err["message"], err


def test_speculation_status_has_the_documented_shape(tiny_app):
    s = tiny_app.speculation()
    assert s["mode"] in ("auto", "fixed")
    assert {"num_steps", "version", "cluster_queue", "replicas", "events", "policy"} <= s.keys()
    assert len(s["replicas"]) == 2
    assert {"id", "num_steps", "step_policy", "mean_num_steps", "waiting", "running"} <= s["replicas"][0].keys()


def test_the_engines_step_policy_reaches_every_replica_at_run_time_and_changes_no_greedy_output(fresh_tiny_app):
    app = fresh_tiny_app
    body = {"model": "tiny-random", "prompt": "1 2 3 1 2 3 1 2 3", "max_tokens": 24, "temperature": 0}
    fixed = [app.http.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(2)]
    r = app.put({"policy": {"engine_step_policy": "adaptive"}})
    assert r.status_code == 200, r.text
    event = r.json()["events"][-1]
    assert event["reason"] == "step_policy" and event["from"] == event["to"]  # the ceiling did not move
    version = r.json()["version"]
    app.wait_until(lambda s: all(x["applied_version"] >= version and x["step_policy"] == "adaptive"
                                 for x in s["replicas"]))
    adaptive = [app.http.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(2)]
    assert adaptive == fixed
    # What the engines decide from shows beside their ceiling once they have chosen
    status = app.wait_until(lambda s: all(x["step_choices"] is not None for x in s["replicas"]))
    for x in status["replicas"]:
        assert {"engine_acceptance", "gate_shut", "reasons", "step_cost_ms"} <= x["step_choices"].keys()
    app.put({"policy": {"engine_step_policy": None}})
    app.wait_until(lambda s: all(x["step_policy"] == "fixed" and x["step_choices"] is None for x in s["replicas"]))


def test_handle_api_from_another_ray_task(tiny_app, ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0)
    def use_handle(app_name):
        from ray import serve

        handle = serve.get_app_handle(app_name)
        one = handle.generate.remote("Hello", max_tokens=6, temperature=0).result()
        deltas = list(handle.options(stream=True).generate_stream.remote("Hello", max_tokens=6, temperature=0))
        chat = handle.generate.remote(messages=[{"role": "user", "content": "hi"}], max_tokens=3).result()
        try:
            handle.generate.remote("Hello", max_tokens=-1).result()
            bad = None
        except Exception as e:  # InvalidRequestError, re-raised through Ray
            bad = (type(e).__name__, getattr(e, "param", None))
        return one, deltas, chat, bad

    one, deltas, chat, bad = ray.get(use_handle.remote(tiny_app.name), timeout=120)
    assert one["completion_tokens"] == 6 and one["finish_reason"] == "length"
    assert "".join(d["text"] for d in deltas) == one["text"]
    assert sum(len(d["token_ids"]) for d in deltas) == 6 and deltas[-1]["finish_reason"] == "length"
    assert chat["completion_tokens"] <= 3
    assert bad is not None and "InvalidRequestError" in bad[0] and bad[1] == "max_tokens"


def test_operator_api_answers_403_with_instructions_when_no_token_is_configured(serve_http):
    app = deploy("noauth", serve_http, app_args(num_replicas=1, admin_token_env="SPECSERVE_UNSET_FOR_TESTS"))
    try:
        r = app.put({"mode": "auto"}, headers={"Authorization": "Bearer anything"})
        assert r.status_code == 403
        assert "SPECSERVE_UNSET_FOR_TESTS" in r.json()["error"]["message"]
    finally:
        undeploy(app)


def _greedy_ids(ray, app_name: str, prompt: str, max_tokens: int) -> list[int]:
    @ray.remote(num_cpus=0)
    def generate(app_name):
        from ray import serve

        handle = serve.get_app_handle(app_name)
        return handle.generate.remote(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True).result()

    return ray.get(generate.remote(app_name), timeout=120)["token_ids"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_token_ids_and_min_tokens_through_the_openai_client(tiny_app, ray_session, client, stream):
    ids = _greedy_ids(ray_session, tiny_app.name, "Once upon a time", 12)
    stop = ids[5]
    first = ids.index(stop)

    def complete(**extra) -> tuple[int, str]:
        body = {"ignore_eos": True, "stop_token_ids": [stop], **extra}
        kwargs = dict(model="tiny-random", prompt="Once upon a time", max_tokens=12, temperature=0, extra_body=body)
        if not stream:
            out = client.completions.create(**kwargs)
            return out.usage.completion_tokens, out.choices[0].finish_reason
        chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return chunks[-1].usage.completion_tokens, finish[-1]

    assert complete() == (first + 1, "stop")  # the stop id ends it, as end-of-sequence would
    tokens, finish = complete(min_tokens=first + 2)  # not before min_tokens: greedy picks another token there
    assert tokens >= first + 2 and (finish == "length") == (tokens == 12)


def test_a_request_without_temperature_samples_at_the_engine_default(client):
    # The tiny model ships no generation_config.json and the test app sets no default: 1.0.
    kwargs = dict(model="tiny-random", prompt="Once upon a time", max_tokens=16, seed=11)
    unset = client.completions.create(**kwargs).choices[0].text
    assert unset == client.completions.create(**kwargs, temperature=1.0).choices[0].text
    assert unset != client.completions.create(**kwargs, temperature=0).choices[0].text


@pytest.mark.parametrize("body, param", [
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": "1"}, "stop_token_ids"),
    ({"min_tokens": -2}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
])
def test_bad_stop_token_ids_and_min_tokens_are_400s_naming_them(tiny_app, body, param):
    r = tiny_app.http.post("/v1/completions", json={"prompt": "x", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_n_choices_and_a_list_of_prompts_through_the_openai_client(client):
    kw = dict(model="tiny-random", max_tokens=8, temperature=0)
    one = client.completions.create(prompt="Once upon a time", **kw)
    two = client.completions.create(prompt="The quick brown", **kw)
    expected = [one.choices[0].text] * 2 + [two.choices[0].text] * 2  # greedy: n equal choices per prompt
    out = client.completions.create(prompt=["Once upon a time", "The quick brown"], n=2, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == expected
    assert out.usage.prompt_tokens == one.usage.prompt_tokens + two.usage.prompt_tokens
    assert out.usage.completion_tokens == 4 * 8
    chunks = list(client.completions.create(prompt=["Once upon a time", "The quick brown"], n=2, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    texts, finished = ["", "", "", ""], set()
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert texts == expected and finished == {0, 1, 2, 3}
    assert chunks[-1].usage.completion_tokens == 4 * 8
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_sampled_choices_differ_and_a_seed_reproduces_them(client):
    kw = dict(model="tiny-random", prompt="Once upon a time", n=3, max_tokens=12, temperature=1.0, seed=5)
    first = [c.text for c in client.completions.create(**kw).choices]
    assert first == [c.text for c in client.completions.create(**kw).choices]
    assert len(set(first)) > 1
    chat = client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=6, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


@pytest.mark.parametrize("body", [
    {"prompt": "x", "n": 0},
    {"prompt": "x", "n": 65},
    {"prompt": ["a"] * 33, "n": 2},
])
def test_too_many_choices_are_a_400_naming_n_or_the_prompt(tiny_app, body):
    r = tiny_app.http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] in ("n", "prompt"), r.text
