"""End to end on the real SmolLM2-135M: the openai client, and lossless switching through the stack."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.conftest import app_args, deploy, undeploy

pytestmark = pytest.mark.real_model

PROMPTS = [
    "List three colors and one fruit of each color.",
    "Repeat after me: the cat sat on the mat, the cat sat on the mat.",
    "Write a Python function that adds two numbers.",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def real_app(serve_http):
    app = deploy("real", serve_http, app_args("smollm2-135m-instruct"))
    yield app
    undeploy(app)


@pytest.fixture(scope="module")
def client(real_app):
    return openai.OpenAI(base_url=f"{real_app.prefix}/v1", api_key="unused", max_retries=0)


def chat(client, prompt, max_tokens=24):
    out = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return out.choices[0].message.content


def test_openai_client_against_the_real_model(client):
    assert [m.id for m in client.models.list()] == ["smollm2-135m-instruct"]
    text = client.completions.create(
        model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert "Paris" in text.choices[0].text
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": PROMPTS[3]}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens > 0


def test_greedy_outputs_are_unchanged_while_modes_are_forced_back_and_forth(real_app, client):
    real_app.put({"mode": "fixed", "num_steps": 0})
    real_app.wait_until(real_app.all_replicas_at(0, count=2), timeout_s=10)
    reference = [chat(client, p) for p in PROMPTS]

    stop = threading.Event()
    flips = []

    def flip():
        k = 4
        while not stop.is_set():
            real_app.put({"mode": "fixed", "num_steps": k})
            flips.append(k)
            k = 4 if k == 0 else 0
            time.sleep(0.1)

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(lambda p: chat(client, p), PROMPTS * 2))
    finally:
        stop.set()
        flipper.join()
        real_app.put({"mode": "auto"})
    assert len(flips) >= 5, "the modes did not switch during generation"
    assert outputs == reference * 2
