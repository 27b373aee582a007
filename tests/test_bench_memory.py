"""``bench memory`` reads RSS idle, under load and after, with the KV cache released after."""

import json

from serve_app.tools.bench.__main__ import main


def test_bench_memory_reports_idle_loaded_and_after_with_the_cache_released(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text("engine:\n  embedded: {model: tiny-random, device: cpu, num_threads: 1, max_num_seqs: 8}\n")
    out = tmp_path / "memory.json"
    assert main(["memory", "--config", str(config), "--concurrency", "8", "--max-tokens", "40",
                 "--settle-s", "0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [json.loads(line) for line in printed] == [result]
    assert result["output_tokens"] == 8 * 40
    assert result["idle"]["kv_cache_mib"] == 0 == result["after"]["kv_cache_mib"]
    assert result["loaded_peak"]["rss_mib"] >= result["idle"]["rss_mib"] > 0
