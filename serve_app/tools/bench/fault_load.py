"""What the fault scenarios share: closed-loop clients that check every answer against a
reference (:class:`Load`, counting into a :class:`Tally`), and the application under test
(:class:`Target`: its HTTP routes, operator API and replicas)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "The capital of France is",
    "Repeat after me: red green blue red green blue",
]



@dataclass
class Tally:
    """What the clients saw. ``failed`` counts client-visible failures (anything but a 200 with
    the reference output, or a cut stream ended cleanly); ``retried`` counts answers the
    ingress re-dispatched after losing a replica (header ``x-specserve-attempts`` > 1);
    ``resent`` counts requests the client sent again once because the connection closed before
    any response came (as OpenAI's SDK resends on a connection error, twice by default)."""

    sent: int = 0
    completed: int = 0
    failed: int = 0
    retried: int = 0
    cut: int = 0
    resent: int = 0
    mismatched: int = 0
    errors: list[str] = field(default_factory=list)

    def fail(self, why: str) -> None:
        self.failed += 1
        if len(self.errors) < 20:
            self.errors.append(why)


class Load:
    """``clients`` closed-loop clients in a background event loop, until :meth:`stop`."""

    def __init__(self, prefix: str, clients: int, max_tokens: int, reference: dict[str, str], timeout_s: float = 60):
        self.prefix, self.clients, self.max_tokens, self.reference = prefix, clients, max_tokens, reference
        self.timeout_s, self.tally, self._running = timeout_s, Tally(), True
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.ttft: list[tuple[float, float]] = []  # (sent at, monotonic; seconds to the first event) per stream

    def __enter__(self) -> Load:
        self._thread.start()
        self._futures = [asyncio.run_coroutine_threadsafe(self._client(i), self._loop) for i in range(self.clients)]
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> Tally:
        self._running = False
        for f in self._futures:
            f.result(timeout=self.timeout_s + 30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        return self.tally

    async def _client(self, i: int) -> None:
        async with httpx.AsyncClient(base_url=self.prefix, timeout=self.timeout_s) as http:
            k = i
            while self._running:
                prompt, stream = PROMPTS[k % len(PROMPTS)], k % 2 == 1
                k += 1
                self.tally.sent += 1
                try:
                    await self._one(http, prompt, stream)
                except Exception as e:  # a timeout here is a hang
                    self.tally.fail(f"{type(e).__name__}: {e}")

    async def _send(self, http: httpx.AsyncClient, body: dict) -> httpx.Response:
        """The response, its body still to read; sent a second time where the connection closed
        before any response (a kept-alive connection the server side closed as it was reused),
        never where a response began."""
        try:
            return await http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
        except (httpx.RemoteProtocolError, httpx.ConnectError):
            self.tally.resent += 1
            return await http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)

    async def _one(self, http: httpx.AsyncClient, prompt: str, stream: bool) -> None:
        body = {"prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
        t = self.tally
        if not stream:
            r = await self._send(http, body)
            try:
                await r.aread()
            finally:
                await r.aclose()
            if r.status_code != 200:
                return t.fail(f"{r.status_code}: {r.text[:200]}")
            text = r.json()["choices"][0]["text"]
        else:
            sent = time.monotonic()
            r = await self._send(http, {**body, "stream": True})
            lines = []
            try:
                async for line in r.aiter_lines():
                    if line and not lines and r.status_code == 200:
                        self.ttft.append((sent, time.monotonic() - sent))
                    if line:
                        lines.append(line)
            finally:
                await r.aclose()
            if r.status_code != 200:
                return t.fail(f"{r.status_code}: {lines[:1]}")
            if lines[-1:] != ["data: [DONE]"]:
                return t.fail(f"stream without [DONE]: {lines[-1:]}")
            chunks = [json.loads(line[6:]) for line in lines[:-1]]
            errors = [c["error"] for c in chunks if "error" in c]
            if errors:  # a cut stream: fine only if a replica died under it, and said so
                if "replica serving it failed" in errors[0]["message"]:
                    t.cut += 1
                    return
                return t.fail(f"stream error: {errors[0]}")
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        if int(r.headers.get("x-specserve-attempts", "1")) > 1:
            t.retried += 1
        if self.reference.get(prompt, text) != text:
            t.mismatched += 1
            return t.fail(f"output differs from the reference for {prompt!r}")
        t.completed += 1


# -- the application under test ----------------------------------------------------------------


@dataclass
class Target:
    """A deployed application: where it answers and how to steer it."""

    app_name: str
    prefix: str
    admin_token: str
    timeout_s: float = 60  # one request's; a reference request of many tokens on a busy machine needs more
    http: httpx.Client = field(init=False)

    def __post_init__(self):
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        self.http = httpx.Client(base_url=self.prefix, headers=headers, timeout=self.timeout_s)

    def status(self) -> dict:
        r = self.http.get("/v1/speculation")
        r.raise_for_status()
        return r.json()

    def force(self, body: dict) -> httpx.Response:
        return self.http.put("/v1/speculation", json=body)

    def wait_converged(self, num_steps: int, replicas: int, timeout_s: float = 120) -> float:
        """Seconds until every one of ``replicas`` live replicas runs ``num_steps`` at the cluster version."""
        start = time.monotonic()
        while True:
            s = self.status()
            reps = s["replicas"]
            if (
                s["num_steps"] == num_steps
                and len(reps) == replicas
                and all(r["num_steps"] == num_steps and r["applied_version"] == s["version"] for r in reps)
            ):
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"not converged to {num_steps} on {replicas} replicas: {s['replicas']}")
            time.sleep(0.1)

    def reference(self, max_tokens: int, replicas: int) -> dict[str, str]:
        """Greedy outputs of every prompt with plain decoding, one at a time, before any fault.
        Leaves the cluster fixed at num_steps 0."""
        self.force({"mode": "fixed", "num_steps": 0}).raise_for_status()
        self.wait_converged(0, replicas)
        out = {}
        for p in PROMPTS:
            body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            r = self.http.post("/v1/completions", json=body)
            r.raise_for_status()
            out[p] = r.json()["choices"][0]["text"]
        return out

    def replica_actor_names(self) -> list[str]:
        import ray

        prefix = f"SERVE_REPLICA::{self.app_name}#LLMReplica#"
        return sorted(
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)
        )

    def replica_infos(self) -> list[dict]:
        from ray import serve

        return serve.get_deployment_handle("LLMReplica", self.app_name).broadcast("info").results(timeout_s=60)


def result(name: str, tally: Tally, started: float, **extra) -> dict:
    return {"scenario": name, "duration_s": round(time.monotonic() - started, 1), **asdict(tally), **extra}
