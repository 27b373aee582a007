"""The pinned SGLang release, read from its wheel: where the wheel is, and what we rely on in it.

sglang cannot run (or be installed) on CPU machines, so CI checks our use of it against the
source of the exact wheel we pin: every symbol the plugin and the engine touch must exist
with the signature we call it with (:data:`RELIED_ON`), and every server argument we pass
must be a ``ServerArgs`` field of a type that accepts our value. A new SGLang release that
moves any of them fails these checks with a message naming the symbol. Stdlib + pydantic only.
One file past 300 lines: most of it is the table of what we rely on, :data:`RELIED_ON`.
"""

from __future__ import annotations

import ast
import os
import shutil
import sys
import tempfile
import types
import typing
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_app.engines.sglang.compat import NEWEST, OLDEST, RELEASES, parse

CACHE_ENV = "SPECSERVE_WHEEL_CACHE"
WHEEL_LIST = Path(__file__).resolve().parents[2] / ".ci" / "sglang_wheels.txt"


def wheel_cache_dir() -> Path:
    """Where .ci/fetch_sglang_wheel.sh puts the wheels (same default, same override)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specserve" / "wheels")


def find_wheel(version: str) -> Path | None:
    """The wheel of sglang ``version`` in the fetch script's cache, else None."""
    found = sorted(wheel_cache_dir().glob(f"sglang-{version}-*.whl"))
    return found[0] if found else None


def source_tree(version: str, wheel: Path | None = None) -> Path | None:
    """The wheel's ``.py`` files unpacked (once, beside the wheel); the folder holds ``sglang/``.
    None when the wheel is not there."""
    wheel = wheel or find_wheel(version)
    if wheel is None:
        return None
    dest = wheel.with_name(wheel.name.removesuffix(".whl") + "-py")
    if not dest.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=wheel.parent))
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp, members=[n for n in zf.namelist() if n.startswith("sglang/") and n.endswith(".py")])
        try:
            tmp.rename(dest)
        except OSError:  # another process unpacked it first
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


# -- symbols we rely on ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Symbol:
    """A name in a source file of the wheel, what we expect of it, and why we care.

    ``params``: the parameter names of a function (``*args``/``**kw`` spelled so) as we call
    it. ``value``: the literal a module constant must have. ``contains``: source text the
    definition must contain, as ``ast.unparse`` writes it (the behaviour we rely on).
    ``releases``: the first and last release (inclusive) the symbol applies to.
    """

    file: str
    name: str
    why: str
    params: tuple[str, ...] | None = None
    value: Any = None
    contains: tuple[str, ...] = ()
    releases: tuple[str, str] = (OLDEST, NEWEST)

    def applies_to(self, version: str) -> bool:
        return parse(self.releases[0]) <= parse(version) <= parse(self.releases[1])


_ARS = "sglang/srt/speculative/adaptive_runtime_state.py"
_ASP = "sglang/srt/speculative/adaptive_spec_params.py"
_HOOK = "sglang/srt/arg_groups/speculative_hook.py"
_BUILDS_POLICY = (OLDEST, "0.5.19")  # AdaptiveController(worker, config_path) builds its own policy
_TAKES_POLICY = ("0.5.20", NEWEST)  # AdaptiveController(worker, policy)
_POLICY_METHODS = {
    "candidate_steps": ("self",),
    "set_cuda_graph_bs": ("self", "cuda_graph_bs"),
    "get_steps_for_batch": ("self", "batch_size"),
    "on_verify_complete": ("self", "num_correct_drafts_per_req", "batch_size"),
    "cuda_graph_bs_for_step": ("self", "step"),
}
assert all(RELEASES[v].controller_takes_policy for v in _TAKES_POLICY)
assert not any(RELEASES[v].controller_takes_policy for v in _BUILDS_POLICY)

RELIED_ON: tuple[Symbol, ...] = (
    # The plugin hook: the controller takes (worker, policy), or builds SGLang's policy into
    # self.params; either way it asks self.params before each decode batch.
    Symbol(
        _ARS,
        "AdaptiveController.__init__",
        "plugin wraps it and puts its policy in self.params",
        ("self", "worker", "config_path"),
        contains=("self.params = AdaptiveSpeculativeParams(",),
        releases=_BUILDS_POLICY,
    ),
    Symbol(
        _ARS,
        "AdaptiveController.__init__",
        "plugin wraps it to swap the policy",
        ("self", "worker", "policy"),
        contains=("self.params: AdaptiveSpecPolicy = policy",),
        releases=_TAKES_POLICY,
    ),
    Symbol(
        _ARS,
        "AdaptiveController.activate_step_by_batch",
        "switch point: asks the policy before each decode batch",
        ("self", "batch_size"),
        contains=("self.params.get_steps_for_batch(batch_size)",),
    ),
    Symbol(
        _ARS,
        "AdaptiveController.init_states",
        "builds one runtime state per candidate step",
        ("self", "cuda_graph_bs"),
        contains=("self.candidate_steps", "cuda_graph_bs_for_step"),
    ),
    Symbol(_ARS, "AdaptiveSpecWorker.speculative_num_steps", "plugin reads the worker's initial steps"),
    *(
        Symbol(_ARS, f"AdaptiveSpecPolicy.{m}", "policy protocol", params, releases=_TAKES_POLICY)
        for m, params in _POLICY_METHODS.items()
    ),
    # Before the protocol existed, SGLang's own policy class is what the controller calls.
    *(
        Symbol(_ASP, f"AdaptiveSpeculativeParams.{m}", "the policy's methods", params, releases=_BUILDS_POLICY)
        for m, params in _POLICY_METHODS.items()
    ),
    Symbol(
        "sglang/srt/speculative/eagle_worker_v2.py",
        "EAGLEWorkerV2.__init__",
        "the EAGLE-3 worker builds its controller as AdaptiveController(self, policy)",
        contains=("AdaptiveController(",),
    ),
    Symbol(
        "sglang/srt/speculative/eagle_worker_v2.py",
        "EAGLEWorkerV2.forward_batch_generation",
        "steps are re-chosen at each decode batch",
        contains=("self.activate_step_by_batch(",),
    ),
    Symbol(_ASP, "adaptive_unsupported_reason", "engine reports why adaptive was turned off", ("server_args",)),
    Symbol(_ASP, "_load_adaptive_config", "reads the adaptive config JSON we write", ("cfg_path",)),
    # The RPC path: Engine.collective_rpc -> Scheduler.handle_rpc_request -> getattr(scheduler, method)(**params).
    Symbol(
        "sglang/srt/entrypoints/engine.py",
        "Engine.collective_rpc",
        "set_num_steps sends the command",
        ("self", "method", "**kwargs"),
        contains=("RpcReqInput(method=method, parameters=kwargs)", "assert recv_req.success"),
    ),
    Symbol(
        "sglang/srt/managers/scheduler.py",
        "Scheduler.handle_rpc_request",
        "runs our scheduler method on every TP rank",
        ("self", "recv_req"),
        contains=("getattr(self, recv_req.method)", "func(**recv_req.parameters)", "barrier("),
    ),
    Symbol(
        "sglang/srt/managers/scheduler.py",
        "run_scheduler_process",
        "scheduler processes load plugins first",
        contains=("load_plugins()",),
    ),
    # Plugins: entry points of this group, each called with no arguments.
    Symbol(
        "sglang/srt/plugins/__init__.py", "GENERAL_PLUGINS_GROUP", "our entry-point group", value="sglang.srt.plugins"
    ),
    Symbol(
        "sglang/srt/plugins/__init__.py",
        "load_plugins",
        "calls register() with no arguments",
        (),
        contains=("GENERAL_PLUGINS_GROUP", "func()"),
    ),
    Symbol(
        "sglang/srt/plugins/__init__.py",
        "load_plugins_by_group",
        "SGLANG_PLUGINS filters plugins by entry-point name",
        contains=("SGLANG_PLUGINS", "ep.name not in allowed_set"),
    ),
    # The engine: streaming generation, load snapshot, shutdown, adaptive check.
    Symbol(
        "sglang/srt/entrypoints/engine.py",
        "Engine.async_generate",
        "generate() streams through it",
        contains=("prompt: ", "sampling_params: ", "input_ids: ", "stream: bool", "rid: "),
    ),
    Symbol("sglang/srt/entrypoints/engine.py", "Engine.shutdown", "shutdown()", ("self",)),
    Symbol("sglang/srt/entrypoints/engine.py", "Engine.__init__", "Engine(**server_args)", ("self", "**kwargs")),
    Symbol(
        "sglang/srt/server_args.py",
        "ServerArgs.resolved_dict",
        "checks adaptive is really on",
        ("self",),
        releases=("0.5.19", NEWEST),
    ),
    Symbol(
        _HOOK,
        "_maybe_disable_adaptive",
        "turning adaptive off is a resolution, read through resolved_dict()",
        contains=("declare_resolution(", "speculative_adaptive=False"),
        releases=("0.5.19", NEWEST),
    ),
    Symbol(
        _HOOK,
        "_maybe_disable_adaptive",
        "turning adaptive off sets the field",
        contains=("server_args.speculative_adaptive = False",),
        releases=(OLDEST, "0.5.18"),
    ),
    Symbol(
        "sglang/srt/managers/tokenizer_manager.py",
        "TokenizerManager.init_ipc_channels",
        "load() reads its load snapshot reader",
        contains=("self.load_snapshot_reader = create_load_snapshot_reader(",),
    ),
    Symbol(
        "sglang/srt/managers/tokenizer_manager.py",
        "TokenizerManager.abort_request",
        "aborts a dropped stream / all on shutdown",
        ("self", "rid", "abort_all"),
    ),
    Symbol("sglang/srt/managers/load_snapshot.py", "ShmLoadSnapshotReader.read_all", "load()", ("self",)),
    *(
        Symbol("sglang/srt/managers/load_snapshot.py", f"LoadSnapshot.{f}", "load()")
        for f in ("num_running_reqs", "num_waiting_reqs", "gen_throughput", "speculative")
    ),
    *(
        Symbol("sglang/srt/managers/load_snapshot.py", f"SpeculativeMetrics.{f}", "load()")
        for f in ("accept_length", "accept_rate")
    ),
    *(
        Symbol("sglang/srt/sampling/sampling_params.py", f"SamplingParams.{f}", "sampling_dict()")
        for f in ("max_new_tokens", "temperature", "top_p", "stop", "ignore_eos", "sampling_seed", "stop_token_ids",
                  "min_new_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    ),
    Symbol(
        "sglang/srt/managers/tokenizer_manager.py",
        "TokenizerManager._handle_batch_output",
        "incremental stream chunks carry text, output_ids, meta_info",
        contains=("'text': delta_text", "'output_ids': output_token_ids", "'finish_reason': recv_obj"),
    ),
    Symbol(
        "sglang/srt/speculative/eagle_worker_v2.py",
        "EAGLEWorkerV2.forward_batch_generation",
        "steps=0 still runs draft-extend unless the env flag is set (docs/sglang.md)",
        contains=("SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND", "_build_trivial_verify_input"),
    ),
)


def _find(tree: ast.Module, dotted: str) -> ast.AST | None:
    """A def, class, field or constant by dotted name in a module's AST."""
    node: ast.AST = tree
    for part in dotted.split("."):
        found = None
        for child in getattr(node, "body", []):
            if found is not None:  # the first definition (ServerArgs is a class, then rebound)
                break
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and child.name == part:
                found = child
            elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name) and child.target.id == part:
                found = child
            elif isinstance(child, ast.Assign) and any(isinstance(t, ast.Name) and t.id == part for t in child.targets):
                found = child
        if found is None:
            return None
        node = found
    return node


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    names += [p.arg for p in a.kwonlyargs]
    names += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return tuple(names)


def check_symbols(src: Path, version: str, symbols: tuple[Symbol, ...] = RELIED_ON) -> list[str]:
    """Every way the ``symbols`` of release ``version`` differ from the source tree at ``src``
    (empty: all as we rely on)."""
    problems, trees = [], {}
    for sym in (s for s in symbols if s.applies_to(version)):
        where = f"{sym.file}: {sym.name} ({sym.why})"
        if sym.file not in trees:
            path = src / sym.file
            trees[sym.file] = ast.parse(path.read_text()) if path.is_file() else None
        if trees[sym.file] is None:
            problems.append(f"{where}: file is gone")
            continue
        node = _find(trees[sym.file], sym.name)
        if node is None:
            problems.append(f"{where}: not defined any more")
            continue
        if sym.params is not None:
            got = _params(node) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None
            if got != sym.params:
                problems.append(f"{where}: parameters are {got}, we rely on {sym.params}")
        if sym.value is not None:
            got = ast.literal_eval(node.value) if isinstance(node, ast.Assign | ast.AnnAssign) else None
            if got != sym.value:
                problems.append(f"{where}: value is {got!r}, we rely on {sym.value!r}")
        text = ast.unparse(node)
        problems += [f"{where}: no longer contains {snippet!r}" for snippet in sym.contains if snippet not in text]
    return problems


# -- ServerArgs fields from source ------------------------------------------------------------


def server_arg_types(src: Path) -> dict[str, str]:
    """``ServerArgs`` field name -> type expression, read from the wheel's source.

    Each field is declared ``name: A[<type>, <help>] = default``. Up to 0.5.19 they sit in the
    ``ServerArgs`` dataclass of srt/server_args.py; from 0.5.20 ``ServerArgs`` is assembled from
    the namespace structs listed in its ``_INPUT_NAMESPACES``.
    """
    server_args = ast.parse((src / "sglang/srt/server_args.py").read_text())
    namespaces = _find(server_args, "_INPUT_NAMESPACES")
    if namespaces is None:
        classes = [_find(server_args, "ServerArgs")]
    else:
        wanted = {elt.id for elt in namespaces.value.elts}
        modules = {
            alias.name: node.module
            for node in server_args.body
            if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names
            if alias.name in wanted
        }
        classes = [
            _find(ast.parse((src / (modules[name].replace(".", "/") + ".py")).read_text()), name) for name in wanted
        ]
    if not classes or any(c is None for c in classes):
        raise LookupError("srt/server_args.py: no ServerArgs fields found; ServerArgs is assembled differently now")
    fields: dict[str, str] = {}
    for cls in classes:
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                ann = stmt.annotation
                is_a = isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "A"
                fields[stmt.target.id] = ast.unparse(ann.slice.elts[0] if is_a else ann)
    return fields


_TYPE_NAMES: dict[str, Any] = {
    n: getattr(typing, n) for n in ("Optional", "Union", "Literal", "List", "Dict", "Any", "Tuple")
}
_TYPE_NAMES.update({t.__name__: t for t in (int, float, str, bool, list, dict)}, __builtins__={})


def check_server_args(kwargs: dict[str, Any], field_types: dict[str, Any]) -> list[str]:
    """Every keyword argument that is not a ServerArgs field, or whose value its type rejects.

    ``field_types`` maps field names to types, or to type expressions as read from source.
    """
    from pydantic import TypeAdapter, ValidationError

    problems = []
    for name, value in kwargs.items():
        if name not in field_types:
            problems.append(f"{name}: not a ServerArgs field")
            continue
        tp = field_types[name]
        try:
            tp = eval(tp, dict(_TYPE_NAMES)) if isinstance(tp, str) else tp  # noqa: S307 - the pinned wheel's
        except Exception as e:
            problems.append(f"{name}: cannot read its type {tp!r} ({e})")
            continue
        try:
            TypeAdapter(tp).validate_python(value, strict=True)
        except ValidationError as e:
            problems.append(f"{name}={value!r}: not a {field_types[name]} ({e.errors()[0]['msg']})")
    return problems


# -- importing modules of the wheel without running sglang/__init__.py ----------------------


@contextmanager
def sglang_modules(src: Path) -> Iterator[types.ModuleType]:
    """Make ``import sglang.srt...`` load from ``src`` without sglang/__init__.py (which pulls
    in the whole runtime); every ``sglang`` module is removed again on exit."""
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    for k in saved:
        del sys.modules[k]
    package = types.ModuleType("sglang")
    package.__path__ = [str(src / "sglang")]
    sys.modules["sglang"] = package
    try:
        yield package
    finally:
        for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
            del sys.modules[k]
        sys.modules.update(saved)
