"""Every dashboard query against a real Prometheus scraping a real run.

Starts Debian's prometheus on a free port (config: infra/prometheus/prometheus.yml with a
1 s scrape), deploys the tiny app with Grafana HTTP annotations pointed at a local stub,
drives load that makes the controller switch at least twice (off under load, back on when it
falls; no operator override), then evaluates every panel query and every
annotation query of every dashboard through Prometheus's HTTP API.

Set SPECSERVE_OBSERVABILITY_PNG=docs/img/mode_timeline.png to also draw the run's mode
timeline and queue from Prometheus (how docs/img/mode_timeline.png was made).
"""

import json
import os
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from serve_app.tools.dashboards import build_all
from tests.conftest import TEST_ADMIN_TOKEN_ENV, app_args, deploy, free_port, undeploy
from tests.load_gen import LoadGen

ROOT = Path(__file__).resolve().parents[1]
APP_NAME = "obs"
# Grafana fills these in; the test uses windows that fit a one-minute run scraped every second.
GRAFANA_VARS = {"$__rate_interval": "15s", "$__interval": "1s", "$__range": "2m", "$app": APP_NAME}


def _prometheus_binary() -> str:
    found = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)
    if found is None:
        message = "prometheus is not installed (apt-get install -y prometheus)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


@pytest.fixture(scope="module")
def prometheus(ray_session, tmp_path_factory):
    """Prometheus scraping this session's Ray node every second; yields its base URL.

    The session's Ray runs without its dashboard process, which is what writes the target
    file, so the test writes the same file (same format) for the node it runs on."""
    binary = _prometheus_binary()
    tmp = tmp_path_factory.mktemp("prometheus")
    node = next(n for n in ray_session.nodes() if n["Alive"])
    targets = tmp / "prom_metrics_service_discovery.json"
    targets.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": [f"127.0.0.1:{node['MetricsExportPort']}"]}]))
    config = yaml.safe_load((ROOT / "infra/prometheus/prometheus.yml").read_text())
    # Ray's agent can take over a second to answer /metrics on a busy host (every scrape of a CI
    # run timed out at 1 s, `up` 0): scrapes 3 s apart, each allowed the 3 s.
    config["global"].update(scrape_interval="3s", scrape_timeout="3s", evaluation_interval="1s")
    config["scrape_configs"][0]["file_sd_configs"][0].update(files=[str(targets)], refresh_interval="1s")
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "w"),
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{base}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp / "prometheus.log").read_text()[-2000:]
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def grafana_stub():
    """A stand-in for Grafana's POST /api/annotations; records the bodies it gets."""
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append({"path": self.path, **json.loads(self.rfile.read(int(self.headers["Content-Length"])))})
            body = json.dumps({"id": len(received), "message": "Annotation added"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", received
    server.shutdown()


def _substitute(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def _queries(dashboard: dict):
    """(where, expr, instant) for every panel target and every Prometheus annotation."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield f"{dashboard['uid']}/{panel['title']}/{target['refId']}", target["expr"], target.get("instant", False)
    for ann in dashboard["annotations"]["list"]:
        if "expr" in ann:
            yield f"{dashboard['uid']}/annotation {ann['name']}", ann["expr"], False


def _values(prom: str, expr: str, start: float, end: float, instant: bool) -> list[tuple[dict, list[float]]]:
    if instant:
        r = httpx.get(f"{prom}/api/v1/query", params={"query": expr, "time": end})
    else:
        r = httpx.get(f"{prom}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": 1})
    r.raise_for_status()
    result = r.json()["data"]["result"]
    out = []
    for series in result:
        points = series["values"] if "values" in series else [series["value"]]
        values = [float(v) for _, v in points]
        out.append((series["metric"], [v for v in values if v == v]))  # drop NaN
    return out


def _latest(prom: str, expr: str, at: float, wait_s: float = 10.0) -> list[tuple[dict, list[float]]]:
    """An instant query (a table's value now) at ``at``, then at the time of asking, once a second
    while it comes back empty, for up to ``wait_s``: a scrape of Ray's metrics that fails (an
    answer past the timeout on a busy machine) marks every series it had stale until the next
    one succeeds, and an instant query finds none of them meanwhile."""
    deadline = time.monotonic() + wait_s
    while True:
        series = _values(prom, expr, at, at, True)
        if any(values for _, values in series) or time.monotonic() > deadline:
            return series
        time.sleep(1.0)
        at = time.time()


def _range(prom: str, expr: str, start: float, wait_s: float = 15.0) -> list[tuple[dict, list[float]]]:
    """A range query from ``start`` to the time of asking, once a second while it comes back
    empty, for up to ``wait_s``. On a busy machine the latency histograms once came back empty
    while the counters of the same requests had data; a worker's report that reaches Ray's
    metrics agent late is one way that happens, and a late report is data Grafana shows."""
    deadline = time.monotonic() + wait_s
    while True:
        series = _values(prom, expr, start, time.time(), False)
        if any(values for _, values in series) or time.monotonic() > deadline:
            return series
        time.sleep(1.0)


def _scrape_report(prom: str, start: float, end: float) -> str:
    """What Prometheus holds of the run, to tell a missing metric from failed scrapes."""
    lines = ["", "Prometheus over the run:"]
    for expr in (
        "up",
        "scrape_duration_seconds",
        f'count_over_time(ray_specserve_output_tokens_total{{app="{APP_NAME}"}}[5m])',
        f'count_over_time(ray_specserve_ttft_seconds_bucket{{app="{APP_NAME}",le="+Inf"}}[5m])',
        f'ray_specserve_ttft_seconds_count{{app="{APP_NAME}"}}',
        "count(ray_specserve_ttft_seconds_bucket)",  # attribute sets: the SDK folds those past 2000 into one
        'count by (__name__) ({otel_metric_overflow="true"})',
    ):
        for metric, values in _values(prom, expr, start, end, False):
            labels = {k: v for k, v in metric.items() if k in ("__name__", "instance", "num_steps", "WorkerId")}
            lines.append(f"  {expr} {labels}: {values[:60]}")
    return "\n".join(lines)


def test_every_dashboard_query_returns_data_from_a_live_run(prometheus, serve_http, grafana_stub):
    stub_url, annotations = grafana_stub
    args = app_args(controller={"grafana": {"url": stub_url, "token_env": TEST_ADMIN_TOKEN_ENV, "timeout_s": 1.0}})
    app = deploy(APP_NAME, serve_http, args)
    try:
        start = time.time()
        v0 = app.speculation()["version"]
        load = LoadGen(app.prefix, max_tokens=32)
        try:  # load alone moves the mode: 1 client speculates, 16 turn it off, 1 turns it back on
            load.set_clients(1)
            time.sleep(2.0)
            load.set_clients(16)
            app.wait_until(app.all_replicas_at(0, count=2), timeout_s=30)
            time.sleep(2.0)
            load.set_clients(1)
            back = app.wait_until(app.all_replicas_at(4, count=2), timeout_s=30)
            time.sleep(1.0)
        finally:
            load.stop()
        assert not load.errors, load.errors[:3]
        reasons = [e["reason"] for e in back["events"] if e["version"] > v0]
        assert reasons[:2] == ["load_rise", "load_fall"], reasons

        # Wait for the last switch and the latest requests to be scraped.
        def scraped() -> bool:
            switches = _values(prometheus, 'sum(ray_specserve_switches_total{app="obs"})', 0, time.time(), True)
            return bool(switches) and switches[0][1] and switches[0][1][0] >= 2

        deadline = time.monotonic() + 60  # a busy host answers scrapes slowly
        while not scraped():
            assert time.monotonic() < deadline, "Prometheus never saw two switches" + _scrape_report(
                prometheus, start, time.time()) + "\n" + str(_values(
                    prometheus, 'ray_specserve_switches_total', start, time.time(), True))
            time.sleep(0.5)
        time.sleep(3)
        end = time.time()

        empty, checked = [], 0
        for dashboard in build_all().values():
            for where, expr, instant in _queries(dashboard):
                checked += 1
                if instant:
                    series = _latest(prometheus, _substitute(expr), end)
                else:
                    series = _range(prometheus, _substitute(expr), start - 5)
                if not any(values for _, values in series):
                    empty.append(f"{where}: {expr}")
        assert checked >= 20
        assert not empty, "queries without data:\n" + "\n".join(empty) + _scrape_report(prometheus, start - 5, time.time())

        # One annotation marker per switch: the switch-time series hold >= 2 distinct times.
        (expr,) = [a["expr"] for d in build_all().values() for a in d["annotations"]["list"] if "expr" in a][:1]
        times = {v for _, values in _values(prometheus, _substitute(expr), start - 5, end, False) for v in values}
        assert len(times) >= 2
        modes = _values(prometheus, 'max by (replica) (ray_specserve_replica_num_steps{app="obs"})', start, end, False)
        assert len(modes) == 2 and all({0.0, 4.0} <= set(values) for _, values in modes)
        assert len(annotations) >= 2 and all(a["path"] == "/api/annotations" for a in annotations)
        assert all(a["dashboardUID"] == "specserve-overview" and "switch" in a["text"] for a in annotations)

        if png := os.environ.get("SPECSERVE_OBSERVABILITY_PNG"):
            _draw(prometheus, start - 2, end, Path(png))
    finally:
        undeploy(app)


def _draw(prom: str, start: float, end: float, path: Path) -> None:
    """The overview's mode timeline and queue panels, from Prometheus range data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(expr):
        r = httpx.get(f"{prom}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": 1})
        return [
            (s["metric"], [(float(t) - start, float(v)) for t, v in s["values"]]) for s in r.json()["data"]["result"]
        ]

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    for metric, points in series('max by (replica) (ray_specserve_replica_num_steps{app="obs"})'):
        xs, ys = zip(*points, strict=False)
        ax1.step(xs, ys, where="post", label=f"replica {metric['replica'][:8]}")
    switches = series('max by (from, to, reason) (ray_specserve_switch_timestamp_seconds{app="obs"})')
    for metric, points in switches:
        for t in {v for _, v in points if start <= v <= end}:
            for ax in (ax1, ax2):
                ax.axvline(t - start, color="orange", linestyle="--", linewidth=1)
            ax1.annotate(f"{metric['from']}→{metric['to']} ({metric['reason']})", (t - start, 4.2), fontsize=7)
    ax1.set_ylabel("draft steps")
    ax1.set_ylim(-0.5, 5)
    ax1.legend(loc="center right", fontsize=8)
    ax1.set_title("Mode per replica (orange: switches)")
    for _, points in series('max by (app) (ray_specserve_cluster_queue{app="obs"})'):
        xs, ys = zip(*points, strict=False)
        ax2.plot(xs, ys, label="cluster queue")
    bounds = 'max by (tier) (ray_specserve_policy_tier_bound{app="obs"}) * on () group_left max(ray_specserve_live_replicas{app="obs"})'
    for metric, points in series(bounds):
        xs, ys = zip(*points, strict=False)
        ax2.plot(xs, ys, linestyle=":", label=f"tier {metric['tier']} threshold")
    ax2.set_ylabel("requests")
    ax2.set_xlabel("seconds since start")
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
