"""The copy engine beside cuBLAS against torch's symmetric-memory ops, where torch's win (issue 40; GPU machine).

Where torch's fused all-gather + matmul / matmul + reduce-scatter beat autofuse's own best in the shipped 2x H200
table, autofuse's own best moved data with Triton programs (ENGINE=sm: 32-64 SMs taken from the GEMM beside it):
the copy engine had never been measured there. For each problem: bsp, torch_symm, the table's own best and the
hybrids with ENGINE=ce, built, checked against float64 and timed in turns (`measure_in_turns`), one rank per GPU.

    python3 scripts/ce_probe_gpu.py --world 2 --db tuning_db/h200x2.db --out autofuse-out/ce-probe.json
    python3 scripts/ce_probe_gpu.py --cpu --mode eager        # a smoke run: tiny problems, CPU ranks, shm heap
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys

from autofuse.comm.world import spawn
from autofuse.core import registry
from autofuse.core.op import Problem

AG = [(8192, 2048, 4096), (8192, 2048, 5120), (8192, 4096, 4096), (8192, 4096, 5120), (4096, 4096, 3072),
      (8192, 8192, 4096), (8192, 8192, 14336), (8192, 2048, 28672), (8192, 8192, 28672)]  # (K, M, N), rows form
RS = [(28672, 2048, 4096), (14336, 4096, 4096), (10240, 2048, 8192), (28672, 8192, 8192), (57344, 4096, 8192),
      (57344, 8192, 8192)]
SMALL_AG, SMALL_RS = [(32, 16, 32)], [(64, 16, 32)]

CE = {"ENGINE": "ce", "COMM_SMS": 1, "BLOCK": 4096, "num_warps": 4}
OVERLAP = {"FLAG": "shard", "PRIORITY": "high"}


def _candidates(op: str, cpu: bool) -> list[tuple[str, dict]]:
    if op == "ag_gemm":
        ce = dict(CE, ALGO="push")
        out = [("heap_mm", ce), ("heap_mm_overlap", dict(ce, **OVERLAP)),
               ("heap_mm_overlap", dict(ce, FLAG="row_block", CHUNKS=2, PRIORITY="high")),
               ("heap_mm_overlap", dict(ce, **OVERLAP, COMM_SMS=2))]
    else:
        out = [("mm_heap", dict(CE)), ("mm_heap", dict(CE, COMM_SMS=2))]  # mm_heap_overlap is SM-only
    return ([("bsp", {})] if cpu else [("bsp", {}), ("torch_symm", {})]) + out


def _table_best(db: str | None, key: str) -> tuple[str, dict] | None:
    """The stored own best (graph mode, not bsp or torch's) of `key` in `db`, or None."""
    if not db or not os.path.exists(db):
        return None
    with sqlite3.connect(db) as c:
        row = c.execute("select variant, config from measurements where problem=? and mode='graph' and ok=1 and "
                        "variant not in ('bsp', 'torch_symm') order by median_us limit 1", (key,)).fetchone()
    return None if row is None else (row[0], json.loads(row[1]))


def job(world, mode: str, db: str | None, cpu: bool, reps: int, ops: tuple[str, ...], builds: int) -> list[dict]:
    from autofuse.measure.timing import build_checked, measure_in_turns

    rows = []
    for name, shapes in (("ag_gemm", SMALL_AG if cpu else AG), ("gemm_rs", SMALL_RS if cpu else RS)):
        if name not in ops:
            continue
        op = registry.get(name)
        for k, m, n in shapes:
            dims = {"M": m, "N": n, "K": k, **({"gather": "rows"} if name == "ag_gemm" else {})}
            problem = Problem.make(name, "float32" if cpu else "bfloat16", world.size, **dims)
            cands = _candidates(name, cpu)
            best = _table_best(db, problem.key)
            if best is not None:
                cands.insert(2 if not cpu else 1, best)
            cands = [c for c in cands for _ in range(builds if c[1].get("ENGINE") == "ce" else 1)]
            ok, why = [], {}
            for v, c in cands:  # each built and checked alone first: one that fails is reported, not timed
                runner, reason, _ = build_checked(world, op, problem, v, c, 0)
                if runner is None:
                    why[f"{v} {json.dumps(c, sort_keys=True)}"] = reason
                else:
                    ok.append((v, c))
                del runner
            timed = measure_in_turns(world, op, problem, ok, modes=(mode,), reps=reps, rounds=reps)
            row = {"problem": problem.key, "refused": why, "timed": []}
            for (v, c), ms in zip(ok, timed):
                row["timed"].append({"variant": v, "config": c, "us": ms[0].median_us if ms and ms[0].ok else None,
                                     "table_best": best is not None and (v, c) == best})
            rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mode", default="graph")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--db", default=None, help="a tuning database: its own best per problem joins the candidates")
    ap.add_argument("--out", default="autofuse-out/ce-probe.json")
    ap.add_argument("--cpu", action="store_true", help="CPU ranks (interpreter), tiny problems: a smoke run")
    ap.add_argument("--ops", default="ag_gemm,gemm_rs")
    ap.add_argument("--builds", type=int, default=1, help="runners built (and timed in turns) per copy-engine config")
    a = ap.parse_args()
    os.environ.setdefault("AUTOFUSE_ONLINE", "0")
    rows = spawn(job, a.world, a.mode, a.db, a.cpu, a.reps, tuple(a.ops.split(",")), a.builds, device_kind="cpu" if a.cpu else "cuda",
                 timeout_s=1200)[0]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{'problem':52s} {'variant':16s} {'us':>9s}  x torch_symm  config")
    for row in rows:
        ref = next((t["us"] for t in row["timed"] if t["variant"] == "torch_symm"), None)
        for t in sorted(row["timed"], key=lambda t: t["us"] or float("inf")):
            x = f"{ref / t['us']:.3f}" if ref and t["us"] else "-"
            cfg = {k: v for k, v in t["config"].items() if k in ("ENGINE", "ALGO", "COMM_SMS", "FLAG", "CHUNKS")}
            mark = " (table)" if t["table_best"] else ""
            us = f"{t['us']:.1f}" if t["us"] else "failed"
            print(f"{row['problem'][:52]:52s} {t['variant']:16s} {us:>9s}  {x:>11s}  {cfg}{mark}")
        for cand, why in row["refused"].items():
            print(f"{row['problem'][:52]:52s} refused: {cand}: {why[:120]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
