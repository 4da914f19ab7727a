#!/usr/bin/env python
"""GPU check of `ag_gemm` on 2 GPUs: every variant x gather form x dtype against a float64 reference.

Problems: M = 8, 1000, 4096 (global), N = 3584 per rank, K = 8192, gather rows and k, bf16 / fp16 /
fp32. Variants: bsp, torch_symm (where torch has it), pull, push, push_ws. Fused variants run a
BLOCK 16x128x64 config valid at every size (the flag granularity rotates over variant, form and
dtype, so each (variant, form) sees tile, row_block and shard), and for bf16 at M=4096 also their
first default config (the large tiles the bench uses). Per case: 3 eager calls alternating inputs
into NaN-poisoned outputs, then one call captured in a CUDA graph (warm-up on a side stream) and
replayed 3 times with fresh inputs copied into its buffers between replays. References are
float64 matmuls on the GPU. Prints a table; exits 1 on any failure.

Run: `python scripts/gpu_check_ag_gemm.py` (2 GPUs; about a minute, most of it Triton compiles on
the first run). `--cpu` dry-runs the same logic on 2 CPU ranks (interpreter, tiny sizes, no graphs).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checklib  # noqa: E402  (helpers shared by the GPU check scripts)

from autofuse import status  # noqa: E402
from autofuse.op import Problem, rel_error  # noqa: E402
from autofuse.ops.ag_gemm import OP  # noqa: E402
from autofuse.world import spawn  # noqa: E402

VARIANTS = ("bsp", "torch_symm", "pull", "push", "push_ws")
FUSED = ("pull", "push", "push_ws")
DTYPES = ("bfloat16", "float16", "float32")
GATHERS = ("rows", "k")
GPU_SIZES = ((8, 3584, 8192), (1000, 3584, 8192), (4096, 3584, 8192))
CPU_SIZES = ((2, 32, 64), (24, 48, 64))


def _check_config(problem: Problem, variant: str, tiny: bool) -> dict:
    """The rotating-flag small-tile config of a fused case."""
    flag = ("tile", "row_block", "shard")[(FUSED.index(variant) + GATHERS.index(problem["gather"])
                                          + DTYPES.index(problem.dtype)) % 3]
    bn, bk, stages, comm = (16, 16, 2, 2) if tiny else (128, 64, 3, 4)
    return {"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 4, "num_warps": 4, "num_stages": stages,
            "FLAG": flag, "COMM_SMS": comm}


def _cases(problem: Problem, tiny: bool) -> list[tuple[str, dict]]:
    cases: list[tuple[str, dict]] = [("bsp", {}), ("torch_symm", {})]
    for v in FUSED:
        cases.append((v, _check_config(problem, v, tiny)))
        if not tiny and problem.dtype == "bfloat16" and problem["M"] == 4096:
            cases.append((v, OP.variant(v).defaults(problem)[0]))
    return cases






def _eager(world, runner, problem, data, name) -> float:
    worst = 0.0
    for seed in (1, 2, 1):
        (a, b), ref = data[seed]
        out = torch.full((problem["M"], problem["N"]), math.nan, dtype=problem.torch_dtype, device=world.device)
        runner(a, b, out=out)
        checklib.sync(world)
        status.check(world.heap, name)
        worst = max(worst, rel_error(out, ref))
    return worst






def _run_case(world, problem, variant, config, data) -> dict:
    row = {"problem": problem.key, "variant": variant, "flag": config.get("FLAG", ""),
           "blocks": "x".join(str(config[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) if config else "",
           "eager": math.nan, "graph": math.nan, "tol": OP.tolerance(problem), "status": "ok", "why": ""}
    v = OP.variant(variant)
    if not v.available(world):
        row.update(status="skip", why=f"not available on {world.device.type}")
        return row
    name = f"ag_gemm.{variant}"
    t0 = time.perf_counter()
    error = ""
    try:
        runner = v.build(world, problem, config)
        row["eager"] = _eager(world, runner, problem, data, name)
    except Exception as exc:  # reported, and the ranks agree to stop or go on below
        error = f"{type(exc).__name__}: {exc}"
    if checklib.agree_any(world, bool(error)):
        row.update(status="n/a" if variant == "torch_symm" else "FAIL", why=error or "failed on the other rank")
        row["abort"] = variant != "torch_symm"
        return row
    if world.device.type == "cuda":
        out = torch.full((problem["M"], problem["N"]), math.nan, dtype=problem.torch_dtype, device=world.device)
        checklib.graph_check(world, row, runner, data, out, name, optional=variant == "torch_symm")
    return checklib.finish(row, t0)


def rank_main(world, cpu: bool, dtypes: list[str], gathers: list[str], variants: list[str]) -> list[dict]:
    rows: list[dict] = []
    sizes = CPU_SIZES if cpu else GPU_SIZES
    for gather in gathers:
        for dtype in dtypes:
            for m, n, k in sizes:
                problem = Problem.make("ag_gemm", dtype, world.size, M=m, N=n, K=k, gather=gather)
                data = {s: (OP.inputs(world, problem, s), OP.reference(world, problem, s)) for s in (1, 2, 3, 4)}
                for variant, config in _cases(problem, cpu):
                    if variant not in variants:
                        continue
                    row = _run_case(world, problem, variant, config, data)
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
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--gathers", default=",".join(GATHERS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    if not args.cpu and (not torch.cuda.is_available() or torch.cuda.device_count() < 2):
        print("needs 2 CUDA GPUs (or --cpu for a dry run)")
        return 2
    t0 = time.perf_counter()
    results = spawn(rank_main, 2, args.cpu, args.dtypes.split(","), args.gathers.split(","),
                    args.variants.split(","), device_kind="cpu" if args.cpu else "cuda", timeout_s=1200)
    return checklib.report(results, t0, [("problem", "problem", 54), ("variant", "variant", 10), ("flag", "flag", 9), ("blocks", "blocks", 10)])


if __name__ == "__main__":
    sys.exit(main())
