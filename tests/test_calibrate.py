"""`python -m serve_app.tools.calibrate`: from a measured sweep to a policy file the configs include."""

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from serve_app.control.config import PolicyConfig
from serve_app.control.policy import raw_tier, target_tier
from serve_app.serving.config import AppArgs
from serve_app.tools.calibrate import crossover, derive_tiers, fit_margin, main, plain_crossovers, window_noise

CONFIGS = Path(__file__).parent.parent / "configs"


def test_the_crossover_is_interpolated_between_the_loads_around_it():
    spec, plain = {2: 100.0, 4: 100.0}, {2: 90.0, 4: 130.0}  # plain gains 40 over 2 loads, starts 10 behind
    assert crossover(spec, plain, 2, 4) == 2.5
    assert crossover(spec, {2: 120.0, 4: 130.0}, 2, 4) == 2  # already ahead at the lower load


def test_the_ladder_steps_down_where_fewer_steps_start_to_win():
    tps = {5: {1: 50, 2: 80, 4: 100, 8: 110, 16: 100},
           3: {1: 45, 2: 78, 4: 110, 8: 130, 16: 150},
           0: {1: 30, 2: 60, 4: 100, 8: 140, 16: 200}}
    tiers = derive_tiers(tps)

    assert [t["num_steps"] for t in tiers] == [5, 3, 0]
    assert 2 < tiers[0]["below"] < 4 and 4 < tiers[1]["below"] < 8 and "below" not in tiers[2]
    PolicyConfig.model_validate({"tiers": tiers})
    assert plain_crossovers(tps) == {"3": 6.0, "5": 4.0}


def test_a_tier_that_never_wins_is_left_out_and_noise_never_climbs_back_up():
    tps = {4: {1: 50, 2: 60, 4: 40, 8: 70}, 2: {1: 40, 2: 50, 4: 45, 8: 60}, 0: {1: 30, 2: 55, 4: 80, 8: 65}}
    assert [t["num_steps"] for t in derive_tiers(tps)] == [4, 0]  # 4 wins again at 8: ignored


def test_a_lead_inside_the_windows_spread_keeps_the_deeper_tier():
    tps = {3: {1: 326.6, 2: 500.4, 3: 478.7}, 1: {1: 333.8, 2: 492.0, 3: 644.2}, 0: {1: 267.2, 2: 443.9, 3: 496.4}}
    rows = [{"load_per_replica": load, "window_tokens_per_s": w}
            for load, w in [(1, [352.8, 300.3]), (1, [328.2, 339.4]), (2, [511.8, 489.0]), (3, [682.0, 606.4])]]
    noise = window_noise(rows)
    assert noise == pytest.approx({1: 26.25, 2: 11.4, 3: 37.8})
    assert [t["num_steps"] for t in derive_tiers(tps)] == [1, 0]  # 1 step's 2 % lead at load 1 drops 3 steps
    assert [t["num_steps"] for t in derive_tiers(tps, noise)] == [3, 1, 0]  # inside 3 steps' spread: a tie
    assert derive_tiers(tps, noise)[0]["below"] == 2.0  # 1 step overtakes 3 between loads 2 and 3
    assert window_noise([{"load_per_replica": 1, "window_tokens_per_s": [300.0]}]) == {1: 0.0}  # one window
    # 1 step leads at load 1 by 10, inside the noise of 20: 3 steps hold load 1, and their tier
    # ends where 1 step's lead outgrows the noise (10 behind it at 1, 95 ahead at 2), not at 1
    tied = {3: {1: 300, 2: 300}, 1: {1: 310, 2: 400}, 0: {1: 100, 2: 100}}
    assert derive_tiers(tied, {1: 20, 2: 5})[0] == {"below": 1.1, "num_steps": 3}
    assert crossover(tied[3], tied[1], 1, 2) == 1  # without the noise: 1 step is ahead at 1


def test_without_a_crossover_the_ladder_says_so_in_its_bounds():
    always_spec = {4: {1: 50, 2: 60}, 0: {1: 30, 2: 40}}
    assert derive_tiers(always_spec) == [{"below": 2, "num_steps": 4}, {"num_steps": 0}]  # past the sweep
    assert plain_crossovers(always_spec) == {"4": None}
    assert derive_tiers({4: {1: 20, 2: 30}, 0: {1: 30, 2: 40}}) == [{"num_steps": 0}]  # speculation never pays


def test_the_margin_is_cut_to_a_quarter_of_the_narrowest_band_so_every_tier_stays_reachable():
    ladder = [{"below": 2.0, "num_steps": 3}, {"below": 6.0, "num_steps": 1}, {"num_steps": 0}]
    assert fit_margin(1.0, [2.0, 6.0]) == 0.5  # 0..2 is the narrowest band
    assert fit_margin(0.2, [2.0, 6.0]) == 0.2  # a smaller margin stays
    assert fit_margin(1.0, []) == 1.0  # no boundary, nothing to cut
    assert fit_margin(1.0, [1.3]) == 0.33  # 0.325, two decimals
    policy = PolicyConfig(tiers=ladder, margin=0.5, dwell_s=0, min_switch_interval_s=0, smoothing_s=0)
    for load in (1.0, 4.0):  # the middle of each band gets its tier from the tiers on both sides
        assert {target_tier(load, t, policy) for t in range(3)} == {raw_tier(load, policy)}


def test_calibrate_sweeps_the_deployed_app_and_writes_a_policy_file_configs_include(tiny_app, tmp_path):
    tiny_app.reset()
    policy_file, results = tmp_path / "policy.yaml", tmp_path / "calibration.json"
    assert main(["--url", tiny_app.prefix, "--admin-token-env", "SPECSERVE_TEST_ADMIN_TOKEN", "--loads", "0.5,2",
                 "--settle-s", "0.3", "--measure-s", "1", "--max-tokens", "8", "--ignore-eos", "--repeats", "2",
                 "--stagger-s", "0.2", "--out", str(policy_file), "--results", str(results)]) == 0
    tiny_app.reset()

    written = yaml.safe_load(policy_file.read_text())
    assert written["tiers"][-1] == {"below": None, "num_steps": 0}
    capped = fit_margin(tiny_app.args["policy"]["margin"], PolicyConfig.model_validate(written).bounds)
    assert written["margin"] == capped  # the app's margin, capped
    assert policy_file.read_text().startswith("# Written by `python -m serve_app.tools.calibrate")
    args = AppArgs.model_validate({"policy_file": str(policy_file)})
    assert args.policy.model_dump() == written
    measured = yaml.safe_load(results.read_text())["measurements"]  # JSON is YAML
    assert {(r["num_steps"], r["concurrency"]) for r in measured["rows"]} == {(4, 1), (0, 1), (4, 4), (0, 4)}
    assert all(r["windows"] == 2 and len(r["window_tokens_per_s"]) == 2 for r in measured["rows"])
    assert measured["stagger_s"] == 0.2
    assert measured["cpu_model"]  # the host: speeds, and so the crossovers, differ between hosts


def test_calibrate_refuses_a_negative_stagger(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--url", "http://127.0.0.1:1", "--stagger-s", "-1"])
    assert exc.value.code == 2 and "--stagger-s must be >= 0" in capsys.readouterr().err


def test_local_config_takes_its_ladder_from_the_policy_file_calibrated_for_this_hosts_cpu_kernel():
    from serve_app.engines import cpu_id
    from serve_app.engines.embedded.qmm import kernel_path

    raw = yaml.safe_load((CONFIGS / "local.yaml").read_text())["applications"][0]["args"]
    assert raw["policy_file"] == {"avx2@amd-23-49": "configs/policies/local-avx2-amd-23-49.yaml",
                                  "avx2": "configs/policies/local-avx2.yaml", "default": "configs/policies/local.yaml"}
    assert set(raw.get("policy", {})) <= {"fall_dwell_s", "rise_min_interval_s"}  # the ladder and its margin come from the file
    files = raw["policy_file"]
    path = files.get(f"{kernel_path()}@{cpu_id()}", files.get(kernel_path(), files["default"]))
    from_file = yaml.safe_load((CONFIGS.parent / path).read_text())
    expected = PolicyConfig.model_validate(from_file | raw.get("policy", {}))
    assert AppArgs.model_validate(raw).policy == expected and expected.tiers == PolicyConfig.model_validate(from_file).tiers


def test_policy_fields_in_the_config_override_the_policy_file(tmp_path, monkeypatch):
    (tmp_path / "p.yaml").write_text("tiers: [{below: 3, num_steps: 2}, {num_steps: 0}]\nmargin: 0.5\n")
    monkeypatch.chdir(tmp_path)
    args = AppArgs.model_validate({"policy_file": "p.yaml", "policy": {"margin": 0.25}})
    assert args.policy.bounds == [3] and args.policy.margin == 0.25
    with pytest.raises(ValidationError, match="policy_file: nowhere.yaml not found"):
        AppArgs.model_validate({"policy_file": "nowhere.yaml"})


def test_a_policy_file_per_cpu_kernel_reads_the_one_for_this_hosts_kernel(tmp_path, monkeypatch):
    from serve_app.engines.embedded.qmm import kernel_path
    from serve_app.serving.config import CPU_KERNELS

    monkeypatch.chdir(tmp_path)
    for steps, name in ((3, "mine.yaml"), (2, "other.yaml"), (1, "default.yaml")):
        (tmp_path / name).write_text(f"tiers: [{{below: 3, num_steps: {steps}}}, {{num_steps: 0}}]\n")
    mine = kernel_path()
    other = next(k for k in CPU_KERNELS if k != mine)

    def first_steps(spec: dict) -> int:
        return AppArgs.model_validate({"policy_file": spec}).policy.tiers[0].num_steps

    assert first_steps({mine: "mine.yaml", other: "other.yaml", "default": "default.yaml"}) == 3
    assert first_steps({other: "other.yaml", "default": "default.yaml"}) == 1
    with pytest.raises(ValidationError, match=f"policy_file: none for this host's CPU kernel {mine} and no default"):
        AppArgs.model_validate({"policy_file": {other: "other.yaml"}})
    with pytest.raises(ValidationError, match="policy_file: unknown CPU kernel 'avx9'"):
        AppArgs.model_validate({"policy_file": {"avx9": "mine.yaml"}})
    with pytest.raises(ValidationError, match="policy_file: unknown CPU kernel 'avx9'"):
        AppArgs.model_validate({"policy_file": {"avx9@amd-23-49": "mine.yaml", "default": "default.yaml"}})


def test_a_policy_file_for_this_hosts_cpu_comes_before_its_kernels(tmp_path, monkeypatch):
    from serve_app.engines import cpu_id
    from serve_app.engines.embedded.qmm import kernel_path

    monkeypatch.chdir(tmp_path)
    for steps, name in ((3, "cpu.yaml"), (2, "kernel.yaml"), (1, "default.yaml")):
        (tmp_path / name).write_text(f"tiers: [{{below: 3, num_steps: {steps}}}, {{num_steps: 0}}]\n")
    mine, cpu = kernel_path(), cpu_id()

    def first_steps(spec: dict) -> int:
        return AppArgs.model_validate({"policy_file": spec}).policy.tiers[0].num_steps

    other_cpu = {f"{mine}@not-{cpu}": "cpu.yaml", mine: "kernel.yaml", "default": "default.yaml"}
    assert first_steps(other_cpu) == 2
    if cpu is not None:
        assert first_steps({f"{mine}@{cpu}": "cpu.yaml", mine: "kernel.yaml", "default": "default.yaml"}) == 3
        assert first_steps({f"{mine}@{cpu}": "cpu.yaml", "default": "default.yaml"}) == 3


def test_a_cpus_policy_file_not_written_yet_reads_the_kernels_until_calibrate_writes_it(tmp_path, monkeypatch,
                                                                                         caplog):
    from serve_app.engines import cpu_id
    from serve_app.engines.embedded.qmm import kernel_path
    from serve_app.tools.calibrate import default_out, parser

    cpu = cpu_id()
    if cpu is None:
        pytest.skip("this host's /proc/cpuinfo names no CPU")
    monkeypatch.chdir(tmp_path)
    for steps, name in ((2, "kernel.yaml"), (1, "default.yaml")):
        (tmp_path / name).write_text(f"tiers: [{{below: 3, num_steps: {steps}}}, {{num_steps: 0}}]\n")
    mine = f"{kernel_path()}@{cpu}"
    spec = {mine: "new-cpu.yaml", kernel_path(): "kernel.yaml", "default": "default.yaml"}
    with caplog.at_level("WARNING", logger="serve_app.serving.config"):
        assert AppArgs.model_validate({"policy_file": spec}).policy.tiers[0].num_steps == 2
    assert "new-cpu.yaml, this CPU's" in caplog.text and "does not exist yet" in caplog.text
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"policy_file": spec}))
    assert default_out(parser().parse_args(["--config", "config.yaml"])) == "new-cpu.yaml"  # where calibrate writes
    (tmp_path / "new-cpu.yaml").write_text("tiers: [{below: 3, num_steps: 3}, {num_steps: 0}]\n")
    assert AppArgs.model_validate({"policy_file": spec}).policy.tiers[0].num_steps == 3
    with pytest.raises(ValidationError, match="policy_file: gone.yaml, this host's CPU's, not found, and no key"):
        AppArgs.model_validate({"policy_file": {mine: "gone.yaml"}})
    with pytest.raises(ValidationError, match="policy_file: gone.yaml not found"):
        AppArgs.model_validate({"policy_file": {mine: "gone.yaml", "default": "gone.yaml"}})


def test_the_cpu_id_is_vendor_family_and_model_of_the_first_processor():
    from serve_app.engines import cpu_id

    amd = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 49\n"
           "model name\t: AMD EPYC\n\nprocessor\t: 1\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n")
    assert cpu_id(amd) == "amd-23-49"
    assert cpu_id("vendor_id : GenuineIntel\ncpu family : 6\nmodel name : Xeon\nmodel : 143\n") == "intel-6-143"
    assert cpu_id("processor : 0\nBogoMIPS : 50.00\n") is None  # no vendor, family or model (an ARM host)


def test_by_default_calibrate_writes_the_policy_file_the_config_reads_on_this_host():
    from serve_app.engines import cpu_id
    from serve_app.engines.embedded.qmm import kernel_path
    from serve_app.tools.calibrate import default_out, parser

    mine = {"avx2": "configs/policies/local-avx2.yaml"}.get(kernel_path(), "configs/policies/local.yaml")
    if kernel_path() == "avx2" and cpu_id() == "amd-23-49":
        mine = "configs/policies/local-avx2-amd-23-49.yaml"
    assert default_out(parser().parse_args(["--config", str(CONFIGS / "local.yaml")])) == mine
    assert default_out(parser().parse_args(["--url", "http://127.0.0.1:1"])) == "configs/policies/local.yaml"


@pytest.mark.parametrize(("results_file", "policy_file"), [("calibration.json", "local.yaml"),
                                                           ("calibration-avx2.json", "local-avx2.yaml"),
                                                           ("calibration-avx2-amd-23-49.json", "local-avx2-amd-23-49.yaml")])
def test_the_shipped_ladder_is_what_its_stored_measurements_give(tmp_path, results_file, policy_file):
    """configs/policies/local*.yaml come from bench/results/calibration*.json through --from-results."""
    out, results = tmp_path / "p.yaml", tmp_path / "c.json"
    root = CONFIGS.parent
    assert main(["--from-results", str(root / "bench/results" / results_file), "--out", str(out),
                 "--results", str(results)]) == 0
    assert yaml.safe_load(out.read_text()) == yaml.safe_load((CONFIGS / "policies" / policy_file).read_text())
    header = out.read_text().splitlines()[1]
    assert header.startswith("# from the measurements of `python -m serve_app.tools.calibrate --config")
    stored = json.loads(results.read_text())
    assert stored["measured_by"].startswith("python -m serve_app.tools.calibrate --config") and stored["measurements"]


def test_from_results_refuses_a_file_without_measurements(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    for text in ("{}", '{"measurements": {"rows": []}}', "not json"):  # no measurements; no command; not JSON
        bad.write_text(text)
        with pytest.raises(SystemExit) as exc:
            main(["--from-results", str(bad), "--out", str(tmp_path / "p.yaml")])
        assert exc.value.code == 2 and "not a calibrate --results file" in capsys.readouterr().err
