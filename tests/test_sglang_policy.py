"""The plugin's policy and hooks, driven by each supported release's real AdaptiveController.

From 0.5.20 adaptive_runtime_state.py imports nothing at run time, so the real controller runs
here as it is; the plugin hands it our policy in place of SGLang's. Up to 0.5.19 the
controller builds SGLang's own policy (AdaptiveSpeculativeParams, which reads our adaptive
config) and the plugin replaces it afterwards: that module imports only
``sglang.srt.utils.log_info_on_rank0`` of SGLang's runtime, which a one-function stand-in
provides (the real utils module pulls in CUDA libraries).
"""

import ast
import json
import sys
import types
from types import SimpleNamespace

import pytest

from serve_app.engines.sglang import compat, plugin
from serve_app.engines.sglang.config import SGLangOptions, write_adaptive_config
from serve_app.engines.sglang.policy import CommandedStepsPolicy, StatePublisher, read_states
from serve_app.tools.sglang_pins import sglang_modules


def runtime_stand_ins() -> None:
    """The two names of SGLang's runtime that adaptive_spec_params imports and its policy class
    never calls into CUDA through: a log helper, and (0.5.19) the server-args views that only
    ``adaptive_unsupported_reason`` uses."""
    utils = types.ModuleType("sglang.srt.utils")
    utils.log_info_on_rank0 = lambda logger, msg: logger.info(msg)
    overrides = types.ModuleType("sglang.srt.arg_groups.overrides")
    overrides.resolved_view = overrides.resolving_view = lambda server_args: server_args
    # 0.5.23's adaptive_spec_params imports these two for adaptive_unsupported_reason alone.
    context = types.ModuleType("sglang.srt.runtime_context")
    context.attn_dp_enabled_of = lambda server_args: False
    spec_info = types.ModuleType("sglang.srt.speculative.spec_info")
    spec_info.SpeculativeAlgorithm = None
    sys.modules.update({m.__name__: m for m in (utils, overrides, context, spec_info)})


@pytest.fixture
def sgl(sglang_src, sglang_release, monkeypatch, tmp_path):
    """The wheel's adaptive_runtime_state module (fresh per test, so patches die with it), with
    the release and a folder for the adaptive config."""
    monkeypatch.setattr(plugin, "policies", [])
    with sglang_modules(sglang_src):
        runtime_stand_ins()
        from sglang.srt.speculative import adaptive_runtime_state

        adaptive_runtime_state.release = compat.RELEASES[sglang_release]
        adaptive_runtime_state.tmp = tmp_path
        yield adaptive_runtime_state


class Worker:
    """An AdaptiveSpecWorker: records the states it builds and the one it runs."""

    def __init__(self, steps):
        self.speculative_num_steps = steps
        self.built = {}
        self.switches = 0

    def build_adaptive_runtime_state(self, speculative_num_steps, speculative_num_draft_tokens, cuda_graph_bs=None):
        self.built[speculative_num_steps] = (speculative_num_draft_tokens, cuda_graph_bs)
        return SimpleNamespace(speculative_num_steps=speculative_num_steps)

    def apply_runtime_state(self, state):
        if state.speculative_num_steps != self.speculative_num_steps:
            self.switches += 1
        self.speculative_num_steps = state.speculative_num_steps


def new_controller(sgl, worker, steps=(0, 3, 5)):
    """A controller built as the release's EAGLEWorkerV2 builds it, with the plugin's hook in."""
    plugin.install_policy_hook(sgl.AdaptiveController, sgl.release)
    opts = SGLangOptions(
        model_path="m", draft_model_path="d", candidate_steps=list(steps), adaptive_config_dir=str(sgl.tmp)
    )
    if sgl.release.controller_takes_policy:  # SGLang passes its policy; the hook reads its candidates
        return sgl.AdaptiveController(worker, SimpleNamespace(candidate_steps=list(opts.candidate_steps)))
    return sgl.AdaptiveController(worker, config_path=str(write_adaptive_config(opts)))


def started(sgl, steps=(0, 3, 5), initial=5, cuda_graph_bs=(1, 2, 4, 8, 16)):
    """A controller as EAGLEWorkerV2 starts it: register the initial state, then init_states."""
    worker = Worker(initial)
    controller = new_controller(sgl, worker, steps)
    controller.register(SimpleNamespace(speculative_num_steps=initial))
    controller.init_states(cuda_graph_bs=list(cuda_graph_bs))
    return worker, controller.params, controller


def test_the_controller_builds_every_step_count_for_every_cuda_graph_batch_size(sgl):
    worker, _, _ = started(sgl)
    assert worker.built == {0: (1, [1, 2, 4, 8, 16]), 3: (4, [1, 2, 4, 8, 16])}  # 5 was registered at start
    assert worker.speculative_num_steps == 5


def test_a_command_takes_effect_at_the_next_decode_batch(sgl):
    worker, policy, controller = started(sgl)
    policy.command(0)
    assert worker.speculative_num_steps == 5  # nothing moves between batches
    controller.activate_step_by_batch(8)
    assert worker.speculative_num_steps == 0
    controller.activate_step_by_batch(8)
    policy.command(3)
    controller.activate_step_by_batch(1)
    assert (worker.speculative_num_steps, worker.switches) == (3, 2)


def test_acceptance_is_recorded_and_the_policy_never_switches_by_itself(sgl):
    worker, policy, controller = started(sgl)
    controller.activate_step_by_batch(4)
    for _ in range(50):  # SGLang's EMA policy would have moved by now
        controller.on_verify_complete([0, 0, 1, 0], batch_size=4)
    assert worker.speculative_num_steps == 5
    assert policy.stats.verifies[5] == 50 and policy.stats.mean_accepted(5) == 0.25


def test_the_batch_size_guard_runs_zero_steps_above_its_limit(sgl):
    worker, policy, controller = started(sgl)
    policy.command(3, max_batch_size=64)
    controller.activate_step_by_batch(64)
    assert worker.speculative_num_steps == 3
    controller.activate_step_by_batch(65)
    assert worker.speculative_num_steps == 0
    controller.activate_step_by_batch(10)
    assert worker.speculative_num_steps == 3


def test_a_step_count_outside_the_candidates_is_refused():
    policy = CommandedStepsPolicy([0, 3, 5], 5)
    with pytest.raises(ValueError, match="not a candidate"):
        policy.command(4)
    assert policy.cuda_graph_bs_for_step(3) is None  # CUDA graphs off: nothing to prune


def test_the_plugin_hook_gives_each_controller_our_policy_and_the_rpc_commands_it(sgl):
    plugin.install_policy_hook(sgl.AdaptiveController, sgl.release)  # idempotent: new_controller installs again
    worker = Worker(5)
    controller = new_controller(sgl, worker)
    assert isinstance(controller.params, CommandedStepsPolicy) and plugin.policies == [controller.params]
    assert controller.candidate_steps == [0, 3, 5]
    controller.register(SimpleNamespace(speculative_num_steps=5))
    controller.init_states(cuda_graph_bs=[1, 2])

    plugin.specserve_set_num_steps(scheduler=None, num_steps=0, max_batch_size=0)
    controller.activate_step_by_batch(2)
    assert worker.speculative_num_steps == 0 and controller.params.max_batch_size is None


def test_the_hook_refuses_a_controller_shaped_for_another_release(sgl):
    other = compat.Release("x", not sgl.release.controller_takes_policy, sgl.release.resolves_server_args)
    with pytest.raises(compat.UnsupportedSGLangError, match="AdaptiveController.__init__"):
        plugin.install_policy_hook(sgl.AdaptiveController, other)


def test_each_policy_publishes_the_steps_it_runs_and_its_recent_acceptance(sgl, tmp_path, monkeypatch):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    monkeypatch.setenv(plugin.STATE_DIR_ENV, str(state_dir))
    worker, policy, controller = started(sgl)
    policy.command(3, max_batch_size=16)
    controller.activate_step_by_batch(8)
    controller.on_verify_complete([3, 1, 2, 0], batch_size=8)
    controller.activate_step_by_batch(32)  # above the guard: 0 steps run, published at once
    (state,) = read_states(state_dir)
    assert (state["commanded"], state["active"], state["last_batch_size"]) == (3, 0, 32)
    assert state["recent"] == {"verified": 4, "proposed": 12, "accepted": 6}


def test_the_rpc_fails_with_a_reason_when_no_adaptive_controller_was_built(monkeypatch):
    monkeypatch.setattr(plugin, "policies", [])
    with pytest.raises(RuntimeError, match="no adaptive controller"):
        plugin.specserve_set_num_steps(None, num_steps=3)


def test_register_does_nothing_unless_the_engine_enabled_it(monkeypatch):
    monkeypatch.delenv(plugin.ENABLE_ENV, raising=False)
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    plugin.register()  # would raise ImportError if it touched sglang
    assert "sglang" not in sys.modules


def test_register_adds_the_scheduler_method_and_the_policy_hook(sglang_src, sglang_release, monkeypatch):
    monkeypatch.setenv(plugin.ENABLE_ENV, "1")
    monkeypatch.setattr(compat, "installed", lambda: compat.RELEASES[sglang_release])
    with sglang_modules(sglang_src):
        runtime_stand_ins()
        # The real scheduler module needs CUDA libraries; a stand-in takes the method.
        scheduler_module = types.ModuleType("sglang.srt.managers.scheduler")
        scheduler_module.Scheduler = type("Scheduler", (), {})
        sys.modules["sglang.srt.managers.scheduler"] = scheduler_module
        plugin.register()
        from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController

        assert getattr(scheduler_module.Scheduler, plugin.RPC_METHOD) is plugin.specserve_set_num_steps
        assert AdaptiveController.__init__._specserve


def load_config_reader(sglang_src):
    """SGLang's own adaptive-config reader, executed from the wheel's source."""
    tree = ast.parse((sglang_src / "sglang/srt/speculative/adaptive_spec_params.py").read_text())
    wanted = {"DEFAULT_ADAPTIVE_CONFIG", "_load_adaptive_config", "resolve_candidate_steps_from_config"}
    body = [
        n
        for n in tree.body
        if getattr(n, "name", None) in wanted or (isinstance(n, ast.AnnAssign) and n.target.id in wanted)
    ]
    namespace = {"json": json}
    exec(compile(ast.Module(body=body, type_ignores=[]), "adaptive_spec_params.py", "exec"), namespace)  # noqa: S102
    return namespace["resolve_candidate_steps_from_config"]


def test_sglang_reads_our_adaptive_config_as_exactly_our_candidate_steps(sglang_src, tmp_path):
    opts = SGLangOptions(
        model_path="m", draft_model_path="d", candidate_steps=[5, 0, 2], adaptive_config_dir=str(tmp_path)
    )
    assert load_config_reader(sglang_src)(str(write_adaptive_config(opts))) == [0, 2, 5]


def test_a_publisher_that_cannot_write_never_breaks_the_scheduler(tmp_path):
    publisher = StatePublisher(tmp_path / "missing-folder")
    policy = CommandedStepsPolicy([0, 3], 3, publisher)
    assert policy.get_steps_for_batch(4) == 3  # the write fails, logged once; the decode batch goes on
    policy.command(0)
    assert policy.get_steps_for_batch(4) == 0


def adaptive_started(sgl, monkeypatch, slots, steps=(0, 1, 3, 5), initial=5, cuda_graph_bs=(1, 2, 4, 8, 16, 32),
                     env="adaptive"):
    """A controller with step_policy adaptive: SGLang's own policy, built from our adaptive
    config by the release's code, inside ours."""
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    monkeypatch.setenv(plugin.STEP_POLICY_ENV, env)
    plugin.install_policy_hook(sgl.AdaptiveController, sgl.release)
    opts = SGLangOptions(model_path="m", draft_model_path="d", candidate_steps=list(steps), step_policy="adaptive",
                         adaptive_slots=slots, adaptive_config_dir=str(sgl.tmp))
    path = str(write_adaptive_config(opts))
    worker = Worker(initial)
    if sgl.release.controller_takes_policy:
        controller = sgl.AdaptiveController(worker, AdaptiveSpeculativeParams(initial, path))
    else:
        controller = sgl.AdaptiveController(worker, config_path=path)
    controller.register(SimpleNamespace(speculative_num_steps=initial))
    controller.init_states(cuda_graph_bs=list(cuda_graph_bs))
    return worker, controller.params, controller


def test_adaptive_sglangs_own_policy_picks_under_the_ceiling(sgl, monkeypatch):
    worker, policy, controller = adaptive_started(sgl, monkeypatch, {1: [1, 3, 5], 16: [0, 1]})
    assert isinstance(policy, CommandedStepsPolicy) and type(policy.inner).__name__ == "AdaptiveSpeculativeParams"
    assert controller.candidate_steps == [0, 1, 3, 5]
    policy.command(3)
    controller.activate_step_by_batch(1)
    assert worker.speculative_num_steps == 3  # SGLang's slot says 5; the ceiling is 3
    controller.activate_step_by_batch(16)
    assert worker.speculative_num_steps == 1  # the batch-size slot of 16 and more picks from [0, 1]
    controller.activate_step_by_batch(2)
    for _ in range(40):  # no draft accepted: SGLang's EMA walks down its slot's candidates
        controller.on_verify_complete([0, 0], batch_size=2)
        controller.activate_step_by_batch(2)
    assert worker.speculative_num_steps == 1  # the small-batch slot's lowest
    for _ in range(60):  # every draft accepted: it climbs back, never past the ceiling
        controller.on_verify_complete([worker.speculative_num_steps] * 2, batch_size=2)
        controller.activate_step_by_batch(2)
    assert worker.speculative_num_steps == 3
    policy.command(0)
    controller.activate_step_by_batch(2)
    assert worker.speculative_num_steps == 0
    controller.on_verify_complete([0, 0], batch_size=2)  # what SGLang's EMA does never passes it
    assert worker.speculative_num_steps == 0


def test_fixed_keeps_sglangs_policy_aside_until_the_rpc_turns_it_on(sgl, monkeypatch):
    monkeypatch.setenv(plugin.STEP_POLICY_ENV, "fixed")
    worker, policy, controller = adaptive_started(sgl, monkeypatch, {1: [1, 3, 5], 16: [0, 1]}, env="fixed")
    assert policy.inner is None and policy.sglang_policy is not None and plugin.policies == [policy]
    controller.activate_step_by_batch(16)
    assert worker.speculative_num_steps == 5  # the command, whatever SGLang's slot says
    plugin.specserve_set_num_steps(None, num_steps=3, max_batch_size=0, adaptive=1)
    controller.activate_step_by_batch(16)
    assert worker.speculative_num_steps == 1  # now SGLang's slot picks, under 3
    plugin.specserve_set_num_steps(None, num_steps=3)  # -1: the policy stays as it is
    controller.activate_step_by_batch(16)
    assert worker.speculative_num_steps == 1
    plugin.specserve_set_num_steps(None, num_steps=3, adaptive=0)
    controller.activate_step_by_batch(16)
    assert worker.speculative_num_steps == 3


def test_adaptive_without_sglangs_policy_is_refused():
    with pytest.raises(ValueError, match="SGLang's own policy"):
        CommandedStepsPolicy([0, 3], 3, adaptive=True)
    policy = CommandedStepsPolicy([0, 3], 3)
    with pytest.raises(ValueError, match="did not build"):
        policy.command(3, adaptive=True)
