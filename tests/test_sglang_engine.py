"""SGLangEngine against a stand-in ``sglang`` module shaped as sglang 0.5.23's Engine
(the shapes are pinned by tests/test_sglang_pinned.py; the real engine needs GPUs)."""

import asyncio
import sys
import threading
import types
from types import SimpleNamespace

import pytest

from serve_app.engines.base import EngineError, GenerateRequest, InvalidRequestError, SamplingParams
from serve_app.engines.sglang import engine as engine_mod
from serve_app.engines.sglang import plugin
from serve_app.engines.sglang.config import SGLangOptions


class FakeTokenizerManager:
    def __init__(self):
        self.aborted = []
        snapshot = SimpleNamespace(
            num_waiting_reqs=7,
            num_running_reqs=30,
            gen_throughput=812.5,
            speculative=SimpleNamespace(accept_rate=0.6, accept_length=2.8),
        )
        self.load_snapshot_reader = SimpleNamespace(read_all=lambda: [snapshot])

    def abort_request(self, rid="", abort_all=False):
        self.aborted.append("*" if abort_all else rid)


class FakeEngine:
    adaptive = True
    rpc_error: str | None = None
    last = None

    def __init__(self, **kwargs):
        self.kwargs, self.rpcs, self.stopped = kwargs, [], False
        self.tokenizer_manager = FakeTokenizerManager()
        self.server_args = SimpleNamespace(resolved_dict=lambda: {"speculative_adaptive": FakeEngine.adaptive})
        FakeEngine.last = self

    def collective_rpc(self, method, **kwargs):
        self.rpcs.append((method, kwargs, threading.current_thread() is threading.main_thread()))
        assert FakeEngine.rpc_error is None, FakeEngine.rpc_error

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, stream=False, rid=None):
        self.request = dict(prompt=prompt, input_ids=input_ids, sampling_params=sampling_params, stream=stream)

        async def chunks():
            yield {
                "text": "Hel",
                "output_ids": [1, 2],
                "meta_info": {"finish_reason": None, "prompt_tokens": 3, "completion_tokens": 2},
            }
            yield {
                "text": "lo",
                "output_ids": [3],
                "meta_info": {
                    "finish_reason": {"type": "length", "length": 3},
                    "prompt_tokens": 3,
                    "completion_tokens": 3,
                },
            }

        return chunks()

    def shutdown(self):
        self.stopped = True


@pytest.fixture
def sglang(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=FakeEngine))
    monkeypatch.setattr(engine_mod, "check_plugin_installed", lambda: None)
    monkeypatch.setattr(FakeEngine, "adaptive", True)
    monkeypatch.setattr(FakeEngine, "rpc_error", None)
    monkeypatch.setenv(plugin.ENABLE_ENV, "0")  # restored after the test; start() sets it to 1
    return SGLangOptions(
        model_path="m", draft_model_path="d", spec_max_batch_size=128, adaptive_config_dir=str(tmp_path)
    )


def started(opts):
    eng = engine_mod.SGLangEngine(opts)
    asyncio.run(eng.start())
    return eng, FakeEngine.last


def test_start_launches_sglang_with_our_arguments_and_commands_the_initial_steps(sglang):
    eng, fake = started(sglang)
    assert fake.kwargs["speculative_adaptive"] and fake.kwargs["tp_size"] == 8
    assert fake.rpcs == [(plugin.RPC_METHOD, {"num_steps": 5, "max_batch_size": 128}, False)]  # off the loop thread
    assert engine_mod.os.environ[plugin.ENABLE_ENV] == "1"
    assert eng.load().num_steps == 5


def test_start_fails_loudly_when_sglang_turned_adaptive_speculation_off(sglang, monkeypatch):
    monkeypatch.setattr(FakeEngine, "adaptive", False)
    with pytest.raises(EngineError, match="turned adaptive speculation off"):
        started(sglang)
    assert FakeEngine.last.stopped


def test_start_fails_when_the_schedulers_lack_the_plugin(sglang, monkeypatch):
    monkeypatch.setattr(FakeEngine, "rpc_error", "'Scheduler' object has no attribute 'specserve_set_num_steps'")
    with pytest.raises(EngineError, match="refused specserve_set_num_steps"):
        started(sglang)
    assert FakeEngine.last.stopped


def test_start_fails_before_loading_anything_when_the_entry_point_is_missing(monkeypatch):
    monkeypatch.setattr(engine_mod, "entry_points", lambda group: [])
    with pytest.raises(EngineError, match="sglang.srt.plugins:specserve"):
        engine_mod.check_plugin_installed()


def test_generate_streams_only_new_tokens_and_maps_the_finish_reason(sglang):
    eng, fake = started(sglang)
    request = GenerateRequest(
        "r1", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=3, stop=["\n"], seed=4)
    )

    async def collect():
        return [d async for d in eng.generate(request)]

    deltas = asyncio.run(collect())
    assert [(d.token_ids, d.text, d.finish_reason) for d in deltas] == [([1, 2], "Hel", None), ([3], "lo", "length")]
    assert (deltas[-1].prompt_tokens, deltas[-1].completion_tokens) == (3, 3)
    assert fake.request == {
        "prompt": None,
        "input_ids": [5, 6, 7],
        "stream": True,
        "sampling_params": {
            "max_new_tokens": 3,
            "temperature": 0.0,
            "top_p": 1.0,
            "ignore_eos": False,
            "stop": ["\n"],
            "sampling_seed": 4,
        },
    }
    assert fake.tokenizer_manager.aborted == []


def test_bad_parameters_raise_before_any_streaming(sglang):
    eng, _ = started(sglang)
    with pytest.raises(InvalidRequestError) as err:
        eng.generate(GenerateRequest("r", prompt="hi", params=SamplingParams(top_p=0)))  # no await needed
    assert err.value.param == "top_p"
    with pytest.raises(InvalidRequestError):
        eng.generate(GenerateRequest("r", prompt=""))


def test_a_dropped_stream_aborts_its_request(sglang):
    eng, fake = started(sglang)

    async def first_only():
        stream = eng.generate(GenerateRequest("r2", prompt="hi"))
        await anext(stream)
        await stream.aclose()

    asyncio.run(first_only())
    assert fake.tokenizer_manager.aborted == ["r2"]


def test_set_num_steps_sends_the_command_and_refuses_unknown_step_counts(sglang):
    eng, fake = started(sglang)
    asyncio.run(eng.set_num_steps(0))
    assert fake.rpcs[-1][:2] == (plugin.RPC_METHOD, {"num_steps": 0, "max_batch_size": 128})
    assert eng.load().num_steps == 0
    with pytest.raises(ValueError, match="candidate_steps"):
        asyncio.run(eng.set_num_steps(4))


def test_load_comes_from_sglangs_load_snapshot(sglang):
    eng, _ = started(sglang)
    load = eng.load()
    assert (load.waiting, load.running, load.output_tokens_per_s) == (7, 30, 812.5)
    assert (load.accept_rate, load.mean_accepted_len) == (0.6, 2.8)


def test_shutdown_aborts_running_requests_and_stops_sglang(sglang):
    eng, fake = started(sglang)
    asyncio.run(eng.shutdown())
    assert fake.tokenizer_manager.aborted == ["*"] and fake.stopped
    with pytest.raises(EngineError):
        eng.generate(GenerateRequest("r", prompt="hi"))
