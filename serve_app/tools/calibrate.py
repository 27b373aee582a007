"""``python -m serve_app.tools.calibrate``: measure where plain decoding overtakes each speculative
tier on this hardware and model, and write the ladder as a policy file configs include.

    python -m serve_app.tools.calibrate --config configs/local.yaml

writes the policy file the config reads on this host (``--out`` to choose another).

``--from-results FILE`` derives the ladder again from the measurements a ``--results`` file
keeps, without measuring: the file it writes records both commands.

It sweeps the deployed application (the same stack and replica count that will serve, so
the loads are the controller's own unit: waiting + running per replica): for each load per
replica L and each num_steps k (the config's ladder, 0 included), ``bench serve``'s closed
loop runs L x replicas clients with k pinned through the operator API. Points at one load
run back to back for every k, so their ratios see the same machine conditions; with
``--repeats N`` each k runs N windows at a load in mirrored order (k=3, k=0, k=0, k=3, ...),
pooled as ``bench serve`` pools them, so a drift over a load weighs on every k alike. With
``--stagger-s S`` each window's clients start spread over S seconds, as ``bench serve
--stagger-s`` does.

From the tokens/s table it builds the ladder: walking up the loads, a tier ends where a
tier with fewer steps starts to win; the boundary is the crossover, interpolated linearly
between the two loads around it. A speculative tier that never wins is left out. With
``--repeats`` of 2 or more, a lead no larger than the noise at that load (half the widest
spread between one num_steps' windows there) is a tie, and a tie goes to more steps: a tier
ends only where fewer steps win by more than the windows disagree among themselves (where
a tier held a load on a tie, its boundary is where the lead outgrows the noise), so a ladder
does not lose its deepest tier to a 2 % lead inside a 16 % spread. The policy
file keeps the config's dwell and intervals and replaces the tiers; it keeps the config's
margin too, cut to a quarter of the ladder's narrowest band (from load 0 to the first
boundary, or between two boundaries; rounded to two decimals), so that the middle half of
every band gets its tier from either side (a margin of 1.0 on a 3-step tier below 1.3 would
hold 1 step down to 0.3).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import yaml
from tqdm import tqdm

from serve_app.control.config import PolicyConfig
from serve_app.serving.config import policy_file_for_host, read_serve_config
from serve_app.tools.bench.client import Poller, Target, add_target_arguments, prompt_messages, run_against_target
from serve_app.tools.bench.engine import cpu_model
from serve_app.tools.bench.serve import measure_window, point_row, window_order


def _floats(text: str) -> list[float]:
    values = sorted({float(v) for v in text.split(",") if v.strip()})
    if not values or values[0] <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _ints(text: str) -> list[int]:
    return sorted({int(v) for v in text.split(",") if v.strip()}, reverse=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serve_app.tools.calibrate", description=__doc__.splitlines()[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_arguments(p)
    p.add_argument("--loads", type=_floats, default=[1, 2, 3, 4, 6, 8, 12, 16],
                   help="loads per replica to measure (clients = load x replicas)")
    p.add_argument("--num-steps", type=_ints, default=None,
                   help="num_steps to measure (default: the config's ladder); 0 is always added")
    p.add_argument("--settle-s", type=float, default=5.0,
                   help="unmeasured seconds per point, and at least until every client finished a request")
    p.add_argument("--measure-s", type=float, default=20.0, help="measured seconds per window")
    p.add_argument("--repeats", type=int, default=1,
                   help="windows per num_steps and load, in mirrored order, pooled (default 1)")
    p.add_argument("--stagger-s", type=float, default=0.0,
                   help="client j sends its first request j x S / clients seconds after a window starts, as "
                        "bench serve --stagger-s (default 0: together; requests of one length then stay in step "
                        "under plain decoding, which flatters it against traffic that arrives spread out)")
    p.add_argument("--out", default=None,
                   help="the policy file to write (default: the one --config reads on this host, see "
                        "AppArgs.policy_file; else configs/policies/local.yaml)")
    p.add_argument("--results", default=None, help="also write the measurements as JSON here")
    p.add_argument("--from-results", metavar="FILE", default=None,
                   help="derive the ladder from the measurements in FILE (an earlier --results) instead of "
                        "measuring; the target and sweep options are then unused")
    return p


# -- from measurements to a ladder (pure) ------------------------------------------------
def crossover(a: dict[float, float], b: dict[float, float], lo: float, hi: float,
              noise: dict[float, float] | None = None) -> float:
    """The load in [lo, hi] where ``b`` overtakes ``a`` (tokens/s by load), linearly interpolated.

    Where ``b`` already leads at ``lo`` but by no more than ``noise`` there (``a`` held ``lo``
    on a tie), the load where ``b``'s lead outgrows the noise instead."""
    d_lo, d_hi = b[lo] - a[lo], b[hi] - a[hi]
    noise = noise or {}
    if d_lo >= 0 and noise.get(lo, 0.0) > 0:
        d_lo, d_hi = d_lo - noise[lo], d_hi - noise.get(hi, 0.0)
    if d_lo >= 0 or d_hi <= d_lo:
        return lo
    return lo + (hi - lo) * min(1.0, -d_lo / (d_hi - d_lo))


def derive_tiers(tps: dict[int, dict[float, float]], noise: dict[float, float] | None = None) -> list[dict]:
    """The ladder from tokens/s by num_steps and load per replica (see the module docstring).

    ``noise`` (tokens/s by load, see ``window_noise``): a lead up to it is a tie, and ties
    within it go to more steps. Without noise, exact ties go to fewer steps. If speculation
    wins at every load measured, plain decoding takes over past the largest load measured
    (measure further to place it)."""
    loads = sorted(set.intersection(*(set(v) for v in tps.values())))
    noise = noise or {}

    def winner(load: float) -> int:
        best = max(sorted(tps), key=lambda k: (tps[k][load], -k))
        tol = noise.get(load, 0.0)
        return max(k for k in tps if tps[k][load] >= tps[best][load] - tol) if tol > 0 else best

    winners = [winner(load) for load in loads]
    ladder, bounds = [winners[0]], []
    for prev, load, w in zip(loads, loads[1:], winners[1:], strict=False):
        if w < ladder[-1]:  # only ever fewer steps as the load rises
            bounds.append(crossover(tps[ladder[-1]], tps[w], prev, load, noise))
            ladder.append(w)
    if ladder[-1] != 0:
        bounds.append(loads[-1])
        ladder.append(0)
    rounded: list[float] = []
    for b in bounds:  # one decimal, strictly rising, positive
        rounded.append(round(max(b, rounded[-1] + 0.1 if rounded else 0.1), 1))
    return [{"below": b, "num_steps": k} for k, b in zip(ladder[:-1], rounded, strict=True)] + [{"num_steps": 0}]


MARGIN_SHARE = 0.25
"""The most hysteresis a calibrated ladder keeps, as a share of its narrowest band."""


def fit_margin(margin: float, bounds: list[float]) -> float:
    """``margin``, or a quarter of the narrowest band between 0 and ``bounds`` (a ladder's
    ``PolicyConfig.bounds``) if that is smaller."""
    if not bounds:
        return margin
    edges = [0.0, *bounds]
    narrowest = min(b - a for a, b in zip(edges, edges[1:], strict=False))
    return min(margin, round(MARGIN_SHARE * narrowest, 2))


def window_noise(rows: list[dict]) -> dict[float, float]:
    """Per load per replica: half the widest spread (tokens/s) between one num_steps' windows,
    0 where a load ran one window per num_steps."""
    noise: dict[float, float] = {}
    for r in rows:
        w = r.get("window_tokens_per_s") or []
        spread = (max(w) - min(w)) / 2 if len(w) > 1 else 0.0
        noise[r["load_per_replica"]] = max(noise.get(r["load_per_replica"], 0.0), spread)
    return noise


def plain_crossovers(tps: dict[int, dict[float, float]]) -> dict[str, float | None]:
    """Per speculative num_steps: the load where plain decoding overtakes it (None: it never does)."""
    out: dict[str, float | None] = {}
    loads = sorted(tps[0])
    for k in sorted(k for k in tps if k > 0):
        out[str(k)] = None
        for i, load in enumerate(loads):
            if tps[0][load] >= tps[k][load]:
                out[str(k)] = load if i == 0 else round(crossover(tps[k], tps[0], loads[i - 1], load), 2)
                break
    return out


def default_out(args: argparse.Namespace) -> str:
    """The policy file ``--config`` reads on this host (its CPU's or kernel's, where it names one
    per CPU or kernel; a CPU's that does not exist yet too), so that recalibrating changes the
    ladder this host serves with."""
    if not args.url and not args.from_results:
        spec = read_serve_config(args.config)[1].get("policy_file")
        if spec:
            return policy_file_for_host(spec, to_write=True)
    return "configs/policies/local.yaml"


def write_policy_file(path: str, policy: PolicyConfig, header: str) -> None:
    text = yaml.safe_dump(policy.model_dump(), sort_keys=False, default_flow_style=None)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + text)


# -- the sweep ---------------------------------------------------------------------------
async def measure(target: Target, args: argparse.Namespace) -> dict:
    status = await target.status()
    replicas = len(status["replicas"])
    policy = PolicyConfig.model_validate(status["policy"])
    steps = sorted({*(args.num_steps or [t.num_steps for t in policy.tiers]), 0}, reverse=True)
    prompts = prompt_messages(args.prompt_set.split(","))
    rows = []
    order = window_order(steps, args.repeats)
    async with Poller(target) as poller:
        with tqdm(total=len(args.loads) * len(order), desc="calibrate", unit="window", file=sys.stderr) as bar:
            for load in args.loads:
                clients = max(1, round(load * replicas))
                windows: dict[int, list] = {k: [] for k in steps}
                for k in order:
                    bar.set_postfix_str(f"load {load:g} k={k}")
                    await target.apply_policy("spec" if k else "off", k)
                    windows[k].append(await measure_window(target, poller, prompts, clients, args.settle_s,
                                                           args.measure_s, args.max_tokens, args.ignore_eos,
                                                           args.stagger_s))
                    bar.update(1)
                rows += [{"num_steps": k, "load_per_replica": load, "concurrency": clients} | point_row(windows[k])
                         for k in steps]
    await target.put_mode(None)
    return {"model": target.model, "replicas": replicas, "policy": policy.model_dump(), "stagger_s": args.stagger_s,
            "rows": rows}


def calibrate(measured: dict, args: argparse.Namespace) -> dict:
    """The ladder and the policy file's contents from the measurements."""
    tps: dict[int, dict[float, float]] = {}
    for r in measured["rows"]:
        tps.setdefault(r["num_steps"], {})[r["load_per_replica"]] = r["output_tokens_per_s"]
    noise = window_noise(measured["rows"])
    tiers = derive_tiers(tps, noise)
    policy = PolicyConfig.model_validate(measured["policy"] | {"tiers": tiers})
    policy = policy.model_copy(update={"margin": fit_margin(policy.margin, policy.bounds)})
    return {"tiers": tiers, "crossovers": plain_crossovers(tps), "noise": {str(k): round(v, 1) for k, v in noise.items()},
            "policy": policy.model_dump()}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.repeats < 1:
        parser().error("--repeats must be at least 1")
    if args.stagger_s < 0:
        parser().error("--stagger-s must be >= 0")
    args.out = args.out or default_out(args)
    t0 = time.monotonic()
    command = " ".join(["python -m serve_app.tools.calibrate", *(sys.argv[1:] if argv is None else argv)])
    when = datetime.now(UTC).isoformat(timespec="seconds")
    if args.from_results:
        try:
            stored = json.loads(Path(args.from_results).read_text())
            measured = stored["measurements"]
            measured_by, measured_on = stored.get("measured_by", stored["command"]), stored.get("measured_on", stored["date"])
        except (OSError, ValueError, KeyError) as e:
            parser().error(f"--from-results {args.from_results}: not a calibrate --results file ({e})")
        source = f"from the measurements of `{measured_by}` on {measured_on}\n({measured['model']}, "
    else:
        measured = run_against_target(args, lambda target: measure(target, args)) | {"cpu_model": cpu_model()}
        measured_by, measured_on = command, when
        source = f"({measured['model']}, {time.monotonic() - t0:.0f} s, "
    result = calibrate(measured, args) | {"measurements": measured}
    on_cpu = f", on {measured['cpu_model']}" if measured.get("cpu_model") else ""
    header = (f"Written by `{command}` on {when}\n{source}{measured['replicas']} replicas{on_cpu}). "
              "Load = waiting + running per replica.\n"
              f"Plain decoding overtakes num_steps k at load: {result['crossovers']}\n"
              "Re-run the command to recalibrate; edit by hand at your own risk.")
    write_policy_file(args.out, PolicyConfig.model_validate(result["policy"]), header)
    print("tokens/s by load per replica and num_steps:")
    steps = sorted({r["num_steps"] for r in measured["rows"]}, reverse=True)
    print(f"{'load':>6} " + " ".join(f"{'k=' + str(k):>9}" for k in steps))
    for load in sorted({r["load_per_replica"] for r in measured["rows"]}):
        tps = {r["num_steps"]: r["output_tokens_per_s"] for r in measured["rows"] if r["load_per_replica"] == load}
        print(f"{load:>6g} " + " ".join(f"{tps[k]:>9.1f}" for k in steps))
    print(f"crossovers (plain overtakes k at load): {result['crossovers']}")
    if any(result["noise"].values()):
        print(f"noise (tok/s by load; a lead up to it is a tie, which keeps more steps): {result['noise']}")
    if result["policy"]["margin"] < measured["policy"]["margin"]:
        print(f"margin {measured['policy']['margin']:g} cut to {result['policy']['margin']:g}: "
              f"{MARGIN_SHARE:g} of the ladder's narrowest band")
    print(f"tiers: {result['tiers']}\nwrote {args.out}")
    if args.results:
        Path(args.results).write_text(json.dumps(result | {"command": command, "date": when, "measured_by": measured_by,
                                                           "measured_on": measured_on}, indent=2))
        print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
