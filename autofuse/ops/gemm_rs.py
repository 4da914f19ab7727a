"""gemm_rs: GEMM then reduce-scatter of the rows (a row-parallel linear layer), BSP vs fused.

Rank r holds A_r (M x K/W) and B_r (K/W x N) and gets rows [r * M/W, (r + 1) * M/W) of
C = sum_q A_q @ B_q. Rows are split evenly, as NCCL's reduce-scatter does: M % W == 0 and
K % W == 0 are input requirements (InvalidInput otherwise).

Variants:
- `bsp`: torch.matmul, then the collective library's reduce-scatter. gloo (CPU) has no
  reduce_scatter_tensor, so on CPU it is all_reduce of the whole partial, then this rank's rows.
- `torch_symm`: torch's `torch.ops.symm_mem.fused_matmul_reduce_scatter` (CUDA only).
- `push_last`: one kernel; the GEMM epilogue stores each partial tile into its owner's inbox and
  bumps a per-tile arrival counter; the owner's program for the tile sums the arrivals with its
  own accumulator (kernels/gemm_rs.py says why the sum stays on the owner).
- `push_reducer`: the same pushes for every tile (own ones too); persistent reducer programs
  wait per tile or per row block (`FLAG_GRAN`) and sum.

Partials in the inbox are stored in float32 (`PARTIAL="fp32"`, exact) or in the output dtype
(`PARTIAL="out"`, half the NVLink bytes for bf16/fp16, one extra rounding per partial); either
way the sum is accumulated in float32. This module also holds what gemm_ar shares: inputs,
GEMM config checks and defaults, and the per-World workspace cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from autofuse import status
from autofuse.op import (Config, InvalidConfig, InvalidInput, Op, Problem, SearchSpace, Variant,
                         default_tolerance, dtype_name)

NAME = "gemm_rs"
BLOCKS = (16, 32, 64, 128, 256)
WARPS = (2, 4, 8)
GEMM_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "PARTIAL")
PARTIALS = ("fp32", "out")
FLAG_GRANS = ("tile", "row_block")
SMEM_LIMIT = 232448   # bytes of shared memory one program may use on sm_90 (227 KiB)
MAX_ACC_REGS = 128    # float32 accumulator registers per thread before the tile spills
TINY_FLOPS = 1 << 22  # problems below this many multiply-adds per rank get the CPU test configs
SWEEP_M = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ---------------------------------------------------------------------------------------------
# Call validation, inputs, reference (shared with gemm_ar)
# ---------------------------------------------------------------------------------------------
def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.t().is_contiguous()


def check_operands(world, a: Any, b: Any, op: str) -> None:
    """Raise InvalidInput unless a (M x K_r) and b (K_r x N) are dense 2-D tensors on the World's device."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise InvalidInput(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise InvalidInput(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}")
        if t.device != world.device:
            raise InvalidInput(f"{op}: {name} is on {t.device}, this rank's device is {world.device}")
        if not _dense(t):
            raise InvalidInput(f"{op}: {name} must be row- or column-major dense (strides {t.stride()}); "
                               "call .contiguous()")
        if t.numel() == 0:
            raise InvalidInput(f"{op}: {name} is empty (shape {tuple(t.shape)})")
    if a.dtype != b.dtype:
        raise InvalidInput(f"{op}: a is {a.dtype} but b is {b.dtype}; both must have the same dtype")
    dtype_name(a.dtype)  # raises InvalidInput for unsupported dtypes
    if a.shape[1] != b.shape[0]:
        raise InvalidInput(f"{op}: a is {tuple(a.shape)} and b is {tuple(b.shape)}: "
                           "a's columns (K/W) must equal b's rows")


def problem_of(world, a: torch.Tensor, b: torch.Tensor) -> Problem:
    """The gemm_rs Problem of this call: a = A_r (M x K/W), b = B_r (K/W x N); M % W == 0."""
    check_operands(world, a, b, NAME)
    m, k_r = a.shape
    if m % world.size:
        raise InvalidInput(f"{NAME}: M={m} rows are not divisible by the world size {world.size}; "
                           "the rows are split evenly (pad M to a multiple of W)")
    return Problem.make(NAME, a.dtype, world.size, M=int(m), N=int(b.shape[1]), K=int(k_r) * world.size)


def rank_inputs(problem: Problem, rank: int, seed: int, device: torch.device,
                rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A_rank (rows x K/W) and B_rank (K/W x N), standard normal, deterministic in (seed, rank)."""
    k_r, n = problem["K"] // problem.world, problem["N"]
    g = torch.Generator(device=device)
    g.manual_seed(seed * 100_003 + rank * 7_919 + 1)
    a = torch.randn(rows, k_r, generator=g, device=device, dtype=torch.float32).to(problem.torch_dtype)
    b = torch.randn(k_r, n, generator=g, device=device, dtype=torch.float32).to(problem.torch_dtype)
    return a, b


def inputs(world, problem: Problem, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rank_inputs(problem, world.rank, seed, world.device, problem["M"])


def full_product(world, problem: Problem, seed: int, rows: slice) -> torch.Tensor:
    """float64 (sum over ranks of A_q @ B_q)[rows], rebuilt from every rank's inputs on this device."""
    acc = None
    for q in range(problem.world):
        a, b = rank_inputs(problem, q, seed, world.device, problem["M"])
        part = a[rows].to(torch.float64) @ b.to(torch.float64)
        acc = part if acc is None else acc.add_(part)
    return acc


def reference(world, problem: Problem, seed: int) -> torch.Tensor:
    m_r = problem["M"] // problem.world
    return full_product(world, problem, seed, slice(world.rank * m_r, (world.rank + 1) * m_r))


def tolerance(problem: Problem) -> float:
    """`default_tolerance(dtype, K)`: about 5 units of roundoff for the K of the sweeps.

    Against the float64 product of the dtype-rounded inputs, a fused result carries: the float32
    dot products (tf32 inputs for float32 on GPUs: ~u * sqrt(log K) relative), one rounding of each
    partial when PARTIAL='out' (W partials of size ~|C|/sqrt(W) with independent rounding errors
    add up to ~u|C|/sqrt(3) rms) and the final rounding to the dtype (~u/sqrt(3) rms): under 2u
    in all, well inside 4u * max(1, sqrt(log2(K) / 8)) for bf16 (u = 2^-8), fp16 and fp32 (2^-11).
    The summation order across ranks differs from the reference but only moves float32 roundoff.
    """
    return default_tolerance(problem.dtype, problem["K"])


def gemm_features(problem: Problem, comm_bytes: float) -> dict[str, float]:
    """Sizes, per-rank FLOPs and bytes moved: what the policy learns the BSP/fused trade-off from."""
    m, n, k, w = problem["M"], problem["N"], problem["K"], problem.world
    nbytes = problem.torch_dtype.itemsize
    flops = 2.0 * m * n * k / w
    return {
        "log2_m": math.log2(m), "log2_n": math.log2(n), "log2_k": math.log2(k), "world": float(w),
        "dtype_bytes": float(nbytes), "log2_flops": math.log2(flops),
        "log2_comm_bytes": math.log2(max(comm_bytes, 1.0)), "comm_bytes_per_flop": comm_bytes / flops,
        "log2_m_per_rank": math.log2(max(m / w, 1.0)),
    }


def features(problem: Problem) -> dict[str, float]:
    m, n, w = problem["M"], problem["N"], problem.world
    return gemm_features(problem, (w - 1) / w * m * n * problem.torch_dtype.itemsize)


def gemm_sweep(op: str, kind: str, world: int) -> list[Problem]:
    """'gpu': M sweep at N=8192, K=14336; 'llama70b': Llama-3-70B row-parallel layers; 'cpu': tiny."""
    if kind == "gpu":
        return [Problem.make(op, "bfloat16", world, M=m, N=8192, K=14336) for m in SWEEP_M]
    if kind == "llama70b":
        layers = [(8192, 8192), (28672, 8192)]  # attention out-proj, MLP down-proj: (K global, N)
        return [Problem.make(op, "bfloat16", world, M=m, N=n, K=k) for k, n in layers for m in (128, 512, 2048, 8192)]
    if kind == "cpu":
        shapes = [(8, 32, 16, "float32"), (20, 48, 24, "bfloat16"), (16, 40, 32, "float16"), (2, 24, 8, "float32")]
        return [Problem.make(op, dt, world, M=m * world, N=n, K=k * world) for m, n, k, dt in shapes]
    raise ValueError(f"unknown sweep kind {kind!r}: use cpu, gpu or llama70b")


def sweep(kind: str, world: int) -> list[Problem]:
    return gemm_sweep(NAME, kind, world)


# ---------------------------------------------------------------------------------------------
# GEMM configs (shared with gemm_ar)
# ---------------------------------------------------------------------------------------------
def check_gemm(problem: Problem, config: Config, rows: int, extra: dict[str, Any]) -> str | None:
    """Why `config` cannot run a GEMM of `rows` x N x K/W tiles (None if it can).

    `extra` maps each variant-specific key to its allowed values (a tuple or a range). Rejects unknown or missing
    keys, blocks that are not powers of two in 16..256 or exceed the problem, shared memory
    beyond sm_90's 227 KiB and accumulators that would spill.
    """
    keys = set(GEMM_KEYS) | set(extra)
    missing, unknown = sorted(keys - set(config)), sorted(set(config) - keys)
    if missing or unknown:
        return f"config keys: missing {missing}, unknown {unknown} (expects {sorted(keys)})"
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        if config[key] not in BLOCKS:
            return f"{key}={config[key]!r} must be one of {BLOCKS}"
    if not isinstance(config["GROUP_M"], int) or not 1 <= config["GROUP_M"] <= 64:
        return f"GROUP_M={config['GROUP_M']!r} must be an int in 1..64"
    if config["num_warps"] not in WARPS:
        return f"num_warps={config['num_warps']!r} must be one of {WARPS}"
    if not isinstance(config["num_stages"], int) or not 1 <= config["num_stages"] <= 8:
        return f"num_stages={config['num_stages']!r} must be an int in 1..8"
    if config["PARTIAL"] not in PARTIALS:
        return f"PARTIAL={config['PARTIAL']!r} must be one of {PARTIALS}"
    for key, allowed in extra.items():
        if isinstance(allowed, range) and not isinstance(config[key], int):
            return f"{key}={config[key]!r} must be an int in {allowed.start}..{allowed.stop - 1}"
        if config[key] not in allowed:
            bounds = f"an int in {allowed.start}..{allowed.stop - 1}" if isinstance(allowed, range) else f"one of {allowed}"
            return f"{key}={config[key]!r} must be {bounds}"
    n, k_r = problem["N"], problem["K"] // problem.world
    if max(problem["M"] * k_r, k_r * n, problem["M"] * n) >= 1 << 31:
        return "A, B or C has 2^31 elements or more: the kernels index with int32 offsets"
    for key, block, size in (("BLOCK_M", bm, rows), ("BLOCK_N", bn, n), ("BLOCK_K", bk, k_r)):
        if block > max(16, next_pow2(size)):
            return f"{key}={block} exceeds the problem's {size} (rounded up to {max(16, next_pow2(size))})"
    smem = config["num_stages"] * (bm * bk + bk * bn) * problem.torch_dtype.itemsize
    if smem > SMEM_LIMIT:
        return f"shared memory {smem} B for {config['num_stages']} stages exceeds {SMEM_LIMIT} B"
    regs = bm * bn // (32 * config["num_warps"])
    if regs > MAX_ACC_REGS:
        return f"{bm}x{bn} accumulator needs {regs} registers per thread with {config['num_warps']} warps (> {MAX_ACC_REGS})"
    return None


def gemm_space(trial: SearchSpace, extra: dict[str, tuple]) -> Config:
    """Draw a GEMM config; fixed choices per key (Optuna), invalid draws are rejected by check().

    `extra` maps each variant-specific key to the choices to draw from.
    """
    config: Config = {
        "BLOCK_M": trial.suggest_categorical("BLOCK_M", list(BLOCKS)),
        "BLOCK_N": trial.suggest_categorical("BLOCK_N", [32, 64, 128, 256]),
        "BLOCK_K": trial.suggest_categorical("BLOCK_K", [32, 64, 128, 256]),
        "GROUP_M": trial.suggest_categorical("GROUP_M", [1, 4, 8, 16]),
        "num_warps": trial.suggest_categorical("num_warps", list(WARPS)),
        "num_stages": trial.suggest_int("num_stages", 2, 6),
        "PARTIAL": trial.suggest_categorical("PARTIAL", list(PARTIALS)),
    }
    for key, allowed in extra.items():
        config[key] = trial.suggest_categorical(key, list(allowed))
    return config


def _tile(bm: int, bn: int, bk: int, warps: int, stages: int, group_m: int = 8) -> Config:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "num_warps": warps, "num_stages": stages}


def gemm_defaults(problem: Problem, rows: int) -> list[Config]:
    """Known-good GEMM tiles: tiny ones for CPU test problems, GPU-NOTES's H200 tiles otherwise.

    H200 (bf16, graph mode): <= 64 rows: BLOCK 16 x 64..128 with BLOCK_K 128-256; ~128 rows:
    64x64x128; >= 512 rows: 128x128..128x256 x 64, 4-8 warps, 3-4 stages. Stages are cut until
    the tiles fit in shared memory (float32 inputs need twice the bytes).
    """
    k_r = problem["K"] // problem.world
    if rows * problem["N"] * k_r <= TINY_FLOPS:
        tiles = [_tile(16, 32, 16, 4, 2, 2)]
    elif rows <= 32:
        tiles = [_tile(16, 64, 256, 4, 4), _tile(16, 128, 128, 4, 5)]
    elif rows <= 96:
        tiles = [_tile(64, 64, 128, 4, 4), _tile(32, 64, 128, 4, 4)]
    elif rows <= 384:
        tiles = [_tile(64, 128, 64, 4, 4), _tile(128, 128, 64, 4, 4)]
    else:
        tiles = [_tile(128, 128, 64, 8, 4), _tile(128, 256, 64, 8, 3)]
    nbytes = problem.torch_dtype.itemsize
    for t in tiles:
        while t["num_stages"] > 2 and t["num_stages"] * (t["BLOCK_M"] + t["BLOCK_N"]) * t["BLOCK_K"] * nbytes > SMEM_LIMIT:
            t["num_stages"] -= 1
    return tiles


# ---------------------------------------------------------------------------------------------
# Workspace: inbox bytes, counters and epoch on the symmetric heap, cached per (World, op)
# ---------------------------------------------------------------------------------------------
@dataclass
class Workspace:
    """One op's heap workspace on a World, shared by its fused variants and configs.

    Calls of an op run one after another on every rank, so its variants can share one inbox,
    one set of counters (zero between calls) and one epoch counter. Both are split into two fixed
    halves, one per epoch parity, whatever the problem: a peer one call ahead writes only the
    other half, even when its call has another problem, config or variant. Capacities are powers
    of two; a problem that needs more allocates a bigger workspace (every rank at the same call).
    """

    data: torch.Tensor      # uint8, two parity halves, carved into typed inboxes by `view`
    counters: torch.Tensor  # int32, two parity halves, zero between calls
    epoch: torch.Tensor     # int32 [epoch, programs done]

    @property
    def half_bytes(self) -> int:
        return self.data.numel() // 2

    @property
    def half_counters(self) -> int:
        return self.counters.numel() // 2

    def view(self, offset: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """(a `dtype` view of parity 0's inbox from byte `offset` on, the parity stride in elements)."""
        if offset % dtype.itemsize or self.half_bytes % dtype.itemsize:
            raise ValueError(f"offset {offset} is not aligned for {dtype}")
        return self.data[offset:].view(dtype), self.half_bytes // dtype.itemsize


def workspace(world, op: str, nbytes: int, ncounters: int) -> Workspace:
    """The op's workspace on this World: per parity, `nbytes` of inbox and `ncounters` counters."""
    cache: dict[str, Workspace] = world.__dict__.setdefault("_gemm_workspaces", {})
    ws = cache.get(op)
    if ws is None or ws.half_bytes < nbytes or ws.half_counters < ncounters:
        heap = world.heap
        cap_b = 2 * next_pow2(max(nbytes, 1 << 16, ws.half_bytes if ws else 0))
        cap_c = 2 * next_pow2(max(ncounters, 1 << 10, ws.half_counters if ws else 0))
        ws = Workspace(heap.empty(cap_b, dtype=torch.uint8, name=f"{op}.inbox"),
                       heap.zeros(cap_c, dtype=torch.int32, name=f"{op}.counters"),
                       heap.zeros(2, dtype=torch.int32, name=f"{op}.epoch"))
        cache[op] = ws
    return ws


def partial_dtype(problem: Problem, config: Config) -> torch.dtype:
    return torch.float32 if config["PARTIAL"] == "fp32" else problem.torch_dtype


class GemmRunner:
    """Checks a call against the built problem (cheaply), makes or checks `out`, launches."""

    def __init__(self, world, problem: Problem, a_shape: tuple[int, int], b_shape: tuple[int, int],
                 out_shape: tuple[int, int], launch: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]):
        self.world, self.problem, self.launch = world, problem, launch
        self.a_shape, self.b_shape, self.out_shape = a_shape, b_shape, out_shape
        self.dtype = problem.torch_dtype

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if (tuple(a.shape) != self.a_shape or tuple(b.shape) != self.b_shape or a.dtype != self.dtype
                or b.dtype != self.dtype or a.device != self.world.device or b.device != self.world.device):
            raise InvalidInput(f"{self.problem.op}: built for a {self.a_shape} and b {self.b_shape} ({self.dtype}, "
                               f"{self.world.device}), called with a {tuple(a.shape)} {a.dtype} {a.device}, "
                               f"b {tuple(b.shape)} {b.dtype} {b.device}")
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.world.device)
        elif tuple(out.shape) != self.out_shape or out.dtype != self.dtype or out.device != self.world.device:
            raise InvalidInput(f"{self.problem.op}: out must be {self.out_shape} {self.dtype} on {self.world.device}, "
                               f"got {tuple(out.shape)} {out.dtype} {out.device}")
        self.launch(a, b, out)
        return out


def launch_args(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> tuple:
    """The strides every fused GEMM kernel takes after its sizes."""
    return (a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1))


def gemm_meta(problem: Problem, config: Config) -> dict[str, Any]:
    """Constexprs and launch options shared by the fused GEMM kernels."""
    return {"WORLD": problem.world, "BLOCK_M": config["BLOCK_M"], "BLOCK_N": config["BLOCK_N"],
            "BLOCK_K": config["BLOCK_K"], "GROUP_M": config["GROUP_M"],
            "EVEN_K": (problem["K"] // problem.world) % config["BLOCK_K"] == 0,
            "num_warps": config["num_warps"], "num_stages": config["num_stages"]}


# ---------------------------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------------------------
def _group_name(world) -> str:
    return (world.group if world.group is not None else dist.group.WORLD).group_name


def _reduce_scatter(world, out: torch.Tensor, partial: torch.Tensor) -> None:
    """out = this rank's rows of the sum of every rank's `partial` (NCCL; all_reduce + slice on gloo)."""
    if world.backend == "gloo":
        dist.all_reduce(partial, group=world.group)
        m_r = out.shape[0]
        out.copy_(partial[world.rank * m_r:(world.rank + 1) * m_r])
    else:
        dist.reduce_scatter_tensor(out, partial, group=world.group)


def _shapes(problem: Problem) -> tuple[int, int, int, int, int]:
    w = problem.world
    return problem["M"], problem["N"], problem["K"] // w, problem["M"] // w, w


def _check_no_config(problem: Problem, config: Config) -> str | None:
    return f"this variant takes no config, got {config}" if config else None


def _build_bsp(world, problem: Problem, config: Config) -> GemmRunner:
    if config:
        raise InvalidConfig(_check_no_config(problem, config))
    m, n, k_r, m_r, _ = _shapes(problem)
    partial = torch.empty(m, n, dtype=problem.torch_dtype, device=world.device)

    def launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        torch.matmul(a, b, out=partial)
        if out.is_contiguous():
            _reduce_scatter(world, out, partial)
        else:
            tmp = torch.empty_like(out, memory_format=torch.contiguous_format)
            _reduce_scatter(world, tmp, partial)
            out.copy_(tmp)

    return GemmRunner(world, problem, (m, k_r), (k_r, n), (m_r, n), launch)


def _torch_symm_available(world) -> bool:
    """CUDA, and a torch whose symmetric-memory module defines the op (importing it registers it)."""
    if world.device.type != "cuda":
        return False
    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        return hasattr(torch.ops.symm_mem, "fused_matmul_reduce_scatter")
    except (ImportError, AttributeError, RuntimeError):
        return False


def _build_torch_symm(world, problem: Problem, config: Config) -> GemmRunner:
    if config:
        raise InvalidConfig(_check_no_config(problem, config))
    if not _torch_symm_available(world):
        raise InvalidConfig("torch_symm needs CUDA and torch.ops.symm_mem.fused_matmul_reduce_scatter")
    import torch.distributed._symmetric_memory as symm

    group = _group_name(world)
    enabled = getattr(symm, "is_symm_mem_enabled_for_group", lambda name: True)
    if hasattr(symm, "enable_symm_mem_for_group") and not enabled(group):  # needed before torch 2.13
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm.enable_symm_mem_for_group(group)
    m, n, k_r, m_r, _ = _shapes(problem)

    def launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group))

    return GemmRunner(world, problem, (m, k_r), (k_r, n), (m_r, n), launch)


PUSH_LAST_EXTRA: dict[str, tuple] = {}
PUSH_REDUCER_EXTRA: dict[str, Any] = {"FLAG_GRAN": FLAG_GRANS, "REDUCERS": range(1, 1025)}
PUSH_REDUCER_SPACE: dict[str, tuple] = {"FLAG_GRAN": FLAG_GRANS, "REDUCERS": (16, 32, 64, 132, 264)}


def _check_push_last(problem: Problem, config: Config) -> str | None:
    return check_gemm(problem, config, problem["M"] // problem.world, PUSH_LAST_EXTRA)


def _check_push_reducer(problem: Problem, config: Config) -> str | None:
    return check_gemm(problem, config, problem["M"] // problem.world, PUSH_REDUCER_EXTRA)


def _build_push(world, problem: Problem, config: Config, reducer: bool) -> GemmRunner:
    from autofuse.kernels import gemm_rs as k

    reason = (_check_push_reducer if reducer else _check_push_last)(problem, config)
    if reason:
        raise InvalidConfig(reason)
    m, n, k_r, m_r, w = _shapes(problem)
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    tiles_m, per_owner = cdiv(m_r, bm), cdiv(m_r, bm) * cdiv(n, bn)
    pdtype = partial_dtype(problem, config)
    slots = w if reducer else w - 1
    units = tiles_m if config.get("FLAG_GRAN") == "row_block" else per_owner
    ws = workspace(world, NAME, slots * per_owner * bm * bn * pdtype.itemsize, units)
    inbox, inbox_half = ws.view(0, pdtype)
    heap, rank = world.heap, world.rank
    spin = status.spin_limit(world.device.type)
    meta = gemm_meta(problem, config)
    if reducer:
        reducers = min(config["REDUCERS"], units)
        grid = (w * per_owner + reducers,)
        meta.update(ROW_BLOCK=config["FLAG_GRAN"] == "row_block", RED_M=max(1, min(bm, 4096 // bn)))
        kernel, tail = k.gemm_rs_push_reducer_kernel, (w * per_owner, reducers)
    else:
        grid = (w * per_owner,)
        kernel, tail = k.gemm_rs_push_last_kernel, ()

    def launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        kernel[grid](a, b, out, inbox, inbox_half, ws.counters, ws.half_counters, ws.epoch, heap.status,
                     heap.bases, rank, m_r, n, k_r,
                     *launch_args(a, b, out), spin, *tail, **meta)

    return GemmRunner(world, problem, (m, k_r), (k_r, n), (m_r, n), launch)


def _push_last_defaults(problem: Problem) -> list[Config]:
    rows = problem["M"] // problem.world
    tiles = gemm_defaults(problem, rows)
    out = [{**t, "PARTIAL": "fp32"} for t in tiles]
    if problem.dtype != "float32":
        out.append({**tiles[0], "PARTIAL": "out"})
    return out


def _push_reducer_defaults(problem: Problem) -> list[Config]:
    rows = problem["M"] // problem.world
    tiles = gemm_defaults(problem, rows)
    reducers = 8 if rows * problem["N"] <= 1 << 16 else 64
    return [{**tiles[0], "PARTIAL": "fp32", "FLAG_GRAN": "tile", "REDUCERS": reducers},
            {**tiles[-1], "PARTIAL": "out" if problem.dtype != "float32" else "fp32", "FLAG_GRAN": "row_block",
             "REDUCERS": reducers}]


def bound(world, problem: Problem, seed: int) -> dict[str, Callable[[], Any]]:
    """The pieces of the BSP bound: this rank's matmul alone and the reduce-scatter alone."""
    a, b = inputs(world, problem, seed)
    m, n, _, m_r, _ = _shapes(problem)
    partial = torch.matmul(a, b)
    out = torch.empty(m_r, n, dtype=problem.torch_dtype, device=world.device)
    return {"matmul": lambda: torch.matmul(a, b, out=partial),
            "reduce_scatter": lambda: _reduce_scatter(world, out, partial)}


OP = Op(
    name=NAME,
    variants={
        "bsp": Variant("bsp", _build_bsp, check=_check_no_config, fused=False),
        "torch_symm": Variant("torch_symm", _build_torch_symm, check=_check_no_config,
                              available=_torch_symm_available, fused=False),
        "push_last": Variant("push_last", lambda w, p, c: _build_push(w, p, c, reducer=False),
                             space=lambda trial, p: gemm_space(trial, PUSH_LAST_EXTRA),
                             defaults=_push_last_defaults, check=_check_push_last),
        "push_reducer": Variant("push_reducer", lambda w, p, c: _build_push(w, p, c, reducer=True),
                                space=lambda trial, p: gemm_space(trial, PUSH_REDUCER_SPACE),
                                defaults=_push_reducer_defaults, check=_check_push_reducer),
    },
    problem_of=problem_of,
    inputs=inputs,
    reference=reference,
    tolerance=tolerance,
    features=features,
    sweep=sweep,
    description="GEMM + reduce-scatter of rows: A_r (M x K/W) @ B_r (K/W x N) summed over ranks, M/W x N each",
    extra={"bound": bound},
)
