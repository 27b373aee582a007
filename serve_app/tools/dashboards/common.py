"""Pieces every specserve dashboard shares: the datasource and app variables, Prometheus
queries, switch annotations, and the encoding to Grafana's dashboard JSON.

Panels are built with grafana-foundation-sdk's typed builders, so what we write has the
shape of Grafana's dashboard schema by construction; tests check the committed JSON against
the same types. Every series Ray exports carries WorkerId and other process labels: each
query aggregates them away (``max by`` for gauges, ``sum by`` for rates).
"""

from __future__ import annotations

import json
from typing import Any

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as gm
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

DATASOURCE = gm.DataSourceRef(type_val="prometheus", uid="${datasource}")
APP = 'app=~"$app"'
"""The label matcher every query carries: the dashboard's app variable."""

# One marker per switch: the gauge holds the time of the latest switch of each kind, and
# Grafana (useValueForTime) places the marker at that value, merging repeats of it.
SWITCH_ANNOTATION_EXPR = f"max by (app, from, to, reason) (ray_specserve_switch_timestamp_seconds{{{APP}}}) * 1000"


def query(expr: str, legend: str = "__auto", ref: str = "A", *, instant: bool = False, table: bool = False):
    """A Prometheus target."""
    q = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE)
    if table:
        q = q.format(PromQueryFormat.TABLE)
    return q.instant() if instant else q.range()


def new_dashboard(uid: str, title: str, description: str) -> gd.Dashboard:
    """A dashboard with the datasource and app variables, refreshing every 10 s."""
    return (
        gd.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["specserve"])
        .refresh("10s")
        .time("now-30m", "now")
        .timezone("browser")
        .with_variable(gd.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(
            gd.QueryVariable("app")
            .label("Application")
            .datasource(DATASOURCE)
            .query("label_values(ray_specserve_cluster_num_steps, app)")
            .refresh(gm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True)
            .all_value(".*")
            .multi(True)
        )
    )


def switch_annotations() -> list[dict[str, Any]]:
    """Grafana's built-in annotations plus the switch markers from Prometheus.

    Grafana's schema leaves an annotation query open for its datasource's own fields
    (Prometheus: expr, step, titleFormat, textFormat, tagKeys, useValueForTime); the SDK's
    AnnotationQuery type does not model them, so they are added here as plain keys."""
    return [
        {
            "builtIn": 1,
            "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True,
            "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts",
            "type": "dashboard",
        },
        {
            "name": "Mode switches",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "enable": True,
            "hide": False,
            "iconColor": "orange",
            "expr": SWITCH_ANNOTATION_EXPR,
            "step": "5s",
            "useValueForTime": True,
            "titleFormat": "switch {{from}} → {{to}} steps",
            "textFormat": "{{reason}} ({{app}})",
            "tagKeys": "app,reason",
        },
    ]


def to_json(board: gd.Dashboard) -> dict[str, Any]:
    """The dashboard as Grafana's JSON (plain dicts), with the switch annotations."""
    data = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    data["annotations"] = {"list": switch_annotations()}
    return data


def timeseries_panel(title: str, unit: str, *targets, span: int = 12, description: str = ""):
    """A time-series panel of the given targets."""
    panel = timeseries.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
    return panel.targets(list(targets)).span(span).height(8)


def quantiles(histogram: str, legend: str) -> list:
    """The p50 and p99 targets of a histogram expression; ``histogram`` has ``{q}`` where the
    quantile goes, ``legend`` has ``{p}`` where its percent goes."""
    return [
        query(histogram.replace("{q}", str(q)), legend.replace("{p}", str(round(q * 100))), ref)
        for q, ref in ((0.5, "A"), (0.99, "B"))
    ]
