"""SGLangOptions: what the YAML may say, and the sglang.Engine arguments built from it."""

import json

import pytest
from pydantic import ValidationError

from serve_app.engines.sglang.config import SGLangOptions, adaptive_config, build_server_args, local_context_length


def options(tmp_path, **kw):
    return SGLangOptions(model_path="target", draft_model_path="draft", adaptive_config_dir=str(tmp_path), **kw)


def test_defaults_are_tp8_eagle3_topk1_adaptive_with_the_policy_tiers(tmp_path):
    args = build_server_args(options(tmp_path))
    assert {
        k: args[k] for k in ("tp_size", "speculative_algorithm", "speculative_eagle_topk", "speculative_adaptive")
    } == {
        "tp_size": 8,
        "speculative_algorithm": "EAGLE3",
        "speculative_eagle_topk": 1,
        "speculative_adaptive": True,
    }
    assert (args["speculative_num_steps"], args["speculative_num_draft_tokens"]) == (5, 6)  # chain: steps + 1
    assert args["enable_metrics"] and args["incremental_streaming_output"] and args["nccl_port"] == 29600
    assert json.loads(open(args["speculative_adaptive_config"]).read()) == {"1": {"candidate_steps": [0, 3, 5]}}


def test_the_adaptive_config_file_is_content_addressed_and_shared(tmp_path):
    a, b = build_server_args(options(tmp_path)), build_server_args(options(tmp_path))
    c = build_server_args(options(tmp_path, candidate_steps=[0, 2]))
    assert a["speculative_adaptive_config"] == b["speculative_adaptive_config"] != c["speculative_adaptive_config"]
    assert adaptive_config(options(tmp_path, candidate_steps=[4, 0, 1])) == {"1": {"candidate_steps": [0, 1, 4]}}


def test_unset_optional_arguments_are_left_to_sglang_and_extras_pass_through(tmp_path):
    args = build_server_args(options(tmp_path, nccl_port=None, extra_server_args={"log_level": "info"}))
    assert "nccl_port" not in args and "mem_fraction_static" not in args and args["log_level"] == "info"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"candidate_steps": [3, 5]}, "must include 0"),
        ({"candidate_steps": [0]}, "at least one positive"),
        ({"candidate_steps": [0, 3, 3]}, "distinct"),
        ({"initial_steps": 4}, "not one of candidate_steps"),
        ({"speculative_eagle_topk": 4}, "speculative_eagle_topk"),
        ({"extra_server_args": {"enable_two_batch_overlap": True}}, "two-batch overlap turns adaptive"),
        ({"extra_server_args": {"attn_dp_size": 2}}, "attention DP"),
        ({"extra_server_args": {"enable_pdmux": True}}, "pdmux"),
        ({"extra_server_args": {"tp_size": 4}}, "set by specserve"),
        ({"unknown_option": 1}, "Extra inputs are not permitted"),
    ],
)
def test_options_that_would_break_the_switch_are_refused_with_the_reason(tmp_path, kw, message):
    with pytest.raises(ValidationError, match=message):
        options(tmp_path, **kw)


def test_harmless_values_of_refused_keys_are_allowed(tmp_path):
    options(tmp_path, extra_server_args={"attn_dp_size": 1, "enable_pdmux": False, "dp_size": 1})


def write_config(folder, **config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_a_draft_with_a_shorter_context_than_the_target_is_refused_with_what_to_do(tmp_path):
    target = write_config(tmp_path / "target", max_position_embeddings=8192)
    draft = write_config(tmp_path / "draft", max_position_embeddings=2048)
    with pytest.raises(ValueError, match="context_length: 2048.*draft_context_overwrite: true"):
        SGLangOptions(model_path=target, draft_model_path=draft, adaptive_config_dir=str(tmp_path))
    # Either way out of it is accepted.
    SGLangOptions(model_path=target, draft_model_path=draft, context_length=2048, adaptive_config_dir=str(tmp_path))
    SGLangOptions(
        model_path=target, draft_model_path=draft, draft_context_overwrite=True, adaptive_config_dir=str(tmp_path)
    )
    with pytest.raises(ValueError, match="context of 2048 tokens and the target runs 4096"):
        SGLangOptions(model_path="org/hub-model", draft_model_path=draft, context_length=4096)


def test_context_lengths_are_derived_as_sglang_derives_them(tmp_path):
    assert local_context_length(write_config(tmp_path / "a", max_position_embeddings=2048, seq_length=4096)) == 4096
    scaled = write_config(tmp_path / "b", max_position_embeddings=4096, rope_scaling={"type": "linear", "factor": 2.0})
    assert local_context_length(scaled) == 8192
    llama3 = {"rope_type": "llama3", "factor": 8.0}
    assert (
        local_context_length(write_config(tmp_path / "c", max_position_embeddings=131072, rope_scaling=llama3))
        == 131072
    )
    assert local_context_length("meta-llama/Llama-3.3-70B-Instruct") is None  # a hub id: SGLang checks it at start
