"""What the row-parallel GEMM ops share (gemm_rs: + reduce-scatter, gemm_ar: + all-reduce).

Rank r holds A_r (M x K/W) and B_r (K/W x N) (a row-parallel linear layer: K is split), and the
op sums A_q @ B_q over the ranks. This module holds, once for both ops: call validation, inputs,
the float64 reference, the tolerance, features, sweeps, and the base of their fused variants
(typed GEMM config from autofuse/core/gemm.py plus the op's own keys, the heap workspace, the runner
that picks the TMA or pointer path per call). Each op module keeps only what differs.

FP8 (float8_e4m3fn A_r and B_r with float32 scales, as torch._scaled_mm takes them: B_r stored
N x K/W, i.e. b = w_r.t(); scales tensorwise (0-dim each) or row-wise (scale_a M x 1, scale_b
1 x N)): every rank's partial is scaled by its own scales before the sum, C = sum_q (A_q @ B_q) *
sa_q * sb_q in bfloat16. The inputs are then (a, b, scale_a, scale_b), the problem has dtype
float8_e4m3fn and a `scaling` dim; what is reduced is the bfloat16 (or float32) partial.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import torch

from autofuse.core import gemm, shapes
from autofuse.core.op import (FP8, SCALINGS, Config, InvalidInput, Problem, SearchSpace, Variant, config_key,
                              default_tolerance, dtype_name)
from autofuse.core.runner import Runner, TensorSpec
from autofuse.ops import hybrid
from autofuse.comm.workspace import Workspace

if TYPE_CHECKING:
    from autofuse.comm.world import World

PARTIALS = ("fp32", "out")
SWEEP_M = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
GPU_N, GPU_K = 8192, 14336
ALIGN = 256  # bytes between regions of one workspace


# -- call validation, inputs, reference --------------------------------------------------------------
def check_operands(world: World, a: Any, b: Any, op: str) -> None:
    """Raise InvalidInput unless a (M x K_r) and b (K_r x N) are dense 2-D tensors of one supported
    dtype on the World's device."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise InvalidInput(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise InvalidInput(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}")
        if t.device != world.device:
            raise InvalidInput(f"{op}: {name} is on {t.device}, this rank's device is {world.device}")
        if not (t.is_contiguous() or t.t().is_contiguous()):
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


def is_fp8(problem: Problem) -> bool:
    return problem.dtype == FP8


def rank_inputs(problem: Problem, rank: int, seed: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A_rank (M x K/W) and B_rank (K/W x N), standard normal, deterministic in (seed, rank); FP8
    problems: B_rank stored N x K/W, and the rank's own scales (0.5..1.5) after them."""
    m, k_r, n = problem["M"], problem["K"] // problem.world, problem["N"]
    g = torch.Generator(device=device)
    g.manual_seed(seed * 100_003 + rank * 7_919 + 1)
    a = torch.randn(m, k_r, generator=g, device=device, dtype=torch.float32).to(problem.torch_dtype)
    if not is_fp8(problem):
        return a, torch.randn(k_r, n, generator=g, device=device, dtype=torch.float32).to(problem.torch_dtype)
    b = torch.randn(n, k_r, generator=g, device=device, dtype=torch.float32).to(problem.torch_dtype).t()
    shapes = ((), ()) if problem["scaling"] == "tensorwise" else ((m, 1), (1, n))
    scales = [torch.rand(s, generator=g, device=device, dtype=torch.float32) + 0.5 for s in shapes]
    return a, b, *scales


def inputs(world: World, problem: Problem, seed: int) -> tuple[torch.Tensor, ...]:
    return rank_inputs(problem, world.rank, seed, world.device)


def dequantised(problem: Problem, rank: int, seed: int, device: torch.device, rows: slice
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 A_rank[rows] and B_rank with the rank's FP8 scales folded in (as they are otherwise)."""
    a, b, *scales = rank_inputs(problem, rank, seed, device)
    a, b = a[rows].to(torch.float64), b.to(torch.float64)
    if scales:
        sa, sb = (s.to(torch.float64) for s in scales)
        a, b = a * (sa if sa.dim() == 0 else sa[rows]), b * sb
    return a, b


def full_product(world: World, problem: Problem, seed: int, rows: slice) -> torch.Tensor:
    """float64 (sum over ranks of A_q @ B_q)[rows] (FP8: each rank's product times its scales),
    rebuilt from every rank's inputs on this device."""
    acc = None
    for q in range(problem.world):
        a, b = dequantised(problem, q, seed, world.device, rows)
        part = a @ b
        acc = part if acc is None else acc.add_(part)
    return acc


def tolerance(problem: Problem) -> float:
    """`default_tolerance(dtype, K)`: about 5 units of roundoff for the K of the sweeps.

    Against the float64 product of the dtype-rounded inputs, a fused result carries: the float32
    dot products (tf32 inputs for float32 on GPUs: ~u * sqrt(log K) relative), one rounding of each
    partial when PARTIAL='out' (W partials of size ~|C|/sqrt(W) with independent rounding errors
    add up to ~u|C|/sqrt(3) rms) and the final rounding to the dtype (~u/sqrt(3) rms): under 2u
    in all, well inside 4u * max(1, sqrt(log2(K) / 8)) for bf16 (u = 2^-8), fp16 and fp32 (2^-11).
    Split-K and the summation order across ranks only move float32 roundoff. FP8: the reference
    multiplies the FP8 values themselves, the output is bfloat16: bfloat16's bound.
    """
    return default_tolerance(problem.dtype, problem["K"])


def features(problem: Problem, comm_bytes: float) -> dict[str, float]:
    """The op's own features (autofuse.core.features adds log2_M, log2_N, log2_K, world, dtype_bytes):
    per-rank FLOPs, bytes communicated, their ratio and the rows per rank."""
    m, n, k, w = problem["M"], problem["N"], problem["K"], problem.world
    flops = 2.0 * m * n * k / w
    return {"log2_flops": math.log2(flops), "log2_comm_bytes": math.log2(max(comm_bytes, 1.0)),
            "comm_bytes_per_flop": comm_bytes / flops, "log2_M_per_rank": math.log2(max(m / w, 1.0))}


# -- sweeps -------------------------------------------------------------------------------------------
def sweep(op: str, kind: str, world: int, model_m: tuple[int, ...],
          default: Mapping[str, tuple[int, ...]], scaling_m: tuple[int, ...] = ()) -> list[Problem]:
    """Problems of `kind` for `op` at `world` ranks (bf16 unless said):

    - "cpu": tiny problems of every dtype for the interpreter;
    - "gpu": M = 128..16384 at N=8192, K=14336 (the papers' sweep);
    - "llama70b": Llama-3-70B's row-parallel layers (o_proj K=8192, down K=28672; N=8192) at M = 128,
      512, 2048, 8192;
    - "models": every model's row-parallel GEMMs (autofuse.core.shapes: o_proj and down) at `model_m`
      (the op's regime: decode batches for gemm_ar, prefill chunks for gemm_rs);
    - "default" (what `autofuse tune` runs, about 10 problems): `default` maps "gpu" to the M of
      the "gpu" sweep to take, and model names (autofuse.core.shapes) to the M of their o_proj and down;
    - "scaling": Llama-3-70B's o_proj and down (K global) at `scaling_m`, the same problems at every
      world size, for strong-scaling tables (`autofuse tune --world 1,2 --sweep scaling`);
    - "train": every call of `op` in a sequence-parallel training step of Llama-3 70B and 8B, forward and
      backward, at 2K-8K tokens (autofuse.core.shapes.train_gemms; none for gemm_ar, which sequence
      parallelism does not use);
    - "fp8": the "default" problems in FP8 (float8_e4m3fn), tensorwise and row-wise scales;
    - "fp8-cpu": tiny FP8 problems for the interpreter, both scalings.
    Problems whose M is not a multiple of the world size are left out (gemm_rs splits the rows).
    """
    if kind == "cpu":
        tiny = [(8, 32, 16, "float32"), (20, 48, 24, "bfloat16"), (16, 40, 32, "float16"), (2, 24, 8, "float32")]
        return [Problem.make(op, dt, world, M=m * world, N=n, K=k * world) for m, n, k, dt in tiny]
    if kind == "fp8-cpu":
        return [Problem.make(op, FP8, world, M=m * world, N=n, K=32 * world, scaling=s)
                for (m, n), s in zip(((8, 32), (12, 48)), SCALINGS)]
    if kind == "train":
        return [Problem.make(op, "bfloat16", world, **d) for d in shapes.train_sweep(op, world)]
    if kind == "fp8":
        return [Problem.make(op, FP8, world, scaling=s, **{d: p[d] for d in ("M", "N", "K")})
                for p in sweep(op, "default", world, model_m, default, scaling_m) for s in SCALINGS]
    if kind == "gpu":
        dims = [(m, GPU_N, GPU_K) for m in SWEEP_M]
    elif kind == "llama70b":
        dims = [(m, 8192, k) for k in (8192, 28672) for m in (128, 512, 2048, 8192)]
    elif kind == "models":
        dims = [(m, g.N, g.K) for g in shapes.gemms("row", world) for m in model_m]
    elif kind == "scaling":
        dims = [(m, 8192, k) for k in (8192, 28672) for m in scaling_m]
    elif kind == "default":
        dims = [(m, GPU_N, GPU_K) for m in default.get("gpu", ())]
        for model, ms in default.items():
            if model != "gpu":
                dims += [(m, g.N, g.K) for g in shapes.gemms("row", world, (model,)) for m in ms]
    else:
        raise ValueError(f"unknown sweep kind {kind!r}: use cpu, gpu, llama70b, models, default, scaling, train, "
                         "fp8 or fp8-cpu")
    seen: dict[str, Problem] = {}
    for m, n, k in dims:
        if op == "gemm_ar" or m % world == 0:
            p = Problem.make(op, "bfloat16", world, M=m, N=n, K=k)
            seen.setdefault(p.key, p)
    return list(seen.values())


# -- the fused variants' config ----------------------------------------------------------------------
class FusedVariant(Variant):
    """A fused kernel of a row-parallel op: the GEMM keys (autofuse/core/gemm.py) plus the op's own.

    Subclasses set `name`, `keys` (op key -> allowed values; a range for ints), `space_keys` (op key
    -> the choices the tuner draws) and implement `rows` (the GEMM tile grid's rows), `op_defaults`
    and `runner`. `comm_programs(config)` is the programs the kernel keeps off the GEMM.
    """

    family = "fused"
    keys: Mapping[str, Any] = {"PARTIAL": PARTIALS}
    space_keys: Mapping[str, tuple] = {"PARTIAL": PARTIALS}

    def rows(self, problem: Problem) -> int:
        raise NotImplementedError

    def comm_programs(self, config: Mapping[str, Any]) -> int:
        return 0

    def op_defaults(self, problem: Problem) -> list[Config]:
        """The op keys' known-good values, best first (the first goes with every GEMM default): partials
        in the output dtype for bf16/fp16 (half the bytes on the link), then float32."""
        first = "out" if problem.out_dtype.itemsize == 2 else "fp32"
        return [{"PARTIAL": p} for p in dict.fromkeys((first, "fp32"))]

    def gemm_dims(self, problem: Problem) -> tuple[int, int, int]:
        return self.rows(problem), problem["N"], problem["K"] // problem.world

    def check(self, problem: Problem, config: Config) -> str | None:
        why = gemm.check(config, *self.gemm_dims(problem), problem.dtype, extra=tuple(self.keys))
        if why:
            return why
        missing = [k for k in self.keys if k not in config]
        if missing:
            return f"config keys: missing {missing} (the op's keys are {list(self.keys)})"
        for key, allowed in self.keys.items():
            value = config[key]
            if isinstance(allowed, range):
                if not isinstance(value, int) or isinstance(value, bool) or value not in allowed:
                    return f"{key}={value!r} must be an int in {allowed.start}..{allowed.stop - 1}"
            elif value not in allowed:
                return f"{key}={value!r} must be one of {tuple(allowed)}"
        if config.get("WARP_SPEC", False):
            return ("WARP_SPEC=true: fused kernels wait and push inside their tile loop, which Triton's "
                    "warp specialisation rejects")
        return None

    def space(self, trial: SearchSpace, problem: Problem) -> Config:
        config = gemm.space(trial, *self.gemm_dims(problem), problem.dtype, warp_spec=False)
        for key, choices in self.space_keys.items():
            config[key] = trial.suggest_categorical(key, list(choices))
        return config

    def defaults(self, problem: Problem) -> list[Config]:
        """gemm.defaults for the kernel's GEMM (WARP_SPEC off, SMs left by the comm programs),
        the first with every op default, the others with the first op default."""
        op_configs = self.op_defaults(problem)
        sms = gemm.H200_SMS - self.comm_programs(op_configs[0])
        tiles = []
        for c in gemm.defaults(*self.gemm_dims(problem), problem.dtype, sms=sms, warp_spec=False):
            if gemm.check(c, *self.gemm_dims(problem), problem.dtype) is None and c not in tiles:
                tiles.append(c)
        if not tiles:
            return []
        out = [{**tiles[0], **o} for o in op_configs] + [{**t, **op_configs[0]} for t in tiles[1:]]
        unique = {config_key(c): c for c in out if self.check(problem, c) is None}
        return list(unique.values())


def partial_dtype(problem: Problem, config: Mapping[str, Any]) -> torch.dtype:
    """The inbox dtype: float32, or the output dtype (half the bytes for bf16/fp16/FP8's bf16 out)."""
    return torch.float32 if config["PARTIAL"] == "fp32" else problem.out_dtype


def split_k_buffers(world: World, cfg: gemm.GemmConfig, tiles: int, fallback: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials, counts) of the core's split-K workspace for `tiles` output tiles, or `fallback`
    twice when SPLIT_K == 1 (the kernel never touches them then)."""
    if cfg.SPLIT_K == 1:
        return fallback, fallback
    sk = gemm.split_k_workspace(world.device, tiles * cfg.SPLIT_K * cfg.BLOCK_M * cfg.BLOCK_N, tiles)
    return sk.partials, sk.counts


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class FusedRunner(Runner):
    """The runner of a fused row-parallel kernel: a (M x K_r), b (K_r x N), dense (FP8: and the two
    scales, applied to each partial tile before it leaves the GEMM); out contiguous.

    The GEMM reads A and B through TMA descriptors when the config says TMA and this call's a and
    b are row-major (FP8: b stored N x K, read K-major) with 16-byte aligned bases (rows are
    aligned by the config check); otherwise, e.g. for a bf16 b = weight.t(), through the pointer
    path. Subclasses set `kernel`, `grid`, `args` (the kernel's arguments between the scales and
    `ctx`), `sizes` (between `ctx` and the strides) and `tail` (after the strides).
    """

    def __init__(self, world: World, problem: Problem, config: Config, out_rows: int, ws: Workspace):
        specs, out = io_specs(problem, out_rows)
        super().__init__(world, problem, specs, out, workspaces=(ws,))
        self.cfg = gemm.GemmConfig.from_dict(config)
        self.ws = ws
        self.meta = {"WORLD": problem.world, **self.cfg.fused_kwargs()}
        del self.meta["USE_TMA"]  # decided per call from the inputs' alignment (`use_tma`)
        self.meta["SCALE"] = gemm.SCALINGS[problem.get("scaling", "none")]
        self.fp8 = is_fp8(problem)
        if self.cfg.TMA:
            gemm.ensure_allocator()
        self.kernel: Any = None
        self.grid: tuple[int, ...] = (1,)
        self.args: tuple = ()
        self.sizes: tuple = ()
        self.tail: tuple = ()

    def use_tma(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        b_rows = b.stride(0) == 1 if self.fp8 else b.stride(1) == 1  # FP8: b stored N x K
        return (self.cfg.TMA and a.stride(1) == 1 and b_rows and a.data_ptr() % 16 == 0
                and b.data_ptr() % 16 == 0)

    def launch(self, a: torch.Tensor, b: torch.Tensor, *scales: torch.Tensor, out: torch.Tensor) -> None:
        sa, sb = scales or (out, out)  # unused by the kernel without FP8 scales
        tma = self.use_tma(a, b)
        if tma:
            gemm.ensure_allocator()  # per thread: autograd's backward launches from its own
        self.kernel[self.grid](a, b, out, sa, sb, *self.args, self.ws.ctx, *self.sizes, a.stride(0), a.stride(1),
                               b.stride(0), b.stride(1), out.stride(0), out.stride(1), *self.tail,
                               USE_TMA=tma, B_T=self.fp8, **self.meta)


# -- the collective library's side (BSP) ------------------------------------------------------------
def io_specs(problem: Problem, out_rows: int) -> tuple[list[TensorSpec], TensorSpec]:
    """(input specs, out spec) of a row-parallel op's runner: a, b dense (FP8: then scale_a and
    scale_b, float32); out contiguous in the problem's output dtype."""
    m, n, k_r = problem["M"], problem["N"], problem["K"] // problem.world
    dtype = problem.torch_dtype
    specs = [TensorSpec("a", (m, k_r), dtype, "dense"), TensorSpec("b", (k_r, n), dtype, "dense")]
    if is_fp8(problem):
        rowwise = problem["scaling"] == "rowwise"
        specs += [TensorSpec("scale_a", (m, 1) if rowwise else (), torch.float32),
                  TensorSpec("scale_b", (1, n) if rowwise else (), torch.float32)]
    return specs, TensorSpec("out", (out_rows, n), problem.out_dtype)


class RowParallelHybrid(hybrid.HybridVariant):
    """What gemm_rs's and gemm_ar's hybrids share: the collective runs on the M x N partial result."""

    def shape(self, problem: Problem) -> tuple[int, int, int]:
        return problem["M"], problem["N"], 0

    def comm_dtype(self, problem: Problem) -> torch.dtype:
        """The reduced partial's dtype: the output's (bfloat16 for FP8 problems)."""
        return problem.out_dtype

    def problem_error(self, problem: Problem) -> str | None:
        why = super().problem_error(problem)
        if why:
            return why
        m, _, k, w = hybrid.dims(problem)
        if k % w:
            return f"K={k} is not divisible by the world size {w}"
        if self.kind == "reduce_scatter" and m % w:
            return f"M={m} rows are not divisible by the world size {w}"
        return None


def keep_operands(inputs: tuple, needs: tuple[bool, ...], extras: Any) -> dict[str, Any]:
    """What the row-parallel ops' backward keeps (Backward.keep): A where B needs a gradient, B where A does."""
    a, b = inputs[:2]
    return {"a": a if needs[1] else None, "b": b if needs[0] else None}
