"""The tree's layering holds: no module-level import cycle, no upward import (``tpcomm``
never imports ``kda``; neither imports ``engine`` or ``launch``; ``engine`` never imports
``launch``), no import cycle among ``scripts/`` (any import, at module level or in a
function, since scripts import each other late), no package importing a script, no source
file over 600 lines and no ``# fmt: skip`` outside the tests."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("tpcomm", "kda", "engine", "launch")  # each may import only those before it
MAX_LINES = 600


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(mods, name, path) -> set[str]:
    """The tree's modules ``name`` imports at module level (``from p import m``: ``p.m``
    where it is a module, else ``p``)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: None if path.name == "__init__.py" else -1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            subs = {f"{base}.{a.name}" for a in node.names} & set(mods)
            found |= subs if len(subs) == len(node.names) else subs | ({base} & set(mods))
    return found - {name}


def test_no_import_cycle():
    mods = _modules()
    cycles = _cycles({name: _imports(mods, name, path) for name, path in mods.items()})
    assert not cycles, cycles[:5]


def _cycles(graph) -> list[list[str]]:
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return cycles


def _script_imports(scripts, path) -> set[str]:
    """The scripts ``path`` imports anywhere in it (scripts import each other by bare name,
    ``scripts/`` on sys.path)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in scripts)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module in scripts:
            found.add(node.module)
    return found - {path.stem}


def test_no_import_cycle_in_scripts():
    scripts = {p.stem: p for p in (ROOT / "scripts").glob("*.py")}
    graph = {name: _script_imports(scripts, path) for name, path in scripts.items()}
    cycles = _cycles(graph)
    assert not cycles, cycles[:5]


def test_packages_never_import_scripts():
    scripts = {p.stem: p for p in (ROOT / "scripts").glob("*.py")}
    bad = [
        f"{name} -> {dep}"
        for name, path in _modules().items()
        for dep in _script_imports(scripts, path)
        | _script_imports({f"scripts.{s}" for s in scripts}, path)
    ]
    assert not bad, bad


def test_no_upward_import():
    mods = _modules()
    bad = []
    for name, path in mods.items():
        level = PACKAGES.index(name.split(".")[0])
        for dep in _imports(mods, name, path):
            if PACKAGES.index(dep.split(".")[0]) > level:
                bad.append(f"{name} -> {dep}")
    assert not bad, bad


@pytest.mark.parametrize("folder", [*PACKAGES, "scripts"])
def test_files_short_and_formatted(folder):
    for path in sorted((ROOT / folder).rglob("*.py")):
        text = path.read_text()
        assert text.count("\n") <= MAX_LINES, f"{path.name}: over {MAX_LINES} lines"
        assert "# fmt: skip" not in text, f"{path.name}: # fmt: skip"
