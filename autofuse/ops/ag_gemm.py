"""ag_gemm: all-gather + GEMM (Megatron sequence-parallel -> column-parallel linear).

Two forms, the problem dimension `gather`:
- gather="rows": rank r holds A_r (M/W x K) and B_r (K x N); every rank returns
  concat_rows(A_0, ..., A_{W-1}) @ B_r, M x N. (torch's fused_all_gather_matmul, gather_dim=0.)
- gather="k" (the papers' form): rank r holds A_r (M x K/W), the r-th block of K/W columns of A,
  and B_r (K x N), a whole K x N matrix of its own (the same weight on every rank, or this rank's
  N-column shard of a bigger weight: peers' B are never read). Every rank returns
  concat_cols(A_0, ..., A_{W-1}) @ B_r = sum_s A_s @ B_r[s*K/W : (s+1)*K/W], M x N.
  (torch's fused_all_gather_matmul with gather_dim=1.)
Problem dims: M (global rows), N (columns of B, per rank), K (global), gather.

Requirements (InvalidInput otherwise): A and B 2-D, contiguous, same dtype (bf16, fp16, fp32), on
the World's device, 16-byte aligned; M divisible by W (rows form) or K by W (k form); N and the
K each rank holds (K rows form, K/W k form) multiples of 16 bytes (8 elements in bf16/fp16, 4 in
fp32). Any M >= W, any number of rows per rank (1 included), blocks need not divide anything.

Variants: `bsp` (all-gather with torch.distributed, then torch.matmul), `torch_symm` (torch's own
symm_mem.fused_all_gather_matmul, CUDA only), and the fused Triton kernels of
`autofuse.kernels.ag_gemm`: `pull`, `push`, `push_ws`. Fused configs: BLOCK_M/N/K, GROUP_M,
num_warps, num_stages, FLAG (tile | row_block | shard) and COMM_SMS (producer programs); push and
push_ws also take LAYOUT: "shard" (the default: one inbox slot per peer shard, flags awaited inside
the K loop) or "gathered" (every rank's inbox holds the whole gathered A, own shard included;
each tile waits once for the shards it covers, then runs a pipelined K loop; FLAG must be shard)
and, with it, SPLIT_K (1, 2, 4 or 8: each output tile's K loop split over that many programs whose
float32 partials the last to finish sums). Both fill the GPU at small M, where the GEMM is bound by
streaming B.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from autofuse import status
from autofuse.op import (Config, InvalidConfig, InvalidInput, Op, Problem, SearchSpace, Variant, default_tolerance,
                         dtype_name)

NAME = "ag_gemm"
GATHERS = ("rows", "k")
FLAGS = {"tile": 0, "row_block": 1, "shard": 2}
SMEM_LIMIT = 227 * 1024  # usable shared memory per block on sm_90
MAX_COMM_SMS = 64
CPU_PROGRAMS = 4  # compute programs of push_ws under the interpreter (one "SM" each)
FUSED_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "FLAG", "COMM_SMS")
LAYOUTS = ("shard", "gathered")
SPLITS = (1, 2, 4, 8)
OPTIONAL_KEYS = ("LAYOUT", "SPLIT_K")  # absent: LAYOUT shard, SPLIT_K 1
GATHERED_VARIANTS = ("push", "push_ws")  # the variants with a gathered-layout kernel


# ------------------------------------------------------------------------------------------------
# problems
def _shard_shape(problem: Problem) -> tuple[int, int]:
    """(R, C): rows and columns of the A shard each rank holds."""
    m, k, w = problem["M"], problem["K"], problem.world
    return (m // w, k) if problem["gather"] == "rows" else (m, k // w)


def validate(problem: Problem) -> None:
    """Raise InvalidInput unless the problem meets the stated divisibility and alignment."""
    m, n, k, w, gather = problem["M"], problem["N"], problem["K"], problem.world, problem["gather"]
    if gather not in GATHERS:
        raise InvalidInput(f"ag_gemm: gather must be one of {GATHERS}, got {gather!r}")
    if min(m, n, k, w) < 1:
        raise InvalidInput(f"ag_gemm: sizes must be positive (M={m}, N={n}, K={k}, world={w})")
    if gather == "rows" and m % w:
        raise InvalidInput(f"ag_gemm rows: M={m} is not divisible by the world size {w}")
    if gather == "k" and k % w:
        raise InvalidInput(f"ag_gemm k: K={k} is not divisible by the world size {w}")
    size = problem.torch_dtype.itemsize
    _, c = _shard_shape(problem)
    for what, v in (("N", n), ("K per rank" if gather == "k" else "K", c)):
        if v * size % 16:
            raise InvalidInput(f"ag_gemm: {what}={v} must be a multiple of {16 // size} elements "
                               f"(16 bytes of {problem.dtype}) so rows stay 16-byte aligned")


def problem_of(world: Any, a: torch.Tensor, b: torch.Tensor, gather: str | None = None) -> Problem:
    """Validate this rank's (A_r, B_r) and return the Problem; `gather` is inferred from the shapes.

    B with as many rows as A has columns is the rows form; with W times as many, the k form (at
    W == 1 both are the same computation and the rows form is returned). No collectives.
    """
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise InvalidInput("ag_gemm takes two tensors (A_r, B_r)")
    if a.dim() != 2 or b.dim() != 2:
        raise InvalidInput(f"ag_gemm: A and B must be 2-D, got {a.dim()}-D and {b.dim()}-D")
    if a.dtype != b.dtype:
        raise InvalidInput(f"ag_gemm: A is {a.dtype} but B is {b.dtype}; they must match")
    dtype = dtype_name(a.dtype)
    if a.device != world.device or b.device != world.device:
        raise InvalidInput(f"ag_gemm: inputs on {a.device} and {b.device}, but this rank's device is {world.device}")
    if not a.is_contiguous() or not b.is_contiguous():
        raise InvalidInput("ag_gemm: A and B must be contiguous (row-major); call .contiguous() first")
    if a.data_ptr() % 16 or b.data_ptr() % 16:
        raise InvalidInput("ag_gemm: A and B must start at 16-byte aligned addresses")
    if gather not in (None, *GATHERS):
        raise InvalidInput(f"ag_gemm: gather must be one of {GATHERS}, got {gather!r}")
    w = world.size
    (ra, ca), (kb, n) = a.shape, b.shape
    if gather is None:
        gather = "rows" if kb == ca else "k" if kb == ca * w else None
    if gather == "rows" and kb == ca:
        problem = Problem.make(NAME, dtype, w, M=ra * w, N=n, K=kb, gather="rows")
    elif gather == "k" and kb == ca * w:
        problem = Problem.make(NAME, dtype, w, M=ra, N=n, K=kb, gather="k")
    else:
        raise InvalidInput(
            f"ag_gemm: shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit world size {w}: B must have "
            f"{ca} rows (gather rows) or {ca * w} rows (gather k)" + (f", as gather={gather!r} asks" if gather else ""))
    validate(problem)
    return problem


def _generator(device: torch.device, seed: int, rank: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank)


def _rank_inputs(problem: Problem, seed: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    r, c = _shard_shape(problem)
    g = _generator(device, seed, rank)
    a = torch.randn((r, c), generator=g, device=device, dtype=torch.float32).to(problem.torch_dtype)
    b = torch.randn((problem["K"], problem["N"]), generator=g, device=device, dtype=torch.float32)
    return a, b.to(problem.torch_dtype)


def inputs(world: Any, problem: Problem, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A_r, B_r): random normal, deterministic in (seed, rank), on the World's device."""
    validate(problem)
    return _rank_inputs(problem, seed, world.rank, world.device)


def reference(world: Any, problem: Problem, seed: int) -> torch.Tensor:
    """This rank's expected output in float64 (rebuilds every rank's A shard; no collectives)."""
    shards = [_rank_inputs(problem, seed, s, world.device)[0].to(torch.float64) for s in range(problem.world)]
    full = torch.cat(shards, dim=0 if problem["gather"] == "rows" else 1)
    b = _rank_inputs(problem, seed, world.rank, world.device)[1].to(torch.float64)
    return full @ b


def tolerance(problem: Problem) -> float:
    return default_tolerance(problem.dtype, problem["K"])


def features(problem: Problem) -> dict[str, float]:
    """What the policy learns from: sizes (log2), world, dtype, gather form, communication vs compute."""
    m, n, k, w = problem["M"], problem["N"], problem["K"], problem.world
    size = problem.torch_dtype.itemsize
    flops = 2.0 * m * n * k
    received = (w - 1) / w * m * k * size  # bytes of A each rank receives
    return {
        "log2_M": math.log2(m), "log2_N": math.log2(n), "log2_K": math.log2(k),
        "log2_M_per_rank": math.log2(max(1, m // w)) if problem["gather"] == "rows" else math.log2(m),
        "world": float(w), "dtype_bytes": float(size), "gather_k": float(problem["gather"] == "k"),
        "log2_flops": math.log2(flops), "log2_bytes_received": math.log2(received) if received else 0.0,
        "bytes_per_flop": received / flops, "a_bytes_per_b_byte": m * size / (n * size),
    }


GPU_M = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LLAMA70B_M = (16, 128, 1024, 4096, 16384)
CPU_SHAPES = ((4, 32, 64), (24, 48, 64), (64, 64, 64))


def _valid(problem: Problem) -> bool:
    try:
        validate(problem)
        return True
    except InvalidInput:
        return False


def sweep(kind: str, world: int) -> list[Problem]:
    """Problems to tune/bench.

    gpu: M in 8..16384, N=3584 per rank (N is always per rank, the papers' N_r), K=8192, bf16, rows.
    llama70b: Llama-3-70B column-parallel GEMMs (hidden 8192): QKV N=(8192+2*1024)/W and MLP
    up+gate N=2*28672/W per rank, K=8192, rows form. cpu: tiny problems of both forms.
    """
    if kind == "gpu":
        probs = [Problem.make(NAME, "bfloat16", world, M=m, N=3584, K=8192, gather="rows") for m in GPU_M]
    elif kind == "llama70b":
        probs = [Problem.make(NAME, "bfloat16", world, M=m, N=n // world, K=8192, gather="rows")
                 for n in (8192 + 2 * 1024, 2 * 28672) for m in LLAMA70B_M]
    elif kind == "cpu":
        probs = [Problem.make(NAME, "bfloat16", world, M=m, N=n, K=k, gather=g)
                 for g in GATHERS for (m, n, k) in CPU_SHAPES]
    else:
        raise ValueError(f"unknown sweep {kind!r}: use gpu, llama70b or cpu")
    return [p for p in probs if _valid(p)]


# ------------------------------------------------------------------------------------------------
# fused configs
def _pow2ceil(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _tiny(problem: Problem) -> bool:
    """Problems for the CPU interpreter: small blocks keep it fast."""
    return max(problem["M"], problem["N"], problem["K"]) <= 256


def _gathered_rows(problem: Problem) -> int:
    """Rows of the gathered A (the output's rows): M in both forms."""
    return problem["M"]


def check(problem: Problem, config: Config, variant: str = "push") -> str | None:
    """The reason `config` cannot run `problem` with fused `variant`, or None."""
    missing = [k for k in FUSED_KEYS if k not in config]
    if missing:
        return f"config lacks {', '.join(missing)}"
    unknown = sorted(set(config) - set(FUSED_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        return f"unknown config keys {unknown}"
    layout = config.get("LAYOUT", "shard")
    if layout not in LAYOUTS:
        return f"LAYOUT={layout!r} must be one of {LAYOUTS}"
    if layout == "gathered" and variant not in GATHERED_VARIANTS:
        return f"LAYOUT=gathered is for {' and '.join(GATHERED_VARIANTS)}, not {variant}"
    if layout == "gathered" and config["FLAG"] != "shard":
        return f"LAYOUT=gathered waits per shard: FLAG must be shard, got {config['FLAG']!r}"
    split = config.get("SPLIT_K", 1)
    if split not in SPLITS:
        return f"SPLIT_K={split!r} must be one of {SPLITS}"
    if split > 1 and layout != "gathered":
        return f"SPLIT_K={split} needs LAYOUT=gathered"
    try:
        validate(problem)
    except InvalidInput as exc:
        return str(exc)
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    for name, v in (("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_K", bk)):
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            return f"{name}={v} must be a power of two >= 16 (tl.dot needs 16)"
        if v > 512:
            return f"{name}={v} is larger than 512"
    r, c = _shard_shape(problem)
    if bk > c:
        return f"BLOCK_K={bk} is larger than the K each rank holds ({c})"
    k_steps = -(-(problem["K"]) // bk)
    if split > k_steps:
        return f"SPLIT_K={split} is more than the {k_steps} BLOCK_K steps of K={problem['K']}"
    rows, what = (_gathered_rows(problem), "the gathered A's") if layout == "gathered" else (r, "a shard's")
    if bm > max(16, _pow2ceil(rows)):
        return f"BLOCK_M={bm} is larger than {what} {rows} rows needs"
    if bn > max(16, _pow2ceil(problem["N"])):
        return f"BLOCK_N={bn} is larger than N={problem['N']} needs"
    if not isinstance(config["GROUP_M"], int) or config["GROUP_M"] < 1:
        return f"GROUP_M={config['GROUP_M']} must be a positive integer"
    if config["num_warps"] not in (1, 2, 4, 8, 16):
        return f"num_warps={config['num_warps']} must be 1, 2, 4, 8 or 16"
    if not isinstance(config["num_stages"], int) or not 1 <= config["num_stages"] <= 8:
        return f"num_stages={config['num_stages']} must be in 1..8"
    if config["FLAG"] not in FLAGS:
        return f"FLAG={config['FLAG']!r} must be one of {sorted(FLAGS)}"
    if not isinstance(config["COMM_SMS"], int) or not 1 <= config["COMM_SMS"] <= MAX_COMM_SMS:
        return f"COMM_SMS={config['COMM_SMS']} must be in 1..{MAX_COMM_SMS}"
    smem = config["num_stages"] * (bm * bk + bk * bn) * problem.torch_dtype.itemsize
    if smem > SMEM_LIMIT:
        return (f"shared memory estimate {smem // 1024} KB (stages x A and B tiles) exceeds "
                f"{SMEM_LIMIT // 1024} KB on sm_90")
    return None


def _space_for(variant: str) -> Callable[[SearchSpace, Problem], Config]:
    def space(trial: SearchSpace, problem: Problem) -> Config:
        """The fused search space (LAYOUT first where the variant has one; gathered implies FLAG
        shard); tiny (CPU) problems search small blocks only."""
        if variant not in GATHERED_VARIANTS:
            return _space(trial, problem, "shard")
        return _space(trial, problem, trial.suggest_categorical("LAYOUT", LAYOUTS))
    return space


def _space(trial: SearchSpace, problem: Problem, layout: str) -> Config:
    tiny = _tiny(problem)
    blocks = (16, 32) if tiny else (16, 32, 64, 128, 256)
    config = {
        "BLOCK_M": trial.suggest_categorical("BLOCK_M", blocks),
        "BLOCK_N": trial.suggest_categorical("BLOCK_N", blocks if tiny else (32, 64, 128, 256)),
        "BLOCK_K": trial.suggest_categorical("BLOCK_K", blocks if tiny else (32, 64, 128, 256)),
        "GROUP_M": trial.suggest_categorical("GROUP_M", (1, 4, 8, 16)),
        "num_warps": trial.suggest_categorical("num_warps", (2, 4) if tiny else (2, 4, 8)),
        "num_stages": trial.suggest_int("num_stages", 2, 5),
        "FLAG": "shard" if layout == "gathered" else trial.suggest_categorical("FLAG", tuple(FLAGS)),
        "COMM_SMS": trial.suggest_int("COMM_SMS", 1, 4 if tiny else 32, log=not tiny),
    }
    if layout == "gathered":
        config["LAYOUT"] = "gathered"
        config["SPLIT_K"] = trial.suggest_categorical("SPLIT_K", SPLITS)
    return config


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, flag: str, comm: int, group: int = 8,
         layout: str = "shard", split: int = 1) -> Config:
    config = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, "num_warps": warps,
              "num_stages": stages, "FLAG": flag, "COMM_SMS": comm}
    if layout != "shard":
        config["LAYOUT"] = layout
    if split != 1:
        config["SPLIT_K"] = split
    return config


def _gathered_defaults(problem: Problem, comm: int) -> list[Config]:
    """Gathered-layout tiles for M <= 1024, where streaming B bounds the GEMM: narrow BLOCK_N so
    about one program per SM streams its own columns of B (M <= 64: 112 tiles of 32 columns at
    N=3584), a deep pipeline over long BLOCK_K steps, and split-K twice as many programs with
    shared memory for 2 per SM (<= 110 KB: wgmma tiles keep num_stages buffers); BLOCK_M capped at
    the gathered rows."""
    m = problem["M"]
    if m <= 64:
        tiles = [(64, 32, 256, 4, 4, 1), (16, 64, 256, 4, 4, 1), (64, 32, 128, 4, 4, 2)]
    elif m <= 256:
        tiles = [(64, 64, 128, 4, 4, 1), (128, 64, 128, 8, 3, 1), (64, 64, 128, 4, 3, 2)]
    elif m <= 1024:
        tiles = [(128, 128, 64, 8, 3, 1), (128, 64, 128, 8, 3, 1)]
    else:
        return []
    cap = max(16, _pow2ceil(_gathered_rows(problem)))
    return [_cfg(min(bm, cap), bn, bk, warps, stages, "shard", comm, layout="gathered", split=split)
            for bm, bn, bk, warps, stages, split in tiles]


def _defaults_for(variant: str) -> Callable[[Problem], list[Config]]:
    def defaults(problem: Problem) -> list[Config]:
        """Known-good configs: GPU-NOTES' GEMM tiles by M (BLOCK_M capped at a shard's rows), the
        gathered layout first for push and push_ws at M <= 1024, small blocks for CPU problems;
        at most 4, only configs that pass `check` (none where K per rank < 16)."""
        m = problem["M"]
        gathered = variant in GATHERED_VARIANTS
        if _tiny(problem):
            cands = [_cfg(16, 32, 16, 4, 2, "row_block", 2, 4), _cfg(32, 32, 32, 4, 2, "tile", 1, 4),
                     _cfg(16, 16, 16, 4, 2, "shard", 3, 1), _cfg(16, 32, 32, 4, 2, "shard", 2, 4)]
            if gathered:
                cands.insert(0, _cfg(16, 32, 16, 4, 2, "shard", 2, 4, layout="gathered"))
        else:
            comm = 4 if m <= 256 else 8 if m <= 2048 else 16
            if variant == "push_ws":
                comm *= 2
            if m <= 64:
                tiles = [(16, 64, 256, 4, 3), (16, 64, 128, 4, 4), (16, 128, 128, 4, 4)]
            elif m <= 256:
                tiles = [(64, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 128, 64, 4, 4)]
            else:
                tiles = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4)]
            cap = max(16, _pow2ceil(_shard_shape(problem)[0]))
            cands = [_cfg(min(bm, cap), bn, bk, warps, stages, flag, comm)
                     for (bm, bn, bk, warps, stages), flag in zip(tiles, ("row_block", "shard", "row_block"))]
            if gathered and m <= 1024:
                cands = _gathered_defaults(problem, comm) + cands[:4 - len(_gathered_defaults(problem, comm))]
        valid: list[Config] = []
        for c in cands:
            if check(problem, c, variant) is None and c not in valid:
                valid.append(c)
        return valid[:4]
    return defaults


# ------------------------------------------------------------------------------------------------
# workspace and runners
@dataclass
class Workspace:
    """Heap buffers shared by every fused variant of one World at one capacity.

    One epoch counter for all of them: every fused call, whatever its variant or config, takes the
    next epoch, so parity double-buffering and `>=` flag waits stay sound when calls interleave.
    """

    data: torch.Tensor    # uint8, 2 x W slots of one A shard (viewed in the call's dtype)
    flags: torch.Tensor   # int32 epochs, W x units (units <= ceil(R/16) * ceil(C/16))
    counts: torch.Tensor  # int32, W: per-source arrival counts for FLAG=shard
    epoch: torch.Tensor   # int32 [epoch, programs done]


def _sync(world: Any) -> None:
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)
    world.barrier()


def workspace(world: Any, problem: Problem) -> Workspace:
    """The cached workspace big enough for `problem` (collective on first use of a capacity)."""
    r, c = _shard_shape(problem)
    nbytes = _pow2ceil(2 * problem.world * r * c * problem.torch_dtype.itemsize)
    nflags = _pow2ceil(problem.world * -(-r // 16) * -(-c // 16))
    cache = getattr(world, "_ag_gemm_workspaces", None)
    if cache is None:
        cache = {}
        setattr(world, "_ag_gemm_workspaces", cache)
    key = (nbytes, nflags)
    if key not in cache:
        heap = world.heap
        tag = f"{NAME}.{nbytes}B.{nflags}f"
        ws = Workspace(heap.empty(nbytes, dtype=torch.uint8, name=f"{tag}.data"),
                       heap.zeros(nflags, dtype=torch.int32, name=f"{tag}.flags"),
                       heap.zeros(problem.world, dtype=torch.int32, name=f"{tag}.counts"),
                       heap.zeros(2, dtype=torch.int32, name=f"{tag}.epoch"))
        _sync(world)  # every rank's flags are zero before any peer can raise one
        cache[key] = ws
    return cache[key]


def _check_call(problem: Problem, shapes: tuple, a: torch.Tensor, b: torch.Tensor) -> None:
    if (tuple(a.shape), tuple(b.shape)) != shapes or a.dtype != problem.torch_dtype or b.dtype != a.dtype:
        raise InvalidInput(f"runner built for {problem.key} (A {shapes[0]}, B {shapes[1]}, {problem.dtype}) got "
                           f"A {tuple(a.shape)} {a.dtype}, B {tuple(b.shape)} {b.dtype}")
    if not (a.is_contiguous() and b.is_contiguous()):
        raise InvalidInput("ag_gemm: A and B must be contiguous")


def _out(problem: Problem, a: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    shape = (problem["M"], problem["N"])
    if out is None:
        return torch.empty(shape, dtype=a.dtype, device=a.device)
    if tuple(out.shape) != shape or out.dtype != a.dtype or not out.is_contiguous():
        raise InvalidInput(f"ag_gemm: out must be a contiguous {shape} {a.dtype} tensor, got "
                           f"{tuple(out.shape)} {out.dtype}")
    return out


def _shapes(problem: Problem) -> tuple:
    return (_shard_shape(problem), (problem["K"], problem["N"]))


class FusedRunner:
    """One fused kernel launch per call; epochs, flags and inboxes stay on the device.

    Gathered layout with SPLIT_K > 1: the runner owns the float32 partial tiles and the per-tile
    arrival counts (local memory, not the heap: no peer reads them); the kernel leaves every count
    at 0, so calls and CUDA-graph replays need no clearing.
    """

    def __init__(self, world: Any, problem: Problem, config: Config, kernel: Any, persistent: bool):
        self.problem, self.kernel = problem, kernel
        self.shapes = _shapes(problem)
        r, c = _shard_shape(problem)
        bm, bn = config["BLOCK_M"], config["BLOCK_N"]
        gathered = config.get("LAYOUT", "shard") == "gathered"
        split = config.get("SPLIT_K", 1)
        if gathered:
            tiles = -(-_gathered_rows(problem) // bm) * -(-problem["N"] // bn)
            partials = torch.empty(tiles * split * bm * bn if split > 1 else 1, dtype=torch.float32,
                                   device=world.device)
            tile_counts = torch.zeros(tiles, dtype=torch.int32, device=world.device)
            tiles *= split  # work items: one split of one tile each
        else:
            tiles = -(-r // bm) * -(-problem["N"] // bn) * (1 if problem["gather"] == "k" else problem.world)
        comm = config["COMM_SMS"]
        if persistent:
            sms = (torch.cuda.get_device_properties(world.device).multi_processor_count
                   if world.device.type == "cuda" else comm + CPU_PROGRAMS)
            if comm >= sms:
                raise InvalidConfig(f"COMM_SMS={comm} leaves no SM to compute on ({sms} SMs)")
            self.grid = (comm + min(tiles, sms - comm),)
        else:
            self.grid = (comm + tiles,)
        ws = workspace(world, problem)
        heap = world.heap
        self.args = (ws.data.view(problem.torch_dtype), ws.flags, ws.counts, ws.epoch, heap.status, heap.bases,
                     world.rank, problem.world, status.spin_limit(world.device.type), problem["N"], r, c, comm)
        if gathered:
            self.args += (partials, tile_counts)
            mode = dict(SPLIT_K=split)
        else:
            mode = dict(FLAG=FLAGS[config["FLAG"]])
        self.meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=config["BLOCK_K"], GROUP_M=config["GROUP_M"],
                         **mode, GATHER_K=problem["gather"] == "k",
                         EVEN_K=c % config["BLOCK_K"] == 0,
                         DOT_F32=world.device.type == "cpu" and problem.dtype == "bfloat16",
                         num_warps=config["num_warps"], num_stages=config["num_stages"])

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_call(self.problem, self.shapes, a, b)
        out = _out(self.problem, a, out)
        self.kernel[self.grid](a, b, out, *self.args, **self.meta)
        return out


def _fused(name: str, kernel_name: str, persistent: bool) -> Variant:
    def check_variant(problem: Problem, config: Config) -> str | None:
        return check(problem, config, name)

    def build(world: Any, problem: Problem, config: Config) -> FusedRunner:
        reason = check_variant(problem, config)
        if reason:
            raise InvalidConfig(reason)
        if problem.world != world.size:
            raise InvalidInput(f"problem is for {problem.world} ranks, this World has {world.size}")
        from autofuse.kernels import ag_gemm as kernels

        gathered = config.get("LAYOUT", "shard") == "gathered"
        kernel = getattr(kernels, kernel_name.replace("_kernel", "_gathered_kernel") if gathered else kernel_name)
        return FusedRunner(world, problem, config, kernel, persistent)

    return Variant(name, build, space=_space_for(name), defaults=_defaults_for(name), check=check_variant)


class BspRunner:
    """All-gather with torch.distributed (NCCL / gloo) into a preallocated buffer, then torch.matmul."""

    def __init__(self, world: Any, problem: Problem):
        self.problem, self.group = problem, world.group
        self.shapes = _shapes(problem)
        r, c = _shard_shape(problem)
        m, k, w = problem["M"], problem["K"], problem.world
        dt, dev = problem.torch_dtype, world.device
        self.gathered = torch.empty((w * r, c), dtype=dt, device=dev)  # shard s at rows s*r..
        self.full = self.gathered if problem["gather"] == "rows" else torch.empty((m, k), dtype=dt, device=dev)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_call(self.problem, self.shapes, a, b)
        out = _out(self.problem, a, out)
        dist.all_gather_into_tensor(self.gathered, a, group=self.group)
        if self.problem["gather"] == "k":
            w, m, c = self.problem.world, self.problem["M"], a.shape[1]
            self.full.view(m, w, c).copy_(self.gathered.view(w, m, c).transpose(0, 1))
        torch.matmul(self.full, b, out=out)
        return out


def _build_bsp(world: Any, problem: Problem, config: Config) -> BspRunner:
    if config:
        raise InvalidConfig(f"bsp takes no config, got {sorted(config)}")
    if problem.world != world.size:
        raise InvalidInput(f"problem is for {problem.world} ranks, this World has {world.size}")
    validate(problem)
    return BspRunner(world, problem)


def _symm_available(world: Any) -> bool:
    if world.device.type != "cuda":
        return False
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (registers torch.ops.symm_mem)
    except ImportError:
        return False
    return hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, "fused_all_gather_matmul")


class SymmRunner:
    """torch.ops.symm_mem.fused_all_gather_matmul (gather_dim 0 or 1), copied into `out` if given."""

    def __init__(self, world: Any, problem: Problem):
        import torch.distributed._symmetric_memory as symm

        self.problem = problem
        self.shapes = _shapes(problem)
        self.group_name = (world.group if world.group is not None else dist.group.WORLD).group_name
        if hasattr(symm, "enable_symm_mem_for_group"):
            symm.enable_symm_mem_for_group(self.group_name)
        self.gather_dim = 0 if problem["gather"] == "rows" else 1

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_call(self.problem, self.shapes, a, b)
        _, outs = torch.ops.symm_mem.fused_all_gather_matmul(a, [b], self.gather_dim, self.group_name, return_A=False)
        if out is None:
            return outs[0]
        return _out(self.problem, a, out).copy_(outs[0])


def _build_symm(world: Any, problem: Problem, config: Config) -> SymmRunner:
    if config:
        raise InvalidConfig(f"torch_symm takes no config, got {sorted(config)}")
    if not _symm_available(world):
        raise InvalidConfig("torch_symm needs CUDA and torch.ops.symm_mem.fused_all_gather_matmul")
    validate(problem)
    return SymmRunner(world, problem)


def bound(world: Any, problem: Problem, seed: int) -> dict[str, Callable[[], Any]]:
    """The pieces of the lower bound: the all-gather alone and the full-size matmul alone."""
    a, b = inputs(world, problem, seed)
    r, c = _shard_shape(problem)
    w = problem.world
    gathered = torch.empty((w * r, c), dtype=a.dtype, device=a.device)
    full = torch.randn((problem["M"], problem["K"]), generator=_generator(world.device, seed, w + world.rank),
                       device=world.device).to(a.dtype)
    out = torch.empty((problem["M"], problem["N"]), dtype=a.dtype, device=a.device)
    group = world.group
    return {"allgather": lambda: dist.all_gather_into_tensor(gathered, a, group=group),
            "matmul": lambda: torch.matmul(full, b, out=out)}


OP = Op(
    name=NAME,
    variants={
        "bsp": Variant("bsp", _build_bsp, fused=False),
        "torch_symm": Variant("torch_symm", _build_symm, available=_symm_available, fused=False),
        "pull": _fused("pull", "ag_gemm_pull_kernel", persistent=False),
        "push": _fused("push", "ag_gemm_push_kernel", persistent=False),
        "push_ws": _fused("push_ws", "ag_gemm_push_ws_kernel", persistent=True),
    },
    problem_of=problem_of,
    inputs=inputs,
    reference=reference,
    tolerance=tolerance,
    features=features,
    sweep=sweep,
    description="all-gather of A (rows, or K columns) + GEMM with this rank's B",
    extra={"bound": bound},
)
