"""gemm_rs: GEMM then reduce-scatter of the rows (a row-parallel linear layer, sequence-parallel out).

Rank r holds A_r (M x K/W) and B_r (K/W x N) and gets rows [r * M/W, (r + 1) * M/W) of
C = sum_q A_q @ B_q. Rows are split evenly, as NCCL's reduce-scatter does: M % W == 0 and
K % W == 0 are input requirements (InvalidInput otherwise).

Variants:
- `bsp`: torch.matmul, then the collective library's reduce-scatter. gloo (CPU) has no
  reduce_scatter_single, so on CPU it is all_reduce of the whole partial, then this rank's rows.
- `torch_symm` (peer): torch's `torch.ops.symm_mem.fused_matmul_reduce_scatter` (FP8:
  fused_scaled_matmul_reduce_scatter), CUDA, one GPU per rank.
- `mm_heap`, `mm_heap_overlap` (hybrid, in this module on autofuse/ops/hybrid.py): torch.matmul, then the one-launch heap
  reduce-scatter (autofuse/comm/collectives.py); overlapped: the matmul in row chunks, each pushed to its
  owner as soon as it is written.
- `push_last` (fused): one persistent kernel; each partial tile goes from the GEMM to its owner's
  inbox with an epoch flag; the owner adds the arrivals to its own tile's accumulator.
- `push_reducer` (fused): every partial tile, own ones too, goes to the owner's inbox; COMM_SMS
  reducer programs wait per tile or per row block (FLAG) and sum.
- `mm_ring` (hybrid): the reduction runs around the ring inside cuBLAS's epilogue. At step s rank r
  computes owner (r - s - 1) mod W's rows: step 0 `torch.mm` into a heap buffer, later steps pull the
  previous rank's partial of the same rows with the copy engine (into a heap buffer, or into `out`
  at the last step, whose owner is r) and `addmm_` onto it (beta = 1). No SM moves data and no
  reduction kernel reads the partials again; CHUNKS row chunks per owner pipeline the pulls under
  the GEMMs. Partials are rounded to the output dtype once per step. kernels/ring.py orders it.
  Not FP8 (torch._scaled_mm cannot accumulate onto C), and not below AUTOFUSE_RING_MIN_GFLOP x
  (1 + CHUNKS) / 3 per rank (default 300 at CHUNKS=2): its 0.3-1 ms of host work per call (ten-odd
  torch and stream operations per chunk, growing with CHUNKS) would pace calls that are not
  graph-replayed.
kernels/gemm_rs.py has the algorithms; the fused configs are the GEMM core's (autofuse/core/gemm.py)
plus PARTIAL ("fp32" | "out": the inbox dtype) and, for push_reducer, FLAG and COMM_SMS.

FP8 (`autofuse.gemm_rs(a, b, group=..., scale_a=..., scale_b=...)`, float8_e4m3fn, b = w.t(), see
autofuse/ops/row_parallel.py): bsp is torch._scaled_mm into a bfloat16 partial, then the
reduce-scatter of that partial (the hybrids: the heap reduce-scatter, overlapped per row chunk);
the fused kernels scale each partial tile before it is pushed. torch_symm calls torch's
symm_mem.fused_scaled_matmul_reduce_scatter (scatter dim 0, bfloat16 out, fast accumulation) with
the rank's scales: tensorwise, or row-wise scale_a M x 1 (every rank holds all M rows of its
partial; torch's op splits the scales with A's rows, one row chunk per destination rank, and
copies a chunk that is not 16-byte aligned, as cuBLAS's row-wise kernel needs). Checked on CPU
ranks against stand-ins of torch's op (tests/_symm_cpu.py) and passed on two H100, 2026-11-26.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.distributed as dist

from autofuse.core import gemm, settings
from autofuse.core.custom import Backward, CustomOp
from autofuse.ops import hybrid
from autofuse.comm import collectives
from autofuse.comm.heap import torch_symm_group, torch_symm_unavailable
from autofuse.comm.world import reduce_scatter_single
from autofuse.core.op import Config, InvalidInput, Op, Problem, SearchSpace, Variant
from autofuse.ops import row_parallel as rp
from autofuse.core.runner import Runner
from autofuse.core.sizes import cdiv
from autofuse.comm.workspace import workspace
from autofuse.ops.padded import ag_gemm_any

if TYPE_CHECKING:
    from autofuse.comm.world import World

NAME = "gemm_rs"
FLAGS = ("tile", "row_block")
COMM_SMS = (4, 8, 16, 32)  # the tuner's choices; any 1..128 is valid
RED_ELEMS = 4096           # a reducer sums RED_M x BLOCK_N elements at a time (registers)


def problem_of(world: World, a: torch.Tensor, b: torch.Tensor, scale_a: Any = None, scale_b: Any = None) -> Problem:
    """The gemm_rs Problem of this call: a = A_r (M x K/W), b = B_r (K/W x N); M % W == 0; FP8:
    the rank's scales too (gemm.fp8_dims)."""
    rp.check_operands(world, a, b, NAME)
    extra = gemm.fp8_dims(world.device, a, b, scale_a, scale_b, NAME)
    m, k_r = a.shape
    if m % world.size:
        raise InvalidInput(f"{NAME}: M={m} rows are not divisible by the world size {world.size}; "
                           "the rows are split evenly (pad M to a multiple of W)")
    return Problem.make(NAME, a.dtype, world.size, M=int(m), N=int(b.shape[1]), K=int(k_r) * world.size, **extra)


def reference(world: World, problem: Problem, seed: int) -> torch.Tensor:
    m_r = problem["M"] // problem.world
    return rp.full_product(world, problem, seed, slice(world.rank * m_r, (world.rank + 1) * m_r))


def features(problem: Problem) -> dict[str, float]:
    m, n, w = problem["M"], problem["N"], problem.world
    return rp.features(problem, (w - 1) / w * m * n * problem.out_dtype.itemsize)


def sweep(kind: str, world: int) -> list[Problem]:
    """rp.sweep's kinds; gemm_rs runs at prefill sizes (rows of a sequence-parallel chunk)."""
    return rp.sweep(NAME, kind, world, model_m=(512, 2048, 8192),
                    default={"gpu": (1024, 2048, 4096, 8192), "llama3-70b": (2048, 8192), "llama3-8b": (2048,)},
                    scaling_m=(2048, 8192))


def reduce_scatter(world: World, out: torch.Tensor, partial: torch.Tensor) -> None:
    """out = this rank's rows of the sum of every rank's `partial` (NCCL; all_reduce + slice on gloo)."""
    if world.backend == "gloo":
        world.collective(dist.all_reduce, partial, what="gemm_rs.bsp")
        m_r = out.shape[0]
        out.copy_(partial[world.rank * m_r:(world.rank + 1) * m_r])
    else:
        world.collective(reduce_scatter_single, out, partial, what="gemm_rs.bsp")


# -- bsp and torch_symm -------------------------------------------------------------------------------
class BspRunner(Runner):
    def __init__(self, world: World, problem: Problem):
        specs, out = rp.io_specs(problem, problem["M"] // problem.world)
        super().__init__(world, problem, specs, out)
        self.partial = torch.empty(problem["M"], problem["N"], dtype=problem.out_dtype, device=world.device)

    def launch(self, a: torch.Tensor, b: torch.Tensor, *scales: torch.Tensor, out: torch.Tensor) -> None:
        gemm.vendor_mm(a, b, scales, self.partial)
        reduce_scatter(self.world, out, self.partial)


class Bsp(Variant):
    name, family = "bsp", "bsp"

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return BspRunner(world, problem)


class TorchSymmRunner(Runner):
    """torch.ops.symm_mem.fused_matmul_reduce_scatter (scatter dim 0), copied into `out`. FP8:
    fused_scaled_matmul_reduce_scatter with the rank's scale_a (tensorwise: one for every row chunk;
    row-wise M x 1: the op splits it with A's rows) and scale_b, bfloat16 out and fast accumulation
    (gemm.vendor_mm's torch._scaled_mm)."""

    def __init__(self, world: World, problem: Problem, group: str):
        specs, out = rp.io_specs(problem, problem["M"] // problem.world)
        super().__init__(world, problem, specs, out)
        self.group = group
        self.full_shape = [problem["M"], problem["N"]]  # the unscattered product: the op's output_shape

    def launch(self, a: torch.Tensor, b: torch.Tensor, *scales: torch.Tensor, out: torch.Tensor) -> None:
        if scales:
            res = torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
                a, b, scales[0], scales[1], "sum", 0, 0, self.group, self.full_shape, out_dtype=out.dtype,
                use_fast_accum=True)
        else:
            res = torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, self.group)
        out.copy_(res)


class TorchSymm(Variant):
    """torch's own fused matmul + reduce-scatter on symmetric memory (FP8: its scaled form, tensorwise
    or row-wise scales). CUDA, one GPU per rank, torch with symm_mem."""

    name, family = "torch_symm", "peer"

    def unavailable(self, world: World) -> str | None:
        return torch_symm_unavailable(world, "fused_matmul_reduce_scatter")

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return TorchSymmRunner(world, problem, torch_symm_group(world))


# -- fused: push_last, push_reducer ---------------------------------------------------------------------
class PushRunner(rp.FusedRunner):
    """kernels/gemm_rs.py's gemm_rs_kernel at one config (push_last, or push_reducer with `reducer`)."""

    def __init__(self, world: World, problem: Problem, config: Config, reducer: bool):
        from autofuse.kernels import gemm_rs as k

        w, n, k_r = problem.world, problem["N"], problem["K"] // problem.world
        m_r = problem["M"] // w
        cfg = gemm.GemmConfig.from_dict(config)
        tiles_m, tiles = cdiv(m_r, cfg.BLOCK_M), cfg.tiles(m_r, n)
        slots = w if reducer else w - 1
        row_block = reducer and config["FLAG"] == "row_block"
        pdtype = rp.partial_dtype(problem, config)
        ws = workspace(world, NAME, slots * tiles * cfg.BLOCK_M * cfg.BLOCK_N * pdtype.itemsize,
                       tiles_m if row_block else slots * tiles)
        super().__init__(world, problem, config, m_r, ws)
        programs = gemm.programs(world.device)
        comm = min(config["COMM_SMS"], tiles_m if row_block else tiles) if reducer else 0
        gemm_programs = max(1, min(cfg.work_items(m_r, n), programs - comm))
        inbox, inbox_half = ws.data_view(pdtype)
        sk = rp.split_k_buffers(world, cfg, w * tiles, inbox)
        self.kernel = k.gemm_rs_kernel
        self.grid = (gemm_programs + comm,)
        self.args = (inbox, inbox_half, ws.flags, ws.half_flags, *sk)
        self.sizes = (m_r, n, k_r)
        self.tail = (gemm_programs,)
        self.meta.update(PUSH_ALL=reducer, ROW_BLOCK=row_block,
                         RED_M=max(1, min(cfg.BLOCK_M, RED_ELEMS // cfg.BLOCK_N)))


class PushLast(rp.FusedVariant):
    name = "push_last"

    def rows(self, problem: Problem) -> int:
        return problem["M"] // problem.world

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return PushRunner(world, problem, config, reducer=False)


class PushReducer(PushLast):
    name = "push_reducer"
    keys = {"PARTIAL": rp.PARTIALS, "FLAG": FLAGS, "COMM_SMS": range(1, 129)}
    space_keys = {"PARTIAL": rp.PARTIALS, "FLAG": FLAGS, "COMM_SMS": COMM_SMS}

    def comm_programs(self, config: Mapping[str, Any]) -> int:
        return config["COMM_SMS"]

    def op_defaults(self, problem: Problem) -> list[Config]:
        partial = "out" if problem.out_dtype.itemsize == 2 else "fp32"
        comm = 8 if problem["M"] * problem["N"] <= 1 << 22 else 16
        return [{"PARTIAL": partial, "FLAG": "tile", "COMM_SMS": comm},
                {"PARTIAL": partial, "FLAG": "row_block", "COMM_SMS": comm}]

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return PushRunner(world, problem, config, reducer=True)


# ------------------------------------------------------------------------------------------------
# hybrids (the shared base: autofuse/ops/hybrid.py)
class _RSRunner(Runner):
    """mm_heap / mm_heap_overlap of gemm_rs on one problem (see the module docstring)."""

    def __init__(self, world: World, problem: Problem, rs: collectives.ReduceScatter, overlap: bool, priority: str):
        m, n, k, w = hybrid.dims(problem)
        self.rs, self.overlap = rs, overlap
        self.streams = hybrid.Streams(world.device, priority)
        self.partial = torch.empty((m, n), dtype=problem.out_dtype, device=world.device)
        per = m // w
        self.parts = [(i, c.owner != world.rank, slice(c.owner * per + c.start, c.owner * per + c.stop))
                      for i, c in enumerate(rs.chunks)]
        specs, out = rp.io_specs(problem, per)
        super().__init__(world, problem, specs, out, workspaces=rs.workspaces)

    def launch(self, a: torch.Tensor, b: torch.Tensor, *scales: torch.Tensor, out: torch.Tensor) -> None:
        rs, partial = self.rs, self.partial
        if not self.overlap:
            gemm.vendor_mm(a, b, scales, partial)
            rs._call(partial, out)
            return
        st = self.streams
        for i, remote, rows in self.parts:
            gemm.vendor_mm(a[rows], b, gemm.scale_rows(scales, rows), partial[rows])
            if remote:
                st.fork()
                with st.on_comm():
                    rs.push(partial, i)
        st.fork()
        with st.on_comm():
            rs.reduce(partial, out)
        st.join()


class MMHeapRS(rp.RowParallelHybrid):
    """gemm_rs mm_heap: torch.matmul, then the heap reduce-scatter."""

    name = "mm_heap"
    op = "gemm_rs"
    kind = "reduce_scatter"

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return _RSRunner(world, problem, self._collective(world, problem, config), False, "high")


class MMHeapRSOverlap(rp.RowParallelHybrid):
    """gemm_rs mm_heap_overlap: the matmul in row chunks, each pushed to its owner as it finishes."""

    name = "mm_heap_overlap"
    op = "gemm_rs"
    kind = "reduce_scatter"
    overlap = True
    engines = ("sm",)

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        rs = self._collective(world, problem, config)
        return _RSRunner(world, problem, rs, True, config.get("PRIORITY", "high"))


# -- mm_ring: the ring reduction in cuBLAS's epilogue, copy-engine pulls ---------------------------------
RING_CHUNKS = (1, 2, 4, 8)
RING_ALIGN = 16          # chunk rows are a multiple of this (the GEMMs' row tiles stay whole)
PEER_HEAPS = ("torch", "shm", "symm")  # heaps whose peers' memory the host can view (copy-engine pulls)
_FINISH_PROGRAMS, _FINISH_BLOCK = 8, 1024


def ring_floor(min_gflop: float, chunks: int) -> float:
    """The GFLOP per rank mm_ring needs at `chunks` chunks: AUTOFUSE_RING_MIN_GFLOP is CHUNKS=2's floor, and
    the floor grows with the host's work per call (two H200: about 270 / 390 / 735 us at CHUNKS 1 / 2 / 4)."""
    return min_gflop * (1 + chunks) / 3


def ring_chunks(rows: int, chunks: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges cutting `rows` into at most `chunks` pieces of a multiple of RING_ALIGN rows."""
    size = max(1, cdiv(cdiv(rows, chunks), RING_ALIGN) * RING_ALIGN) if rows > RING_ALIGN else rows
    return [(lo, min(rows, lo + size)) for lo in range(0, rows, size)] or [(0, 0)]


class RingRunner(Runner):
    """mm_ring on one problem (see the module docstring); the flags' kernels: kernels/ring.py.

    Heap (workspace "gemm_rs.ring"): the partials of steps 0..W-2, each M/W x N in the output dtype,
    which the next rank pulls; flags CURRENT, TAKEN, then READY per (step, chunk). Flags are raised by
    the copy engine: a 4-byte copy of my CURRENT word into the neighbour's flag, ordered after the work it
    announces by the stream it runs on (no kernel launch; the host's cost per call is what keeps mm_ring
    off small problems).
    """

    def __init__(self, world: World, problem: Problem, config: Config):
        from autofuse.kernels import ring as k

        m, n, _, w = hybrid.dims(problem)
        per = m // w
        specs, out = rp.io_specs(problem, per)
        dtype = problem.out_dtype
        self.chunks = ring_chunks(per, config["CHUNKS"])
        steps = w - 1
        nbytes = steps * per * n * dtype.itemsize
        self.ws = workspace(world, f"{NAME}.ring", cdiv(nbytes, 2),
                            cdiv(k.READY.value + max(steps, 1) * len(self.chunks), 2))
        super().__init__(world, problem, specs, out, workspaces=(self.ws,))
        self.k, self.per, self.rank = k, per, world.rank
        self.partials = self.ws.data[:nbytes].view(dtype).view(steps, per, n)
        flags = self.ws.flags
        self.current = flags[k.CURRENT.value:k.CURRENT.value + 1]
        if steps:
            self.previous = world.heap.peer_tensor(self.partials, (world.rank - 1) % w)
            after = world.heap.peer_tensor(flags, (world.rank + 1) % w)
            before = world.heap.peer_tensor(flags, (world.rank - 1) % w)
            self.ready_after = [after[k.READY.value + i:k.READY.value + i + 1] for i in range(steps * len(self.chunks))]
            self.taken_before = before[k.TAKEN.value:k.TAKEN.value + 1]
        self.pull, self.signals = hybrid.comm_stream(world.device, "high"), hybrid.comm_stream(world.device, "normal")
        cuda = world.device.type == "cuda"
        self.pulled = [torch.cuda.Event() if cuda else None for _ in range(steps * len(self.chunks))]
        self.made = [torch.cuda.Event() if cuda else None for _ in range(steps * len(self.chunks))]

    def launch(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """Per step: the pulls of every chunk (pull stream), the GEMMs (compute stream), the flags raised
        (signal stream); each stream entered once per step, since the host's cost per call is what keeps
        mm_ring off small problems. The streams run concurrently: chunk c's GEMM waits for its own pull
        only, and its flag for its own GEMM only. On CPU everything runs inline, in this order."""
        k, ws, w, per, nc = self.k, self.ws, self.problem.world, self.per, len(self.chunks)
        ctx, flags, compute = ws.ctx, ws.flags, None
        k.begin_kernel[(1,)](ctx, flags, num_warps=4)
        if self.pull is not None:
            compute = torch.cuda.current_stream(self.device)
            self.pull.wait_stream(compute)
            self.signals.wait_stream(compute)
        for s in range(w):
            rows0 = (self.rank - s - 1) % w * per
            last = s == w - 1
            targets = [out[lo:hi] if last else self.partials[s, lo:hi] for lo, hi in self.chunks]
            if s:  # pull the previous rank's partials of these rows, chunk by chunk as each is ready
                with _on(self.pull):
                    for c, (lo, hi) in enumerate(self.chunks):
                        i = (s - 1) * nc + c
                        k.wait_kernel[(1,)](ctx, flags, k.READY.value + i, num_warps=4)
                        targets[c].copy_(self.previous[s - 1, lo:hi])
                        if compute is not None:
                            self.pulled[i].record(self.pull)
            for c, (lo, hi) in enumerate(self.chunks):
                a_rows = a[rows0 + lo:rows0 + hi]
                if s == 0:
                    torch.mm(a_rows, b, out=targets[c])
                else:
                    if compute is not None:
                        compute.wait_event(self.pulled[(s - 1) * nc + c])
                    targets[c].addmm_(a_rows, b)
                if compute is not None and not last:
                    self.made[s * nc + c].record(compute)
            if not last:  # my partial i is complete: READY + i on the next rank := my epoch
                with _on(self.signals):
                    for c in range(nc):
                        i = s * nc + c
                        if compute is not None:
                            self.signals.wait_event(self.made[i])
                        self.ready_after[i].copy_(self.current)
        if w > 1:  # every partial of the previous rank pulled: its TAKEN := my epoch
            with _on(self.pull):
                self.taken_before.copy_(self.current)
        if compute is not None:
            compute.wait_stream(self.pull)
            compute.wait_stream(self.signals)
        k.finish_kernel[(_FINISH_PROGRAMS,)](ctx, flags, out, out.numel(), BLOCK=_FINISH_BLOCK, num_warps=4)


def _on(stream: Any) -> Any:
    """`torch.cuda.stream(stream)`, or nothing on CPU (every launch runs inline, in host order)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class MMRing(Variant):
    """gemm_rs mm_ring: GEMM chunks summing around the ring in cuBLAS's epilogue, copy-engine pulls."""

    name, family = "mm_ring", "hybrid"

    def check(self, problem: Problem, config: Config) -> str | None:
        if problem.op != NAME:
            return f"{self.name} serves {NAME}, not {problem.op}"
        if rp.is_fp8(problem):
            return "FP8: torch._scaled_mm cannot accumulate onto a partial (no beta); use the fused variants"
        unknown = sorted(set(config) - {"CHUNKS"})
        if unknown:
            return f"unknown config keys {unknown} (takes CHUNKS)"
        if config.get("CHUNKS") not in RING_CHUNKS:
            return f"CHUNKS must be one of {RING_CHUNKS}, got {config.get('CHUNKS')!r}"
        gflop = 2.0 * problem["M"] * problem["N"] * problem["K"] / problem.world / 1e9
        floor = settings.ring_min_gflop()
        need = ring_floor(floor, config["CHUNKS"])
        if gflop < need:
            return (f"{gflop:.3g} GFLOP per rank is below mm_ring's floor at CHUNKS={config['CHUNKS']}: {need:.3g} "
                    f"(AUTOFUSE_RING_MIN_GFLOP={floor:g} x (1 + CHUNKS) / 3): the host's 0.3-1 ms of work per call, "
                    "growing with CHUNKS, would outweigh the GPU work where calls are not graph-replayed")
        return None

    def space(self, trial: SearchSpace, problem: Problem) -> Config:
        return {"CHUNKS": trial.suggest_categorical("CHUNKS", list(RING_CHUNKS))}

    def defaults(self, problem: Problem) -> list[Config]:
        """Two chunks per owner first (the last pull hides under the other chunk's GEMM), then four, one:
        those above their floor."""
        return [{"CHUNKS": c} for c in (2, 4, 1) if self.check(problem, {"CHUNKS": c}) is None]

    def refuses(self, world: World, problem: Problem, config: Config) -> str | None:
        provider = getattr(world.heap, "provider", "?")
        if provider not in PEER_HEAPS:
            return f"the copy engine pulls need peer-mapped heap tensors, which the {provider} heap does not provide"
        return None

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return RingRunner(world, problem, config)


def bound(world: World, problem: Problem, seed: int) -> dict[str, Callable[[], Any]]:
    """The pieces of the BSP bound: this rank's matmul alone and the reduce-scatter alone."""
    a, b, *scales = rp.inputs(world, problem, seed)
    partial = torch.empty(problem["M"], problem["N"], dtype=problem.out_dtype, device=world.device)
    gemm.vendor_mm(a, b, scales, partial)
    out = torch.empty(problem["M"] // problem.world, problem["N"], dtype=problem.out_dtype, device=world.device)
    return {"matmul": lambda: gemm.vendor_mm(a, b, scales, partial),
            "reduce_scatter": lambda: reduce_scatter(world, out, partial)}


# -- the custom op (autofuse/library registers it) ------------------------------------------------------
# C_r = rows r of sum_q A_q @ B_q; with G = all_gather_rows(dC): dA_q = G @ B_q^T = ag_gemm(dC, B_q^T) and
# dB_q = A_q^T @ G: one ag_gemm_gathered call when both are needed (dC is gathered once), else
# ag_gemm(dC, B_q^T), or for dB alone ag_gemm(dC^T, A_q)^T in the k form. B_q^T is passed as the
# view it is (column-major where B_q is row-major): ag_gemm reads it in place, no transposed copy.
def _grads(kept: dict[str, Any], grad: torch.Tensor, needs: tuple[bool, ...], group_name: str) -> tuple:
    a, b = kept["a"], kept["b"]
    need_a, need_b = needs[:2]
    grad = grad.contiguous()
    if need_a and need_b:
        da, full = ag_gemm_any(grad, b.t(), group_name, gathered=True)
        return da, a.t() @ full
    if need_a:
        return ag_gemm_any(grad, b.t(), group_name), None
    return None, ag_gemm_any(grad.t().contiguous(), a, group_name).t()


CUSTOM = CustomOp(out_shape=lambda inputs, w: (inputs[0].shape[0] // w, inputs[1].shape[1]),
                  backward=Backward(rp.keep_operands, _grads))


OP = Op(
    name=NAME,
    args=("a", "b"),
    optional=("scale_a", "scale_b"),
    variants=[Bsp(), TorchSymm(), MMHeapRS(), MMHeapRSOverlap(), PushLast(), PushReducer(), MMRing()],
    problem_of=problem_of,
    inputs=rp.inputs,
    reference=reference,
    tolerance=rp.tolerance,
    features=features,
    sweep=sweep,
    description="GEMM + reduce-scatter of rows: A_r (M x K/W) @ B_r (K/W x N) summed over ranks, M/W x N each",
    bound=bound,
    custom=CUSTOM,
)
