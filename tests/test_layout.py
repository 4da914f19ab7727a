"""The import rules of docs/DESIGN.md ("Floors and arrows"), held on every module of the package.

Every import counts, also one inside a function: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("optuna", "sklearn", "typer", "rich")  # the tuning, bench and command-line side's libraries


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":
        parts = ["autofuse", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports (`from a import b` counts as a and a.b), relative imports resolved."""
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


FILES = sorted([*ROOT.glob("autofuse/**/*.py"), *ROOT.glob("kernels/*.py")])
IMPORTS = {_module(f): _imports(f) for f in FILES}


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _offenders(floor: tuple[str, ...], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    return {m: sorted(i for i in imps if _within(i, forbidden)) for m, imps in IMPORTS.items()
            if _within(m, floor) and any(_within(i, forbidden) for i in imps)}


FLOORS = ("kernels", "core", "comm", "measure", "ops", "dispatch", "library", "nn", "tuning", "bench", "commands")


def test_the_rules_see_every_floor():
    for floor in FLOORS:
        assert any(_within(m, (f"autofuse.{floor}",)) for m in IMPORTS), floor
    assert "autofuse.core.registry" in IMPORTS["autofuse.dispatch.state"]  # lazy imports are seen


def test_every_folder_is_a_floor_of_the_rules_and_of_design():
    """A new folder under autofuse/ gets its floor here and its row in docs/DESIGN.md's table."""
    folders = {p.name for p in (ROOT / "autofuse").iterdir() if (p / "__init__.py").is_file()} | {"kernels"}
    assert folders == set(FLOORS)
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    for floor in FLOORS:
        assert f"| `{'autofuse/' if floor != 'kernels' else ''}{floor}/" in design, floor


def test_kernels_import_no_host_code():
    hosts = tuple(f"autofuse.{p}" for p in FLOORS if p != "kernels") + ("torch",)
    assert _offenders(("autofuse.kernels",), hosts) == {}


def test_comm_knows_no_op():
    above = ("autofuse.ops", "autofuse.core.registry", "autofuse.measure", "autofuse.dispatch", "autofuse.library",
             "autofuse.tuning", "autofuse.bench", "autofuse.commands", "autofuse.nn")
    assert _offenders(("autofuse.comm",), above) == {}


def test_core_knows_no_comm():
    """core stands below comm: what a runner asks of a World or a workspace is a Protocol of its own
    (autofuse/core/contracts.py), which comm's classes implement (type-only imports count too)."""
    assert _offenders(("autofuse.core",), ("autofuse.comm",)) == {}


TOP = ("autofuse.tuning", "autofuse.bench", "autofuse.commands", "autofuse.cli")


@pytest.mark.parametrize("floor,above", [
    ("autofuse.core", ("autofuse.ops", "autofuse.measure", "autofuse.dispatch", "autofuse.library", "autofuse.nn",
                       *TOP)),
    ("autofuse.measure", ("autofuse.ops", "autofuse.dispatch", "autofuse.library", "autofuse.nn", *TOP)),
    ("autofuse.ops", ("autofuse.dispatch", "autofuse.library", "autofuse.nn", *TOP)),
    ("autofuse.library", ("autofuse.ops", "autofuse.nn", *TOP)),
    ("autofuse.nn", TOP),
    ("autofuse.tuning", ("autofuse.bench", "autofuse.nn", "autofuse.commands", "autofuse.cli")),
    ("autofuse.bench", ("autofuse.commands", "autofuse.cli")),
])
def test_no_floor_imports_one_above(floor, above):
    assert _offenders((floor,), above) == {}


def test_dispatch_reaches_ops_only_through_the_registry():
    assert _offenders(("autofuse.dispatch",), ("autofuse.ops", "autofuse.nn", *TOP)) == {}


def test_dispatch_never_imports_the_custom_op_layer():
    """autofuse.library stands above dispatch (it installs itself there; dispatch loads it by the
    registry's name for it), and reaches ops only through the registry too."""
    assert _offenders(("autofuse.dispatch",), ("autofuse.library",)) == {}
    assert "autofuse.dispatch.entry" in IMPORTS["autofuse.library"]  # the arrow that stays: library -> dispatch


def test_only_the_command_line_imports_commands():
    """autofuse/commands only parses options and calls: what a command needs lives on the floor that owns it."""
    line = ("autofuse.commands", "autofuse.cli", "autofuse.__main__")
    assert {m: sorted(i for i in imps if _within(i, line)) for m, imps in IMPORTS.items()
            if not _within(m, line) and any(_within(i, line) for i in imps)} == {}


def test_only_tuning_bench_and_commands_import_the_heavy_libraries():
    allowed = ("autofuse.tuning", "autofuse.bench", "autofuse.commands", "autofuse.cli")
    offenders = {m: sorted(i for i in imps if _within(i, HEAVY)) for m, imps in IMPORTS.items()
                 if not _within(m, allowed) and any(_within(i, HEAVY) for i in imps)}
    assert offenders == {}


def test_the_package_root_stands_above_nn():
    """`autofuse/__init__.py` hands out dispatch's and nn's names (`autofuse.<op>`, `autofuse.nn`,
    `autofuse.parallelize`): a module of a floor up to nn that imports it climbs back up (nn calls the
    ops through autofuse/nn/public.py; `from autofuse import dispatch` counts, say `autofuse.dispatch`)."""
    below = ("autofuse.kernels", "autofuse.core", "autofuse.comm", "autofuse.measure", "autofuse.ops",
             "autofuse.dispatch", "autofuse.library", "autofuse.nn")
    assert sorted(m for m, imps in IMPORTS.items() if _within(m, below) and "autofuse" in imps) == []
    assert sorted(i for i in IMPORTS["autofuse"] if _within(i, TOP)) == []
    assert {"autofuse.dispatch", "autofuse.nn"} <= IMPORTS["autofuse"]  # the arrows that stay: the root -> dispatch, nn


def _cycles() -> list[set[str]]:
    """The import cycles between modules (strongly connected groups of two or more; a module's import of
    its own package's __init__ is not an edge)."""
    graph = {m: {i for i in imps if i in IMPORTS and i != m and not m.startswith(i + ".")}
             for m, imps in IMPORTS.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = {stack.pop()}
            while v not in group:
                group.add(stack.pop())
            if len(group) > 1:
                found.append(group)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert [sorted(c) for c in _cycles()] == []


@pytest.mark.parametrize("one,other", [("autofuse.comm.heap", "autofuse.comm.world"),
                                       ("autofuse.comm.rounds", "autofuse.comm.world"),
                                       ("autofuse.comm.rounds", "autofuse.comm.workspace"),
                                       ("autofuse.nn.llama", "autofuse.nn.parallelize"),
                                       ("autofuse.core.op", "autofuse.core.runner"),
                                       ("autofuse.core.runner", "autofuse.comm.workspace"),
                                       ("autofuse.dispatch.entry", "autofuse.library")])
def test_removed_cycles_stay_removed(one, other):
    assert not any({one, other} <= c for c in _cycles())
