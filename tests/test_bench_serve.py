"""`bench serve`, `bench trace` and `bench report` end to end on the tiny-random app, plus their pure parts."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from serve_app.tools.bench.__main__ import main
from serve_app.tools.bench.client import Record, with_overrides
from serve_app.tools.bench.serve import window_order
from serve_app.tools.bench.stats import paired_ratio_ci
from serve_app.tools.bench.trace import (
    Replay,
    make_trace,
    off_overloaded,
    policy_stats,
    pooled_stats,
    rates_from_rows,
    run_slo,
    slo_from_sweep,
    slo_source,
)

ROW_FIELDS = {"policy", "concurrency", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
              "tpot_p99_ms", "switches"}
FAST = ["--settle-s", "0.5", "--measure-s", "1.5", "--max-tokens", "8", "--ignore-eos"]
TINY_CONFIG = """
applications:
  - name: benchtiny
    route_prefix: /
    import_path: serve_app.serving.app:build_app
    args:
      engine:
        embedded: {model: tiny-random, device: cpu, num_threads: 1, max_num_seqs: 8}
      num_replicas: 1
      replica_ray_actor_options: {num_cpus: 0}
      admin_token_env: SPECSERVE_BENCH_TEST_TOKEN
"""


@pytest.fixture(scope="module")
def results(reset_tiny_app, tmp_path_factory):
    """One sweep and one trace against the shared tiny app (two replicas, ladder: load < 2 → 4, else 0)."""
    out = tmp_path_factory.mktemp("bench")
    url = reset_tiny_app.prefix
    assert main(["serve", "--url", url, "--admin-token-env", "SPECSERVE_TEST_ADMIN_TOKEN", "--concurrency", "1,6",
                 "--repeats", "2", *FAST, "--out", str(out / "serve_sweep.json")]) == 0
    assert main(["trace", "--url", url, "--admin-token-env", "SPECSERVE_TEST_ADMIN_TOKEN", "--trace", "bursty",
                 "--phases", "3", "--phase-s", "1.5", "--low-rate", "1", "--high-rate", "8", "--seed", "7",
                 "--max-tokens", "8", "--ignore-eos", "--tpot-slo-ms", "1000", "--rounds", "2",
                 "--out", str(out / "serve_trace.json")]) == 0
    return out


@pytest.fixture(scope="module")
def reset_tiny_app(tiny_app):  # module scope: both commands share one reset app
    tiny_app.reset()
    yield tiny_app
    tiny_app.reset()


def test_bench_serve_writes_one_row_per_concurrency_and_policy_in_sweep_order(results):
    sweep = json.loads((results / "serve_sweep.json").read_text())

    assert [(r["concurrency"], r["policy"]) for r in sweep["rows"]] == [
        (c, p) for c in (1, 6) for p in ("spec", "off", "dynamic")]
    for row in sweep["rows"]:
        assert ROW_FIELDS <= row.keys()
        assert row["output_tokens_per_s"] > 0 and row["num_requests"] > 0 and row["errors"] == 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and 0 < row["tpot_p50_ms"] <= row["tpot_p99_ms"]
    assert [x["concurrency"] for x in sweep["ratios"]] == [1, 6]
    for x in sweep["ratios"]:  # 2 windows a policy: an interval from the two pairs
        lo, hi = x["dynamic_over_best_static_ci95"]
        assert 0 < lo <= hi
    assert sweep["meta"]["spec_steps"] == 4 and sweep["meta"]["replicas"] == 2


def test_bench_serve_pools_a_rows_repeated_windows(results):
    sweep = json.loads((results / "serve_sweep.json").read_text())

    assert sweep["meta"]["repeats"] == 2
    for row in sweep["rows"]:
        assert row["windows"] == 2 and len(row["window_tokens_per_s"]) == 2
        # equal windows: the row's tokens/s is their mean
        assert row["output_tokens_per_s"] == pytest.approx(sum(row["window_tokens_per_s"]) / 2, abs=0.01)


def test_a_ratio_s_interval_comes_from_windows_paired_by_repeat():
    assert paired_ratio_ci([110, 220, 330], [100, 200, 300]) == [1.1, 1.1]  # every pair 1.1: no spread
    lo, hi = paired_ratio_ci([105, 95, 100, 102], [100, 100, 100, 100])
    assert lo < 1.0 < hi and hi - lo < 0.15  # sd 0.042, t(3) 3.18: half-width 0.067
    wide = paired_ratio_ci([105, 95], [100, 100])  # two pairs: t with 1 degree of freedom
    assert wide[0] < lo and wide[1] > hi
    assert paired_ratio_ci([105], [100]) is None and paired_ratio_ci([0, 90], [100, 100]) is None
    with pytest.raises(ValueError, match="as many on each side"):
        paired_ratio_ci([1, 2], [1])


def test_repeated_windows_run_in_mirrored_order():
    assert window_order(["spec", "off", "dynamic"], 1) == ["spec", "off", "dynamic"]
    assert window_order(["spec", "off", "dynamic"], 3) == ["spec", "off", "dynamic", "dynamic", "off", "spec",
                                                          "spec", "off", "dynamic"]


def test_bench_serve_pins_spec_and_off_and_lets_the_policy_choose_under_dynamic(results):
    rows = {(r["policy"], r["concurrency"]): r for r in json.loads((results / "serve_sweep.json").read_text())["rows"]}

    for c in (1, 6):
        assert rows["spec", c]["mode_share"] == {"4": 1.0} and rows["spec", c]["switches"] == 0
        assert rows["off", c]["mode_share"] == {"0": 1.0} and rows["off", c]["switches"] == 0
        assert rows["spec", c]["steps_ran"] == 4 and rows["off", c]["steps_ran"] == 0  # what the replicas ran
    assert rows["dynamic", 1]["mode_share"].get("4", 0) > 0.5  # 0.5 clients per replica: the low-load tier
    assert rows["dynamic", 6]["mean_load_per_replica"] > rows["dynamic", 1]["mean_load_per_replica"]


def test_bench_trace_replays_the_same_arrivals_against_each_policy_in_rounds(results):
    trace = json.loads((results / "serve_trace.json").read_text())

    assert set(trace["policies"]) == {"spec", "off", "dynamic"}
    assert trace["meta"]["rounds"] == 2 and trace["meta"]["tpot_slo_from"] == "ms"
    assert trace["meta"]["off_overloaded"] is False  # 1 req/s of 8 tokens in the low phases
    assert trace["trace"]["arrivals"] == make_trace("bursty", 7, 1, 8, 1.5, 3)["arrivals"]
    n = len(trace["trace"]["arrivals"])
    for s in trace["policies"].values():
        assert s["num_requests"] == 2 * n and s["errors"] == 0  # both rounds pooled
        assert 0 < s["goodput_tokens_per_s"] <= s["output_tokens_per_s"]
        assert set(s["phases"]) == {"low", "high"} and s["tpot_p50_low_load_ms"] == s["phases"]["low"]["tpot_p50_ms"]
        assert s["switches"] is not None and s["timeline"]["mode"] and len(s["timeline"]["requests"]) == n
        assert len(s["rounds"]) == 2 and all(r["goodput_tokens_per_s"] > 0 for r in s["rounds"])
        assert s["goodput_at_slo_x"]["1"] == s["goodput_tokens_per_s"]


def test_trace_rates_and_slo_can_come_from_a_sweep_of_the_same_machine(results):
    sweep = json.loads((results / "serve_sweep.json").read_text())
    rows = {(r["policy"], r["concurrency"]): r for r in sweep["rows"]}

    low, high = rates_from_rows(sweep["rows"])
    slo = slo_from_sweep(sweep["rows"])
    assert low == pytest.approx(0.5 * rows["spec", 1]["requests_per_s"], rel=1e-3)
    assert high == pytest.approx(0.9 * rows["off", 6]["requests_per_s"], rel=1e-3)
    assert slo == pytest.approx(1.5 * rows["off", 1]["tpot_p50_ms"], abs=0.1)


def test_trace_rates_can_come_from_a_probe_of_this_run(reset_tiny_app, tmp_path):
    out = tmp_path / "probe.json"
    assert main(["trace", "--url", reset_tiny_app.prefix, "--admin-token-env", "SPECSERVE_TEST_ADMIN_TOKEN",
                 "--trace", "bursty", "--phases", "3", "--phase-s", "1.5", "--seed", "7", "--policies", "off,dynamic",
                 "--rates-from", "probe", "--probe-concurrency", "1,4", "--probe-settle-s", "0.5",
                 "--probe-measure-s", "1.5", "--max-tokens", "8", "--ignore-eos", "--out", str(out)]) == 0

    result = json.loads(out.read_text())
    spec, off = result["probe"]
    assert (spec["policy"], spec["concurrency"], off["policy"], off["concurrency"]) == ("spec", 1, "off", 4)
    assert spec["mode_share"] == {"4": 1.0} and off["mode_share"] == {"0": 1.0}  # each window ran its mode
    tr = result["trace"]
    assert (tr["low_rate"], tr["high_rate"]) == rates_from_rows(result["probe"]) and 0 < tr["low_rate"] < tr["high_rate"]
    assert tr["arrivals"] == make_trace("bursty", 7, tr["low_rate"], tr["high_rate"], 1.5, 3)["arrivals"]
    assert result["meta"]["rates_from"] == "probe" and result["meta"]["tpot_slo_from"] == "run"
    assert all(s["num_requests"] == len(tr["arrivals"]) for s in result["policies"].values())


@pytest.mark.parametrize("argv, message", [
    (["--rates-from", "probe", "--tpot-slo-from", "sweep"], "give a sweep's JSON file"),
    (["--rates-from", "probe", "--probe-concurrency", "1,8,32"], "two positive client counts"),
    (["--rates-from", "probe", "--probe-measure-s", "0"], "--probe-measure-s must be > 0"),
    (["--rates-from", "probe", "--trace", "TRACE"], "a trace file has its own"),
])
def test_a_probe_that_cannot_give_rates_is_refused_before_any_request(tmp_path, argv, message):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"arrivals": [{"t": 0.5, "phase": "low"}]}))
    argv = [str(trace) if a == "TRACE" else a for a in argv]
    with pytest.raises(SystemExit, match=message):
        main(["trace", "--url", "http://127.0.0.1:9", *argv])


def test_bench_report_writes_markdown_with_ratios_and_both_plots(results):
    assert main(["report", "--sweep", str(results / "serve_sweep.json"), "--trace", str(results / "serve_trace.json"),
                 "--out-dir", str(results)]) == 0

    md = (results / "report.md").read_text()
    assert "dynamic / best static" in md and "goodput" in md and "low-load TPOT p50 within 10% of spec" in md
    assert "95 % interval (paired windows)" in md
    for png in ("serve_sweep.png", "serve_trace.png"):
        assert (results / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # starts its own Ray and Serve
def test_bench_serve_brings_up_the_app_of_a_config_itself(tmp_path):
    """Its own Ray, in a subprocess (this test session may hold one already); random admin token."""
    config, out = tmp_path / "tiny.yaml", tmp_path / "sweep.json"
    config.write_text(textwrap.dedent(TINY_CONFIG))
    env = {k: v for k, v in os.environ.items() if k != "SPECSERVE_BENCH_TEST_TOKEN"}
    proc = subprocess.run([sys.executable, "-m", "serve_app.tools.bench", "serve", "--config", str(config),
                           "--concurrency", "2", "--policies", "off,dynamic", *FAST, "--out", str(out),
                           "--set", "streaming.chunks_per_s=0"],
                          cwd=Path(__file__).parent.parent, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["meta"]["overrides"] == ["streaming.chunks_per_s=0"]
    rows = result["rows"]
    assert [(r["policy"], r["mode_share"].get("0")) for r in rows][0] == ("off", 1.0)
    assert "dynamic / best static (95 % interval of paired windows): c=2: " in proc.stdout


# -- pure parts --------------------------------------------------------------------------
def test_set_changes_one_app_arg_of_the_config_and_refuses_what_is_not_a_path():
    raw = {"streaming": {"chunks_per_s": 200}, "engine": {"embedded": {"model": "x"}}}
    out = with_overrides(raw, ["streaming.chunks_per_s=0", "engine.embedded.max_num_seqs=64", "limits.retries=1"])
    assert out == {"streaming": {"chunks_per_s": 0}, "engine": {"embedded": {"model": "x", "max_num_seqs": 64}},
                   "limits": {"retries": 1}}
    assert raw["streaming"]["chunks_per_s"] == 200, "the config read stays as it was"
    for bad in ("streaming.chunks_per_s", "=3", "engine.embedded.model.x=1"):
        with pytest.raises(SystemExit):
            with_overrides(raw, [bad])


def test_traces_are_seeded_and_every_arrival_is_in_its_phase():
    a, b = make_trace("bursty", 3, 0.5, 5, 10, 5), make_trace("bursty", 3, 0.5, 5, 10, 5)
    assert a == b and a != make_trace("bursty", 4, 0.5, 5, 10, 5)
    assert [p["name"] for p in a["phases"]] == ["low", "high", "low", "high", "low"]
    for arrival in a["arrivals"]:
        (phase,) = [p for p in a["phases"] if p["start"] <= arrival["t"] < p["end"]]
        assert arrival["phase"] == phase["name"]
    highs = sum(x["phase"] == "high" for x in a["arrivals"])
    assert highs > 3 * (len(a["arrivals"]) - highs)  # 10x the rate over 2/3 of the time
    d = make_trace("diurnal", 3, 0.5, 5, 10, 4)
    assert [p["name"] for p in d["phases"]] == ["low", "high", "low"] and d["duration_s"] == 40


def test_goodput_counts_only_the_tokens_of_requests_within_the_tpot_slo():
    fast = Record(0.0, 0, output_tokens=11, chunk_times=[0.1 + 0.01 * i for i in range(11)], phase="low")  # 10 ms
    slow = Record(0.0, 1, output_tokens=11, chunk_times=[0.1 + 0.05 * i for i in range(11)], phase="high")  # 50 ms
    failed = Record(0.0, 2, error="HTTP 429", phase="high")

    s = policy_stats([fast, slow, failed], wall_s=2.0, slo_ms=20)
    assert s["output_tokens_per_s"] == 11.0 and s["goodput_tokens_per_s"] == 5.5 and s["errors"] == 1
    assert s["tpot_p50_low_load_ms"] == pytest.approx(10) and s["phases"]["high"]["slo_attainment"] == 0


def _record(i: int, tpot_ms: float, phase: str, tokens: int = 11) -> Record:
    return Record(0.0, i, output_tokens=tokens, chunk_times=[0.1 + tpot_ms / 1000 * j for j in range(tokens)],
                  phase=phase)


def test_a_policy_s_rounds_pool_into_one_figure_and_each_round_keeps_its_own():
    one = Replay([_record(0, 10, "low"), _record(1, 50, "high")], wall_s=2.0, switches=1, timeline={"mode": [1]})
    two = Replay([_record(0, 12, "low"), _record(1, 28, "high")], wall_s=2.0, switches=2, timeline={"mode": [2]})

    s = pooled_stats([one, two], slo_ms=40)
    assert s["num_requests"] == 4 and s["output_tokens_per_s"] == 11.0  # 44 tokens over 4 s
    assert s["goodput_tokens_per_s"] == 8.25  # the 50 ms request misses the 40 ms SLO
    assert [r["goodput_tokens_per_s"] for r in s["rounds"]] == [5.5, 11.0]
    assert s["rounds"][0]["tpot_p50_by_phase_ms"] == {"low": pytest.approx(10), "high": pytest.approx(50)}
    assert s["switches"] == 3 and s["timeline"] == {"mode": [1]}  # the first round's timeline, for the plot
    assert s["goodput_at_slo_x"] == {"0.75": 8.25, "1": 8.25, "1.5": 11.0, "2": 11.0}  # 30, 40, 60, 80 ms: 28 ms meets all four


def test_the_run_s_slo_is_off_s_low_phase_tpot_and_its_source_is_checked():
    off = [_record(0, 10, "low"), _record(1, 14, "low"), _record(2, 12, "low"), _record(3, 90, "high"),
           Record(0.0, 4, error="HTTP 429", phase="low")]
    assert run_slo(off) == 18.0  # 1.5 x the median of 10, 12, 14; the burst and the failed request left out
    assert run_slo([_record(0, 90, "high")]) is None

    assert slo_source(20.0, None, ["spec", "off"], 17.0) == "ms"
    assert slo_source(None, None, ["spec", "off"], 17.0) == "sweep"  # --rates-from: the sweep's
    assert slo_source(None, None, ["spec", "off"], None) == "run"  # else off's low phases in this run
    assert slo_source(None, None, ["spec", "dynamic"], None) == "default"
    assert slo_source(None, "run", ["off"], 17.0) == "run"
    for bad in ((20.0, "run", ["off"], None), (None, "run", ["spec"], None), (None, "sweep", ["off"], None)):
        with pytest.raises(SystemExit):
            slo_source(*bad)


def test_a_request_s_tokens_are_spread_over_its_chunks_for_windowed_throughput():
    r = Record(0.0, 0, output_tokens=8, chunk_times=[1.0, 2.0, 3.0, 4.0])
    assert r.tokens_between(0, 10) == 8 and r.tokens_between(1.5, 3.5) == 4 and r.tokens_between(5, 6) == 0
    assert Record(0.0, 0, output_tokens=8, chunk_times=[1.0], error="cut").tokens_between(0, 10) == 0


def test_report_explains_a_short_point_by_what_dynamic_ran():
    from serve_app.tools.bench.report import why_short

    def rows(spec, off, dyn, dyn_mode, switches=0):
        return [{"policy": "spec", "concurrency": 16, "output_tokens_per_s": spec, "mode_share": {"3": 1.0}},
                {"policy": "off", "concurrency": 16, "output_tokens_per_s": off, "mode_share": {"0": 1.0}},
                {"policy": "dynamic", "concurrency": 16, "output_tokens_per_s": dyn, "mode_share": {dyn_mode: 1.0},
                 "switches": switches, "mean_load_per_replica": 8.0}]

    # off's mode, with off itself within 0.95 of spec: the shortfall is spread, not the ladder
    assert "run-to-run spread" in why_short(rows(265.3, 262.6, 246.6, "0"), 16, "spec")
    # off's mode where off is far behind spec: the ladder's boundary is wrong for this load
    assert "boundary is off" in why_short(rows(300.0, 200.0, 205.0, "0"), 16, "spec")
    assert "same mode as the best static" in why_short(rows(300.0, 200.0, 280.0, "3"), 16, "spec")
    assert "switched 2x" in why_short(rows(300.0, 200.0, 250.0, "3", switches=2), 16, "spec")
    # where the calibration measured the ladder's mode ahead at that load, the report says so
    calibration = {"measurements": {"rows": [{"num_steps": 3, "load_per_replica": 8.0, "output_tokens_per_s": 278.0},
                                             {"num_steps": 0, "load_per_replica": 8.0, "output_tokens_per_s": 293.0}]}}
    why = why_short(rows(300.0, 200.0, 205.0, "0"), 16, "spec", calibration)
    assert "the calibration measured num_steps 0 at 1.05x num_steps 3 at load 8" in why
    assert why_short(rows(300.0, 200.0, 205.0, "0"), 16, "spec", {"measurements": {"rows": []}}).endswith("this load")


def test_staggered_clients_send_their_first_requests_spread_over_the_stagger():
    import asyncio
    import time

    from serve_app.tools.bench.client import Record
    from serve_app.tools.bench.serve import measure_window

    class FakeTarget:
        def __init__(self):
            self.starts = []

        async def chat(self, i, messages, max_tokens, ignore_eos):
            rec = Record(time.perf_counter(), i, output_tokens=2)
            self.starts.append(rec.start)
            await asyncio.sleep(0.5)  # longer than the stagger: the first 4 starts are the clients' first
            rec.chunk_times = [time.perf_counter()]
            return rec

    class FakePoller:
        def summary(self, t0, t1):
            return {"switches": 0, "mean_load_per_replica": None, "mode_share": {}}

    async def first_starts(stagger):
        target = FakeTarget()
        t = time.perf_counter()
        await measure_window(target, FakePoller(), [[{"role": "user", "content": "x"}]] * 8, 4, 0.0, 0.1, 2, True,
                             stagger_s=stagger)
        return sorted(s - t for s in target.starts)[:4]

    together = asyncio.run(first_starts(0.0))
    assert max(together) < 0.03
    spread = asyncio.run(first_starts(0.4))  # clients at 0, 0.1, 0.2, 0.3 s
    assert spread[1] >= 0.09 and spread[3] >= 0.29 and spread[3] < 0.4


def test_report_says_when_dynamic_ran_one_mode_through_the_trace():
    from serve_app.tools.bench.report import trace_checks

    def policy(goodput, modes, switches=0):
        return {"goodput_tokens_per_s": goodput, "tpot_p50_low_load_ms": 20.0, "switches": switches,
                "timeline": {"mode": [[0.5 * i, k, 1.0] for i, k in enumerate(modes)]}}

    pol = {"spec": policy(21.1, [3, 3]), "off": policy(8.3, [0, 0]), "dynamic": policy(20.5, [3, 3, 3])}
    line = trace_checks(pol)[0]
    assert line.startswith("- dynamic's goodput ≥ both static policies: no")
    assert "did not switch: it ran num_steps 3 throughout, as static spec does" in line
    pol["dynamic"] = policy(20.5, [3, 0, 3], switches=2)  # it switched: no excuse offered
    assert "did not switch" not in trace_checks(pol)[0]
    pol["dynamic"] = policy(22.0, [3, 3])  # met: nothing to explain
    assert trace_checks(pol)[0].startswith("- dynamic's goodput ≥ both static policies: yes (22.0")


def test_bench_serve_runs_two_level_on_a_mixed_workload_and_puts_the_step_policy_back(reset_tiny_app, tmp_path):
    url, out = reset_tiny_app.prefix, tmp_path / "mixed.json"
    assert main(["serve", "--url", url, "--admin-token-env", "SPECSERVE_TEST_ADMIN_TOKEN", "--concurrency", "2",
                 "--policies", "off,dynamic,two-level", "--prompt-set", "chat,copy", "--sampled-every", "3", *FAST,
                 "--out", str(out)]) == 0
    sweep = json.loads(out.read_text())
    assert [r["policy"] for r in sweep["rows"]] == ["off", "dynamic", "two-level"]
    assert all(r["errors"] == 0 and r["num_requests"] > 0 for r in sweep["rows"])
    (x,) = sweep["ratios"]
    assert x["two_level_over_best_static"] > 0 and x["two_level_over_dynamic"] > 0
    # commanded 0 all window long (its steps_ran averages the replicas' last 5 s, which a
    # 2-second window's start still shares with the policy before)
    assert sweep["rows"][0]["mode_share"] == {"0": 1.0}
    two = sweep["rows"][2]  # under the ceiling, the engines' own choice, read back from the replicas
    assert two["steps_ran"] is not None and 0 <= two["steps_ran"] <= max(int(k) for k in two["mode_share"])
    assert sweep["meta"]["sampled_every"] == 3 and sweep["meta"]["prompt_set"] == "chat,copy"
    status = reset_tiny_app.speculation()
    assert status["policy"]["engine_step_policy"] is None and {r["step_policy"] for r in status["replicas"]} == {"fixed"}
    details = [e["detail"] for e in status["events"] if e["reason"] == "step_policy"]
    assert details[-2:] == ["engines' step_policy fixed -> adaptive", "engines' step_policy adaptive -> configured"]


def test_steps_ran_averages_each_replicas_mean_else_active_else_commanded_steps():
    from serve_app.tools.bench.client import steps_ran

    status = {"replicas": [{"num_steps": 3, "active_num_steps": 2, "mean_num_steps": 1.5},
                           {"num_steps": 3, "active_num_steps": 1, "mean_num_steps": None},
                           {"num_steps": 3, "active_num_steps": None, "mean_num_steps": None}]}
    assert steps_ran(status) == pytest.approx((1.5 + 1 + 3) / 3)
    assert steps_ran({"replicas": []}) is None


def test_every_nth_request_is_sampled_with_its_index_as_seed():
    from serve_app.tools.bench.client import sampling_for

    assert [sampling_for(i, 3) for i in range(6)] == [(0.0, None), (0.0, None), (1.0, 2), (0.0, None), (0.0, None),
                                                      (1.0, 5)]
    assert {sampling_for(i, 0) for i in range(5)} == {(0.0, None)}


def test_a_run_slo_on_a_trace_without_low_phases_is_refused_before_any_replay(tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"arrivals": [{"t": 0.5}, {"t": 1.0}]}))  # one phase: "all"
    with pytest.raises(SystemExit, match="has none"):
        main(["trace", "--url", "http://127.0.0.1:9", "--trace", str(trace), "--tpot-slo-from", "run"])


def test_off_is_overloaded_when_its_low_phase_requests_wait_for_the_bursts_backlog():
    def policies(ttft_ms):
        return {"off": {"phases": {"low": {"ttft_p50_ms": ttft_ms}, "high": {"ttft_p50_ms": 9000.0}}}}

    assert off_overloaded(policies(120.0)) is False  # bursts may queue; the low phases start clean
    assert off_overloaded(policies(5187.0)) is True
    assert off_overloaded({"spec": {}}) is None and off_overloaded({"off": {"phases": {"all": {}}}}) is None
