"""The package layout is the architecture: engines, the serving layer and the control plane
stay apart, tools sit on top, and no module imports itself back through another."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "serve_app"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The serve_app modules ``name`` imports, at module level or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("serve_app"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if not target.startswith("serve_app"):
                continue
            for alias in node.names:  # `from pkg import module` names the module itself
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    return out - {name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else ""


def test_the_import_graph_is_read():
    graph = _graph()
    assert "serve_app.control.policy" in graph["serve_app.control.loop"]
    assert "serve_app.serving.openai_protocol" in graph["serve_app.serving.ingress"]
    assert "serve_app.engines.embedded.model" in graph["serve_app.engines.embedded.eagle"]  # relative import


def test_no_import_cycle():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


# What each part may import of serve_app besides itself and serve_app.strict.
ALLOWED = {
    "engines": {"serve_app.control.steps"},  # the pure per-step choice an engine applies
    "control": set(),
    "serving": {"serve_app.engines", "serve_app.engines.base", "serve_app.engines.config", "serve_app.control"},
}


def test_no_upward_or_sideways_import():
    bad = []
    for module, imported in _graph().items():
        part = _part(module)
        for target in imported:
            if _part(target) in (part, "strict") or target == "serve_app":
                continue
            if part == "tools":
                continue  # tools sit on top of everything
            if part not in ALLOWED or target not in ALLOWED[part]:
                bad.append(f"{module} imports {target}")
    assert not bad, "\n".join(sorted(bad))
