"""FP8 (float8_e4m3fn, tensorwise and row-wise scales, bfloat16 out) in the GEMM ops.

CPU (Triton's interpreter, 2 and 4 ranks): gemm_ar and gemm_rs, bsp (torch._scaled_mm + the
collective on the bfloat16 result) and every fused variant, against the float64 product of each
rank's FP8 values times its scales, summed over ranks (rp.full_product); the fused ones bitwise
equal across ranks where they sum in rank order. The public call with scales through dispatch.
Clear errors: e5m2, missing or misshapen scales, b not stored N x K, scales on bf16, and the
variants that do not run FP8 yet (ag_gemm, the hybrids, torch_symm).

GPU (`pytest -m gpu tests/test_fp8_ops.py`, world 2 on one GPU, two ranks per GPU where the
machine has one GPU): the same variants at model sizes, eager and under CUDA-graph replay.
"""
from __future__ import annotations

import os

import pytest
import torch

import harness
from _row_parallel import tiny
from autofuse.comm.world import spawn
from autofuse.core.op import FP8, InvalidConfig, InvalidInput, Problem
from autofuse.ops import gemm_ar, gemm_rs
from autofuse.ops import row_parallel as rp

FP8_TINY = {"BLOCK_K": 32}  # an FP8 dot takes K in steps of 32
ODD = {"M": 20, "N": 48, "K": 64}    # M not a multiple of the blocks; K/W = 32
CPU_CASES = {
    "gemm_ar": [
        ("bsp", {**ODD, "scaling": "tensorwise"}, FP8, {}),
        ("bsp", {**ODD, "scaling": "rowwise"}, FP8, {}),
        ("one_shot", {**ODD, "scaling": "rowwise"}, FP8, tiny(**FP8_TINY, PARTIAL="fp32")),
        ("one_shot", {**ODD, "scaling": "tensorwise"}, FP8, tiny(**FP8_TINY, PARTIAL="out", SWAP_AB=True, SPLIT_K=1)),
        ("two_shot", {**ODD, "scaling": "rowwise"}, FP8, tiny(**FP8_TINY, PARTIAL="out", TMA=False)),
        ("two_shot", {**ODD, "scaling": "tensorwise"}, FP8, tiny(**FP8_TINY, BLOCK_N=32, PARTIAL="fp32")),
    ],
    "gemm_rs": [
        ("bsp", {**ODD, "scaling": "rowwise"}, FP8, {}),
        ("push_last", {**ODD, "scaling": "rowwise"}, FP8, tiny(**FP8_TINY, PARTIAL="out")),
        ("push_last", {**ODD, "scaling": "tensorwise"}, FP8, tiny(**FP8_TINY, PARTIAL="fp32", TMA=False)),
        ("push_reducer", {**ODD, "scaling": "rowwise"}, FP8,
         tiny(**FP8_TINY, PARTIAL="out", FLAG="tile", COMM_SMS=2)),
        ("push_reducer", {**ODD, "scaling": "tensorwise"}, FP8,
         tiny(**FP8_TINY, PARTIAL="fp32", FLAG="row_block", COMM_SMS=1)),
    ],
}
OPS = {"gemm_ar": gemm_ar.OP, "gemm_rs": gemm_rs.OP}
SAME_BITS = ("one_shot", "two_shot")  # gemm_ar's fused variants sum in rank order on every rank


def _cases(world) -> dict:
    return {name: harness.run_cases(world, OPS[name], cases, calls=2) for name, cases in CPU_CASES.items()}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(_cases, 2, device_kind="cpu", timeout_s=900)


@pytest.mark.parametrize("op", list(CPU_CASES))
def test_two_ranks_fp8_variants_match_float64(two_ranks, op):
    harness.assert_ok([rank[op] for rank in two_ranks], same_bits=SAME_BITS)


def _four(world) -> list:
    dims = {"M": 8, "N": 32, "K": 128, "scaling": "rowwise"}
    return harness.run_cases(world, gemm_rs.OP, [("push_last", dims, FP8, tiny(**FP8_TINY, PARTIAL="out")),
                                                 ("bsp", dims, FP8, {})], calls=1) + \
        harness.run_cases(world, gemm_ar.OP, [("two_shot", dims, FP8, tiny(**FP8_TINY, PARTIAL="out"))], calls=1)


def test_four_ranks_fp8():
    harness.assert_ok(spawn(_four, 4, device_kind="cpu", timeout_s=900), same_bits=SAME_BITS)


def _public_call(world) -> dict:
    """autofuse's dispatch with FP8 inputs and scales (a, b, scale_a, scale_b), forced variants too."""
    from autofuse import dispatch

    out = {}
    for scaling in ("tensorwise", "rowwise"):
        problem = Problem.make("gemm_ar", FP8, world.size, M=6, N=32, K=64, scaling=scaling)
        inputs = gemm_ar.OP.inputs(world, problem, 3)
        ref = gemm_ar.OP.reference(world, problem, 3)
        for variant in (None, "one_shot"):
            config = tiny(**FP8_TINY, PARTIAL="fp32") if variant else None
            c = dispatch.call("gemm_ar", *inputs, group=world, variant=variant, config=config)
            out[(scaling, variant)] = (c.dtype == torch.bfloat16, float((c.double() - ref).norm() / ref.norm()))
    return out


def test_public_call_with_scales_through_dispatch():
    for rank in spawn(_public_call, 2, device_kind="cpu", timeout_s=600):
        for key, (bf16, err) in rank.items():
            assert bf16 and err <= 2 ** -6, (key, err)


# -- clear errors --------------------------------------------------------------------------------------
class _World:
    size, rank, device = 2, 0, torch.device("cpu")


def _fp8(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(m, k).to(torch.float8_e4m3fn), torch.randn(n, k).to(torch.float8_e4m3fn).t()


@pytest.mark.parametrize("op", [gemm_ar.OP, gemm_rs.OP])
def test_problem_of_rejects_bad_fp8_calls_with_a_reason(op):
    w = _World()
    a, b = _fp8(8, 32, 16)
    one = torch.tensor(1.0)
    p = op.problem_of(w, a, b, one, one)
    assert p.dtype == FP8 and p["scaling"] == "tensorwise" and p.out_dtype == torch.bfloat16
    assert op.problem_of(w, a, b, torch.ones(8, 1), torch.ones(1, 32))["scaling"] == "rowwise"
    assert "scaling" not in dict(op.problem_of(w, a.bfloat16(), b.bfloat16()).dims)  # bf16 keys unchanged
    bad = [
        ((a.to(torch.float8_e5m2), b.to(torch.float8_e5m2), one, one), "float8_e5m2"),
        ((a, b), "need scale_a and scale_b"),
        ((a, b, one, None), "need scale_a and scale_b"),
        ((a, b, torch.ones(1), torch.ones(1)), "0-dim"),
        ((a, b, torch.ones(8, 1), one), "neither tensorwise"),
        ((a, b, one.half(), one), "float32"),
        ((a, b.contiguous(), one, one), "stored N x K"),
        ((a.bfloat16(), b.bfloat16(), one, one), "for float8_e4m3fn"),
    ]
    for args, reason in bad:
        with pytest.raises(InvalidInput, match=reason):
            op.problem_of(w, *args)


def test_what_does_not_run_fp8_says_so():
    from autofuse.ops import ag_gemm

    w = _World()
    a, b = _fp8(8, 32, 16)
    with pytest.raises(InvalidInput, match="FP8"):
        ag_gemm.OP.problem_of(w, a, b.t().contiguous())
    for op, names in ((gemm_ar.OP, ("mm_heap",)), (gemm_rs.OP, ("mm_heap", "mm_heap_overlap", "torch_symm"))):
        p = Problem.make(op.name, FP8, 2, M=16, N=32, K=64, scaling="rowwise")
        for name in names:
            v = op.variant(name)
            why = v.check(p, (v.defaults(p) or [{}])[0])
            assert why and "FP8" in why, (name, why)
            if v.family == "hybrid":  # torch_symm is not available on CPU at all (it says so first)
                with pytest.raises(InvalidConfig, match="FP8"):
                    v.build(type("W", (), {"size": 2, "device": torch.device("cpu")})(), p, {})


def test_fp8_sweeps_defaults_and_features():
    for op in OPS.values():
        problems = op.sweep("fp8", 2)
        assert problems and {p["scaling"] for p in problems} == {"tensorwise", "rowwise"}
        assert {(p["M"], p["N"], p["K"]) for p in problems} == {(p["M"], p["N"], p["K"]) for p in op.sweep("default", 2)}
        for p in problems + op.sweep("fp8-cpu", 2):
            feats = {**op.features(p)}
            assert all(v == v for v in feats.values())
            for v in op.variants.values():
                if v.family == "fused":
                    configs = v.defaults(p)
                    assert configs and all(v.check(p, c) is None and c["BLOCK_K"] >= 32 for c in configs), (v, p)
                    assert configs[0]["PARTIAL"] == "out"  # the bfloat16 output: half the bytes of float32
    bf16 = Problem.make("gemm_rs", "bfloat16", 2, M=1024, N=8192, K=8192)
    fp8 = Problem.make("gemm_rs", FP8, 2, M=1024, N=8192, K=8192, scaling="rowwise")
    assert fp8.key != bf16.key and fp8 != Problem.make("gemm_rs", FP8, 2, M=1024, N=8192, K=8192, scaling="tensorwise")
    from autofuse.core.features import problem_features

    f = problem_features(fp8, gemm_rs.OP)
    assert f["dtype_bytes"] == 1.0 and f["scaling=rowwise"] == 1.0
    assert f["log2_comm_bytes"] == problem_features(bf16, gemm_rs.OP)["log2_comm_bytes"]  # bf16 partials move


# -- GPU: world 2 on one GPU (several ranks per GPU) or two -------------------------------------------
GPU_DIMS = [{"M": 128, "N": 8192, "K": 8192}, {"M": 1024, "N": 8192, "K": 14336}, {"M": 96, "N": 3000, "K": 4096}]
GPU_CASES = {
    "gemm_ar": [(v, {**d, "scaling": s}, FP8, c) for d in GPU_DIMS[:1] + GPU_DIMS[2:] for s in rp.SCALINGS
                for v in ("bsp", "one_shot", "two_shot")
                for c in (gemm_ar.OP.variant(v).defaults(Problem.make("gemm_ar", FP8, 2, **d, scaling=s))[:1])],
    "gemm_rs": [(v, {**d, "scaling": s}, FP8, c) for d in GPU_DIMS[1:] for s in rp.SCALINGS
                for v in ("bsp", "push_last", "push_reducer")
                for c in (gemm_rs.OP.variant(v).defaults(Problem.make("gemm_rs", FP8, 2, **d, scaling=s))[:1])],
}


TWO_RANKS = harness.gpus() >= 2 or (harness.gpus() == 1 and int(os.environ.get("AUTOFUSE_RANKS_PER_GPU", "1")) >= 2)


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_RANKS, reason="needs 2 CUDA GPUs, or 1 with AUTOFUSE_RANKS_PER_GPU=2")
@pytest.mark.parametrize("op", list(GPU_CASES))
def test_gpu_fp8_variants_eager_and_graph_replay(op):
    """Two ranks (on one GPU when the machine has one: AUTOFUSE_RANKS_PER_GPU, see README), every
    FP8-capable variant at its first default, eager calls and CUDA-graph replays with new inputs."""
    results = spawn(harness.run_cases, 2, OPS[op], GPU_CASES[op], 2, device_kind="cuda", timeout_s=900)
    harness.assert_ok(results, same_bits=SAME_BITS)
