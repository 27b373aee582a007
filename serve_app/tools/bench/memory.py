"""``bench memory``: the resident memory of one replica's engine, idle, under load and after.

Builds the embedded engine a serve config describes (``configs/local.yaml`` by default),
in this process as a replica does, and reads this process's RSS: once started and idle,
every 0.2 s while ``--concurrency`` greedy requests of exactly ``--max-tokens`` tokens run
at once (the peak), and ``--settle-s`` after they finish. The KV cache's bound (the bytes
it may hold written) comes alongside each figure; the result prints as a table, then as one
line of JSON. A replica also imports Ray and Serve: ``--with-ray`` imports them first, to
count them too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import psutil

from serve_app.engines.base import SamplingParams

from .engine import timed_request
from .prompts import PROMPT_SETS, chat_messages
from .stats import emit

HELP = "RSS of one replica's embedded engine: idle, under concurrent requests, after"
MIB = 2**20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/local.yaml", help="serve config whose embedded engine to build")
    p.add_argument("--concurrency", type=int, default=32, help="requests running at once (default 32)")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per request, exact (default 256)")
    p.add_argument("--num-steps", type=int, default=0, help="draft steps while loaded (default 0)")
    p.add_argument("--settle-s", type=float, default=1.0, help="wait before reading RSS after the load (default 1)")
    p.add_argument("--with-ray", action="store_true", help="import ray and serve first, as a replica has")
    p.add_argument("--out", default=None, help="write the JSON result here too")


def run(args: argparse.Namespace) -> int:
    if args.concurrency < 1 or args.max_tokens < 1:
        raise SystemExit("concurrency and max tokens must be positive")
    if args.with_ray:
        import ray.serve  # noqa: F401
    result = asyncio.run(measure(args))
    return emit(result, format_report(result) + "\n" + json.dumps(result), args.out)


def _options(path: str):
    from serve_app.engines.config import EngineConfig
    from serve_app.serving.config import read_serve_config

    engine = EngineConfig.model_validate(read_serve_config(path)[1].get("engine") or {})
    if engine.backend != "embedded":
        raise SystemExit(f"{path} runs the {engine.backend} backend; bench memory measures the embedded engine")
    return engine.options


async def measure(args) -> dict:
    from serve_app.engines.embedded import EmbeddedEngine

    options = _options(args.config)
    if args.concurrency > options.max_num_seqs:
        raise SystemExit(f"--concurrency {args.concurrency} exceeds the engine's max_num_seqs {options.max_num_seqs}")
    proc = psutil.Process()
    engine = EmbeddedEngine(options)

    def reading() -> dict:
        return {"rss_mib": round(proc.memory_info().rss / MIB, 1),
                "kv_cache_mib": round(engine.core.cache.nbytes() / MIB, 1)}

    started = time.perf_counter()
    await engine.start()
    load_s = time.perf_counter() - started
    idle = reading()
    prompts = [engine.apply_chat_template(chat_messages(p)) for p in PROMPT_SETS["chat"]]
    await engine.set_num_steps(args.num_steps)
    async def one(prompt: str) -> int:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        return (await timed_request(engine, prompt, args.max_tokens, params)).output_tokens

    peak = dict(idle)
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            now = reading()
            if now["rss_mib"] > peak["rss_mib"]:
                peak.update(now)
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(one(prompts[i % len(prompts)]) for i in range(args.concurrency)))
    wall = time.perf_counter() - t0
    done.set()
    await sampler
    await asyncio.sleep(args.settle_s)
    after = reading()
    await engine.shutdown()
    return {
        "config": args.config, "model": options.model, "drafter": options.drafter, "dtype": options.dtype,
        "weights": options.weights, "max_num_seqs": options.max_num_seqs, "max_model_len": options.max_model_len,
        "num_threads": options.num_threads, "with_ray": args.with_ray, "load_s": round(load_s, 1),
        "concurrency": args.concurrency, "max_tokens": args.max_tokens, "num_steps": args.num_steps,
        "output_tokens": sum(tokens), "loaded_s": round(wall, 1),
        "idle": idle, "loaded_peak": peak, "after": after,
    }


def format_report(r: dict) -> str:
    rows = [("idle", r["idle"]), (f"{r['concurrency']} x {r['max_tokens']} tokens (peak)", r["loaded_peak"]),
            (f"after ({r['loaded_s']} s of load)", r["after"])]
    lines = [f"{r['model']} ({r['dtype']}, {r['drafter']}), max_num_seqs {r['max_num_seqs']}, "
             f"max_model_len {r['max_model_len']}", f"{'':32s} {'RSS MiB':>9s} {'KV cache MiB':>13s}"]
    lines += [f"{name:32s} {v['rss_mib']:9.1f} {v['kv_cache_mib']:13.1f}" for name, v in rows]
    return "\n".join(lines)
