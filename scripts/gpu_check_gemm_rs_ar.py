#!/usr/bin/env python
"""GPU check of `gemm_rs` and `gemm_ar` on 2 GPUs: every variant x dtype against a float64 reference.

Problems: M = 4096, 1000, 128 (global; largest first so the shared workspaces are allocated once),
N = 8192, K = 14336 (7168 per rank), bf16 / fp16 / fp32. Variants: gemm_rs bsp, torch_symm (where
torch has it), push_last, push_reducer; gemm_ar bsp, one_shot, two_shot. Fused variants run a
BLOCK 64x128x64 config valid at every size (PARTIAL fp32/out and push_reducer's FLAG_GRAN
tile/row_block rotate over variant and dtype), and for bf16 at M=4096 also their first default
config (the large tiles the bench uses). Per case: 3 eager calls alternating inputs into
NaN-poisoned outputs, then one call captured in a CUDA graph (warm-up on a side stream) and
replayed 3 times with fresh inputs copied into its buffers between replays. References are float64
matmuls on the GPU. gemm_ar's fused variants must also return bitwise the same matrix on both
ranks. Prints a table; exits 1 on any failure (torch_symm failing is reported as n/a).

Run: `python scripts/gpu_check_gemm_rs_ar.py` (2 GPUs; about a minute, most of it Triton compiles
on the first run). `--cpu` dry-runs the same logic on 2 CPU ranks (interpreter, tiny sizes, no graphs).
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

from autofuse import registry, status  # noqa: E402
from autofuse.op import Problem, rel_error  # noqa: E402
from autofuse.world import spawn  # noqa: E402

VARIANTS = {"gemm_rs": ("bsp", "torch_symm", "push_last", "push_reducer"), "gemm_ar": ("bsp", "one_shot", "two_shot")}
PEERS = ("torch_symm",)  # torch's own fused op: failures are reported, not counted
DTYPES = ("bfloat16", "float16", "float32")
GPU_SIZES = ((4096, 8192, 14336), (1000, 8192, 14336), (128, 8192, 14336))
CPU_SIZES = ((40, 40, 48), (2, 24, 16))
SEEDS = (1, 2, 3, 4)


def _check_config(op: str, variant: str, problem: Problem, tiny: bool) -> dict:
    """The small-tile config of a fused case, valid at every size; PARTIAL and FLAG_GRAN rotate."""
    turn = VARIANTS[op].index(variant) + DTYPES.index(problem.dtype)
    bm, bn, bk, stages = (16, 16, 16, 2) if tiny else (64, 128, 64, 3)
    config = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": 4, "num_stages": stages,
              "PARTIAL": ("fp32", "out")[turn % 2]}
    if variant == "push_reducer":
        config.update(FLAG_GRAN=("tile", "row_block")[(turn // 2) % 2], REDUCERS=8 if tiny else 64)
    return config


def _cases(op: str, problem: Problem, tiny: bool) -> list[tuple[str, dict]]:
    cases: list[tuple[str, dict]] = []
    for v in VARIANTS[op]:
        if not registry.get(op).variant(v).fused:
            cases.append((v, {}))
            continue
        cases.append((v, _check_config(op, v, problem, tiny)))
        if not tiny and problem.dtype == "bfloat16" and problem["M"] == 4096:
            cases.append((v, registry.get(op).variant(v).defaults(problem)[0]))
    return cases






def _out_shape(op: str, problem: Problem) -> tuple[int, int]:
    return (problem["M"] // problem.world if op == "gemm_rs" else problem["M"], problem["N"])


def _bits(t: torch.Tensor) -> int:
    """A checksum of the exact bits (to compare ranks' gemm_ar outputs)."""
    as_int = t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)
    return int(as_int.to(torch.int64).sum().item())


def _eager(world, op, runner, problem, data, name) -> tuple[float, int]:
    worst, bits = 0.0, 0
    for seed in (1, 2, 1):
        (a, b), ref = data[seed]
        out = torch.full(_out_shape(op, problem), math.nan, dtype=problem.torch_dtype, device=world.device)
        runner(a, b, out=out)
        checklib.sync(world)
        status.check(world.heap, name)
        worst = max(worst, rel_error(out, ref))
        bits = _bits(out)
    return worst, bits






def _describe(config: dict) -> str:
    if not config:
        return ""
    text = "x".join(str(config[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) + f" {config['PARTIAL']}"
    return text + (f" {config['FLAG_GRAN']}" if "FLAG_GRAN" in config else "")


def _run_case(world, op, problem, variant, config, data) -> dict:
    opdef = registry.get(op)
    row = {"problem": problem.key, "variant": variant, "config": _describe(config), "eager": math.nan,
           "graph": math.nan, "tol": opdef.tolerance(problem), "status": "ok", "why": "", "bits": 0,
           "fused": opdef.variant(variant).fused}
    v = opdef.variant(variant)
    if not v.available(world):
        row.update(status="skip", why=f"not available on {world.device.type}")
        return row
    name = f"{op}.{variant}"
    t0 = time.perf_counter()
    error = ""
    try:
        runner = v.build(world, problem, config)
        row["eager"], row["bits"] = _eager(world, op, runner, problem, data, name)
    except Exception as exc:  # reported, and the ranks agree to stop or go on below
        error = f"{type(exc).__name__}: {exc}"
    if checklib.agree_any(world, bool(error)):
        row.update(status="n/a" if variant in PEERS else "FAIL", why=error or "failed on the other rank")
        row["abort"] = variant not in PEERS
        return row
    if world.device.type == "cuda":
        out = torch.full(_out_shape(op, problem), math.nan, dtype=problem.torch_dtype, device=world.device)
        checklib.graph_check(world, row, runner, data, out, name, optional=variant in PEERS)
    return checklib.finish(row, t0)


def rank_main(world, cpu: bool, ops: list[str], dtypes: list[str], variants: list[str]) -> list[dict]:
    rows: list[dict] = []
    for op in ops:
        opdef = registry.get(op)
        for dtype in dtypes:
            for m, n, k in (CPU_SIZES if cpu else GPU_SIZES):
                problem = Problem.make(op, dtype, world.size, M=m, N=n, K=k)
                data = {s: (opdef.inputs(world, problem, s), opdef.reference(world, problem, s)) for s in SEEDS}
                for variant, config in _cases(op, problem, cpu):
                    if variant not in variants:
                        continue
                    row = _run_case(world, op, problem, variant, config, data)
                    rows.append(row)
                    if row.pop("abort", False):  # flags may be out of step: stop rather than hang
                        return rows
                del data
                if world.device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _same_bits(r0: dict, r1: dict) -> str | None:
    """gemm_ar's fused variants must return bitwise the same matrix on every rank."""
    if r0["problem"].startswith("gemm_ar") and r0["fused"] and r0["bits"] != r1["bits"]:
        return "ranks returned different bits"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="dry run on 2 CPU ranks (interpreter, tiny sizes)")
    ap.add_argument("--ops", default="gemm_rs,gemm_ar")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--variants", default=",".join(sorted({v for vs in VARIANTS.values() for v in vs})))
    args = ap.parse_args()
    if not args.cpu and (not torch.cuda.is_available() or torch.cuda.device_count() < 2):
        print("needs 2 CUDA GPUs (or --cpu for a dry run)")
        return 2
    os.environ.setdefault("AUTOFUSE_HEAP_SIZE", "4G")  # room for both ops' workspaces at M=4096, fp32 partials
    t0 = time.perf_counter()
    results = spawn(rank_main, 2, args.cpu, args.ops.split(","), args.dtypes.split(","), args.variants.split(","),
                    device_kind="cpu" if args.cpu else "cuda", timeout_s=1200)
    return checklib.report(results, t0, [("problem", "problem", 42), ("variant", "variant", 12), ("config", "config", 24)], extra_check=_same_bits)


if __name__ == "__main__":
    sys.exit(main())
