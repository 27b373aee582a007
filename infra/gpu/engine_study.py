"""Engine-level study of the SGLang backend on one GPU: lossless greedy output and the speed of
each step count, against a plain SGLang engine (no speculation) in the same harness.

    python infra/gpu/engine_study.py --model DIR --draft DIR --out engine.json [--deadline-s 540]

Each engine runs in its own process (``probe``), one after another, so that a variant's
environment and GPU memory never leak into the next:

- ``plain``: ``sglang.Engine`` without speculation, the control. Greedy outputs three times
  (cold, again with its prefix cache warm, after ``flush_cache()``) and once request by request,
  with the top-2 logprobs at every position (the margin where another path first differs).
- ``spec``: the specserve engine (``SGLangEngine``: EAGLE-3, ``--speculative-adaptive``,
  candidate steps [0, 1, 3], the plugin's commanded steps). Greedy outputs at steps 3, 3 again,
  0, 1, switched every 20 ms, and 3 after the round trip, each after ``flush_cache()``.
- ``spec-skip-extend``: as ``spec`` with ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1``
  (steps 0 runs no draft-extend; the draft goes cold).
- ``plain-no-overlap``: the plain engine with ``disable_overlap_schedule``: how much of the plain
  engine's speed is its CPU/GPU overlap, which the speculative worker does not get.
- ``spec-adaptive``: the specserve engine with ``step_policy: adaptive`` (the command is a
  ceiling; SGLang's own acceptance-EMA policy picks under it per batch-size slot,
  ``ADAPTIVE_SLOTS``). Greedy outputs at ceiling 3, and while the policy toggles between fixed
  and adaptive every 20 ms; speeds at ceiling 3 fixed, ceiling 3 adaptive and 0, side by side
  in one engine (``set_step_policy``), in mirrored repeats (``side_by_side``), each with the
  steps its last batch ran.

``--variants`` picks which run (default: the first four).

Speed: output tokens/s of B concurrent greedy requests of 256 tokens each (ignore_eos), for B
in 1, 64, 256, after a warm-up at each B (Triton compiles kernels on first use).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from smoke import PROMPTS  # noqa: E402  (the 8-GPU smoke run's prompts; this folder is on sys.path)

BATCHES = (1, 64, 256)
SPEED_TOKENS = 256
GREEDY_TOKENS = 128
CUDA_GRAPH_BS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
# The trimmed sglang-kernel of infra/gpu/bundle.sh has no FA3/flashinfer attention: Triton
# attention and PyTorch sampling (infra/gpu/README.md).
COMMON = {
    "attention_backend": "triton",
    "sampling_backend": "pytorch",
    "cuda_graph_bs_decode": CUDA_GRAPH_BS,
    "disable_prefill_cuda_graph": True,
    "dtype": "bfloat16",
    "log_level": "info",
}
VARIANTS = ("plain", "spec", "spec-skip-extend", "plain-no-overlap", "spec-adaptive")
# SGLang's batch-size slots for spec-adaptive: small batches pick among 1 and 3 steps, batches of
# 64 and more among 0 and 1, of 256 and more run 0.
ADAPTIVE_SLOTS = {1: [1, 3], 64: [0, 1], 256: [0]}
if os.environ.get("SPECSERVE_ADAPTIVE_SLOTS"):  # JSON {"batch size": [steps]} to try other slots
    ADAPTIVE_SLOTS = {int(k): v for k, v in json.loads(os.environ["SPECSERVE_ADAPTIVE_SLOTS"]).items()}


def prompt_ids(tokenizer) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


async def flush(engine) -> None:
    """Empty the prefix cache. ``Engine.flush_cache()`` runs the tokenizer manager's coroutine on
    the loop the engine was built on; inside a running loop await the coroutine itself."""
    result = await engine.tokenizer_manager.flush_cache()
    if not getattr(result, "success", True):
        raise RuntimeError(f"flush_cache failed: {result}")


async def greedy(engine, ids: list[list[int]], logprobs: bool, one_by_one: bool = False) -> list[dict]:
    """Greedy outputs of every prompt, concurrently (one batch) or one after another."""
    params = {"max_new_tokens": GREEDY_TOKENS, "temperature": 0.0}
    extra = {"return_logprob": True, "top_logprobs_num": 2} if logprobs else {}

    async def one(i: list[int]) -> dict:
        out = await engine.async_generate(input_ids=i, sampling_params=params, **extra)
        top = out["meta_info"].get("output_top_logprobs") or []
        return {"ids": list(out["output_ids"]), "top2": [[float(t[0]) for t in pos[:2]] for pos in top]}

    if one_by_one:
        return [await one(i) for i in ids]
    return list(await asyncio.gather(*(one(i) for i in ids)))


async def speed(engine, ids: list[list[int]], batch: int, tokens: int = SPEED_TOKENS) -> dict:
    params = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    outs = await asyncio.gather(
        *(engine.async_generate(input_ids=ids[i % len(ids)], sampling_params=params) for i in range(batch))
    )
    wall = time.perf_counter() - start
    n = sum(len(o["output_ids"]) for o in outs)
    return {"batch": batch, "output_tokens": n, "wall_s": round(wall, 4), "output_tokens_per_s": round(n / wall, 1)}


async def speeds(engine, ids, label: str, states=None) -> list[dict]:
    rows = []
    for b in BATCHES:
        await speed(engine, ids, b, tokens=16)  # warm-up: Triton kernels and graphs of this size
        row = await speed(engine, ids, b)
        if states is not None:  # what the plugin's policy saw in the last 5 s, and ran last
            state = (states() or [{}])[0]
            row["ran_last_batch"] = state.get("active")
            recent = state.get("recent", {})
            if recent.get("verified"):
                row["accepted_per_verify"] = round(recent["accepted"] / recent["verified"], 3)
        rows.append({"engine": label, **row})
        print(f"  {label} batch {b}: {row['output_tokens_per_s']} tok/s", flush=True)
    return rows


async def probe(variant: str, model: str, draft: str) -> dict:
    """One engine, its greedy outputs and its speeds."""
    from transformers import AutoTokenizer

    ids = prompt_ids(AutoTokenizer.from_pretrained(model))
    result: dict = {"variant": variant, "greedy": {}, "speed": []}
    t0 = time.perf_counter()
    if variant.startswith("plain"):
        import sglang

        kwargs = {"model_path": model, "mem_fraction_static": 0.5, "max_running_requests": 256, **COMMON}
        if variant == "plain-no-overlap":
            kwargs["disable_overlap_schedule"] = True
        engine = sglang.Engine(**kwargs)
        result["start_s"] = round(time.perf_counter() - t0, 1)
        result["sglang_version"] = importlib.metadata.version("sglang")
        try:
            if variant == "plain":
                for phase in ("cold", "warm"):
                    result["greedy"][phase] = await greedy(engine, ids, logprobs=True)
                await flush(engine)
                result["greedy"]["flushed"] = await greedy(engine, ids, logprobs=True)
                await flush(engine)
                result["greedy"]["one_by_one"] = await greedy(engine, ids, logprobs=False, one_by_one=True)
            result["speed"] = await speeds(engine, ids, variant)
        finally:
            engine.shutdown()
        return result

    from serve_app.engines.sglang import SGLangEngine, SGLangOptions

    if variant == "spec-skip-extend":
        os.environ["SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND"] = "1"
    adaptive = {"step_policy": "adaptive", "adaptive_slots": ADAPTIVE_SLOTS} if variant == "spec-adaptive" else {}
    opts = SGLangOptions(
        **adaptive,
        model_path=model,
        draft_model_path=draft,
        tp_size=1,
        candidate_steps=[0, 1, 3],
        mem_fraction_static=0.5,
        max_running_requests=256,
        nccl_port=None,
        extra_server_args=COMMON,
    )
    se = SGLangEngine(opts)
    await se.start()
    engine = se._engine
    result["start_s"] = round(time.perf_counter() - t0, 1)
    result["sglang_version"] = se.release.version
    try:
        if variant == "spec":
            for label, steps in (("steps3", 3), ("steps3_again", 3), ("steps0", 0), ("steps1", 1)):
                await se.set_num_steps(steps)
                await flush(engine)
                result["greedy"][label] = await greedy(engine, ids, logprobs=False)
            await flush(engine)
            result["greedy"]["switched"] = await switched(se, engine, ids)
            await se.set_num_steps(3)
            await flush(engine)
            result["greedy"]["steps3_after_switches"] = await greedy(engine, ids, logprobs=False)
        if variant == "spec-adaptive":
            await se.set_num_steps(3)
            await flush(engine)
            result["greedy"]["adaptive3"] = await greedy(engine, ids, logprobs=False)
            await flush(engine)
            result["greedy"]["policy_toggled"] = await toggled(se, engine, ids)
            result["speed"] = await side_by_side(se, engine, ids)
            result["adaptive_slots"] = {str(k): v for k, v in ADAPTIVE_SLOTS.items()}
            return result
        for steps in (3, 1, 0) if variant == "spec" else (0, 3):
            await se.set_num_steps(steps)
            rows = await speeds(engine, ids, f"{variant} steps {steps}", se.policy_states)
            ran = (se.policy_states() or [{}])[0].get("active")
            result["speed"] += [{**r, "num_steps": steps, "ran": ran} for r in rows]
    finally:
        await se.shutdown()
    return result


async def greedy_while(engine, ids, change, values) -> list[dict]:
    """Greedy outputs while ``change(value)`` cycles through ``values``, one every 20 ms."""

    async def flip():
        while True:
            for value in values:
                await change(value)
                await asyncio.sleep(0.02)

    task = asyncio.create_task(flip())
    try:
        return await greedy(engine, ids, logprobs=False)
    finally:
        task.cancel()


async def switched(se, engine, ids) -> list[dict]:
    """Greedy outputs while the step count cycles 3 -> 0 -> 1 every 20 ms."""
    return await greedy_while(engine, ids, se.set_num_steps, (0, 1, 3))


async def toggled(se, engine, ids) -> list[dict]:
    """Greedy outputs at ceiling 3 while the step policy flips fixed <-> adaptive every 20 ms."""
    return await greedy_while(engine, ids, se.set_step_policy, ("fixed", "adaptive"))


SIDES = (("fixed", 3), ("adaptive", 3), ("fixed", 0))
REPEATS = 4


async def side_by_side(se, engine, ids) -> list[dict]:
    """Per batch size, each side (step policy, ceiling) ``REPEATS`` times in mirrored order
    (fixed 3, adaptive 3, 0, 0, adaptive 3, fixed 3, ...), so that the machine's drift weighs on
    each alike; a row sums its repeats and keeps each one's tokens/s and the steps it ran last."""
    rows = []
    for b in BATCHES:
        tally = {side: {"output_tokens": 0, "wall_s": 0.0, "each": [], "ran": []} for side in SIDES}
        for r in range(REPEATS):
            for policy, steps in SIDES if r % 2 == 0 else SIDES[::-1]:
                await se.set_step_policy(policy)
                await se.set_num_steps(steps)
                if r == 0:
                    await speed(engine, ids, b, tokens=16)  # warm-up at this size and setting
                row = await speed(engine, ids, b)
                t = tally[(policy, steps)]
                t["output_tokens"] += row["output_tokens"]
                t["wall_s"] += row["wall_s"]
                t["each"].append(row["output_tokens_per_s"])
                t["ran"].append((se.policy_states() or [{}])[0].get("active"))
        for (policy, steps), t in tally.items():
            rows.append({"engine": f"{policy} ceiling {steps}", "batch": b, "step_policy": policy, "num_steps": steps,
                         "output_tokens_per_s": round(t["output_tokens"] / t["wall_s"], 1),
                         "each_tokens_per_s": t["each"], "ran_last_batch": t["ran"]})
            print(f"  {policy} ceiling {steps} batch {b}: {rows[-1]['output_tokens_per_s']} tok/s, ran {t['ran']}",
                  flush=True)
    return rows



def first_difference(a: list[int], b: list[int]) -> int | None:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def compare(outs: list[dict], ref: list[dict]) -> dict:
    """Identical prompts, and for each that differs: where, and the reference's top-1 - top-2
    logprob there (a small margin: a near-tie that another rounding order may flip)."""
    diffs = []
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        at = first_difference(o["ids"], r["ids"])
        if at is None:
            continue
        top2 = r["top2"][at] if at < len(r["top2"]) else []
        margin = round(top2[0] - top2[1], 4) if len(top2) == 2 else None
        diffs.append({"prompt": i, "first_difference_at": at, "reference_margin": margin})
    return {"identical": len(outs) - len(diffs), "of": len(outs), "differences": diffs}


def run_probe(variant: str, args, logs: Path) -> dict | None:
    out = logs / f"probe-{variant}.json"
    with open(logs / f"probe-{variant}.log", "w") as log:
        cmd = [sys.executable, __file__, "probe", variant, "--model", args.model, "--draft", args.draft, "--out", str(out)]
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not out.exists():
        print(f"probe {variant} failed (rc {rc}); see {log.name}", flush=True)
        return None
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("all", "probe"))
    ap.add_argument("variant", nargs="?", choices=VARIANTS)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline-s", type=float, default=540, help="skip optional variants past this many seconds")
    ap.add_argument("--variants", default="plain,spec,spec-skip-extend,plain-no-overlap",
                    help="comma list of the variants to run, in this order")
    args = ap.parse_args(argv)
    if args.command == "probe":
        Path(args.out).write_text(json.dumps(asyncio.run(probe(args.variant, args.model, args.draft))))
        return 0

    start, logs = time.monotonic(), Path(args.out).parent
    probes = {}
    optional = {"spec-skip-extend": 300, "plain-no-overlap": 420}
    chosen = args.variants.split(",")
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    for variant in chosen:
        optional_after_s = optional.get(variant)
        if optional_after_s is not None and time.monotonic() - start > min(optional_after_s, args.deadline_s):
            print(f"skipping {variant}: {time.monotonic() - start:.0f} s gone", flush=True)
            continue
        print(f"{variant}: starting ({time.monotonic() - start:.0f} s)", flush=True)
        probes[variant] = run_probe(variant, args, logs)
    plain = (probes.get("plain") or {}).get("greedy", {})
    spec = (probes.get("spec") or {}).get("greedy", {})
    adaptive = (probes.get("spec-adaptive") or {}).get("greedy", {})
    greedy_identical = {}
    if plain.get("cold"):
        ref = plain["cold"]
        for label, outs in plain.items():
            if label != "cold":
                greedy_identical[f"plain {label} vs plain cold"] = compare(outs, ref)
        for label, outs in spec.items():
            greedy_identical[f"spec {label} vs plain cold"] = compare(outs, ref)
        for label, outs in adaptive.items():
            greedy_identical[f"spec-adaptive {label} vs plain cold"] = compare(outs, ref)
    if spec.get("steps3"):
        s3 = [{**o, "top2": []} for o in spec["steps3"]]
        for label in ("steps3_again", "steps0", "steps1", "switched", "steps3_after_switches"):
            if label in spec:
                greedy_identical[f"spec {label} vs spec steps3"] = compare(spec[label], s3)
    result = {
        "probes": {v: {k: p[k] for k in ("start_s", "sglang_version", "speed")} for v, p in probes.items() if p},
        "greedy_identical": greedy_identical,
        "failed": [v for v, p in probes.items() if p is None],
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name, c in greedy_identical.items():
        print(f"  {name}: {c['identical']}/{c['of']} identical", flush=True)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
