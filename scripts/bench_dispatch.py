"""CPU cost of a cached autofuse dispatch: `autofuse.<op>(...)` against calling its runner directly.

Per rank, after a warm-up that decides, builds and caches each problem, interleaved batches of
`--calls` back-to-back host calls are timed (time.perf_counter, and the thread's CPU time), with a
device sync and a barrier between batches (untimed). Rows:
- `noop`: an op whose runner returns at once: the pure dispatch overhead (the library-path test, key,
  lookup, call), grad mode on; `noop no_grad`: the same under torch.no_grad() (how servers run).
- `ag_gemm bsp` and `ag_gemm bsp, grad A` / `grad B` (every device; on CPU a small float32 problem
  on one-rank groups, so no cross-process wait blurs the host cost):
  the hot path, and the library path a call takes when its inputs require grad (torch custom op,
  autograd node, dispatch inside; `grad B` also copies out the gathered A it keeps for backward),
  each against the same cached runner.
- one row per variant of `--op` (GPU only; under the CPU interpreter a call takes milliseconds):
  `autofuse.<op>(a, b, variant=v)` against `dispatch.runner_of(...)` of the same cached entry,
  so both run the same runner and kernels; the difference is dispatch.
- `auto`: no override, the policy's choice (or BSP without a policy).
Prints a table, writes JSON, exits 1 if a noop overhead or the median variant overhead > 3 us (the
library path is reported, not limited).

Usage (GPU machine): python scripts/bench_dispatch.py [--world 2] [--op ag_gemm] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

LIMIT_US = 3.0


def _noop_op():
    """An op whose runner returns at once: what a cached call costs beyond its runner."""
    from autofuse.core.op import Op, Problem, Variant

    class Noop(Variant):
        name, family = "bsp", "bsp"

        def runner(self, world, problem, config):
            def run(*inputs, out=None):
                return out
            run.workspaces = ()
            return run

    return Op(name="noop", args=("a", "b"), variants=[Noop()],
              problem_of=lambda world, a, b: Problem.make("noop", a.dtype, world.size, M=a.shape[0], N=b.shape[1]),
              inputs=lambda world, problem, seed: (), reference=lambda world, problem, seed: None,
              tolerance=lambda problem: 0.0, features=lambda problem: {}, sweep=lambda kind, world: [])


def _batch(fn, n: int) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        fn()
    return (time.perf_counter() - w0) * 1e6 / n, (time.thread_time() - c0) * 1e6 / n


def _compare(world, direct, dispatched, calls: int, rounds: int) -> dict:
    for _ in range(3):
        direct()
        dispatched()
    world.sync()
    d_wall, d_cpu, x_wall, x_cpu = [], [], [], []
    for _ in range(rounds):
        w, c = _batch(direct, calls)
        d_wall.append(w)
        d_cpu.append(c)
        world.sync()
        w, c = _batch(dispatched, calls)
        x_wall.append(w)
        x_cpu.append(c)
        world.sync()
    med = statistics.median
    return {"direct_us": med(d_wall), "dispatch_us": med(x_wall), "overhead_us": med(x_wall) - med(d_wall),
            "direct_cpu_us": med(d_cpu), "dispatch_cpu_us": med(x_cpu), "overhead_cpu_us": med(x_cpu) - med(d_cpu)}


def _rank(world, op_name: str, calls: int, rounds: int) -> dict:
    import autofuse
    from autofuse import dispatch
    from autofuse.core import registry
    from autofuse.core.op import Problem

    dispatch.reset()
    rows: dict[str, dict] = {}
    dispatch.STATE.ops["noop"] = _noop_op()
    noop = dispatch.entry_point("noop")  # generated like autofuse.<op>: the real hot path
    a = torch.empty(64, 64, device=world.device)
    noop(a, a, group=world)
    runner = dispatch.runner_of("noop", a, a, group=world)
    rows["noop"] = _compare(world, lambda: runner(a, a), lambda: noop(a, a, group=world), calls, rounds)
    with torch.no_grad():
        rows["noop no_grad"] = _compare(world, lambda: runner(a, a), lambda: noop(a, a, group=world), calls, rounds)
    rows.update(_library_rows(world, calls, rounds))
    if world.device.type == "cuda":
        op = registry.get(op_name)
        entry = getattr(autofuse, op_name)
        problem = min(op.sweep("gpu", world.size), key=lambda p: [v for _, v in p.dims if isinstance(v, int)])
        if op_name == "ag_gemm":
            problem = Problem.make("ag_gemm", "bfloat16", world.size, M=64 * world.size, N=512, K=512, gather="rows")
        inputs = op.inputs(world, problem, 0)
        out = entry(*inputs, group=world)
        rows["problem"] = {"key": problem.key}
        for v in [v for v, var in op.variants.items() if var.available(world)] + [None]:
            entry(*inputs, group=world, variant=v, out=out)
            r = dispatch.runner_of(op_name, *inputs, group=world, variant=v)
            label = v or f"auto ({dispatch.explain(op_name, *inputs, group=world).variant})"
            rows[label] = _compare(world, lambda r=r: r(*inputs, out=out),
                                   lambda v=v: entry(*inputs, group=world, variant=v, out=out), calls, rounds)
    rows["stats"] = dict(vars(dispatch.stats))
    return rows


def _library_rows(world, calls: int, rounds: int) -> dict:
    """ag_gemm bsp on the hot path and on the library path (inputs requiring grad), against its runner."""
    import autofuse
    from autofuse import dispatch

    from autofuse.comm.world import World

    gpu = world.device.type == "cuda"
    if not gpu:  # one rank per group and one thread: waits on other processes would drown the host cost
        world = [World.of_ranks([r]) for r in range(world.size)][world.rank]
        torch.set_num_threads(1)
    m, k, n = (64, 512, 512) if gpu else (16, 64, 64)
    g = torch.Generator(device=world.device).manual_seed(world.rank)
    dt = torch.bfloat16 if gpu else torch.float32
    a = torch.randn(m, k, generator=g, device=world.device).to(dt)
    b = torch.randn(k, n, generator=g, device=world.device).to(dt)
    ga, gb = a.clone().requires_grad_(), b.clone().requires_grad_()
    for x, y in ((a, b), (ga, b), (a, gb)):
        autofuse.ag_gemm(x, y, group=world, variant="bsp")
    r = dispatch.runner_of("ag_gemm", a, b, group=world, variant="bsp")
    rows = {}
    for label, x, y in (("ag_gemm bsp", a, b), ("ag_gemm bsp, grad A", ga, b), ("ag_gemm bsp, grad B", a, gb)):
        call = lambda x=x, y=y: autofuse.ag_gemm(x, y, group=world, variant="bsp")  # noqa: E731
        rows[label] = _compare(world, lambda: r(a, b), call, calls, rounds)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=None, help="ranks (default: every GPU, else 2 CPU ranks)")
    ap.add_argument("--op", default="ag_gemm")
    ap.add_argument("--calls", type=int, default=200, help="calls per timed batch")
    ap.add_argument("--rounds", type=int, default=15, help="timed batches per row and side")
    ap.add_argument("--out", type=Path, default=Path("autofuse-out/bench_dispatch.json"))
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    from autofuse.measure import environment
    from autofuse.comm.world import default_device_kind, gpu_count, spawn

    kind = default_device_kind()
    ranks = args.world or (gpu_count() if kind == "cuda" else 2)
    results = spawn(_rank, ranks, args.op, args.calls, args.rounds)
    labels = [k for k in results[0] if k not in ("stats", "problem")]
    merged = {k: {f: max(r[k][f] for r in results) for f in results[0][k]} for k in labels}  # worst rank
    t = Table(title=f"dispatch overhead per cached call, us (worst of {ranks} ranks; median of {args.rounds} "
                    f"batches of {args.calls} calls)" + (f"; {results[0]['problem']['key']}" if "problem" in results[0] else ""))
    for col in ("row", "direct", "autofuse", "overhead", "CPU direct", "CPU autofuse", "CPU overhead"):
        t.add_column(col, justify="left" if col == "row" else "right")
    for k in labels:
        m = merged[k]
        t.add_row(k, *(f"{m[f]:.2f}" for f in ("direct_us", "dispatch_us", "overhead_us", "direct_cpu_us",
                                                  "dispatch_cpu_us", "overhead_cpu_us")))
    Console().print(t)
    noops = [merged[k]["overhead_us"] for k in labels if k.startswith("noop")]
    real = [merged[k]["overhead_us"] for k in labels if not k.startswith(("noop", "ag_gemm bsp"))]
    ok = max(noops) <= LIMIT_US and (not real or statistics.median(real) <= LIMIT_US)
    report = {"fingerprint": environment.fingerprint(kind), "ranks": ranks, "calls": args.calls,
              "rounds": args.rounds, "limit_us": LIMIT_US, "ok": ok, "rows": merged, "per_rank": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, sort_keys=True, default=str) + "\n")
    print(f"{'PASS' if ok else 'FAIL'}: noop overhead {merged['noop']['overhead_us']:.2f} us"
          + (f", median variant overhead {statistics.median(real):.2f} us" if real else "")
          + f" (limit {LIMIT_US} us); JSON in {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
