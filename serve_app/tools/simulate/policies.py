"""The policies a simulation runs: a ladder calibrated from a curve, or one read from a serve
config or policy file."""

from __future__ import annotations

from serve_app.control.config import ControllerOptions, PolicyConfig, Tier
from serve_app.control.steps import expected_tokens

from .curves import Curve
from .traces import RequestClass


def mix_throughput(curve: Curve, batch: int, k: int, classes: tuple[RequestClass, ...] | None = None,
                   off_cost: bool = False) -> float:
    """Tokens/s of ``batch`` requests at k steps when the batch holds the classes by share:
    the curve's throughput × the mix's tokens per step over the curve's. ``off_cost``: k = 0
    in a speculative engine (the curve's ``off_cost``)."""
    x = curve.throughput(batch, k)
    if classes and k > 0:
        x *= sum(c.share * expected_tokens(c.acceptance, k) for c in classes) / curve.tokens_per_step(k)
    if off_cost and k == 0:
        x *= float(curve.off_speed([batch])[0])
    return x


def curve_policy(curve: Curve, spec_steps: int | None = None, classes: tuple[RequestClass, ...] | None = None,
                 off_cost: bool = False) -> PolicyConfig:
    """A ladder calibrated from the curve: each tier runs the num_steps that is fastest over its
    range of load per replica (only moves to fewer steps as load grows are kept, so noise in
    a measured curve cannot make the ladder climb back). ``spec_steps`` caps the top tier.
    ``classes``: fastest for that mix of requests (:func:`mix_throughput`), not the curve's own;
    ``off_cost``: num_steps 0 priced as in a speculative engine."""
    ks = [k for k in curve.steps if spec_steps is None or k <= spec_steps]
    tiers: list[Tier] = []
    current = None
    for b in range(1, curve.max_running + 1):
        best = max(ks, key=lambda k: mix_throughput(curve, b, k, classes, off_cost))
        if current is None:
            current = best
        elif best < current:
            tiers.append(Tier(below=b, num_steps=current))
            current = best
    tiers.append(Tier(num_steps=current))
    first = tiers[0].below or 1.0
    return PolicyConfig(tiers=tiers, margin=round(max(0.5, 0.1 * first), 2))


def load_policy(path: str) -> tuple[PolicyConfig | None, ControllerOptions | None, int | None]:
    """Policy, controller options and engine slots (max_num_seqs) from a serve config YAML (its
    first application's args, validated as AppArgs so ``policy_file`` is resolved), an
    AppArgs-shaped file, or a bare policy file."""
    from serve_app.serving.config import AppArgs, read_serve_config

    _, data = read_serve_config(path)
    if "tiers" in data:
        return PolicyConfig.model_validate(data), None, None
    args = AppArgs.model_validate(data)
    return args.policy, args.controller, getattr(args.engine.options, "max_num_seqs", None)
