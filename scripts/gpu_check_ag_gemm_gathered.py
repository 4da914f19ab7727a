#!/usr/bin/env python
"""GPU check of ag_gemm's gathered layout (push, push_ws with LAYOUT=gathered, SPLIT_K) on 2 GPUs.

Problems: M = 8, 64, 256, 1000 (global), N = 3584 per rank, K = 8192, bf16, gather rows (and k
at M=64). Configs: every gathered default of the problem plus 16x32x128 split 4 and 64x64x64
split 8 (M=1000's 128-row tiles span both shards). Each case as in scripts/gpu_check_ag_gemm.py (whose
helpers it reuses): 3 eager calls into NaN-poisoned outputs, then a CUDA graph replayed 3 times
with fresh inputs (the split-K tile counts must be back at 0 after every replay), against a
float64 reference. Prints a table; exits 1 on any failure.

Run: `python scripts/gpu_check_ag_gemm_gathered.py` (2 GPUs; about a minute, mostly Triton compiles).
`--cpu` dry-runs the same logic on 2 CPU ranks (interpreter, tiny sizes, no graphs).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checklib  # noqa: E402  (helpers shared by the GPU check scripts)
import gpu_check_ag_gemm as base  # noqa: E402  (its eager / graph case runner)

from autofuse.op import Problem  # noqa: E402
from autofuse.ops.ag_gemm import OP  # noqa: E402
from autofuse.world import spawn  # noqa: E402

GPU_CASES = (("rows", "bfloat16", 8), ("rows", "bfloat16", 64), ("rows", "bfloat16", 256),
             ("rows", "bfloat16", 1000), ("k", "bfloat16", 64))
CPU_CASES = (("rows", "bfloat16", 6), ("k", "float16", 4))


def _gcfg(bm: int, bn: int, bk: int, warps: int, stages: int, split: int, comm: int = 4) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps, "num_stages": stages,
            "FLAG": "shard", "COMM_SMS": comm, "LAYOUT": "gathered", "SPLIT_K": split}


def _configs(problem: Problem, variant: str, tiny: bool) -> list[dict]:
    if tiny:
        extra = [_gcfg(16, 16, 16, 4, 2, 2, 2), _gcfg(16, 16, 16, 4, 2, 1, 3)]
    else:
        extra = [_gcfg(16, 32, 128, 4, 4, 4), _gcfg(64, 64, 64, 4, 3, 8, 8)]
    configs = [c for c in OP.variant(variant).defaults(problem) if c.get("LAYOUT") == "gathered"]
    return configs + [c for c in extra if OP.variant(variant).check(problem, c) is None and c not in configs]


def rank_main(world, cpu: bool) -> list[dict]:
    rows: list[dict] = []
    n, k = (32, 64) if cpu else (3584, 8192)
    for gather, dtype, m in CPU_CASES if cpu else GPU_CASES:
        problem = Problem.make("ag_gemm", dtype, world.size, M=m, N=n, K=k, gather=gather)
        data = {s: (OP.inputs(world, problem, s), OP.reference(world, problem, s)) for s in (1, 2, 3, 4)}
        for variant in ("push", "push_ws"):
            for config in _configs(problem, variant, cpu):
                row = base._run_case(world, problem, variant, config, data)
                row["flag"] = f"split{config.get('SPLIT_K', 1)}"
                rows.append(row)
                if row.pop("abort", False):  # flags may be out of step: stop rather than hang
                    return rows
        del data
        if world.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="dry run on 2 CPU ranks (interpreter, tiny sizes)")
    args = ap.parse_args()
    if not args.cpu and (not torch.cuda.is_available() or torch.cuda.device_count() < 2):
        print("needs 2 CUDA GPUs (or --cpu for a dry run)")
        return 2
    t0 = time.perf_counter()
    results = spawn(rank_main, 2, args.cpu, device_kind="cpu" if args.cpu else "cuda", timeout_s=600)
    return checklib.report(results, t0, [("problem", "problem", 54), ("variant", "variant", 8), ("flag", "split", 7), ("blocks", "blocks", 11)])


if __name__ == "__main__":
    sys.exit(main())
