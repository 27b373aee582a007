"""``bench efficiency``: tokens/s through the serving stack against the engines it runs, alone.

The stack's share of its engines' speed. For each concurrency c and each policy (``spec``: the
ladder's top tier, ``off``: num_steps 0), two windows side by side:

- **engines**: as many engine processes as the config has replicas, each built from the
  config's engine options (weights, threads, max_num_seqs: what a replica builds), all at once
  on this machine, each with c / replicas closed-loop clients calling the engine in-process
  (no Ray, no HTTP); their tokens/s summed;
- **stack**: the config's application brought up on a local Ray (``serve run`` of it, HTTP
  streaming through Serve's proxy, the ingress and the replicas), with c closed-loop streaming
  HTTP clients, the mode pinned through ``PUT /v1/speculation``.

Both sides run the same window (``bench serve``'s: greedy chat requests, prompts 0, 1, 2, ...
in the measured window, ``--settle-s`` of warm-up, ``--measure-s`` measured) and count the
same thing: output tokens delivered in the window. The engine processes stay up, idle, while
the stack runs, and the stack idles while they run, so each side has the machine to itself.
``--repeats N`` alternates N windows a side per point (engines, stack, stack, engines, ...).
The stack's side reads ``GET /v1/speculation`` once a second, to report the mode it ran.
Efficiency is the stack's tokens/s over the engines'; a row per (concurrency, policy), with
``efficiency_ci95``, its 95 % interval from the windows paired by repeat (``--repeats`` >= 2).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing as mp
import sys
import time

from tqdm import tqdm

from .client import (
    Poller,
    Record,
    Target,
    add_target_arguments,
    prompt_messages,
    run_against_target,
    sampling_for,
    with_overrides,
)
from .engine import _int_list
from .serve import measure_window, meta, point_row, policy_list, spec_steps_of
from .stats import emit, paired_ratio_ci

HELP = "tokens/s through the serving stack over its engines' own, side by side"
POLICIES = ("spec", "off")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_arguments(p)
    p.add_argument("--concurrency", type=_int_list, default=[2, 8, 32],
                   help="comma list; each a multiple of the replicas (default 2,8,32)")
    p.add_argument("--policies", type=policy_list(POLICIES), default=list(POLICIES),
                   help="comma list of spec, off (default both)")
    p.add_argument("--settle-s", type=float, default=8.0, help="unmeasured seconds at the start of a window (default 8)")
    p.add_argument("--measure-s", type=float, default=12.0, help="measured seconds of a window (default 12)")
    p.add_argument("--repeats", type=int, default=1, help="windows a side per point, alternating (default 1)")
    p.add_argument("--spec-steps", type=int, default=None, help="num_steps of 'spec' (default: the ladder's top tier)")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")


class _NoPoller:
    """An engine has no operator API: its windows report no switches."""

    def __init__(self, num_steps: int):
        self.num_steps = num_steps

    def summary(self, t0: float, t1: float) -> dict:
        return {"switches": 0, "mean_load_per_replica": None, "mode_share": {str(self.num_steps): 1.0}}


class EngineTarget:
    """``Target.chat`` against an engine in this process: the same record, timed per delta."""

    def __init__(self, engine, sampled_every: int = 0):
        self.engine = engine
        self.sampled_every = sampled_every  # see client.sampling_for
        self._ids = itertools.count()

    async def chat(self, prompt_index: int, messages: list[dict], max_tokens: int, ignore_eos: bool) -> Record:
        from serve_app.engines.base import GenerateRequest, SamplingParams

        rec = Record(time.perf_counter(), prompt_index)
        temperature, seed = sampling_for(prompt_index, self.sampled_every)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=1.0, seed=seed,
                                ignore_eos=ignore_eos)
        request = GenerateRequest(f"efficiency-{next(self._ids)}", prompt=self.engine.apply_chat_template(messages),
                                  params=params)
        try:
            async for delta in self.engine.generate(request):
                if delta.token_ids:
                    rec.chunk_times.append(time.perf_counter())
                    rec.output_tokens += len(delta.token_ids)
        except Exception as e:  # noqa: BLE001 - a failed request is counted, as over HTTP
            rec.error = repr(e)
        return rec


def engine_worker(options: dict, conn, sampled_every: int = 0) -> None:
    """One engine process: build the engine, then run each window the parent sends."""
    asyncio.run(_serve_windows(options, conn, sampled_every))


async def _serve_windows(options: dict, conn, sampled_every: int) -> None:
    from serve_app.engines.embedded import EmbeddedEngine
    from serve_app.engines.embedded.config import EmbeddedOptions

    engine = EmbeddedEngine(EmbeddedOptions.model_validate(options))
    await engine.start()
    target = EngineTarget(engine, sampled_every)
    conn.send("ready")
    while (job := await asyncio.to_thread(conn.recv)) is not None:
        num_steps, prompts, concurrency, settle_s, measure_s, max_tokens, ignore_eos = job
        await engine.set_num_steps(num_steps)
        w = await measure_window(target, _NoPoller(num_steps), prompts, concurrency, settle_s, measure_s,
                                 max_tokens, ignore_eos)
        conn.send(w)
    await engine.shutdown()


class Engines:
    """``n`` engine processes built from ``options``, run together window by window."""

    def __init__(self, options: dict, n: int, sampled_every: int = 0):
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=engine_worker, args=(options, child, sampled_every), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        for pipe, proc in zip(self.pipes, self.procs, strict=True):
            if not pipe.poll(600) or pipe.recv() != "ready":
                raise RuntimeError(f"engine process {proc.pid} did not start")

    def window(self, num_steps: int, prompts, concurrency: int, settle_s: float, measure_s: float,
               max_tokens: int, ignore_eos: bool) -> list:
        """Each engine's window at ``concurrency`` / n clients, all at once."""
        each = concurrency // len(self.pipes)
        for pipe in self.pipes:
            pipe.send((num_steps, prompts, each, settle_s, measure_s, max_tokens, ignore_eos))
        return [pipe.recv() for pipe in self.pipes]

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def engine_row(windows_per_engine: list[list]) -> dict:
    """The engines' side of a point: each engine's windows pooled, their tokens/s summed (and
    summed window by window: the engines ran each window together)."""
    rows = [point_row(ws) for ws in windows_per_engine]
    return {"output_tokens_per_s": round(sum(r["output_tokens_per_s"] for r in rows), 3),
            "window_tokens_per_s": [round(sum(w), 3) for w in zip(*(r["window_tokens_per_s"] for r in rows),
                                                                   strict=True)],
            "per_engine_tokens_per_s": [r["output_tokens_per_s"] for r in rows],
            "tpot_p50_ms": [r["tpot_p50_ms"] for r in rows], "errors": sum(r["errors"] for r in rows)}


async def measure(target: Target, engines: Engines, args: argparse.Namespace, replicas: int) -> dict:
    spec_steps, status = await spec_steps_of(target, args.spec_steps)
    prompts = prompt_messages(args.prompt_set.split(","))
    rows = []
    sides = [s for r in range(args.repeats) for s in (("engines", "stack") if r % 2 == 0 else ("stack", "engines"))]
    # Once a second: a poll costs the stack ~8 ms of CPU, which its engines' side does not pay.
    async with Poller(target, every_s=1.0) as poller:
        await asyncio.gather(*(target.chat(i, prompts[i], 8, True) for i in range(2)))
        with tqdm(total=len(args.concurrency) * len(args.policies) * len(sides), desc="bench efficiency",
                  unit="window", file=sys.stderr) as bar:
            for c in args.concurrency:
                for policy in args.policies:
                    k = spec_steps if policy == "spec" else 0
                    await target.apply_policy(policy, spec_steps)
                    engine_windows: list[list] = [[] for _ in range(replicas)]
                    stack_windows = []
                    for side in sides:
                        bar.set_postfix_str(f"c={c} {policy} {side}")
                        if side == "engines":
                            ws = await asyncio.to_thread(engines.window, k, prompts, c, args.settle_s, args.measure_s,
                                                         args.max_tokens, args.ignore_eos)
                            for mine, w in zip(engine_windows, ws, strict=True):
                                mine.append(w)
                        else:
                            stack_windows.append(await measure_window(target, poller, prompts, c, args.settle_s,
                                                                      args.measure_s, args.max_tokens, args.ignore_eos))
                        bar.update(1)
                    stack = point_row(stack_windows)
                    eng = engine_row(engine_windows)
                    rows.append({"concurrency": c, "policy": policy, "num_steps": k,
                                 "stack_tokens_per_s": stack["output_tokens_per_s"],
                                 "engines_tokens_per_s": eng["output_tokens_per_s"],
                                 "efficiency": round(stack["output_tokens_per_s"] / eng["output_tokens_per_s"], 4)
                                 if eng["output_tokens_per_s"] else None,
                                 "efficiency_ci95": paired_ratio_ci(stack["window_tokens_per_s"],
                                                                    eng["window_tokens_per_s"]),
                                 "stack": stack, "engines": eng})
        await target.restore(status)
    return {"meta": meta(args, target, status, spec_steps) | {
        "repeats": args.repeats, "settle_s": args.settle_s, "measure_s": args.measure_s,
        "engines": f"{replicas} processes, each the config's engine, c/{replicas} clients each"}, "rows": rows}


def format_table(result: dict) -> str:
    m = result["meta"]
    lines = [f"bench efficiency: {m['config']}, {m['replicas']} replicas, {m['prompt_set']} prompts, "
             f"max_tokens {m['max_tokens']}, spec = {m['spec_steps']} steps",
             f"{'clients':>7} {'policy':>6} {'stack tok/s':>11} {'engines tok/s':>13} {'efficiency':>10}  "
             "95 % interval (windows paired by repeat)"]
    for r in result["rows"]:
        eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        ci = r.get("efficiency_ci95")
        lines.append(f"{r['concurrency']:>7} {r['policy']:>6} {r['stack_tokens_per_s']:>11.1f} "
                     f"{r['engines_tokens_per_s']:>13.1f} {eff:>10}  " + (f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-"))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from serve_app.serving.config import AppArgs, read_serve_config

    if args.url:
        sys.exit("bench efficiency builds the config's engines itself: give --config, not --url")
    if args.repeats < 1 or args.settle_s < 0 or args.measure_s <= 0:
        sys.exit("--repeats must be >= 1, --settle-s >= 0 and --measure-s > 0")
    app = AppArgs.model_validate(with_overrides(read_serve_config(args.config)[1], args.overrides))
    engine, replicas = app.engine, app.num_replicas
    if engine.backend != "embedded":
        sys.exit(f"{args.config} runs the {engine.backend} backend; bench efficiency builds embedded engines")
    if app.autoscaling_config is not None:
        sys.exit(f"{args.config} autoscales its replicas; bench efficiency needs a fixed num_replicas")
    bad = [c for c in args.concurrency if c < replicas or c % replicas]
    if bad:
        sys.exit(f"--concurrency must be multiples of the {replicas} replicas; got {bad}")
    engines = Engines(engine.options.model_dump(), replicas, args.sampled_every)
    try:
        result = run_against_target(args, lambda target: measure(target, engines, args, replicas))
    finally:
        engines.close()
    return emit(result, format_table(result), args.out)
