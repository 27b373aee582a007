"""The shipped configs validate against Ray's ServeDeploySchema and our AppArgs."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray._common.utils import import_attr
from ray.serve import Application
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
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
    # What `serve run` does with the import path and the args (Serve wants a builder of one parameter).
    built = call_user_app_builder_with_args_if_necessary(import_attr(app.import_path), app.args)
    assert isinstance(built, Application)


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


def test_ray_env_puts_haproxy_in_front_and_own_ports_frees_its_fixed_ones(monkeypatch):
    """ray[serve] installs HAProxy on Linux, so RAY_ENV turns it on; a process that starts a Ray
    of its own beside another (tests, benchmarks) gets free ports for HAProxy's stats and
    metrics and the fallback proxy, and a window of its own for the ingress replicas' ports."""
    import os
    import sys

    from serve_app.serving.config import (
        DIRECT_INGRESS_PORT_WINDOWS,
        HAPROXY_PORTS,
        RAY_ENV,
        ephemeral_port_range,
        set_ray_env,
    )

    if sys.platform == "linux":
        assert RAY_ENV["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    windows = [k for low, high, _ in DIRECT_INGRESS_PORT_WINDOWS for k in (low, high)]
    for key in (*RAY_ENV, *HAPROXY_PORTS, *windows):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_SERVE_PROXY_USE_GRPC", "0")  # set by hand: kept
    set_ray_env()
    assert os.environ["RAY_SERVE_PROXY_USE_GRPC"] == "0"
    assert all(os.environ[k] == v for k, v in RAY_ENV.items() if k != "RAY_SERVE_PROXY_USE_GRPC")
    assert not any(k in os.environ for k in (*HAPROXY_PORTS, *windows))  # a plain run keeps Serve's ports
    if RAY_ENV.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        for _ in range(3):  # a child process of a process that set them picks again
            set_ray_env(own_ports=True)
            ports = [int(os.environ[k]) for k in HAPROXY_PORTS]
            assert len(set(ports)) == len(ports) and not {8404, 9101, 8500, 9500} & set(ports)
            if ephemeral_port_range()[1] < 65036:  # above the range: no outgoing connection takes one
                assert all(ephemeral_port_range()[1] < p <= 65535 for p in ports), ports
            low, high = (int(os.environ[k]) for k in windows[:2])
            assert 20000 <= low < high == low + 99 < 25000


def test_free_ports_outside_ephemeral_pass_over_ports_in_use(monkeypatch):
    """Above the range, in order (shuffle off): a port something holds is passed over; with
    fewer than 500 ports above the range, the kernel picks."""
    import socket

    from serve_app.serving import config

    monkeypatch.setattr(config.random, "shuffle", lambda xs: None)
    monkeypatch.setattr(config, "ephemeral_port_range", lambda: (32768, 65000))
    first = config.free_ports_outside_ephemeral(1)[0]
    assert 65000 < first <= 65535
    with socket.socket() as held:
        held.bind(("", first))
        ports = config.free_ports_outside_ephemeral(3)
    assert len(set(ports)) == 3 and first not in ports and all(first < p <= 65535 for p in ports)
    monkeypatch.setattr(config, "ephemeral_port_range", lambda: (32768, 65529))
    assert len(set(config.free_ports_outside_ephemeral(3))) == 3
