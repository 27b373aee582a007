"""The Grafana side: the publisher against a recorded Grafana HTTP exchange, and the
controller's HTTP annotator, which must never block and must count what it could not send."""

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from serve_app.control.annotations import GrafanaAnnotator
from serve_app.control.config import GrafanaAnnotations
from serve_app.tools.dashboards import build_all
from serve_app.tools.dashboards.publish import publish

RECORDED = json.loads((Path(__file__).parent / "fixtures/grafana_publish.json").read_text())["exchanges"]
TOKEN = "glsa_recorded"


class ReplayGrafana:
    """Answers each request with the next recorded response, after checking it is the
    recorded request; keeps what the publisher stored to answer "$DASHBOARD"."""

    def __init__(self, exchanges):
        self.exchanges, self.seen, self.stored, self.errors = list(exchanges), [], {}, []
        replay = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                replay.seen.append((self.command, self.path, self.headers.get("Authorization"), body))
                status, answer = replay.answer(self.command, self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = _serve

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, method, path, body):
        if not self.exchanges:
            self.errors.append(f"unexpected {method} {path}")
            return 500, {"message": "not in the recording"}
        want, response = self.exchanges[0]["request"], self.exchanges[0]["response"]
        self.exchanges.pop(0)
        if (method, path) != (want["method"], want["path"]):
            self.errors.append(f"got {method} {path}, recorded {want['method']} {want['path']}")
        for key, value in want.get("body", {}).items():
            if body.get(key) != value:
                self.errors.append(f"{path}: {key}={body.get(key)!r}, recorded {value!r}")
        if path == "/api/dashboards/db":
            self.stored[body["dashboard"]["uid"]] = {**body["dashboard"], "id": response["body"]["id"], "version": 1}
        answer = json.loads(json.dumps(response["body"]))
        if answer.get("dashboard") == "$DASHBOARD":
            answer["dashboard"] = self.stored[path.rsplit("/", 1)[1]]
        return response["status"], answer


@pytest.fixture
def grafana():
    replay = ReplayGrafana(RECORDED)
    yield replay
    replay.server.shutdown()


def test_publish_creates_the_folder_and_dashboards_then_is_a_no_op(grafana):
    dashboards = build_all()
    assert publish(grafana.url, TOKEN, dashboards) == {d["uid"]: "created" for d in dashboards.values()}
    assert publish(grafana.url, TOKEN, dashboards) == {d["uid"]: "unchanged" for d in dashboards.values()}
    assert not grafana.errors and not grafana.exchanges  # every recorded request, in order, nothing else
    assert all(auth == f"Bearer {TOKEN}" for _, _, auth, _ in grafana.seen)
    posts = [body for method, path, _, body in grafana.seen if path == "/api/dashboards/db"]
    for body, dashboard in zip(posts, dashboards.values(), strict=False):
        assert body["folderUid"] == "specserve" and body["overwrite"] is True  # upsert by uid
        assert body["dashboard"] == {**dashboard, "id": None}


def test_publish_updates_a_dashboard_that_changed(grafana):
    dashboards = build_all()
    publish(grafana.url, TOKEN, dashboards)
    overview = dashboards["overview.json"]
    overview["title"] = "specserve overview (edited)"
    grafana.exchanges = [
        RECORDED[6],
        RECORDED[7],
        {**RECORDED[3], "response": {**RECORDED[3]["response"]}},
        RECORDED[8],
    ]
    assert publish(grafana.url, TOKEN, dashboards) == {
        "specserve-overview": "updated",
        "specserve-control-plane": "unchanged",
    }
    assert not grafana.errors


class Counts:
    def __init__(self):
        self.results: list[str] = []

    def observe_annotation(self, result: str) -> None:
        self.results.append(result)


class Event:
    def __init__(self, i):
        self.time, self.from_steps, self.to_steps, self.reason, self.detail = time.time(), 4, 0, "load", f"n={i}"


def test_annotator_never_blocks_and_counts_failures_and_drops():
    async def run():
        counts = Counts()
        # Nothing listens on port 9 (discard): every post fails fast.
        config = GrafanaAnnotations(url="http://127.0.0.1:9", queue_size=2, timeout_s=0.5)
        annotator = GrafanaAnnotator("app", config, counts)
        started = time.perf_counter()
        for i in range(5):
            annotator.submit(Event(i))
        assert time.perf_counter() - started < 0.01  # the controller's decision is never delayed
        for _ in range(100):
            if len(counts.results) >= 5:
                break
            await asyncio.sleep(0.05)
        return counts.results

    results = asyncio.run(run())
    assert results.count("dropped") == 3 and results.count("failed") == 2
