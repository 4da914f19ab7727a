"""DESIGN.md's "Adding an op", held: an op is its kernels module, its op module, its tests and one
registry line. The toy op (tests/_toy_op.py: no kernels module, it launches torch.matmul) is registered
here at test time, and then has a public entry point, a torch custom op, a gradient and a
`torch.compile(fullgraph=True)` graph, with nothing under autofuse/ or kernels/ naming it."""
from __future__ import annotations

import ast
from pathlib import Path

import torch

from autofuse.comm.world import spawn

ROOT = Path(__file__).resolve().parents[1]
NAME = "toy_mm"
TOL = 1e-5
# What adding the toy op took, file by file: its op module, and here one registry line (+ these tests).
NEEDED = {"tests/_toy_op.py", "tests/test_adding_an_op.py"}


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_the_toy_op_needs_its_module_and_one_registry_line():
    package = [*ROOT.glob("autofuse/**/*.py"), *ROOT.glob("kernels/*.py")]
    assert [p for p in package if NAME in p.read_text()] == []  # no edit of library/, dispatch/, or any other
    defining = {str(p.relative_to(ROOT)) for p in ROOT.glob("tests/*.py")
                if "OP = Op(" in p.read_text() and f'NAME = "{NAME}"' in p.read_text()}
    registering = {str(p.relative_to(ROOT)) for p in ROOT.glob("tests/*.py")
                   if 'registry.register(NAME, "_toy_op")' in p.read_text()}
    assert defining | registering == NEEDED and len(registering) == 1
    assert not any(m.startswith(("autofuse.library", "autofuse.dispatch")) for m in _imports(ROOT / "tests/_toy_op.py"))


def _grad_and_compile(world) -> dict:
    import autofuse
    from autofuse import dispatch
    from autofuse.core import registry
    from autofuse.dispatch.policy import Policy

    registry.register(NAME, "_toy_op")  # the one registry line
    dispatch.set_policy(Policy.bsp("adding an op"))
    fn = getattr(autofuse, NAME)
    gen = torch.Generator().manual_seed(world.rank)
    a, b, g = torch.randn(16, 8, generator=gen), torch.randn(8, 4, generator=gen), torch.randn(16, 4, generator=gen)
    ref = [t.double().requires_grad_() for t in (a, b)]
    (ref[0] @ ref[1] * g.double()).sum().backward()

    def run(f) -> list[float]:
        x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
        c = f(x, y)
        (c * g).sum().backward()
        return [float((t.detach().double() - r).norm() / r.norm())
                for t, r in ((c, ref[0].detach() @ ref[1].detach()), (x.grad, ref[0].grad), (y.grad, ref[1].grad))]

    eager = run(lambda x, y: fn(x, y, group=world))
    compiled = run(torch.compile(lambda x, y: fn(x, y, group=world), fullgraph=True, backend="aot_eager"))
    registry.unregister(NAME)
    return {"eager": eager, "compiled": compiled, "custom_op": hasattr(torch.ops.autofuse, NAME)}


def test_a_registered_toy_op_has_gradient_and_compiles_fullgraph():
    for r in spawn(_grad_and_compile, 2, timeout_s=300):
        assert r["custom_op"]
        assert max(r["eager"]) < TOL and max(r["compiled"]) < TOL, r
