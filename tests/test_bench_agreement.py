"""``bench agreement`` compares each format's greedy outputs with float32's, prompt by prompt."""

import json

import pytest

from serve_app.tools.bench.__main__ import main
from serve_app.tools.bench.agreement import compare


def test_bench_agreement_reports_each_format_against_float32(tmp_path, capsys):
    out = tmp_path / "agreement.json"
    assert main(["agreement", "--model", "tiny-random", "--weights", "float32,q4_1,gguf", "--batch", "2",
                 "--max-tokens", "8", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [json.loads(line) for line in printed] == [r]
    assert r["num_prompts"] == 2 and r["batch"] == 2 and r["max_tokens"] == 8
    assert list(r["formats"]) == ["float32", "q4_1", "gguf"]
    assert len(r["reference"]["lengths"]) == 2 and all(1 <= n <= 8 for n in r["reference"]["lengths"])
    for f in r["formats"].values():
        assert 0 <= f["identical"] <= f["num_prompts"] == 2
        assert 0 <= f["share_matched"] <= 1 and len(f["common_prefix"]) == 2
        assert f["mean_common_prefix"] == sum(f["common_prefix"]) / 2
        assert f["decode_s"] > 0
    # A second float32 engine gives the same tokens.
    same = r["formats"]["float32"]
    assert same["identical"] == 2 and same["share_matched"] == 1.0
    assert same["common_prefix"] == r["reference"]["lengths"] == same["lengths"]


def test_compare_counts_positions_prefixes_and_identical_outputs():
    c = compare([[1, 2, 3, 4], [5, 6], [7]], [[1, 9, 3], [5, 6], [8, 7]])
    assert c["identical"] == 1 and c["tokens_matched"] == 2 + 2 + 0
    assert c["share_matched"] == round(4 / 7, 4) and c["common_prefix"] == [1, 2, 0]
    assert c["mean_common_prefix"] == 1.0


def test_bench_agreement_refuses_an_unknown_format():
    with pytest.raises(SystemExit, match="--weights takes"):
        main(["agreement", "--model", "tiny-random", "--weights", "q4_1,fp8"])
