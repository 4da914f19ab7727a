"""Where a heap collective's large-message time goes: a wide config sweep and a kernel profile.

`autofuse bench collectives` tries two or three configs per size and keeps the best; when the best
misses a bandwidth target, two questions remain: would another config of the search space reach
it, and is the time the copy kernel's own or the launch's and flags'? For each message size per
rank (default 16M and 64M) this, on every local GPU (2 CPU ranks under the interpreter without one):
- times the library's collective (NCCL) and every config of the grid below that passes
  `collectives.check` (ENGINE sm: ALGO x COMM_SMS x BLOCK x num_warps x CHUNKS; the copy engine
  where the heap allows it), each first checked against the library's result (`bench_collectives.time_config`, as the
  bench does), in graph mode on GPUs (median, rank-max);
- profiles the library's call and the best config's (`kernel_profile.profile_calls`): kernels per
  call with device us, busy time against the measured latency.
Bus bandwidth as `bench collectives` reports it (NCCL's convention).

    python3 scripts/collective_sweep.py --kind all_gather --sizes 16M,64M --out sweep.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

GRID = {"COMM_SMS": (32, 64, 128), "BLOCK": (8192, 16384), "num_warps": (8, 16), "CHUNKS": (1, 4)}
CPU_GRID = {"COMM_SMS": (2,), "BLOCK": (1024,), "num_warps": (4,), "CHUNKS": (1, 2)}
ALGOS = {"all_gather": ("push", "inbox", "pull"), "reduce_scatter": (None,), "all_reduce": ("one_shot", "two_shot")}
TOP = 5  # configs listed per size


def configs(kind: str, cuda: bool) -> list[dict]:
    """The grid: every SM config, then the copy engine's one."""
    grid = GRID if cuda else CPU_GRID
    out = []
    for algo in ALGOS[kind]:
        for values in itertools.product(*grid.values()):
            c = {"ENGINE": "sm", **dict(zip(grid, values))}
            out.append({**c, "ALGO": algo} if algo else c)
    ce = {"ENGINE": "ce", "COMM_SMS": 1, "BLOCK": 4096, "num_warps": 4}
    return out + [{**ce, "ALGO": ALGOS[kind][0]} if ALGOS[kind][0] else ce]


def _sweep_rank(world: Any, kind: str, sizes: list[int], reps: int) -> dict[str, Any]:
    from autofuse.comm import collectives as C
    from autofuse.measure.timing import time_fn
    from autofuse.bench import bench_collectives as B
    from autofuse.bench.kernel_profile import profile_calls

    cuda = world.device.type == "cuda"
    mode = "graph" if cuda else "eager"
    dtype = torch.bfloat16 if cuda else torch.float32
    tol = 2.0 ** -7 if cuda else 1e-5
    g = torch.Generator().manual_seed(4321 + world.rank)
    report: dict[str, Any] = {"kind": kind, "mode": mode, "dtype": str(dtype).split(".")[-1], "world": world.size,
                              "sizes": []}
    for size in sizes:
        shape = B.message_shape(kind, size, dtype.itemsize, world.size, 8192 if cuda else 256)
        nbytes = shape[0] * shape[1] * dtype.itemsize
        busbw = nbytes * B.bus_factor(kind, world.size) / 1e3  # GB/s times us
        x = torch.randn(shape, generator=g).to(dtype).to(world.device)
        lib = B.Library(world, kind, x)
        expected = lib().clone()
        lib_us = time_fn(world, lib, mode, reps=reps).median_us
        rows = []
        for config in configs(kind, cuda):
            us, why = B.time_config(world, kind, x, expected, config, [mode], reps, tol, name=f"sweep.{kind}")
            rows.append({"config": config, "us": us[mode], "error": why, "busbw_GBps": busbw / us[mode]})
            if world.rank == 0:
                print(f"{B.size_text(nbytes)} {B.config_text(config)}: {f'{us[mode]:.1f} us' if not why else why}",
                      flush=True)
        ok = [r for r in rows if not r["error"]]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        entry = {"bytes": nbytes, "library_us": lib_us, "library_busbw_GBps": busbw / lib_us, "rows": rows,
                 "best": best, "library_profile": profile_calls(world, [lib], mode)}
        if best is not None:
            coll = C.build(kind, world, shape[0], shape[1], dtype, best["config"], name=f"sweep.{kind}")
            entry["best_profile"] = profile_calls(world, [B.collective_call(kind, coll, x)], mode)
            coll.check()
        report["sizes"].append(entry)
    return report


def _kernels(profile: dict, top: int = 4) -> str:
    return "; ".join(f"{k['name'][:40]} {k['us']:.1f}" for k in (profile.get("kernels") or [])[:top])


def render(report: dict[str, Any]) -> str:
    from autofuse.bench import bench_collectives as B

    lines = [f"{report['kind']}, {report['mode']} mode, {report['dtype']}, {report['world']} ranks "
             f"(us per call, median, rank-max; bus GB/s as NCCL counts it)"]
    for e in report["sizes"]:
        ok = sorted((r for r in e["rows"] if r["us"] == r["us"]), key=lambda r: r["us"])
        lines.append(f"\n{B.size_text(e['bytes'])} per rank: library {e['library_us']:.1f} us "
                     f"({e['library_busbw_GBps']:.0f} GB/s); {len(ok)} of {len(e['rows'])} configs ran")
        for r in ok[:TOP]:
            lines.append(f"  {r['us']:8.1f} us {r['busbw_GBps']:5.0f} GB/s  {B.config_text(r['config'])}")
        for name, key, us in (("library", "library_profile", e["library_us"]),
                              ("best", "best_profile", (e["best"] or {}).get("us", math.nan))):
            p = e.get(key) or {}
            if p.get("busy_us") is not None:
                busy = p["busy_us"]
                lines.append(f"  profile {name}: measured {us:.1f} us, device busy {busy:.1f} us "
                             f"({e['bytes'] * B.bus_factor(report['kind'], report['world']) / busy / 1e3:.0f} GB/s "
                             f"while busy), idle {us - busy:.1f} us, {p.get('launches', 0):.1f} launches/call: "
                             f"{_kernels(p)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from autofuse.bench.bench_collectives import KINDS, parse_sizes
    from autofuse.comm.world import default_device_kind, gpu_count, spawn

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kind", choices=KINDS, default="all_gather")
    p.add_argument("--sizes", default="", help="bytes per rank, e.g. 16M,64M (default: 16M,64M; 16K,64K on CPU)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--world", type=int, help="ranks (default: every local GPU, 2 on CPU)")
    p.add_argument("--out", type=Path, help="JSON output (never replaces an existing file)")
    a = p.parse_args(argv)
    if a.out is not None and a.out.exists():
        p.error(f"{a.out} exists; choose another --out")
    kind = default_device_kind()
    cuda = kind == "cuda"
    sizes = parse_sizes([a.sizes] if a.sizes else None) or ([16 << 20, 64 << 20] if cuda else [16 << 10, 64 << 10])
    world = a.world or (gpu_count() if cuda else 2)
    if world < 2:
        p.error("a collective needs at least 2 ranks")
    if not cuda:
        print("CPU emulation (Triton interpreter, gloo): the timings are not a GPU's", file=sys.stderr)
    report = spawn(_sweep_rank, world, a.kind, sizes, a.reps if cuda else min(a.reps, 3), device_kind=kind,
                   timeout_s=3000)[0]
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
