"""Typed configuration of a specserve application: what `serve run` passes as ``args``.

Everything here is a pydantic model validated at the edge, so a bad YAML fails at
``serve run`` with a message that names the field. The policy models have no heavy imports:
the simulator and the pure policy import this module without pulling in an engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    """Unknown fields are errors, and values keep their type (``true`` is not a number, ``"2"``
    is not an integer): a typo in a config or in ``PUT /v1/speculation`` is a 4xx, not a silent
    coercion."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Tier(_Strict):
    """One rung of the ladder: loads per replica below ``below`` run ``num_steps`` draft steps."""

    below: float | None = Field(
        default=None, gt=0, description="Upper bound (exclusive) of load per replica; null on the last tier."
    )
    num_steps: int = Field(ge=0, le=64, description="Draft tokens per decode step in this tier; 0 = off.")


def _default_tiers() -> list[Tier]:
    return [Tier(below=4, num_steps=5), Tier(below=12, num_steps=3), Tier(num_steps=0)]


class PolicyConfig(_Strict):
    """The load → num_steps ladder and what keeps it from flapping.

    Load is the cluster queue (waiting + running over live replicas) divided by the number of
    live replicas. The load is averaged over ``smoothing_s``; a tier is left only when the
    averaged load is past the tier's boundary by ``margin`` for ``dwell_s`` without a break,
    and never sooner than ``min_switch_interval_s`` after the previous switch.
    """

    tiers: list[Tier] = Field(default_factory=_default_tiers, min_length=1)
    margin: float = Field(default=1.0, ge=0, description="Hysteresis, in load-per-replica units.")
    dwell_s: float = Field(default=2.0, ge=0)
    min_switch_interval_s: float = Field(default=5.0, ge=0)
    smoothing_s: float = Field(default=1.0, ge=0)

    @model_validator(mode="after")
    def _check_ladder(self) -> PolicyConfig:
        *inner, last = self.tiers
        if last.below is not None:
            raise ValueError("tiers: the last tier must have no 'below' bound (it takes all higher loads)")
        for i, tier in enumerate(inner):
            if tier.below is None:
                raise ValueError(f"tiers[{i}]: only the last tier may omit 'below'")
            if i > 0 and tier.below <= inner[i - 1].below:
                raise ValueError(f"tiers[{i}].below must be greater than tiers[{i - 1}].below")
        steps = [t.num_steps for t in self.tiers]
        if len(set(steps)) != len(steps):
            raise ValueError(f"tiers: each tier needs its own num_steps, got {steps}")
        return self

    @property
    def bounds(self) -> list[float]:
        """The tier boundaries, ascending (one fewer than tiers)."""
        return [t.below for t in self.tiers[:-1]]  # type: ignore[misc]

    @property
    def history_s(self) -> float:
        """How much load history ``decide`` looks at (callers may drop older samples)."""
        return self.dwell_s + self.smoothing_s + 1.0

    def tier_of(self, num_steps: int) -> int | None:
        """The index of the tier that runs ``num_steps`` (the lowest-load one), or None."""
        for i, tier in enumerate(self.tiers):
            if tier.num_steps == num_steps:
                return i
        return None


class GrafanaAnnotations(_Strict):
    """Optional HTTP annotations on each switch (the dashboards' Prometheus annotation query
    needs none): posted asynchronously from a bounded queue, failures counted and logged."""

    url: str = Field(min_length=1, description="Grafana base URL, e.g. http://grafana:3000")
    token_env: str = Field(default="GRAFANA_TOKEN", min_length=1, description="Env var with a service account token.")
    dashboard_uids: list[str] = Field(default_factory=lambda: ["specserve-overview"], min_length=1)
    queue_size: int = Field(default=64, ge=1, description="Switches waiting to be posted; more are dropped.")
    timeout_s: float = Field(default=2.0, gt=0)


class ControllerOptions(_Strict):
    """How the controller and the replicas talk."""

    report_interval_s: float = Field(default=0.25, gt=0, le=10)
    decision_interval_s: float = Field(
        default=0.25, gt=0, le=1, description="How often the controller samples the cluster queue and decides."
    )
    stale_after_s: float = Field(
        default=1.0, gt=0, description="Reports older than this drop out of the cluster queue."
    )
    long_poll_timeout_s: float = Field(default=10.0, gt=0)
    max_events: int = Field(default=200, ge=1)
    grafana: GrafanaAnnotations | None = None

    @model_validator(mode="after")
    def _stale_after_reports(self) -> ControllerOptions:
        if self.stale_after_s < 2 * self.report_interval_s:
            raise ValueError("stale_after_s must be at least 2 × report_interval_s")
        return self


class Limits(_Strict):
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


class StreamOptions(_Strict):
    """How a replica paces its streams (the ``streaming`` section of the app's args)."""

    chunks_per_s: float = Field(
        default=200.0,
        ge=0,
        description="Chunks a replica sends per second over all its streams; 0: one chunk per engine delta.",
    )
    max_interval_s: float = Field(default=0.25, ge=0, le=5, description="Longest wait between two chunks of one stream.")


def _options_class(backend: str) -> type[BaseModel]:
    # Imported on use: the sglang options module is importable without sglang itself, and
    # neither engine package is needed to validate or run the policy.
    if backend == "embedded":
        from serve_app.engines.embedded.config import EmbeddedOptions

        return EmbeddedOptions
    from serve_app.engines.sglang.config import SGLangOptions

    return SGLangOptions


class EngineConfig(_Strict):
    """Which engine backend the replicas run, with that backend's own options."""

    backend: Literal["embedded", "sglang"] = "embedded"
    embedded: Any = Field(default=None, description="EmbeddedOptions when backend is 'embedded'.")
    sglang: Any = Field(default=None, description="SGLangOptions when backend is 'sglang'.")

    @field_validator("embedded", "sglang", mode="before")
    @classmethod
    def _parse_options(cls, value: Any, info) -> Any:
        if value is None:
            return None
        options_cls = _options_class(info.field_name)
        return value if isinstance(value, options_cls) else options_cls.model_validate(value)

    @model_validator(mode="after")
    def _one_backend(self) -> EngineConfig:
        if self.backend == "embedded" and self.embedded is None:
            self.embedded = _options_class("embedded")()
        if self.backend == "sglang" and self.sglang is None:
            raise ValueError("sglang: options are required when backend is 'sglang'")
        other = "sglang" if self.backend == "embedded" else "embedded"
        if getattr(self, other) is not None:
            raise ValueError(f"{other}: options given but backend is {self.backend!r}")
        return self

    @property
    def options(self) -> BaseModel:
        """The selected backend's options."""
        return getattr(self, self.backend)


class AppArgs(_Strict):
    """The ``args`` of ``serve_app.app:build_app``."""

    engine: EngineConfig = Field(default_factory=EngineConfig)
    num_replicas: int = Field(default=1, ge=1, description="Ignored when autoscaling_config is set.")
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int = Field(
        default=512, ge=1, description="Per replica; keep above the engine's queue so the engine, not Serve, queues."
    )
    replica_ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1})
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    policy_file: str | None = Field(
        default=None, description="A YAML policy file (`python -m serve_app.calibrate` writes one); `policy` fields override it."
    )
    controller: ControllerOptions = Field(default_factory=ControllerOptions)
    limits: Limits = Field(default_factory=Limits)
    streaming: StreamOptions = Field(default_factory=StreamOptions)
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
        return {**data, "policy": {**load_policy_file(data["policy_file"]), **given}}

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


def load_policy_file(path: str) -> dict[str, Any]:
    """The policy fields of a YAML policy file. A relative path is looked up in the working
    directory, then in the project root (where `serve run configs/...` is meant to run)."""
    import yaml

    candidates = [Path(path)] if Path(path).is_absolute() else [Path.cwd() / path, _PROJECT_ROOT / path]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        raise ValueError(f"policy_file: {path} not found (looked in {', '.join(str(p.parent) for p in candidates)})")
    data = yaml.safe_load(found.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"policy_file: {found} must hold a mapping of policy fields")
    return data


_PROJECT_ROOT = Path(__file__).resolve().parent.parent
