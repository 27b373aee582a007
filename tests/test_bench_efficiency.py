"""`bench efficiency`: the stack's tokens/s over its engines' own, end to end on the tiny-random app."""

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from serve_app.engines.embedded import EmbeddedEngine
from serve_app.tools.bench.__main__ import main
from serve_app.tools.bench.client import Record
from serve_app.tools.bench.efficiency import EngineTarget, engine_row
from serve_app.tools.bench.prompts import PROMPT_SETS, chat_messages
from serve_app.tools.bench.serve import Window

from .test_bench_serve import TINY_CONFIG


@pytest.mark.slow  # starts its own Ray and Serve, and two engine processes
def test_bench_efficiency_measures_the_stack_and_as_many_engines_as_replicas_side_by_side(tmp_path):
    config, out = tmp_path / "tiny.yaml", tmp_path / "efficiency.json"
    config.write_text(textwrap.dedent(TINY_CONFIG))
    env = {k: v for k, v in os.environ.items() if k != "SPECSERVE_BENCH_TEST_TOKEN"}
    proc = subprocess.run([sys.executable, "-m", "serve_app.tools.bench", "efficiency", "--config", str(config),
                           "--set", "num_replicas=2", "--concurrency", "2,4", "--spec-steps", "3",
                           "--settle-s", "0.5", "--measure-s", "1.5", "--max-tokens", "8", "--ignore-eos",
                           "--out", str(out)],
                          cwd=Path(__file__).parent.parent, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["concurrency"], r["policy"], r["num_steps"]) for r in rows] == [
        (2, "spec", 3), (2, "off", 0), (4, "spec", 3), (4, "off", 0)]
    for r in rows:
        assert len(r["engines"]["per_engine_tokens_per_s"]) == 2 and all(t > 0 for t in r["engines"]["per_engine_tokens_per_s"])
        assert r["stack_tokens_per_s"] > 0 and r["engines"]["errors"] == 0 and r["stack"]["errors"] == 0
        assert r["efficiency"] == round(r["stack_tokens_per_s"] / r["engines_tokens_per_s"], 4)
        assert r["efficiency_ci95"] is None  # one window a side: no interval
    assert {r["policy"]: r["stack"]["mode_share"] for r in rows if r["concurrency"] == 2} == {
        "spec": {"3": 1.0}, "off": {"0": 1.0}}
    assert result["meta"]["replicas"] == 2 and "efficiency" in proc.stdout


def test_bench_efficiency_refuses_what_it_cannot_split_or_build(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(textwrap.dedent(TINY_CONFIG))
    with pytest.raises(SystemExit, match="multiples of the 2 replicas"):
        main(["efficiency", "--config", str(config), "--set", "num_replicas=2", "--concurrency", "2,3"])
    with pytest.raises(SystemExit, match="not --url"):
        main(["efficiency", "--url", "http://127.0.0.1:9"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["efficiency", "--config", str(config), "--policies", "dynamic"])
    assert "--policies: policies are spec, off; got 'dynamic'" in capsys.readouterr().err


def test_an_engine_target_times_an_in_process_engine_as_the_http_client_times_the_stack():
    engine = EmbeddedEngine(model="tiny-random", max_num_seqs=4, max_model_len=256)

    async def go() -> Record:
        await engine.start()
        try:
            return await EngineTarget(engine).chat(0, chat_messages(PROMPT_SETS["chat"][0]), 6, True)
        finally:
            await engine.shutdown()

    rec = asyncio.run(go())
    assert rec.ok and rec.output_tokens == 6 and len(rec.chunk_times) >= 1
    assert rec.chunk_times == sorted(rec.chunk_times) and rec.chunk_times[0] >= rec.start


def test_the_engines_side_sums_each_engine_s_pooled_windows():
    def window(tokens: float) -> Window:
        return Window(timings=[], tokens=tokens, completed=0, errors=0, settle_s=1.0, measure_s=2.0,
                      poll={"switches": 0, "mean_load_per_replica": None, "mode_share": {"0": 1.0}})

    row = engine_row([[window(100), window(60)], [window(50), window(50)]])
    assert row["per_engine_tokens_per_s"] == [40.0, 25.0] and row["output_tokens_per_s"] == 65.0
    assert row["window_tokens_per_s"] == [75.0, 55.0]  # window by window, the engines together
