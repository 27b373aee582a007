"""The control plane: the load the policy sees, how fast decisions are made and spread."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import timeseries

from serve_app.tools.dashboards.common import APP, DATASOURCE, new_dashboard, query

UID = "specserve-control-plane"


def _panel(title: str, unit: str, *targets, description: str = ""):
    panel = timeseries.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
    return panel.targets(list(targets)).span(12).height(8)


def build() -> gd.Dashboard:
    load = _panel(
        "Load per replica against the tier bounds",
        "short",
        query(f"max by (app) (ray_specserve_load_per_replica{{{APP}}})", "load per replica ({{app}})", "A"),
        query(
            f"max by (app, tier, num_steps) (ray_specserve_policy_tier_bound{{{APP}}})",
            "tier {{tier}}: {{num_steps}} steps below",
            "B",
        ),
        description="What the policy compares (before its smoothing) with each tier's upper bound.",
    )
    mode = _panel(
        "Cluster mode and live replicas",
        "short",
        query(f"max by (app) (ray_specserve_cluster_num_steps{{{APP}}})", "num_steps ({{app}})", "A"),
        query(f"max by (app) (ray_specserve_live_replicas{{{APP}}})", "live replicas ({{app}})", "B"),
    )
    # Switches are rare: quantiles over every switch since the controller started, not a rate.
    propagation = _panel(
        "Switch propagation (decision → applied on every live replica)",
        "s",
        *[
            query(
                f"histogram_quantile({q}, sum by (app, le) (ray_specserve_switch_propagation_seconds_bucket{{{APP}}}))",
                f"p{round(q * 100)} ({{{{app}}}})",
                ref,
            )
            for q, ref in ((0.5, "A"), (0.99, "B"))
        ],
    )
    decision = _panel(
        "Controller decision latency (one tick)",
        "s",
        *[
            query(
                f"histogram_quantile({q}, sum by (app, le)"
                f" (rate(ray_specserve_controller_decision_seconds_bucket{{{APP}}}[$__rate_interval])))",
                f"p{round(q * 100)} ({{{{app}}}})",
                ref,
            )
            for q, ref in ((0.5, "A"), (0.99, "B"))
        ],
    )
    switches = _panel(
        "Switches by reason (cumulative)",
        "short",
        query(f"sum by (app, reason) (ray_specserve_switches_total{{{APP}}})", "{{reason}} ({{app}})", "A"),
    )
    annotations = _panel(
        "Grafana HTTP annotations by result (cumulative)",
        "short",
        query(f"sum by (app, result) (ray_specserve_grafana_annotations_total{{{APP}}})", "{{result}} ({{app}})", "A"),
        description="Only when the controller's optional grafana block is set.",
    )
    return (
        new_dashboard(
            UID,
            "specserve control plane",
            "The controller: the load it sees, its tiers, decisions, and how fast each switch reaches the replicas.",
        )
        .with_panel(load)
        .with_panel(mode)
        .with_panel(propagation)
        .with_panel(decision)
        .with_panel(switches)
        .with_panel(annotations)
    )
