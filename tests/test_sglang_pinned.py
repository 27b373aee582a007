"""Drift guard: what we use of SGLang exists in every supported release's wheel, as we use it.

The wheels come from .ci/fetch_sglang_wheel.sh (.ci/sglang_wheels.txt lists them). Each test
that takes ``sglang_src`` runs once per release. In CI (CI=true) a missing wheel fails these
tests; elsewhere they skip and say how to fetch it.
"""

import ast
import inspect
import shutil
import typing
from pathlib import Path

import pytest

from serve_app.engines.sglang import plugin, policy
from serve_app.engines.sglang.compat import RELEASES
from serve_app.engines.sglang.config import SGLangOptions, build_server_args
from serve_app.tools.sglang_pins import (
    WHEEL_LIST,
    check_server_args,
    check_symbols,
    server_arg_types,
    sglang_modules,
)


def option_variants(tmp_path):
    base = {"model_path": "meta-llama/Llama-3.1-70B-Instruct", "draft_model_path": "some/eagle3-draft"}
    yield SGLangOptions(**base, adaptive_config_dir=str(tmp_path))
    yield SGLangOptions(
        **base,
        adaptive_config_dir=str(tmp_path),
        candidate_steps=[0, 1, 3, 7],
        initial_steps=3,
        mem_fraction_static=0.85,
        nccl_port=31000,
        context_length=8192,
        max_running_requests=256,
        enable_metrics=False,
        extra_server_args={"log_level": "info", "trust_remote_code": True, "cuda_graph_max_bs_decode": 256},
    )


def test_every_sglang_symbol_we_rely_on_is_in_each_supported_wheel(sglang_src, sglang_release):
    problems = check_symbols(sglang_src, sglang_release)
    assert not problems, f"sglang {sglang_release} no longer matches what specserve uses:\n  " + "\n  ".join(problems)


def test_the_wheel_list_holds_exactly_the_supported_releases():
    listed = [line.split()[0] for line in WHEEL_LIST.read_text().splitlines() if line and not line.startswith("#")]
    assert listed == sorted(RELEASES)


def test_the_drift_guard_names_a_symbol_whose_signature_moved(sglang_src, sglang_release, tmp_path):
    moved = tmp_path / "sglang/srt/speculative/adaptive_runtime_state.py"
    moved.parent.mkdir(parents=True)
    shutil.copy(sglang_src / "sglang/srt/speculative/adaptive_runtime_state.py", moved)
    text = moved.read_text()
    moved.write_text(text.replace("self.params.get_steps_for_batch(batch_size)", "self.params.steps(batch_size)"))
    problems = check_symbols(tmp_path, sglang_release)
    assert any("activate_step_by_batch" in p and "no longer contains" in p for p in problems)
    assert any("eagle_worker_v2.py" in p and "file is gone" in p for p in problems)


def test_a_release_whose_controller_changed_how_it_takes_its_policy_is_caught(sglang_src, sglang_release, tmp_path):
    """Each release's controller is checked for the shape compat.RELEASES says it has."""
    src = tmp_path / "sglang/srt/speculative/adaptive_runtime_state.py"
    src.parent.mkdir(parents=True)
    text = (sglang_src / "sglang/srt/speculative/adaptive_runtime_state.py").read_text()
    if RELEASES[sglang_release].controller_takes_policy:
        text = text.replace("policy: AdaptiveSpecPolicy,", "config_path: str | None = None,")
    else:
        text = text.replace("config_path: str | None = None", "policy")
    src.write_text(text)
    problems = check_symbols(tmp_path, sglang_release)
    assert any("AdaptiveController.__init__" in p and "parameters are" in p for p in problems), problems


def test_our_policy_has_every_method_of_the_policy_the_controller_calls(sglang_src, sglang_release):
    """From 0.5.20 the protocol AdaptiveSpecPolicy; before, SGLang's own AdaptiveSpeculativeParams."""
    if RELEASES[sglang_release].controller_takes_policy:
        module, name = "adaptive_runtime_state.py", "AdaptiveSpecPolicy"
    else:
        module, name = "adaptive_spec_params.py", "AdaptiveSpeculativeParams"
    tree = ast.parse((sglang_src / "sglang/srt/speculative" / module).read_text())
    protocol = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    public = [n for n in protocol.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
    assert len(public) == 5, [n.name for n in public]
    for method in public:
        ours = inspect.getattr_static(policy.CommandedStepsPolicy, method.name)
        expected = [a.arg for a in method.args.args]
        if isinstance(ours, property):
            decorators = {getattr(d, "id", None) for d in method.decorator_list}
            assert decorators & {"property", "cached_property"}, method.name
            ours = ours.fget
        assert list(inspect.signature(ours).parameters) == expected, method.name


def test_the_plugin_registers_under_the_group_sglang_loads_and_takes_no_arguments(sglang_src):
    tree = ast.parse((sglang_src / "sglang/srt/plugins/__init__.py").read_text())
    group = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "GENERAL_PLUGINS_GROUP")
    assert plugin.ENTRY_POINT_GROUP == ast.literal_eval(group.value)
    assert not inspect.signature(plugin.register).parameters  # load_plugins() calls func()


def test_every_server_argument_we_pass_is_a_field_of_that_type_in_the_wheel_source(sglang_src, tmp_path):
    types = server_arg_types(sglang_src)
    assert len(types) > 400  # ServerArgs of 0.5.23 has 546 fields: the reader found the namespaces
    for opts in option_variants(tmp_path):
        assert check_server_args(build_server_args(opts), types) == []


def test_a_wrong_type_or_an_unknown_server_argument_is_reported(sglang_src):
    problems = check_server_args({"tp_size": "8", "speculative_adaptiv": True}, server_arg_types(sglang_src))
    assert problems[0].startswith("tp_size='8': not a int")
    assert problems[1] == "speculative_adaptiv: not a ServerArgs field"


def test_server_arguments_against_the_real_ServerArgs_when_it_imports(sglang_src, sglang_release, tmp_path):
    with sglang_modules(sglang_src):
        try:
            from sglang.srt.server_args import ServerArgs
        except ImportError as e:
            pytest.skip(
                f"sglang {sglang_release}'s ServerArgs imports without CUDA but needs msgspec, orjson, pybase64, "
                f"pyzmq and triton, not installed here ({e}); the wheel-source test above covers it"
            )
        hints = typing.get_type_hints(ServerArgs)
        for opts in option_variants(tmp_path):
            kwargs = build_server_args(opts)
            ServerArgs(**kwargs)  # unknown names raise TypeError
            assert check_server_args(kwargs, hints) == []


def test_the_fetch_script_and_the_tests_agree_on_where_the_wheels_are(tmp_path, monkeypatch):
    import subprocess

    from serve_app.tools.sglang_pins import CACHE_ENV, find_wheel

    names = [line.split()[1] for line in WHEEL_LIST.read_text().splitlines() if line and not line.startswith("#")]
    for name in names:
        (tmp_path / name).write_bytes(b"")  # present: the script must not download
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    script = Path(__file__).resolve().parents[1] / ".ci/fetch_sglang_wheel.sh"
    out = subprocess.run([str(script)], capture_output=True, text=True, check=True).stdout.strip()
    assert Path(out) == tmp_path
    assert [find_wheel(v).name for v in sorted(RELEASES)] == names
