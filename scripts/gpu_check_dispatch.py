"""GPU check of runtime dispatch on 2 GPUs: exits 1 on any failure.

For every registered op, on the smallest problem of its GPU sweep:
1. every available variant through its public entry point (`autofuse.<op>(..., variant=v)`), two
   calls each (the second from the cache), against the float64 reference;
2. the default decision (policy from AUTOFUSE_POLICY / models/, else BSP) and its `explain`;
3. each cached variant captured in a CUDA graph and replayed 3 times, checked against the reference;
4. an unseen shape inside a capture raises CaptureMiss, and dispatch still works afterwards;
5. the hot path does no collective after warm-up (dispatch.stats).
Usage: python scripts/gpu_check_dispatch.py
"""
from __future__ import annotations

import math
import sys

import torch


def _smallest(op, world_size: int):
    return min(op.sweep("gpu", world_size), key=lambda p: math.prod(v for _, v in p.dims if isinstance(v, int)))


def _graph(world, fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream(device=world.device)
    side.wait_stream(torch.cuda.current_stream(world.device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(world.device).wait_stream(side)
    torch.cuda.synchronize(world.device)
    world.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize(world.device)
    world.barrier()
    return g


def _rank(world) -> list[tuple[str, bool, str]]:
    import autofuse
    from autofuse import dispatch, registry
    from autofuse.op import rel_error

    dispatch.reset()
    checks: list[tuple[str, bool, str]] = []

    def add(name: str, ok: bool, detail: str = "") -> None:
        checks.append((name, bool(ok), detail))

    for name in registry.names():
        op = registry.get(name)
        entry = getattr(autofuse, name)
        problem = _smallest(op, world.size)
        inputs = op.inputs(world, problem, 11)
        ref = op.reference(world, problem, 11)
        tol = op.tolerance(problem)
        variants = [v for v, var in op.variants.items() if var.available(world)]
        for v in variants + [None]:
            label = f"{name}.{v or 'auto'} {problem.key}"
            try:
                errs = [rel_error(entry(*inputs, group=world, variant=v), ref) for _ in range(2)]
                add(f"{label} eager", max(errs) <= tol, f"rel err {max(errs):.3g} (tol {tol:.3g})")
            except Exception as exc:
                add(f"{label} eager", False, f"{type(exc).__name__}: {exc}")
                continue
            if v is None:
                add(f"{name} explain", True, str(autofuse.explain(name, *inputs, group=world)).replace("\n", " | "))
            try:
                out = entry(*inputs, group=world, variant=v)
                out.fill_(math.nan)
                before = dispatch.stats.collectives
                g = _graph(world, lambda: entry(*inputs, group=world, variant=v, out=out))
                for _ in range(3):
                    g.replay()
                torch.cuda.synchronize(world.device)
                world.barrier()
                err = rel_error(out, ref)
                add(f"{label} graph", err <= tol and dispatch.stats.collectives == before,
                    f"rel err {err:.3g}; collectives during capture {dispatch.stats.collectives - before}")
                del g
            except Exception as exc:
                add(f"{label} graph", False, f"{type(exc).__name__}: {exc}")
        # an unseen shape inside capture: a clear error, nothing captured, dispatch still usable
        other = [p for p in op.sweep("gpu", world.size) if p != problem]
        if other:
            new_inputs = op.inputs(world, other[0], 12)
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    entry(*new_inputs, group=world)
                add(f"{name} capture miss", False, "no error was raised")
            except dispatch.CaptureMiss as exc:
                add(f"{name} capture miss", "warm-up" in str(exc), str(exc)[:80])
            except Exception as exc:
                add(f"{name} capture miss", False, f"{type(exc).__name__}: {exc}")
            torch.cuda.synchronize(world.device)
            world.barrier()
            try:
                err = rel_error(entry(*inputs, group=world), ref)
                add(f"{name} after capture miss", err <= tol, f"rel err {err:.3g}")
            except Exception as exc:
                add(f"{name} after capture miss", False, f"{type(exc).__name__}: {exc}")
    s = dispatch.stats
    add("stats", s.hits > 0 and s.collectives <= s.misses, str(vars(s)))
    return checks


def main() -> int:
    from rich.console import Console
    from rich.table import Table

    from autofuse.world import gpu_count, spawn

    if gpu_count() < 2:
        print("gpu_check_dispatch: needs 2 GPUs")
        return 1
    results = spawn(_rank, 2, device_kind="cuda", timeout_s=300)
    t = Table(title="dispatch on 2 GPUs")
    for col in ("check", "rank 0", "rank 1", "detail (rank 0)"):
        t.add_column(col)
    failed = 0
    for (name, ok0, detail), (_, ok1, _) in zip(*results):
        failed += not (ok0 and ok1)
        t.add_row(name, "ok" if ok0 else "[red]FAIL[/]", "ok" if ok1 else "[red]FAIL[/]", detail[:110])
    Console(width=200).print(t)
    print(f"{'FAIL' if failed else 'PASS'}: {failed} failed checks")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
