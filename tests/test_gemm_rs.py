"""gemm_rs on CPU ranks (Triton's interpreter, 2 and 4 ranks), on two GPUs (`pytest -m gpu`), and
compiled for sm_90.

One case table per setting (variant, dims, dtype, config), run by tests/harness.py: every case is
called repeatedly with fresh inputs into NaN-poisoned outputs, then interleaved with the others on
the shared workspace (as the tuner calls them), and compared with the float64 reference at
`OP.tolerance(problem)` (autofuse/ops/row_parallel.py derives it: float32 dots of the
dtype-rounded inputs, at most one rounding per partial and the final rounding, ~2u against
4u * max(1, sqrt(log2 K / 8)) allowed). On GPUs the harness also replays each case from a CUDA graph.
Fault scenarios (a late peer, a skipped call, a dead peer) must raise on every rank within the wait
budget and never return a wrong result.
"""
from __future__ import annotations

import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

import harness
from _row_parallel import (TINY, assert_rejected, cases_and_faults, check_compiled_gemm, check_dead_peer_time,
                           check_fault, check_faults_on_gpus, check_space, check_sweeps, default_cases, fake_world,
                           fault_ids, fault_plan, tiny)
from autofuse.core import gemm
from autofuse.core.op import InvalidInput, Problem
from autofuse.core.settings import SettingError
from autofuse.ops import gemm_rs
from autofuse.comm.world import spawn
from conftest import (CTX, VERSIONS, assert_spills_within, assert_uniform, compile_request, compile_sm90_many,
                      compile_table, needs_t36)

OP = gemm_rs.OP
_defaults = partial(default_cases, OP)  # (variant, dims, dtype, pick: the first `pick` defaults or a slice, world)


ODD = {"M": 40, "N": 40, "K": 48}     # 20 rows per rank; N and K/W are not multiples of the blocks
ONE_ROW = {"M": 2, "N": 24, "K": 16}  # one row per rank
CPU_CASES = [
    ("bsp", ODD, "bfloat16", {}), ("bsp", ODD, "float16", {}), ("bsp", ODD, "float32", {}),
    ("bsp", ONE_ROW, "float32", {}),
    ("push_last", ODD, "bfloat16", tiny(PARTIAL="out")),
    ("push_last", ODD, "float16", tiny(BLOCK_N=32, PARTIAL="fp32", TMA=False, SPLIT_K=2)),
    ("push_last", ODD, "float32", tiny(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, PARTIAL="fp32", SWAP_AB=True)),
    ("push_last", ONE_ROW, "bfloat16", tiny(BLOCK_N=32, PARTIAL="fp32", TMA=False)),
    ("push_reducer", ODD, "float32", tiny(PARTIAL="fp32", FLAG="tile", COMM_SMS=2)),
    ("push_reducer", ODD, "bfloat16", tiny(BLOCK_M=32, BLOCK_N=32, PARTIAL="out", FLAG="row_block", COMM_SMS=8,
                                          TMA=False)),
    ("push_reducer", ODD, "float16", tiny(BLOCK_N=32, PARTIAL="out", FLAG="tile", COMM_SMS=1, SPLIT_K=2)),
    ("push_reducer", ONE_ROW, "float32", tiny(BLOCK_N=32, PARTIAL="fp32", FLAG="row_block", COMM_SMS=2)),
    *_defaults("mm_heap", ODD, "bfloat16", slice(0, 1)), *_defaults("mm_heap_overlap", ODD, "float32", slice(2, 3)),
    ("mm_ring", ODD, "bfloat16", {"CHUNKS": 2}), ("mm_ring", ODD, "float32", {"CHUNKS": 1}),
    ("mm_ring", ONE_ROW, "float16", {"CHUNKS": 4}),
]
FOUR = {"M": 20, "N": 24, "K": 32}  # 5 rows per rank
CPU4_CASES = [
    ("bsp", FOUR, "bfloat16", {}),
    ("push_last", FOUR, "bfloat16", tiny(PARTIAL="out", SWAP_AB=True)),
    ("push_reducer", FOUR, "float32", tiny(PARTIAL="fp32", FLAG="tile", COMM_SMS=2)),
    ("push_reducer", FOUR, "float16", tiny(PARTIAL="out", FLAG="row_block", COMM_SMS=1, TMA=False)),
    ("mm_ring", FOUR, "bfloat16", {"CHUNKS": 2}), ("mm_ring", FOUR, "float32", {"CHUNKS": 8}),
]

# GPU sizes: the sweeps' N=8192, K=14336 and shapes outside every sweep (odd, Qwen2.5-72B's down).
BIG, MID, SMALL = ({"M": 4096, "N": 8192, "K": 14336}, {"M": 1000, "N": 8192, "K": 14336},
                   {"M": 128, "N": 8192, "K": 14336})
ODD_GPU, QWEN = {"M": 1002, "N": 3000, "K": 5000}, {"M": 640, "N": 8192, "K": 29568}
MID_TILE = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


GPU_CASES = [
    ("bsp", BIG, "bfloat16", {}), ("torch_symm", BIG, "bfloat16", {}), ("bsp", MID, "float32", {}),
    *_defaults("mm_heap", BIG), *_defaults("mm_heap_overlap", BIG, pick=slice(0, 3)), *_defaults("mm_heap", QWEN),
    *_defaults("mm_heap_overlap", ODD_GPU, "float16", slice(2, 3)),
    *_defaults("push_last", BIG), *_defaults("push_reducer", BIG), *_defaults("push_last", SMALL),
    *_defaults("push_reducer", SMALL), *_defaults("push_last", QWEN),
    ("push_last", MID, "float16", {**MID_TILE, "PARTIAL": "out"}),
    ("push_last", MID, "float32", {**MID_TILE, "BLOCK_K": 32, "PARTIAL": "fp32"}),
    ("push_reducer", MID, "float32", {**MID_TILE, "BLOCK_K": 32, "PARTIAL": "fp32", "FLAG": "row_block",
                                      "COMM_SMS": 16, "TMA": False}),
    ("push_last", ODD_GPU, "bfloat16", {**MID_TILE, "PARTIAL": "fp32", "TMA": False, "SPLIT_K": 2}),
    ("push_reducer", ODD_GPU, "float16", {**MID_TILE, "PARTIAL": "out", "FLAG": "tile", "COMM_SMS": 8,
                                          "TMA": False}),
    *_defaults("mm_ring", BIG, pick=3), *_defaults("mm_ring", SMALL, pick=1), ("mm_ring", MID, "float16", {"CHUNKS": 8}),
    ("mm_ring", ODD_GPU, "float32", {"CHUNKS": 2}), ("mm_ring", QWEN, "bfloat16", {"CHUNKS": 4}),
]


# -- faults: a late peer, a skipped call, a dead peer (at 1 and at 8 tiles per rank) -------------------------
SMALL_FAULT, LARGE_FAULT = {"M": 32, "N": 16, "K": 32}, {"M": 128, "N": 128, "K": 32}
FAULT_PLAN = fault_plan(SMALL_FAULT, "float32", (("push_last", tiny(PARTIAL="fp32")),
                                                 ("push_reducer", tiny(PARTIAL="out", FLAG="row_block", COMM_SMS=2)),
                                                 ("mm_ring", {"CHUNKS": 2})))
FAULT_PLAN.append(("push_last", LARGE_FAULT, "float32", tiny(BLOCK_M=32, BLOCK_N=32, PARTIAL="fp32"), "dead_peer"))


@pytest.fixture(scope="module")
def two_ranks() -> tuple[list, list[list[dict]]]:
    """(run_cases results per rank, [scenario][rank] -> what the rank saw in harness.fault_run)."""
    return cases_and_faults(2, OP, CPU_CASES, 2, FAULT_PLAN, timeout_s=900)


def test_two_ranks_every_variant_dtype_and_odd_shapes(two_ranks):
    harness.assert_ok(two_ranks[0])


def test_four_ranks():
    harness.assert_ok(spawn(harness.run_cases, 4, OP, CPU4_CASES, 1, timeout_s=600))


GPU_PARTS = 4  # the case table in parts: each compiles its own kernels on a cold cache (minutes), so each
               # part stays inside pytest's time limit and a slow or stuck case is narrowed to a part


@harness.gpu()
@pytest.mark.parametrize("part", range(GPU_PARTS))
def test_gpu_cases_eager_and_graph_replay(part):
    cases = GPU_CASES[part::GPU_PARTS]
    results = spawn(harness.gpu_cases, harness.gpu_world(), OP, cases, device_kind="cuda", timeout_s=580)
    harness.assert_ok(results)
    assert len(results[0]) == len(cases)


@harness.gpu()
def test_gpu_faults():
    check_faults_on_gpus(OP, fault_plan(MID, "bfloat16", (
        ("push_last", {**MID_TILE, "PARTIAL": "out"}),
        ("push_reducer", {**MID_TILE, "PARTIAL": "fp32", "FLAG": "tile", "COMM_SMS": 8}),
        ("mm_ring", {"CHUNKS": 2}))))


@harness.gpu()
@pytest.mark.timeout(900)
def test_gpu_faults_late_peer_at_sizes_that_hung():
    """scripts/diag_fault_hang.py at harness.gpu_world() ranks: a late peer in push_last / push_reducer
    at M=1000 N=8192 K=14336 (more tiles than SMs), where the survivor used to hang (docs/results/faults.md):
    every rank's call must raise within the budget + 5 s, none hang (the script stops a hung job)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "diag_fault_hang.py"
    proc = subprocess.run([sys.executable, str(script), "--world", str(harness.gpu_world())], capture_output=True,
                          text=True, timeout=840)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, f"diag_fault_hang.py rc={proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "diag_fault_hang.py: PASS" in proc.stdout


@pytest.mark.parametrize("i", range(len(FAULT_PLAN) - 1),
                         ids=fault_ids(FAULT_PLAN[:-1]))
def test_fault_raises_on_every_rank_and_never_returns_a_wrong_result(two_ranks, i):
    check_fault(two_ranks[1][i], FAULT_PLAN[i][4])


def test_dead_peer_time_to_fail_does_not_grow_with_the_problem(two_ranks):
    check_dead_peer_time(two_ranks[1], FAULT_PLAN, "push_last", SMALL_FAULT)


# -- validation, configs, sweeps ------------------------------------------------------------------------
def test_problem_of_validates_inputs():
    w = fake_world()
    a, b = torch.randn(8, 6), torch.randn(6, 5)
    p = OP.problem_of(w, a, b)
    assert (p["M"], p["N"], p["K"], p.world, p.dtype) == (8, 5, 12, 2, "float32")
    assert OP.problem_of(w, a, torch.randn(5, 6).t()) == p  # column-major b is fine
    bad = [
        ((torch.randn(7, 6), b), "divisible by the world size"),
        ((a, torch.randn(4, 5)), "must equal b's rows"),
        ((a.to(torch.float16), b), "same dtype"),
        ((a.to(torch.int32), b.to(torch.int32)), "not supported"),
        ((torch.randn(2, 8, 6), b), "2-D"),
        ((torch.randn(8, 12)[:, ::2], b), "dense"),
        ((a, "b"), "torch.Tensor"),
        ((a.to("meta"), b), "device"),
    ]
    for args, msg in bad:
        with pytest.raises(InvalidInput, match=msg):
            OP.problem_of(w, *args)


def test_runner_rejects_mismatched_call():
    w = fake_world()
    p = Problem.make("gemm_rs", "float32", 2, M=8, N=5, K=12)
    runner = OP.variant("bsp").build(w, p, {})
    with pytest.raises(InvalidInput, match="built for"):
        runner(torch.randn(8, 7), torch.randn(7, 5))
    with pytest.raises(InvalidInput, match="out must be"):
        runner(torch.randn(8, 6), torch.randn(6, 5), out=torch.empty(8, 5))


def test_invalid_configs_rejected_before_launch():
    w = fake_world()
    p = Problem.make("gemm_rs", "bfloat16", 2, M=64, N=64, K=64)
    last = tiny(PARTIAL="fp32")
    red = {**last, "FLAG": "tile", "COMM_SMS": 8}
    bad = [
        ("push_last", {**last, "BLOCK_M": 24}, "BLOCK_M=24 must be one of"),
        ("push_last", {**last, "BLOCK_M": 64}, "BLOCK_M=64 is larger than 32 needs"),
        ("push_last", {**last, "num_warps": 3}, "num_warps"),
        ("push_last", {**last, "PARTIAL": "fp8"}, "PARTIAL='fp8' must be one of"),
        ("push_last", {**last, "FLAG": "tile"}, "unknown ['FLAG']"),
        ("push_last", {k: v for k, v in last.items() if k != "GROUP_M"}, "missing ['GROUP_M']"),
        ("push_last", TINY, "missing ['PARTIAL']"),
        ("push_reducer", {**red, "FLAG": "shard"}, "FLAG='shard' must be one of"),
        ("push_reducer", {**red, "COMM_SMS": 0}, "COMM_SMS=0 must be an int"),
        ("push_reducer", {k: v for k, v in red.items() if k != "COMM_SMS"}, "missing ['COMM_SMS']"),
        ("bsp", {"BLOCK_M": 16}, "takes no config"),
        ("mm_ring", {"CHUNKS": 3}, "CHUNKS must be one of"),
        ("mm_ring", {}, "CHUNKS must be one of"),
        ("mm_ring", {"CHUNKS": 2, "PRIORITY": "high"}, "unknown config keys ['PRIORITY']"),
    ]
    for variant, config, msg in bad:
        assert_rejected(w, p, OP.variant(variant), config, msg)
    big = Problem.make("gemm_rs", "float32", 2, M=4096, N=8192, K=14336)
    huge_tiles = {**last, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4}
    assert "shared memory" in OP.variant("push_last").check(big, huge_tiles)
    assert "registers" in OP.variant("push_last").check(big, {**huge_tiles, "BLOCK_M": 256, "BLOCK_K": 32})
    ws_ok = {**last, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 3, "WARP_SPEC": True}
    bf16 = Problem.make("gemm_rs", "bfloat16", 2, M=4096, N=8192, K=14336)
    assert gemm.check(ws_ok, 2048, 8192, 7168, "bfloat16", extra=("PARTIAL",)) is None
    assert "warp specialisation rejects" in OP.variant("push_last").check(bf16, ws_ok)
    huge = Problem.make("gemm_rs", "bfloat16", 2, M=65536, N=65536, K=1024)
    assert "2^31" in OP.variant("push_reducer").check(huge, red)


def test_mm_ring_refuses_problems_below_its_size_floor_which_grows_with_chunks(monkeypatch):
    ring = OP.variant("mm_ring")
    small = Problem.make("gemm_rs", "bfloat16", 2, M=4096, N=4096, K=4096)   # 68.7 GFLOP per rank
    mid = Problem.make("gemm_rs", "bfloat16", 2, M=4096, N=4096, K=28672)    # 481 GFLOP per rank (8B's gate_up dX)
    large = Problem.make("gemm_rs", "bfloat16", 2, M=8192, N=8192, K=28672)  # 1924 GFLOP per rank
    monkeypatch.delenv("AUTOFUSE_RING_MIN_GFLOP")
    why = ring.check(small, {"CHUNKS": 2})
    assert "floor at CHUNKS=2: 300" in why and "AUTOFUSE_RING_MIN_GFLOP=300" in why and ring.defaults(small) == []
    assert [gemm_rs.ring_floor(300, c) for c in gemm_rs.RING_CHUNKS] == [200, 300, 500, 900]
    assert ring.check(mid, {"CHUNKS": 1}) is None and ring.check(mid, {"CHUNKS": 2}) is None
    assert "floor at CHUNKS=4: 500" in ring.check(mid, {"CHUNKS": 4}) and ring.check(mid, {"CHUNKS": 8})
    assert [c["CHUNKS"] for c in ring.defaults(mid)] == [2, 1]
    assert all(ring.check(large, {"CHUNKS": c}) is None for c in gemm_rs.RING_CHUNKS)
    monkeypatch.setenv("AUTOFUSE_RING_MIN_GFLOP", "50")
    assert ring.check(small, {"CHUNKS": 2}) is None and "floor at CHUNKS=8: 150" in ring.check(small, {"CHUNKS": 8})
    monkeypatch.setenv("AUTOFUSE_RING_MIN_GFLOP", "-1")
    with pytest.raises(SettingError, match="AUTOFUSE_RING_MIN_GFLOP"):
        ring.check(small, {"CHUNKS": 2})


def test_mm_ring_refuses_fp8_and_heaps_without_peer_views_and_cuts_rows_in_whole_tiles():
    fp8 = Problem.make("gemm_rs", "float8_e4m3fn", 2, M=256, N=256, K=256, scaling="tensorwise")
    ring = OP.variant("mm_ring")
    assert "cannot accumulate" in ring.check(fp8, {"CHUNKS": 2}) and ring.defaults(fp8) == []
    bf16 = Problem.make("gemm_rs", "bfloat16", 2, M=4096, N=8192, K=14336)
    assert [c["CHUNKS"] for c in ring.defaults(bf16)] == [2, 4, 1]

    class Heap:
        provider = "iris"

    class NoPeers:
        heap = Heap()

    assert "peer-mapped" in ring.refuses(NoPeers(), bf16, {"CHUNKS": 2})
    assert gemm_rs.ring_chunks(2048, 4) == [(0, 512), (512, 1024), (1024, 1536), (1536, 2048)]
    assert gemm_rs.ring_chunks(20, 2) == [(0, 16), (16, 20)]  # whole 16-row tiles, the rest last
    assert gemm_rs.ring_chunks(5, 8) == [(0, 5)] and gemm_rs.ring_chunks(1000, 8)[-1] == (896, 1000)
    for rows in (1, 7, 16, 17, 100, 1000, 4096):
        for chunks in gemm_rs.RING_CHUNKS:
            cut = gemm_rs.ring_chunks(rows, chunks)
            assert cut[0][0] == 0 and cut[-1][1] == rows and len(cut) <= chunks
            assert all(hi > lo and (hi - lo) % 16 == 0 for lo, hi in cut[:-1]) and cut[-1][1] > cut[-1][0]
            assert all(a[1] == b[0] for a, b in zip(cut, cut[1:]))


def test_space_draws_runnable_configs_without_warp_specialisation():
    for p in (Problem.make("gemm_rs", "bfloat16", 2, M=4096, N=8192, K=14336),
              Problem.make("gemm_rs", "float32", 2, M=40, N=40, K=48)):
        for name in ("push_last", "push_reducer"):
            v = OP.variant(name)
            check_space(v, p, lambda config: set(v.keys) <= set(config))


def test_sweeps_defaults_and_features():
    for p, _, configs in check_sweeps(OP, divisible=("M", "K")):
        if p.dtype == "bfloat16":
            assert configs[0]["PARTIAL"] == "out"  # half the NVLink bytes
    assert [p["M"] for p in OP.sweep("gpu", 2)] == [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert {(p["K"], p["N"]) for p in OP.sweep("llama70b", 2)} == {(8192, 8192), (28672, 8192)}
    models = OP.sweep("models", 2)
    assert {p["M"] for p in models} == {512, 2048, 8192}  # prefill chunks
    assert {(p["N"], p["K"]) for p in models} >= {(8192, 8192), (8192, 28672), (4096, 14336), (16384, 53248)}
    assert 8 <= len(OP.sweep("default", 2)) <= 12
    assert OP.variant("torch_symm").available(fake_world()) is False
    assert {v.family for v in OP.variants.values()} == {"bsp", "peer", "hybrid", "fused"}
    big = OP.variant("push_last").defaults(Problem.make("gemm_rs", "bfloat16", 2, M=8192, N=8192, K=14336))[0]
    assert (big["BLOCK_M"], big["BLOCK_N"], big["TMA"], big["SPLIT_K"]) == (128, 256, True, 1)


# -- sm_90 -----------------------------------------------------------------------------------------------
MOD = "autofuse.kernels.gemm_rs"
SIG = {"a": "*bf16", "b": "*bf16", "out": "*bf16", "scale_a": "*fp32", "scale_b": "*fp32", "inbox": "*bf16", "inbox_half": "i64", "flags": "*i32",
       "half_flags": "i32", "sk_partials": "*fp32", "sk_counts": "*i32", "ctx": CTX, "M_r": "i32", "N": "i32",
       "K_r": "i32", "stride_am": "i32", "stride_ak": "constexpr", "stride_bk": "i32", "stride_bn": "constexpr",
       "stride_om": "i32", "stride_on": "constexpr", "gemm_programs": "i32"}
DIVISIBLE = ("a", "b", "out", "inbox", "flags", "sk_partials", "sk_counts", "N", "K_r", "stride_am", "stride_bk",
             "stride_om")
BASE = {"stride_ak": 1, "stride_bn": 1, "stride_on": 1, "WORLD": 2, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64,
        "GROUP_M": 8, "NUM_STAGES": 3, "SPLIT_K": 1, "SWAP_AB": False, "USE_TMA": True, "PUSH_ALL": False,
        "ROW_BLOCK": False, "RED_M": 16, "B_T": False, "SCALE": 0}
COMPILES = {  # name: (constexpr changes, inbox dtype, num_warps)
    "push_last_tma": ({}, "bf16", 8),
    "push_last_swap_split": ({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "NUM_STAGES": 4, "SPLIT_K": 4,
                              "SWAP_AB": True}, "fp32", 4),
    "push_reducer_tile_w4": ({"PUSH_ALL": True, "WORLD": 4}, "bf16", 8),
    "push_reducer_row_ptr": ({"PUSH_ALL": True, "ROW_BLOCK": True, "USE_TMA": False, "BLOCK_N": 128,
                              "NUM_STAGES": 4, "RED_M": 32}, "fp32", 8),
    # FP8 (B stored N x K, scales on each partial before it is pushed): e4m3 wgmma
    "fp8_push_last_rowwise": ({"B_T": True, "SCALE": 2, "BLOCK_K": 128}, "bf16", 8),
    "fp8_push_reducer_tensor": ({"B_T": True, "SCALE": 1, "PUSH_ALL": True, "BLOCK_K": 128}, "fp32", 8),
    "push_last_deep": ({"BLOCK_N": 128, "NUM_STAGES": 5}, "bf16", 8),  # gemm.defaults' deep tile, fused: 8 warps
}


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compile_table(MOD, "gemm_rs_kernel", BASE, SIG, COMPILES, DIVISIBLE)


# Spills Triton 3.6's ptxas reported for rows of COMPILES on 2026-11-26 (spill-store bytes): the 128x256
# tile on 8 warps holds 128 accumulator registers a thread beside the push state. Known, not yet
# measured for speed; the test keeps them from growing and every other row at zero.
KNOWN_SPILLS = {"push_last_tma": 88, "fp8_push_last_rowwise": 280}


RING = "autofuse.kernels.ring"


def test_ring_kernels_compile_for_sm90_with_bounded_waits():
    """kernels/ring.py (mm_ring's flags): the waits poll and are bounded in time, and no barrier sits in a
    per-thread branch (the copy engine raises the flags: no kernel to check)."""
    flags = {"ctx": CTX, "flags": "*i32"}
    reqs = [compile_request(RING, "begin_kernel", flags, num_warps=4, num_stages=1, name="begin"),
            compile_request(RING, "wait_kernel", {**flags, "word": "i32"}, num_warps=4, num_stages=1, name="wait"),
            compile_request(RING, "finish_kernel", {**flags, "out": "*bf16", "numel": "i32", "BLOCK": "constexpr"},
                            {"BLOCK": 1024}, num_warps=4, num_stages=1, divisible=["out"], name="finish")]
    kernels = compile_sm90_many(reqs)
    for name, k in kernels.items():
        assert_uniform(k, name)
    for name in ("begin", "wait"):
        assert "ld.volatile.global" in kernels[name]["ptx"] and "%globaltimer" in kernels[name]["ptx"], name
    assert "%globaltimer" not in kernels["finish"]["ptx"]  # it never waits


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
        assert "f32.e4m3.e4m3" in ptx, "no FP8 wgmma"
    if consts["ROW_BLOCK"]:
        assert "red.global.sys.release.add" in ptx or "atom.global.sys.release.add" in ptx, "no arrival count"
    else:
        assert "atom.global.sys.release.exch.b32" in ptx, "no epoch flag raised with a sys-scope release"
