"""What the serving benchmarks share: the application under test, its operator API, and one
streaming chat request timed from the client's side.

A benchmark either targets a running application (``--url``, admin token from the
environment) or brings one up itself from a ``serve run`` config (``--config``): a fresh
local Ray, Serve's HTTP proxy on a free port, ``build_app`` with the config's ``args``. The
admin token is then set (randomly, if unset) before Ray starts, so that the ingress reads it.
One file just past 300 lines: the target, its poller and the timed request belong together.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import yaml

from serve_app.serving.config import read_serve_config

from .prompts import PROMPT_SETS, chat_messages
from .stats import RequestTiming, mean

POLICIES = ("spec", "off", "dynamic", "two-level")
"""``spec``/``off``: a pinned num_steps; ``dynamic``: the cluster ladder, every engine drafting
the tier's num_steps; ``two-level``: the same ladder as a ceiling, each engine picking every
step's draft length under it (``engine_step_policy: adaptive``)."""
DEFAULT_POLICIES = ("spec", "off", "dynamic")


def sampling_for(prompt_index: int, sampled_every: int) -> tuple[float, int | None]:
    """(temperature, seed) of request ``prompt_index``: greedy, except every ``sampled_every``-th
    (the last of each group) at temperature 1 with its index as seed, so that every policy
    samples the same requests alike."""
    if sampled_every and prompt_index % sampled_every == sampled_every - 1:
        return 1.0, prompt_index
    return 0.0, None


# -- one request -------------------------------------------------------------------------
@dataclass(slots=True)
class Record:
    """One streamed request: when it was sent, when its text chunks arrived (perf_counter)."""

    start: float
    prompt_index: int
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from usage, as the server counted them
    chunk_times: list[float] = field(default_factory=list)
    error: str | None = None
    phase: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def end(self) -> float:
        return self.chunk_times[-1] if self.chunk_times else self.start

    @property
    def timing(self) -> RequestTiming | None:
        if not self.ok:
            return None
        return RequestTiming(self.output_tokens, self.chunk_times[0] - self.start, self.chunk_times[-1] - self.start)

    def tokens_between(self, t0: float, t1: float) -> float:
        """Output tokens delivered in [t0, t1). A chunk's token count is not on the wire (only
        its text), so the request's tokens (from usage) are spread evenly over its chunks."""
        if not self.ok:
            return 0.0
        inside = sum(1 for t in self.chunk_times if t0 <= t < t1)
        return self.output_tokens * inside / len(self.chunk_times)


# -- the application's HTTP and operator API ---------------------------------------------
class Target:
    """An application's OpenAI and operator API at ``url`` (which may carry a route prefix)."""

    def __init__(self, url: str, admin_token: str | None):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=httpx.Timeout(900, connect=30),
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=512))
        self.model: str | None = None
        self.extra_body: dict[str, Any] = {}  # added to every chat request, e.g. a server's own parameters
        self.sampled_every = 0  # see sampling_for

    async def aclose(self) -> None:
        await self.http.aclose()

    async def start(self, wait_s: float = 120) -> None:
        """Wait for the application to answer, and learn its model name."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                r = await self.http.get("/v1/models")
                if r.status_code == 200:
                    self.model = r.json()["data"][0]["id"]
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.url} did not answer /v1/models within {wait_s:.0f}s")
            await asyncio.sleep(0.5)

    async def status(self) -> dict:
        r = await self.http.get("/v1/speculation")
        r.raise_for_status()
        return r.json()

    async def status_or_none(self) -> dict | None:
        """The operator API's status; None from a server without one (llama-server, vLLM, ...)."""
        r = await self.http.get("/v1/speculation")
        return r.json() if r.status_code == 200 else None

    async def put_mode(self, num_steps: int | None) -> dict:
        """Pin ``num_steps`` (``None``: back to auto, the policy decides)."""
        body = {"mode": "auto"} if num_steps is None else {"mode": "fixed", "num_steps": num_steps}
        r = await self.http.put("/v1/speculation", json=body)
        if r.status_code in (401, 403):
            raise RuntimeError(f"PUT /v1/speculation: {r.json()['error']['message']}")
        r.raise_for_status()
        return r.json()

    async def wait_for(self, predicate: Callable[[dict], bool], timeout_s: float) -> dict:
        """Poll the operator API until ``predicate(status)``; the last status either way."""
        deadline = time.monotonic() + timeout_s
        while not predicate(status := await self.status()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return status

    async def put_step_policy(self, step_policy: str | None) -> None:
        """Set the engines' step policy (None: each engine's configured one) and wait until every
        replica runs the version that carries it."""
        r = await self.http.put("/v1/speculation", json={"policy": {"engine_step_policy": step_policy}})
        if r.status_code != 200:
            raise RuntimeError(f"PUT /v1/speculation engine_step_policy={step_policy}: HTTP {r.status_code} {r.text[:200]}")
        version = r.json()["version"]
        await self._until_replicas(lambda s: bool(s["replicas"]) and all(
            x["applied_version"] >= version for x in s["replicas"]), f"engine_step_policy={step_policy}")

    async def restore(self, status: dict) -> None:
        """Back to auto mode and the engines' step policy of ``status`` (taken before a run)."""
        await self.put_mode(None)
        initial = status["policy"].get("engine_step_policy")
        if (await self.status())["policy"].get("engine_step_policy") != initial:
            await self.put_step_policy(initial)

    async def apply_policy(self, policy: str, spec_steps: int) -> None:
        """``spec``/``off`` pin a mode and wait until every replica runs it; ``dynamic`` and
        ``two-level`` are auto, the engines' step policy fixed and adaptive."""
        status = await self.status()
        want = "adaptive" if policy == "two-level" else "fixed"
        if status["policy"].get("engine_step_policy") != want:
            await self.put_step_policy(want)
        if policy in ("dynamic", "two-level"):
            await self.put_mode(None)
            return
        k = spec_steps if policy == "spec" else 0
        await self.put_mode(k)
        await self._until_replicas(lambda s: all_replicas_at(s, k), f"num_steps={k}")

    async def _until_replicas(self, done: Callable[[dict], bool], what: str, timeout_s: float = 30) -> None:
        """Wait until ``done(status)``; past ``timeout_s``, RuntimeError naming ``what``."""
        status = await self.wait_for(done, timeout_s)
        if not done(status):
            raise RuntimeError(f"replicas did not apply {what} within {timeout_s:g}s: {status['replicas']}")

    async def chat(self, prompt_index: int, messages: list[dict], max_tokens: int, ignore_eos: bool) -> Record:
        """One streamed chat completion, timed chunk by chunk: greedy, or sampled (see sampling_for)."""
        rec = Record(time.perf_counter(), prompt_index)
        temperature, seed = sampling_for(prompt_index, self.sampled_every)
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos} | self.extra_body
        if seed is not None:
            body |= {"seed": seed, "top_p": 1.0}
        try:
            async with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return rec
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if (data := line[6:]) == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        rec.error = chunk["error"]["message"]
                        break
                    if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                        rec.chunk_times.append(time.perf_counter())
                    if chunk.get("usage"):
                        rec.output_tokens = chunk["usage"]["completion_tokens"]
                        rec.prompt_tokens = chunk["usage"].get("prompt_tokens")
        except httpx.HTTPError as e:
            rec.error = repr(e)
        return rec


def all_replicas_at(status: dict, num_steps: int) -> bool:
    reps = status["replicas"]
    return (status["num_steps"] == num_steps and bool(reps)
            and all(r["num_steps"] == num_steps and r["applied_version"] == status["version"] for r in reps))


def steps_ran(status: dict) -> float | None:
    """The draft steps the replicas ran, averaged over replicas: each replica's ``mean_num_steps``
    (an adaptive engine's mean over its recent steps), else its ``active_num_steps``, else its
    commanded ``num_steps`` (the rule of the ``specserve_replica_mean_num_steps`` gauge)."""
    ran = []
    for r in status.get("replicas") or []:
        for key in ("mean_num_steps", "active_num_steps", "num_steps"):
            if r.get(key) is not None:
                ran.append(float(r[key]))
                break
    return sum(ran) / len(ran) if ran else None


class Poller:
    """Samples ``GET /v1/speculation`` in the background: (perf_counter, num_steps, load, version,
    steps_ran). ``every_s=None``: never (a server without the operator API); its summaries are empty."""

    def __init__(self, target: Target, every_s: float | None = 0.25):
        self.target, self.every_s = target, every_s
        self.samples: list[tuple[float, int, float, int, float | None]] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> Poller:
        if self.every_s is not None:
            await self._sample()  # so that version_at(now) is known from the start
            self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is None:
            return
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    async def _sample(self) -> None:
        try:
            s = await self.target.status()
            self.samples.append((time.perf_counter(), s["num_steps"], s["load_per_replica"] or 0.0, s["version"],
                                 steps_ran(s)))
        except httpx.HTTPError:
            pass

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            await self._sample()

    def window(self, t0: float, t1: float) -> list[tuple[float, int, float, int, float | None]]:
        return [s for s in self.samples if t0 <= s[0] < t1]

    def version_at(self, t: float) -> int | None:
        before = [s[3] for s in self.samples if s[0] <= t]
        return before[-1] if before else None

    def summary(self, t0: float, t1: float) -> dict:
        """Switches (controller versions) in [t0, t1), mean load, the share of samples per
        commanded mode (the ceiling), and the mean of the steps the replicas ran."""
        window = self.window(t0, t1)
        v0, v1 = self.version_at(t0), self.version_at(t1)
        share: dict[str, float] = {}
        for s in window:
            share[str(s[1])] = share.get(str(s[1]), 0) + 1 / len(window)
        ran = [s[4] for s in window if s[4] is not None]
        return {
            "switches": (v1 - v0) if v0 is not None and v1 is not None else None,
            "mean_load_per_replica": mean([s[2] for s in window]),
            "mode_share": {k: round(v, 3) for k, v in sorted(share.items())},
            "steps_ran": mean(ran),
        }


# -- prompts -----------------------------------------------------------------------------
def prompt_messages(names: list[str]) -> list[list[dict]]:
    """The chat messages of the named prompt sets, interleaved (copy0, chat0, copy1, ...)."""
    sets = [PROMPT_SETS[n] for n in names]
    return [chat_messages(s[i]) for i in range(max(map(len, sets))) for s in sets if i < len(s)]


# -- bringing the application up ---------------------------------------------------------
def free_port() -> int:
    """A free TCP port for a server this process starts, outside the kernel's ephemeral range
    (:func:`serve_app.serving.config.free_ports_outside_ephemeral`)."""
    from serve_app.serving.config import free_ports_outside_ephemeral

    return free_ports_outside_ephemeral(1)[0]


def with_overrides(raw: dict, overrides: list[str]) -> dict:
    """``raw`` app args with each ``dotted.path=VALUE`` set (VALUE read as YAML: 200, true, [0, 3])."""
    out = copy.deepcopy(raw)
    for item in overrides:
        path, sep, value = item.partition("=")
        keys = path.strip().split(".")
        if not sep or not all(keys):
            raise SystemExit(f"--set takes dotted.path=VALUE, e.g. streaming.chunks_per_s=200; got {item!r}")
        node = out
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise SystemExit(f"--set {item!r}: {key} is not a section")
        node[keys[-1]] = yaml.safe_load(value)
    return out


@contextmanager
def local_app(config: str, overrides: list[str] | None = None) -> Iterator[str]:
    """Deploy ``config``'s application (``overrides`` applied) on a fresh local Ray; yields its
    base URL; tears all down."""
    import ray
    from ray import serve

    from serve_app.serving.app import build_app
    from serve_app.serving.config import AppArgs, set_ray_env

    name, raw_args = read_serve_config(config)
    args = AppArgs.model_validate(with_overrides(raw_args, overrides or []))
    if not os.environ.get(args.admin_token_env):  # before Ray starts: its workers inherit it
        os.environ[args.admin_token_env] = secrets.token_hex(16)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    set_ray_env(own_ports=True)
    ray.init(address="local", include_dashboard=False, log_to_driver=False, namespace="specserve-bench")
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name=name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--config", default="configs/local.yaml",
                       help="bring this `serve run` config's application up on a local Ray (default configs/local.yaml)")
    where.add_argument("--url", help="benchmark a running application instead, e.g. http://127.0.0.1:8000")
    p.add_argument("--admin-token-env", default=None,
                   help="environment variable with the admin token (default: the config's admin_token_env, "
                        "or SPECSERVE_ADMIN_TOKEN with --url)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="with --config: change one of its app args, e.g. --set streaming.chunks_per_s=0 (repeatable)")
    p.add_argument("--prompt-set", default="chat", help="comma list of prompt sets, interleaved (default chat)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request, at most (default 128)")
    p.add_argument("--ignore-eos", action="store_true", help="every request runs to --max-tokens")
    p.add_argument("--sampled-every", type=int, default=0, metavar="N",
                   help="every N-th request at temperature 1 (seeded by its index; default 0: all greedy)")


def run_against_target(args: argparse.Namespace, body: Callable[[Target], Awaitable[Any]]) -> Any:
    """Run ``body(target)`` against ``--url`` or against ``--config`` brought up locally."""
    for name in args.prompt_set.split(","):
        if name not in PROMPT_SETS:
            raise SystemExit(f"prompt sets are {', '.join(PROMPT_SETS)}; got {name!r}")
    if args.sampled_every < 0:
        raise SystemExit(f"--sampled-every must be >= 0, got {args.sampled_every}")
    token_env = args.admin_token_env or (read_serve_config(args.config)[1].get("admin_token_env", "SPECSERVE_ADMIN_TOKEN")
                                         if not args.url else "SPECSERVE_ADMIN_TOKEN")

    async def main(url: str) -> Any:
        target = Target(url, os.environ.get(token_env))
        target.sampled_every = args.sampled_every
        try:
            await target.start()
            return await body(target)
        finally:
            await target.aclose()

    if args.url:
        if args.overrides:
            raise SystemExit("--set changes a --config's app args; it cannot change a running application (--url)")
        return asyncio.run(main(args.url))
    with local_app(args.config, args.overrides) as url:
        return asyncio.run(main(url))
