"""Where the CPU goes during a serving point: per-process CPU seconds over a measured window.

python scripts/cpu_share.py --config configs/local.yaml --prompt-set chat --concurrency 16 --policy off \
    --settle-s 15 --out bench/results/cpu_share_off_c16.json

``--concurrency 0`` measures the stack idle (no client; ``--settle-s`` after start-up, then
``--measure-s``).

With ``--policy off`` it also prints ``host_ms_per_chunk``: the CPU of the per-request path
outside the replicas (ingress, HTTP proxy or HAProxy, benchmark client) per token, which is per chunk
when every token is its own chunk (``--set streaming.chunks_per_s=0``), the simulator's
``--host-ms-per-chunk``. A lower bound: the replicas' own streaming work
is inside their CPU, with the engine's. The CPU is sampled from ``--settle-s`` on, while the
served window opens no sooner than every client's first request has ended: give a settle longer
than one request at that load so the two windows coincide.
"""
import argparse
import asyncio
import json
import os
import sys
import threading
import time
from collections import defaultdict
from datetime import UTC, datetime

import psutil

from serve_app.tools.bench.client import Poller, add_target_arguments, prompt_messages, run_against_target
from serve_app.tools.bench.engine import cpu_model
from serve_app.tools.bench.serve import run_point


def group(p: psutil.Process) -> str:
    try:
        name = " ".join(p.cmdline())[:200]
    except psutil.Error:
        return "?"
    if p.pid == os.getpid():
        return "benchmark client"
    for key in ("LLMReplica", "OpenAIIngress", "ProxyActor", "ModeController", "ServeController", "HAProxyManager",
                "haproxy", "raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env",
                "default_worker"):
        if key in name:
            return key
    return "other: " + name[:60]


PER_CHUNK = ("OpenAIIngress", "ProxyActor", "haproxy", "benchmark client")  # work on every streamed chunk


def cpu_by_group() -> dict:
    out = defaultdict(float)
    for p in psutil.process_iter():
        try:
            t = p.cpu_times()
            out[group(p)] += t.user + t.system
        except psutil.Error:
            pass
    return out


def replica_threads() -> dict:
    """CPU seconds per thread name inside the replica processes (the step thread is
    ``specserve-step``), summed over replicas."""
    out = defaultdict(float)
    for p in psutil.process_iter():
        if group(p) != "LLMReplica":
            continue
        try:
            for t in p.threads():
                try:
                    with open(f"/proc/{p.pid}/task/{t.id}/comm") as f:
                        name = f.read().strip()
                except OSError:
                    name = "?"
                out[name] += t.user_time + t.system_time
        except psutil.Error:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    add_target_arguments(ap)
    ap.add_argument("--concurrency", type=int, default=16, help="clients; 0: the idle stack, no load")
    ap.add_argument("--policy", default="off")
    ap.add_argument("--settle-s", type=float, default=10)
    ap.add_argument("--measure-s", type=float, default=30)
    ap.add_argument("--out", default=None, help="also write the result as JSON here")
    args = ap.parse_args()

    async def body(target):
        prompts = prompt_messages(args.prompt_set.split(","))
        await target.apply_policy(args.policy, 3)
        result = {}

        def sample():
            time.sleep(args.settle_s)
            a, ta, t0 = cpu_by_group(), replica_threads(), time.monotonic()
            time.sleep(args.measure_s)
            b, tb, t1 = cpu_by_group(), replica_threads(), time.monotonic()
            result["window_s"] = round(t1 - t0, 1)
            result["cpu_s"] = {k: round(b[k] - a.get(k, 0.0), 1) for k in b if b[k] - a.get(k, 0.0) > 0.05}
            result["replica_thread_cpu_s"] = dict(sorted(
                ((k, round(tb[k] - ta.get(k, 0.0), 2)) for k in tb if tb[k] - ta.get(k, 0.0) > 0.05),
                key=lambda kv: -kv[1]))

        th = threading.Thread(target=sample)
        th.start()
        if args.concurrency == 0:  # the idle stack: no client, no poller
            await asyncio.to_thread(th.join)
            await target.put_mode(None)
            return {"row": {"output_tokens_per_s": 0.0, "tpot_p50_ms": None}, **result}
        async with Poller(target) as poller:
            row = await run_point(target, poller, prompts, args.concurrency, args.settle_s, args.measure_s, 128, False)
        th.join()
        await target.put_mode(None)
        return {"row": {k: row[k] for k in ("output_tokens_per_s", "tpot_p50_ms")}, **result}

    out = {"command": "python scripts/cpu_share.py " + " ".join(sys.argv[1:]),
           "date": datetime.now(UTC).isoformat(timespec="seconds"), "cpus": os.cpu_count(), "cpu_model": cpu_model()}
    out |= run_against_target(args, body)
    # after the run: starting a local app sets serve_app.serving.config.RAY_ENV where unset
    out["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("RAY_SERVE_")}
    out["cpu_s"] = dict(sorted(out["cpu_s"].items(), key=lambda kv: -kv[1]))
    if args.policy == "off" and args.concurrency > 0:
        chunks = out["row"]["output_tokens_per_s"] * out["window_s"]
        out["host_ms_per_chunk"] = round(1000 * sum(out["cpu_s"].get(g, 0.0) for g in PER_CHUNK) / chunks, 3)
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
