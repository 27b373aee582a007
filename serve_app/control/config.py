"""The control plane's configuration: the load → num_steps ladder and how the controller and
the replicas talk. No heavy imports: the simulator and the pure policy import it without an
engine or Ray."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from serve_app.strict import Strict


class Tier(Strict):
    """One rung of the ladder: loads per replica below ``below`` run ``num_steps`` draft steps."""

    below: float | None = Field(
        default=None, gt=0, description="Upper bound (exclusive) of load per replica; null on the last tier."
    )
    num_steps: int = Field(ge=0, le=64, description="Draft tokens per decode step in this tier; 0 = off.")


def _default_tiers() -> list[Tier]:
    return [Tier(below=4, num_steps=5), Tier(below=12, num_steps=3), Tier(num_steps=0)]


class PolicyConfig(Strict):
    """The load → num_steps ladder and what keeps it from flapping.

    Load is the cluster queue (waiting + running over live replicas) divided by the number of
    live replicas. The load is averaged over ``smoothing_s``; a tier is left only when the
    averaged load is past the tier's boundary by ``margin`` for ``dwell_s`` without a break
    (``fall_dwell_s``, where set, for a switch to more draft steps after the load fell), and
    never sooner than ``min_switch_interval_s`` after the previous switch
    (``rise_min_interval_s``, where set, for a switch to fewer draft steps after the load rose).
    """

    tiers: list[Tier] = Field(default_factory=_default_tiers, min_length=1)
    margin: float = Field(default=1.0, ge=0, description="Hysteresis, in load-per-replica units.")
    dwell_s: float = Field(default=2.0, ge=0)
    fall_dwell_s: float | None = Field(
        default=None,
        ge=0,
        description="The dwell before a switch to more draft steps (the load fell); null: dwell_s. Longer than "
        "dwell_s, it keeps the dips of a queue near capacity from bringing speculation back in the middle of a "
        "burst, while a rise still takes speculation away within dwell_s.",
    )
    min_switch_interval_s: float = Field(default=5.0, ge=0)
    rise_min_interval_s: float | None = Field(
        default=None,
        ge=0,
        description="The least time after the last switch before a switch to fewer draft steps (the load rose); "
        "null: min_switch_interval_s. Shorter, it lets a burst that first crossed one boundary take the next "
        "one within dwell_s, while a return to more draft steps still waits min_switch_interval_s.",
    )
    smoothing_s: float = Field(default=1.0, ge=0)
    engine_step_policy: Literal["fixed", "adaptive"] | None = Field(
        default=None,
        description="How the engines use the tier's num_steps: fixed (every decode step drafts it), adaptive (a "
        "ceiling; each engine picks every step's draft length under it), null (each engine's configured "
        "step_policy). Broadcast with the mode, so a change reaches every replica without a restart.",
    )

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
    def spec_steps(self) -> int:
        """The lowest-load tier's num_steps: what "speculation on" means under this policy (the
        controller starts there, and the static "spec" policy of the benchmarks runs it)."""
        return self.tiers[0].num_steps

    @property
    def history_s(self) -> float:
        """How much load history ``decide`` looks at (callers may drop older samples)."""
        return max(self.dwell_s, self.fall_dwell_s or 0.0) + self.smoothing_s + 1.0

    def tier_of(self, num_steps: int) -> int | None:
        """The index of the tier that runs ``num_steps`` (the lowest-load one), or None."""
        for i, tier in enumerate(self.tiers):
            if tier.num_steps == num_steps:
                return i
        return None


class GrafanaAnnotations(Strict):
    """Optional HTTP annotations on each switch (the dashboards' Prometheus annotation query
    needs none): posted asynchronously from a bounded queue, failures counted and logged."""

    url: str = Field(min_length=1, description="Grafana base URL, e.g. http://grafana:3000")
    token_env: str = Field(default="GRAFANA_TOKEN", min_length=1, description="Env var with a service account token.")
    dashboard_uids: list[str] = Field(default_factory=lambda: ["specserve-overview"], min_length=1)
    queue_size: int = Field(default=64, ge=1, description="Switches waiting to be posted; more are dropped.")
    timeout_s: float = Field(default=2.0, gt=0)


class ControllerActorOptions(Strict):
    """Where Ray places the controller actor: the ``num_cpus`` and custom ``resources`` passed to
    its ``.options()`` when it is created. The default (0 CPUs, no resources) lets Ray place it
    on any node; ``resources: {head: 0.001}`` pins it to the nodes that offer a ``head``
    resource. After its node is lost Ray restarts it on a live node that offers what it asks for
    (none: it stays pending until one joins). Read only when the controller is created: a
    running controller keeps its node until it is deleted or its node is lost."""

    num_cpus: float = Field(
        default=0.0, ge=0, allow_inf_nan=False, description="CPUs the controller holds (default 0: it mostly waits)."
    )
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources it needs, e.g. {head: 0.001} to pin it to the head."
    )

    @model_validator(mode="after")
    def _custom_resources_only(self) -> ControllerActorOptions:
        for name, amount in self.resources.items():
            if not name or name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(
                    f"resources: {name!r} is not a custom resource name (use num_cpus for CPUs; GPUs are not for the controller)"
                )
            if not (amount > 0 and math.isfinite(amount)):
                raise ValueError(f"resources.{name} must be a finite number greater than 0, got {amount}")
        return self

    def actor_options(self) -> dict[str, Any]:
        """The keyword arguments for ``ray.remote(...).options()``."""
        return {"num_cpus": self.num_cpus, **({"resources": dict(self.resources)} if self.resources else {})}


class ControllerOptions(Strict):
    """How the controller and the replicas talk, and where the controller runs."""

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
    ray_actor_options: ControllerActorOptions = Field(
        default_factory=ControllerActorOptions, description="The controller actor's placement: num_cpus, resources."
    )

    @model_validator(mode="after")
    def _stale_after_reports(self) -> ControllerOptions:
        if self.stale_after_s < 2 * self.report_interval_s:
            raise ValueError("stale_after_s must be at least 2 × report_interval_s")
        return self


def _policy_file_candidates(path: str) -> list[Path]:
    return [Path(path)] if Path(path).is_absolute() else [Path.cwd() / path, _PROJECT_ROOT / path]


def find_policy_file(path: str) -> Path | None:
    """Where a policy file is: a relative path is looked up in the working directory, then in
    the project root (where `serve run configs/...` is meant to run); None where it is in neither."""
    return next((p for p in _policy_file_candidates(path) if p.is_file()), None)


def load_policy_file(path: str) -> dict[str, Any]:
    """The policy fields of a YAML policy file, found as ``find_policy_file`` finds it."""
    import yaml

    found = find_policy_file(path)
    if found is None:
        looked = ", ".join(str(p.parent) for p in _policy_file_candidates(path))
        raise ValueError(f"policy_file: {path} not found (looked in {looked})")
    data = yaml.safe_load(found.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"policy_file: {found} must hold a mapping of policy fields")
    return data


_PROJECT_ROOT = Path(__file__).resolve().parents[2]
