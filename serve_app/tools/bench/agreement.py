"""``bench agreement``: how far a compact weight format's greedy output agrees with float32's.

Builds the embedded engine (``--model``, ngram drafter, ``--num-threads``) in this process,
once with float32 weights (the reference) and once per format in ``--weights``, each freed
before the next is built. Every engine decodes the same prompts greedily (temperature 0, end
of sequence honoured, num_steps 0, at most ``--max-tokens`` each) as one continuous batch:
all requests are added at once and ``--batch`` of them decode together (the engine's
max_num_seqs). The prompts are the first ``--num-prompts`` of ``--prompt-set`` (default
min(batch, size of the set); a larger number cycles over the set again), each rendered
with the model's chat template.

Per format, against float32's outputs: the prompts whose output token ids are identical,
the share of float32's output tokens matched position by position (position i counts when
both outputs have a token there and they are equal; summed over the prompts and divided by
float32's total output length), and the mean length of the common prefix in tokens. Naming
``float32`` in ``--weights`` builds a second float32 engine: it should agree completely.
The table prints, then the JSON result.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

from serve_app.engines.base import GenerateRequest, SamplingParams

from .prompts import PROMPT_SETS, chat_messages
from .stats import emit

HELP = "greedy output agreement of compact weight formats with float32 (identical outputs, tokens matched)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="model (default smollm2-135m-instruct)")
    p.add_argument("--weights", default="q4_1,gguf",
                   help="comma list of formats compared with float32: float32, bfloat16, int8, q4_1, gguf "
                        "(default q4_1,gguf)")
    p.add_argument("--prompt-set", default="chat", choices=sorted(PROMPT_SETS), help="prompts (default chat)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts run (default min(batch, size of the set); more cycles over the set)")
    p.add_argument("--max-tokens", type=int, default=96, help="output tokens per request at most (default 96)")
    p.add_argument("--batch", type=int, default=16, help="requests decoding together (default 16)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--out", default=None, help="write the JSON result here too")


def _formats(text: str) -> list[str]:
    from serve_app.engines.embedded.linear import WEIGHT_FORMATS

    formats = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in formats if w not in WEIGHT_FORMATS]
    if not formats or bad:
        raise SystemExit(f"--weights takes a comma list of {', '.join(WEIGHT_FORMATS)}; got {text!r}")
    return formats


def run(args: argparse.Namespace) -> int:
    if args.batch < 1 or args.max_tokens < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        raise SystemExit("--batch, --max-tokens and --num-prompts must be >= 1")
    formats = _formats(args.weights)
    result = measure(args, formats)
    return emit(result, format_report(result) + "\n" + json.dumps(result), args.out)


def _engine(args, weights: str):
    from serve_app.engines.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(model=args.model, weights=weights, drafter="ngram", num_threads=args.num_threads,
                            max_num_seqs=args.batch, max_model_len=1024)
    engine.build()
    return engine


def _generate(args, weights: str, texts: list[str]) -> tuple[list[list[int]], float, float]:
    """Build an engine of ``weights``, decode every prompt greedily as one batch and free it;
    returns (output token ids per prompt, build seconds, decode seconds)."""
    start = time.perf_counter()
    engine = _engine(args, weights)
    built = time.perf_counter()
    prompts = [engine.apply_chat_template(chat_messages(t)) for t in texts]
    outputs: list[list[int]] = [[] for _ in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=False)
    for i, prompt in enumerate(prompts):
        seq = engine.make_sequence(GenerateRequest(f"a{i}", prompt=prompt, params=params),
                                   lambda d, out=outputs[i]: out.extend(d.token_ids))
        engine.core.add(seq)
    engine.core.num_steps = 0
    while engine.core.has_work():
        engine.core.step()
    done = time.perf_counter()
    del engine
    gc.collect()
    return outputs, built - start, done - built


def compare(reference: list[list[int]], outputs: list[list[int]]) -> dict:
    """Agreement of ``outputs`` with ``reference``, prompt by prompt (see the module's docstring)."""
    prefixes, matched = [], 0
    for ref, out in zip(reference, outputs, strict=True):
        matched += sum(a == b for a, b in zip(ref, out, strict=False))
        n = 0
        while n < min(len(ref), len(out)) and ref[n] == out[n]:
            n += 1
        prefixes.append(n)
    ref_tokens = sum(len(r) for r in reference)
    return {
        "identical": sum(r == o for r, o in zip(reference, outputs, strict=True)),
        "num_prompts": len(reference),
        "tokens_matched": matched,
        "share_matched": round(matched / ref_tokens, 4) if ref_tokens else None,
        "mean_common_prefix": round(sum(prefixes) / len(prefixes), 2),
        "common_prefix": prefixes,
    }


def measure(args, formats: list[str]) -> dict:
    import torch

    prompt_set = PROMPT_SETS[args.prompt_set]
    n = args.num_prompts if args.num_prompts is not None else min(args.batch, len(prompt_set))
    texts = [prompt_set[i % len(prompt_set)] for i in range(n)]
    reference, build_s, decode_s = _generate(args, "float32", texts)
    ref = {"output_tokens": sum(len(o) for o in reference), "lengths": [len(o) for o in reference],
           "build_s": round(build_s, 2), "decode_s": round(decode_s, 4)}
    compared = {}
    for weights in formats:
        outputs, build_s, decode_s = _generate(args, weights, texts)
        compared[weights] = {**compare(reference, outputs), "output_tokens": sum(len(o) for o in outputs),
                             "lengths": [len(o) for o in outputs],
                             "build_s": round(build_s, 2), "decode_s": round(decode_s, 4)}
    return {
        "model": args.model, "torch": torch.__version__, "num_threads": args.num_threads,
        "prompt_set": args.prompt_set, "num_prompts": n, "batch": args.batch, "max_tokens": args.max_tokens,
        "reference": ref, "formats": compared,
        "command": " ".join(["python -m serve_app.tools.bench", *sys.argv[1:]]),
    }


def format_report(r: dict) -> str:
    ref = r["reference"]
    lines = [f"{r['model']}, {r['num_prompts']} {r['prompt_set']} prompts, batch {r['batch']}, "
             f"max_tokens {r['max_tokens']}, {r['num_threads']} thread(s): float32 gave {ref['output_tokens']} "
             f"tokens (decode {ref['decode_s']} s)", "",
             f"{'weights':10s} {'identical':>10s} {'tokens matched':>15s} {'mean prefix':>12s} "
             f"{'tokens':>7s} {'build s':>8s} {'decode s':>9s}"]
    for name, f in r["formats"].items():
        share = "-" if f["share_matched"] is None else f"{f['share_matched']:.1%}"
        lines.append(f"{name:10s} {f['identical']:>4d} of {f['num_prompts']:<3d} {share:>15s} "
                     f"{f['mean_common_prefix']:12.1f} {f['output_tokens']:7d} {f['build_s']:8.2f} "
                     f"{f['decode_s']:9.2f}")
    return "\n".join(lines)
