"""``bench acceptance``: the draft head's acceptance by draft position for each kind of request,
and what a draft length per sequence could gain over one length a step.

One embedded engine (``--weights``, ``--drafter``, 1 thread) serves each class of request in
turn, one request at a time, every decode step drafting ``--num-steps``: chat and copy-heavy
prompts (``bench steps``' prompt sets), each greedy and at temperature 1. From the engine's
count of verifies by (drafts, accepted) over a class: ``a_by_position``, the acceptance at draft
position j of the verifies that tried it (all drafts before it accepted).

The bound (with ``--cost-from``, a ``bench steps`` result of the same weights): ``bench steps``'
mixed workload (request i chat when even, copy-heavy when odd, at temperature 1 when
i % 3 == 2) in batches of B consecutive requests, at every offset of the pattern. For each
batch and ceiling, the best single draft length for the whole batch against the best length
for each sequence apart, each by expected tokens per second of step time (the chooser's
``expected_tokens``), on the cost the chooser of that run fitted (its ``meta.chooser``): a
verify of ``base + per_row * rows + per_draft * K`` and a head of ``head_base + head_per_row *
drafting * (1 + 2 K) + head_per_pass * K``, K the longest draft, ``drafting`` the sequences that
draft. One length a step feeds ``B (1 + K)`` rows; lengths per sequence feed
``sum(1 + k_i)``: a ragged verify, where each sequence is fed only its own drafts, as the
engine's verify does. An upper bound on what lengths per sequence add: the choice knows each
class's acceptance exactly, and the cost is the linear model without its per-cell corrections
(the engine's chooser, ``per_sequence``, estimates acceptance per request as it goes).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from collections import Counter
from dataclasses import dataclass

from tqdm import tqdm

from serve_app.control.steps import best_group_lengths, expected_tokens
from serve_app.engines.base import SamplingParams
from serve_app.engines.embedded.config import DRAFTERS

from .client import sampling_for
from .engine import IGNORE_EOS, _int_list, timed_request
from .prompts import PROMPT_SETS, chat_messages
from .stats import acceptance, emit
from .steps import mixed_prompt_set

HELP = "acceptance by draft position per kind of request, and the most a draft length per sequence could add"

CLASSES = ("chat t=0", "chat t=1", "copy t=0", "copy t=1")
PATTERN = 6  # the mixed workload repeats every 6 requests: chat/copy every 2, sampled every 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--drafter", choices=DRAFTERS, default="eagle")
    p.add_argument("--weights", default="gguf")
    p.add_argument("--num-steps", type=int, default=3, help="drafts of every decode step (default 3)")
    p.add_argument("--requests", type=int, default=8, help="requests per class (default 8)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--cost-from", default=None,
                   help="a `bench steps` JSON of the same weights: the step cost of the bound (none: no bound)")
    p.add_argument("--batches", type=_int_list, default=[1, 2, 4, 8], help="batch sizes of the bound")
    p.add_argument("--ceilings", type=_int_list, default=[1, 3], help="ceilings of the bound")
    p.add_argument("--out", help="write the results as JSON to this file")


def run(args: argparse.Namespace) -> int:
    if args.num_steps < 1 or args.requests < 1:
        raise SystemExit("--num-steps and --requests must be >= 1")
    cost = None
    if args.cost_from:
        with open(args.cost_from) as f:
            cost = LinearCost.from_chooser(json.load(f)["meta"]["chooser"])
    classes = asyncio.run(measure(args))
    result = {"meta": {"model": args.model, "drafter": args.drafter, "weights": args.weights,
                       "num_steps": args.num_steps, "requests": args.requests, "max_tokens": args.max_tokens,
                       "num_threads": args.num_threads, "cost_from": args.cost_from},
              "classes": classes}
    if cost is not None:
        acc = {name: c["a_by_position"] for name, c in classes.items()}
        result["meta"]["cost"] = dataclasses.asdict(cost)
        result["bound"] = bound(acc, cost, args.batches, [c for c in args.ceilings if c <= args.num_steps])
    return emit(result, format_report(result), args.out)


# -- measuring ---------------------------------------------------------------------------
def class_of(i: int) -> str:
    """The class of request i of ``bench steps``' mixed workload."""
    temperature, _ = sampling_for(i, 3)
    return f"{mixed_prompt_set(i)} t={temperature:g}"


def position_acceptance(counts: Counter, depth: int) -> list[float | None]:
    """Acceptance at draft positions 1..depth from verify counts ``(drafts, accepted) -> n``:
    of the verifies that tried position j (j <= drafts, the j - 1 before it accepted), the share
    that accepted it; None where none tried it."""
    out = []
    for j in range(1, depth + 1):
        tried = sum(n for (k, a), n in counts.items() if k >= j and a >= j - 1)
        hit = sum(n for (k, a), n in counts.items() if k >= j and a >= j)
        out.append(round(hit / tried, 4) if tried else None)
    return out


async def measure(args: argparse.Namespace) -> dict:
    import torch

    from serve_app.engines.embedded import EmbeddedEngine, EmbeddedOptions

    torch.set_num_threads(args.num_threads)
    engine = EmbeddedEngine(EmbeddedOptions(model=args.model, drafter=args.drafter, weights=args.weights,
                                            num_threads=args.num_threads, max_num_seqs=1,
                                            max_num_steps=max(8, args.num_steps)))
    await engine.start()
    engine.core.num_steps = args.num_steps
    out = {}
    try:
        with tqdm(total=len(CLASSES) * args.requests, desc="bench acceptance", unit="req", file=sys.stderr) as bar:
            for name in CLASSES:
                bar.set_postfix_str(name)
                kind, temp = name.split(" t=")
                sampled = temp != "0"
                prompts = [engine.apply_chat_template(chat_messages(p)) for p in PROMPT_SETS[kind]]
                before, totals, tokens = Counter(engine.core.verify_counts), dict(engine.core.totals), 0
                for i in range(args.requests):
                    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0 if sampled else 0.0,
                                            top_p=1.0, seed=i if sampled else None, ignore_eos=IGNORE_EOS)
                    tokens += (await timed_request(engine, prompts[i % len(prompts)], args.max_tokens,
                                                   params)).output_tokens
                    bar.update(1)
                counts = engine.core.verify_counts - before
                out[name] = {"requests": args.requests, "output_tokens": tokens,
                             "verifies": engine.core.totals["verifies"] - totals["verifies"],
                             "mean_accepted": acceptance(totals, engine.core.totals)["mean_accepted_len"],
                             "a_by_position": position_acceptance(counts, args.num_steps)}
    finally:
        await engine.shutdown()
    return out


# -- the bound (pure) ----------------------------------------------------------------------
@dataclass(slots=True)
class LinearCost:
    """Seconds of a decode step: the chooser's linear verify and head, fed per-sequence lengths."""

    base: float
    per_row: float
    per_draft: float
    head_base: float
    head_per_row: float
    head_per_pass: float

    @classmethod
    def from_chooser(cls, chooser: dict) -> LinearCost:
        return cls(*(float(chooser[f"{part}_s"]) for part in (
            "step_cost_base", "step_cost_per_row", "step_cost_per_draft",
            "head_cost_base", "head_cost_per_row", "head_cost_per_pass")))

    def seconds(self, lengths: tuple[int, ...]) -> float:
        """A step of these drafts per sequence, each sequence fed 1 + its own (a ragged verify)."""
        longest = max(lengths)
        verify = self.base + self.per_row * (len(lengths) + sum(lengths)) + self.per_draft * longest
        if longest == 0:
            return verify
        drafting = sum(1 for k in lengths if k > 0)
        return verify + self.head_base + self.head_per_row * drafting * (1 + 2 * longest) + self.head_per_pass * longest


def best_lengths(acceptances: list[list[float]], ceiling: int, cost: LinearCost,
                 per_sequence: bool) -> tuple[float, tuple[int, ...]]:
    """(expected tokens/s, lengths): the best one length for all (``per_sequence`` False) or the
    best length for each sequence, among 0..ceiling. Per sequence, sequences of one acceptance
    take one length: under the best rate r the choice splits into each sequence's own best of
    ``expected_tokens - r * its cost``, the same for like sequences, once the longest draft
    (the head's passes) is fixed; so the search runs over a length per distinct acceptance."""
    groups = list(dict.fromkeys(tuple(a) for a in acceptances))
    which = [groups.index(tuple(a)) for a in acceptances]

    def rate(by_group: tuple[int, ...]) -> float:
        lengths = tuple(by_group[g] for g in which)
        return sum(expected_tokens(a, k) for a, k in zip(acceptances, lengths, strict=True)) / cost.seconds(lengths)

    top, by_group = best_group_lengths(len(groups), ceiling, per_sequence, rate)
    return top, tuple(by_group[g] for g in which)


def bound(acc: dict[str, list[float]], cost: LinearCost, batches: list[int], ceilings: list[int]) -> list[dict]:
    """Per batch size and ceiling, over the batches of the mixed workload at every offset: the
    best per-sequence lengths' rate over the best single length's, and the single length's over
    plain decoding's."""
    rows = []
    for b in batches:
        for ceiling in ceilings:
            gains, over_plain, examples = [], [], []
            for offset in range(PATTERN):
                names = [class_of(offset + j) for j in range(b)]
                accs = [[a if a is not None else 0.0 for a in acc[name]] for name in names]
                one, k = best_lengths(accs, ceiling, cost, per_sequence=False)
                each, ks = best_lengths(accs, ceiling, cost, per_sequence=True)
                plain, _ = best_lengths(accs, 0, cost, per_sequence=False)
                gains.append(round(each / one, 4))
                over_plain.append(round(one / plain, 4))
                examples.append({"classes": names, "one_length": k[0], "per_sequence": list(ks)})
            rows.append({"batch": b, "ceiling": ceiling, "per_sequence_over_one_length": gains,
                         "one_length_over_plain": over_plain, "max_gain": max(gains), "batches": examples})
    return rows


def format_report(result: dict) -> str:
    lines = [f"{'class':>9} {'verifies':>8} {'accepted':>8}  acceptance by position"]
    for name, c in result["classes"].items():
        a = ", ".join("-" if x is None else f"{x:.3f}" for x in c["a_by_position"])
        mean = "-" if c["mean_accepted"] is None else f"{c['mean_accepted']:.3f}"
        lines.append(f"{name:>9} {c['verifies']:>8} {mean:>8}  {a}")
    if "bound" in result:
        lines.append("per-sequence lengths over one length a step (ragged verify, at each offset of the mix)")
        for r in result["bound"]:
            lines.append(f"  batch {r['batch']:>2}, ceiling {r['ceiling']}: "
                         + " ".join(f"{g:.3f}" for g in r["per_sequence_over_one_length"])
                         + f"   (one length over plain: {' '.join(f'{g:.3f}' for g in r['one_length_over_plain'])})")
    return "\n".join(lines)
