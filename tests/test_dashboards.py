"""The dashboards as code: the committed JSON is what the generator writes, and it has the
shape of Grafana's dashboard schema (grafana-foundation-sdk's generated types)."""

import json
import re
from pathlib import Path

import pytest
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

from serve_app.tools.dashboards import DASHBOARDS_DIR, build_all, render

ROOT = Path(__file__).resolve().parents[1]
# Grafana's schema leaves an annotation query open for its datasource's own fields.
PROMETHEUS_ANNOTATION_KEYS = {"expr", "step", "useValueForTime", "titleFormat", "textFormat", "tagKeys"}


def test_committed_dashboards_equal_what_the_generator_writes():
    built = build_all()
    assert sorted(p.name for p in DASHBOARDS_DIR.glob("*.json")) == sorted(built)
    for name, dashboard in built.items():
        assert (DASHBOARDS_DIR / name).read_text() == render(dashboard), (
            f"dashboards/{name} is stale: run python -m serve_app.tools.dashboards build"
        )


@pytest.mark.parametrize("name", sorted(build_all()))
def test_dashboard_json_round_trips_through_grafanas_schema_types(name):
    committed = json.loads((DASHBOARDS_DIR / name).read_text())
    decoded = Dashboard.from_json(committed)  # decodes panels, targets and options by type
    again = json.loads(json.dumps(decoded, cls=JSONEncoder))
    for ann in committed["annotations"]["list"]:
        extra = set(ann) - set(again["annotations"]["list"][committed["annotations"]["list"].index(ann)])
        assert extra <= PROMETHEUS_ANNOTATION_KEYS
    again["annotations"] = committed["annotations"]
    assert again == committed  # nothing unknown to the schema, nothing it would drop


def test_every_query_aggregates_away_rays_per_process_labels():
    for dashboard in build_all().values():
        exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
        for expr in exprs:
            for metric in re.findall(r"ray_specserve_\w+", expr):
                assert re.search(rf"\b(max|sum)\b[^(]*(\([^()]*\))?\s*\(\s*(rate\()?{metric}\b", expr), (metric, expr)
            assert 'app=~"$app"' in expr


def test_every_dashboard_metric_is_defined_and_documented():
    source = "".join((ROOT / f"serve_app/{part}/metrics.py").read_text() for part in ("serving", "control"))
    defined = set(re.findall(r'"(specserve_\w+)"', source))
    docs = (ROOT / "docs/metrics.md").read_text()
    for name in defined:
        assert f"ray_{name}" in docs, f"{name} is not in docs/metrics.md"
    for dashboard in build_all().values():
        for used in re.findall(r"ray_(specserve_\w+)", json.dumps(dashboard)):
            base = re.sub(r"_(total|bucket|count|sum)$", "", used)
            assert base in defined, used
