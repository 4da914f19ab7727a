"""gemm_ar on CPU ranks (Triton's interpreter, 2 and 4 ranks), on two GPUs (`pytest -m gpu`), and
compiled for sm_90.

Case tables run by tests/harness.py (repeated and interleaved calls into NaN-poisoned outputs, CUDA
graph replay on GPUs) against the float64 reference at `OP.tolerance(problem)` (the gemm_rs bound,
autofuse/ops/row_parallel.py). The fused variants sum in rank order, so every rank must return
bitwise the same matrix. Fault scenarios must raise on every rank, never return a wrong result.
"""
from __future__ import annotations

import re
from functools import partial

import pytest
import torch

import harness
from _row_parallel import (TINY, assert_rejected, cases_and_faults, check_compiled_gemm, check_dead_peer_time,
                           check_fault, check_faults_on_gpus, check_space, check_sweeps, default_cases, fake_world,
                           fault_ids, fault_plan, tiny)
from autofuse.core.op import InvalidConfig, InvalidInput, Problem
from autofuse.ops import gemm_ar
from autofuse.comm.world import spawn
from conftest import CTX, VERSIONS, assert_spills_within, compile_table, needs_t36

OP = gemm_ar.OP
FUSED = ("one_shot", "two_shot")
SAME_BITS = ("mm_heap", "mm_ll", *FUSED)  # these sum in rank order: bitwise identical results on every rank

_defaults = partial(default_cases, OP)  # (variant, dims, dtype, pick: the first `pick` defaults, world)


ODD = {"M": 20, "N": 40, "K": 48}   # M, N and K/W not multiples of the blocks
FEW = {"M": 3, "N": 24, "K": 16}    # a decode batch: fewer rows than a block
CPU_CASES = [
    ("bsp", ODD, "bfloat16", {}), ("bsp", ODD, "float16", {}), ("bsp", ODD, "float32", {}),
    ("bsp", FEW, "float32", {}),
    ("one_shot", ODD, "bfloat16", tiny(PARTIAL="fp32")),
    ("one_shot", ODD, "float16", tiny(BLOCK_N=32, GROUP_M=1, PARTIAL="out", TMA=False, SPLIT_K=2)),
    ("one_shot", ODD, "float32", tiny(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, PARTIAL="out", SWAP_AB=True)),
    ("one_shot", FEW, "bfloat16", tiny(BLOCK_N=32, PARTIAL="out")),
    ("two_shot", ODD, "bfloat16", tiny(PARTIAL="out")),
    ("two_shot", ODD, "float16", tiny(BLOCK_M=32, BLOCK_N=32, PARTIAL="fp32", TMA=False, SPLIT_K=2)),
    ("two_shot", ODD, "float32", tiny(BLOCK_M=32, GROUP_M=1, BLOCK_K=32, PARTIAL="fp32")),
    ("two_shot", FEW, "float32", tiny(BLOCK_N=32, PARTIAL="fp32", SWAP_AB=True)),
    *_defaults("mm_heap", ODD, "bfloat16"), *_defaults("mm_heap", FEW, "float32", pick=1),
    *_defaults("mm_ll", ODD, "float16", pick=1), *_defaults("mm_ll", FEW, "float32", pick=1),
]
FOUR = {"M": 5, "N": 24, "K": 64}
CPU4_CASES = [
    ("bsp", FOUR, "bfloat16", {}),
    ("one_shot", FOUR, "bfloat16", tiny(PARTIAL="out")),
    ("two_shot", FOUR, "float16", tiny(PARTIAL="out")),
    *_defaults("mm_heap", FOUR, "bfloat16", world=4),
    *_defaults("mm_ll", FOUR, "bfloat16", pick=1, world=4),
]

# GPU sizes: decode batches on Llama-3-70B's o_proj and down, the sweep's N=8192, K=14336, and
# shapes outside every sweep (odd sizes, Qwen2.5-72B's down).
O_PROJ = {"N": 8192, "K": 8192}
DOWN, QWEN, GPU_SWEEP = {"N": 8192, "K": 28672}, {"N": 8192, "K": 29568}, {"N": 8192, "K": 14336}
SMALL_TILE = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}


GPU_CASES = [
    ("bsp", {"M": 128, **GPU_SWEEP}, "bfloat16", {}), ("bsp", {"M": 77, **QWEN}, "float32", {}),
    ("torch_symm_one_shot", {"M": 128, **GPU_SWEEP}, "bfloat16", {}),
    ("torch_symm_two_shot", {"M": 77, **QWEN}, "bfloat16", {}),
    *_defaults("mm_heap", {"M": 8, **O_PROJ}, pick=4), *_defaults("mm_heap", {"M": 256, **GPU_SWEEP}),
    *_defaults("mm_heap", {"M": 77, **QWEN}, "float16", pick=1),
    *_defaults("mm_ll", {"M": 1, **O_PROJ}, pick=3), *_defaults("mm_ll", {"M": 256, **GPU_SWEEP}, pick=1),
    *_defaults("mm_ll", {"M": 77, **QWEN}, "float16", pick=1), *_defaults("mm_ll", {"M": 9, **O_PROJ}, "float32", pick=1),
    *_defaults("one_shot", {"M": 1, **O_PROJ}), *_defaults("one_shot", {"M": 32, **DOWN}),
    *_defaults("one_shot", {"M": 256, **GPU_SWEEP}), *_defaults("two_shot", {"M": 128, **GPU_SWEEP}),
    *_defaults("one_shot", {"M": 1000, **GPU_SWEEP}, pick=1), *_defaults("two_shot", {"M": 2048, **O_PROJ}, pick=1),
    *_defaults("one_shot", {"M": 77, **QWEN}, "float16", pick=1),
    ("one_shot", {"M": 77, **QWEN}, "float32", {**SMALL_TILE, "BLOCK_M": 64, "BLOCK_K": 32, "PARTIAL": "fp32"}),
    ("one_shot", {"M": 9, "N": 3000, "K": 5000}, "bfloat16", {**SMALL_TILE, "PARTIAL": "fp32", "TMA": False,
                                                              "SWAP_AB": True, "SPLIT_K": 4}),
    ("two_shot", {"M": 9, "N": 3000, "K": 5000}, "float16", {**SMALL_TILE, "PARTIAL": "out", "TMA": False}),
]


# -- faults: a late peer, a skipped call, a dead peer (at 1 and at 8 tiles); one at 4 ranks ---------------
SMALL_FAULT, LARGE_FAULT = {"M": 16, "N": 16, "K": 32}, {"M": 64, "N": 128, "K": 32}  # 1 and 8 tiles (32x32)
FAULT_PLAN = fault_plan(SMALL_FAULT, "float32", (("one_shot", tiny(PARTIAL="fp32")), ("two_shot", tiny(PARTIAL="out"))))
FAULT_PLAN.append(("one_shot", LARGE_FAULT, "float32", tiny(BLOCK_M=32, BLOCK_N=32, PARTIAL="fp32"), "dead_peer"))
FAULT_PLAN4 = [("two_shot", SMALL_FAULT, "bfloat16", tiny(PARTIAL="out"), "dead_peer"),
               ("mm_ll", SMALL_FAULT, "bfloat16", {"COMM_SMS": 2, "BLOCK": 256, "num_warps": 4}, "dead_peer")]


@pytest.fixture(scope="module")
def two_ranks() -> tuple[list, list[list[dict]]]:
    """(run_cases results per rank, [scenario][rank] -> what the rank saw in harness.fault_run)."""
    return cases_and_faults(2, OP, CPU_CASES, 2, FAULT_PLAN, timeout_s=900)


def test_two_ranks_every_variant_dtype_and_odd_shapes_bitwise_equal_across_ranks(two_ranks):
    harness.assert_ok(two_ranks[0], same_bits=SAME_BITS)


def test_four_ranks_and_a_dead_peer():
    results, scenarios = cases_and_faults(4, OP, CPU4_CASES, 1, FAULT_PLAN4, timeout_s=900)
    harness.assert_ok(results, same_bits=SAME_BITS)
    for seen in scenarios:
        harness.check_fault_run(seen)
        assert all(r["seen"][1][0] != "returned" for r in seen[:-1]), seen


@harness.gpu()
def test_gpu_cases_eager_and_graph_replay_bitwise_equal_across_ranks():
    results = spawn(harness.gpu_cases, harness.gpu_world(), OP, GPU_CASES, device_kind="cuda", timeout_s=1800)
    harness.assert_ok(results, same_bits=SAME_BITS)


@harness.gpu()
def test_gpu_faults():
    tile = {**SMALL_TILE, "BLOCK_M": 64}
    check_faults_on_gpus(OP, fault_plan({"M": 128, **O_PROJ}, "bfloat16", (("one_shot", {**tile, "PARTIAL": "out"}),
                                                                           ("two_shot", {**tile, "PARTIAL": "fp32"}))))


@pytest.mark.parametrize("i", range(len(FAULT_PLAN) - 1),
                         ids=fault_ids(FAULT_PLAN[:-1]))
def test_fault_raises_on_every_rank_and_never_returns_a_wrong_result(two_ranks, i):
    check_fault(two_ranks[1][i], FAULT_PLAN[i][4])


def test_dead_peer_time_to_fail_does_not_grow_with_the_problem(two_ranks):
    check_dead_peer_time(two_ranks[1], FAULT_PLAN, "one_shot", SMALL_FAULT)


# -- validation, configs, sweeps ------------------------------------------------------------------------
def test_problem_of_and_runner_validate_inputs():
    w = fake_world()
    a, b = torch.randn(7, 6), torch.randn(6, 5)
    p = OP.problem_of(w, a, b)
    assert (p["M"], p["N"], p["K"], p.op) == (7, 5, 12, "gemm_ar")  # any M: nothing is split by rows
    for args, msg in [((a, torch.randn(4, 5)), "must equal b's rows"), ((a.double(), b.double()), "not supported"),
                      ((a, b.to(torch.bfloat16)), "same dtype"), ((a[None], b), "2-D")]:
        with pytest.raises(InvalidInput, match=msg):
            OP.problem_of(w, *args)
    runner = OP.variant("bsp").build(w, p, {})
    with pytest.raises(InvalidInput, match="built for"):
        runner(torch.randn(8, 6), b)
    with pytest.raises(InvalidInput, match="out must be"):
        runner(a, b, out=torch.empty(7, 6))


def test_invalid_configs_rejected_before_launch():
    w = fake_world()
    p = Problem.make("gemm_ar", "float16", 2, M=32, N=64, K=64)
    good = tiny(PARTIAL="fp32")
    for variant in FUSED:
        v = OP.variant(variant)
        assert v.check(p, good) is None
        for config, msg in [({**good, "BLOCK_N": 48}, "BLOCK_N=48 must be one of"),
                            ({**good, "BLOCK_M": 64}, "BLOCK_M=64 is larger than 32 needs"),
                            ({**good, "FLAG": "tile"}, "unknown ['FLAG']"), ({**good, "num_stages": 0}, "num_stages"),
                            ({**good, "GROUP_M": 0}, "GROUP_M"), ({**good, "PARTIAL": "bf16"}, "PARTIAL='bf16'"),
                            (TINY, "missing ['PARTIAL']"), ({**good, "SPLIT_K": 3}, "SPLIT_K=3 is more than")]:
            assert_rejected(w, p, v, config, msg)
    odd = Problem.make("gemm_ar", "bfloat16", 2, M=9, N=3000, K=5000)  # K/W = 2500: rows not 16-byte aligned
    assert "TMA needs 16-byte aligned row strides" in OP.variant("one_shot").check(odd, {**good, "BLOCK_M": 16})
    assert OP.variant("one_shot").check(odd, {**good, "TMA": False}) is None
    with pytest.raises(InvalidConfig, match="takes no config"):
        OP.variant("bsp").build(w, p, good)


def test_space_draws_runnable_configs_without_warp_specialisation():
    for p in (Problem.make("gemm_ar", "bfloat16", 2, M=32, N=8192, K=8192),
              Problem.make("gemm_ar", "float32", 2, M=20, N=40, K=48)):
        for name in FUSED:
            check_space(OP.variant(name), p, lambda config: config["PARTIAL"] in ("fp32", "out"))


def test_sweeps_defaults_and_features():
    check_sweeps(OP, divisible=("K",))  # any M: nothing is split by rows
    assert [p["M"] for p in OP.sweep("gpu", 2)] == [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert {p["M"] for p in OP.sweep("models", 2)} == {1, 8, 32, 128}  # decode batches
    default = OP.sweep("default", 2)
    assert 8 <= len(default) <= 12 and max(p["M"] for p in default) <= 256
    decode = OP.variant("one_shot").defaults(Problem.make("gemm_ar", "bfloat16", 2, M=8, N=8192, K=8192))[0]
    assert decode["SWAP_AB"] and decode["SPLIT_K"] > 1  # skinny: N on the wgmma's M side, K split to fill SMs
    assert {v.family for v in OP.variants.values()} == {"bsp", "peer", "hybrid", "fused"}
    for name in ("torch_symm_one_shot", "torch_symm_two_shot"):  # torch's symmetric memory: CUDA only
        assert OP.variant(name).available(fake_world()) is False and OP.variant(name).family == "peer"
        for dtype, refused in (("float16", True), ("bfloat16", False), ("float32", False)):  # torch has no fp16 kernel
            why = OP.variant(name).check(Problem.make("gemm_ar", dtype, 2, M=8, N=8192, K=8192), {})
            assert (why is not None and "float16" in why) == refused, (name, dtype, why)


# -- sm_90 -----------------------------------------------------------------------------------------------
MOD = "autofuse.kernels.gemm_ar"
SIG = {"a": "*bf16", "b": "*bf16", "out": "*bf16", "scale_a": "*fp32", "scale_b": "*fp32", "inbox": "*bf16", "inbox_half": "i64", "gathered": "*bf16",
       "gathered_half": "i64", "flags": "*i32", "half_flags": "i32", "sk_partials": "*fp32", "sk_counts": "*i32",
       "ctx": CTX, "M": "i32", "N": "i32", "K_r": "i32", "stride_am": "i32", "stride_ak": "constexpr",
       "stride_bk": "i32", "stride_bn": "constexpr", "stride_om": "i32", "stride_on": "constexpr"}
DIVISIBLE = ("a", "b", "out", "inbox", "gathered", "flags", "sk_partials", "sk_counts", "N", "K_r", "stride_am",
             "stride_bk", "stride_om")
BASE = {"stride_ak": 1, "stride_bn": 1, "stride_on": 1, "WORLD": 2, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128,
        "GROUP_M": 8, "NUM_STAGES": 4, "SPLIT_K": 1, "SWAP_AB": False, "USE_TMA": True, "TWO_SHOT": False,
        "B_T": False, "SCALE": 0}
COMPILES = {  # name: (constexpr changes, inbox dtype, num_warps)
    "one_shot_decode": ({"BLOCK_M": 16, "SWAP_AB": True, "SPLIT_K": 4}, "bf16", 4),
    "one_shot_fp32_w4": ({"WORLD": 4}, "fp32", 4),
    "two_shot_w4": ({"TWO_SHOT": True, "WORLD": 4, "BLOCK_M": 128, "BLOCK_K": 64, "NUM_STAGES": 3}, "bf16", 8),
    "two_shot_ptr": ({"TWO_SHOT": True, "USE_TMA": False}, "fp32", 4),
    # FP8 (B stored N x K, row-wise / tensorwise scales on each partial): e4m3 wgmma, bf16 inbox
    "fp8_one_shot_rowwise": ({"B_T": True, "SCALE": 2, "BLOCK_K": 256, "NUM_STAGES": 3}, "bf16", 4),
    "fp8_two_shot_tensor_swap": ({"B_T": True, "SCALE": 1, "TWO_SHOT": True, "BLOCK_M": 16, "SWAP_AB": True,
                                  "SPLIT_K": 2, "BLOCK_K": 256, "NUM_STAGES": 3}, "fp32", 4),
    # gemm.defaults' deep tile, on 8 warps in fused kernels
    "one_shot_deep": ({"BLOCK_M": 128, "BLOCK_K": 64, "NUM_STAGES": 5}, "bf16", 8),
}


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compile_table(MOD, "gemm_ar_kernel", BASE, SIG, COMPILES, DIVISIBLE)


# Spills Triton 3.6's ptxas reported for rows of COMPILES on 2026-11-26 (spill-store bytes): float32
# partials of a 4-rank one-shot sum beside a 64x128 accumulator on 4 warps. Known, not yet measured
# for speed; the test keeps them from growing and every other row at zero.
KNOWN_SPILLS = {"one_shot_fp32_w4": 104}


@needs_t36
def test_sm90_no_register_spills(compiled, tmp_path):
    """Triton 3.6's ptxas (the GPU machines') assembles every row without spilling, but KNOWN_SPILLS's
    rows within their recorded bytes; the deep 5-stage tile of gemm.defaults included."""
    assert_spills_within(compiled["3.6"], KNOWN_SPILLS, tmp_path)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", list(COMPILES))
def test_compiles_for_sm90_with_pipelined_wgmma_and_bounded_waits(compiled, name, version):
    ptx, consts = check_compiled_gemm(compiled[version], name, BASE, COMPILES)
    if consts["B_T"]:
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", ptx), "no FP8 wgmma"
    elif consts["SWAP_AB"]:
        assert "wgmma.mma_async.sync.aligned.m64n16k16" in ptx, "swap-AB: BLOCK_N on the wgmma's M side"
    if consts["SPLIT_K"] > 1:
        assert "atom.global.gpu.acq_rel.add" in ptx, "split-K arrivals"
    assert "atom.global.sys.release.exch.b32" in ptx, "no epoch flag raised with a sys-scope release"
