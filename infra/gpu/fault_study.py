"""An SGLang scheduler killed under load, through ``serve run``: what the requests in flight get,
and how long the app takes to serve again.

    python infra/gpu/fault_study.py --config configs/gpu-h200.yaml --out fault.json --logs DIR \
        [--kill scheduler|replica] [--ray-stop-force]

1. ``serve run CONFIG`` (a Ray cluster of its own, as serve_study.py starts it); 3 steps pinned
   through ``PUT /v1/speculation``.
2. Reference: each of ``--prompts`` chat prompts once, not streamed, greedy, ``--max-tokens``
   tokens (ignore_eos), all at once; then the same round again, compared with the first (the
   same engine twice: how far greedy output repeats at this length).
3. Fault: ``--requests`` of those requests not streamed and ``--streams`` streamed, all sent at
   once; once the replicas report ``--kill-at-running`` requests running (or 10 s passed), one
   process is sent SIGKILL: ``scheduler``, the oldest process titled ``sglang::scheduler`` (an
   engine's TP rank 0, spawned inside the replica's process), or ``replica``, the oldest
   replica process (an embedded engine has no scheduler: this runs the study on CPU with
   configs/local.yaml). ``GET /v1/speculation`` is sampled every 0.5 s meanwhile: which
   replicas report, and when.
4. Every request is awaited, and the replacement replica's first report (``--wait-s`` at most). For each: its HTTP status or error, its
   latency, and whether its text equals the reference of its prompt, else the character where
   it parts from it (greedy output; in bf16 a batch of another size may part at a near-tie, so
   this is counted, not required). A stream
   cut past its first token ends with an error event, as the app promises.
5. After: the reference round once more, on the replacement, compared with the reference.

The result JSON is rewritten after every phase; the servers are stopped on every way out
(serve_study.py's clean-up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_study as ss  # noqa: E402 - after the path: serve_study's helpers and clean-up
from engine_study import first_difference  # noqa: E402

from serve_app.tools.bench.client import Target, prompt_messages  # noqa: E402

SCHEDULER_TITLE = b"sglang::scheduler"
REPLICA_TITLE = b"ray::ServeReplica:specserve:LLMReplica"  # Ray's title for a replica's process


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def processes_titled(title: bytes) -> list[int]:
    """Pids whose command line (setproctitle's title) holds ``title``, oldest first."""
    table = ss._proc_table()
    return sorted((pid for pid in table if title in cmdline(pid)), key=lambda p: table[p][1])


async def chat(target: Target, messages: list[dict], max_tokens: int, stream: bool) -> dict:
    """One greedy chat completion: status, text, latency; a stream's error event kept apart."""
    body = {"model": target.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    t0 = time.perf_counter()
    out: dict = {"stream": stream, "status": None, "text": "", "error": None}
    try:
        if not stream:
            r = await target.http.post("/v1/chat/completions", json=body)
            out["status"] = r.status_code
            if r.status_code == 200:
                out["text"] = r.json()["choices"][0]["message"]["content"]
            else:
                out["error"] = r.text[:300]
        else:
            async with target.http.stream("POST", "/v1/chat/completions", json=body) as r:
                out["status"] = r.status_code
                if r.status_code != 200:
                    out["error"] = (await r.aread()).decode(errors="replace")[:300]
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line[6:] == "[DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            out["error"] = chunk["error"].get("message", str(chunk["error"]))[:300]
                            break
                        out["text"] += "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    out["latency_s"] = round(time.perf_counter() - t0, 2)
    return out


async def replicas_running(target: Target) -> dict[str, int]:
    status, _ = await ss.try_status(target)
    return {} if status is None else {r["id"]: r["running"] + r["waiting"] for r in status.get("replicas", [])}


async def kill_one(target: Target, kill: str) -> dict:
    """SIGKILL to the process ``kill`` names (see the module); what was killed, and when."""
    title = SCHEDULER_TITLE if kill == "scheduler" else REPLICA_TITLE
    pids = processes_titled(title)
    if not pids:
        under = {p: cmdline(p)[:100] for r in processes_titled(REPLICA_TITLE) for p in ss._descendants(r)}
        raise RuntimeError(f"no process titled {title.decode()} on this machine; under the replicas: {under}")
    pid, what = pids[0], f"{title.decode()} (the oldest of {len(pids)})"
    os.kill(pid, signal.SIGKILL)
    return {"pid": pid, "what": what, "t": time.perf_counter()}


async def fault(target: Target, prompts, refs: list[str], args, res: ss.Results) -> None:
    data = res.data
    samples: list[dict] = []
    t0 = time.perf_counter()

    async def sample() -> None:
        while True:
            status, err = await ss.try_status(target, 5.0)
            samples.append({"t": round(time.perf_counter() - t0, 2), "error": err,
                            "replicas": None if status is None else sorted(
                                r["id"] for r in status.get("replicas", []))})
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    n = len(prompts)
    jobs = [asyncio.create_task(chat(target, prompts[i % n], args.max_tokens, False)) for i in range(args.requests)]
    jobs += [asyncio.create_task(chat(target, prompts[i % n], args.max_tokens, True)) for i in range(args.streams)]
    deadline = time.perf_counter() + 10
    while time.perf_counter() < deadline and sum((await replicas_running(target)).values()) < args.kill_at_running:
        await asyncio.sleep(0.2)
    before = await replicas_running(target)
    killed = await kill_one(target, args.kill)
    killed.update(t=round(killed["t"] - t0, 2), replicas_before=before)
    data["killed"] = killed
    res.save()
    ss.say(f"  killed {killed['what']} pid {killed['pid']} at {killed['t']} s; replicas before: {before}")
    until = time.perf_counter() + args.wait_s
    done, pending = await asyncio.wait(jobs, timeout=args.wait_s)
    for job in pending:
        job.cancel()
    first = samples[0]["replicas"] if samples and samples[0]["replicas"] else []
    while time.perf_counter() < until and not any(s["replicas"] and set(s["replicas"]) - set(first) for s in samples):
        await asyncio.sleep(0.5)  # the replacement's first report, when the requests finished before it
    sampler.cancel()
    results = []
    for i, job in enumerate(jobs):
        if job in pending:
            results.append({"stream": i >= args.requests, "status": None, "error": f"no answer in {args.wait_s} s"})
            continue
        r = job.result()
        ref = refs[i % n]
        r["identical_to_reference"] = r["status"] == 200 and r["error"] is None and r["text"] == ref
        r["prefix_of_reference"] = ref.startswith(r["text"])
        r["first_difference"] = first_difference(r["text"], ref)  # a character index; None: identical
        r["chars"] = len(r.pop("text"))
        results.append(r)
    gone = next((s["t"] for s in samples if s["t"] > killed["t"] and s["replicas"] is not None
                 and not set(first) <= set(s["replicas"])), None)
    new = next((s["t"] for s in samples if s["replicas"] and set(s["replicas"]) - set(first)), None)
    plain = [r for r in results if not r["stream"]]
    streams = [r for r in results if r["stream"]]
    data["fault"] = {
        "requests": args.requests, "streams": args.streams, "max_tokens": args.max_tokens,
        "non_streamed_ok": sum(r["status"] == 200 and r["error"] is None for r in plain),
        "non_streamed_identical_to_reference": sum(r.get("identical_to_reference", False) for r in plain),
        "streams_completed": sum(r["status"] == 200 and r["error"] is None for r in streams),
        "streams_cut_with_error_event": sum(r["status"] == 200 and r["error"] is not None for r in streams),
        "streams_cut_text_prefix_of_reference": sum(r["status"] == 200 and r["error"] is not None
                                                    and r.get("prefix_of_reference", False) for r in streams),
        "errors": sorted({r["error"] for r in results if r["error"]}),
        "latency_s_max": max((r["latency_s"] for r in results if "latency_s" in r), default=None),
        "replica_gone_s_after_kill": None if gone is None else round(gone - killed["t"], 2),
        "new_replica_reporting_s_after_kill": None if new is None else round(new - killed["t"], 2),
        "samples": samples,
        "results": results,
    }
    res.save()
    f = data["fault"]
    ss.say(f"  fault: {f['non_streamed_ok']}/{f['requests']} non-streamed ok "
           f"({f['non_streamed_identical_to_reference']} identical to the reference), streams: "
           f"{f['streams_completed']} completed, {f['streams_cut_with_error_event']} cut with an error event; "
           f"replica gone after {f['replica_gone_s_after_kill']} s, a new one reporting after "
           f"{f['new_replica_reporting_s_after_kill']} s; errors {f['errors']}")


async def round_of(target: Target, prompts, max_tokens: int) -> list[dict]:
    """Each prompt once, not streamed, all at once."""
    return list(await asyncio.gather(*(chat(target, m, max_tokens, False) for m in prompts)))


def compared(outs: list[dict], refs: list[str]) -> dict:
    """How many answered, how many equal the reference, and where the others part from it."""
    return {"of": len(outs), "ok": sum(r["status"] == 200 and r["error"] is None for r in outs),
            "identical_to_reference": sum(r["text"] == x for r, x in zip(outs, refs, strict=True)),
            "first_difference": [first_difference(r["text"], x) for r, x in zip(outs, refs, strict=True)],
            "reference_chars": [len(x) for x in refs]}


async def study(args, res: ss.Results) -> None:
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    prompts = prompt_messages(["chat"])[: args.prompts]
    server, target = ss.launch_app(args.config, logs)
    data = res.data
    try:
        res.begin("start")
        t0 = time.perf_counter()
        await ss.wait_up(target, server, 420)
        data["openai_client"] = await ss.openai_client_checks(target.model, target.url)  # waits for the replicas
        data["start_s"] = round(time.perf_counter() - t0, 1)
        await target.apply_policy("spec", 3)
        res.done("start")

        res.begin("reference")
        ref = await round_of(target, prompts, args.max_tokens)
        if bad := [r for r in ref if r["status"] != 200 or r["error"]]:
            raise RuntimeError(f"reference requests failed: {bad[:2]}")
        refs = [r["text"] for r in ref]
        data["reference_again"] = compared(await round_of(target, prompts, args.max_tokens), refs)  # the engine twice
        ss.say(f"  reference again: {data['reference_again']}")
        res.done("reference")

        res.begin("fault")
        await fault(target, prompts, refs, args, res)
        res.done("fault")

        res.begin("after")
        data["after"] = compared(await round_of(target, prompts, args.max_tokens), refs)
        ss.say(f"  after, on the replacement: {data['after']}")
        data["status_after"] = (await ss.try_status(target))[0]
        res.done("after")
    finally:
        await target.aclose()
        ss.stop(server)
        data["stop_notes"] = server.notes
        data["log_lines"] = log_lines(logs, server)
        res.save()


def log_lines(logs: Path, server: ss.Server) -> list[str]:
    """The lines of the run's logs (serve run's and the Ray session's) about the fault."""
    keys = ("SubprocessWatchdog", "crashed with exit code", "SIGQUIT", "ending the replica's process",
            "replica lost", "died unexpectedly", "ActorDiedError", "ActorUnavailableError")
    files = [server.log] + sorted((server.ray_tmp or logs).glob("**/*.log")) + sorted((server.ray_tmp or logs).glob("**/*.err"))
    out = []
    for f in files:
        try:
            for line in f.read_text(errors="replace").splitlines():
                if any(k in line for k in keys):
                    out.append(f"{f.name}: {line[:300]}")
        except OSError:
            continue
    return out[:200]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/gpu-h200.yaml")
    ap.add_argument("--out", required=True)
    ap.add_argument("--logs", required=True)
    ap.add_argument("--kill", choices=("scheduler", "replica"), default="scheduler")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--requests", type=int, default=24, help="non-streamed requests in flight at the kill")
    ap.add_argument("--streams", type=int, default=8, help="streamed requests in flight at the kill")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--kill-at-running", type=int, default=16)
    ap.add_argument("--wait-s", type=float, default=400.0)
    ap.add_argument("--ray-stop-force", action="store_true")
    args = ap.parse_args(argv)
    ss.RAY_STOP_FORCE = args.ray_stop_force
    res = ss.Results(args.out, {"phases_completed": [], "phase_running": None, "errors": [], "config": args.config,
                                "kill": args.kill, "gpu": ss.gpu_name(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    res.save()
    rc = 0
    try:
        asyncio.run(study(args, res))
    except Exception as e:  # noqa: BLE001 - recorded, and the JSON still written
        res.error(res.data["phase_running"] or "study", e)
        ss.say(f"fault_study: {type(e).__name__}: {e}", file=sys.stderr)
        rc = 1
    finally:
        ss.stop_all()
        res.save()
    ss.say(f"wrote {args.out} (phases completed: {', '.join(res.data['phases_completed']) or 'none'})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
