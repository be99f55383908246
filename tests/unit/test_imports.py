"""The package has no import circles (module-level or inside functions): each module's imports of the package's
own modules, read from its syntax tree, form a graph without cycles; so do the subpackages' (``clients``,
``serving.launch``, ``serving.repository``, ...: one node each, a top-level module its own node). Run-time files are
found through :mod:`cosyvoice_triton.resources`, never by climbing from a module's own path."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "cosyvoice_triton"


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


def _graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for name, f in mods.items():
        pkg = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
                mod = ".".join([*base, *([node.module] if node.module else [])])
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(v: str, path: list[str]) -> list[str] | None:
        state[v] = 1
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return [*path[path.index(w):], w]
            if w not in state and (found := visit(w, [*path, w])):
                return found
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v, [v])):
            return found
    return None


def _subpackage(name: str, mods: dict[str, Path]) -> str:
    """The innermost subpackage of a module (itself for a package), or the module itself at the top level."""
    pkg = name if mods[name].name == "__init__.py" else name.rsplit(".", 1)[0]
    return name if pkg == PACKAGE.name else pkg


def _subpackage_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for name, targets in _graph(mods).items():
        graph[_subpackage(name, mods)].update(_subpackage(t, mods) for t in targets)
    return {v: {w for w in ws if w not in (v, PACKAGE.name)} for v, ws in graph.items()}


def test_no_import_circles():
    mods = _modules()
    assert len(mods) > 50
    assert _cycle(_graph(mods)) is None, " -> ".join(_cycle(_graph(mods)))


def test_no_circles_between_subpackages():
    mods = _modules()
    graph = _subpackage_graph(mods)
    assert {"cosyvoice_triton.clients", "cosyvoice_triton.serving.launch",
            "cosyvoice_triton.serving.repository"} <= set(graph)
    assert "cosyvoice_triton.serving.repository" in graph["cosyvoice_triton.serving.launch"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_run_time_files_are_found_through_resources():
    climbing = [f"{name}: {line.strip()}" for name, f in _modules().items() if name != "cosyvoice_triton.resources"
                for line in f.read_text().splitlines() if "__file__" in line and "parents[" in line]
    assert not climbing, "use cosyvoice_triton.resources.path(...):\n" + "\n".join(climbing)


def test_the_check_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_subpackages_are_the_nodes():
    mods = {"cosyvoice_triton": PACKAGE / "__init__.py", "cosyvoice_triton.errors": PACKAGE / "errors.py",
            "cosyvoice_triton.serving": PACKAGE / "serving" / "__init__.py",
            "cosyvoice_triton.serving.marker": PACKAGE / "serving" / "marker.py",
            "cosyvoice_triton.serving.launch.server": PACKAGE / "serving" / "launch" / "server.py"}
    assert [_subpackage(m, mods) for m in mods] == ["cosyvoice_triton", "cosyvoice_triton.errors",
                                                    "cosyvoice_triton.serving", "cosyvoice_triton.serving",
                                                    "cosyvoice_triton.serving.launch"]


def test_test_modules_have_one_name_across_the_suite():
    """The suite's folders are no packages: pytest imports each test module by its file name, so two files of one
    name (say in tests/unit and tests/live) stop ``make test`` at collection ("import file mismatch")."""
    tests = PACKAGE.parent / "tests"
    seen: dict[str, list[str]] = {}
    for f in sorted(tests.rglob("*.py")):
        seen.setdefault(f.name, []).append(str(f.relative_to(tests)))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twice, twice
