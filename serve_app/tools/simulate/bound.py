"""``simulate bound``: what a draft length per request could add on the roofline, over one length a step.

The two-level engine picks one draft length for its whole batch (``choose_steps``); SGLang's
EAGLE worker and the embedded engine both verify every sequence at the batch's width. A
length per request needs a ragged verify: each sequence fed its own drafts, the step paying
for the tokens it feeds. This prices such a step on ``h200-8b-roofline``'s cost
(``curves.roofline_step_ms``: the target's forward over the fed tokens, then one draft pass per
draft position over the rows still drafting there) and, for batches drawn from the class mix,
compares the best lengths per class with the best single length, each by expected tokens per
second of step time (``expected_tokens`` at each class's acceptance). An upper bound on the
gain: the choice knows every class's acceptance exactly, and rows of one class draft alike
(they gain alike). ``bench acceptance``'s bound does the same for the embedded engine's
measured cost.

Writes ``bench/results/sim_per_sequence_bound.json``; takes a few seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from serve_app.control.steps import best_group_lengths, expected_tokens

from .curves import roofline_step_ms
from .traces import DEFAULT_CLASSES, RequestClass, parse_classes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--classes", default=DEFAULT_CLASSES, help=f"name:share:acceptance,... (default {DEFAULT_CLASSES})")
    p.add_argument("--ceiling", type=int, default=5, help="the most drafts a sequence may verify (default 5)")
    p.add_argument("--batches", default="1,2,4,8,16,32,64,96,128,160,192,224,256")
    p.add_argument("--draws", type=int, default=200, help="batches drawn from the mix per batch size (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/sim_per_sequence_bound.json")


def step_ms(counts: tuple[int, ...], lengths: tuple[int, ...]) -> float:
    """A ragged step of ``counts[c]`` sequences of class c, each verifying ``lengths[c]`` drafts."""
    fed = sum(n * (1 + k) for n, k in zip(counts, lengths, strict=True))
    drafting = [sum(n for n, k in zip(counts, lengths, strict=True) if k >= j) for j in range(1, max(lengths) + 1)]
    return roofline_step_ms(fed, drafting)


def best(counts: tuple[int, ...], tokens: np.ndarray, ceiling: int, per_class: bool) -> tuple[float, tuple[int, ...]]:
    """(tokens per ms, lengths by class) of the best choice: one length for all, or one per class.
    ``tokens[c, k]``: expected tokens of a verify of k drafts for class c. Ties keep fewer drafts."""
    present = [c for c, n in enumerate(counts) if n]

    def by_class(chosen: tuple[int, ...]) -> tuple[int, ...]:
        lengths = [0] * len(counts)
        for c, k in zip(present, chosen, strict=True):
            lengths[c] = k
        return tuple(lengths)

    def rate(chosen: tuple[int, ...]) -> float:
        lengths = by_class(chosen)
        return sum(counts[c] * tokens[c, lengths[c]] for c in present) / step_ms(counts, lengths)

    top, chosen = best_group_lengths(len(present), ceiling, per_class, rate)
    return top, by_class(chosen)


def bound(classes: tuple[RequestClass, ...], batches: list[int], ceiling: int, draws: int, seed: int) -> list[dict]:
    """Per batch size, over ``draws`` batches drawn from the mix: the per-class choice's tokens/s
    over the single length's (the ratio of the means, and the largest of one batch), the single
    length's over plain decoding's, and the lengths chosen most often."""
    rng = np.random.default_rng(seed)
    shares = np.array([c.share for c in classes])
    tokens = np.array([[expected_tokens(c.acceptance, k) for k in range(ceiling + 1)] for c in classes])
    rows = []
    for b in batches:
        sums = {"plain": 0.0, "one": 0.0, "each": 0.0}
        largest, picks_one, picks_each = 1.0, {}, {}
        seen: dict[tuple[int, ...], tuple] = {}
        for counts in (tuple(int(x) for x in rng.multinomial(b, shares)) for _ in range(draws)):
            if counts not in seen:
                seen[counts] = (best(counts, tokens, 0, False), best(counts, tokens, ceiling, False),
                                best(counts, tokens, ceiling, True))
            (plain, _), (one, k_one), (each, k_each) = seen[counts]
            sums["plain"] += plain
            sums["one"] += one
            sums["each"] += each
            largest = max(largest, each / one)
            picks_one[str(max(k_one))] = picks_one.get(str(max(k_one)), 0) + 1
            key = ",".join(str(k) if n else "-" for k, n in zip(k_each, counts, strict=True))
            picks_each[key] = picks_each.get(key, 0) + 1
        rows.append({
            "batch": b,
            "plain_tokens_per_s": round(1000 * sums["plain"] / draws, 1),
            "one_length_over_plain": round(sums["one"] / sums["plain"], 4),
            "per_class_over_one_length": round(sums["each"] / sums["one"], 4),
            "largest_per_class_over_one_length": round(largest, 4),
            "one_length_chosen": dict(sorted(picks_one.items(), key=lambda kv: -kv[1])[:3]),
            "per_class_chosen": dict(sorted(picks_each.items(), key=lambda kv: -kv[1])[:3]),
        })
    return rows


def format_rows(rows: list[dict], classes: tuple[RequestClass, ...]) -> str:
    names = ",".join(c.name for c in classes)
    lines = [f"{'batch':>5} {'one/plain':>9} {'per-class/one':>13} {'largest':>7}  one length  per class ({names})"]
    for r in rows:
        one = " ".join(f"{k}:{n}" for k, n in r["one_length_chosen"].items())
        each = " ".join(f"{k}:{n}" for k, n in r["per_class_chosen"].items())
        lines.append(f"{r['batch']:>5} {r['one_length_over_plain']:>9.3f} {r['per_class_over_one_length']:>13.3f} "
                     f"{r['largest_per_class_over_one_length']:>7.3f}  {one:<10}  {each}")
    return "\n".join(lines)


def run(args) -> int:
    started = time.perf_counter()
    classes = parse_classes(args.classes)
    if any(c.acceptance is None for c in classes):
        raise SystemExit("simulate bound: every class needs an acceptance (name:share:acceptance)")
    if args.ceiling < 1:
        raise SystemExit(f"simulate bound: --ceiling must be at least 1, got {args.ceiling}")
    try:
        batches = [int(x) for x in args.batches.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"simulate bound: --batches takes integers, got {args.batches!r}") from None
    if not batches or min(batches) < 1:
        raise SystemExit(f"simulate bound: --batches must be positive, got {args.batches!r}")
    rows = bound(classes, batches, args.ceiling, args.draws, args.seed)
    print(format_rows(rows, classes))
    out = {
        "meta": {
            "command": "python -m serve_app.tools.simulate " + " ".join(sys.argv[1:]),
            "curve": "h200-8b-roofline",
            "cost": "roofline_step_ms: T(fed tokens) + per draft position (0.06·T(rows drafting) + 0.2 ms)",
            "classes": [{"name": c.name, "share": c.share, "acceptance": c.acceptance} for c in classes],
            "ceiling": args.ceiling, "draws": args.draws, "seed": args.seed,
            "wall_s": round(time.perf_counter() - started, 1),
        },
        "rows": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0
