"""gemm_ar: GEMM then all-reduce (a row-parallel linear whose output every rank keeps).

Rank r holds A_r (M x K/W) and B_r (K/W x N) and gets C = sum_q A_q @ B_q (M x N); K % W == 0.

Variants:
- `bsp`: torch.matmul, then the collective library's all_reduce.
- `torch_symm_one_shot`, `torch_symm_two_shot` (peer): torch.matmul (FP8: torch._scaled_mm) into a
  torch symmetric-memory buffer of the output dtype, then torch's own one-shot / two-shot all-reduce
  on it (`torch.ops.symm_mem`): what vLLM- and SGLang-style custom all-reduce runs; a baseline users
  would otherwise run (CUDA, one GPU per rank, whole-job groups).
- `mm_heap` (hybrid, in this module on autofuse/ops/hybrid.py): torch.matmul into out, then the one-launch heap all-reduce
  in place (autofuse/comm/collectives.py: one-shot or two-shot, same bits on every rank).
- `mm_ll` (hybrid): torch.matmul into out, then the low-latency all-reduce in place
  (autofuse/comm/lowlatency.py: every 32-bit word travels with its epoch, so no flag round trip; the
  same bits as mm_heap's one-shot). For decode sizes, where torch's one-shot all-reduce beat mm_heap
  by 2-8 us (issue 40); at most 4 MB of output per rank.
- `one_shot` (fused): one persistent kernel; each GEMM tile's partial is pushed to every peer's
  inbox with an epoch flag, and every rank sums the W partials of each tile (one hop: small M).
- `two_shot` (fused): tile t is owned by rank t % W: partials go to the owner (reduce-scatter),
  the owner sums and pushes the reduced tile to every peer (all-gather). Two hops, fewer bytes
  received per rank for W > 2: large M.
Partials are float32 (PARTIAL="fp32") or the output dtype ("out"), summed in float32 in rank order,
so every rank returns bitwise the same C (kernels/gemm_ar.py). Shared with gemm_rs:
autofuse/ops/row_parallel.py.

FP8 (`autofuse.gemm_ar(a, b, group=..., scale_a=..., scale_b=...)`, float8_e4m3fn, b = w.t(), see
autofuse/ops/row_parallel.py): bsp is torch._scaled_mm into out (bfloat16), then the all-reduce of
out; mm_heap the same with the heap all-reduce; torch_symm_one_shot / torch_symm_two_shot the same
into their symmetric buffer, then torch's all-reduce of it (passed on two H100, 2026-11-26); the fused
kernels scale each partial tile before it is pushed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from autofuse.core import gemm
from autofuse.core.custom import Backward, CustomOp
from autofuse.comm import collectives, lowlatency
from autofuse.comm.heap import torch_symm_group, torch_symm_unavailable
from autofuse.core.op import Config, Op, Problem, Variant
from autofuse.ops import row_parallel as rp
from autofuse.core.runner import Runner
from autofuse.core.sizes import cdiv
from autofuse.comm.workspace import workspace

if TYPE_CHECKING:
    from autofuse.comm.world import World

NAME = "gemm_ar"


def problem_of(world: World, a: torch.Tensor, b: torch.Tensor, scale_a: Any = None, scale_b: Any = None) -> Problem:
    """The gemm_ar Problem of this call: a = A_r (M x K/W), b = B_r (K/W x N); any M; FP8: the
    rank's scales too (gemm.fp8_dims)."""
    rp.check_operands(world, a, b, NAME)
    extra = gemm.fp8_dims(world.device, a, b, scale_a, scale_b, NAME)
    m, k_r = a.shape
    return Problem.make(NAME, a.dtype, world.size, M=int(m), N=int(b.shape[1]), K=int(k_r) * world.size, **extra)


def reference(world: World, problem: Problem, seed: int) -> torch.Tensor:
    return rp.full_product(world, problem, seed, slice(0, problem["M"]))


def features(problem: Problem) -> dict[str, float]:
    m, n, w = problem["M"], problem["N"], problem.world
    return rp.features(problem, 2 * (w - 1) / w * m * n * problem.out_dtype.itemsize)


def sweep(kind: str, world: int) -> list[Problem]:
    """rp.sweep's kinds; gemm_ar runs at decode sizes (a batch of sequences, one token each)."""
    return rp.sweep(NAME, kind, world, model_m=(1, 8, 32, 128),
                    default={"gpu": (128, 256), "llama3-70b": (1, 8, 32, 128)}, scaling_m=(1, 128))


# -- bsp -----------------------------------------------------------------------------------------------
class BspRunner(Runner):
    def __init__(self, world: World, problem: Problem):
        super().__init__(world, problem, *rp.io_specs(problem, problem["M"]))

    def launch(self, a: torch.Tensor, b: torch.Tensor, *scales: torch.Tensor, out: torch.Tensor) -> None:
        gemm.vendor_mm(a, b, scales, out)
        self.world.collective(dist.all_reduce, out, what="gemm_ar.bsp")


class Bsp(Variant):
    name, family = "bsp", "bsp"

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return BspRunner(world, problem)


# -- peer: torch's symmetric-memory all-reduce ------------------------------------------------------------
class SymmAllReduceRunner(Runner):
    """The rank's partial product into a symmetric buffer of the output dtype (gemm.vendor_mm: torch.matmul,
    or torch._scaled_mm for FP8), then torch.ops.symm_mem's one-shot or two-shot all-reduce on it; the
    buffer is made once, so calls allocate nothing and CUDA graphs capture them."""

    def __init__(self, world: World, problem: Problem, group: str, algo: str):
        import torch.distributed._symmetric_memory as symm

        super().__init__(world, problem, *rp.io_specs(problem, problem["M"]))
        self.group, self.algo = group, algo
        self.buffer = symm.empty((problem["M"], problem["N"]), dtype=problem.out_dtype, device=world.device)
        symm.rendezvous(self.buffer, group)

    def launch(self, a: torch.Tensor, b: torch.Tensor, *scales: torch.Tensor, out: torch.Tensor) -> None:
        gemm.vendor_mm(a, b, scales, self.buffer)
        if self.algo == "one_shot":
            torch.ops.symm_mem.one_shot_all_reduce_out(self.buffer, "sum", self.group, out)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(self.buffer, "sum", self.group)
            out.copy_(self.buffer)


class TorchSymmOneShot(Variant):
    """torch's symmetric-memory one-shot all-reduce after the vendor GEMM (every rank reads every peer's partial)."""

    name, family, algo, torch_op = "torch_symm_one_shot", "peer", "one_shot", "one_shot_all_reduce_out"

    def unavailable(self, world: World) -> str | None:
        return torch_symm_unavailable(world, self.torch_op)

    def check(self, problem: Problem, config: Config) -> str | None:
        """torch's symmetric-memory all-reduce kernels take bfloat16 and float32, not float16 (they raise
        NotImplementedError for 'Half': refused here, before a build or a policy can pick them)."""
        if problem.out_dtype == torch.float16:
            return f"{self.name}: torch's symmetric-memory all-reduce has no float16 kernel"
        return super().check(problem, config)

    def defaults(self, problem: Problem) -> list[Config]:
        """No config to measure where `check` refuses the problem (float16), else the empty one."""
        return [] if self.check(problem, {}) else [{}]

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return SymmAllReduceRunner(world, problem, torch_symm_group(world), self.algo)


class TorchSymmTwoShot(TorchSymmOneShot):
    """torch's symmetric-memory two-shot all-reduce (reduce-scatter then all-gather, in place)."""

    name, algo, torch_op = "torch_symm_two_shot", "two_shot", "two_shot_all_reduce_"


# -- fused: one_shot, two_shot ---------------------------------------------------------------------------
class AllReduceRunner(rp.FusedRunner):
    """kernels/gemm_ar.py's gemm_ar_kernel at one config (one-shot, or two-shot with `two_shot`)."""

    def __init__(self, world: World, problem: Problem, config: Config, two_shot: bool):
        from autofuse.kernels import gemm_ar as k

        w, m, n, k_r = problem.world, problem["M"], problem["N"], problem["K"] // problem.world
        cfg = gemm.GemmConfig.from_dict(config)
        tiles = cfg.tiles(m, n)
        tile_elems = cfg.BLOCK_M * cfg.BLOCK_N
        pdtype = rp.partial_dtype(problem, config)
        boxes = cdiv(tiles, w) if two_shot else tiles       # tiles per inbox slot
        inbox_bytes = rp.align((w - 1) * boxes * tile_elems * pdtype.itemsize)
        gathered_bytes = tiles * tile_elems * problem.out_dtype.itemsize if two_shot else 0
        ws = workspace(world, NAME, inbox_bytes + gathered_bytes, (w - 1) * boxes + (tiles if two_shot else 0))
        super().__init__(world, problem, config, m, ws)
        inbox, inbox_half = ws.data_view(pdtype)
        gathered, gathered_half = ws.data_view(problem.out_dtype, inbox_bytes if two_shot else 0)
        self.kernel = k.gemm_ar_kernel
        self.grid = cfg.grid(m, n, gemm.programs(world.device))
        self.args = (inbox, inbox_half, gathered, gathered_half, ws.flags, ws.half_flags,
                     *rp.split_k_buffers(world, cfg, tiles, inbox))
        self.sizes = (m, n, k_r)
        self.meta["TWO_SHOT"] = two_shot


class OneShot(rp.FusedVariant):
    name = "one_shot"

    def rows(self, problem: Problem) -> int:
        return problem["M"]

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return AllReduceRunner(world, problem, config, two_shot=False)


class TwoShot(OneShot):
    name = "two_shot"

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return AllReduceRunner(world, problem, config, two_shot=True)


# ------------------------------------------------------------------------------------------------
# hybrids (the shared base: autofuse/ops/hybrid.py)
class _ARRunner(Runner):
    """mm_heap of gemm_ar: torch.matmul into out, then the heap all-reduce in place."""

    def __init__(self, world: World, problem: Problem, ar: collectives.AllReduce):
        self.ar = ar
        specs, out = rp.io_specs(problem, problem["M"])
        super().__init__(world, problem, specs, out, workspaces=ar.workspaces)

    def launch(self, a: torch.Tensor, b: torch.Tensor, *scales: torch.Tensor, out: torch.Tensor) -> None:
        gemm.vendor_mm(a, b, scales, out)
        self.ar._call(out, out)


class MMHeapAR(rp.RowParallelHybrid):
    """gemm_ar mm_heap: torch.matmul, then the heap all-reduce (one-shot or two-shot), same bits everywhere."""

    name = "mm_heap"
    op = "gemm_ar"
    kind = "all_reduce"

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return _ARRunner(world, problem, self._collective(world, problem, config))


class _LLRunner(Runner):
    """mm_ll of gemm_ar: torch.matmul into out, then the low-latency all-reduce in place (through a fixed
    scratch buffer where the caller's `out=` is not 4-byte aligned: the all-reduce moves 32-bit words)."""

    def __init__(self, world: World, problem: Problem, ar: lowlatency.AllReduce):
        self.ar = ar
        specs, out = rp.io_specs(problem, problem["M"])
        super().__init__(world, problem, specs, out, workspaces=ar.workspaces)
        self._scratch: torch.Tensor | None = None

    def launch(self, a: torch.Tensor, b: torch.Tensor, *scales: torch.Tensor, out: torch.Tensor) -> None:
        if out.data_ptr() % 4 == 0:
            gemm.vendor_mm(a, b, scales, out)
            self.ar._call(out, out)
            return
        if self._scratch is None:
            self._scratch = torch.empty_like(out, memory_format=torch.contiguous_format)
        gemm.vendor_mm(a, b, scales, self._scratch)
        self.ar._call(self._scratch, self._scratch)
        out.copy_(self._scratch)


class MMLowLatency(Variant):
    """gemm_ar mm_ll: torch.matmul, then the low-latency (data-as-flag) heap all-reduce; same bits everywhere."""

    name, family = "mm_ll", "hybrid"

    def _problem_error(self, problem: Problem) -> str | None:
        if problem.op != NAME:
            return f"{self.name} serves {NAME}, not {problem.op}"
        if problem["K"] % problem.world:
            return f"K={problem['K']} is not divisible by the world size {problem.world}"
        return lowlatency.check(problem.world, problem["M"], problem["N"], problem.out_dtype, {})

    def space(self, trial: Any, problem: Problem) -> Config:
        return lowlatency.space(trial, problem.world, problem["M"], problem["N"], problem.out_dtype)

    def defaults(self, problem: Problem) -> list[Config]:
        if self._problem_error(problem):
            return []
        return lowlatency.defaults(problem.world, problem["M"], problem["N"], problem.out_dtype)

    def check(self, problem: Problem, config: Config) -> str | None:
        return self._problem_error(problem) or lowlatency.check(problem.world, problem["M"], problem["N"],
                                                                problem.out_dtype, config)

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return _LLRunner(world, problem, lowlatency.all_reduce(world, problem["M"], problem["N"], problem.out_dtype,
                                                               config, name=f"{NAME}.ll"))


def bound(world: World, problem: Problem, seed: int) -> dict[str, Callable[[], Any]]:
    """The pieces of the BSP bound: this rank's matmul alone and the all-reduce alone."""
    a, b, *scales = rp.inputs(world, problem, seed)
    c = torch.empty(problem["M"], problem["N"], dtype=problem.out_dtype, device=world.device)
    gemm.vendor_mm(a, b, scales, c)
    return {"matmul": lambda: gemm.vendor_mm(a, b, scales, c),
            "all_reduce": lambda: dist.all_reduce(c, group=world.group)}


# -- the custom op (autofuse/library registers it) ------------------------------------------------------
# C = sum_q A_q @ B_q on every rank: dA_q = dC @ B_q^T, dB_q = A_q^T @ dC, local GEMMs. The output is taken
# as replicated (Megatron's convention): every rank's dC must be the same, which it is when every rank
# computes the same loss from it.
def _grads(kept: dict[str, Any], grad: torch.Tensor, needs: tuple[bool, ...], group_name: str) -> tuple:
    a, b = kept["a"], kept["b"]
    return (grad @ b.t() if needs[0] else None), (a.t() @ grad if needs[1] else None)


CUSTOM = CustomOp(out_shape=lambda inputs, w: (inputs[0].shape[0], inputs[1].shape[1]),
                  backward=Backward(rp.keep_operands, _grads))


OP = Op(
    name=NAME,
    args=("a", "b"),
    optional=("scale_a", "scale_b"),
    variants=[Bsp(), TorchSymmOneShot(), TorchSymmTwoShot(), MMHeapAR(), MMLowLatency(), OneShot(), TwoShot()],
    problem_of=problem_of,
    inputs=rp.inputs,
    reference=reference,
    tolerance=rp.tolerance,
    features=features,
    sweep=sweep,
    description="GEMM + all-reduce: A_r (M x K/W) @ B_r (K/W x N) summed over ranks, M x N on every rank",
    bound=bound,
    custom=CUSTOM,
)
