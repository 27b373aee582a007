"""`python -m serve_app.tools.bench engine` end to end on the tiny-random model, plus its pure parts."""

import json

import pytest

from serve_app.tools.bench.__main__ import main
from serve_app.tools.bench.prompts import PROMPT_SETS, chat_messages
from serve_app.tools.bench.stats import RequestTiming, acceptance, crossover, percentile

ROW_FIELDS = {"prompt_set", "num_steps", "concurrency", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
              "tpot_p50_ms", "tpot_p99_ms", "accept_rate", "mean_accepted_len"}
TINY = ["engine", "--model", "tiny-random", "--concurrency", "1,2", "--num-steps", "0,3", "--max-tokens", "8",
        "--requests-per-point", "2", "--warmup", "1"]


def run_bench(tmp_path, *extra: str) -> dict:
    out = tmp_path / "bench.json"
    assert main([*TINY, *extra, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_engine_bench_writes_one_row_per_prompt_set_num_steps_and_concurrency(tmp_path, capsys):
    result = run_bench(tmp_path, "--no-hf")

    keys = [(r["prompt_set"], r["num_steps"], r["concurrency"]) for r in result["rows"]]
    assert sorted(keys) == sorted((s, k, c) for s in ("copy", "chat") for k in (0, 3) for c in (1, 2))
    for row in result["rows"]:
        assert ROW_FIELDS <= row.keys()
        assert row["output_tokens"] == 2 * 8  # the tiny model never ends its turn early
        assert row["output_tokens_per_s"] > 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert 0 < row["tpot_p50_ms"] <= row["tpot_p99_ms"]
        if row["num_steps"] == 0:  # nothing drafted: acceptance is not applicable, not 0
            assert row["accept_rate"] is None and row["mean_accepted_len"] is None
        elif row["accept_rate"] is not None:  # None too when the lookup found nothing to draft
            assert 0 <= row["accept_rate"] <= 1 and 0 <= row["mean_accepted_len"] <= 3
    assert result["hf_baseline"] is None
    assert set(result["crossover"]) == {"copy", "chat"}
    meta = result["meta"]
    assert meta["model"] == "tiny-random" and meta["max_tokens"] == 8 and meta["threads"] >= 1
    assert meta["command"].startswith("python -m serve_app.tools.bench")
    printed = capsys.readouterr().out
    assert "[copy]" in printed and "[chat]" in printed and "crossover" in printed


def test_engine_bench_measures_each_weight_format_at_every_point(tmp_path):
    result = run_bench(tmp_path, "--no-hf", "--prompt-set", "chat", "--weights", "float32,q4_1")

    keys = [(r["weights"], r["num_steps"], r["concurrency"]) for r in result["rows"]]
    assert sorted(keys) == sorted((w, k, c) for w in ("float32", "q4_1") for k in (0, 3) for c in (1, 2))
    assert result["meta"]["weights"] == ["float32", "q4_1"] and set(result["crossover"]) == {"chat"}


def test_engine_bench_pairs_the_engine_with_transformers_on_the_same_weights(tmp_path):
    result = run_bench(tmp_path, "--prompt-set", "chat", "--concurrency", "1", "--hf-prompts", "2")

    hf = result["hf_baseline"]
    assert hf["plain_batch1"]["hf_tokens_per_s"] > 0 and hf["plain_batch1"]["engine_tokens_per_s"] > 0
    assert hf["pld_batch1"]["hf_pld_tokens_per_s"] > 0 and hf["pld_batch1"]["engine_spec_tokens_per_s"] > 0
    assert hf["pld_batch1"]["prompt_set"] == "copy" and hf["pld_batch1"]["num_steps"] == 5
    assert hf["batch16"]["hf_batch16_tokens_per_s"] > 0 and hf["batch16"]["engine_c16_tokens_per_s"] > 0
    assert hf["batch16"]["num_prompts"] == 16


def test_transformers_greedy_output_matches_the_engine_on_tiny_random():
    """The HF pair is only honest if transformers runs the very model the engine runs."""
    import torch

    from serve_app.engines.embedded import EmbeddedOptions
    from serve_app.engines.embedded.engine import build_core
    from serve_app.tools.bench.engine import load_hf_model

    core = build_core(EmbeddedOptions(model="tiny-random"))
    ids = core.tokenizer("The quick brown fox", add_special_tokens=False).input_ids
    hf = load_hf_model("tiny-random")
    with torch.inference_mode():
        hf_logits = hf(torch.tensor([ids])).logits[0]
        engine_logits, _ = core.model.forward(torch.tensor([ids]), torch.tensor([0]), core.cache)
    torch.testing.assert_close(engine_logits[0], hf_logits, rtol=1e-4, atol=1e-4)


def test_prompt_sets_have_at_least_24_prompts_each():
    assert set(PROMPT_SETS) == {"copy", "chat"}
    assert all(len(prompts) >= 24 and len(set(prompts)) == len(prompts) for prompts in PROMPT_SETS.values())
    assert chat_messages("hi")[-1] == {"role": "user", "content": "hi"}


def test_percentile_interpolates_and_is_none_when_empty():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([], 99) is None


def test_tpot_excludes_the_first_token():
    assert RequestTiming(output_tokens=5, ttft_s=1.0, last_token_s=3.0).tpot_s == 0.5
    assert RequestTiming(output_tokens=1, ttft_s=1.0, last_token_s=1.0).tpot_s is None


def test_acceptance_is_the_delta_between_counter_snapshots():
    before = {"proposed": 10, "accepted": 5, "verifies": 4}
    after = {"proposed": 30, "accepted": 15, "verifies": 8}
    assert acceptance(before, after) == {"accept_rate": 0.5, "mean_accepted_len": 2.5}
    assert acceptance(before, before) == {"accept_rate": None, "mean_accepted_len": None}


def test_crossover_is_the_lowest_concurrency_where_speculation_no_longer_wins():
    def row(k, c, tps):
        return {"prompt_set": "copy", "num_steps": k, "concurrency": c, "output_tokens_per_s": tps}

    rows = [row(0, 1, 10), row(0, 4, 30), row(0, 16, 60),
            row(3, 1, 15), row(3, 4, 29), row(3, 16, 50),
            row(5, 1, 18), row(5, 4, 33), row(5, 16, 55)]
    assert crossover(rows) == {"copy": {"by_num_steps": {"3": 4, "5": 16}, "best": 16}}
    assert crossover([row(0, 1, 10), row(5, 1, 20)])["copy"]["best"] is None


@pytest.mark.parametrize("bad", [["--prompt-set", "poems"], ["--concurrency", "1,x"]])
def test_bad_arguments_are_rejected_before_anything_loads(bad):
    with pytest.raises(SystemExit):
        main(["engine", *bad])
