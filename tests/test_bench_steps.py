"""``bench steps`` on the tiny model: every side runs the same mixed requests, and the adaptive
row says how it compares with the best fixed one."""

from __future__ import annotations

import json

from serve_app.tools.bench.__main__ import main
from serve_app.tools.bench.steps import mixed


def test_the_mixed_workload_alternates_chat_and_copy_and_samples_every_third():
    rendered = {"chat": ["c0", "c1"], "copy": ["p0", "p1"]}
    reqs = [mixed(i, rendered, 8) for i in range(6)]
    assert [p for p, _ in reqs] == ["c0", "p0", "c1", "p1", "c0", "p0"]
    assert [s.temperature for _, s in reqs] == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert reqs[2][1].seed == 2 and reqs[0][1].seed is None


def test_bench_steps_runs_every_side_and_compares_adaptive_with_the_best_fixed(tmp_path, capsys):
    out = tmp_path / "steps.json"
    assert main(["steps", "--model", "tiny-random", "--drafter", "ngram", "--concurrency", "1,3",
                 "--num-steps", "0,2", "--requests", "3", "--max-tokens", "8", "--rounds", "2",
                 "--one-length", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    adaptive = ("adaptive", "adaptive one")
    assert [(r["concurrency"], r["side"]) for r in result["rows"]] == [
        (c, s) for c in (1, 3) for s in ("fixed 0", "fixed 2", *adaptive)]
    for r in result["rows"]:
        assert r["num_requests"] == max(3, 2 * r["concurrency"]) and r["output_tokens"] > 0
        ran = {tuple(map(int, key.split(","))): n for key, (n, ms) in r["step_ms"].items() if ms > 0}
        assert all(1 <= b <= r["concurrency"] for b, _ in ran) and sum(ran.values()) > 0
        if r["side"].startswith("fixed"):  # every decode step of a fixed side is chosen at its k
            assert {k for _, k in ran} <= set(range(int(r["side"].split()[1]) + 1))
    assert {k for key in next(r for r in result["rows"] if r["side"] == "fixed 0")["step_ms"]
            for k in [int(key.split(",")[1])]} == {0}
    for r in (r for r in result["rows"] if r["side"] in adaptive):
        point = {x["side"]: x for x in result["rows"] if x["concurrency"] == r["concurrency"]}
        best = max((x for side, x in point.items() if side not in adaptive), key=lambda x: x["output_tokens_per_s"])
        assert r["best_fixed"] == best["side"]
        assert r["vs_best_fixed"] == round(r["output_tokens_per_s"] / best["output_tokens_per_s"], 3)
        assert sum(r["step_reasons"].values()) > 0
        if r["side"] == "adaptive":
            one = point["adaptive one"]["output_tokens_per_s"]
            assert r["vs_one_length"] == round(r["output_tokens_per_s"] / one, 3)
    assert result["meta"]["chooser_one_length"]["per_sequence_steps"] == 0
    assert result["meta"]["chooser"]["choose_ms"] > 0  # the chooser's own time a step
    assert result["meta"]["ceiling"] == 2 and "vs one length" in capsys.readouterr().out
