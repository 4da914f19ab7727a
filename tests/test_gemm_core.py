"""The GEMM core (kernels/gemm_core.py) and its typed config (autofuse/core/gemm.py).

Interpreter (Triton's CPU interpreter, one spawned child for every case): the pointer and the
TMA-descriptor paths, SPLIT_K 1/2/4, SWAP_AB, STREAM_K at several program counts (shares that
straddle tiles, tiles of 1-4 contributors), sizes that are not multiples of the blocks, bf16,
fp16 and fp32, into NaN-poisoned outputs, against the float64 product of the dtype-rounded inputs
at `default_tolerance(dtype, K)`: the interpreter's dot multiplies exactly (bf16 widened to fp32)
and accumulates in float32, so the error is the final rounding to the dtype (~u/sqrt(3) rms,
u = 2^-8 bf16, 2^-11 fp16) or float32 roundoff, far inside 4u * max(1, sqrt(log2 K / 8)).
Repeated split-K and stream-K calls check the arrival counts come back to zero and the results are
bitwise equal (the fixup sums in a fixed order). The waiting consumer template
runs with its flags raised and with one flag left down (bounded wait, recorded timeout).

Compiled (sm_90, ahead of time, no GPU): the same kernels with Triton 3.9 (this venv) and, where
AUTOFUSE_T36_PYTHON names a python with the GPU machines' Triton 3.6, with that one too. The PTX must show
what each path is for: TMA loads and stores, wgmma, pipelined stages, split-K atomics, swap-AB's
wgmma with BLOCK_M on the N side, warp specialisation's extra warpgroups.
"""
from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
import torch

from autofuse.core import gemm
from autofuse.core.gemm import GemmConfig
from autofuse.core.op import InvalidConfig, InvalidInput, default_tolerance, rel_error
from autofuse.comm.world import spawn
import conftest
from conftest import VERSIONS, compile_request

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TINY = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}

# (name, M, N, K, dtype, config changes): TMA cases keep N and K 16-byte aligned, pointer cases need not.
CASES = [
    ("ptr bf16 odd", 37, 70, 41, "bfloat16", {"TMA": False}),
    ("ptr fp16 odd swap", 37, 70, 41, "float16", {"TMA": False, "SWAP_AB": True}),
    ("ptr fp32 odd split2", 37, 70, 41, "float32", {"TMA": False, "SPLIT_K": 2}),
    ("ptr bf16 split4 swap", 21, 40, 100, "bfloat16", {"TMA": False, "SPLIT_K": 4, "SWAP_AB": True}),
    ("ptr bf16 32x32", 50, 72, 64, "bfloat16", {"TMA": False, "BLOCK_M": 32, "BLOCK_K": 32}),
    ("tma bf16", 37, 72, 40, "bfloat16", {}),
    ("tma fp16 swap", 37, 72, 40, "float16", {"SWAP_AB": True}),
    ("tma fp32 split2", 37, 72, 40, "float32", {"SPLIT_K": 2}),
    ("tma bf16 split4", 45, 40, 96, "bfloat16", {"SPLIT_K": 4, "GROUP_M": 1}),
    ("tma bf16 odd split3", 45, 40, 112, "bfloat16", {"SPLIT_K": 3}),  # 7 K steps: 2, 2, 3 (wave_split)
    ("ptr fp32 split5", 21, 40, 96, "float32", {"TMA": False, "SPLIT_K": 5}),
    ("tma bf16 split2 swap", 9, 104, 64, "bfloat16", {"SPLIT_K": 2, "SWAP_AB": True}),
    ("tma bf16 warp_spec", 64, 64, 48, "bfloat16", {"WARP_SPEC": True, "BLOCK_M": 64}),
    ("tma fp32 1 row", 1, 36, 20, "float32", {"BLOCK_K": 32}),
]
# STREAM_K (name, M, N, K, dtype, config changes, programs): with tiles % programs tail tiles shared
# out in K steps. 3 tiles on 4 programs of 7 steps: shares of 5-6 steps straddle tiles; 9 tiles on 4
# programs: 1 tail tile in 4 pieces; 30 tiles on 7 programs: 2 tail tiles; 1 tile of 4 steps: one share.
STREAM_K_CASES = [
    ("sk tma bf16 straddle", 48, 32, 112, "bfloat16", {"STREAM_K": True}, 4),
    ("sk tma bf16 one tail tile", 37, 72, 256, "bfloat16", {"STREAM_K": True}, 4),
    ("sk ptr fp16 3 programs", 37, 70, 200, "float16", {"STREAM_K": True, "TMA": False}, 3),
    ("sk tma fp32 7 programs", 80, 96, 160, "float32", {"STREAM_K": True, "GROUP_M": 1}, 7),
    ("sk tma bf16 swap short", 16, 32, 64, "bfloat16", {"STREAM_K": True, "SWAP_AB": True}, 4),
    # lanes (stream_k_lanes): 2 tile rows in one group, 6 tiles on 8 programs: 2 lanes of 4 programs, shares
    # of 5-6 steps straddling the lane's 3 tiles; 4 tile rows in whole groups of 2 on 12 programs: 2 lanes
    # of 6; on 6 programs: one data-parallel wave of 6 tiles, then 2 tail tiles in 3 pieces each
    ("sk lanes straddle", 32, 96, 112, "bfloat16", {"STREAM_K": True}, 8),
    ("sk lanes whole groups", 64, 64, 112, "float16", {"STREAM_K": True}, 12),
    ("sk lanes dp and tail", 64, 64, 256, "bfloat16", {"STREAM_K": True}, 6),
]
# FP8 (name, M, N, K, scaling, config changes, B stored N x K, programs): e4m3 inputs, bf16 output,
# against float64 of the FP8 values times their scales.
FP8_CASES = [
    ("fp8 tma tensorwise bt", 37, 64, 96, "tensorwise", {}, True, None),
    ("fp8 tma rowwise bt", 37, 64, 96, "rowwise", {}, True, None),
    ("fp8 tma rowwise row-major b", 37, 64, 96, "rowwise", {}, False, None),
    ("fp8 ptr rowwise odd", 37, 70, 96, "rowwise", {"TMA": False}, True, None),
    ("fp8 swap split2", 21, 64, 128, "tensorwise", {"SWAP_AB": True, "SPLIT_K": 2}, True, None),
    ("fp8 stream-k rowwise", 48, 32, 224, "rowwise", {"STREAM_K": True}, True, 4),
]
CALLS = 2  # every case twice, fresh inputs each time: split-K counts must reset themselves


def _inputs(m: int, n: int, k: int, dtype: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(DTYPES[dtype])
    b = torch.randn(k, n, generator=g).to(DTYPES[dtype])
    return a, b


def _interpreter_cases(world) -> dict:
    """In the interpreter child: every case CALLS times (errors, leftover counts), then the waiting
    consumer template with and without a missing flag."""
    out: dict = {}
    for name, m, n, k, dtype, change, programs in [(*c, None) for c in CASES] + STREAM_K_CASES:
        config = {**TINY, **change}
        errs, same = [], True
        ws = gemm.SplitKWorkspace(torch.empty(1 << 14), torch.zeros(64, dtype=torch.int32))
        for call in range(CALLS):
            a, b = _inputs(m, n, k, dtype, seed=call)
            c = torch.full((m, n), math.nan, dtype=DTYPES[dtype])
            gemm.matmul(a, b, config, out=c, workspace=ws, num_programs=programs)
            errs.append(rel_error(c, a.double() @ b.double()))
            again = torch.full_like(c, math.nan)
            gemm.matmul(a, b, config, out=again, workspace=ws, num_programs=programs)
            same = same and torch.equal(c, again)
        counts = int(ws.counts.abs().sum())
        out[name] = {"errs": errs, "tol": default_tolerance(dtype, k), "counts": counts, "same": same}
    for name, m, n, k, scaling, change, b_t, programs in FP8_CASES:
        g = torch.Generator().manual_seed(3)
        a = (2 * torch.randn(m, k, generator=g)).to(torch.float8_e4m3fn)
        w = (2 * torch.randn(n, k, generator=g)).to(torch.float8_e4m3fn)
        b = w.t() if b_t else w.t().contiguous()
        if scaling == "tensorwise":
            sa, sb = torch.tensor([0.7]), torch.tensor([1.3])
        else:
            sa, sb = torch.rand(m, 1, generator=g) + 0.5, torch.rand(1, n, generator=g) + 0.5
        c = torch.full((m, n), math.nan, dtype=torch.bfloat16)
        ws = gemm.SplitKWorkspace(torch.empty(1 << 14), torch.zeros(64, dtype=torch.int32))
        gemm.matmul(a, b, {**TINY, "BLOCK_K": 32, **change}, out=c, workspace=ws, num_programs=programs,
                    scale_a=sa, scale_b=sb)
        ref = (a.double() @ b.double()) * sa.double() * sb.double()
        out[name] = {"errs": [rel_error(c, ref)], "tol": default_tolerance("float8_e4m3fn", k),
                     "counts": int(ws.counts.abs().sum()), "same": True}
    out["wait"] = _wait_cases()
    return out


def _wait_cases() -> dict:
    """gemm_wait_kernel (the fused consumer's template): ready flags per BLOCK_M rows of A."""
    from autofuse.kernels import gemm_core, shmem

    gemm.ensure_allocator()
    m, n, k = 40, 48, 64
    res = {}
    for name, down, split in (("all raised", None, 1), ("all raised split2", None, 2), ("row block 1 down", 1, 1)):
        cfg = GemmConfig(**{**TINY, "SPLIT_K": split})
        a, b = _inputs(m, n, k, "bfloat16", seed=7)
        c = torch.zeros((m, n), dtype=torch.bfloat16)  # not NaN: a failed tile must be written as NaN
        heap = torch.zeros(64, dtype=torch.int32)  # ready flags at words 0.., status at word 32
        epoch = 5
        heap[: gemm.cdiv(m, cfg.BLOCK_M)] = epoch
        if down is not None:
            heap[down] = epoch - 1
        status = heap[32:36]
        bases = torch.tensor([heap.data_ptr()], dtype=torch.int64)
        ctx = shmem.DeviceContext(0, 1, bases, status, heap[40:42], int(0.2e9), torch.zeros(1, dtype=torch.int32))
        ws = gemm.SplitKWorkspace(torch.empty(1 << 14), torch.zeros(64, dtype=torch.int32))
        gemm_core.gemm_wait_kernel[cfg.grid(m, n, gemm.CPU_PROGRAMS)](
            a, b, c, ws.partials, ws.counts, heap, epoch, ctx, m, n, k,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
            NUM_STAGES=cfg.num_stages, SPLIT_K=cfg.SPLIT_K, SWAP_AB=False, USE_TMA=True, PREFETCH=2,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        ref = a.double() @ b.double()
        rows = slice(16, 32)
        kept = torch.ones(m, dtype=torch.bool)
        if down is not None:
            kept[rows] = False
        res[name] = {"err": rel_error(c[kept], ref[kept]), "skipped_nan": bool(torch.isnan(c[~kept].float()).all()),
                     "status": status.tolist(), "counts": int(ws.counts.abs().sum())}
    return res


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return spawn(_interpreter_cases, 1, device_kind="cpu", timeout_s=300)[0]


@pytest.mark.parametrize("name", [c[0] for c in CASES + STREAM_K_CASES + FP8_CASES])
def test_interpreter_matches_float64(interpreted, name):
    case = interpreted[name]
    assert all(e <= case["tol"] for e in case["errs"]), f"{name}: rel errors {case['errs']} > {case['tol']:.2e}"
    assert case["counts"] == 0, f"{name}: split-K / stream-K arrival counts not reset to 0"
    assert case["same"], f"{name}: two calls on the same inputs differ (the fixup must sum in a fixed order)"


def test_wait_template_waits_and_times_out(interpreted):
    res = interpreted["wait"]
    tol = default_tolerance("bfloat16", 64)
    for name in ("all raised", "all raised split2"):
        assert res[name]["err"] <= tol and res[name]["status"] == [0, 0, 0, 0] and res[name]["counts"] == 0, res[name]
    down = res["row block 1 down"]
    assert down["err"] <= tol and down["skipped_nan"], down  # other tiles correct, the waiting one NaN
    code, word, expected, seen = down["status"]  # rank 0's timeout record (kernels/shmem.py CODE, RECORD)
    assert code == (0 + 1) * 4 + 1 and word == 1 and expected == 5 and seen == 4, down["status"]


# ------------------------------------------------------------------------------------------------
# the config: validator, round trip, space, defaults
def test_config_round_trip_and_defaults_for_absent_keys():
    cfg = GemmConfig.from_dict({**TINY, "FLAG": "shard", "COMM_SMS": 2})
    assert (cfg.SPLIT_K, cfg.SWAP_AB, cfg.TMA, cfg.WARP_SPEC) == (1, False, True, False)
    assert GemmConfig.from_dict(cfg.to_dict()) == cfg
    assert set(cfg.to_dict()) == set(gemm.KEYS)
    assert gemm.op_keys({**TINY, "FLAG": "shard", "COMM_SMS": 2}) == {"FLAG": "shard", "COMM_SMS": 2}
    with pytest.raises(InvalidConfig, match="BLOCK_K"):
        GemmConfig.from_dict({"BLOCK_M": 16, "BLOCK_N": 16, "GROUP_M": 1, "num_warps": 4, "num_stages": 2})
    assert gemm.cdiv(7, 2) == 4 and gemm.next_pow2(1) == 1 and gemm.next_pow2(17) == 32 and gemm.next_pow2(64) == 64


BIG = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}


@pytest.mark.parametrize("config, dims, dtype, reason", [
    ({**BIG, "BLOCK_M": 96}, (4096, 3584, 8192), "bfloat16", "BLOCK_M=96 must be one of"),
    ({**BIG, "BLOCK_K": 512}, (4096, 3584, 8192), "bfloat16", "BLOCK_K=512 must be one of"),
    ({**BIG, "BLOCK_M": True}, (4096, 3584, 8192), "bfloat16", "BLOCK_M=True"),
    (BIG, (64, 3584, 8192), "bfloat16", "BLOCK_M=128 is larger than 64 needs"),
    ({**BIG, "num_warps": 2}, (4096, 3584, 8192), "bfloat16", "num_warps=2"),
    ({**BIG, "num_warps": 4}, (4096, 3584, 8192), "bfloat16", "256 registers per thread"),
    ({**BIG, "num_stages": 4}, (4096, 3584, 8192), "bfloat16", "shared memory 263168 B"),
    ({**BIG, "num_stages": 3}, (4096, 3584, 8192), "float32", "shared memory"),
    ({**BIG, "num_stages": 0}, (4096, 3584, 8192), "bfloat16", "num_stages=0"),
    ({**BIG, "GROUP_M": 0}, (4096, 3584, 8192), "bfloat16", "GROUP_M=0"),
    (BIG, (4096, 3583, 8192), "bfloat16", "TMA needs 16-byte aligned row strides: n"),
    (BIG, (4096, 3584, 8190), "bfloat16", "TMA needs 16-byte aligned row strides: k"),
    ({**BIG, "SPLIT_K": 8}, (4096, 3584, 256), "bfloat16", "SPLIT_K=8 is more than the 4 BLOCK_K steps"),
    ({**BIG, "SPLIT_K": 3.0}, (4096, 3584, 8192), "bfloat16", "SPLIT_K=3.0"),
    ({**BIG, "SWAP_AB": 1}, (4096, 3584, 8192), "bfloat16", "SWAP_AB=1 must be true or false"),
    ({**BIG, "WARP_SPEC": True, "TMA": False}, (4096, 3584, 8192), "bfloat16", "WARP_SPEC needs TMA"),
    ({**BIG, "WARP_SPEC": True}, (4096, 3584, 8192), "bfloat16", "WARP_SPEC needs num_warps=4"),
    ({**BIG, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "WARP_SPEC": True}, (4096, 3584, 8192), "float32",
     "WARP_SPEC needs bfloat16 or float16"),
    ({**BIG, "BLOCK_N": 128, "num_warps": 4, "WARP_SPEC": True, "SPLIT_K": 2}, (4096, 3584, 8192), "bfloat16",
     "WARP_SPEC needs SPLIT_K=1"),
    ({**BIG, "BLOCK_M": 16, "num_warps": 4, "WARP_SPEC": True}, (16, 3584, 8192), "bfloat16", "MMA M side >= 64"),
    # measured wrong (5-6 stages, two consumer warpgroups) or not compiling (64 x 256), H100, Triton 3.6
    ({**BIG, "BLOCK_N": 128, "num_warps": 4, "num_stages": 5, "WARP_SPEC": True}, (4096, 3584, 8192), "bfloat16",
     "WARP_SPEC needs num_stages <= 4 with an MMA M side of 128"),
    ({**BIG, "BLOCK_N": 64, "num_warps": 4, "num_stages": 6, "WARP_SPEC": True}, (4096, 3584, 8192), "float16",
     "WARP_SPEC needs num_stages <= 4"),
    ({**BIG, "BLOCK_M": 64, "num_warps": 4, "WARP_SPEC": True}, (4096, 3584, 8192), "bfloat16",
     "WARP_SPEC does not compile with a 64x256 tile"),
    ({**BIG, "STREAM_K": True}, (4096, 3584, 8192), "bfloat16", "STREAM_K is run only by the core's standalone"),
    ({**BIG, "STREAM_K": 1}, (4096, 3584, 8192), "bfloat16", "STREAM_K=1 must be true or false"),
    ({**BIG, "FLAG": "tile"}, (4096, 3584, 8192), "bfloat16", "unknown ['FLAG']"),
    ({k: v for k, v in BIG.items() if k != "GROUP_M"}, (4096, 3584, 8192), "bfloat16", "missing ['GROUP_M']"),
    (BIG, (65536, 65536, 8192), "bfloat16", "2^31"),
    (BIG, (4096, 3584, 8192), "int8", "dtype 'int8' not supported"),
])
def test_check_rejects_with_a_reason(config, dims, dtype, reason):
    why = gemm.check(config, *dims, dtype)
    assert why is not None and reason in why, why


@pytest.mark.parametrize("config, dims, dtype", [
    (BIG, (4096, 3584, 8192), "bfloat16"),
    ({**BIG, "FLAG": "tile", "COMM_SMS": 8}, (4096, 3584, 8192), "bfloat16"),  # op keys named by the op
    ({**BIG, "BLOCK_N": 128, "num_warps": 4, "WARP_SPEC": True}, (4096, 3584, 8192), "bfloat16"),
    ({**BIG, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "WARP_SPEC": True}, (4096, 3584, 8192), "bfloat16"),
    ({**BIG, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 6, "WARP_SPEC": True}, (4096, 3584, 8192),
     "bfloat16"),  # one consumer row block: right at 2-6 stages
    ({**BIG, "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "SWAP_AB": True,
      "SPLIT_K": 4}, (16, 3584, 8192), "bfloat16"),
    ({**BIG, "BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "SWAP_AB": True, "WARP_SPEC": True}, (32, 3584, 8192),
     "float16"),
    ({**TINY, "TMA": False}, (37, 70, 41), "float32"),
])
def test_check_accepts(config, dims, dtype):
    assert gemm.check(config, *dims, dtype, extra=("FLAG", "COMM_SMS")) is None


def test_check_stream_k_in_the_standalone_kernel():
    assert gemm.check({**BIG, "STREAM_K": True}, 1024, 5120, 8192, "bfloat16", stream_k=True) is None
    why = gemm.check({**BIG, "STREAM_K": True, "SPLIT_K": 2}, 1024, 5120, 8192, "bfloat16", stream_k=True)
    assert why and "STREAM_K needs SPLIT_K=1" in why
    ws = {**BIG, "BLOCK_N": 128, "num_warps": 4, "WARP_SPEC": True, "STREAM_K": True}
    why = gemm.check(ws, 1024, 5120, 8192, "bfloat16", stream_k=True)
    assert why and "STREAM_K needs WARP_SPEC=false" in why
    cfg = GemmConfig.from_dict({**BIG, "STREAM_K": True})
    assert cfg.grid(512, 5120, 132) == (132,) and cfg.stream_k_slots(512, 5120, 132) == (132 + 80, 80)
    assert cfg.replace(STREAM_K=False).grid(512, 5120, 132) == (80,)


def test_stream_k_defaults_where_the_last_wave_idles():
    assert gemm.last_wave_fill(80) == 80 / 132 and gemm.last_wave_fill(264) == 1.0
    assert gemm.stream_k_helps(80, 128) and not gemm.stream_k_helps(130, 128) and not gemm.stream_k_helps(264, 128)
    assert not gemm.stream_k_helps(20, 8)  # 160 K steps for 132 SMs: shares too short to pipeline
    plain = gemm.defaults(512, 5120, 8192, "bfloat16")
    both = gemm.defaults(512, 5120, 8192, "bfloat16", stream_k=True)
    assert both[:len(plain)] == plain and any(c["STREAM_K"] for c in both)
    assert not any(c["STREAM_K"] for c in plain)
    for c in both:
        assert gemm.check(c, 512, 5120, 8192, "bfloat16", stream_k=True) is None, c
    full = gemm.defaults(16384, 8192, 8192, "bfloat16", stream_k=True)  # 4096 tiles of 128x256: 31 full waves
    assert all(not c["STREAM_K"] or gemm.stream_k_helps(GemmConfig.from_dict(c).tiles(16384, 8192), 128)
               for c in full)


def test_smem_model_matches_triton36_allocation():
    """GemmConfig.smem_bytes against what Triton 3.6 allocated in AOT compiles (B, mbarriers aside): the
    GEMM core, and ag_gemm's kernel in its gathered layout (TMA store of C) with split-K in float32 and
    bf16, TMA and pointer loads (2026-11-25). The first float32 row failed on the GPUs with OutOfResources
    (262144 B needed) while the model without split-K's float32 partial tile said 230400."""
    measured = [((128, 256, 64, 8, 3, True, 1, False), "bfloat16", 213016),
                ((128, 256, 64, 8, 3, False, 1, False), "bfloat16", 147456),
                ((16, 128, 128, 4, 4, True, 1, False), "bfloat16", 151584),
                ((128, 128, 64, 4, 3, True, 1, False), "bfloat16", 131544),
                ((128, 256, 32, 8, 2, True, 4, False), "float32", 262144),
                ((128, 256, 32, 8, 2, True, 1, False), "float32", 229400),
                ((128, 128, 32, 8, 2, False, 4, False), "float32", 65536),
                ((16, 128, 64, 4, 3, True, 4, True), "float32", 118832),
                ((128, 256, 64, 8, 3, True, 4, False), "bfloat16", 213016),
                ((64, 128, 64, 4, 2, False, 4, False), "bfloat16", 49152)]
    for (bm, bn, bk, w, s, tma, split, swap), dtype, shared in measured:
        model = GemmConfig(bm, bn, bk, 8, w, s, SPLIT_K=split, SWAP_AB=swap, TMA=tma).smem_bytes(dtype)
        assert shared <= model <= shared + gemm.SMEM_SLACK, (bm, bn, bk, s, tma, split, dtype, shared, model)
    big_fp32_split = GemmConfig(128, 256, 32, 8, 8, 2, SPLIT_K=4)
    assert "split-K's 128x256 float32 partial" in gemm.check(big_fp32_split, 1024, 1024, 2048, "float32")


class _RandomTrial:
    """The SearchSpace protocol with random draws that keep each name's choices fixed (as Optuna)."""

    def __init__(self, seed: int, seen: dict):
        self.rng, self.seen = random.Random(seed), seen

    def suggest_categorical(self, name, choices):
        assert self.seen.setdefault(name, list(choices)) == list(choices), f"{name}: choices changed in one study"
        return self.rng.choice(list(choices))

    def suggest_int(self, name, low, high, step=1, log=False):
        assert self.seen.setdefault(name, (low, high)) == (low, high)
        return self.rng.randint(low, high)


@pytest.mark.parametrize("dims, dtype", [((16, 3584, 8192), "bfloat16"), ((4096, 28672, 8192), "bfloat16"),
                                         ((37, 70, 41), "float32"), ((512, 5120, 14336), "float16")])
def test_space_draws_gemm_keys_with_fixed_choices(dims, dtype):
    seen: dict = {}
    valid = 0
    for seed in range(60):
        config = gemm.space(_RandomTrial(seed, seen), *dims, dtype)
        assert set(config) == set(gemm.KEYS)
        valid += gemm.check(config, *dims, dtype) is None
    assert valid >= 5  # the space is mostly runnable; check() rejects the rest before any launch


@pytest.mark.parametrize("rows", [1, 16, 64, 128, 256, 512, 1024, 16384])
@pytest.mark.parametrize("n, k", [(3584, 8192), (28672, 8192), (5120, 14336), (8192, 14336)])
def test_defaults_pass_check_and_fill_the_gpu(rows, n, k):
    configs = gemm.defaults(rows, n, k, "bfloat16")
    assert 2 <= len(configs) <= 4
    for c in configs:
        assert gemm.check(c, rows, n, k, "bfloat16") is None, c
    if rows <= 64:
        assert any(c["SWAP_AB"] for c in configs)
        first = GemmConfig.from_dict(configs[0])
        assert first.work_items(rows, n) >= 0.8 * gemm.H200_SMS or first.SPLIT_K == 8, first
    for dtype in ("float32", "float16"):
        assert all(gemm.check(c, rows, n, k, dtype) is None for c in gemm.defaults(rows, n, k, dtype))


def test_defaults_for_interpreter_problems_are_tiny_and_aligned_or_pointer():
    for dims in ((37, 70, 41), (64, 64, 64), (4, 32, 64)):
        configs = gemm.defaults(*dims, "bfloat16")
        assert configs and all(c["BLOCK_M"] <= 32 and c["BLOCK_N"] <= 32 for c in configs)
        assert all(gemm.check(c, *dims, "bfloat16") is None for c in configs)


def test_auto_split_fills_waves():
    assert gemm.auto_split(28, 64) == 4      # N=3584 / 128 at M<=64: 112 of 132 SMs
    assert gemm.auto_split(224, 64) == 1     # N=28672: already 1.7 waves
    assert gemm.auto_split(28, 8) == 2       # never fewer than 4 K steps per split


def test_matmul_rejects_bad_fp8_inputs():
    a = torch.randn(32, 64).to(torch.float8_e4m3fn)
    w = torch.randn(32, 64).to(torch.float8_e4m3fn)
    one = torch.tensor([1.0])
    fp8 = {**TINY, "BLOCK_K": 32}
    cases = [
        (dict(a=a.to(torch.float8_e5m2), b=w.t().to(torch.float8_e5m2), scale_a=one, scale_b=one), "float8_e5m2"),
        (dict(a=a, b=w.t()), "need scale_a and scale_b"),
        (dict(a=a, b=w.t(), scale_a=one.double(), scale_b=one), "scale_a must be float32"),
        (dict(a=a, b=w.t(), scale_a=torch.ones(32), scale_b=torch.ones(32)), "neither tensorwise"),
        (dict(a=a, b=w.t(), scale_a=torch.ones(32, 1), scale_b=one), "neither tensorwise"),
        (dict(a=a.float(), b=w.t().float(), scale_a=one, scale_b=one), "scale_a/scale_b are for float8_e4m3fn"),
    ]
    for kwargs, reason in cases:
        with pytest.raises(InvalidInput, match=reason):
            gemm.matmul(config=fp8, **kwargs)
    with pytest.raises(ValueError, match="out must be bfloat16"):
        gemm.matmul(a, w.t(), fp8, out=torch.empty(32, 32), scale_a=one, scale_b=one)
    with pytest.raises(InvalidConfig, match="too small for FP8"):
        gemm.matmul(a, w.t(), TINY, scale_a=one, scale_b=one)


def test_fp8_config_rules_and_defaults():
    assert gemm.output_dtype("float8_e4m3fn") == "bfloat16" and gemm.output_dtype(torch.float16) == "float16"
    with pytest.raises(ValueError, match="gradient format"):
        gemm.check(BIG, 4096, 3584, 8192, "float8_e5m2") and gemm.output_dtype("float8_e5m2")
    # 3 stages of 128x128 + 128x256 FP8 tiles plus the bfloat16 C tile of the TMA store (measured 213040 B)
    assert GemmConfig(128, 256, 128, 8, 8, 3).smem_bytes("float8_e4m3fn") == 3 * 128 * 384 + 128 * 256 * 2 + 1024
    for rows in (16, 128, 512, 4096):
        configs = gemm.defaults(rows, 5120, 8192, "float8_e4m3fn", stream_k=True)
        assert configs and all(c["BLOCK_K"] >= 32 for c in configs)
        assert all(gemm.check(c, rows, 5120, 8192, "float8_e4m3fn", stream_k=True) is None for c in configs)
    assert all(32 <= c["BLOCK_K"] <= 64 for c in gemm.defaults(37, 64, 96, "float8_e4m3fn"))  # tiny, still FP8-sized


@pytest.mark.parametrize("warp_spec", [True, False])
def test_fp8_skinny_defaults_lead_with_pointer_tiles(warp_spec):
    """FP8 at <= 256 rows is memory-bound: the pointer path (cp.async) first, swap-AB at <= 64 rows. The
    core's own kernel (warp_spec=True) takes two pointer tiles (four from 129 rows); the fused kernels
    one at 65-256 rows, then TMA tiles, and TMA first at <= 64 rows (run g4). bf16 leads with TMA."""
    fused_skinny = gemm.defaults(64, 3584, 8192, "float8_e4m3fn", warp_spec=False)
    assert not warp_spec or fused_skinny[0]["TMA"] is True  # fused kernels at <= 64 rows: TMA first (run g4)
    for rows in (16, 64, 128, 256) if warp_spec else (128, 256):
        configs = gemm.defaults(rows, 3584, 8192, "float8_e4m3fn", warp_spec=warp_spec)
        paths = [c["TMA"] for c in configs]
        deep = warp_spec and rows > 128  # the core's own kernel: 128x128x128 and 128x256x128 pointer tiles lead
        assert paths[0] is False and configs[0]["BLOCK_K"] == (128 if deep else 256)
        assert configs[0]["SWAP_AB"] == (rows <= 64)
        assert any(paths), "the TMA tiles still follow"
        lead = (4 if deep else 2) if warp_spec and rows > 64 else 1
        assert paths[:lead] == [False] * lead and paths[lead] is True, paths
    for rows, dtype in ((2048, "float8_e4m3fn"), (128, "bfloat16"), (16, "bfloat16")):
        assert gemm.defaults(rows, 3584, 8192, dtype, warp_spec=warp_spec)[0]["TMA"] is True
    first, second = gemm.defaults(512, 3584, 8192, "float8_e4m3fn", warp_spec=warp_spec)[:2]
    assert (first["TMA"], first["num_stages"]) == ((False, 6) if warp_spec else (True, 5))
    assert (second["TMA"], second["num_stages"], second["BLOCK_N"]) == ((False, 4, 256) if warp_spec else (False, 6, 128))
    assert all(c["TMA"] for c in gemm.defaults(2048, 3584, 8192, "float8_e4m3fn", warp_spec=warp_spec)[:2])


def test_core_defaults_take_six_stages_where_run_g2_found_them():
    """bf16 at 65-256 rows: the core's own kernel runs 128x128x64 at 6 stages and a 64x64x128 pointer tile at 6;
    the fused kernels keep 5 stages (6 was not checked inside them)."""
    core = gemm.defaults(256, 5120, 8192, "bfloat16")
    fused = gemm.defaults(256, 5120, 8192, "bfloat16", warp_spec=False)
    tile = lambda c: (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"])  # noqa: E731
    assert {c["num_stages"] for c in core if tile(c) == (128, 128, 64)} == {6}
    assert any(tile(c) == (64, 64, 128) and not c["TMA"] and c["num_stages"] == 6 for c in core)
    assert {c["num_stages"] for c in fused if tile(c) == (128, 128, 64)} == {5}
    assert all(gemm.check(c, 256, 5120, 8192, "bfloat16") is None for c in core + fused)


def test_matmul_rejects_unaligned_tma_operands():
    a = torch.randn(32, 48)[:, :40]  # row stride 48 floats is aligned; a view with offset is not
    b = torch.randn(40, 32)
    with pytest.raises(InvalidConfig, match="TMA needs A"):
        gemm.matmul(a[:, 1:33], b[:32], TINY)
    with pytest.raises(InvalidConfig, match="BLOCK_K=128 is larger"):
        gemm.matmul(a, b, {**TINY, "BLOCK_K": 128})


# ------------------------------------------------------------------------------------------------
# sm_90 compiles with Triton 3.9 (this venv) and 3.6 (AUTOFUSE_T36_PYTHON, the GPU machines' version)
MOD = "autofuse.kernels.gemm_core"
_HEAD = {"a": "*bf16", "b": "*bf16", "c": "*bf16", "partials": "*fp32", "counts": "*i32"}
_SIZES = {"M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_ak": "constexpr", "stride_bk": "i32",
          "stride_bn": "constexpr", "stride_cm": "i32", "stride_cn": "constexpr"}
_CONST = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "NUM_STAGES", "SPLIT_K", "SWAP_AB", "USE_TMA")
_DIV = ("a", "b", "c", "partials", "counts", "M", "N", "K", "stride_am", "stride_cm")
_WAIT_EXTRA = {"ready": "*i32", "epoch": "i32", "ctx": conftest.CTX}
SCALE_CODES = {"none": 0, "tensorwise": 1, "rowwise": 2}


def _request(name: str, cfg: GemmConfig, dtype: str = "bf16", wait: bool = False, b_t: bool = False,
             scale: str = "none") -> dict:
    """gemm_kernel (or gemm_wait_kernel) at `cfg` for inputs of Triton type `dtype` (FP8 'fp8e4nv'
    writes bf16), B row-major K x N or, with b_t, stored N x K (stride_bk 1)."""
    out = "bf16" if dtype == "fp8e4nv" else dtype
    sig = {**_HEAD, "a": f"*{dtype}", "b": f"*{dtype}", "c": f"*{out}"}
    sig.update(_WAIT_EXTRA if wait else {"scale_a": "*fp32", "scale_b": "*fp32"})
    sig.update(_SIZES)
    consts = {"stride_ak": 1, "stride_cn": 1, **{k: v for k, v in cfg.kernel_kwargs().items() if k in _CONST}}
    if b_t:
        sig["stride_bk"], sig["stride_bn"] = "constexpr", "i32"
        consts["stride_bk"] = 1
    else:
        consts["stride_bn"] = 1
    if wait:
        consts["PREFETCH"] = 2
    else:
        consts.update(WARP_SPEC=cfg.WARP_SPEC, STREAM_K=cfg.STREAM_K, B_T=b_t, SCALE=SCALE_CODES[scale])
    for k in consts:
        sig[k] = "constexpr"
    div = _DIV + ("stride_bn" if b_t else "stride_bk",) + (("ready",) if wait else ())
    return compile_request(MOD, "gemm_wait_kernel" if wait else "gemm_kernel", sig, consts, cfg.num_warps,
                           cfg.num_stages, div, name=name)


def _cfg(bm, bn, bk, warps, stages, **kw) -> GemmConfig:
    return GemmConfig(bm, bn, bk, 8, warps, stages, **kw)


COMPILES = {
    "tma": (_cfg(128, 256, 64, 8, 3), "bf16", False),
    "ptr": (_cfg(128, 128, 64, 8, 4, TMA=False), "bf16", False),
    "split": (_cfg(64, 128, 128, 4, 4, SPLIT_K=4), "bf16", False),
    "swap": (_cfg(16, 128, 128, 4, 4, SWAP_AB=True, SPLIT_K=4), "bf16", False),
    "noswap16": (_cfg(16, 64, 256, 4, 3), "bf16", False),
    "ws": (_cfg(128, 128, 64, 4, 3, WARP_SPEC=True), "bf16", False),
    "fp32": (_cfg(64, 64, 32, 4, 3), "fp32", False),
    "streamk": (_cfg(128, 256, 64, 8, 3, STREAM_K=True), "bf16", False),
    "deep_w4": (_cfg(128, 128, 64, 4, 5), "bf16", False),  # gemm.defaults' deep 4-warp tile
    "deep_w4_sk": (_cfg(128, 128, 64, 4, 5, STREAM_K=True), "bf16", False),
    "deep6_w4": (_cfg(128, 128, 64, 4, 6), "bf16", False),  # the core's 6-stage defaults (run g2)
    "ptr6_skinny": (_cfg(64, 64, 128, 4, 6, TMA=False), "bf16", False),
    "wait_tma": (_cfg(128, 256, 64, 8, 3), "bf16", True),
    "wait_ptr": (_cfg(128, 128, 64, 8, 4, TMA=False), "bf16", True),
}
# FP8 (e4m3 in, bf16 out, B stored N x K as torch._scaled_mm takes it): (config, scaling)
FP8_COMPILES = {
    "fp8_tma_row": (_cfg(128, 256, 128, 8, 3), "rowwise"),
    "fp8_tma_tensor_sk": (_cfg(128, 256, 128, 8, 3, STREAM_K=True), "tensorwise"),
    "fp8_swap_split": (_cfg(16, 128, 256, 4, 3, SWAP_AB=True, SPLIT_K=4), "rowwise"),
    "fp8_ptr": (_cfg(128, 128, 128, 8, 4, TMA=False), "tensorwise"),
    "fp8_deep_w4_tensor": (_cfg(128, 128, 128, 4, 5), "tensorwise"),  # gemm.defaults' deep 4-warp tile
    "fp8_deep_w4_row": (_cfg(128, 128, 128, 4, 5), "rowwise"),
    "fp8_deep_w4_row_sk": (_cfg(128, 128, 128, 4, 5, STREAM_K=True), "rowwise"),
    "fp8_ptr6_w8": (_cfg(128, 128, 128, 8, 6, TMA=False), "tensorwise"),  # the core's pointer defaults (run g2)
    "fp8_ptr4_wide_row": (_cfg(128, 256, 128, 8, 4, TMA=False), "rowwise"),
}

@pytest.fixture(scope="module")
def compiled() -> dict:
    """{version: {case: {'ptx', 'shared'}}} for every entry of conftest.VERSIONS present here."""
    return conftest.compile_sm90_versions([_request(name, cfg, dtype, wait)
                                           for name, (cfg, dtype, wait) in COMPILES.items()] +
                                          [_request(name, cfg, "fp8e4nv", b_t=True, scale=scale)
                                           for name, (cfg, scale) in FP8_COMPILES.items()])


def _pipeline_bytes(cfg: GemmConfig, elem: int = 2) -> int:
    return cfg.num_stages * (cfg.BLOCK_M * cfg.BLOCK_K + cfg.BLOCK_K * cfg.BLOCK_N) * elem


@pytest.mark.parametrize("version", VERSIONS)
def test_sm90_tma_and_pointer_paths_are_pipelined_wgmma(compiled, version):
    k = compiled[version]
    for name in ("tma", "split", "swap", "wait_tma"):
        ptx = k[name]["ptx"]
        assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", ptx), f"{name}: no TMA loads"
        assert "mbarrier.try_wait" in ptx, f"{name}: TMA loads without mbarrier waits"
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in k["tma"]["ptx"], "C is not stored by TMA"
    for name in ("ptr", "wait_ptr"):
        ptx = k[name]["ptx"]
        assert "cp.async.bulk.tensor" not in ptx
        assert "cp.async.commit_group" in ptx and "cp.async.wait_group" in ptx, f"{name}: K loop not pipelined"
    for name in ("tma", "ptr", "split", "swap", "ws", "wait_tma", "wait_ptr", "fp32"):
        assert "wgmma.mma_async" in k[name]["ptx"], f"{name}: no wgmma"
    for name in ("tma", "ptr", "split", "swap", "wait_tma", "wait_ptr", "deep6_w4", "ptr6_skinny"):  # A and B stages
        cfg = COMPILES[name][0]
        assert _pipeline_bytes(cfg) <= k[name]["shared"] <= gemm.SMEM_LIMIT, (name, k[name]["shared"])
        assert k[name]["shared"] <= cfg.smem_bytes("bfloat16"), (name, "smem model too low")


@pytest.mark.parametrize("version", VERSIONS)
def test_sm90_split_k_swap_ab_and_warp_spec(compiled, version):
    k = compiled[version]
    assert "atom.global.gpu.acq_rel.add" in k["split"]["ptx"] and "ld.global.cg" in k["split"]["ptx"]
    assert "atom.global" not in k["tma"]["ptx"]  # SPLIT_K=1 touches no counts
    # stream-K: the tail's fixup counts and reads partials; its second tile loop is pipelined like the first
    assert "atom.global.gpu.acq_rel.add" in k["streamk"]["ptx"] and "ld.global.cg" in k["streamk"]["ptx"]
    assert k["streamk"]["ptx"].count("wgmma.mma_async") >= 2 * k["tma"]["ptx"].count("wgmma.mma_async")
    assert k["streamk"]["shared"] <= COMPILES["streamk"][0].smem_bytes("bfloat16")
    # swap-AB: BLOCK_N=128 on the wgmma's M side, the 16 rows of A as its N; without, BLOCK_M=16 rows
    # cannot use wgmma at all (mma.sync)
    assert "wgmma.mma_async.sync.aligned.m64n16k16" in k["swap"]["ptx"]
    assert "wgmma" not in k["noswap16"]["ptx"] and "mma.sync" in k["noswap16"]["ptx"]
    # warp specialisation: a producer warpgroup plus two consumers, registers rebalanced
    assert "setmaxnreg" in k["ws"]["ptx"] and "setmaxnreg" not in k["tma"]["ptx"]
    assert ".f32.tf32.tf32" in k["fp32"]["ptx"]  # float32 inputs run tf32 wgmma (default_tolerance's u = 2^-11)


@pytest.mark.parametrize("version", VERSIONS)
def test_sm90_waiting_consumer_keeps_the_pipeline(compiled, version):
    """A bounded wait and B's L2 prefetch before each tile's K loop leave the loop as pipelined as
    the plain kernel's: num_stages buffers of the A and B tiles (the other test checks the TMA and
    cp.async instructions); Triton 3.9 may also reuse them for the C tile of the TMA store."""
    k = compiled[version]
    for plain, waiting in (("tma", "wait_tma"), ("ptr", "wait_ptr")):
        shared = k[waiting]["shared"]
        assert _pipeline_bytes(COMPILES[plain][0]) <= shared <= k[plain]["shared"], (plain, k[plain]["shared"], shared)
        assert "ld.volatile.global" in k[waiting]["ptx"] and "prefetch.global.L2" in k[waiting]["ptx"]
        conftest.assert_uniform(k[waiting], waiting)  # a timed-out wait never splits the program


@pytest.mark.parametrize("version", VERSIONS)
def test_sm90_fp8_runs_e4m3_wgmma_from_k_major_tiles(compiled, version, tmp_path):
    """FP8 compiles to e4m3 wgmma with B's N x K storage loaded by TMA (K-major, what FP8 wgmma
    reads), its scales in the epilogue, stream-K and swap-AB/split-K too, within the shared-memory
    model, and (Triton 3.6's ptxas, the GPU machines') without register spills."""
    k = compiled[version]
    for name, (cfg, scale) in FP8_COMPILES.items():
        ptx = k[name]["ptx"]
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", ptx), name
        assert k[name]["shared"] <= cfg.smem_bytes("float8_e4m3fn") <= gemm.SMEM_LIMIT, (name, k[name]["shared"])
        if cfg.TMA:
            assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", ptx), f"{name}: no TMA loads"
    assert "atom.global.gpu.acq_rel.add" in k["fp8_tma_tensor_sk"]["ptx"]  # the stream-K fixup
    if version == "3.6":
        conftest.assert_spills_within({name: k[name] for name in FP8_COMPILES}, {}, tmp_path)


# ------------------------------------------------------------------------------------------------
# on a GPU (pytest -m gpu): the core against torch.matmul at the defaults of the bench's regimes
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m, n, k", [(16, 3584, 8192), (128, 5120, 8192), (1024, 8192, 14336), (77, 1000, 520)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpu_defaults_match_torch(m, n, k, dtype):
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda").to(DTYPES[dtype])
    b = torch.randn(k, n, device="cuda").to(DTYPES[dtype])
    ref = a.double() @ b.double()
    configs = gemm.defaults(m, n, k, dtype)
    configs += [dict(c, TMA=False) for c in configs if c["TMA"] and not c["WARP_SPEC"]][:1]
    for config in configs:
        for _ in range(3):  # repeated calls: split-K counts reset, graph-style reuse of the workspace
            out = torch.full_like(ref, math.nan, dtype=DTYPES[dtype])
            gemm.matmul(a, b, config, out=out)
            torch.cuda.synchronize()
            assert rel_error(out, ref) <= default_tolerance(dtype, k), (config, rel_error(out, ref))


def _graph_replays(launch, out: torch.Tensor, replays: int = 3) -> list[torch.Tensor]:
    """Capture `launch` in a CUDA graph, replay it `replays` times; the output after each replay."""
    launch()  # compiled and workspace grown before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    results = []
    for _ in range(replays):
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        results.append(out.clone())
    return results


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m, n, k", [(512, 5120, 8192), (1024, 28672, 8192), (256, 3584, 14336), (77, 1000, 520)])
def test_gpu_stream_k_matches_float64_and_replays_bitwise(m, n, k):
    """STREAM_K configs (the defaults' stream-K twins, or a 64x128 one where none is proposed) on
    shapes whose last wave idles SMs: correct, bitwise the same over calls and CUDA-graph replays
    (the fixup's counts reset themselves, its sum order is fixed)."""
    torch.manual_seed(1)
    a = torch.randn(m, k, device="cuda").bfloat16()
    b = torch.randn(k, n, device="cuda").bfloat16()
    ref = a.double() @ b.double()
    configs = [c for c in gemm.defaults(m, n, k, "bfloat16", stream_k=True) if c["STREAM_K"]]
    configs = configs or [GemmConfig(64, 128, 64, 8, 4, 4, TMA=n % 8 == 0 and k % 8 == 0, STREAM_K=True).to_dict()]
    for config in configs:
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        launch = gemm.prepare(a, b, config, out)
        first = None
        for _ in range(3):
            out.fill_(math.nan)
            launch()
            torch.cuda.synchronize()
            assert rel_error(out, ref) <= default_tolerance("bfloat16", k), (config, rel_error(out, ref))
            first = out.clone() if first is None else first
            assert torch.equal(out, first), config
        for replayed in _graph_replays(launch, out):
            assert torch.equal(replayed, first), (config, "graph replay differs")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("m, n, k", [(16, 3584, 8192), (128, 5120, 8192), (1024, 8192, 14336), (77, 1024, 528)])
def test_gpu_fp8_matches_float64_and_scaled_mm(m, n, k, scaling):
    """Every FP8 default (B stored N x K, as weights are) against the float64 product of the FP8
    values times their scales, next to torch._scaled_mm's own error, also under graph replay."""
    torch.manual_seed(2)
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
    shapes = ((1,), (1,)) if scaling == "tensorwise" else ((m, 1), (1, n))
    sa, sb = (torch.rand(s, device="cuda") + 0.5 for s in shapes)
    ref = (a.double() @ b.double()) * sa.double() * sb.double()
    tol = default_tolerance("float8_e4m3fn", k)
    vendor = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True)
    assert rel_error(vendor, ref) <= tol
    for config in gemm.defaults(m, n, k, "float8_e4m3fn", stream_k=True):
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        launch = gemm.prepare(a, b, config, out, scale_a=sa, scale_b=sb)
        out.fill_(math.nan)
        launch()
        torch.cuda.synchronize()
        assert rel_error(out, ref) <= tol, (config, rel_error(out, ref), rel_error(vendor, ref))
        for replayed in _graph_replays(launch, out, 2):
            assert rel_error(replayed, ref) <= tol, (config, "graph replay")


# ------------------------------------------------------------------------------------------------
# the benchmark's plumbing (the GPU run is the lead's: autofuse bench gemm_core)
def test_bench_shapes_and_candidates():
    from autofuse.bench import bench_gemm_core as bench

    assert bench.parse_shapes(["16,64x3584", "1024x28672x8192"]) == [(16,), (64, 3584), (1024, 28672, 8192)]
    with pytest.raises(ValueError, match="MxNxK"):
        bench.parse_shapes(["16x"])
    shapes = bench.sweep_shapes("gpu")
    assert len(shapes) == 64 and {n for _, n, _ in shapes} == set(bench.N_SET)
    assert len(bench.sweep_shapes("full")) == 88
    assert bench.select(shapes, [(64, 3584)]) == [(64, 3584, 8192), (64, 3584, 14336)]
    assert bench.parse_variants(["tma,ptr", "swap"]) == {"tma", "ptr", "swap"}
    with pytest.raises(ValueError, match="families"):
        bench.parse_variants(["pull"])
    assert bench.families({**BIG, "TMA": False, "SPLIT_K": 2}) == {"ptr", "splitk"}
    assert bench.families({**BIG, "STREAM_K": True}) == {"tma", "streamk"}
    # 80 tiles of 128x256 on 132 SMs: that tile's stream-K twin is timed too (the best tile there, not the first)
    assert any(c["STREAM_K"] and (c["BLOCK_M"], c["BLOCK_N"]) == (128, 256) for c in bench.candidates(512, 5120, 8192))
    for m, n, k in shapes:
        configs = bench.candidates(m, n, k)
        assert 4 <= len(configs) <= 14  # each default and extra, and a stream-K twin where it can help
        assert all(gemm.check(c, m, n, k, "bfloat16", stream_k=True) is None for c in configs)
        assert any(not c["TMA"] for c in configs)
        assert any(c["WARP_SPEC"] for c in configs) == (not 64 < m <= 256)  # 65-256 rows: 6-stage tiles instead
        if m <= 64:
            assert any(c["SWAP_AB"] for c in configs) and any(c["SPLIT_K"] > 1 for c in configs) == (n < 28672)


def test_bench_wide_search_widens_the_defaults():
    """--search wide: the defaults first, then a grid that passes check for the shape and dtype (swap-AB
    both ways at <= 64 rows, warp-specialised and stream-K twins where they apply); none on tiny shapes."""
    from autofuse.bench import bench_gemm_core as bench

    for dtype in ("bfloat16", "float8_e4m3fn"):
        for m, n, k in ((16, 3584, 8192), (256, 5120, 8192), (1024, 5120, 14336), (16384, 28672, 8192)):
            base, wide = bench.candidates(m, n, k, dtype), bench.candidates(m, n, k, dtype, "wide")
            assert wide[:len(base)] == base and len(wide) > 2 * len(base)
            assert len({bench.config_text(c) for c in wide}) == len(wide)
            assert all(gemm.check(c, m, n, k, dtype, stream_k=True) is None for c in wide)
            assert {c["num_stages"] for c in wide} >= {3, 4, 5}
            for c in wide:
                tiles = GemmConfig.from_dict(c).tiles(m, n)
                if c["STREAM_K"] and c not in base:  # a stream-K twin: a partial last wave, or under one wave
                    assert tiles < gemm.H200_SMS or gemm.stream_k_helps(tiles, gemm.cdiv(k, c["BLOCK_K"])), c
            one_wave = [c for c in wide if GemmConfig.from_dict(c).tiles(m, n) < gemm.H200_SMS
                        and not c["STREAM_K"] and not c["WARP_SPEC"] and c["SPLIT_K"] == 1 and not c["SWAP_AB"]]
            for c in one_wave:  # under one wave: its stream-K twin is timed too
                assert {**c, "STREAM_K": True} in wide or gemm.check({**c, "STREAM_K": True}, m, n, k, dtype,
                                                                     stream_k=True) is not None, c
            assert any(c["WARP_SPEC"] for c in wide) == (dtype == "bfloat16")
            if m <= 64:
                assert {c["SWAP_AB"] for c in wide} == {True, False}
    assert bench.candidates(16, 64, 64, search="wide") == bench.candidates(16, 64, 64)
    with pytest.raises(ValueError, match="defaults or wide"):
        bench.candidates(16, 64, 64, search="all")


def test_bench_precompile_runs_each_config_once_in_workers():
    """The wide search's compile pass (processes launching each distinct config once) on CPU: it
    reports no failure for valid configs and names the ones that fail."""
    from autofuse.bench import bench_gemm_core as bench

    lines = []
    assert bench.precompile([(16, 64, 64), (40, 72, 48)], "bf16", "defaults", torch.device("cpu"), 2,
                            lines.append) == []
    assert lines[0].startswith("compiling 5 distinct configs in 2 processes")


def test_bench_runs_on_cpu_under_the_interpreter():
    from autofuse.bench import bench_gemm_core as bench

    result = bench.run({"shapes": ["16"], "reps": 1, "progress": False})
    assert result["device_kind"] == "cpu" and result["notes"] and json.dumps(result)
    (row,) = result["rows"]
    assert row["mode"] == "eager" and row["core_us"] > 0 and row["meets_target"] is None
    assert all(c["error"] is None for c in row["configs"]), row["configs"]


def test_bench_fp8_runs_on_cpu_against_scaled_mm():
    from autofuse.bench import bench_gemm_core as bench

    result = bench.run({"shapes": ["16"], "reps": 1, "progress": False, "dtype": "fp8"})
    assert result["dtype"] == "fp8" and "_scaled_mm" in result["vendor"]
    (row,) = result["rows"]
    assert row["dtype"] == "float8_e4m3fn" and row["core_us"] > 0 and row["rowwise_core_us"] > 0
    assert all(c["error"] is None for c in row["configs"]), row["configs"]
    with pytest.raises(ValueError, match="bf16 or fp8"):
        bench.run({"dtype": "fp16"})


def test_allocator_is_installed_in_every_thread_that_launches():
    """Triton keeps its allocator in a context variable: a thread that did not set it has none (autograd
    runs backward in its own thread on GPUs), so ensure_allocator works per thread, not once per process."""
    import threading

    from triton.runtime import _allocation

    gemm.ensure_allocator()
    seen = []

    def launcher() -> None:
        seen.append(_allocation._allocator.get())
        gemm.ensure_allocator()
        seen.append(_allocation._allocator.get())

    t = threading.Thread(target=launcher)
    t.start()
    t.join()
    assert isinstance(seen[0], _allocation.NullAllocator)  # a new thread starts without it
    assert not isinstance(seen[1], _allocation.NullAllocator)
