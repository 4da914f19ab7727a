"""The GEMM config shared by ag_gemm, gemm_rs and gemm_ar, and the host side of the GEMM core.

`GemmConfig` is the typed form of the GEMM part of a variant's plain config dict (the form the
database stores): BLOCK_M/N/K, GROUP_M, num_warps, num_stages, plus the core's own switches
SPLIT_K, SWAP_AB, TMA, WARP_SPEC and STREAM_K (absent in a dict: 1, False, True, False, False). An
op's own keys
(FLAG, COMM_SMS, PARTIAL, LAYOUT, ...) stay in the dict: `check(..., extra=op_keys)` validates the
GEMM part and accepts those names, and the op checks their values itself:

    why = gemm.check(config, rows, n, k, problem.dtype, extra=("FLAG", "COMM_SMS"))
    if why is None:
        why = op_specific_checks(config)

`space` draws the GEMM keys from an Optuna trial (the op adds its own), `defaults` lists known-good
GEMM configs by problem size, `ensure_allocator` installs the allocator that device-side TMA
descriptors need, and `matmul` launches the core's standalone kernel (kernels/gemm_core.py).
Runtime module: no Optuna import (the trial is the op.SearchSpace protocol).
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from autofuse.core.op import FP8, OUTPUT_DTYPES, Config, InvalidConfig, InvalidInput, SearchSpace
from autofuse.core.sizes import cdiv, next_pow2

SMEM_LIMIT = 232448       # bytes of shared memory one program may use on sm_90 (227 KiB)
SMEM_SLACK = 1024         # mbarriers and alignment, beyond the tile buffers (measured: 24-600 B)
MAX_ACC_REGS = 128        # float32 accumulator registers per thread before a tile spills
WS_MAX_STAGES_128 = 4     # WARP_SPEC with an MMA M side of 128+: 5-6 stages computed wrong (H100, Triton 3.6)
BLOCKS = (16, 32, 64, 128, 256)
WARPS = (4, 8)
MAX_STAGES = 8
MAX_GROUP_M = 64
MAX_SPLIT_K = 16
INT32_LIMIT = 1 << 31
H200_SMS = 132
CPU_PROGRAMS = 4          # persistent programs under the interpreter: several tiles per program
TINY_MACS = 1 << 22       # problems below this many multiply-adds get the interpreter's tiny configs
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, FP8: 1}
FP8_MIN_BLOCK_K = 32      # an FP8 wgmma consumes K in steps of 32
FUSED_ACC_REGS = 64       # defaults(warp_spec=False): at most this many accumulator registers a thread
SCALINGS = {"none": 0, "tensorwise": 1, "rowwise": 2}  # kernels/gemm_core.py NO_SCALE, TENSORWISE, ROWWISE
REQUIRED = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
OPTIONAL: dict[str, Any] = {"SPLIT_K": 1, "SWAP_AB": False, "TMA": True, "WARP_SPEC": False, "STREAM_K": False}
KEYS = REQUIRED + tuple(OPTIONAL)


def _dtype_name(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if dtype not in ELEMENT_BYTES:
        hint = " (float8_e5m2 is a gradient format: FP8 GEMMs take float8_e4m3fn)" if "e5m2" in dtype else ""
        raise ValueError(f"GEMM dtype {dtype!r} not supported{hint}: use one of {sorted(ELEMENT_BYTES)}")
    return dtype


def output_dtype(dtype: str | torch.dtype) -> str:
    """The dtype a GEMM of `dtype` inputs writes: bfloat16 for FP8, else the input dtype."""
    dt = _dtype_name(dtype)
    return OUTPUT_DTYPES.get(dt, dt)


@dataclass(frozen=True)
class GemmConfig:
    """The GEMM part of a config: tile shape, launch options and the core's switches."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3
    SPLIT_K: int = 1
    SWAP_AB: bool = False
    TMA: bool = True
    WARP_SPEC: bool = False
    STREAM_K: bool = False

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "GemmConfig":
        """The GEMM keys of `config` (other keys are the op's and are ignored); absent optional
        keys take their defaults. Raises InvalidConfig if a required key is missing."""
        missing = [k for k in REQUIRED if k not in config]
        if missing:
            raise InvalidConfig(f"GEMM config lacks {', '.join(missing)}")
        return cls(**{k: config[k] for k in KEYS if k in config})

    def to_dict(self) -> Config:
        """Every GEMM key, explicit (the canonical form stored in the database)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "GemmConfig":
        return dataclasses.replace(self, **changes)

    def kernel_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of a gemm_core kernel launch: the constexprs and launch options."""
        return {"BLOCK_M": self.BLOCK_M, "BLOCK_N": self.BLOCK_N, "BLOCK_K": self.BLOCK_K, "GROUP_M": self.GROUP_M,
                "NUM_STAGES": self.num_stages, "SPLIT_K": self.SPLIT_K, "SWAP_AB": self.SWAP_AB,
                "USE_TMA": self.TMA, "WARP_SPEC": self.WARP_SPEC, "STREAM_K": self.STREAM_K,
                "num_warps": self.num_warps, "num_stages": self.num_stages}

    def fused_kwargs(self) -> dict[str, Any]:
        """`kernel_kwargs` without WARP_SPEC and STREAM_K: what the fused kernels built on the core take
        (a program that waits on peers' flags cannot be warp-specialised; they schedule their own tiles)."""
        kwargs = self.kernel_kwargs()
        del kwargs["WARP_SPEC"], kwargs["STREAM_K"]
        return kwargs

    def tiles(self, rows: int, n: int) -> int:
        return cdiv(rows, self.BLOCK_M) * cdiv(n, self.BLOCK_N)

    def work_items(self, rows: int, n: int) -> int:
        """Output tiles times K splits: what a persistent grid loops over."""
        return self.tiles(rows, n) * self.SPLIT_K

    def grid(self, rows: int, n: int, programs: int) -> tuple[int]:
        """Persistent grid: one program per SM (`programs`), never more than there are work items
        (with STREAM_K every program takes a share of the last wave: always `programs`)."""
        return (max(1, programs if self.STREAM_K else min(self.work_items(rows, n), programs)),)

    def stream_k_slots(self, rows: int, n: int, programs: int) -> tuple[int, int]:
        """(partial tiles, counts) the stream-K fixup of a `programs`-program launch needs, as
        gemm_core.stream_k_plan cuts the tail into lanes: per lane a slot per (program, tile)
        piece, lane programs + lane tiles, and a count per tail tile."""
        pid_m, tiles = cdiv(rows, self.BLOCK_M), self.tiles(rows, n)
        lanes = pid_m if pid_m <= self.GROUP_M else self.GROUP_M if pid_m % self.GROUP_M == 0 else 1
        lanes = lanes if lanes <= programs else 1
        tail = tiles - (tiles - tiles % programs) // lanes * lanes
        return lanes * max(programs // lanes, 1) + tail, max(tail, 1)  # lane programs: at most programs // lanes

    def smem_bytes(self, dtype: str | torch.dtype) -> int:
        """Shared memory of one program on sm_90, as Triton 3.6 allocates it: num_stages buffers of
        the A and B tiles; with split-K, the float32 partial tile on its way to the partials buffer
        (a layout change through shared memory that reuses the pipeline's buffers, so the larger of
        the two counts: it is the larger in float32 with few stages); plus the C tile a TMA store
        stages through. Measured exact to the mbarriers' few bytes for TMA, pointer, split-K,
        swap-AB and warp-specialised kernels, float32 and 16-bit (tests/test_gemm_core.py); kernels
        that store float32 tiles through pointers without split-K (gemm_rs's fp32 inbox) reuse the
        pipeline the same way and stay below the model where it binds."""
        e = ELEMENT_BYTES[_dtype_name(dtype)]
        pipeline = self.num_stages * (self.BLOCK_M * self.BLOCK_K + self.BLOCK_K * self.BLOCK_N) * e
        partial = self.BLOCK_M * self.BLOCK_N * 4 if self.SPLIT_K > 1 or self.STREAM_K else 0
        epilogue = self.BLOCK_M * self.BLOCK_N * ELEMENT_BYTES[output_dtype(dtype)] if self.TMA else 0
        return max(pipeline, partial) + epilogue + SMEM_SLACK

    def acc_regs(self) -> int:
        """float32 accumulator registers per thread of the warps that hold it (with WARP_SPEC two
        consumer warpgroups, 8 warps, hold it; the producer warpgroup holds none)."""
        warps = 8 if self.WARP_SPEC else self.num_warps
        return self.BLOCK_M * self.BLOCK_N // (32 * warps)


def op_keys(config: Mapping[str, Any]) -> Config:
    """The keys of `config` that are not the GEMM's (the op's own: FLAG, COMM_SMS, ...)."""
    return {k: v for k, v in config.items() if k not in KEYS}


# ---------------------------------------------------------------------------------------------
# the validator
# ---------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check(config: Mapping[str, Any] | GemmConfig, rows: int, n: int, k: int, dtype: str | torch.dtype,
          extra: Iterable[str] = (), stream_k: bool = False) -> str | None:
    """Why the GEMM part of `config` cannot run a rows x n x k GEMM (A rows x k, B k x n) in `dtype`
    on sm_90, or None. `extra` names the op's own keys (accepted here, checked by the op);
    `stream_k` says the kernel runs STREAM_K (the core's standalone kernel does).

    The rules, and why (one set for every GEMM op; the two earlier validators disagreed):
    - BLOCK_M/N/K powers of two in 16..256: tl.dot needs 16 on every side, a TMA box and a wgmma
      N side stop at 256, and 512 tiles never fit the registers. No block beyond what the problem
      needs (max(16, next_pow2(size))): a bigger one only computes padding.
    - num_warps 4 or 8: a warpgroup (4 warps) issues Hopper's wgmma; 2 warps fall back to the
      older mma.sync, and 16 warps halve each thread's registers for no tile we run.
    - accumulator: BLOCK_M * BLOCK_N / (32 * warps holding it) <= 128 float32 registers per thread
      (of 255), or the tile spills; 128x256 needs 8 warps (or WARP_SPEC's two consumer warpgroups).
    - shared memory: num_stages x (A tile + B tile), or split-K's float32 partial tile where that is
      larger, plus the C tile of a TMA store <= 227 KiB (GemmConfig.smem_bytes; Triton compiles
      bigger kernels and fails only at launch, with OutOfResources).
    - num_stages 1..8, GROUP_M 1..64.
    - TMA: A's and B's row strides (k and n elements) must be multiples of 16 bytes (a tensor
      descriptor's rule; base addresses are checked at launch).
    - SPLIT_K 1..16 and at most the number of BLOCK_K steps of k, so no split is empty.
    - WARP_SPEC (Triton 3.6's Hopper warp specialisation, measured by AOT compiles): only with TMA
      (the pointer path fails to compile), num_warps 4 (the pass builds one producer and two
      consumer warpgroups, 12 warps; with 8 it silently does nothing), 16-bit inputs (float32
      fails to compile), SPLIT_K 1 (silently not specialised) and an MMA M side (BLOCK_M, or
      BLOCK_N with SWAP_AB) of at least 64 (smaller tiles use mma.sync: nothing to specialise).
      Measured on an H100 (Triton 3.6, scripts/diag_warp_spec.py, 2026-11-27): an MMA M side of
      128 (two consumer warpgroups) at 5 or 6 stages computes wrong, non-finite and not
      repeatable outputs (2-4 stages, and 64-row tiles at 2-6, are right), and 64 x 256 tiles
      fail to compile; both are refused.
    - STREAM_K (the last wave's tiles shared out in K steps, kernels/gemm_core.py stream_k_plan):
      only in the core's standalone kernel (`prepare`: stream_k=True; the fused kernels schedule
      their own tiles), with SPLIT_K 1 (one way of splitting K at a time) and without WARP_SPEC
      (a kernel with a second tile loop is not specialised).
    - FP8 (float8_e4m3fn inputs, bfloat16 output): BLOCK_K >= 32 (an FP8 wgmma takes K in 32s).
    - int32 offsets: A, B and C under 2^31 elements, and so the split-K partials.
    """
    extra = set(extra)
    if isinstance(config, GemmConfig):
        config = config.to_dict()
    missing = [key for key in REQUIRED if key not in config]
    unknown = sorted(set(config) - set(KEYS) - extra)
    if missing or unknown:
        return (f"config keys: missing {missing}, unknown {unknown} "
                f"(GEMM keys {list(KEYS)}" + (f", op keys {sorted(extra)})" if extra else ")"))
    try:
        dt = _dtype_name(dtype)
    except ValueError as exc:
        return str(exc)
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        if config[key] not in BLOCKS or not _is_int(config[key]):
            return f"{key}={config[key]!r} must be one of {BLOCKS} (a power of two in 16..256)"
    if not _is_int(config["GROUP_M"]) or not 1 <= config["GROUP_M"] <= MAX_GROUP_M:
        return f"GROUP_M={config['GROUP_M']!r} must be an int in 1..{MAX_GROUP_M}"
    if not _is_int(config["num_warps"]) or config["num_warps"] not in WARPS:
        return f"num_warps={config['num_warps']!r} must be one of {WARPS} (a wgmma needs a 4-warp warpgroup)"
    if not _is_int(config["num_stages"]) or not 1 <= config["num_stages"] <= MAX_STAGES:
        return f"num_stages={config['num_stages']!r} must be an int in 1..{MAX_STAGES}"
    split = config.get("SPLIT_K", OPTIONAL["SPLIT_K"])
    if not _is_int(split) or not 1 <= split <= MAX_SPLIT_K:
        return f"SPLIT_K={split!r} must be an int in 1..{MAX_SPLIT_K}"
    for key in ("SWAP_AB", "TMA", "WARP_SPEC", "STREAM_K"):
        if not isinstance(config.get(key, OPTIONAL[key]), bool):
            return f"{key}={config[key]!r} must be true or false"
    if min(rows, n, k) < 1:
        return f"GEMM sizes must be positive (rows={rows}, n={n}, k={k})"
    cfg = GemmConfig.from_dict(config)
    for key, block, size in (("BLOCK_M", cfg.BLOCK_M, rows), ("BLOCK_N", cfg.BLOCK_N, n), ("BLOCK_K", cfg.BLOCK_K, k)):
        cap = max(16, next_pow2(size))
        if block > cap:
            return f"{key}={block} is larger than {size} needs (at most {cap})"
    if dt == FP8 and cfg.BLOCK_K < FP8_MIN_BLOCK_K:
        return f"BLOCK_K={cfg.BLOCK_K} is too small for FP8 (an FP8 wgmma takes K in steps of {FP8_MIN_BLOCK_K})"
    regs = cfg.acc_regs()
    if regs > MAX_ACC_REGS:
        warps = "two consumer warpgroups" if cfg.WARP_SPEC else f"{cfg.num_warps} warps"
        return (f"a {cfg.BLOCK_M}x{cfg.BLOCK_N} float32 accumulator over {warps} needs {regs} registers per thread "
                f"(> {MAX_ACC_REGS}: it would spill)")
    smem = cfg.smem_bytes(dt)
    if smem > SMEM_LIMIT:
        return (f"shared memory {smem} B ({cfg.num_stages} stages of {cfg.BLOCK_M}x{cfg.BLOCK_K} + {cfg.BLOCK_K}x"
                f"{cfg.BLOCK_N} {dt}" + (f", or split-K's {cfg.BLOCK_M}x{cfg.BLOCK_N} float32 partial if larger"
                                          if cfg.SPLIT_K > 1 else "")
                + (" + the TMA store's C tile" if cfg.TMA else "") + f") exceeds {SMEM_LIMIT} B on sm_90")
    e = ELEMENT_BYTES[dt]
    if cfg.TMA:
        for what, size in (("k (A's row stride)", k), ("n (B's and C's row stride)", n)):
            if size * e % 16:
                return (f"TMA needs 16-byte aligned row strides: {what} = {size} {dt} elements is not a multiple "
                        f"of {16 // e}; use TMA=false")
    steps = cdiv(k, cfg.BLOCK_K)
    if cfg.SPLIT_K > steps:
        return f"SPLIT_K={cfg.SPLIT_K} is more than the {steps} BLOCK_K steps of k={k}"
    if cfg.WARP_SPEC:
        mma_m = cfg.BLOCK_N if cfg.SWAP_AB else cfg.BLOCK_M
        why = ("needs TMA (the pointer path does not compile)" if not cfg.TMA else
               f"needs num_warps=4 (got {cfg.num_warps}: Triton's Hopper pass builds 3 warpgroups from 4 warps)"
               if cfg.num_warps != 4 else
               "needs bfloat16 or float16 inputs (float32 does not compile)" if e != 2 else
               "needs SPLIT_K=1 (Triton does not specialise the split-K kernel)" if cfg.SPLIT_K > 1 else
               f"needs an MMA M side >= 64 ({'BLOCK_N' if cfg.SWAP_AB else 'BLOCK_M'}={mma_m} runs mma.sync)"
               if mma_m < 64 else
               f"needs num_stages <= {WS_MAX_STAGES_128} with an MMA M side of {mma_m} (two consumer warpgroups: "
               f"at {cfg.num_stages} stages the outputs were wrong, non-finite and not repeatable on an H100 with "
               f"Triton 3.6, scripts/diag_warp_spec.py)" if mma_m >= 128 and cfg.num_stages > WS_MAX_STAGES_128 else
               f"does not compile with a {cfg.BLOCK_M}x{cfg.BLOCK_N} tile (Triton 3.6: PassManager::run failed)"
               if mma_m == 64 and (cfg.BLOCK_M if cfg.SWAP_AB else cfg.BLOCK_N) >= 256 else None)
        if why:
            return f"WARP_SPEC {why}"
    if cfg.STREAM_K:
        why = ("is run only by the core's standalone kernel (this kernel schedules its own tiles)" if not stream_k else
               "needs SPLIT_K=1 (one way of splitting K at a time)" if cfg.SPLIT_K > 1 else
               "needs WARP_SPEC=false (the stream-K loop is not warp-specialised)" if cfg.WARP_SPEC else None)
        if why:
            return f"STREAM_K {why}"
    biggest = max(rows * k, k * n, rows * n, cfg.tiles(rows, n) * cfg.SPLIT_K * cfg.BLOCK_M * cfg.BLOCK_N)
    if biggest >= INT32_LIMIT:
        return f"an operand or the split-K partials have {biggest} >= 2^31 elements: the core indexes with int32"
    return None


# ---------------------------------------------------------------------------------------------
# search space and defaults
# ---------------------------------------------------------------------------------------------
def tiny(rows: int, n: int, k: int) -> bool:
    """Problems for the CPU interpreter: small blocks keep it fast."""
    return rows * n * k <= TINY_MACS


def _tma_ok(n: int, k: int, dtype: str) -> bool:
    e = ELEMENT_BYTES[_dtype_name(dtype)]
    return n * e % 16 == 0 and k * e % 16 == 0


def space(trial: SearchSpace, rows: int, n: int, k: int, dtype: str | torch.dtype, warp_spec: bool = True,
          stream_k: bool = False) -> Config:
    """Draw the GEMM keys of a config (define-by-run); the op draws its own keys after. Kernels that
    wait or push inside their tile loop pass warp_spec=False (Triton's Hopper warp specialisation
    rejects such loops); only a kernel that runs STREAM_K passes stream_k=True.

    Every key's choices depend only on the problem (Optuna needs fixed choices per parameter within
    a study); combinations `check` rejects (shared memory, registers, WARP_SPEC limits) are
    rejected by the tuner without running. Tiny (interpreter) problems search small blocks.
    """
    dt = _dtype_name(dtype)
    cap = lambda size: max(16, next_pow2(size))  # noqa: E731
    min_k = FP8_MIN_BLOCK_K if dt == FP8 else 16
    if tiny(rows, n, k):
        blocks = (16, 32)
        config: Config = {
            "BLOCK_M": trial.suggest_categorical("BLOCK_M", [b for b in blocks if b <= cap(rows)]),
            "BLOCK_N": trial.suggest_categorical("BLOCK_N", [b for b in blocks if b <= cap(n)]),
            "BLOCK_K": trial.suggest_categorical("BLOCK_K", [b for b in blocks if min_k <= b <= max(cap(k), min_k)]),
            "GROUP_M": trial.suggest_categorical("GROUP_M", [1, 4]),
            "num_warps": 4,
            "num_stages": 2,
        }
    else:
        config = {
            "BLOCK_M": trial.suggest_categorical("BLOCK_M", [b for b in BLOCKS if b <= cap(rows)]),
            "BLOCK_N": trial.suggest_categorical("BLOCK_N", [b for b in (32, 64, 128, 256) if b <= cap(n)]),
            "BLOCK_K": trial.suggest_categorical("BLOCK_K", [b for b in (32, 64, 128, 256)
                                                             if b <= max(cap(k), min_k)]),
            "GROUP_M": trial.suggest_categorical("GROUP_M", [1, 4, 8, 16]),
            "num_warps": trial.suggest_categorical("num_warps", list(WARPS)),
            "num_stages": trial.suggest_int("num_stages", 2, 6),
        }
    config["TMA"] = trial.suggest_categorical("TMA", [True, False]) if _tma_ok(n, k, dt) else False
    config["SWAP_AB"] = trial.suggest_categorical("SWAP_AB", [False, True]) if rows <= 64 else False
    few_tiles = cdiv(rows, 64) * cdiv(n, 128) < H200_SMS
    config["SPLIT_K"] = trial.suggest_categorical("SPLIT_K", [1, 2, 4, 8]) if few_tiles else 1
    ws_possible = warp_spec and config["TMA"] and ELEMENT_BYTES[dt] == 2 and not tiny(rows, n, k)
    config["WARP_SPEC"] = trial.suggest_categorical("WARP_SPEC", [False, True]) if ws_possible else False
    config["STREAM_K"] = trial.suggest_categorical("STREAM_K", [False, True]) if stream_k else False
    return config


def auto_split(tiles: int, steps: int, sms: int = H200_SMS, min_steps: int = 4) -> int:
    """SPLIT_K for a problem of `tiles` output tiles: 1 when the tiles fill at least half the SMs
    (splitting then buys less than the float32 partials cost: SPLIT_K x M x N x 4 bytes written and
    read), else the split in (1, 2, 4, 8) whose work items fill the SMs' waves best (ties: fewer
    splits), keeping at least `min_steps` BLOCK_K steps per split (the pipeline's depth)."""
    if 2 * tiles > sms:
        return 1
    best, best_eff = 1, 0.0
    for split in (1, 2, 4, 8):
        if split > 1 and steps // split < min_steps:
            break
        items = tiles * split
        eff = items / (cdiv(items, sms) * sms)
        if eff > best_eff + 1e-9:
            best, best_eff = split, eff
    return best


def last_wave_fill(tiles: int, sms: int = H200_SMS) -> float:
    """Share of the SMs busy in the last wave of `tiles` data-parallel tiles (1.0: whole waves)."""
    tail = tiles % sms
    return 1.0 if tail == 0 else tail / sms


def stream_k_helps(tiles: int, steps: int, sms: int = H200_SMS) -> bool:
    """Whether STREAM_K is worth a candidate: the last wave leaves at least a fifth of the SMs idle
    and its tiles hold enough K steps for every SM's share to keep the pipeline full."""
    return last_wave_fill(tiles, sms) <= 0.8 and (tiles % sms) * steps >= 4 * sms


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, group: int = 8, split: int = 1, swap: bool = False,
         tma: bool = True, ws: bool = False) -> GemmConfig:
    return GemmConfig(bm, bn, bk, group, warps, stages, split, swap, tma, ws)


def defaults(rows: int, n: int, k: int, dtype: str | torch.dtype, sms: int = H200_SMS,
             warp_spec: bool = True, stream_k: bool = False) -> list[Config]:
    """Known-good GEMM configs for a rows x n x k GEMM, best guess first (every one passes `check`;
    none warp-specialised with warp_spec=False, for kernels that wait inside their tile loop). With
    stream_k=True (the core's standalone kernel), every config's STREAM_K twin follows wherever its
    last wave leaves SMs idle (`stream_k_helps`): the tile that is best without stream-K is often
    not the first guess (one H100, 2026-11-25: 512 x 5120 x 8192 ran best at 128x256x64, the third).

    From GPU-NOTES (H200, bf16, graph mode): the persistent TMA kernel is best at 128x256x64,
    3 stages, 8 warps from 1024 rows up, and at 64x128..256 with BLOCK_K 64-128 below; a plain
    Triton GEMM was best at BLOCK 16 x 64..128 x 128-256 for <= 64 rows, where the core adds
    swap-AB (BLOCK_N on the wgmma's M side) and split-K (auto_split fills the SMs when few tiles
    exist). With warp_spec=False (the fused kernels, whose flags, peers' addresses and epilogue
    state live in registers beside the accumulator) a tile whose accumulator needs more than
    FUSED_ACC_REGS registers a thread on 4 warps runs on 8: on 4 warps the 128x128 tile spilled in
    gemm_rs's and gemm_ar's kernels (80-520 bytes, Triton 3.6's ptxas).

    From the wide search (`autofuse bench gemm_core --search wide`, one H100, 2026-11-26,
    docs/results/gemm_core.md): deep pipelines win where they fit: the same tile at 3 stages ran
    1.2-1.6x the time of 5 (64x128x64, 128x128x64, 128x64x64; FP8 alike at BLOCK_K 128), and
    128x128x64 on 4 warps at 5 stages was the most frequent best tile from 128 to 1024 rows. FP8 at
    <= 256 rows is memory-bound (B streamed once): there the pointer path (cp.async, no C tile in
    shared memory) beat TMA, 64x64x256 at 5 stages and 64x128x256 at 4 (runs s7, s8: at 64-128 rows
    and N 3584/5120 the best of these was 1.04x `_scaled_mm`'s time where TMA tiles were 1.19x).
    The fused kernels (warp_spec=False) put one pointer tile first at 65-256 rows and keep the TMA
    tiles next: their FP8 pointer path passed on two H100 (2026-11-27, runs g1/g2: every fused
    variant of the three ops, eager and graph replay), and at op level (run g4, two H100, graph
    mode) the pointer tile beat its TMA twin in 16 of 20 gemm_ar and ag_gemm push/push_ws cases at
    128 rows (by 3-13%; lost three by up to 15%) and 2 of 4 at 256; at <= 64 rows they keep TMA first
    (ag_gemm pull's shard GEMM ran the 64x64x256 swap-AB pointer tile at 140 us where the TMA
    64x128x256 tile ran 75).

    From the wide search with 6 stages (two H100, 2026-11-27, run g2), for the core's own kernel
    (the fused kernels: below): FP8 at 129-1024 rows leads with
    pointer-path 128x128x128 on 8 warps at 6 stages and 128x256x128 at 4 (256-512 rows, N
    3584/5120: 1.09-1.28x `_scaled_mm` where the TMA defaults ran 1.20-1.42x); bf16 at 65-256
    rows takes 128x128x64 at 6 stages (1.18-1.20x cuBLAS at 256 x 5120, 5 stages 1.24) and the
    pointer-path 64x64x128 at 6 (128 x 3584: 1.06 and 0.88x, the defaults 1.20 and 0.93).
    Inside the fused kernels (run g5, scripts/fused_tile_probe.py, two H100, graph mode, each
    output checked against the reference): FP8 128x128x128 w8 s6 on the pointer path ran ag_gemm
    push at 1024 gathered rows in 0.82x the first default's time but gemm_rs push_last at 2048 rows
    in 1.21x; so FP8 at 257-1024 rows takes it second, after the TMA tile. bf16 at 6 stages lost in
    gemm_rs (1.31-1.34x) and tied in ag_gemm (0.96-1.02x): the fused bf16 tiles keep 5 stages.

    Tiny (interpreter) problems get 16x32 tiles. float32 halves BLOCK_K or the stages
    until the tiles fit (`check`); FP8 doubles BLOCK_K (the same bytes per stage as bf16, as
    Triton's FP8 tutorial tiles: 128x256x128), at least 32. TMA is off where row strides are not
    16-byte aligned.
    """
    dt = _dtype_name(dtype)
    tma = _tma_ok(n, k, dt)
    small = min(64, max(16, next_pow2(rows)))
    if tiny(rows, n, k):
        cands = [_cfg(16, 32, 32, 4, 2, 4, tma=tma), _cfg(16, 16, 16, 4, 2, 1, split=2, tma=tma),
                 _cfg(16, 32, 16, 4, 2, 4, swap=True, tma=tma), _cfg(32, 32, 32, 4, 2, 4, tma=False)]
    elif rows <= 64:
        cands = [_cfg(small, 128, 128, 4, 4, swap=True, tma=tma), _cfg(small, 64, 256, 4, 5, swap=True, tma=tma),
                 _cfg(64, 128, 128, 4, 4, tma=tma), _cfg(16, 64, 256, 4, 3, tma=tma)]
    elif rows <= 256:
        cands = [_cfg(64, 128, 128, 4, 4, tma=tma), _cfg(128, 128, 64, 4, 5, tma=tma),
                 _cfg(64, 256, 64, 4, 4, tma=tma), _cfg(64, 128, 64, 4, 4, tma=tma, ws=tma)]
    elif rows <= 512:
        cands = [_cfg(128, 128, 64, 4, 5, tma=tma), _cfg(128, 256, 64, 8, 3, tma=tma),
                 _cfg(64, 256, 64, 4, 4, tma=tma), _cfg(128, 128, 64, 4, 4, tma=tma, ws=tma)]
    else:
        cands = [_cfg(128, 256, 64, 8, 3, tma=tma), _cfg(128, 128, 64, 4, 5, tma=tma),
                 _cfg(128, 256, 64, 4, 3, tma=tma, ws=tma), _cfg(256, 128, 64, 8, 3, tma=tma)]
    skinny_fp8 = dt == FP8 and rows <= 256 and not tiny(rows, n, k)
    if skinny_fp8 and rows <= 64 and warp_spec:  # memory-bound FP8: cp.async pointer loads first
        cands = [_cfg(small, 64, 128, 4, 5, swap=True, tma=False)] + cands
    elif skinny_fp8 and rows > 64:  # the fused kernels: one pointer tile, then the TMA tiles (run g4)
        ptr = [_cfg(64, 128, 128, 4, 4, tma=False), _cfg(64, 64, 128, 4, 5, tma=False)]
        cands = (ptr if warp_spec else ptr[:1]) + cands
    deep = not tiny(rows, n, k)  # 6-stage and pointer-path tiles from round 6's runs
    if deep and dt == FP8 and warp_spec and 128 < rows <= 1024:  # the core's kernel (run g2)
        cands = [_cfg(128, 128, 64, 8, 6, tma=False), _cfg(128, 256, 64, 8, 4, tma=False)] + cands
    elif deep and dt == FP8 and not warp_spec and 256 < rows <= 1024:  # the fused kernels: second (run g5)
        cands = cands[:1] + [_cfg(128, 128, 64, 8, 6, tma=False)] + cands[1:]
    elif deep and dt != FP8 and warp_spec and 64 < rows <= 256:  # the core's kernel (run g2)
        cands = [c.replace(num_stages=6) if (c.BLOCK_M, c.BLOCK_N, c.BLOCK_K) == (128, 128, 64) else c for c in cands]
        cands = cands[:2] + [_cfg(64, 64, 128, 4, 6, tma=False)] + cands[2:3]  # the warp-specialised tile out
    out: list[Config] = []
    caps = [max(16, next_pow2(size)) for size in (rows, n, k)]
    for c in cands:
        if dt == FP8:
            c = c.replace(BLOCK_K=max(FP8_MIN_BLOCK_K, min(2 * c.BLOCK_K, 256, caps[2])))
        c = c.replace(BLOCK_M=min(c.BLOCK_M, caps[0]), BLOCK_N=min(c.BLOCK_N, caps[1]),
                      BLOCK_K=max(min(c.BLOCK_K, caps[2]), FP8_MIN_BLOCK_K if dt == FP8 else 16))
        if dt == "float32" and c.BLOCK_K > 32 and c.smem_bytes(dt) > SMEM_LIMIT:
            c = c.replace(BLOCK_K=c.BLOCK_K // 2)
        while c.num_stages > 2 and c.smem_bytes(dt) > SMEM_LIMIT:
            c = c.replace(num_stages=c.num_stages - 1)
        if c.WARP_SPEC and (not warp_spec or check(c, rows, n, k, dt) is not None):
            c = c.replace(WARP_SPEC=False)
        if not warp_spec and c.num_warps == 4 and c.acc_regs() > FUSED_ACC_REGS:
            c = c.replace(num_warps=8)
        if not tiny(rows, n, k) and not c.WARP_SPEC and c.SPLIT_K == 1:
            c = c.replace(SPLIT_K=auto_split(c.tiles(rows, n), cdiv(k, c.BLOCK_K), sms))
        while c.SPLIT_K > 1 and check(c, rows, n, k, dt) is not None:
            c = c.replace(SPLIT_K=c.SPLIT_K // 2)
        d = c.to_dict()
        if check(d, rows, n, k, dt) is None and d not in out:
            out.append(d)
    if stream_k and not tiny(rows, n, k):
        for d in list(out):
            c = GemmConfig.from_dict(d).replace(SPLIT_K=1, WARP_SPEC=False, STREAM_K=True)
            twin = c.to_dict()
            if (stream_k_helps(c.tiles(rows, n), cdiv(k, c.BLOCK_K), sms) and twin not in out
                    and check(twin, rows, n, k, dt, stream_k=True) is None):
                out.append(twin)
    return out


# ---------------------------------------------------------------------------------------------
# host side of the core: allocator, split-K workspace, the standalone kernel
# ---------------------------------------------------------------------------------------------
_ALLOCATOR_THREAD = threading.local()  # the threads whose Triton context holds `_scratch`


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for device-side tensor descriptors (128 bytes per descriptor per program)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.empty(size, dtype=torch.int8, device=device)


def ensure_allocator() -> None:
    """Install Triton's allocator for device-side TMA descriptors in this thread (idempotent, cheap).

    `tl.make_tensor_descriptor` in a kernel writes its descriptor to global scratch that Triton
    asks this allocator for at each launch (torch's caching allocator: cheap, CUDA-graph safe).
    Triton keeps the allocator in a context variable, so a thread that did not set it has none:
    autograd's backward runs in its own thread. Every launch of a TMA kernel calls this first; the
    CPU interpreter needs it too."""
    if getattr(_ALLOCATOR_THREAD, "set", False):
        return
    import triton

    triton.set_allocator(_scratch)
    _ALLOCATOR_THREAD.set = True


def programs(device: torch.device) -> int:
    """Persistent programs for `device`: its SM count on CUDA, CPU_PROGRAMS under the interpreter."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return CPU_PROGRAMS


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclass
class SplitKWorkspace:
    """float32 partial tiles and int32 per-tile arrival counts (zero between launches: the last
    split of each tile resets its count). One per stream: concurrent split-K launches on
    different streams need their own."""

    partials: torch.Tensor
    counts: torch.Tensor


_WORKSPACES: dict[tuple[str, int], SplitKWorkspace] = {}


def split_k_workspace(device: torch.device, partial_elems: int, tiles: int) -> SplitKWorkspace:
    """The cached workspace of `device` with room for `partial_elems` floats and `tiles` counts,
    grown (to powers of two) when too small. Growing replaces it: do not grow during capture."""
    key = (device.type, device.index if device.index is not None else -1)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.partials.numel() < partial_elems or ws.counts.numel() < tiles:
        p = next_pow2(max(partial_elems, 1 << 12, ws.partials.numel() if ws else 0))
        c = next_pow2(max(tiles, 1 << 8, ws.counts.numel() if ws else 0))
        ws = SplitKWorkspace(torch.empty(p, dtype=torch.float32, device=device),
                             torch.zeros(c, dtype=torch.int32, device=device))
        _WORKSPACES[key] = ws
    return ws


def fp8_scaling(dtype: torch.dtype, m: int, n: int, scale_a: torch.Tensor | None,
                scale_b: torch.Tensor | None, what: str = "matmul") -> str:
    """The scaling of a GEMM of `dtype` inputs, A m x k and B k x n, as torch._scaled_mm takes it:
    'none' (no scales: bf16/fp16/fp32 inputs), 'tensorwise' (float8_e4m3fn, scale_a and scale_b
    float32 with one element each) or 'rowwise' (float8_e4m3fn, scale_a float32 m x 1: one per row
    of A, scale_b float32 1 x n: one per column of B). Raises InvalidInput naming what is wrong
    (e5m2 inputs, a missing scale, scales of the wrong dtype, shape or device, scales on a non-FP8 GEMM)."""
    if dtype == torch.float8_e5m2:
        raise InvalidInput(f"{what}: float8_e5m2 inputs are not supported (a gradient format); use float8_e4m3fn")
    if dtype != torch.float8_e4m3fn:
        if scale_a is not None or scale_b is not None:
            raise InvalidInput(f"{what}: scale_a/scale_b are for float8_e4m3fn inputs, these are {dtype}")
        return "none"
    if scale_a is None or scale_b is None:
        raise InvalidInput(f"{what}: float8_e4m3fn inputs need scale_a and scale_b (float32; the output is "
                           f"bfloat16 (A @ B) * scale_a * scale_b, as torch._scaled_mm)")
    for name, t in (("scale_a", scale_a), ("scale_b", scale_b)):
        if t.dtype != torch.float32:
            raise InvalidInput(f"{what}: {name} must be float32, got {t.dtype}")
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return "tensorwise"
    if tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n):
        if not (scale_a.is_contiguous() and scale_b.is_contiguous()):
            raise InvalidInput(f"{what}: row-wise scales must be contiguous")
        return "rowwise"
    raise InvalidInput(f"{what}: scales of shapes {tuple(scale_a.shape)} and {tuple(scale_b.shape)} are neither "
                       f"tensorwise (one element each) nor rowwise ({(m, 1)} and {(1, n)})")


def b_transposed(b: torch.Tensor) -> bool:
    """Whether B (K x N) is stored transposed (N x K row-major: column stride K, row stride 1), as
    torch._scaled_mm's B and nn.Linear weights (w.t()) are; the core then loads it K-major."""
    return b.stride(0) == 1 and b.stride(1) != 1


def fp8_dims(device: torch.device, a: torch.Tensor, b: torch.Tensor, scale_a: Any, scale_b: Any, op: str
             ) -> dict[str, str]:
    """The problem's extra dims for this call's dtype and scales: {} for bf16/fp16/fp32 (no scales
    allowed), {"scaling": "tensorwise" | "rowwise"} for float8_e4m3fn. FP8 needs b stored N x K
    (b = w.t(): what torch._scaled_mm takes), a row-major, float32 scales on `device` (the rank's),
    tensorwise 0-dim (torch.tensor(s)) or rowwise scale_a (M x 1) and scale_b (1 x N); else InvalidInput."""
    if a.dtype != torch.float8_e4m3fn and scale_a is None and scale_b is None:
        return {}
    for name, t in (("scale_a", scale_a), ("scale_b", scale_b)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise InvalidInput(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    scaling = fp8_scaling(a.dtype, a.shape[0], b.shape[1], scale_a, scale_b, op)
    k, n = b.shape
    if k % 16 or n % 16:  # the vendor FP8 GEMM's rule (torch._scaled_mm on CUDA), every family alike
        raise InvalidInput(f"{op}: FP8 needs b's K ({k}) and N ({n}) to be multiples of 16")
    if not a.is_contiguous() or not b_transposed(b):
        raise InvalidInput(f"{op}: FP8 needs a row-major and b stored N x K (b = w.t(), as torch._scaled_mm takes "
                           f"it); got strides a {a.stride()}, b {b.stride()}")
    for name, t in (("scale_a", scale_a), ("scale_b", scale_b)):
        if t.device != device:
            raise InvalidInput(f"{op}: {name} is on {t.device}, this rank's device is {device}")
        if scaling == "tensorwise" and t.dim() != 0:
            raise InvalidInput(f"{op}: tensorwise scales are 0-dim float32 tensors (torch.tensor(s)), "
                               f"{name} has shape {tuple(t.shape)}")
    return {"scaling": scaling}


def scale_rows(scales: tuple, rows: slice) -> tuple:
    """The FP8 scales of A's `rows` (row-wise scale_a is sliced; tensorwise and scale_b stay)."""
    if not scales or scales[0].dim() == 0:
        return scales
    return scales[0][rows], scales[1]


def vendor_mm(a: torch.Tensor, b: torch.Tensor, scales: tuple, out: torch.Tensor) -> None:
    """out = a @ b with the vendor library: torch.matmul, or torch._scaled_mm for FP8 (`scales` =
    (scale_a, scale_b), bfloat16 out, fast accumulation as the Triton kernels' FP8 dot)."""
    if scales:
        torch._scaled_mm(a, b, scale_a=scales[0], scale_b=scales[1], out_dtype=out.dtype, use_fast_accum=True,
                         out=out)
    else:
        torch.matmul(a, b, out=out)


def prepare(a: torch.Tensor, b: torch.Tensor, config: Mapping[str, Any] | GemmConfig, out: torch.Tensor,
            workspace: SplitKWorkspace | None = None, num_programs: int | None = None,
            scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None) -> Callable[[], None]:
    """Validate once and return a no-argument launcher of C = A @ B into `out` (the core's
    standalone `gemm_kernel`): what benchmarks time and CUDA graphs capture, with no per-call checks.

    A (M x K) and B (K x N) of one dtype (bf16, fp16, fp32, or float8_e4m3fn with its scales, see
    `fp8_scaling`, into a bfloat16 `out`) on one device; any strides on the pointer path; with TMA,
    A's and C's columns and B's columns or rows (B stored N x K: `b_transposed`) of unit stride and
    16-byte aligned rows and base addresses. Raises InvalidConfig when `check` rejects the config or
    the tensors break TMA's alignment, InvalidInput for unsupported dtypes and bad scales.
    """
    from autofuse.kernels import gemm_core

    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply")
    scaling = fp8_scaling(a.dtype, a.shape[0], b.shape[1], scale_a, scale_b)
    want = output_dtype(a.dtype)
    if a.dtype != b.dtype or str(out.dtype).removeprefix("torch.") != want:
        raise ValueError(f"matmul: A is {a.dtype}, B is {b.dtype}, out is {out.dtype}: A and B must match and out "
                         f"must be {want}")
    m, k = a.shape
    n = b.shape[1]
    if tuple(out.shape) != (m, n):
        raise ValueError(f"matmul: out is {tuple(out.shape)}, expected {(m, n)}")
    cfg = config if isinstance(config, GemmConfig) else GemmConfig.from_dict(config)
    why = check(cfg, m, n, k, a.dtype, stream_k=True)
    if why:
        raise InvalidConfig(why)
    b_t = b_transposed(b)
    if cfg.TMA:
        for name, t in (("A", a), ("B", b.t() if b_t else b), ("C", out)):
            if t.stride(1) != 1 or t.data_ptr() % 16 or t.stride(0) * t.element_size() % 16:
                raise InvalidConfig(f"TMA needs {name} with unit column stride, 16-byte aligned base and rows "
                                    f"(strides {t.stride()}, address % 16 = {t.data_ptr() % 16}); use TMA=false")
        ensure_allocator()
    grid = cfg.grid(m, n, num_programs or programs(a.device))
    if cfg.SPLIT_K > 1 or cfg.STREAM_K:
        slots, tiles = (cfg.stream_k_slots(m, n, grid[0]) if cfg.STREAM_K else
                        (cfg.tiles(m, n) * cfg.SPLIT_K, cfg.tiles(m, n)))
        need = slots * cfg.BLOCK_M * cfg.BLOCK_N
        if workspace is not None and (workspace.partials.numel() < need or workspace.counts.numel() < tiles):
            raise ValueError(f"matmul: the workspace holds {workspace.partials.numel()} partial floats and "
                             f"{workspace.counts.numel()} counts, this config needs {need} and {tiles}")
        workspace = workspace or split_k_workspace(a.device, need, tiles)
        partials, counts = workspace.partials, workspace.counts
    else:
        partials, counts = out, out  # unused by the kernel when SPLIT_K == 1 and STREAM_K is off
    kernel = gemm_core.gemm_kernel[grid]
    scales = (scale_a, scale_b) if scaling != "none" else (out, out)  # unused by the kernel without scales
    args = (a, b, out, partials, counts, *scales, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            out.stride(0), out.stride(1))
    kwargs = {**cfg.kernel_kwargs(), "B_T": b_t, "SCALE": SCALINGS[scaling]}

    def launch() -> None:
        kernel(*args, **kwargs)

    return launch


def matmul(a: torch.Tensor, b: torch.Tensor, config: Mapping[str, Any] | GemmConfig,
           out: torch.Tensor | None = None, workspace: SplitKWorkspace | None = None,
           num_programs: int | None = None, scale_a: torch.Tensor | None = None,
           scale_b: torch.Tensor | None = None) -> torch.Tensor:
    """C = A @ B (FP8: times scale_a and scale_b, in bfloat16) with the core's standalone kernel at
    `config` (see `prepare`); returns `out`."""
    if out is None:
        dtype = torch.bfloat16 if a.dtype == torch.float8_e4m3fn else a.dtype
        out = torch.empty((a.shape[0], b.shape[1]) if a.dim() == 2 and b.dim() == 2 else (0,), dtype=dtype,
                          device=a.device)
    prepare(a, b, config, out, workspace, num_programs, scale_a, scale_b)()
    return out
