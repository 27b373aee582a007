"""SGLangEngine against a stand-in ``sglang`` module shaped as sglang's Engine, in the shapes
of the oldest and the newest supported release (the shapes are pinned by
tests/test_sglang_pinned.py; the real engine needs GPUs)."""

import asyncio
import json
import multiprocessing
import signal
import sys
import threading
import time
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from serve_app.engines.base import EngineDeadError, EngineError, GenerateRequest, InvalidRequestError, SamplingParams
from serve_app.engines.sglang import compat, plugin
from serve_app.engines.sglang import engine as engine_mod
from serve_app.engines.sglang.config import SGLangOptions


class FakeTokenizer:
    """The calls SGLangEngine makes of a Hugging Face tokenizer."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class FakeTokenizerManager:
    def __init__(self):
        self.tokenizer = FakeTokenizer()
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
    release = compat.RELEASES[compat.NEWEST]
    hang: threading.Event | None = None  # set: collective_rpc blocks until the event is set
    last = None

    def __init__(self, **kwargs):
        self.kwargs, self.rpcs, self.stopped = kwargs, [], False
        self.tokenizer_manager = FakeTokenizerManager()
        if FakeEngine.release.resolves_server_args:  # the raw field keeps the input
            self.server_args = SimpleNamespace(
                speculative_adaptive=True, resolved_dict=lambda: {"speculative_adaptive": FakeEngine.adaptive}
            )
        else:  # SGLang sets the field itself
            self.server_args = SimpleNamespace(speculative_adaptive=FakeEngine.adaptive)
        FakeEngine.last = self

    def collective_rpc(self, method, **kwargs):
        self.rpcs.append((method, kwargs, threading.current_thread() is threading.main_thread()))
        if FakeEngine.hang is not None:
            FakeEngine.hang.wait()
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
        for proc in getattr(self, "processes", []):
            proc.kill()
            proc.join()


class FakeEngineWithProcesses(FakeEngine):
    """Starts real processes, as SGLang starts its schedulers and detokenizer: exit codes are
    the processes' own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        ctx = multiprocessing.get_context("spawn")  # as SGLang
        self.processes = [ctx.Process(target=time.sleep, args=(60,)) for _ in range(2)]
        self.processes.append(ctx.Process(target=time.sleep, args=(0,)))  # finishes its work: exit code 0
        for proc in self.processes:
            proc.start()


@pytest.fixture(params=[compat.OLDEST, compat.NEWEST])
def sglang(request, monkeypatch, tmp_path):
    release = compat.RELEASES[request.param]
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=FakeEngine))
    monkeypatch.setattr(engine_mod, "check_plugin_installed", lambda: None)
    monkeypatch.setattr(compat, "installed", lambda: release)
    monkeypatch.setattr(FakeEngine, "release", release)
    monkeypatch.setattr(FakeEngine, "adaptive", True)
    monkeypatch.setattr(FakeEngine, "rpc_error", None)
    monkeypatch.setattr(FakeEngine, "hang", None)
    for env in (plugin.ENABLE_ENV, plugin.STATE_DIR_ENV, plugin.STEP_POLICY_ENV):  # start() sets them; restored after
        monkeypatch.setenv(env, "0")
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
    # off the loop thread
    assert fake.rpcs == [(plugin.RPC_METHOD, {"num_steps": 5, "max_batch_size": 128, "adaptive": 0}, False)]
    assert engine_mod.os.environ[plugin.ENABLE_ENV] == "1"
    assert eng.load().num_steps == 5


def test_skipping_the_zero_step_draft_extend_is_an_option_the_engine_processes_inherit(sglang, monkeypatch):
    monkeypatch.setenv(engine_mod.SKIP_ZERO_STEP_DRAFT_EXTEND, "0")  # restored after the test
    started(sglang)
    assert engine_mod.os.environ[engine_mod.SKIP_ZERO_STEP_DRAFT_EXTEND] == "0"  # the default keeps the draft warm
    started(sglang.model_copy(update={"zero_step_draft_extend": False}))
    assert engine_mod.os.environ[engine_mod.SKIP_ZERO_STEP_DRAFT_EXTEND] == "1"


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


def test_start_fails_before_loading_anything_on_an_unsupported_sglang(sglang, monkeypatch):
    monkeypatch.setattr(compat, "installed", lambda: compat.release("0.5.16"))
    FakeEngine.last = None
    with pytest.raises(compat.UnsupportedSGLangError, match="supports sglang 0.5.17 through 0.5.23"):
        started(sglang)
    assert FakeEngine.last is None


def test_versions_outside_the_range_are_refused_and_local_builds_are_read():
    assert compat.release("0.5.17+cu130").controller_takes_policy is False
    assert compat.release("0.5.23.post1").resolves_server_args is True
    for bad in ("0.5.16", "0.5.24", "0.6.0", "nonsense"):
        with pytest.raises(compat.UnsupportedSGLangError):
            compat.release(bad)


def test_start_fails_before_loading_anything_when_the_entry_point_is_missing(monkeypatch):
    monkeypatch.setattr(engine_mod, "entry_points", lambda group: [])
    with pytest.raises(EngineError, match="sglang.srt.plugins:specserve"):
        engine_mod.check_plugin_installed()


def test_generate_streams_only_new_tokens_and_maps_the_finish_reason(sglang):
    eng, fake = started(sglang)
    request = GenerateRequest(
        "r1", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=3, stop=["\n"], seed=4)
    )  # greedy: the seed changes nothing, so it is accepted

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


def test_chat_prompts_and_token_counts_come_from_the_tokenizer_sglang_loaded(sglang):
    eng, _ = started(sglang)
    assert eng.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"
    assert eng.tokenize("abc") == [97, 98, 99]


def test_bad_parameters_raise_before_any_streaming(sglang):
    eng, _ = started(sglang)
    with pytest.raises(InvalidRequestError) as err:
        eng.generate(GenerateRequest("r", prompt="hi", params=SamplingParams(top_p=0)))  # no await needed
    assert err.value.param == "top_p"
    with pytest.raises(InvalidRequestError):
        eng.generate(GenerateRequest("r", prompt=""))


def test_penalties_and_logit_bias_go_to_sglang_and_logprobs_are_refused_naming_them(sglang):
    eng, fake = started(sglang)
    params = SamplingParams(max_tokens=3, presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2,
                            logit_bias={7: 2.5}, echo=True)

    async def collect(request):
        return [d async for d in eng.generate(request)]

    deltas = asyncio.run(collect(GenerateRequest("r", prompt_token_ids=[72, 105], params=params)))
    sent = fake.request["sampling_params"]
    assert (sent["presence_penalty"], sent["frequency_penalty"], sent["repetition_penalty"]) == (0.5, -1.0, 1.2)
    assert sent["logit_bias"] == {"7": 2.5}  # SGLang's keys are strings, as OpenAI's
    assert deltas[0].prompt_text == "Hi" and deltas[1].prompt_text is None  # echo: the prompt once, first
    for name in ("logprobs", "prompt_logprobs", "spec_max_steps"):
        with pytest.raises(InvalidRequestError) as err:
            eng.generate(GenerateRequest("r", prompt="hi", params=SamplingParams(**{name: 1})))
        assert err.value.param == {"spec_max_steps": "speculation.max_steps"}.get(name, name)


def test_a_seed_on_a_sampled_request_is_refused_unless_sglang_runs_deterministic(sglang, tmp_path):
    eng, _ = started(sglang)
    seeded = GenerateRequest("r", prompt="hi", params=SamplingParams(temperature=0.8, seed=7))
    with pytest.raises(InvalidRequestError, match="enable_deterministic_inference") as err:
        eng.generate(seeded)
    assert err.value.param == "seed"
    deterministic = sglang.model_copy(update={"extra_server_args": {"enable_deterministic_inference": True}})
    eng, _ = started(deterministic)
    assert eng.generate(seeded) is not None


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
    assert fake.rpcs[-1][:2] == (plugin.RPC_METHOD, {"num_steps": 0, "max_batch_size": 128, "adaptive": 0})
    assert eng.load().num_steps == 0
    with pytest.raises(ValueError, match="candidate_steps"):
        asyncio.run(eng.set_num_steps(4))


def test_the_step_policy_goes_to_the_schedulers_at_start_and_when_changed(sglang):
    eng, fake = started(sglang.model_copy(update={"step_policy": "adaptive"}))
    assert engine_mod.os.environ[plugin.STEP_POLICY_ENV] == "adaptive"
    assert fake.rpcs[-1][1]["adaptive"] == 1
    asyncio.run(eng.set_step_policy("fixed"))
    assert fake.rpcs[-1][:2] == (plugin.RPC_METHOD, {"num_steps": 5, "max_batch_size": 128, "adaptive": 0})
    with pytest.raises(ValueError, match="fixed or adaptive"):
        asyncio.run(eng.set_step_policy("auto"))
    assert fake.rpcs[-1][1]["adaptive"] == 0


def test_load_takes_the_queue_from_sglang_and_the_steps_run_and_recent_acceptance_from_the_plugin(sglang):
    eng, _ = started(sglang)
    load = eng.load()
    assert (load.waiting, load.running, load.output_tokens_per_s) == (7, 30, 812.5)
    assert (load.active_num_steps, load.accept_rate) == (5, 0.0)  # nothing published yet: the command
    # What a scheduler's policy publishes (tests/test_sglang_policy.py writes it through the real controller).
    state = {
        "time": time.time(),
        "commanded": 5,
        "active": 0,
        "window_s": 5.0,
        "recent": {"verified": 10, "proposed": 50, "accepted": 20},
    }
    (Path(eng._state_dir) / "123.json").write_text(json.dumps(state))
    load = eng.load()
    assert (load.num_steps, load.active_num_steps) == (5, 0)  # the guard ran 0 steps
    assert (load.accept_rate, load.mean_accepted_len) == (0.4, 2.0)
    state["time"] -= 60  # nothing verified for a minute: no recent acceptance
    (Path(eng._state_dir) / "123.json").write_text(json.dumps(state))
    assert eng.load().accept_rate == 0.0


def test_a_switch_whose_rpc_hangs_times_out_and_the_engine_keeps_its_steps(sglang):
    eng, fake = started(sglang.model_copy(update={"rpc_timeout_s": 0.2}))
    FakeEngine.hang = threading.Event()

    async def scenario():
        with pytest.raises(engine_mod.SwitchTimeoutError, match="did not answer"):
            await eng.set_num_steps(0)
        assert eng.load().num_steps == 5  # still the last step count
        deltas = [d async for d in eng.generate(GenerateRequest("r", prompt="hi"))]  # still serving
        assert deltas[-1].finish_reason == "length"
        with pytest.raises(engine_mod.SwitchTimeoutError, match="still unanswered"):
            await eng.set_num_steps(0)  # the stuck call still owns the socket: no second call starts
        assert len(fake.rpcs) == 2  # the start-up command and the stuck one
        FakeEngine.hang.set()  # the scheduler answers at last
        FakeEngine.hang = None
        await eng.set_num_steps(0)  # the retry goes through
        assert eng.load().num_steps == 0 and len(fake.rpcs) == 3

    asyncio.run(scenario())


def test_shutdown_aborts_running_requests_and_stops_sglang(sglang):
    eng, fake = started(sglang)
    asyncio.run(eng.shutdown())
    assert fake.tokenizer_manager.aborted == ["*"] and fake.stopped
    with pytest.raises(EngineError):
        eng.generate(GenerateRequest("r", prompt="hi"))


def test_a_process_of_sglangs_that_fails_makes_the_engine_dead_and_a_shutdown_does_not(sglang, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=FakeEngineWithProcesses))
    eng, fake = started(sglang)
    try:
        assert {p.pid for p in eng._processes} == {p.pid for p in fake.processes}
        fake.processes[2].join(30)
        assert fake.processes[2].exitcode == 0
        eng.check_health()  # one process finished with 0, two run: healthy
        scheduler = fake.processes[1]
        scheduler.kill()
        scheduler.join(30)
        with pytest.raises(EngineDeadError, match=rf"pid {scheduler.pid}\) ended by signal SIGKILL"):
            eng.check_health()
    finally:
        asyncio.run(eng.shutdown())
    eng.check_health()  # shut down: its processes ended on purpose
    assert all(p.exitcode == -signal.SIGKILL for p in fake.processes[:2])
