"""The control plane: the load the policy sees, how fast decisions are made and spread."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as gd

from serve_app.tools.dashboards.common import APP, new_dashboard, quantiles, query, timeseries_panel

UID = "specserve-control-plane"


def build() -> gd.Dashboard:
    load = timeseries_panel(
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
    mode = timeseries_panel(
        "Cluster mode and live replicas",
        "short",
        query(f"max by (app) (ray_specserve_cluster_num_steps{{{APP}}})", "num_steps ({{app}})", "A"),
        query(f"max by (app) (ray_specserve_live_replicas{{{APP}}})", "live replicas ({{app}})", "B"),
    )
    # Switches are rare: quantiles over every switch since the controller started, not a rate.
    propagation = timeseries_panel(
        "Switch propagation (decision → applied on every live replica)",
        "s",
        *quantiles(
            f"histogram_quantile({{q}}, sum by (app, le) (ray_specserve_switch_propagation_seconds_bucket{{{APP}}}))",
            "p{p} ({{app}})",
        ),
    )
    decision = timeseries_panel(
        "Controller decision latency (one tick)",
        "s",
        *quantiles(
            "histogram_quantile({q}, sum by (app, le)"
            f" (rate(ray_specserve_controller_decision_seconds_bucket{{{APP}}}[$__rate_interval])))",
            "p{p} ({{app}})",
        ),
    )
    switches = timeseries_panel(
        "Switches by reason (cumulative)",
        "short",
        query(f"sum by (app, reason) (ray_specserve_switches_total{{{APP}}})", "{{reason}} ({{app}})", "A"),
    )
    annotations = timeseries_panel(
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
