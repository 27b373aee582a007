"""Operator-API hardening and backpressure: on the guard app (1 replica, 2 slots, 2 waiting), on an app
whose operator bucket is small, and on an app whose Serve queue holds one request."""

import asyncio
import pathlib
import time
import uuid

import httpx
import yaml

from serve_app.serving.config import AppArgs
from tests.conftest import TEST_ADMIN_TOKEN, app_args, deploy, undeploy

ROOT = pathlib.Path(__file__).resolve().parents[1]


def ray_log_text(ray) -> str:
    logs = pathlib.Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    return "".join(
        p.read_text(errors="replace") for p in logs.rglob("*") if p.is_file() and p.suffix in (".log", ".out", ".err")
    )


async def burst(prefix: str, n: int) -> list[httpx.Response]:
    """``n`` completions at once, half of them streaming."""
    async with httpx.AsyncClient(base_url=prefix, timeout=30) as http:
        body = {"prompt": "queue me", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        return await asyncio.gather(
            *(http.post("/v1/completions", json={**body, "stream": i % 2 == 1}) for i in range(n))
        )


def test_the_admin_token_is_never_logged(guard_app, ray_session):  # noqa: F811
    wrong = f"wrong-{uuid.uuid4().hex}"
    for headers in (guard_app.admin, {"Authorization": f"Bearer {wrong}"}, {"Authorization": wrong}):
        guard_app.put({"mode": "auto"}, headers=headers)
        guard_app.put({"mode": "bogus"}, headers=headers)  # a failing request logs the most
    time.sleep(1.0)  # let the log handlers flush
    text = ray_log_text(ray_session)
    assert "/v1/speculation" in text  # the access log saw the requests...
    assert TEST_ADMIN_TOKEN not in text and wrong not in text  # ...but no token


def test_the_admin_token_is_taken_from_the_authorization_header_only(guard_app):  # noqa: F811
    for query in ({"token": TEST_ADMIN_TOKEN}, {"access_token": TEST_ADMIN_TOKEN},
                  {"authorization": f"Bearer {TEST_ADMIN_TOKEN}"}):
        r = guard_app.http.put("/v1/speculation", params=query, json={"mode": "auto"})
        assert r.status_code == 401, (query, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    r = guard_app.http.put("/v1/speculation", json={"mode": "auto"}, cookies={"token": TEST_ADMIN_TOKEN})
    assert r.status_code == 401


def test_operator_puts_are_rate_limited_with_retry_after(serve_http):
    # Its own app with a bucket of 5 that refills at 1 a second: 30 PUTs at once get 429s however
    # slowly a busy host lets them through (the guard app's bucket, 40 at 20/s, lets 80 pass when
    # they take more than 2 s to arrive).
    app = deploy("throttled", serve_http, app_args(num_replicas=1, limits={"admin_puts_per_s": 1, "admin_burst": 5}))
    guess = {"Authorization": "Bearer guess"}

    async def puts(n: int):
        async with httpx.AsyncClient(base_url=app.prefix, timeout=30) as http:
            return await asyncio.gather(
                *(
                    http.put("/v1/speculation", json={"mode": "auto"}, headers=app.admin if i % 2 else guess)
                    for i in range(n)
                )
            )

    try:
        assert app.put({"mode": "auto"}).status_code == 200
        assert app.put({"mode": "auto"}, headers=guess).status_code == 403
        answers = asyncio.run(puts(30))
        ok, guesses = answers[1::2], answers[0::2]
        assert 429 in {r.status_code for r in ok} <= {200, 429}, [r.status_code for r in ok]
        # Guessing is throttled too: the limit is checked before the token.
        assert 429 in {r.status_code for r in guesses} <= {403, 429}, [r.status_code for r in guesses]
        limited = next(r for r in ok if r.status_code == 429)
        assert limited.json()["error"]["type"] == "rate_limit_error" and int(limited.headers["Retry-After"]) >= 1
        time.sleep(int(limited.headers["Retry-After"]))
        assert app.put({"mode": "auto"}).status_code == 200
    finally:
        undeploy(app)


def test_a_full_replica_queue_answers_429_with_retry_after_not_a_hang(guard_app):  # noqa: F811
    start = time.monotonic()
    answers = asyncio.run(burst(guard_app.prefix, 40))
    elapsed = time.monotonic() - start
    codes = [r.status_code for r in answers]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) > 0 and codes.count(200) >= 2, codes
    rejected = next(r for r in answers if r.status_code == 429)
    assert int(rejected.headers["Retry-After"]) >= 1
    assert rejected.json()["error"]["type"] == "rate_limit_error"
    assert elapsed < 30
    print(
        f"\nbackpressure: 40 at once on 2 slots + 2 waiting: {codes.count(200)} served, "
        f"{codes.count(429)} × 429 in {elapsed:.1f} s"
    )


def test_a_full_serve_queue_answers_503_with_retry_after(serve_http):
    args = app_args(num_replicas=1, max_ongoing_requests=1, limits={"max_queued_requests": 1})
    app = deploy("busy", serve_http, args)
    try:
        answers = asyncio.run(burst(app.prefix, 20))
    finally:
        undeploy(app)
    codes = [r.status_code for r in answers]
    assert set(codes) == {200, 503}, codes
    for busy in (r for r in answers if r.status_code == 503):
        assert busy.headers.get("Retry-After") == "1", (busy.headers, busy.text)
        assert "queue is full" in busy.json()["error"]["message"]


def test_the_local_config_binds_localhost_and_sets_limits():
    raw = yaml.safe_load((ROOT / "configs/local.yaml").read_text())
    assert raw["http_options"]["host"] == "127.0.0.1"
    args = AppArgs.model_validate(raw["applications"][0]["args"])
    assert args.limits.max_prompt_tokens and args.limits.max_tokens <= args.engine.options.max_model_len
    assert args.limits.max_waiting_per_replica <= args.engine.options.max_waiting
