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

Requirements (InvalidInput otherwise): A and B 2-D, same dtype (bf16, fp16, fp32), on the World's
device, 16-byte aligned; A contiguous, B row-major or column-major (b = w.t() of a contiguous N x K
weight: the backward formulas hand B^T so; the fused kernels read it K-major, as FP8's, no copy); M divisible by W (rows form) or K by W (k form); N and the
K each rank holds (K rows form, K/W k form) multiples of 16 bytes (8 elements in bf16/fp16, 4 in
fp32). Any M >= W, any number of rows per rank (1 included), blocks need not divide anything.

Variants (`OP.variants`):
- `bsp` (family bsp): all-gather with torch.distributed into a preallocated buffer, torch.matmul.
- `torch_symm` (family peer): torch's symm_mem.fused_all_gather_matmul (FP8: fused_all_gather_scaled_matmul),
  CUDA, one GPU per rank.
- `heap_mm`, `heap_mm_overlap` (family hybrid, in this module on autofuse/ops/hybrid.py): a one-launch heap all-gather
  beside torch.matmul, without or with the local shard's matmul overlapping the peers' arrival.
- `pull`, `push`, `push_ws` (family fused): the one Triton kernel of `autofuse.kernels.ag_gemm`
  with PULL on or off, launched with one program per work item (pull, push) or PERSISTENT
  (push_ws: one program per SM taking work items by ticket, producers joining when done).
  Config: the GEMM keys of `autofuse.core.gemm` (BLOCK_M/N/K, GROUP_M, num_warps, num_stages, SPLIT_K,
  SWAP_AB, TMA; WARP_SPEC must stay false: a waiting consumer cannot be warp-specialised) and the
  op's keys FLAG (tile | row_block | shard: what one flag covers), COMM_SMS (producer programs)
  and LAYOUT (shard | gathered; gathered is push and push_ws only; in the k form only gathered
  takes SPLIT_K > 1). kernels/ag_gemm.py says what each one means.
All fused variants of a World share one workspace, `ag_gemm` (one epoch for all of them: calls of
any fused variant or config may interleave, as long as every rank makes the same calls).

FP8 (`autofuse.ag_gemm(a, b, group=..., scale_a=..., scale_b=...)`, both forms): A_r
float8_e4m3fn row-major, B_r stored N x K (b = w.t(), as torch._scaled_mm takes it), bfloat16 out.
Scales, float32: tensorwise, one 0-dim scale_a that every rank passes alike (one activation scale,
as torch's fused_all_gather_scaled_matmul assumes) and the rank's 0-dim scale_b; row-wise, scale_a
(one per row of A_r: M/W x 1 in the rows form, gathered with the rows; M x 1 in the k form) and the
rank's scale_b (1 x N). In the k form each rank quantises only its K slice, and the slices' products
sum only under one scale per row of the whole A: the contract is that every rank passes the same
scale_a (tensorwise or row-wise). It is not checked: comparing the ranks' scales costs a collective
and a host sync on every call; a rank that breaks it gets its own scale_a applied to the whole sum.
- bsp gathers the FP8 A (rows form: and the row-wise scales) with the collective library, then
  torch._scaled_mm.
- heap_mm / heap_mm_overlap gather it on the heap (rows form, row-wise scales: in a heap all-gather
  of their own, workspace "ag_gemm.hybrid.scales", launched before A's on the same stream, so every
  chunk's scales are there when its wait returns), then torch._scaled_mm (per chunk: its rows of
  the scales). heap_mm_overlap's k form adds one partial product per peer into out; torch._scaled_mm
  cannot accumulate, so in FP8 each chunk's product lands in a bfloat16 buffer of the runner's
  (M x N) first, then adds (out rounded once per peer, as in bf16).
- The fused kernels (pull, push, push_ws, every layout and FLAG, both forms) move the FP8 A over
  the heap as they move bf16 tiles, read B K-major from its N x K storage and scale each summed
  output tile in the epilogue. Row-wise scales in the rows form travel with their rows: the
  producers store my rows' scales into the workspace (after A's data) before each flag that
  publishes those rows, so the waits a tile makes for its rows cover their scales (no launch or
  wait of their own); kernels/ag_gemm.py says how.
- torch_symm calls torch's symm_mem.fused_all_gather_scaled_matmul (rows form, gather_dim 0;
  tensorwise scale_a used for every shard, row-wise scale_a gathered with its rows by the op; passed
  on two H100, 2026-11-26); it refuses the k form (InvalidConfig says why).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from autofuse.core import gemm, settings, shapes
from autofuse.core.custom import Backward, CustomOp, Extra
from autofuse.ops import hybrid
from autofuse.comm import collectives
from autofuse.comm.heap import torch_symm_group, torch_symm_unavailable
from autofuse.comm.world import all_gather_single
from autofuse.core.op import (FP8, SCALINGS, Config, InvalidConfig, InvalidInput, Op, Problem, SearchSpace,
                              Variant, default_tolerance, dtype_name)
from autofuse.core.runner import Runner, TensorSpec
from autofuse.core.sizes import cdiv
from autofuse.comm.workspace import workspace
from autofuse.ops.padded import ag_gemm_any, gather_form

if TYPE_CHECKING:
    from autofuse.comm.world import World

NAME = "ag_gemm"
GATHERS = ("rows", "k")
FLAGS = {"tile": 0, "row_block": 1, "shard": 2}
LAYOUTS = ("shard", "gathered")
OP_KEYS = ("FLAG", "COMM_SMS", "LAYOUT")  # the op's own config keys, beside the GEMM keys of autofuse.core.gemm
MAX_COMM_SMS = 64
MAX_FLAGS = 1 << 20  # unit flags per parity (FLAG=tile with small blocks on big problems)
FLAG_ORDER = ("shard", "row_block", "tile")  # the CPU defaults' rotation


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


def problem_of(world: World, a: torch.Tensor, b: torch.Tensor, scale_a: Any = None, scale_b: Any = None,
               gather: str | None = None) -> Problem:
    """Validate this rank's (A_r, B_r) (FP8: and its scales) and return the Problem; `gather` is
    inferred from the shapes.

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
    extra = gemm.fp8_dims(world.device, a, b, scale_a, scale_b, NAME)  # FP8: scaling; b stored N x K
    if not extra and (not a.is_contiguous() or not (b.is_contiguous() or b.t().is_contiguous())):
        raise InvalidInput("ag_gemm: A must be contiguous (row-major) and B row- or column-major; "
                           "call .contiguous() first")
    if a.data_ptr() % 16 or b.data_ptr() % 16:
        raise InvalidInput("ag_gemm: A and B must start at 16-byte aligned addresses")
    if gather not in (None, *GATHERS):
        raise InvalidInput(f"ag_gemm: gather must be one of {GATHERS}, got {gather!r}")
    w = world.size
    (ra, ca), (kb, n) = a.shape, b.shape
    if gather is None:
        gather = "rows" if kb == ca else "k" if kb == ca * w else None
    if gather == "rows" and kb == ca:
        problem = Problem.make(NAME, dtype, w, M=ra * w, N=n, K=kb, gather="rows", **extra)
    elif gather == "k" and kb == ca * w:
        problem = Problem.make(NAME, dtype, w, M=ra, N=n, K=kb, gather="k", **extra)
    else:
        raise InvalidInput(
            f"ag_gemm: shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit world size {w}: B must have "
            f"{ca} rows (gather rows) or {ca * w} rows (gather k)" + (f", as gather={gather!r} asks" if gather else ""))
    validate(problem)
    return problem


def _generator(device: torch.device, seed: int, rank: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank)


def _rank_inputs(problem: Problem, seed: int, rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    r, c = _shard_shape(problem)
    g = _generator(device, seed, rank)
    a = torch.randn((r, c), generator=g, device=device, dtype=torch.float32).to(problem.torch_dtype)
    if problem.dtype != FP8:
        b = torch.randn((problem["K"], problem["N"]), generator=g, device=device, dtype=torch.float32)
        return a, b.to(problem.torch_dtype)
    b = torch.randn((problem["N"], problem["K"]), generator=g, device=device, dtype=torch.float32)
    shared = _generator(device, seed, -1)  # scales every rank passes alike (seeded by the call only)
    if problem["scaling"] == "tensorwise":  # one activation scale on every rank
        scale_a = torch.rand((), generator=shared, device=device) + 0.5
        scale_b = torch.rand((), generator=g, device=device) + 0.5
    else:  # rows form: this rank's rows' scales; k form: the whole A's rows', alike on every rank
        scale_a = torch.rand((r, 1), generator=shared if problem["gather"] == "k" else g, device=device) + 0.5
        scale_b = torch.rand((1, problem["N"]), generator=g, device=device) + 0.5
    return a, b.to(problem.torch_dtype).t(), scale_a, scale_b


def inputs(world: World, problem: Problem, seed: int) -> tuple[torch.Tensor, ...]:
    """This rank's (A_r, B_r) (FP8: and scale_a, scale_b): random, deterministic in (seed, rank), on
    the World's device."""
    validate(problem)
    return _rank_inputs(problem, seed, world.rank, world.device)


def reference(world: World, problem: Problem, seed: int) -> torch.Tensor:
    """This rank's expected output in float64 (rebuilds every rank's A shard; no collectives); FP8:
    each shard times its scale_a, B times this rank's scale_b."""
    shards = []
    for s in range(problem.world):
        a, _, *scales = _rank_inputs(problem, seed, s, world.device)
        shards.append(a.to(torch.float64) * (scales[0].to(torch.float64) if scales else 1.0))
    full = torch.cat(shards, dim=0 if problem["gather"] == "rows" else 1)
    _, b, *scales = _rank_inputs(problem, seed, world.rank, world.device)
    return full @ (b.to(torch.float64) * (scales[1].to(torch.float64) if scales else 1.0))


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



# ------------------------------------------------------------------------------------------------
# sweeps
GPU_M = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LLAMA70B_M = (16, 128, 1024, 4096, 16384)
CPU_SHAPES = ((4, 32, 64), (24, 48, 64), (64, 64, 64))
DEFAULT_GPU_M = (128, 1024, 4096)
DEFAULT_MODELS = {("llama3-70b", "gate_up"): (8, 512, 2048), ("llama3-70b", "qkv"): (32, 2048),
                  ("llama3-8b", "gate_up"): (128, 8192)}
SCALING = ((8192 + 2 * 1024, (32, 2048)), (2 * 28672, (2048,)))  # Llama-3-70B QKV, gate+up: global N, M
SWEEPS = ("cpu", "gpu", "llama70b", "models", "default", "scaling", "train", "fp8", "fp8-cpu")


def _valid(problem: Problem) -> bool:
    try:
        validate(problem)
        return True
    except InvalidInput:
        return False


def _rows(world: int, m: int, n: int, k: int) -> Problem:
    return Problem.make(NAME, "bfloat16", world, M=m, N=n, K=k, gather="rows")


def sweep(kind: str, world: int) -> list[Problem]:
    """Problems to tune/bench (bf16, rows form unless said; N is always per rank).

    cpu: tiny problems of both forms (the interpreter). gpu: the papers' sweep, M in 8..16384,
    N=3584, K=8192. llama70b: Llama-3-70B's column-parallel GEMMs (QKV N=10240/W, gate+up
    N=57344/W, K=8192). models: every column-parallel GEMM of autofuse.core.shapes at this world size
    (Llama-3 8B/70B/405B, Qwen2.5-72B, Mixtral), at prefill and decode M. default: what `autofuse
    tune` runs on GPUs, 10 problems: three of gpu and seven of models (Llama-3 70B and 8B).
    scaling: three Llama-3-70B problems of one global size at every world size (N = global / world),
    for strong-scaling tables (`autofuse tune --world 1,2 --sweep scaling`). train: every ag_gemm a
    sequence-parallel training step of Llama-3 70B and 8B calls, forward and backward, at 2K-8K tokens
    (autofuse.core.shapes.train_gemms: both forms, the gathered input kept or gathered again).
    """
    if kind == "gpu":
        probs = [_rows(world, m, 3584, 8192) for m in GPU_M]
    elif kind == "llama70b":
        probs = [_rows(world, m, n // world, 8192) for n in (8192 + 2 * 1024, 2 * 28672) for m in LLAMA70B_M]
    elif kind == "models":
        probs = [_rows(world, m, g.N, g.K) for g in shapes.gemms("column", world)
                 for m in shapes.DECODE_M + shapes.PREFILL_M]
    elif kind == "default":
        probs = [_rows(world, m, 3584, 8192) for m in DEFAULT_GPU_M]
        for g in shapes.gemms("column", world, ("llama3-70b", "llama3-8b")):
            probs += [_rows(world, m, g.N, g.K) for m in DEFAULT_MODELS.get((g.model, g.name), ())]
    elif kind == "scaling":
        probs = [_rows(world, m, n // world, 8192) for n, ms in SCALING for m in ms]
    elif kind == "train":
        probs = [Problem.make(NAME, "bfloat16", world, **d) for d in shapes.train_sweep(NAME, world)]
    elif kind == "cpu":
        probs = [Problem.make(NAME, "bfloat16", world, M=m, N=n, K=k, gather=g)
                 for g in GATHERS for (m, n, k) in CPU_SHAPES]
    elif kind == "fp8":
        probs = [Problem.make(NAME, FP8, world, scaling=s, **dict(p.dims)) for p in sweep("default", world)
                 for s in SCALINGS]
    elif kind == "fp8-cpu":
        probs = [Problem.make(NAME, FP8, world, M=m * world, N=n, K=64, gather="rows", scaling=s)
                 for (m, n), s in zip(((4, 32), (12, 48)), SCALINGS)]
    else:
        raise ValueError(f"unknown sweep {kind!r}: use one of {', '.join(SWEEPS)}")
    seen: list[Problem] = []
    for p in probs:
        if _valid(p) and p not in seen:
            seen.append(p)
    return seen


# ------------------------------------------------------------------------------------------------
# fused configs
def gemm_shape(problem: Problem, layout: str) -> tuple[int, int, int]:
    """(rows, n, k) of the GEMM one work item runs: the gathered layout multiplies the gathered A
    (M rows; K columns in one loop in the k form), the shard layout one shard at a time (R x C)."""
    r, c = _shard_shape(problem)
    if layout == "gathered":
        return problem["M"], problem["N"], c if problem["gather"] == "rows" else problem["K"]
    return r, problem["N"], c


def flag_units(problem: Problem, config: Config) -> int:
    """Unit flags of one parity: one per shard, per BLOCK_M rows of a shard, or per BLOCK_M x BLOCK_K tile."""
    r, c = _shard_shape(problem)
    w = problem.world
    rb, kb = cdiv(r, config["BLOCK_M"]), cdiv(c, config["BLOCK_K"])
    return {"shard": w, "row_block": w * rb, "tile": w * rb * kb}[config["FLAG"]]


def check(problem: Problem, config: Config, variant: str = "push") -> str | None:
    """The reason `config` cannot run `problem` with the fused `variant`, or None."""
    if not isinstance(config, dict):
        return f"a config is a dict, got {type(config).__name__}"
    missing = [k for k in ("FLAG", "COMM_SMS") if k not in config]
    if missing:
        return f"config lacks {', '.join(missing)}"
    layout = config.get("LAYOUT", "shard")
    if layout not in LAYOUTS:
        return f"LAYOUT={layout!r} must be one of {LAYOUTS}"
    if layout == "gathered" and variant == "pull":
        return "LAYOUT=gathered is for push and push_ws, not pull (pull reads each shard from its owner)"
    if config["FLAG"] not in FLAGS:
        return f"FLAG={config['FLAG']!r} must be one of {sorted(FLAGS)}"
    comm = config["COMM_SMS"]
    if not isinstance(comm, int) or isinstance(comm, bool) or not 1 <= comm <= MAX_COMM_SMS:
        return f"COMM_SMS={comm!r} must be an int in 1..{MAX_COMM_SMS}"
    try:
        validate(problem)
    except InvalidInput as exc:
        return str(exc)
    rows, n, k = gemm_shape(problem, layout)
    why = gemm.check(config, rows, n, k, problem.dtype, extra=OP_KEYS)
    if why:
        what = "the gathered A's" if layout == "gathered" else "a shard's"
        return f"{why} (LAYOUT={layout}: the GEMM of {what} {rows} rows, N={n}, K={k})"
    cfg = gemm.GemmConfig.from_dict(config)
    if cfg.WARP_SPEC:
        return "WARP_SPEC=true: the consumer waits inside its tile loop, which Triton's warp specialisation rejects"
    if cfg.SPLIT_K > 1 and layout != "gathered" and problem["gather"] == "k":
        return (f"SPLIT_K={cfg.SPLIT_K} needs LAYOUT=gathered in the k form (the shard layout runs each shard's K "
                "loop whole)")
    units = flag_units(problem, config)
    if units > MAX_FLAGS:
        return f"FLAG={config['FLAG']} needs {units} flags (> {MAX_FLAGS}): use bigger blocks or a coarser FLAG"
    return None


def _comm_sms(problem: Problem) -> int:
    """Producer programs: enough to keep NVLink busy for the bytes each peer gets (GPU-NOTES: a
    Triton all-gather peaks at 16 programs for 64 KB, 32 for 0.25-8 MB, 64 for 16 MB; these
    producers also hand their SMs to the GEMM when done, so fewer suffice at small sizes)."""
    r, c = _shard_shape(problem)
    per_peer = r * c * problem.torch_dtype.itemsize
    return 8 if per_peer <= (1 << 20) else 16 if per_peer <= (8 << 20) else 32


def _with(g: Config, problem: Problem, layout: str, flag: str, comm: int) -> Config:
    config = dict(g)
    if layout == "shard" and problem["gather"] == "k":
        config["SPLIT_K"] = 1
    config.update(FLAG=flag, COMM_SMS=comm, LAYOUT=layout)
    return config


class Bsp(Variant):
    """All-gather with torch.distributed (NCCL / gloo) into a preallocated buffer, then torch.matmul."""

    name, family = "bsp", "bsp"

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return BspRunner(world, problem)


class TorchSymm(Variant):
    """torch.ops.symm_mem.fused_all_gather_matmul (gather_dim 0 or 1); FP8: fused_all_gather_scaled_matmul
    (rows form, tensorwise or row-wise scales). CUDA, one GPU per rank."""

    name, family = "torch_symm", "peer"

    def unavailable(self, world: World) -> str | None:
        return torch_symm_unavailable(world, "fused_all_gather_matmul")

    def check(self, problem: Problem, config: Config) -> str | None:
        if problem.dtype == FP8 and problem["gather"] != "rows":
            return ("FP8 takes the rows form only (torch's fused_all_gather_scaled_matmul is wired with "
                    "gather_dim 0: row-wise scales travel with A's rows)")
        return super().check(problem, config)

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return SymmRunner(world, problem)


class Fused(Variant):
    """A fused variant: kernels/ag_gemm.py's kernel with PULL and a grid of its own."""

    family = "fused"
    pull = False
    persistent = False
    layouts: tuple[str, ...] = LAYOUTS

    def check(self, problem: Problem, config: Config) -> str | None:
        return check(problem, config, self.name)

    def space(self, trial: SearchSpace, problem: Problem) -> Config:
        """LAYOUT (where the variant has two), the GEMM keys (autofuse.core.gemm.space, drawn for the
        gathered A's rows in every layout so each key keeps one set of choices per study), FLAG
        and COMM_SMS; `check` rejects what a layout cannot run (e.g. SPLIT_K with shard)."""
        layout = trial.suggest_categorical("LAYOUT", self.layouts) if len(self.layouts) > 1 else self.layouts[0]
        rows, n, k = gemm_shape(problem, "gathered")
        config = gemm.space(trial, rows, n, k, problem.dtype, warp_spec=False)
        tiny = gemm.tiny(rows, n, k)
        config["FLAG"] = trial.suggest_categorical("FLAG", tuple(FLAGS))
        config["COMM_SMS"] = trial.suggest_int("COMM_SMS", 1, 4 if tiny else MAX_COMM_SMS, log=not tiny)
        config["LAYOUT"] = layout
        return config

    def defaults(self, problem: Problem) -> list[Config]:
        """Known-good configs, best guess first, at most 4, all passing `check`.

        The gathered layout first (its tiles span shards, so few rows still fill a tile, and the
        TMA core runs one pipelined K loop): autofuse.core.gemm's first two defaults for the gathered
        GEMM (swap-AB and split-K at small M) with FLAG shard (one wait per tile: at two ranks my
        own rows' work hides the whole peer shard from about 512 rows up), then the shard layout's
        best tile, then FLAG row_block (peers' rows start as they land: more ranks, slower links).
        COMM_SMS from the bytes each peer receives. CPU (tiny) problems: small blocks, every FLAG.
        """
        comm = _comm_sms(problem)
        gathered = gemm.defaults(*gemm_shape(problem, "gathered"), problem.dtype, warp_spec=False)
        shard = gemm.defaults(*gemm_shape(problem, "shard"), problem.dtype, warp_spec=False)
        if gemm.tiny(*gemm_shape(problem, "gathered")):
            comm = 2
            cands = [_with(g, problem, "gathered", f, comm) for g, f in zip(gathered, FLAG_ORDER)]
            cands += [_with(g, problem, "shard", f, comm + 1) for g, f in zip(shard, FLAG_ORDER[1:] + FLAG_ORDER[:1])]
        else:
            cands = [_with(g, problem, "gathered", "shard", comm) for g in gathered[:2]]
            cands += [_with(g, problem, "shard", "shard", comm) for g in shard[:1]]
            cands += [_with(g, problem, "gathered", "row_block", comm) for g in gathered[:1]]
        if "gathered" not in self.layouts:
            cands = [c for c in cands if c["LAYOUT"] in self.layouts]
            cands += [_with(g, problem, "shard", f, comm) for g in shard[1:] for f in ("shard", "row_block")]
        out: list[Config] = []
        for c in cands:
            if self.check(problem, c) is None and c not in out:
                out.append(c)
        return out[:4]

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return FusedRunner(world, problem, config, self.pull, self.persistent)


class Pull(Fused):
    """Remote tile loads: producers copy my shard into my heap; consumers read peers' heaps."""

    name, pull, layouts = "pull", True, ("shard",)


class Push(Fused):
    """Producers store my shard into every peer's workspace; one consumer program per work item."""

    name = "push"


class PushWs(Fused):
    """push, persistent: one program per SM (producers included) takes work items by ticket."""

    name, persistent = "push_ws", True


# ------------------------------------------------------------------------------------------------
# runners
def _specs(problem: Problem) -> tuple[list[TensorSpec], TensorSpec]:
    """a contiguous, b row- or column-major (FP8: b stored N x K, then the two float32 scales); out M x N."""
    r, c = _shard_shape(problem)
    dt = problem.torch_dtype
    if problem.dtype != FP8:
        return ([TensorSpec("a", (r, c), dt), TensorSpec("b", (problem["K"], problem["N"]), dt, "dense")],
                TensorSpec("out", (problem["M"], problem["N"]), dt))
    rowwise = problem["scaling"] == "rowwise"
    return ([TensorSpec("a", (r, c), dt), TensorSpec("b", (problem["K"], problem["N"]), dt, "dense"),
             TensorSpec("scale_a", (r, 1) if rowwise else (), torch.float32),
             TensorSpec("scale_b", (1, problem["N"]) if rowwise else (), torch.float32)],
            TensorSpec("out", (problem["M"], problem["N"]), problem.out_dtype))


class FusedRunner(Runner):
    """One launch of kernels/ag_gemm.py's kernel per call; epochs, flags and data stay on the device.

    The workspace `ag_gemm` holds 2 x W x R x C elements of data (the slots, or the gathered A;
    FP8 row-wise in the rows form: then, 16-byte aligned, the W x R gathered float32 scale_a) and
    2 x (W counts + unit flags) flags. The runner owns the float32 split-K partial tiles, the
    per-tile arrival counts and push_ws's ticket counters (local memory: no peer reads them; the
    kernel leaves every count at 0, so calls and CUDA-graph replays need no clearing).
    """

    def __init__(self, world: World, problem: Problem, config: Config, pull: bool, persistent: bool):
        from autofuse.kernels import ag_gemm as kernels

        inputs, out = _specs(problem)
        r, c = _shard_shape(problem)
        w, n, dt = problem.world, problem["N"], problem.torch_dtype
        layout = config.get("LAYOUT", "shard")
        cfg = gemm.GemmConfig.from_dict(config)
        a_bytes = w * r * c * dt.itemsize
        scales_at = cdiv(a_bytes, 16) * 16  # FP8 row-wise, rows form: the gathered scale_a (W*R float32) after A
        row_scales = problem.get("scaling") == "rowwise" and problem["gather"] == "rows"
        ws = workspace(world, NAME, data_bytes=scales_at + w * r * 4 if row_scales else a_bytes,
                       flags=flag_units(problem, config) + w)
        super().__init__(world, problem, inputs, out, workspaces=(ws,))
        self.ws, self.kernel, self.tma = ws, kernels.ag_gemm_kernel, cfg.TMA
        self.pull, self.stacked = pull, layout == "shard" or problem["gather"] == "rows"
        self.data, self.data_half = ws.data_view(dt)
        self.scales = ws.data_view(torch.float32, scales_at)[0] if row_scales else self.data  # any pointer otherwise
        if layout == "gathered" and problem["gather"] == "rows":
            row_tiles = cdiv(problem["M"], cfg.BLOCK_M)
        else:  # row blocks of a shard (rows form: of every shard)
            row_tiles = cdiv(r, cfg.BLOCK_M) * (w if problem["gather"] == "rows" else 1)
        tiles = row_tiles * cdiv(n, cfg.BLOCK_N)
        work = tiles * cfg.SPLIT_K
        comm = config["COMM_SMS"]
        if persistent:
            sms = gemm.programs(world.device)
            if world.device.type == "cuda" and comm >= sms:
                raise InvalidConfig(f"{NAME}: COMM_SMS={comm} leaves none of the {sms} SMs to compute on")
            self.grid = (comm + min(work, sms - comm if world.device.type == "cuda" else sms),)
        else:
            self.grid = (comm + work,)
        partials = tiles * cfg.SPLIT_K * cfg.BLOCK_M * cfg.BLOCK_N if cfg.SPLIT_K > 1 else 1
        self.partials = torch.empty(partials, dtype=torch.float32, device=world.device)
        self.counts = torch.zeros(tiles + 2, dtype=torch.int32, device=world.device)  # split-K, then tickets
        if cfg.TMA:
            gemm.ensure_allocator()
        self.args = (r, c, n, self.data_half, ws.half_flags, comm)
        self.meta = dict(cfg.fused_kwargs(), FLAG=FLAGS[config["FLAG"]], GATHER_K=problem["gather"] == "k",
                         GATHERED=layout == "gathered", PULL=pull, PERSISTENT=persistent,
                         B_T=problem.dtype == FP8, SCALE=gemm.SCALINGS[problem.get("scaling", "none")])
        # bf16/fp16/fp32 B column-major (b = w.t(), as the backward formulas pass it): the same kernel read
        # K-major (B_T), its own compile, picked per call from B's strides
        self.meta_b_t = dict(self.meta, B_T=True)

    def gathered_copy(self, a: torch.Tensor) -> torch.Tensor:
        """push, push_ws: a fresh M x K copy of the A this runner's last call multiplied, from my own
        workspace (no peer is read): the peers' shards in the parity half of that call's epoch (chosen on
        the device from the epoch counter: no host sync, graph-capturable) and my shard from `a` (the
        shard layout never copies it there). Valid until my next call: only that lets a peer reach the
        epoch that writes this half again."""
        if self.pull:
            raise InvalidInput(f"{NAME}: pull leaves the peers' shards in their heaps; gather A instead")
        (r, c), w = a.shape, self.problem.world
        halves = self.data[:2 * self.data_half].view(2, self.data_half)[:, :w * r * c]
        g = halves.index_select(0, (self.ws.counter[:1] % 2).long())
        rank = self.world.rank
        if not self.stacked:  # the gathered k layout: R x W*C, shard s at columns s*C
            g = g.view(r, w, c)
            g[:, rank] = a
            return g.view(r, w * c)
        g = g.view(w, r, c)  # slot s: shard s, R x C
        g[rank] = a
        if self.problem["gather"] == "rows":
            return g.view(w * r, c)
        return g.transpose(0, 1).reshape(r, w * c)

    def launch(self, a: torch.Tensor, b: torch.Tensor, *scales: torch.Tensor, out: torch.Tensor) -> None:
        if not self.meta["B_T"]:
            meta = self.meta if b.is_contiguous() else self.meta_b_t  # the spec admits row- or column-major
        elif b.stride(0) != 1:
            raise InvalidInput(f"{NAME}: FP8 needs b stored N x K (b = w.t(), as torch._scaled_mm takes it)")
        else:
            meta = self.meta
        if self.tma:
            if (a.data_ptr() | b.data_ptr() | out.data_ptr()) & 15:
                raise InvalidInput(f"{NAME}: A, B and out must start at 16-byte aligned addresses (TMA)")
            gemm.ensure_allocator()  # per thread: autograd's backward launches from its own
        sa, sb = scales or (out, out)  # FP8's scales; unused by the kernel otherwise
        self.kernel[self.grid](a, b, out, sa, sb, self.data, self.scales, self.ws.flags, self.partials, self.counts,
                               self.ws.ctx, *self.args, **meta)


class BspRunner(Runner):
    """The collective library's all-gather (all_gather_single) into a preallocated buffer (k form:
    reordered to M x K), torch.matmul (FP8: torch._scaled_mm)."""

    def __init__(self, world: World, problem: Problem):
        inputs, out = _specs(problem)
        super().__init__(world, problem, inputs, out)
        r, c = _shard_shape(problem)
        m, k, w = problem["M"], problem["K"], problem.world
        dt, dev = problem.torch_dtype, world.device
        self.gathered = torch.empty((w * r, c), dtype=dt, device=dev)  # shard s at rows s*r..
        self.full = self.gathered if problem["gather"] == "rows" else torch.empty((m, k), dtype=dt, device=dev)
        rowwise = problem.get("scaling") == "rowwise" and problem["gather"] == "rows"  # k form: scales are whole
        self.scales = torch.empty((w * r, 1), dtype=torch.float32, device=dev) if rowwise else None

    def gathered_input(self) -> torch.Tensor:
        return self.full

    def launch(self, a: torch.Tensor, b: torch.Tensor, *scales: torch.Tensor, out: torch.Tensor) -> None:
        if scales:  # FP8: the collective moves bytes (uint8 views); row-wise scales travel with their rows
            self.world.collective(all_gather_single, self.gathered.view(torch.uint8), a.view(torch.uint8),
                                  what="ag_gemm.bsp")
            if self.scales is not None:
                self.world.collective(all_gather_single, self.scales, scales[0], what="ag_gemm.bsp")
                scales = (self.scales, scales[1])
        else:
            self.world.collective(all_gather_single, self.gathered, a, what="ag_gemm.bsp")
        if self.problem["gather"] == "k":
            w, m, c = self.problem.world, self.problem["M"], a.shape[1]
            self.full.view(m, w, c).copy_(self.gathered.view(w, m, c).transpose(0, 1))
        gemm.vendor_mm(self.full, b, scales, out)


class SymmRunner(Runner):
    """torch.ops.symm_mem.fused_all_gather_matmul (gather_dim 0 or 1), copied into `out`. FP8:
    fused_all_gather_scaled_matmul (gather_dim 0) with the rank's scale_a (tensorwise: one for every
    shard, as the op takes it; row-wise M/W x 1: the op gathers it with A's rows) and scale_b,
    bfloat16 out and fast accumulation (gemm.vendor_mm's torch._scaled_mm)."""

    def __init__(self, world: World, problem: Problem):
        inputs, out = _specs(problem)
        super().__init__(world, problem, inputs, out)
        self.group_name = torch_symm_group(world)
        self.gather_dim = 0 if problem["gather"] == "rows" else 1
        # Once a caller has asked for the gathered A (`_gathered`: training keeps it for B's gradient), later
        # calls have torch return it (return_A: a local copy of each shard as it lands, instead of a second
        # all-gather); calls before that, and the tuner's, time the op without it.
        self.keep_a = False
        self.kept_a: torch.Tensor | None = None

    def launch(self, a: torch.Tensor, b: torch.Tensor, *scales: torch.Tensor, out: torch.Tensor) -> None:
        if scales:
            _, outs = torch.ops.symm_mem.fused_all_gather_scaled_matmul(
                a, [b], scales[0], [scales[1]], self.gather_dim, self.group_name, biases=[None],
                result_scales=[None], out_dtypes=[out.dtype], use_fast_accum=[True])
            self.kept_a = None
        else:
            self.kept_a, outs = torch.ops.symm_mem.fused_all_gather_matmul(
                a, [b], self.gather_dim, self.group_name, return_A=self.keep_a)
        out.copy_(outs[0])


def bound(world: World, problem: Problem, seed: int) -> dict[str, Any]:
    """The pieces of the lower bound: the all-gather alone and the full-size matmul alone."""
    a, b, *scales = inputs(world, problem, seed)
    r, c = _shard_shape(problem)
    w = problem.world
    gathered = torch.empty((w * r, c), dtype=a.dtype, device=a.device).view(torch.uint8)
    full = torch.randn((problem["M"], problem["K"]), generator=_generator(world.device, seed, w + world.rank),
                       device=world.device).to(a.dtype)
    out = torch.empty((problem["M"], problem["N"]), dtype=problem.out_dtype, device=a.device)
    if scales and scales[0].dim():  # row-wise: the gathered rows' scales
        scales = (torch.rand((problem["M"], 1), device=a.device) + 0.5, scales[1])
    group = world.group
    return {"allgather": lambda: all_gather_single(gathered, a.view(torch.uint8), group=group),
            "matmul": lambda: gemm.vendor_mm(full, b, tuple(scales), out)}


# ------------------------------------------------------------------------------------------------
# hybrids (the shared base: autofuse/ops/hybrid.py)
class _AGRunner(Runner):
    """heap_mm / heap_mm_overlap on one problem (see the module docstring)."""

    def __init__(self, world: World, problem: Problem, ag: collectives.AllGather, overlap: bool, priority: str):
        m, n, k, w = hybrid.dims(problem)
        dt = problem.torch_dtype
        self.ag, self.overlap, self.rows_form = ag, overlap, problem["gather"] == "rows"
        rowwise = problem.get("scaling") == "rowwise"
        # FP8 row-wise, rows form: the scales' own heap all-gather (M/W x 1 float32; its own workspaces, its
        # defaults); the k form's scale_a already covers every row
        self.scales = (collectives.all_gather(world, ag.rows, 1, torch.float32, name=f"{NAME}.hybrid.scales")
                       if rowwise and self.rows_form else None)
        self.streams = hybrid.Streams(world.device, priority)
        r = world.rank
        if self.rows_form:
            self.mine = slice(r * ag.rows, (r + 1) * ag.rows)
        else:
            self.mine = slice(r * ag.cols, (r + 1) * ag.cols)
        self.parts = [(i, *ag.rows_of(c)) for i, c in enumerate(ag.chunks)]
        # FP8 k form, overlapped: torch._scaled_mm cannot accumulate, so a chunk's product lands here, then adds
        self.part = (torch.empty((m, n), dtype=problem.out_dtype, device=world.device)
                     if overlap and not self.rows_form and problem.dtype == FP8 else None)
        specs = [TensorSpec("a", (ag.rows, ag.cols), dt), TensorSpec("b", (k, n), dt, "dense")]
        if problem.dtype == FP8:
            specs += [TensorSpec("scale_a", (ag.rows, 1) if rowwise else (), torch.float32),
                      TensorSpec("scale_b", (1, n) if rowwise else (), torch.float32)]
        super().__init__(world, problem, specs, TensorSpec("out", (m, n), problem.out_dtype),
                         workspaces=ag.workspaces + (self.scales.workspaces if self.scales else ()))

    def gathered_input(self) -> torch.Tensor:
        return self.ag.buffer  # M x K in both forms; peers write it again only in my next call

    def _gather(self, a: torch.Tensor, scales: tuple, waited: bool) -> None:
        """A's heap all-gather; FP8 row-wise: the scales' own gather first, on the same stream, so the
        GEMM after A's gather (heap_mm) or after a chunk's wait (heap_mm_overlap: A's chunk flags are
        raised by the launch that follows the scales' gather) finds every gathered scale in place."""
        if self.scales is not None:
            self.scales._launch(scales[0], self.scales.buffer, waited=False)
        self.ag._launch(a, self.ag.buffer, waited=waited)

    def launch(self, a: torch.Tensor, b: torch.Tensor, *scales: torch.Tensor, out: torch.Tensor) -> None:
        ag = self.ag
        gathered = (self.scales.buffer, scales[1]) if self.scales is not None else scales  # FP8 row-wise: M x 1
        if not self.overlap:
            self._gather(a, scales, waited=False)
            gemm.vendor_mm(ag.buffer, b, gathered, out)
            return
        st = self.streams
        st.fork()
        with st.on_comm():
            self._gather(a, scales, waited=bool(ag.chunks))
        g = ag.buffer
        if self.rows_form:
            gemm.vendor_mm(a, b, scales, out[self.mine])
            for i, rows, _ in self.parts:
                ag.wait(i)
                gemm.vendor_mm(g[rows], b, gemm.scale_rows(gathered, rows), out[rows])
        else:
            gemm.vendor_mm(a, b[self.mine], scales, out)
            for i, rows, cols in self.parts:
                ag.wait(i)
                if self.part is None:
                    out[rows].addmm_(g[rows, cols], b[cols])
                else:
                    gemm.vendor_mm(g[rows, cols], b[cols], gemm.scale_rows(scales, rows), self.part[rows])
                    out[rows] += self.part[rows]
        st.join()


class _AGVariant(hybrid.HybridVariant):
    op = "ag_gemm"
    kind = "all_gather"

    def shape(self, problem: Problem) -> tuple[int, int, int]:
        m, _, k, w = hybrid.dims(problem)
        return (m // w, k, 0) if problem.get("gather", "rows") == "rows" else (m, k // w, 1)

    def problem_error(self, problem: Problem) -> str | None:
        why = super().problem_error(problem)
        if why:
            return why
        m, _, k, w = hybrid.dims(problem)
        gather = problem.get("gather")
        if gather not in ("rows", "k"):
            return f"gather must be rows or k, got {gather!r}"
        if gather == "rows" and m % w:
            return f"rows form: M={m} is not divisible by the world size {w}"
        if gather == "k" and k % w:
            return f"k form: K={k} is not divisible by the world size {w}"
        return None

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        ag = self._collective(world, problem, config)
        return _AGRunner(world, problem, ag, self.overlap, config.get("PRIORITY", "high"))


class HeapMM(_AGVariant):
    """ag_gemm heap_mm: heap all-gather, then torch.matmul on the gathered buffer."""

    name = "heap_mm"


class HeapMMOverlap(_AGVariant):
    """ag_gemm heap_mm_overlap: the local shard's matmul while the peers' shards arrive, then per chunk."""

    name = "heap_mm_overlap"
    overlap = True


# -- the custom op (autofuse/library registers it): fake shape, the gathered A, backward ----------------
# Rank r's shards, W ranks, dC the gradient of this rank's output:
# - rows form, C = all_gather_rows(A) @ B_r: dA_r = reduce_scatter_rows(dC @ B_r^T) = gemm_rs(dC, B_r^T);
#   dB_r = all_gather_rows(A)^T @ dC: from the gathered A the forward kept (the `gathered` extra output,
#   custom op `ag_gemm_gathered`), or gathered again: concat_cols(A_s^T) @ dC = ag_gemm(A_r^T, dC), k form.
# - k form, C = concat_cols(A) @ B_r: dA_r = (sum_s B_s @ dC_s^T)[rows of block r]^T = gemm_rs(B_r, dC^T)^T;
#   dB_r = concat_cols(A)^T @ dC: kept, or gathered again: ag_gemm(A_r^T, dC) in the rows form.
# Whether the forward keeps the gathered A: AUTOFUSE_SAVE_GATHERED (settings.save_gathered, default on,
# as torch's async TP does): M x K per call until backward; off: only A, gathered again in backward
# inside an ag_gemm of the other form (a fused variant overlaps the gather with the GEMM).
def _out_shape(inputs: tuple, w: int) -> tuple[int, int]:
    a, b = inputs[:2]
    return (a.shape[0] * w if gather_form(a, b) == "rows" else a.shape[0], b.shape[1])


def _all_gather(a: torch.Tensor, world: World) -> torch.Tensor:
    """all_gather_rows(A) with torch.distributed, bounded as bsp's collectives are (World.collective)."""
    a = a.contiguous()
    shards = a.new_empty((world.size * a.shape[0], a.shape[1]))
    world.collective(all_gather_single, shards, a, what="autofuse.ag_gemm (all_gather of A for B's gradient)")
    return shards


def _gathered(runner: Runner, inputs: tuple) -> torch.Tensor:
    """A fresh M x K tensor holding the A the runner's last call multiplied: from its buffer where it holds
    it whole (bsp, heap_mm, heap_mm_overlap), from its workspace and `a` (push, push_ws: a local copy), else
    (pull, whose peers' shards stay in their heaps, and torch_symm's first such call: its later calls return
    the A, `SymmRunner.keep_a`) gathered once more (concat_cols(A) in the k form)."""
    a, b = inputs[:2]
    if isinstance(runner, (BspRunner, _AGRunner)):
        return runner.gathered_input().clone()
    if isinstance(runner, FusedRunner) and not runner.pull:
        return runner.gathered_copy(a)
    if isinstance(runner, SymmRunner):
        kept, runner.kept_a, runner.keep_a = runner.kept_a, None, True
        if kept is not None:
            return kept.contiguous()
    shards = _all_gather(a, runner.world)
    if gather_form(a, b) == "rows":
        return shards
    w, (m, c) = shards.shape[0] // a.shape[0], a.shape
    return shards.view(w, m, c).transpose(0, 1).reshape(m, w * c)


def _keep_gathered(inputs: tuple) -> bool:
    """Whether a forward that records autograd keeps the gathered A (B needs grad; AUTOFUSE_SAVE_GATHERED)."""
    return inputs[1].requires_grad and settings.save_gathered(not torch.compiler.is_compiling())


def _keep(inputs: tuple, needs: tuple[bool, ...], extras: Any) -> dict[str, Any]:
    a, b = inputs[:2]
    need_a, need_b = needs[:2]
    kept: dict[str, Any] = {"form": gather_form(a, b), "b": b if need_a else None}
    if "gathered" in extras:
        kept["gathered"] = extras["gathered"] if need_b else None
    else:
        kept["a"] = a if need_b else None
    return kept


def _grads(kept: dict[str, Any], grad: torch.Tensor, needs: tuple[bool, ...], group_name: str) -> tuple:
    need_a, need_b = needs[:2]
    grad, b = grad.contiguous(), kept["b"]
    da = db = None
    if need_a:  # gemm_rs(dC, B^T) in the rows form, gemm_rs(B, dC^T)^T in the k form
        da = (torch.ops.autofuse.gemm_rs(grad, b.t(), group_name) if kept["form"] == "rows"
              else torch.ops.autofuse.gemm_rs(b, grad.t(), group_name).t())
    if need_b:
        full = kept.get("gathered")
        db = full.t() @ grad if full is not None else ag_gemm_any(kept["a"].t().contiguous(), grad, group_name)
    return da, db


CUSTOM = CustomOp(out_shape=_out_shape, backward=Backward(_keep, _grads),
                  extras={"gathered": Extra(lambda inputs, w: (_out_shape(inputs, w)[0], inputs[1].shape[0]),
                                            _gathered, _keep_gathered)})


OP = Op(
    name=NAME,
    args=("a", "b"),
    optional=("scale_a", "scale_b"),
    variants=[Bsp(), TorchSymm(), HeapMM(), HeapMMOverlap(), Pull(), Push(), PushWs()],
    problem_of=problem_of,
    inputs=inputs,
    reference=reference,
    tolerance=tolerance,
    features=features,
    sweep=sweep,
    per_rank=("N",),
    description="all-gather of A (rows, or K columns) + GEMM with this rank's B",
    bound=bound,
    custom=CUSTOM,
)
