"""The overview: what mode each replica is in, why it switched, and what each mode did."""

from __future__ import annotations

from grafana_foundation_sdk.builders import common, stat, statetimeline, table
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.models import dashboard as gm

from serve_app.tools.dashboards.common import APP, DATASOURCE, new_dashboard, quantiles, query, timeseries_panel

UID = "specserve-overview"


def _quantiles(metric: str) -> list:
    return quantiles(
        f"histogram_quantile({{q}}, sum by (le, num_steps) (rate({metric}_bucket{{{APP}}}[$__rate_interval])))",
        "p{p} at {{num_steps}} steps",
    )


def build() -> gd.Dashboard:
    mode_timeline = (
        statetimeline.Panel()
        .title("Mode per replica (draft steps; 0 = plain decode)")
        .datasource(DATASOURCE)
        .targets(
            [
                query(f"max by (app) (ray_specserve_cluster_num_steps{{{APP}}})", "controller ({{app}})", "A"),
                query(f"max by (replica) (ray_specserve_replica_num_steps{{{APP}}})", "{{replica}}", "B"),
            ]
        )
        .span(24)
        .height(7)
        .color_scheme(gd.FieldColor().mode(gm.FieldColorModeId.CONTINUOUS_BL_YL_RD))
    )
    ran = timeseries_panel(
        "Draft steps: the controller's ceiling and what each engine ran",
        "short",
        query(f"max by (replica) (ray_specserve_replica_num_steps{{{APP}}})", "{{replica}} ceiling", "A"),
        query(f"max by (replica) (ray_specserve_replica_mean_num_steps{{{APP}}})", "{{replica}} ran (mean)", "B"),
        description="The controller commands a ceiling; an engine with step_policy adaptive picks each decode "
        "step's draft length under it from its batch, its measured step cost and its acceptance (0 when drafts "
        "would lose). Without it, ran = ceiling.",
        span=24,
    )
    queue = timeseries_panel(
        "Cluster queue against the tier thresholds",
        "short",
        query(f"max by (app) (ray_specserve_cluster_queue{{{APP}}})", "cluster queue ({{app}})", "A"),
        query(
            f"max by (app, tier, num_steps) (ray_specserve_policy_tier_bound{{{APP}}})"
            f" * on (app) group_left max by (app) (ray_specserve_live_replicas{{{APP}}})",
            "tier {{tier}}: {{num_steps}} steps below",
            "B",
        ),
        description="Waiting + running requests over live replicas; each threshold is a tier's load-per-replica "
        "bound times the live replicas (the policy adds a hysteresis margin to leave a tier).",
    )
    replica_load = timeseries_panel(
        "Waiting and running per replica",
        "short",
        query(f"max by (replica) (ray_specserve_replica_waiting{{{APP}}})", "{{replica}} waiting", "A"),
        query(f"max by (replica) (ray_specserve_replica_running{{{APP}}})", "{{replica}} running", "B"),
    )
    throughput = timeseries_panel(
        "Output tokens per second",
        "short",
        query(f"sum by (app) (rate(ray_specserve_output_tokens_total{{{APP}}}[$__rate_interval]))", "{{app}}", "A"),
        query(
            f"max by (replica) (ray_specserve_replica_output_tokens_per_second{{{APP}}})", "{{replica}} (engine)", "B"
        ),
        span=12,
    )
    acceptance = timeseries_panel(
        "Draft acceptance rate",
        "percentunit",
        query(f"max by (replica) (ray_specserve_replica_accept_rate{{{APP}}})", "{{replica}}", "A"),
        span=12,
    )
    ttft = timeseries_panel("Time to first token by mode", "s", *_quantiles("ray_specserve_ttft_seconds"))
    tpot = timeseries_panel("Time per output token by mode", "s", *_quantiles("ray_specserve_tpot_seconds"))
    since_switch = (
        stat.Panel()
        .title("Since the last switch")
        .datasource(DATASOURCE)
        .unit("s")
        .targets([query(f"time() - max(ray_specserve_last_switch_timestamp_seconds{{{APP}}})", "since", "A")])
        .span(6)
        .height(8)
    )
    switches = (
        table.Panel()
        .title("Recent switches (latest of each kind)")
        .description(
            "One row per (from, to, reason): when it last happened and how often since the controller started."
        )
        .datasource(DATASOURCE)
        .targets(
            [
                query(
                    f"max by (app, from, to, reason) (ray_specserve_switch_timestamp_seconds{{{APP}}}) * 1000",
                    "",
                    "A",
                    instant=True,
                    table=True,
                ),
                query(
                    f"sum by (app, from, to, reason) (ray_specserve_switches_total{{{APP}}})",
                    "",
                    "B",
                    instant=True,
                    table=True,
                ),
            ]
        )
        .with_transformation(gm.DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(
            gm.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True},
                    "renameByName": {"Value #A": "last switch", "Value #B": "count"},
                    "indexByName": {"Value #A": 0, "app": 1, "from": 2, "to": 3, "reason": 4, "Value #B": 5},
                },
            )
        )
        .sort_by([common.TableSortByFieldState().display_name("last switch").desc(True)])
        .override_by_name("last switch", [gm.DynamicConfigValue(id_val="unit", value="dateTimeAsIso")])
        .span(18)
        .height(8)
    )
    return (
        new_dashboard(
            UID,
            "specserve overview",
            "Speculation mode per replica, the load that drives it, each switch and why, and what each mode did "
            "to throughput and latency. Orange markers: mode switches.",
        )
        .with_row(gd.Row("Mode"))
        .with_panel(mode_timeline)
        .with_panel(ran)
        .with_row(gd.Row("Load"))
        .with_panel(queue)
        .with_panel(replica_load)
        .with_row(gd.Row("Throughput and latency"))
        .with_panel(throughput)
        .with_panel(acceptance)
        .with_panel(ttft)
        .with_panel(tpot)
        .with_row(gd.Row("Switches"))
        .with_panel(switches)
        .with_panel(since_switch)
    )
