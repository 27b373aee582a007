"""Engine backends behind one protocol (:mod:`serve_app.engines.base`) and one factory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from serve_app.engines.base import Engine

if TYPE_CHECKING:
    from serve_app.engines.config import EngineConfig


def make_engine(engine_config: EngineConfig) -> Engine:
    """Build (not start) the engine the config selects. Backends are imported on use: the
    sglang package is only importable on a GPU machine."""
    if engine_config.backend == "embedded":
        from serve_app.engines.embedded import EmbeddedEngine

        return EmbeddedEngine(engine_config.embedded)
    if engine_config.backend == "sglang":
        from serve_app.engines.sglang import SGLangEngine

        return SGLangEngine(engine_config.sglang)
    raise ValueError(f"unknown engine backend {engine_config.backend!r}")


CPU_KERNELS = ("avx512-vnni", "avx2", "c")
"""The paths of the embedded engine's CPU kernels, as ``cpu_kernel()`` names them (qmm.c's ``qmm_path``)."""


def cpu_kernel() -> str:
    """Which of the embedded engine's CPU kernels this host runs: avx512-vnni, avx2 or c
    (``qmm.kernel_path``; compiles the kernels on first use)."""
    from serve_app.engines.embedded.qmm import kernel_path

    return kernel_path()


def cpu_id(cpuinfo: str | None = None) -> str | None:
    """This host's CPU as ``<vendor>-<family>-<model>`` from /proc/cpuinfo (or the text given),
    e.g. "amd-23-49" for an AMD EPYC of family 23 model 49, "intel-6-143" for an Intel Xeon;
    None where there is none. Hosts that run one kernel still differ in where speculation stops
    paying, so a policy file may be keyed by ``<kernel>@<cpu id>`` (serving.config)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:  # the first processor's block ends at its blank line
                break
            continue
        fields.setdefault(key.strip(), value.strip())
    vendor, family, model = fields.get("vendor_id"), fields.get("cpu family"), fields.get("model")
    if not (vendor and family and model):
        return None
    vendor = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(vendor, vendor.lower())
    return f"{vendor}-{family}-{model}"
