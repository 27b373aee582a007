"""SGLang backend: an in-process ``sglang.Engine`` with a run-time num_steps switch.

Importable without sglang (it is imported when an engine starts, on GPU machines only).
"""

from serve_app.engines.sglang.config import SGLangOptions, build_server_args
from serve_app.engines.sglang.engine import SGLangEngine

__all__ = ["SGLangEngine", "SGLangOptions", "build_server_args"]
