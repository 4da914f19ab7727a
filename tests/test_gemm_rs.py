"""gemm_rs on the CPU emulation (2 and 4 ranks, Triton's interpreter) and compiled for sm_90.

Every variant runs repeated calls (parity buffers, counters reset by their reader) into NaN-poisoned
outputs and is compared with the float64 reference at `OP.tolerance(problem)`: float32 dots
(exact products of the dtype-rounded inputs), at most one rounding of each partial to the dtype
and the final rounding, so ~2 units of roundoff against 4u * max(1, sqrt(log2 K / 8)) allowed
(gemm_rs.tolerance has the derivation). Calls of different variants and problems are
interleaved on one shared workspace, as the tuner does.
"""
from __future__ import annotations

import math

import pytest
import torch

from autofuse import status
from autofuse.op import InvalidConfig, InvalidInput, Problem, rel_error
from autofuse.ops import gemm_rs
from autofuse.world import World, spawn
from conftest import compile_sm90

OP = gemm_rs.OP
TINY = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}
FUSED = [
    ("push_last", {**TINY, "PARTIAL": "out"}),
    ("push_last", {**TINY, "BLOCK_N": 32, "GROUP_M": 1, "PARTIAL": "fp32"}),
    ("push_reducer", {**TINY, "PARTIAL": "fp32", "FLAG_GRAN": "tile", "REDUCERS": 2}),
    ("push_reducer", {**TINY, "BLOCK_M": 32, "PARTIAL": "out", "FLAG_GRAN": "row_block", "REDUCERS": 8}),
]
CALLS = 5


def _run_cases(world, cases, calls, interleave):
    """Build every case, call each `calls` times (new inputs each call), then interleave them.

    Returns (case name, worst rel error, tolerance) per case, checked on every rank by the test.
    """
    built = []
    for variant, dims, dtype, config in cases:
        problem = Problem.make("gemm_rs", dtype, world.size, **dims)
        built.append((f"{variant} {config} {problem}", problem, OP.variant(variant).build(world, problem, config)))
    worst = {name: 0.0 for name, _, _ in built}

    def call(name, problem, runner, seed):
        a, b = OP.inputs(world, problem, seed)
        out = torch.full((problem["M"] // world.size, problem["N"]), math.nan, dtype=problem.torch_dtype)
        got = runner(a, b, out=out)
        status.check(world.heap, "gemm_rs")
        assert got is out
        worst[name] = max(worst[name], rel_error(out, OP.reference(world, problem, seed)))

    for name, problem, runner in built:
        for seed in range(calls):
            call(name, problem, runner, seed)
    for seed in range(interleave):  # consecutive calls of different problems/variants on one workspace
        for name, problem, runner in built:
            call(name, problem, runner, 100 + seed)
    return [(name, worst[name], OP.tolerance(problem)) for name, problem, _ in built]


def _assert_within(results):
    for rank, rows in enumerate(results):
        bad = [(name, err, tol) for name, err, tol in rows if not err <= tol]
        assert not bad, f"rank {rank}: outside tolerance: {bad}"


def test_two_ranks_every_variant_dtype_and_odd_shapes():
    odd = {"M": 40, "N": 40, "K": 48}    # 20 rows per rank, N and K/W not multiples of the blocks
    small = {"M": 2, "N": 24, "K": 16}   # one row per rank
    cases = [("bsp", odd, dt, {}) for dt in ("bfloat16", "float16", "float32")] + [("bsp", small, "float32", {})]
    for i, (variant, config) in enumerate(FUSED):
        cases += [(variant, odd, dt, config) for dt in ("bfloat16", "float16", "float32")]
        cases.append((variant, small, ("bfloat16", "float32")[i % 2], {**config, "BLOCK_M": 16}))
    _assert_within(spawn(_run_cases, 2, cases, CALLS, 1, timeout_s=400))


def test_four_ranks_fused_variants():
    dims = {"M": 20, "N": 24, "K": 32}  # 5 rows per rank
    cases = [("bsp", dims, "bfloat16", {})] + [(v, dims, dt, {**c, "BLOCK_M": 16}) for (v, c), dt in
                                               zip(FUSED, ("bfloat16", "float32", "float16", "bfloat16"))]
    _assert_within(spawn(_run_cases, 4, cases, CALLS, 1, timeout_s=400))


def _fake_world(size=2):
    return World(rank=0, size=size, device=torch.device("cpu"), backend="gloo")


def test_problem_of_validates_inputs():
    w = _fake_world()
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
    w = _fake_world()
    p = Problem.make("gemm_rs", "float32", 2, M=8, N=5, K=12)
    runner = OP.variant("bsp").build(w, p, {})
    with pytest.raises(InvalidInput, match="built for"):
        runner(torch.randn(8, 7), torch.randn(7, 5))
    with pytest.raises(InvalidInput, match="out must be"):
        runner(torch.randn(8, 6), torch.randn(6, 5), out=torch.empty(8, 5))


def test_invalid_configs_rejected_before_launch():
    w = _fake_world()
    p = Problem.make("gemm_rs", "bfloat16", 2, M=64, N=64, K=64)
    last = {**TINY, "PARTIAL": "fp32"}
    red = {**last, "FLAG_GRAN": "tile", "REDUCERS": 8}
    bad = [
        ("push_last", {**last, "BLOCK_M": 24}, "BLOCK_M"),
        ("push_last", {**last, "BLOCK_M": 64}, "exceeds the problem"),
        ("push_last", {**last, "num_warps": 3}, "num_warps"),
        ("push_last", {**last, "PARTIAL": "fp8"}, "PARTIAL"),
        ("push_last", {**last, "FLAG_GRAN": "tile"}, "unknown"),
        ("push_last", {k: v for k, v in last.items() if k != "GROUP_M"}, "missing"),
        ("push_reducer", {**red, "FLAG_GRAN": "shard"}, "FLAG_GRAN"),
        ("push_reducer", {**red, "REDUCERS": 0}, "REDUCERS"),
        ("bsp", {"BLOCK_M": 16}, "no config"),
    ]
    for variant, config, msg in bad:
        v = OP.variant(variant)
        assert msg in (v.check(p, config) or ""), (variant, config, v.check(p, config))
        with pytest.raises(InvalidConfig, match=msg):
            v.build(w, p, config)  # raises before touching the heap or launching
    big = Problem.make("gemm_rs", "float32", 2, M=4096, N=8192, K=14336)
    assert "shared memory" in OP.variant("push_last").check(big, {**last, "BLOCK_M": 256, "BLOCK_N": 256,
                                                                  "BLOCK_K": 128, "num_warps": 8, "num_stages": 4})
    assert "registers" in OP.variant("push_last").check(big, {**last, "BLOCK_M": 256, "BLOCK_N": 256,
                                                              "BLOCK_K": 32, "num_warps": 4})
    huge = Problem.make("gemm_rs", "bfloat16", 2, M=65536, N=65536, K=1024)
    assert "int32" in OP.variant("push_reducer").check(huge, red)


def test_sweeps_defaults_and_features():
    for kind in ("cpu", "gpu", "llama70b"):
        for world in (2, 4, 8):
            problems = OP.sweep(kind, world)
            assert problems and all(p.op == "gemm_rs" and p["M"] % world == 0 and p["K"] % world == 0
                                    for p in problems)
            for p in problems:
                for name in ("push_last", "push_reducer"):
                    for config in OP.variant(name).defaults(p):
                        assert OP.variant(name).check(p, config) is None, (name, p, config)
                assert all(math.isfinite(v) for v in OP.features(p).values())
    assert [p["M"] for p in OP.sweep("gpu", 2)] == [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert {(p["K"], p["N"]) for p in OP.sweep("llama70b", 2)} == {(8192, 8192), (28672, 8192)}
    assert OP.variant("torch_symm").available(_fake_world()) is False


SIG = {"a": "*bf16", "b": "*bf16", "out": "*bf16", "inbox": "*fp32", "inbox_half": "i64", "counters": "*i32",
       "counter_half": "i32", "epoch_ptr": "*i32", "status": "*i32", "heap_bases": "*i64", "rank": "i32",
       "M_r": "i32", "N": "i32", "K_r": "i32", "stride_am": "i32", "stride_ak": "constexpr", "stride_bk": "i32",
       "stride_bn": "constexpr", "stride_om": "i32", "stride_on": "constexpr", "spin_limit": "i32",
       "WORLD": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
       "GROUP_M": "constexpr", "EVEN_K": "constexpr"}
META = {"stride_ak": 1, "stride_bn": 1, "stride_on": 1, "WORLD": 2, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64,
        "GROUP_M": 8, "EVEN_K": True}


def _assert_sync_instructions(ptx):
    assert "red.global.sys.release.add" in ptx or "atom.global.sys.release.add" in ptx, "no release signal"
    assert "ld.volatile.global" in ptx, "no volatile poll"
    assert "bar.sync" in ptx
    assert "mma" in ptx, "the GEMM does not use tensor cores"


def test_push_last_compiles_for_sm90():
    res = compile_sm90("autofuse.kernels.gemm_rs", "gemm_rs_push_last_kernel", SIG, META, num_warps=8, num_stages=3)
    _assert_sync_instructions(res["ptx"])
    assert res["shared"] <= gemm_rs.SMEM_LIMIT


@pytest.mark.parametrize("row_block", [False, True])
def test_push_reducer_compiles_for_sm90(row_block):
    sig = {**SIG, "inbox": "*bf16", "num_gemm": "i32", "num_reducers": "i32", "ROW_BLOCK": "constexpr",
           "RED_M": "constexpr"}
    res = compile_sm90("autofuse.kernels.gemm_rs", "gemm_rs_push_reducer_kernel", sig,
                       {**META, "WORLD": 4, "ROW_BLOCK": row_block, "RED_M": 16}, num_warps=8, num_stages=3)
    _assert_sync_instructions(res["ptx"])
    assert res["shared"] <= gemm_rs.SMEM_LIMIT
