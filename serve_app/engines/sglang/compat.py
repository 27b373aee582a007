"""The SGLang releases this backend supports, and how their adaptive APIs differ.

Every release from 0.5.17 to 0.5.23 has the adaptive runtime the plugin drives: a steps=0
tier, the per-batch switch (``AdaptiveController.activate_step_by_batch``),
``Engine.collective_rpc``, ``Scheduler.handle_rpc_request`` and ``load_plugins()`` in the
scheduler. Two things moved inside that range (read from each release's wheel; the drift
guard, tests/test_sglang_pinned.py, checks every release in :data:`RELEASES` in CI):

- how ``AdaptiveController`` gets its step policy: up to 0.5.19 ``__init__(worker,
  config_path=None)`` builds ``self.params`` itself; from 0.5.20 ``__init__(worker, policy)``
  takes it;
- how SGLang records that it turned ``--speculative-adaptive`` off: up to 0.5.18 it sets the
  field ``server_args.speculative_adaptive = False``; from 0.5.19 it declares a resolution and
  only ``server_args.resolved_dict()`` tells (the raw field keeps the input).

Stdlib only: imported by the plugin inside SGLang's processes and by CI without sglang.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version


class UnsupportedSGLangError(RuntimeError):
    """The installed sglang is outside the supported range (or not installed)."""


@dataclass(frozen=True, slots=True)
class Release:
    """What the plugin and the engine need to know of one SGLang release."""

    version: str
    controller_takes_policy: bool
    """``AdaptiveController(worker, policy)``; else ``(worker, config_path)`` builds its own."""
    resolves_server_args: bool
    """Adaptive-off is a resolution read through ``resolved_dict()``; else the plain field."""


RELEASES: dict[str, Release] = {
    f"0.5.{n}": Release(f"0.5.{n}", controller_takes_policy=n >= 20, resolves_server_args=n >= 19)
    for n in range(17, 24)
}
OLDEST, NEWEST = "0.5.17", "0.5.23"


def parse(text: str) -> tuple[int, ...]:
    """``"0.5.23"`` -> ``(0, 5, 23)``; a local or post suffix (``0.5.17+cu130``, ``.post1``) is ignored."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def release(text: str) -> Release:
    """The :class:`Release` of a version string, or UnsupportedSGLangError naming the range."""
    key = ".".join(map(str, parse(text)[:3]))
    if key not in RELEASES:
        raise UnsupportedSGLangError(
            f"sglang {text} is not supported: specserve's SGLang backend supports sglang {OLDEST} "
            f"through {NEWEST} (install one of requirements/sglang-*.txt)"
        )
    return RELEASES[key]


def installed() -> Release:
    """The :class:`Release` of the sglang installed in this environment."""
    try:
        text = version("sglang")
    except PackageNotFoundError as e:
        raise UnsupportedSGLangError(
            f"sglang is not installed; the SGLang backend needs sglang {OLDEST} through {NEWEST}"
        ) from e
    return release(text)
