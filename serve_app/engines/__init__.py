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
