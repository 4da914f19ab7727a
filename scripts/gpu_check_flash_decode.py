#!/usr/bin/env python
"""GPU check of `flash_decode` on 2 GPUs: every variant against a float64 reference.

For each case (B = 1, 16; S_r = 1K, 64K; D = 64, 128; bf16, fp16) and every variant/flag
granularity: ragged lengths (one full and one empty sequence per rank), 5 eager calls
alternating two input sets (catches parity-buffer reuse), then a CUDA graph of one call
captured and replayed 3 times with new inputs (and lengths) copied into its buffers.
Outputs are poisoned with NaN before every call. Then (unless --no-time) graph-mode timings:
each variant, the local part, the all-gather, and a device copy of the same bytes.
Prints a table; exits 1 on any failure. Run: `python scripts/gpu_check_flash_decode.py`.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from autofuse import status
from autofuse.op import rel_error
from autofuse.ops import flash_decode as fd
from autofuse.world import spawn

CASES = [(1, 1 << 10, 128, "bfloat16"), (16, 64 << 10, 128, "bfloat16"),
         (16, 1 << 10, 64, "float16"), (1, 64 << 10, 64, "float16")]
VARIANTS = [("bsp", None), ("push", "head"), ("push", "batch"), ("push", "all"), ("push_fused", None)]
CPU_CASES = [(2, 40, 16, "bfloat16"), (1, 24, 32, "float16")]   # --cpu: a dry run of this script's logic
TIMED = [(16, 1 << 10, 128, "bfloat16"), (16, 16 << 10, 128, "bfloat16"), (4, 64 << 10, 128, "bfloat16")]


def _config(name: str, flags: str | None, p) -> dict:
    cfg = fd.OP.variant(name).defaults(p)[0]
    return dict(cfg, flags=flags) if flags else cfg


def _sync(world) -> None:
    if world.device.type == "cuda":
        torch.cuda.synchronize()


def _check_case(world, p) -> list[tuple]:
    rows = []
    sets = [fd.make_inputs(world, p, seed, ragged=True) for seed in (1, 2)]
    refs = [fd.reference(world, p, seed, ragged=True) for seed in (1, 2)]
    tol = fd.OP.tolerance(p)
    for name, flags in VARIANTS:
        label = f"{name}" + (f"[{flags}]" if flags else "")
        runner = fd.OP.variant(name).build(world, p, _config(name, flags, p))
        worst, ok = 0.0, True
        for call in range(5):
            q, k, v, n = sets[call % 2]
            out = torch.full_like(q, float("nan"))
            runner(q, k, v, n, out=out)
            _sync(world)
            status.check(world.heap, f"flash_decode.{name}")
            err = rel_error(out, refs[call % 2])
            worst = max(worst, err)
            ok &= err <= tol
        rows.append((str(p), label, "eager x5", worst, tol, ok))
        if world.device.type != "cuda":
            continue

        q0, k0, v0, n0 = (t.clone() for t in sets[0])
        out = torch.full_like(q0, float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            runner(q0, k0, v0, n0, out=out)
        worst, ok = 0.0, True
        for replay in (1, 0, 1):
            for dst, src in zip((q0, k0, v0, n0), sets[replay]):
                dst.copy_(src)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            status.check(world.heap, f"flash_decode.{name}")
            err = rel_error(out, refs[replay])
            worst = max(worst, err)
            ok &= err <= tol
        rows.append((str(p), label, "graph x3", worst, tol, ok))
        del graph
    return rows


def _graph_us(world, fn, calls: int = 10, reps: int = 7) -> float:
    """Rank-max median time of one call, `calls` calls captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    med = torch.tensor([sorted(times)[len(times) // 2]], device=world.device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med.item())


def _time_case(world, p) -> dict:
    q, k, v, n = fd.make_inputs(world, p, 5, ragged=False)
    res = {}
    for name, flags in [("bsp", None), ("push", "head"), ("push", "all"), ("push_fused", None)]:
        runner = fd.OP.variant(name).build(world, p, _config(name, flags, p))
        out = torch.empty_like(q)
        res[name + (f"[{flags}]" if flags else "")] = _graph_us(world, lambda: runner(q, k, v, n, out=out))
        status.check(world.heap, f"flash_decode.{name}")
    for piece, fn in fd.OP.extra["bound"](world, p, 5).items():
        res[piece] = _graph_us(world, fn)
    res["copy"] = _graph_us(world, fd.OP.extra["copy_rate"](world, p))
    return res


def job(world, timed: bool):
    rows = []
    gpu = world.device.type == "cuda"
    for B, S, D, dtype in CASES if gpu else CPU_CASES:
        rows += _check_case(world, fd.make_problem(world.size, B, S, D=D, dtype=dtype))
    times = []
    if timed and gpu:
        for B, S, D, dtype in TIMED:
            p = fd.make_problem(world.size, B, S, D=D, dtype=dtype)
            times.append((str(p), fd.kv_bytes(p), _time_case(world, p)))
    return rows, times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-time", action="store_true", help="skip the graph-mode timings")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU ranks (interpreter, tiny cases, no graphs)")
    args = ap.parse_args()
    t0 = time.time()
    results = spawn(job, args.ranks, not args.no_time, device_kind="cpu" if args.cpu else "cuda", timeout_s=300)
    failed = 0
    print(f"{'problem':58} {'variant':18} {'mode':9} {'rel err':>9} {'tol':>8}  result")
    for rank, (rows, _) in enumerate(results):
        for prob, label, mode, err, tol, ok in rows:
            failed += not ok
            if rank == 0 or not ok:
                print(f"{prob:58} {label:18} {mode:9} {err:9.2e} {tol:8.1e}  {'ok' if ok else f'FAIL (rank {rank})'}")
    for prob, nbytes, res in results[0][1]:
        print(f"\n{prob}: graph-mode us per call (rank max)")
        for name, us in res.items():
            print(f"  {name:18} {us:9.1f}")
        print(f"  local part reads {nbytes / res['local'] / 1e3:.0f} GB/s; copy of the same bytes "
              f"{2 * nbytes / res['copy'] / 1e3:.0f} GB/s of read+write; "
              f"bsp / push_fused = {res['bsp'] / res['push_fused']:.2f}x")
    print(f"\n{'FAILED' if failed else 'all passed'}: {failed} failing rows, {time.time() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
