"""The package's import structure: one direction of dependency and no cycles, lazy imports included.

plugins <- models <- (export, runtime) <- cli, bench. Every `import` / `from ... import` statement in
the source is read with `ast` (inside functions too), resolved to a g4rt module, and checked: no
package imports a package above or beside it (export and runtime never import each other), and the
module graph has no cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"plugins": 0, "models": 1, "export": 2, "runtime": 2, "cli": 3, "bench": 3}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["g4rt", *parts])


def _modules() -> dict[str, Path]:
    files = [ROOT / "cli.py", *[p for pkg in LAYERS if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py")]]
    return {_module_name(p): p for p in files}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The g4rt modules `name` imports anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            while t and t not in known:  # `import g4rt.plugins.ops` -> the deepest module we have
                t = t.rpartition(".")[0]
            if t.startswith("g4rt.") and t != name:
                found.add(t)
    return found


def _layer(module: str) -> str:
    return module.split(".")[1]


def test_packages_import_one_way_only():
    mods = _modules()
    known = set(mods)
    bad = []
    for name, path in mods.items():
        for dep in _imports(name, path, known):
            a, b = _layer(name), _layer(dep)
            if a != b and LAYERS[b] >= LAYERS[a]:
                bad.append(f"{name} imports {dep}")
    assert not bad, "imports against plugins <- models <- (export, runtime) <- cli/bench:\n" + "\n".join(bad)


def test_no_import_cycles():
    mods = _modules()
    known = set(mods)
    graph = {name: _imports(name, path, known) for name, path in mods.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for dep in graph.get(node, ()):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The walk must catch what the layout forbids, even inside a function or written relatively."""
    mods = _modules()
    known = set(mods) | {"g4rt.runtime.fake"}
    src = tmp_path / "runtime" / "fake.py"
    src.parent.mkdir()
    src.write_text("def f():\n    from ..export import build\n    from g4rt.export.onnx_export import OPSET\n")
    deps = _imports("g4rt.runtime.fake", src, known)
    assert {"g4rt.export.build", "g4rt.export.onnx_export"} <= deps
