"""``bench ops`` times decode steps unprofiled and sums the profiler's self time per op and group."""

import json

from serve_app.tools.bench.__main__ import main


def test_bench_ops_profiles_the_decode_steps_of_a_batch(tmp_path, capsys):
    out = tmp_path / "ops.json"
    assert main(["ops", "--model", "tiny-random", "--weights", "q4_1", "--batch", "2", "--num-steps", "2",
                 "--drafter", "ngram", "--tokens", "12", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [json.loads(line) for line in printed] == [r]
    # The same greedy pass twice; tokens that come with the prefills are not counted.
    assert r["unprofiled"]["output_tokens"] == r["profiled"]["output_tokens"]
    assert 2 * 8 <= r["unprofiled"]["output_tokens"] <= 2 * 11
    assert r["unprofiled"]["steps"] >= 1 and r["unprofiled"]["tok_per_s"] > 0
    assert r["groups_ms_per_step"]["int4 products (q4_1 layers)"] > 0
    assert abs(sum(r["groups_share"].values()) - 1) < 0.01 and len(r["ops"]) == 15


def test_bench_ops_refuses_a_batch_of_none(capsys):
    try:
        main(["ops", "--model", "tiny-random", "--batch", "0"])
    except SystemExit as e:
        assert "--batch must be >= 1" in str(e)
    else:
        raise AssertionError("a batch of 0 was accepted")
