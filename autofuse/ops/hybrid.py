"""What the hybrid variants share: a one-launch heap collective (autofuse.comm.collectives) beside the
vendor GEMM (torch.matmul).

On LLM inference shapes cuBLAS beats the fused kernels' Triton GEMM, so these keep torch.matmul and
replace only the collective (docs: ../shared/GPU-NOTES.md, "A one-launch Triton all-gather beside
cuBLAS"). `HybridVariant` is the base (the collective's search space, defaults and checks, the
overlap keys), `Streams` the communication stream; each op module defines its own hybrids on them
(ag_gemm: HeapMM, HeapMMOverlap; gemm_rs: MMHeapRS, MMHeapRSOverlap; gemm_ar: MMHeapAR, both on
`row_parallel.RowParallelHybrid`; flash_decode's split_heap combines partials, its own kind), so an
edit to one op's hybrid changes only that op's digest. What they compute:

ag_gemm (dims M, N, K, gather; rank r holds A_r and B_r, returns M x N):
    heap_mm          all-gather of A (rows form: W*M/W x K; k form: M x W*K/W) into the
                     collective's fixed heap buffer, then one torch.matmul on it.
    heap_mm_overlap  the gather starts on a communication stream (PRIORITY high | normal); the
                     local shard's matmul runs at once (rows: out rows of r = A_r @ B; k:
                     out = A_r @ B[r-th K block]); then per chunk of the peers' shards (FLAG
                     "shard": one chunk per peer; "row_block": CHUNKS row blocks per peer) a device
                     wait on the compute stream and that chunk's matmul (rows: its out rows;
                     k: out rows += chunk @ B[its K block], so out is rounded once per peer).
    FP8              torch._scaled_mm instead of torch.matmul. Rows form: row-wise scale_a moves
                     in a heap all-gather of its own ("ag_gemm.hybrid.scales"), launched just
                     before A's. k form (scale_a alike on every rank, nothing to gather):
                     heap_mm_overlap's chunk products land in a bfloat16 buffer, then add to out
                     (torch._scaled_mm cannot accumulate).
gemm_rs (dims M, N, K; rank r holds A_r (M x K/W), B_r (K/W x N), returns rows r of the sum):
    mm_heap          torch.matmul into a fixed local partial, then the heap reduce-scatter.
    mm_heap_overlap  the matmul in row chunks, owners' rows first (FLAG shard: one chunk per
                     owner; row_block: CHUNKS per owner), each chunk pushed to its owner on the
                     communication stream as soon as it is written; my own rows last, then the sum.
    mm_ring          (in autofuse/ops/gemm_rs.py, not on this base: no heap collective) the sum
                     around the ring in cuBLAS's epilogue, partials pulled by the copy engine.
gemm_ar (dims M, N, K; returns the whole sum, bitwise the same on every rank):
    mm_heap          torch.matmul into `out`, then the heap all-reduce in place (ALGO one_shot |
                     two_shot, ENGINE sm | ce for one_shot).

Configs: the collective's keys (autofuse.comm.collectives: ENGINE, ALGO, COMM_SMS, BLOCK, num_warps,
CHUNKS); the overlap variants draw CHUNKS through FLAG (row_block only) and add PRIORITY.
Workspaces are named after the op ("<op>.hybrid"), shared by the op's hybrid runners.

Expected costs (two H200, graph mode; paper estimates, see kernels/collectives.py): ag_gemm heap_mm
at M=8..512, N=3584, K=8192: the all-gather drops from NCCL's 9-38 us to about 3.5-17 us beside
the same matmul: 1.2-1.4x over BSP. heap_mm_overlap from M of about 1K: the local half's matmul
hides the gather (M=2048: 84 + 84 us of matmul, the 16 MB gather under the first half): ~1.4x.
gemm_rs mm_heap at M=1024, N=8192, K=14336: 157 + ~30 us vs 216: 1.15x; overlapped, the peer
half's push hides under my half's matmul: ~1.3x. gemm_ar mm_heap at M <= 256: the all-reduce
drops from NCCL's ~12-20 us to ~3.5-5 us: 1.3-1.5x where the matmul is ~20-30 us.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from autofuse.comm import collectives
from autofuse.core.op import Config, InvalidConfig, Problem, SearchSpace, Variant
from autofuse.core.runner import Runner, TensorSpec

if TYPE_CHECKING:
    from autofuse.comm.world import World

FLAGS = ("shard", "row_block")
CHUNK_CHOICES = (2, 4, 8)
PRIORITIES = ("high", "normal")
OVERLAP_KEYS = ("FLAG", "CHUNKS", "PRIORITY")

_streams: dict[tuple[int, str], Any] = {}


def comm_stream(device: torch.device, priority: str) -> Any:
    """The communication stream of `device` at `priority` (one per device and priority), None on CPU."""
    if device.type != "cuda":
        return None
    key = (device.index if device.index is not None else torch.cuda.current_device(), priority)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(device=device, priority=-1 if priority == "high" else 0)
    return _streams[key]


class Streams:
    """fork(): the communication stream waits for the current one; join(): the reverse. No-ops on CPU."""

    def __init__(self, device: torch.device, priority: str):
        self.device = device
        self.comm = comm_stream(device, priority)

    def fork(self) -> None:
        if self.comm is not None:
            self.comm.wait_stream(torch.cuda.current_stream(self.device))

    def join(self) -> None:
        if self.comm is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.comm)

    def on_comm(self) -> Any:
        return torch.cuda.stream(self.comm) if self.comm is not None else _Nothing()


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def dims(problem: Problem) -> tuple[int, int, int, int]:
    return problem["M"], problem["N"], problem["K"], problem.world


def _split_config(config: Config, keys: tuple[str, ...]) -> Config:
    return {k: v for k, v in config.items() if k in keys}


def _overlap_space(trial: SearchSpace, cfg: Config) -> Config:
    flag = trial.suggest_categorical("FLAG", list(FLAGS))
    cfg = dict(cfg, FLAG=flag)
    if flag == "row_block":
        cfg["CHUNKS"] = trial.suggest_categorical("CHUNKS", list(CHUNK_CHOICES))
    cfg["PRIORITY"] = trial.suggest_categorical("PRIORITY", list(PRIORITIES))
    return cfg


def _overlap_check(config: Config) -> str | None:
    flag = config.get("FLAG")
    if flag not in FLAGS:
        return f"FLAG must be one of {FLAGS}, got {flag!r}"
    if flag == "row_block" and config.get("CHUNKS") not in CHUNK_CHOICES:
        return f"FLAG=row_block needs CHUNKS in {CHUNK_CHOICES}, got {config.get('CHUNKS')!r}"
    if flag == "shard" and "CHUNKS" in config:
        return "FLAG=shard has one chunk per rank: drop CHUNKS"
    if config.get("PRIORITY") not in PRIORITIES:
        return f"PRIORITY must be one of {PRIORITIES}, got {config.get('PRIORITY')!r}"
    return None


def _collective_config(config: Config, kind: str) -> Config:
    cfg = _split_config(config, collectives.KEYS[kind])
    if "FLAG" in config:
        cfg["CHUNKS"] = config.get("CHUNKS", 1) if config["FLAG"] == "row_block" else 1
    return cfg


class HybridVariant(Variant):
    """What the hybrids share: the op they serve, the collective kind, the overlap keys."""

    family = "hybrid"
    op = ""
    kind = ""
    overlap = False
    engines: tuple[str, ...] = collectives.ENGINES

    def shape(self, problem: Problem) -> tuple[int, int, int]:
        """(rows, cols, dim) of the collective this variant runs for `problem`."""
        raise NotImplementedError

    def comm_dtype(self, problem: Problem) -> torch.dtype:
        """The dtype the collective moves: the inputs' (a gathered A) unless a subclass says otherwise."""
        return problem.torch_dtype

    def problem_error(self, problem: Problem) -> str | None:
        if problem.op != self.op:
            return f"{self.name} serves {self.op}, not {problem.op}"
        m, n, k, w = dims(problem)
        if min(m, n, k, w) < 1:
            return f"sizes must be positive (M={m}, N={n}, K={k}, world={w})"
        return None

    def space(self, trial: SearchSpace, problem: Problem) -> Config:
        rows, cols, dim = self.shape(problem)
        cfg = collectives.space(self.kind, trial, problem.world, rows, cols, self.comm_dtype(problem), dim,
                                self.engines, chunks=not self.overlap)
        return _overlap_space(trial, cfg) if self.overlap else cfg

    def defaults(self, problem: Problem) -> list[Config]:
        if self.problem_error(problem):
            return []
        rows, cols, dim = self.shape(problem)
        base = [c for c in collectives.defaults(self.kind, problem.world, rows, cols, self.comm_dtype(problem), dim)
                if c["ENGINE"] in self.engines]
        if not self.overlap:
            return base
        base = [{k: v for k, v in c.items() if k != "CHUNKS"} for c in base]
        out = [dict(c, FLAG="shard", PRIORITY="high") for c in base[:2]]
        if base:
            out.append(dict(base[0], FLAG="row_block", CHUNKS=2, PRIORITY="high"))
        return out

    def check(self, problem: Problem, config: Config) -> str | None:
        why = self.problem_error(problem)
        if why:
            return why
        allowed = set(collectives.KEYS[self.kind]) | (set(OVERLAP_KEYS) if self.overlap else set())
        unknown = sorted(set(config) - allowed)
        if unknown:
            return f"unknown config keys {unknown} (takes {', '.join(sorted(allowed))})"
        if self.overlap:
            why = _overlap_check(config)
            if why:
                return why
        if config.get("ENGINE", "sm") not in self.engines:
            return f"ENGINE must be one of {self.engines}, got {config.get('ENGINE')!r}"
        rows, cols, dim = self.shape(problem)
        return collectives.check(self.kind, problem.world, rows, cols, self.comm_dtype(problem),
                                 _collective_config(config, self.kind), dim)

    def refuses(self, world: World, problem: Problem, config: Config) -> str | None:
        """The collective's own check against this World's heap (e.g. the copy engine needs
        peer-mapped heap tensors, which the symm heap does not provide)."""
        rows, cols, dim = self.shape(problem)
        return collectives.check(self.kind, world, rows, cols, self.comm_dtype(problem),
                                 _collective_config(config, self.kind), dim)

    def _collective(self, world: World, problem: Problem, config: Config) -> Any:
        rows, cols, dim = self.shape(problem)
        cfg = _collective_config(config, self.kind)
        try:
            return collectives.build(self.kind, world, rows, cols, self.comm_dtype(problem), cfg, dim,
                                     name=f"{self.op}.hybrid")
        except InvalidConfig as exc:
            raise InvalidConfig(f"{problem.op}.{self.name}: {exc}") from None
