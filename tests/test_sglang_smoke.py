"""The GPU smoke script's logic (lossless check, throughput, table) on a stand-in engine."""

import asyncio
import importlib.util
from pathlib import Path

from serve_app.engines.base import TokenDelta

spec = importlib.util.spec_from_file_location("smoke", Path(__file__).resolve().parents[1] / "infra/gpu/smoke.py")
smoke = importlib.util.module_from_spec(spec)
spec.loader.exec_module(smoke)


class Engine:
    """Greedy 'model': the tokens depend on the prompt only, unless ``lossy`` steps are active."""

    def __init__(self, lossy_steps=()):
        self.num_steps, self.lossy_steps = 0, set(lossy_steps)

    async def set_num_steps(self, n):
        self.num_steps = n

    async def _stream(self, request):
        for i in range(request.params.max_tokens):
            await asyncio.sleep(0)
            token = len(request.prompt) + i + (1 if self.num_steps in self.lossy_steps else 0)
            yield TokenDelta(request.request_id, [token], "", "length" if i == request.params.max_tokens - 1 else None)

    def generate(self, request):
        return self._stream(request)


def test_identical_outputs_pass_and_a_lossy_step_count_is_named():
    assert asyncio.run(smoke.check_lossless(Engine(), [0, 3, 5], max_tokens=8)) == []
    problems = asyncio.run(smoke.check_lossless(Engine(lossy_steps={3}), [0, 3, 5], max_tokens=8))
    assert problems[0] == "num_steps=3 prompt 0: differs from steps=0 at token 0"


def test_throughput_and_the_table_beside_the_seed_figures():
    assert asyncio.run(smoke.throughput(Engine(), 3, 8, max_tokens=4, rounds=1)) > 0
    results = {(n, c): 100.0 for n in (0, 5) for c in smoke.CONCURRENCY}
    lines = smoke.table(results, [0, 5]).splitlines()
    assert lines[0].split() == ["concurrency", "steps=0", "steps=5", "seed", "plain", "seed", "EAGLE-3"]
    assert lines[1].split() == ["1", "100.0", "100.0", "92.6", "77.5"]
    assert lines[-1].split() == ["250", "100.0", "100.0", "772.1", "340.9"]
