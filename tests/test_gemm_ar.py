"""gemm_ar on the CPU emulation (2 and 4 ranks, Triton's interpreter) and compiled for sm_90.

Repeated calls of every variant into NaN-poisoned outputs, compared with the float64 reference at
`OP.tolerance(problem)` (the gemm_rs bound: float32 dots of the dtype-rounded inputs, at most one
rounding per partial and the final rounding, ~2u against 4u * max(1, sqrt(log2 K / 8)) allowed).
The fused variants sum in rank order, so every rank must return bitwise the same matrix.
"""
from __future__ import annotations

import math

import pytest
import torch

from autofuse import status
from autofuse.op import InvalidConfig, InvalidInput, Problem, rel_error
from autofuse.ops import gemm_ar, gemm_rs
from autofuse.world import World, spawn
from conftest import compile_sm90

OP = gemm_ar.OP
TINY = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}
FUSED = [
    ("one_shot", {**TINY, "PARTIAL": "fp32"}),
    ("one_shot", {**TINY, "BLOCK_N": 32, "GROUP_M": 1, "PARTIAL": "out"}),
    ("two_shot", {**TINY, "PARTIAL": "out"}),
    ("two_shot", {**TINY, "BLOCK_M": 32, "GROUP_M": 1, "PARTIAL": "fp32"}),
]
CALLS = 5


def _run_cases(world, cases, calls):
    """Each case `calls` times with new inputs, then one more round with the cases interleaved.

    Returns per case (name, worst rel error, tolerance, checksum of the last output bytes).
    """
    built = []
    for variant, dims, dtype, config in cases:
        problem = Problem.make("gemm_ar", dtype, world.size, **dims)
        built.append((f"{variant} {config} {problem}", problem, OP.variant(variant).build(world, problem, config)))
    worst = {name: 0.0 for name, _, _ in built}
    last = {}

    def call(name, problem, runner, seed):
        a, b = OP.inputs(world, problem, seed)
        out = torch.full((problem["M"], problem["N"]), math.nan, dtype=problem.torch_dtype)
        assert runner(a, b, out=out) is out
        status.check(world.heap, "gemm_ar")
        worst[name] = max(worst[name], rel_error(out, OP.reference(world, problem, seed)))
        last[name] = out.view(torch.uint8 if out.element_size() == 1 else torch.int16).to(torch.int64).sum().item()

    for name, problem, runner in built:
        for seed in range(calls):
            call(name, problem, runner, seed)
    for name, problem, runner in built:
        call(name, problem, runner, 100)
    return [(name, worst[name], OP.tolerance(problem), last[name]) for name, problem, _ in built]


def _assert_ok(results):
    for rank, rows in enumerate(results):
        bad = [(name, err, tol) for name, err, tol, _ in rows if not err <= tol]
        assert not bad, f"rank {rank}: outside tolerance: {bad}"
    for i, (name, *_rest) in enumerate(results[0]):
        if not name.startswith("bsp"):
            sums = [rows[i][3] for rows in results]
            assert len(set(sums)) == 1, f"{name}: ranks returned different bits ({sums})"


def test_two_ranks_every_variant_dtype_and_odd_shapes():
    odd = {"M": 20, "N": 40, "K": 48}   # M, N and K/W not multiples of the blocks
    small = {"M": 3, "N": 24, "K": 16}
    cases = [("bsp", odd, dt, {}) for dt in ("bfloat16", "float16", "float32")] + [("bsp", small, "float32", {})]
    for i, (variant, config) in enumerate(FUSED):
        cases += [(variant, odd, dt, config) for dt in ("bfloat16", "float16", "float32")]
        cases.append((variant, small, ("bfloat16", "float32")[i % 2], {**config, "BLOCK_M": 16}))
    _assert_ok(spawn(_run_cases, 2, cases, CALLS, timeout_s=400))


def test_four_ranks_fused_variants():
    dims = {"M": 5, "N": 24, "K": 32}
    cases = [("bsp", dims, "bfloat16", {})] + [(v, dims, dt, {**c, "BLOCK_M": 16}) for (v, c), dt in
                                               zip(FUSED, ("bfloat16", "float32", "float16", "bfloat16"))]
    _assert_ok(spawn(_run_cases, 4, cases, CALLS, timeout_s=400))


def _fake_world(size=2):
    return World(rank=0, size=size, device=torch.device("cpu"), backend="gloo")


def test_problem_of_and_runner_validate_inputs():
    w = _fake_world()
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


def test_invalid_configs_rejected_before_launch():
    w = _fake_world()
    p = Problem.make("gemm_ar", "float16", 2, M=32, N=64, K=64)
    good = {**TINY, "PARTIAL": "fp32"}
    for variant in ("one_shot", "two_shot"):
        v = OP.variant(variant)
        assert v.check(p, good) is None
        for config, msg in [({**good, "BLOCK_N": 48}, "BLOCK_N"), ({**good, "BLOCK_M": 64}, "exceeds"),
                            ({**good, "FLAG_GRAN": "tile"}, "unknown"), ({**good, "num_stages": 0}, "num_stages"),
                            ({**good, "GROUP_M": 0}, "GROUP_M")]:
            assert msg in (v.check(p, config) or ""), (variant, config)
            with pytest.raises(InvalidConfig, match=msg):
                v.build(w, p, config)
    with pytest.raises(InvalidConfig, match="no config"):
        OP.variant("bsp").build(w, p, good)


def test_sweeps_defaults_and_features():
    for kind in ("cpu", "gpu", "llama70b"):
        for world in (2, 8):
            for p in OP.sweep(kind, world):
                assert p.op == "gemm_ar" and p["K"] % world == 0
                for name in ("one_shot", "two_shot"):
                    for config in OP.variant(name).defaults(p):
                        assert OP.variant(name).check(p, config) is None, (name, p, config)
                assert all(math.isfinite(v) for v in OP.features(p).values())
    assert [p["M"] for p in OP.sweep("gpu", 2)] == [128, 256, 512, 1024, 2048, 4096, 8192, 16384]


SIG = {"a": "*bf16", "b": "*bf16", "out": "*bf16", "inbox": "*fp32", "inbox_half": "i64", "counters": "*i32",
       "counter_half": "i32", "epoch_ptr": "*i32", "status": "*i32", "heap_bases": "*i64", "rank": "i32",
       "M": "i32", "N": "i32", "K_r": "i32", "stride_am": "i32", "stride_ak": "constexpr", "stride_bk": "i32",
       "stride_bn": "constexpr", "stride_om": "i32", "stride_on": "constexpr", "spin_limit": "i32",
       "WORLD": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
       "GROUP_M": "constexpr", "EVEN_K": "constexpr"}
META = {"stride_ak": 1, "stride_bn": 1, "stride_on": 1, "WORLD": 2, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64,
        "GROUP_M": 8, "EVEN_K": True}


def _assert_sync_instructions(ptx):
    assert "red.global.sys.release.add" in ptx or "atom.global.sys.release.add" in ptx, "no release signal"
    assert "ld.volatile.global" in ptx and "bar.sync" in ptx and "mma" in ptx


def test_one_shot_compiles_for_sm90():
    res = compile_sm90("autofuse.kernels.gemm_ar", "gemm_ar_one_shot_kernel", SIG, {**META, "WORLD": 4},
                       num_warps=8, num_stages=3)
    _assert_sync_instructions(res["ptx"])
    assert res["shared"] <= gemm_rs.SMEM_LIMIT


def test_two_shot_compiles_for_sm90():
    sig = {**SIG, "inbox": "*bf16", "gathered": "*bf16", "gathered_half": "i64", "flags": "*i32"}
    sig = {k: sig[k] for k in ["a", "b", "out", "inbox", "inbox_half", "gathered", "gathered_half", "counters",
                               "flags", "counter_half", "epoch_ptr"] + [k for k in SIG if k not in
                               ("a", "b", "out", "inbox", "inbox_half", "counters", "counter_half", "epoch_ptr")]}
    res = compile_sm90("autofuse.kernels.gemm_ar", "gemm_ar_two_shot_kernel", sig, META, num_warps=8, num_stages=3)
    _assert_sync_instructions(res["ptx"])
    assert res["shared"] <= gemm_rs.SMEM_LIMIT
