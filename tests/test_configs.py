"""The shipped configs validate against Ray's ServeDeploySchema and our AppArgs."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from serve_app.serving.config import AppArgs

CONFIGS = Path(__file__).parent.parent / "configs"


@pytest.mark.parametrize("name", ["local.yaml", "prod.yaml", "gpu-h200.yaml", "tiny-random.yaml"])
def test_config_validates(name):
    raw = yaml.safe_load((CONFIGS / name).read_text())
    schema = (
        ServeDeploySchema.model_validate(raw)
        if hasattr(ServeDeploySchema, "model_validate")
        else ServeDeploySchema.parse_obj(raw)
    )
    (app,) = schema.applications
    assert app.import_path == "serve_app.serving.app:build_app"
    args = AppArgs.model_validate(app.args)
    assert args.policy.tiers[-1].num_steps == 0


def test_local_config_binds_localhost_with_two_embedded_replicas():
    raw = yaml.safe_load((CONFIGS / "local.yaml").read_text())
    assert raw["http_options"]["host"] == "127.0.0.1"
    args = AppArgs.model_validate(raw["applications"][0]["args"])
    assert (args.engine.backend, args.num_replicas) == ("embedded", 2)
    assert args.engine.embedded.model == "smollm2-135m-instruct" and args.engine.embedded.drafter == "eagle"
    assert args.engine.embedded.weights == "gguf"


def test_prod_config_reserves_eight_gpus_per_replica():
    raw = yaml.safe_load((CONFIGS / "prod.yaml").read_text())
    (replica,) = [d for d in raw["applications"][0]["deployments"] if d["name"] == "LLMReplica"]
    assert replica["placement_group_bundles"] == [{"CPU": 1, "GPU": 8}]
    assert replica["placement_group_strategy"] == "STRICT_PACK"
    args = AppArgs.model_validate(raw["applications"][0]["args"])
    assert args.engine.backend == "sglang" and args.engine.sglang.tp_size == 8


@pytest.mark.parametrize(
    "args, field",
    [
        ({"engine": {"embedded": {"max_num_seqs": "lots"}}}, "engine.embedded.max_num_seqs"),
        ({"engine": {"backend": "vllm"}}, "engine.backend"),
        ({"engine": {"backend": "sglang"}}, "sglang"),
        ({"policy": {"margin": -1}}, "policy.margin"),
        ({"policy": {"tiers": [{"below": 4, "num_steps": 12}, {"num_steps": 0}]}}, "max_num_steps"),
        ({"num_replicas": 0}, "num_replicas"),
        ({"replicas": 2}, "replicas"),
        ({"replica_transport": "zmq"}, "replica_transport"),
    ],
)
def test_a_bad_config_fails_naming_the_field(args, field):
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        AppArgs.model_validate(args)


def test_build_app_validates_its_args():
    from serve_app.serving.app import build_app

    with pytest.raises(ValidationError, match="policy.dwell_s"):
        build_app({"policy": {"dwell_s": "soon"}})
