"""configs/prod.yaml end to end: Ray's schema, AppArgs, our SGLang arguments against every
supported release's wheel; and the KubeRay RayService carries the same serve config."""

from pathlib import Path

import pytest
import yaml

from serve_app.engines.sglang.config import SGLangOptions, build_server_args
from serve_app.tools.sglang_pins import check_server_args, server_arg_types

ROOT = Path(__file__).resolve().parents[1]
PROD = ROOT / "configs" / "prod.yaml"
RAYSERVICE = ROOT / "infra" / "kuberay" / "rayservice.yaml"


@pytest.fixture(scope="module")
def prod():
    return yaml.safe_load(PROD.read_text())


def test_prod_yaml_is_a_valid_serve_config_with_valid_app_args(prod):
    from ray.serve.schema import ServeDeploySchema

    from serve_app.serving.config import AppArgs

    ServeDeploySchema.model_validate(prod)
    args = AppArgs.model_validate(prod["applications"][0]["args"])
    assert args.engine.backend == "sglang" and isinstance(args.engine.sglang, SGLangOptions)


def test_prod_sglang_arguments_exist_in_every_supported_sglang_with_our_types(prod, sglang_src, tmp_path):
    opts = SGLangOptions.model_validate(
        {**prod["applications"][0]["args"]["engine"]["sglang"], "adaptive_config_dir": str(tmp_path)}
    )
    assert check_server_args(build_server_args(opts), server_arg_types(sglang_src)) == []


def test_the_replica_holds_as_many_gpus_as_the_tensor_parallel_width(prod):
    app = prod["applications"][0]
    tp = SGLangOptions.model_validate(app["args"]["engine"]["sglang"]).tp_size
    replica = next(d for d in app["deployments"] if d["name"] == "LLMReplica")
    bundles = replica.get("placement_group_bundles")
    gpus = bundles[0].get("GPU", 0) if bundles else replica["ray_actor_options"].get("num_gpus", 0)
    assert gpus == tp
    if bundles:
        assert replica.get("placement_group_strategy") == "STRICT_PACK"


def test_the_rayservice_serves_exactly_prod_yaml(prod):
    service = yaml.safe_load(RAYSERVICE.read_text())
    assert service["kind"] == "RayService"
    assert yaml.safe_load(service["spec"]["serveConfigV2"]) == prod


def test_the_gpu_config_is_valid_and_its_arguments_exist_in_the_sglang_the_gpu_bundle_carries(tmp_path):
    from ray.serve.schema import ServeDeploySchema

    from serve_app.serving.config import AppArgs
    from serve_app.tools.sglang_pins import source_tree

    raw = yaml.safe_load((ROOT / "configs" / "gpu-h200.yaml").read_text())
    ServeDeploySchema.model_validate(raw)
    args = AppArgs.model_validate(raw["applications"][0]["args"])
    src = source_tree("0.5.17")  # infra/gpu/bundle-sglang-0.5.17.txt
    if src is None:
        pytest.skip("sglang 0.5.17 wheel not found: run .ci/fetch_sglang_wheel.sh")
    opts = args.engine.sglang.model_copy(update={"adaptive_config_dir": str(tmp_path)})
    assert check_server_args(build_server_args(opts), server_arg_types(src)) == []
    assert opts.tp_size == 1 and raw["applications"][0]["args"]["replica_ray_actor_options"]["num_gpus"] == 1
