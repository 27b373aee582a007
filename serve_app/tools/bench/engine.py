"""``bench engine``: the embedded engine's throughput and latency per num_steps and concurrency.

Closed-loop clients: at concurrency c, c clients each send the next prompt as soon as their
previous request finishes, all against one engine that is started once and switched
between points with ``set_num_steps``. Generation is greedy and stops at the model's end of
turn (or ``max_tokens``); greedy output does not depend on num_steps, so every point of a
prompt set produces the same tokens. ``--ignore-eos`` makes every request run to max_tokens. Points at one concurrency run back to back
for every num_steps, so the ratios between them see the same machine load.

Two baselines (``--baseline``): Hugging Face transformers on the same weights and rendered
prompts (``hf_baseline``, the default), and llama.cpp's ``llama-server`` on the same GGUF
file (``llamacpp_baseline``; see llamacpp.py). transformers pairs are measured interleaved,
chunk by chunk (one prompt at batch 1, 16 prompts at batch 16): the engine's chunk, then
transformers' same chunk, so noise from other work on the machine lands on both sides alike.
llama.cpp takes its place in the grid instead: at each concurrency, after the engine's
num_steps, the same closed loop over HTTP (the project's streaming client, greedy, the same
prompts as chat messages: llama-server renders them with the GGUF's template, and its prompt
token counts are checked against the engine's) with as many slots as clients and no prompt
cache (the engine has none). ``--rounds N`` splits every concurrency's requests into N rounds
in mirrored order (k=0, k=3, llama.cpp, llama.cpp, k=3, k=0, ...) so that drift lands on
every side alike. ``llama-bench`` (token generation alone, 1 and all threads) runs at the end.

One file past 300 lines: the engine's run and its baselines share its prompts, chunks and
rows.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import re
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime

from tqdm import tqdm

from serve_app.engines.base import GenerateRequest, SamplingParams
from serve_app.engines.embedded.config import DRAFTERS
from serve_app.engines.embedded.weights import DEFAULT_MODEL, TINY_MODEL

from . import llamacpp
from .client import Target
from .prompts import PROMPT_SETS, chat_messages
from .stats import RequestTiming, acceptance, crossover, emit, summarize

HELP = "throughput and latency of the embedded engine per num_steps and concurrency"
HF_BATCH = 16  # the static batch of the batched transformers baseline
HF_PLD_TOKENS = 5  # prompt_lookup_num_tokens of the transformers lookup baseline
BASELINES = ("hf", "llamacpp")
LLAMACPP = "llamacpp"  # the llama.cpp side of a grid cell, next to the engine's num_steps


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo with its widest vector unit and its
    vendor-family-model, e.g. "AMD EPYC (avx2, amd-23-49)" (None elsewhere). The machine these
    benchmarks run on has come up on different hosts (AMD EPYCs with and without AVX512, an
    Intel Xeon), whose speeds differ and whose kernels differ with the vector unit: results
    record which."""
    from serve_app.engines import cpu_id

    name, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return None
    for line in info.splitlines():
        if line.startswith("model name") and name is None:
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    if name is None:
        return None
    unit = next((unit for flag, unit in (("avx512f", "avx512"), ("avx2", "avx2")) if flag in flags), None)
    details = ", ".join(x for x in (unit, cpu_id(info)) if x)
    return f"{name} ({details})" if details else name


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def _prompt_sets(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROMPT_SETS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"prompt sets are {', '.join(PROMPT_SETS)}; got {text!r}")
    return names


def _baselines(text: str) -> list[str]:
    names = {"both": list(BASELINES), "none": []}.get(text.strip())
    if names is None:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names or any(n not in BASELINES for n in names):
            raise argparse.ArgumentTypeError(f"baselines are hf, llamacpp, both or none; got {text!r}")
    return list(dict.fromkeys(names))


def _weight_formats(text: str) -> list[str]:
    from serve_app.engines.embedded.linear import WEIGHT_FORMATS

    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or set(names) - set(WEIGHT_FORMATS) or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"weight formats are {', '.join(WEIGHT_FORMATS)}; got {text!r}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"engine model (default {DEFAULT_MODEL})")
    p.add_argument("--prompt-set", type=_prompt_sets, default=list(PROMPT_SETS),
                   help="comma list of prompt sets: copy, chat (default both)")
    p.add_argument("--concurrency", type=_int_list, default=[1, 2, 4, 8, 16, 32], help="comma list")
    p.add_argument("--num-steps", type=_int_list, default=[0, 3, 5], help="comma list of speculation depths")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (exact)")
    p.add_argument("--requests-per-point", type=int, default=None,
                   help="requests per point (default max(2 x concurrency, 8))")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests per num_steps before the grid")
    p.add_argument("--drafter", choices=DRAFTERS, default="ngram", help="the engine's drafter (default ngram)")
    p.add_argument("--draft-head", default=None, help="with --drafter eagle or hybrid: a head's .safetensors (default: the shipped one)")
    p.add_argument("--weights", type=_weight_formats, default=["float32"],
                   help="comma list of weight formats, one engine each, measured side by side point by point; "
                        "crossover and the HF pairs use the first (default float32)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads for engine and HF (default torch's)")
    p.add_argument("--baseline", type=_baselines, default=["hf"],
                   help="what the engine is measured against: hf (transformers on the same weights), llamacpp "
                        "(llama-server on the same GGUF, built once if absent), both, or none (default hf)")
    p.add_argument("--no-hf", action="store_true", help="leave transformers out of --baseline")
    p.add_argument("--rounds", type=int, default=1,
                   help="split each concurrency's requests into this many rounds in mirrored order (default 1)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly max_tokens per request (the model's continuation past its end of turn)")
    p.add_argument("--hf-max-tokens", type=int, default=None, help="output tokens in the HF pairs (default --max-tokens)")
    p.add_argument("--hf-prompts", type=int, default=8, help="prompts of the batch-1 HF pairs")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")


def run(args: argparse.Namespace) -> int:
    global IGNORE_EOS
    IGNORE_EOS = args.ignore_eos
    if args.max_tokens < 1 or (args.hf_max_tokens is not None and args.hf_max_tokens < 1):
        sys.exit("max tokens must be positive")
    if args.requests_per_point is not None and args.requests_per_point < max(args.concurrency):
        sys.exit("--requests-per-point must be at least the largest concurrency")
    if 0 in args.concurrency:
        sys.exit("concurrency must be positive")
    if args.rounds < 1:
        sys.exit("--rounds must be at least 1")
    args.baseline = [b for b in args.baseline if not (b == "hf" and args.no_hf)]
    if LLAMACPP in args.baseline and args.model != DEFAULT_MODEL:
        sys.exit(f"the llama.cpp baseline runs the GGUF of {DEFAULT_MODEL}; --model {args.model} has none")
    result = asyncio.run(benchmark(args))
    return emit(result, format_report(result), args.out)


# -- one point --------------------------------------------------------------------------
_request_ids = itertools.count()


IGNORE_EOS = False  # set from --ignore-eos for the whole run


async def timed_request(engine, prompt: str, max_tokens: int, params: SamplingParams | None = None) -> RequestTiming:
    """Send one request (greedy unless ``params`` say otherwise) and time its token deltas from
    submission."""
    if params is None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=IGNORE_EOS)
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async for delta in engine.generate(GenerateRequest(f"bench-{next(_request_ids)}", prompt=prompt, params=params)):
        if delta.token_ids:
            last = time.perf_counter() - t0
            first = last if first is None else first
            tokens += len(delta.token_ids)
    return RequestTiming(tokens, first if first is not None else float("nan"), last if last is not None else float("nan"))


@dataclass(slots=True)
class Tally:
    """What a point's chunks add up to: request timings, wall time, draft counters."""

    timings: list[RequestTiming] = field(default_factory=list)
    wall_s: float = 0.0
    drafts: Counter = field(default_factory=Counter)

    def row(self) -> dict:
        return summarize(self.timings, self.wall_s) | acceptance(Counter(), self.drafts)


async def closed_loop(send: Callable[[int], Awaitable[RequestTiming]], concurrency: int, indices: range,
                      progress: tqdm | None, tally: Tally) -> Tally:
    """``concurrency`` clients share requests ``indices``: a client sends the next as soon as
    its last one ends."""
    todo = iter(indices)

    async def client() -> None:
        for i in todo:
            tally.timings.append(await send(i))
            if progress is not None:
                progress.update(1)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    tally.wall_s += time.perf_counter() - t0
    return tally


async def run_point(engine, prompts: list[str], concurrency: int, num_requests: int, max_tokens: int,
                    progress: tqdm | None = None, tally: Tally | None = None, first: int = 0) -> Tally:
    """Requests first..first+n-1 (prompt i mod len) in a closed loop, added to ``tally``."""
    tally = tally if tally is not None else Tally()
    before = dict(engine.core.totals)
    await closed_loop(lambda i: timed_request(engine, prompts[i % len(prompts)], max_tokens), concurrency,
                      range(first, first + num_requests), progress, tally)
    # The final delta is emitted before its step adds to the draft counters; the step is
    # done once the scheduler has dropped its finished sequences.
    while engine.core.has_work():
        await asyncio.sleep(0.001)
    tally.drafts.update({k: engine.core.totals[k] - before[k] for k in ("proposed", "accepted", "verifies")})
    return tally


# -- the transformers baseline ----------------------------------------------------------
def load_hf_model(model: str):
    """The engine's weights as a transformers model (float32, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from serve_app.engines.embedded.weights import load_model, resolve_model_dir

    if model != TINY_MODEL:
        return AutoModelForCausalLM.from_pretrained(resolve_model_dir(model), dtype=torch.float32).eval()
    # tiny-random has no checkpoint: put the very weights the engine builds into transformers' Llama.
    loaded = load_model(TINY_MODEL)
    s = loaded.shape
    cfg = LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                      num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
                      num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim, rms_norm_eps=s.rms_norm_eps,
                      rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta},
                      max_position_embeddings=s.max_position_embeddings, tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg)
    hf.load_state_dict(loaded.state_dict, strict=True)
    return hf.to(torch.float32).eval()


class HFBaseline:
    """Greedy ``generate()``, timed; stops where the engine stops (end of turn or max_tokens)."""

    def __init__(self, model: str, tokenizer):
        self.model = load_hf_model(model)
        self.tokenizer = tokenizer
        self.eos_ids = {tokenizer.eos_token_id}
        self.generate([PROMPT_SETS["chat"][0]], 4)  # warm up; first calls pay one-off costs

    def generate(self, prompts: list[str], max_tokens: int, prompt_lookup: int | None = None) -> tuple[int, float]:
        """(new tokens, seconds) for one left-padded batch of rendered prompts."""
        import torch

        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        kwargs = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
        if IGNORE_EOS:
            kwargs["min_new_tokens"] = max_tokens
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(**enc, do_sample=False, max_new_tokens=max_tokens,
                                      pad_token_id=self.tokenizer.pad_token_id, **kwargs)
        seconds = time.perf_counter() - t0
        new = out[:, enc.input_ids.shape[1]:]
        if IGNORE_EOS:
            assert new.shape[1] == max_tokens, "transformers stopped early: the pair would be unfair"
            return new.numel(), seconds
        # Count each row up to and including its end of turn, as the engine counts.
        eos = torch.tensor(sorted(self.eos_ids))
        tokens = 0
        for row in new:
            hits = torch.isin(row, eos).nonzero()
            tokens += int(hits[0]) + 1 if len(hits) else len(row)
        return tokens, seconds


async def measure_pair(engine, hf: HFBaseline, prompts: list[str], batch: int, num_steps: int, max_tokens: int,
                       prompt_lookup: int | None, progress: tqdm) -> tuple[float, float]:
    """(engine tokens/s, HF tokens/s) over the same prompts, interleaved chunk by chunk."""
    await engine.set_num_steps(num_steps)
    engine_tokens = engine_s = hf_tokens = hf_s = 0.0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        point = await run_point(engine, chunk, len(chunk), len(chunk), max_tokens)
        engine_tokens += sum(t.output_tokens for t in point.timings)
        engine_s += point.wall_s
        tokens, seconds = hf.generate(chunk, max_tokens, prompt_lookup)
        hf_tokens, hf_s = hf_tokens + tokens, hf_s + seconds
        progress.update(2 * len(chunk))
    return round(engine_tokens / engine_s, 3), round(hf_tokens / hf_s, 3)


async def hf_pairs(engine, rendered: dict[str, list[str]], args, progress: tqdm) -> dict:
    hf = HFBaseline(args.model, engine.tokenizer)
    n, max_tokens = args.hf_prompts, args.hf_max_tokens or args.max_tokens
    common = {"max_tokens": max_tokens}
    engine_tps, hf_tps = await measure_pair(engine, hf, rendered["chat"][:n], 1, 0, max_tokens, None, progress)
    plain = common | {"prompt_set": "chat", "num_prompts": n, "batch": 1, "num_steps": 0,
                      "hf_tokens_per_s": hf_tps, "engine_tokens_per_s": engine_tps}
    engine_tps, hf_tps = await measure_pair(engine, hf, rendered["copy"][:n], 1, 5, max_tokens, HF_PLD_TOKENS, progress)
    pld = common | {"prompt_set": "copy", "num_prompts": n, "batch": 1, "num_steps": 5,
                    "prompt_lookup_num_tokens": HF_PLD_TOKENS,
                    "hf_pld_tokens_per_s": hf_tps, "engine_spec_tokens_per_s": engine_tps}
    engine_tps, hf_tps = await measure_pair(engine, hf, rendered["chat"][:HF_BATCH], HF_BATCH, 0, max_tokens, None,
                                            progress)
    batched = common | {"prompt_set": "chat", "num_prompts": HF_BATCH, "batch": HF_BATCH, "num_steps": 0,
                        "hf_batch16_tokens_per_s": hf_tps, "engine_c16_tokens_per_s": engine_tps}
    return {"plain_batch1": plain, "pld_batch1": pld, "batch16": batched}


# -- the llama.cpp baseline --------------------------------------------------------------
class LlamaCppSide:
    """llama-server on the engine's GGUF, driven over HTTP like the serving benchmarks drive
    specserve."""

    def __init__(self, args, threads: int, tokenize: Callable[[str], list[int]], rendered: dict[str, list[str]]):
        from serve_app.engines.embedded.weights import smollm2_gguf_path

        self.binaries = llamacpp.ensure_binaries()
        self.gguf = smollm2_gguf_path()
        self.threads, self.slots = threads, max(args.concurrency)
        self.prompt_tokens = {name: [len(tokenize(r)) for r in rendered[name]] for name in args.prompt_set}
        self.ctx_per_slot = llamacpp.slot_context(max(max(n) for n in self.prompt_tokens.values()), args.max_tokens)
        self.target: Target | None = None
        self.token_check: dict = {}

    def server(self):
        return llamacpp.llama_server(self.binaries, self.gguf, self.threads, self.slots, self.ctx_per_slot)

    async def start(self, url: str) -> None:
        self.target = Target(url, None)
        self.target.extra_body = {"cache_prompt": False}  # every request prefills its whole prompt, as in the engine
        await self.target.start()
        for name, counts in self.prompt_tokens.items():
            self.token_check[name] = await self._check_prompt_tokens(PROMPT_SETS[name], counts)

    async def _check_prompt_tokens(self, prompts: list[str], engine_counts: list[int]) -> dict:
        """llama-server renders the chat template itself: the two sides prefill the same prompts
        only if its prompt token counts match the engine's. (Also its warm-up.)"""
        counts = [(await self.target.chat(i, chat_messages(p), 1, True)).prompt_tokens for i, p in enumerate(prompts)]
        mismatched = [i for i, (a, b) in enumerate(zip(counts, engine_counts, strict=True)) if a != b]
        if mismatched:
            print(f"warning: llama-server's prompt token counts differ from the engine's on prompts {mismatched}",
                  file=sys.stderr)
        return {"prompts": len(counts), "mismatched": mismatched, "engine_prompt_tokens": sum(engine_counts),
                "llamacpp_prompt_tokens": sum(c or 0 for c in counts)}

    async def run_point(self, prompts: list[str], concurrency: int, num_requests: int, max_tokens: int,
                        progress: tqdm, tally: Tally, first: int) -> Tally:
        async def send(i: int) -> RequestTiming:
            rec = await self.target.chat(i, chat_messages(prompts[i % len(prompts)]), max_tokens, IGNORE_EOS)
            if not rec.ok:
                raise RuntimeError(f"llama-server request {i}: {rec.error or 'no output'}")
            return rec.timing

        return await closed_loop(send, concurrency, range(first, first + num_requests), progress, tally)

    def result(self, rows: list[dict], engine_rows: list[dict], max_tokens: int) -> dict:
        return {"version": self.binaries.version(), "binaries": self.binaries.found_in,
                "server": str(self.binaries.server), "gguf": self.gguf.name, "threads": self.threads,
                "slots": self.slots, "ctx_per_slot": self.ctx_per_slot, "cache_prompt": False,
                "prompt_token_check": self.token_check, "rows": rows, "ratios": llamacpp_ratios(engine_rows, rows),
                "llama_bench": llamacpp.llama_bench(self.binaries, self.gguf, sorted({1, self.threads}), max_tokens)}


def llamacpp_ratios(engine_rows: list[dict], llama_rows: list[dict]) -> list[dict]:
    """Per prompt set, concurrency, num_steps and weight format: the engine's figures over llama.cpp's."""
    llama = {(r["prompt_set"], r["concurrency"]): r for r in llama_rows}

    def ratio(a, b):
        return round(a / b, 4) if a is not None and b else None

    return [{"prompt_set": r["prompt_set"], "concurrency": r["concurrency"], "num_steps": r["num_steps"],
             "weights": r.get("weights", "float32")}
            | {f"engine_over_llamacpp_{k}": ratio(r[k], base[k])
               for k in ("output_tokens_per_s", "ttft_p50_ms", "tpot_p50_ms")}
            for r in engine_rows if (base := llama.get((r["prompt_set"], r["concurrency"])))]


# -- the run ----------------------------------------------------------------------------
def _requests(args, concurrency: int) -> int:
    """Requests per round of a point (default: max(2 x concurrency, 8) over all rounds)."""
    return max(concurrency, -(-(args.requests_per_point or max(2 * concurrency, 8)) // args.rounds))


def mirrored(sides: list, rounds: int) -> list[tuple[int, object]]:
    """(round, side) in run order: every round after the first reverses the one before."""
    return [(r, side) for r in range(rounds) for side in (sides if r % 2 == 0 else sides[::-1])]


async def benchmark(args) -> dict:
    """Run the grid (with llama.cpp in it, and the HF pairs) and return the JSON-ready result."""
    import torch

    from serve_app.engines.embedded import EmbeddedEngine, EmbeddedOptions

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    threads = torch.get_num_threads()  # engine and HF share this process's thread pool
    if LLAMACPP in args.baseline:
        llamacpp.ensure_binaries()  # before the engine loads: a build takes minutes, a failure none
    engines = {w: EmbeddedEngine(EmbeddedOptions(model=args.model, num_threads=threads, drafter=args.drafter,
                                                 draft_head=args.draft_head, weights=w,
                                                 max_num_seqs=max(32, HF_BATCH, *args.concurrency),
                                                 max_num_steps=max(8, *args.num_steps)))
               for w in args.weights}
    for engine in engines.values():
        await engine.start()
    engine = engines[args.weights[0]]
    # Every set the pairs need is rendered even when the grid skips it.
    rendered = {name: [engine.apply_chat_template(chat_messages(p)) for p in prompts]
                for name, prompts in PROMPT_SETS.items()}
    llama = LlamaCppSide(args, threads, engine.tokenize, rendered) if LLAMACPP in args.baseline else None
    ours = [(k, w) for k in args.num_steps for w in args.weights]  # each num_steps with each weight format
    sides = [*ours, *([LLAMACPP] if llama else [])]
    per_cell = sum(_requests(args, c) for c in args.concurrency) * args.rounds * len(sides)
    hf_requests = 2 * (2 * args.hf_prompts + HF_BATCH) if "hf" in args.baseline else 0
    rows: list[dict] = []
    llama_rows: list[dict] = []
    baseline = llama_result = None
    try:
        with ExitStack() as stack, tqdm(total=per_cell * len(args.prompt_set) + hf_requests, desc="bench engine",
                                        unit="req", file=sys.stderr) as progress:
            if llama:
                await llama.start(stack.enter_context(llama.server()))
            for each in engines.values():
                for k in args.num_steps:
                    await each.set_num_steps(k)
                    await run_point(each, rendered[args.prompt_set[0]], args.warmup, args.warmup,
                                    min(16, args.max_tokens))
            for prompt_set in args.prompt_set:
                for c in args.concurrency:
                    n = _requests(args, c)
                    tallies = {side: Tally() for side in sides}
                    for r, side in mirrored(sides, args.rounds):  # innermost: the ratios are side by side
                        if side == LLAMACPP:
                            progress.set_postfix_str(f"{prompt_set} c={c} llama.cpp")
                            await llama.run_point(PROMPT_SETS[prompt_set], c, n, args.max_tokens, progress,
                                                  tallies[side], r * n)
                        else:
                            k, w = side
                            progress.set_postfix_str(f"{prompt_set} c={c} k={k} {w}")
                            await engines[w].set_num_steps(k)
                            await run_point(engines[w], rendered[prompt_set], c, n, args.max_tokens, progress,
                                            tallies[side], r * n)
                    rows += [{"prompt_set": prompt_set, "num_steps": k, "concurrency": c, "weights": w}
                             | tallies[(k, w)].row() for k, w in ours]
                    if llama:
                        llama_rows.append({"prompt_set": prompt_set, "concurrency": c}
                                          | summarize(tallies[LLAMACPP].timings, tallies[LLAMACPP].wall_s))
            if "hf" in args.baseline:
                progress.set_postfix_str("hf baseline")
                baseline = await hf_pairs(engine, rendered, args, progress)
            if llama:
                await llama.target.aclose()
    finally:
        for each in engines.values():
            await each.shutdown()
    if llama:  # after the server is gone: llama-bench wants the cores
        llama_result = llama.result(llama_rows, rows, args.max_tokens)
    first = [r for r in rows if r["weights"] == args.weights[0]]
    return {"meta": _meta(args, threads), "rows": rows, "hf_baseline": baseline, "llamacpp_baseline": llama_result,
            "crossover": crossover(first)}


def _meta(args, threads: int) -> dict:
    import torch

    return {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "torch_version": torch.__version__,
        "threads": threads,
        "model": args.model,
        "drafter": args.drafter,
        "weights": args.weights,
        "draft_head": args.draft_head,
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "baselines": args.baseline,
        "rounds": args.rounds,
        "hf_max_tokens": (args.hf_max_tokens or args.max_tokens) if "hf" in args.baseline else None,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],  # other work on the machine, if any
        "command": " ".join(["python -m serve_app.tools.bench", *sys.argv[1:]]),
    }


# -- printing ---------------------------------------------------------------------------
def _f(value, spec: str) -> str:
    width = int(re.match(r"\d*", spec).group() or 0)
    return "-".rjust(width) if value is None else format(value, spec)


def format_report(result: dict) -> str:
    m = result["meta"]
    lines = [f"model {m['model']}, max_tokens {m['max_tokens']}, {m['threads']} torch threads, torch {m['torch_version']}"]
    header = (f"{'steps':>5} {'conc':>4} {'reqs':>4} {'tok/s':>8} {'vs k=0':>6} {'ttft p50':>9} {'ttft p99':>9} "
              f"{'tpot p50':>9} {'tpot p99':>9} {'accept':>6} {'acc len':>7}")
    for prompt_set, w in dict.fromkeys((r["prompt_set"], r.get("weights", "float32")) for r in result["rows"]):
        rows = [r for r in result["rows"] if r["prompt_set"] == prompt_set and r.get("weights", "float32") == w]
        plain = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["num_steps"] == 0}
        lines += ["", f"[{prompt_set}] {w} weights  latencies in ms; 'vs k=0' = tokens/s over num_steps 0 at the same "
                  "concurrency", header]
        for r in sorted(rows, key=lambda r: (r["num_steps"], r["concurrency"])):
            base = plain.get(r["concurrency"])
            ratio = r["output_tokens_per_s"] / base if base else None
            lines.append(f"{r['num_steps']:>5} {r['concurrency']:>4} {r['num_requests']:>4} "
                         f"{_f(r['output_tokens_per_s'], '8.1f')} {_f(ratio, '6.2f')} "
                         f"{_f(r['ttft_p50_ms'], '9.1f')} {_f(r['ttft_p99_ms'], '9.1f')} "
                         f"{_f(r['tpot_p50_ms'], '9.1f')} {_f(r['tpot_p99_ms'], '9.1f')} "
                         f"{_f(r['accept_rate'], '6.2f')} {_f(r['mean_accepted_len'], '7.2f')}")
        cross = result["crossover"].get(prompt_set) if w == m.get("weights", ["float32"])[0] else None
        if cross:
            by_k = ", ".join(f"num_steps {k}: {_f(c, 'd') if c else 'none'}" for k, c in cross["by_num_steps"].items())
            best = cross["best"] if cross["best"] is not None else "none (speculation won everywhere)"
            lines.append(f"crossover (lowest concurrency where speculation no longer wins): {by_k}; best: {best}")
    hf = result["hf_baseline"]
    if hf:
        lines += ["", f"[hf_baseline]  same weights and prompts, {m['hf_max_tokens']} tokens, interleaved",
                  f"{'pair':<48} {'hf tok/s':>9} {'engine tok/s':>12} {'engine/hf':>9}"]
        pairs = [("generate(), batch 1, chat  vs  k=0 c=1", hf["plain_batch1"], "hf_tokens_per_s", "engine_tokens_per_s"),
                 ("generate(pld=5), batch 1, copy  vs  k=5 c=1", hf["pld_batch1"], "hf_pld_tokens_per_s",
                  "engine_spec_tokens_per_s"),
                 ("generate(), static batch 16, chat  vs  k=0 c=16", hf["batch16"], "hf_batch16_tokens_per_s",
                  "engine_c16_tokens_per_s")]
        for name, pair, hf_key, engine_key in pairs:
            lines.append(f"{name:<48} {pair[hf_key]:>9.1f} {pair[engine_key]:>12.1f} "
                         f"{pair[engine_key] / pair[hf_key]:>9.2f}")
    if result.get("llamacpp_baseline"):
        lines += ["", *format_llamacpp(result)]
    return "\n".join(lines)


def format_llamacpp(result: dict) -> list[str]:
    lc = result["llamacpp_baseline"]
    lines = [f"[llamacpp_baseline]  llama-server {lc['version']} on {lc['gguf']}, {lc['threads']} threads, "
             f"{lc['slots']} slots x {lc['ctx_per_slot']} tokens, no prompt cache, over HTTP; latencies in ms; "
             "'vs llama.cpp' = engine tokens/s over llama.cpp's",
             f"{'set':>5} {'conc':>4} {'side':>14} {'tok/s':>8} {'vs llama.cpp':>12} {'ttft p50':>9} {'ttft p99':>9} "
             f"{'tpot p50':>9} {'tpot p99':>9}"]
    ratios = {(x["prompt_set"], x["concurrency"], x["num_steps"], x.get("weights", "float32")):
              x["engine_over_llamacpp_output_tokens_per_s"] for x in lc["ratios"]}
    for base in lc["rows"]:
        cell = (base["prompt_set"], base["concurrency"])
        engine_rows = [r for r in result["rows"] if (r["prompt_set"], r["concurrency"]) == cell]
        for name, r in [("llama.cpp", base), *((f"k={r['num_steps']} {r.get('weights', 'float32')}", r)
                                                for r in engine_rows)]:
            ratio = ratios.get((*cell, r["num_steps"], r.get("weights", "float32"))) if name != "llama.cpp" else None
            lines.append(f"{cell[0]:>5} {cell[1]:>4} {name:>14} {_f(r['output_tokens_per_s'], '8.1f')} "
                         f"{_f(ratio, '12.2f')} {_f(r['ttft_p50_ms'], '9.1f')} {_f(r['ttft_p99_ms'], '9.1f')} "
                         f"{_f(r['tpot_p50_ms'], '9.1f')} {_f(r['tpot_p99_ms'], '9.1f')}")
    bench = ", ".join(f"{b['threads']} thread{'s' if b['threads'] > 1 else ''} {b['tokens_per_s']:.1f} tok/s"
                      for b in lc["llama_bench"])
    lines.append(f"llama-bench tg{lc['llama_bench'][0]['n_gen'] if lc['llama_bench'] else '?'} (batch 1, no prompt): {bench}")
    for name, check in lc["prompt_token_check"].items():
        lines.append(f"prompt tokens [{name}]: llama-server {check['llamacpp_prompt_tokens']}, engine "
                     f"{check['engine_prompt_tokens']} over {check['prompts']} prompts; mismatched: "
                     f"{check['mismatched'] or 'none'}")
    return lines
