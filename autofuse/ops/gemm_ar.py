"""gemm_ar: GEMM then all-reduce (a row-parallel linear whose output every rank keeps), BSP vs fused.

Rank r holds A_r (M x K/W) and B_r (K/W x N) and gets C = sum_q A_q @ B_q (M x N); K % W == 0.

Variants:
- `bsp`: torch.matmul, then the collective library's all_reduce.
- `one_shot`: one kernel; each GEMM tile's partial is pushed to every peer's inbox with an arrival
  counter, and every rank sums the W partials of each tile (latency-optimal, for small M).
- `two_shot`: one kernel; tile t is owned by rank t % W: partials go to the owner (reduce-scatter),
  the owner sums and pushes the reduced tile to every peer (all-gather). Fewer bytes received per
  rank for W > 2, two hops: for large M.

Partials are stored in float32 (`PARTIAL="fp32"`) or the output dtype (`"out"`), summed in float32
in rank order, so every rank returns bitwise the same C. Inputs, GEMM configs and the workspace
cache are shared with gemm_rs (autofuse.ops.gemm_rs).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from autofuse import status
from autofuse.op import Config, InvalidConfig, Op, Problem, Variant
from autofuse.ops import gemm_rs as rs
from autofuse.ops.gemm_rs import GemmRunner, cdiv

NAME = "gemm_ar"
ALIGN = 256


def problem_of(world, a: torch.Tensor, b: torch.Tensor) -> Problem:
    """The gemm_ar Problem of this call: a = A_r (M x K/W), b = B_r (K/W x N)."""
    rs.check_operands(world, a, b, NAME)
    m, k_r = a.shape
    return Problem.make(NAME, a.dtype, world.size, M=int(m), N=int(b.shape[1]), K=int(k_r) * world.size)


def reference(world, problem: Problem, seed: int) -> torch.Tensor:
    return rs.full_product(world, problem, seed, slice(0, problem["M"]))


def tolerance(problem: Problem) -> float:
    """Same bound as gemm_rs (see `autofuse.ops.gemm_rs.tolerance`): the same sums, all rows kept."""
    return rs.tolerance(problem)


def features(problem: Problem) -> dict[str, float]:
    m, n, w = problem["M"], problem["N"], problem.world
    return rs.gemm_features(problem, 2 * (w - 1) / w * m * n * problem.torch_dtype.itemsize)


def sweep(kind: str, world: int) -> list[Problem]:
    return rs.gemm_sweep(NAME, kind, world)


def _shapes(problem: Problem) -> tuple[int, int, int, int]:
    return problem["M"], problem["N"], problem["K"] // problem.world, problem.world


def _check_bsp(problem: Problem, config: Config) -> str | None:
    return f"bsp takes no config, got {config}" if config else None


def _build_bsp(world, problem: Problem, config: Config) -> GemmRunner:
    reason = _check_bsp(problem, config)
    if reason:
        raise InvalidConfig(reason)
    m, n, k_r, _ = _shapes(problem)

    def launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        torch.matmul(a, b, out=target)
        dist.all_reduce(target, group=world.group)
        if target is not out:
            out.copy_(target)

    return GemmRunner(world, problem, (m, k_r), (k_r, n), (m, n), launch)


def _check_fused(problem: Problem, config: Config) -> str | None:
    return rs.check_gemm(problem, config, problem["M"], {})


def _build_fused(world, problem: Problem, config: Config, two_shot: bool) -> GemmRunner:
    from autofuse.kernels import gemm_ar as k

    reason = _check_fused(problem, config)
    if reason:
        raise InvalidConfig(reason)
    m, n, k_r, w = _shapes(problem)
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    tiles = cdiv(m, bm) * cdiv(n, bn)
    pdtype = rs.partial_dtype(problem, config)
    heap, rank = world.heap, world.rank
    spin = status.spin_limit(world.device.type)
    meta = rs.gemm_meta(problem, config)
    grid = (tiles,)
    if two_shot:
        owned = cdiv(tiles, w)
        inbox_bytes = (w - 1) * owned * bm * bn * pdtype.itemsize
        gather_at = cdiv(inbox_bytes, ALIGN) * ALIGN
        ws = rs.workspace(world, NAME, gather_at + tiles * bm * bn * problem.torch_dtype.itemsize, owned + tiles)
        inbox, inbox_half = ws.view(0, pdtype)
        gathered, gathered_half = ws.view(gather_at, problem.torch_dtype)
        counters, flags = ws.counters, ws.counters[owned:]

        def launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
            k.gemm_ar_two_shot_kernel[grid](
                a, b, out, inbox, inbox_half, gathered, gathered_half, counters, flags, ws.half_counters, ws.epoch,
                heap.status, heap.bases, rank, m, n, k_r, *rs.launch_args(a, b, out), spin, **meta)
    else:
        ws = rs.workspace(world, NAME, (w - 1) * tiles * bm * bn * pdtype.itemsize, tiles)
        inbox, inbox_half = ws.view(0, pdtype)

        def launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
            k.gemm_ar_one_shot_kernel[grid](
                a, b, out, inbox, inbox_half, ws.counters, ws.half_counters, ws.epoch, heap.status, heap.bases,
                rank, m, n, k_r, *rs.launch_args(a, b, out), spin, **meta)

    return GemmRunner(world, problem, (m, k_r), (k_r, n), (m, n), launch)


def _defaults(problem: Problem) -> list[Config]:
    tiles = rs.gemm_defaults(problem, problem["M"])
    out = [{**t, "PARTIAL": "fp32"} for t in tiles]
    if problem.dtype != "float32":
        out.append({**tiles[0], "PARTIAL": "out"})
    return out


def bound(world, problem: Problem, seed: int) -> dict[str, Callable[[], Any]]:
    """The pieces of the BSP bound: this rank's matmul alone and the all-reduce alone."""
    a, b = rs.inputs(world, problem, seed)
    c = torch.matmul(a, b)
    return {"matmul": lambda: torch.matmul(a, b, out=c),
            "all_reduce": lambda: dist.all_reduce(c, group=world.group)}


OP = Op(
    name=NAME,
    variants={
        "bsp": Variant("bsp", _build_bsp, check=_check_bsp, fused=False),
        "one_shot": Variant("one_shot", lambda w, p, c: _build_fused(w, p, c, two_shot=False),
                            space=lambda trial, p: rs.gemm_space(trial, {}), defaults=_defaults, check=_check_fused),
        "two_shot": Variant("two_shot", lambda w, p, c: _build_fused(w, p, c, two_shot=True),
                            space=lambda trial, p: rs.gemm_space(trial, {}), defaults=_defaults, check=_check_fused),
    },
    problem_of=problem_of,
    inputs=rs.inputs,
    reference=reference,
    tolerance=tolerance,
    features=features,
    sweep=sweep,
    description="GEMM + all-reduce: A_r (M x K/W) @ B_r (K/W x N) summed over ranks, M x N on every rank",
    extra={"bound": bound},
)
