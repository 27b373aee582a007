"""Closed-loop streaming clients for live-app tests, adjustable while they run."""

import asyncio
import threading

import httpx


class LoadGen:
    """N concurrent streaming clients, adjustable while running; counts completions and errors."""

    def __init__(self, base: str, max_tokens: int = 48):
        self.base, self.max_tokens = base, max_tokens
        self.target, self.done, self.errors = 0, 0, []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._tasks: list = []

    async def _client(self, i: int) -> None:
        body = {
            "prompt": f"client {i} says",
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        async with httpx.AsyncClient(base_url=self.base, timeout=60) as http:
            while i < self.target:
                try:
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        lines = [line async for line in r.aiter_lines() if line]
                    if r.status_code != 200 or lines[-1] != "data: [DONE]":
                        self.errors.append((r.status_code, lines[-1:]))
                    self.done += 1
                except Exception as e:  # noqa: BLE001
                    self.errors.append(repr(e))

    def set_clients(self, n: int) -> None:
        old, self.target = self.target, n
        for i in range(old, n):
            self._tasks.append(asyncio.run_coroutine_threadsafe(self._client(i), self._loop))

    def stop(self) -> None:
        self.set_clients(0)
        for t in self._tasks:
            t.result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
