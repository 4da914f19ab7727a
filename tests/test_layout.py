"""The import rules of docs/DESIGN.md ("Floors and arrows"), held on every module of the package.

Every import counts, also one inside a function: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("optuna", "sklearn", "typer", "rich")  # the training and command-line side's libraries


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


def test_the_rules_see_every_floor():
    for floor in ("autofuse.kernels", "autofuse.core", "autofuse.comm", "autofuse.measure", "autofuse.ops",
                  "autofuse.dispatch", "autofuse.training", "autofuse.commands", "autofuse.nn"):
        assert any(_within(m, (floor,)) for m in IMPORTS), floor
    assert "autofuse.core.registry" in IMPORTS["autofuse.dispatch.state"]  # lazy imports are seen


def test_kernels_import_no_host_code():
    hosts = tuple(f"autofuse.{p}" for p in ("core", "comm", "measure", "ops", "dispatch", "training", "commands",
                                             "nn")) + ("torch",)
    assert _offenders(("autofuse.kernels",), hosts) == {}


def test_comm_knows_no_op():
    above = ("autofuse.ops", "autofuse.core.registry", "autofuse.measure", "autofuse.dispatch", "autofuse.training",
             "autofuse.commands", "autofuse.nn")
    assert _offenders(("autofuse.comm",), above) == {}


@pytest.mark.parametrize("floor,above", [
    ("autofuse.core", ("autofuse.ops", "autofuse.measure", "autofuse.dispatch", "autofuse.training",
                       "autofuse.commands", "autofuse.nn")),
    ("autofuse.measure", ("autofuse.ops", "autofuse.dispatch", "autofuse.training", "autofuse.commands",
                          "autofuse.nn")),
    ("autofuse.ops", ("autofuse.dispatch", "autofuse.training", "autofuse.commands", "autofuse.nn")),
])
def test_no_floor_imports_one_above(floor, above):
    assert _offenders((floor,), above) == {}


def test_dispatch_reaches_ops_only_through_the_registry():
    assert _offenders(("autofuse.dispatch",), ("autofuse.ops", "autofuse.training", "autofuse.commands",
                                               "autofuse.nn")) == {}


def test_only_training_and_commands_import_the_heavy_libraries():
    allowed = ("autofuse.training", "autofuse.commands", "autofuse.cli")
    offenders = {m: sorted(i for i in imps if _within(i, HEAVY)) for m, imps in IMPORTS.items()
                 if not _within(m, allowed) and any(_within(i, HEAVY) for i in imps)}
    assert offenders == {}
