"""SGLang backend: an in-process ``sglang.Engine`` with a run-time num_steps switch.

Importable without sglang (it is imported when an engine starts, on GPU machines only). The
names below load on first use, so that the package's stdlib-only modules (``export``,
``compat``) run on a GPU node that has torch but not the serving layer's dependencies.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve_app.engines.sglang.config import SGLangOptions, build_server_args
    from serve_app.engines.sglang.engine import SGLangEngine

__all__ = ["SGLangEngine", "SGLangOptions", "build_server_args"]
_HOME = {"SGLangEngine": "engine", "SGLangOptions": "config", "build_server_args": "config"}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
