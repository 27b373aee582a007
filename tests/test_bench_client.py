"""SGLang's benchmark client (scripts/bench_client.sh), unmodified, against the local app."""

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sglangs_bench_serving_runs_against_the_app_and_reports_ttft_tpot_and_throughput(tiny_app, tmp_path):
    out = tmp_path / "result.jsonl"
    env = {**os.environ, "BASE_URL": tiny_app.prefix, "MODEL": "tiny-random"}
    proc = subprocess.run(
        [str(ROOT / "scripts" / "bench_client.sh"), "--num-prompts", "6", "--max-concurrency", "3",
         "--sharegpt-output-len", "8", "--warmup-requests", "1", "--disable-tqdm", "--output-file", str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Serving Benchmark Result" in proc.stdout
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["completed"] == 6 and result["total_output_tokens"] == 6 * 8
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0 and result["output_throughput"] > 0
