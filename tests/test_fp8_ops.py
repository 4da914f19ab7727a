"""FP8 (float8_e4m3fn, tensorwise and row-wise scales, bfloat16 out) in the GEMM ops.

CPU (Triton's interpreter, 2 and 4 ranks): gemm_ar and gemm_rs, bsp (torch._scaled_mm + the
collective on the bfloat16 result), the hybrids (the same beside a heap collective) and every
fused variant; ag_gemm's bsp (the FP8 A gathered, row-wise scales with their rows), heap hybrids
(row-wise scales over a heap gather of their own) and fused kernels (pull, push, push_ws, every
layout and FLAG, both scalings: row-wise scales carried with their rows), in both forms (the k
form: scale_a the same on every rank), a fault in the row-wise fused kernel; against the float64
product of each rank's FP8 values times its scales, summed over ranks (rp.full_product); bitwise
equal across ranks where they sum in rank order. The public call `autofuse.gemm_ar(a, b,
group=..., scale_a=..., scale_b=...)` through dispatch. Clear errors: e5m2, missing or misshapen
scales, b not stored N x K, scales on bf16, and what does not run FP8 (ag_gemm's torch_symm in the
k form). The torch_symm (peer) variants of gemm_ar, gemm_rs and ag_gemm: their checks, and their
runners on CPU ranks (2 and 4) with torch's CUDA-only symm_mem ops stood in for (tests/_symm_cpu.py).

GPU (`pytest -m gpu tests/test_fp8_ops.py`, world 2 on one GPU, two ranks per GPU where the
machine has one GPU): the same variants at model sizes (ag_gemm: both forms), eager and under
CUDA-graph replay, with the torch_symm variants of all three (skipped with the reason where ranks
share a GPU: torch's symmetric memory needs a GPU per rank).
"""
from __future__ import annotations

import pytest
import torch

import harness
from _row_parallel import cases_and_faults, default_cases, tiny
from autofuse.comm.world import spawn
from autofuse.core.op import FP8, InvalidInput, Problem
from autofuse.ops import ag_gemm, gemm_ar, gemm_rs
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
        *default_cases(gemm_ar.OP, "mm_heap", {**ODD, "scaling": "rowwise"}, FP8, pick=1),
        *default_cases(gemm_ar.OP, "mm_ll", {**ODD, "scaling": "tensorwise"}, FP8, pick=1),
    ],
    "gemm_rs": [
        ("bsp", {**ODD, "scaling": "rowwise"}, FP8, {}),
        ("push_last", {**ODD, "scaling": "rowwise"}, FP8, tiny(**FP8_TINY, PARTIAL="out")),
        ("push_last", {**ODD, "scaling": "tensorwise"}, FP8, tiny(**FP8_TINY, PARTIAL="fp32", TMA=False)),
        ("push_reducer", {**ODD, "scaling": "rowwise"}, FP8,
         tiny(**FP8_TINY, PARTIAL="out", FLAG="tile", COMM_SMS=2)),
        ("push_reducer", {**ODD, "scaling": "tensorwise"}, FP8,
         tiny(**FP8_TINY, PARTIAL="fp32", FLAG="row_block", COMM_SMS=1)),
        *default_cases(gemm_rs.OP, "mm_heap", {**ODD, "scaling": "tensorwise"}, FP8, pick=1),
        *default_cases(gemm_rs.OP, "mm_heap_overlap", {**ODD, "scaling": "rowwise"}, FP8, pick=slice(0, 3, 2)),
    ],
}
AG = {"M": 24, "N": 32, "K": 64, "gather": "rows"}  # 12 rows a rank: gathered tiles span both shards
AG_ODD = {"M": 24, "N": 48, "K": 96, "gather": "rows", "scaling": "tensorwise"}  # N and K tails of 32- and 64-blocks
AG_T = {**AG, "scaling": "tensorwise"}
AG_R = {**AG, "scaling": "rowwise"}
AG_R_ODD = {**AG_ODD, "scaling": "rowwise"}
AG_R16 = {**AG_R, "M": 32}  # 16 rows a rank: no 16-row tile spans two shards
AG_KT = {"M": 20, "N": 32, "K": 64, "gather": "k", "scaling": "tensorwise"}  # the k form: K/W = 32
AG_KR = {**AG_KT, "scaling": "rowwise"}  # scale_a: M x 1 on every rank alike


def ag_fused(flag: str, layout: str = "shard", comm: int = 2, **changes) -> dict:
    """An ag_gemm fused config for the interpreter: FP8's 32-deep K steps, the op's FLAG/COMM_SMS/LAYOUT."""
    return tiny(**{**FP8_TINY, **changes}, FLAG=flag, COMM_SMS=comm, LAYOUT=layout)


CPU_CASES["ag_gemm"] = [
    ("bsp", AG_T, FP8, {}),
    ("bsp", AG_R, FP8, {}),
    *default_cases(ag_gemm.OP, "heap_mm", AG_T, FP8, pick=1),
    *default_cases(ag_gemm.OP, "heap_mm_overlap", AG_T, FP8, pick=slice(0, 3, 2)),
    # the hybrids with row-wise scales: the scales' own heap gather (overlap: FLAG shard and row_block chunks)
    *default_cases(ag_gemm.OP, "heap_mm", AG_R, FP8, pick=1),
    *default_cases(ag_gemm.OP, "heap_mm_overlap", AG_R, FP8, pick=slice(0, 3, 2)),
    # the fused kernel (tensorwise): every variant, layout and FLAG, TMA and pointer paths, split-K, swap-AB
    ("pull", AG_T, FP8, ag_fused("tile", TMA=False)),
    ("pull", AG_ODD, FP8, ag_fused("shard", comm=1, BLOCK_N=32, BLOCK_K=64, SPLIT_K=2)),
    ("push", AG_T, FP8, ag_fused("row_block", "gathered", SPLIT_K=2)),
    ("push", AG_ODD, FP8, ag_fused("tile", comm=3, BLOCK_N=32, SWAP_AB=True)),
    ("push_ws", AG_T, FP8, ag_fused("shard", "gathered", SWAP_AB=True, TMA=False)),
    ("push_ws", AG_ODD, FP8, ag_fused("row_block", comm=1)),
    *default_cases(ag_gemm.OP, "push", AG_T, FP8, pick=1),
    # the fused kernel with row-wise scales, carried with their rows: every variant, layout and FLAG
    ("pull", AG_R, FP8, ag_fused("tile", TMA=False)),
    ("pull", AG_R_ODD, FP8, ag_fused("row_block", comm=1, BLOCK_N=32, BLOCK_K=64, SPLIT_K=2)),
    ("push", AG_R, FP8, ag_fused("row_block", "gathered", SPLIT_K=2)),
    ("push", AG_R_ODD, FP8, ag_fused("shard", comm=3, BLOCK_N=32, SWAP_AB=True)),
    ("push", AG_R16, FP8, ag_fused("tile", "gathered")),
    ("push_ws", AG_R, FP8, ag_fused("shard", "gathered", SWAP_AB=True, TMA=False)),
    ("push_ws", AG_R_ODD, FP8, ag_fused("tile", comm=1)),
    *default_cases(ag_gemm.OP, "push_ws", AG_R, FP8, pick=1),
    # the k form: bsp, the hybrids and the fused kernels, both scalings (no scales move)
    ("bsp", AG_KT, FP8, {}),
    ("bsp", AG_KR, FP8, {}),
    *default_cases(ag_gemm.OP, "heap_mm", AG_KR, FP8, pick=1),
    *default_cases(ag_gemm.OP, "heap_mm_overlap", AG_KR, FP8, pick=slice(0, 3, 2)),  # FLAG shard, row_block
    *default_cases(ag_gemm.OP, "heap_mm_overlap", AG_KT, FP8, pick=1),
    ("pull", AG_KR, FP8, ag_fused("row_block")),
    ("push", AG_KT, FP8, ag_fused("tile", "gathered", SPLIT_K=2)),
    ("push_ws", AG_KR, FP8, ag_fused("shard", SWAP_AB=True, TMA=False)),
    ("push_ws", AG_KR, FP8, ag_fused("row_block", "gathered")),
]
OPS = {"ag_gemm": ag_gemm.OP, "gemm_ar": gemm_ar.OP, "gemm_rs": gemm_rs.OP}
SAME_BITS = ("one_shot", "two_shot", "mm_heap", "mm_ll")  # gemm_ar's fused and heap all-reduces sum in rank order


def _cases(world) -> dict:
    return {name: harness.run_cases(world, OPS[name], cases, calls=2) for name, cases in CPU_CASES.items()}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(_cases, 2, device_kind="cpu", timeout_s=900)


@pytest.mark.parametrize("op", list(CPU_CASES))
def test_two_ranks_fp8_variants_match_float64(two_ranks, op):
    harness.assert_ok([rank[op] for rank in two_ranks], same_bits=SAME_BITS if op == "gemm_ar" else ())
    assert all(row[1] is not None for rank in two_ranks for row in rank[op])  # no case skipped


def _four(world) -> list:
    dims = {"M": 8, "N": 32, "K": 128, "scaling": "rowwise"}
    ag = {"M": 16, "N": 32, "K": 64, "gather": "rows", "scaling": "tensorwise"}  # 4 rows a rank
    ag_cases = [(v, ag, FP8, ag_fused(flag, layout)) for v, flag, layout in
                (("pull", "row_block", "shard"), ("push", "tile", "gathered"), ("push_ws", "shard", "shard"))]
    ag_rows = {**ag, "scaling": "rowwise"}  # the hybrids' heap gather of the row-wise scales; the fused kernel's
    ag_cases += [(v, ag_rows, FP8, ag_fused(flag, layout)) for v, flag, layout in
                 (("pull", "shard", "shard"), ("push", "row_block", "gathered"), ("push_ws", "tile", "shard"))]
    ag_k = {"M": 8, "N": 32, "K": 128, "gather": "k", "scaling": "rowwise"}  # 32 columns a rank
    ag_cases += [("bsp", ag_k, FP8, {}), ("push", ag_k, FP8, ag_fused("shard", "gathered")),
                 ("pull", {**ag_k, "scaling": "tensorwise"}, FP8, ag_fused("tile")),
                 *default_cases(ag_gemm.OP, "heap_mm_overlap", ag_k, FP8, pick=slice(2, 3), world=4)]
    ag_cases += [c for v, pick in (("heap_mm", 1), ("heap_mm_overlap", slice(2, 3)))
                 for c in default_cases(ag_gemm.OP, v, ag_rows, FP8, pick=pick, world=4)]
    return harness.run_cases(world, gemm_rs.OP, [("push_last", dims, FP8, tiny(**FP8_TINY, PARTIAL="out")),
                                                 ("bsp", dims, FP8, {})], calls=1) + \
        harness.run_cases(world, gemm_ar.OP, [("two_shot", dims, FP8, tiny(**FP8_TINY, PARTIAL="out"))], calls=1) + \
        harness.run_cases(world, ag_gemm.OP, ag_cases, calls=1)


def test_fused_row_wise_faults_raise_on_every_rank():
    """A fault in the fused kernel with row-wise scales (a skipped call; a late peer): every rank
    raises within the wait budget and leaves NaN, never a result scaled by missing scales."""
    plan = [("push", AG_R, FP8, ag_fused("tile", "gathered"), "skipped_call"),
            ("pull", AG_R, FP8, ag_fused("row_block"), "late_peer")]
    _, faults = cases_and_faults(2, ag_gemm.OP, [], 1, plan, device_kind="cpu", timeout_s=600)
    for seen in faults:
        harness.check_fault_run(seen)


def test_four_ranks_fp8():
    results = spawn(_four, 4, device_kind="cpu", timeout_s=900)
    harness.assert_ok(results, same_bits=SAME_BITS)
    assert all(row[1] is not None for rank in results for row in rank)  # no case skipped


def _public_call(world) -> dict:
    """autofuse.gemm_ar / gemm_rs with FP8 inputs and keyword scales (forced fused variants too),
    repeated (the cached hot path), a bf16 call of the same shapes beside them, and missing scales;
    autofuse.ag_gemm with tensorwise scales, dispatched and forced onto its fused push and pull, with
    row-wise scales, dispatched and forced onto its two heap hybrids and fused push and pull, and in
    the k form (row-wise), dispatched and forced onto push_ws."""
    import autofuse
    from autofuse import dispatch

    out = {}
    for op, fused in ((gemm_ar.OP, ("one_shot", tiny(**FP8_TINY, PARTIAL="fp32"))),
                      (gemm_rs.OP, ("push_last", tiny(**FP8_TINY, PARTIAL="out")))):
        entry = getattr(autofuse, op.name)
        for scaling in ("tensorwise", "rowwise"):
            problem = Problem.make(op.name, FP8, world.size, M=6 * world.size, N=32, K=64, scaling=scaling)
            a, b, sa, sb = op.inputs(world, problem, 3)
            ref = op.reference(world, problem, 3)
            for variant, config in ((None, None), fused):
                for _ in range(2):
                    c = entry(a, b, group=world, scale_a=sa, scale_b=sb, variant=variant, config=config)
                    out[(op.name, scaling, variant)] = (c.dtype == torch.bfloat16,
                                                        float((c.double() - ref).norm() / ref.norm()))
            same = dispatch.call(op.name, a, b, sa, sb, group=world)  # call() keys the same way: a cache hit
            out[(op.name, scaling, "call")] = (torch.equal(same, entry(a, b, group=world, scale_a=sa, scale_b=sb)), 0.0)
        bf16 = entry(a.bfloat16(), b.bfloat16(), group=world)
        out[(op.name, "bf16")] = (bf16.dtype == torch.bfloat16, 0.0)
        try:
            entry(a, b, group=world, scale_a=sa)
            out[(op.name, "missing")] = (False, 1.0)
        except InvalidInput as exc:
            out[(op.name, "missing")] = ("need scale_a and scale_b" in str(exc), 0.0)
    problem = Problem.make("ag_gemm", FP8, world.size, M=6 * world.size, N=32, K=64, gather="rows",
                           scaling="tensorwise")
    a, b, sa, sb = ag_gemm.OP.inputs(world, problem, 3)
    ref = ag_gemm.OP.reference(world, problem, 3)
    for variant, config in ((None, None), ("push", ag_fused("tile", "gathered")), ("pull", ag_fused("shard"))):
        c = autofuse.ag_gemm(a, b, group=world, scale_a=sa, scale_b=sb, variant=variant, config=config)
        out[("ag_gemm", variant)] = (c.dtype == torch.bfloat16, float((c.double() - ref).norm() / ref.norm()))
    problem = Problem.make("ag_gemm", FP8, world.size, M=6 * world.size, N=32, K=64, gather="rows", scaling="rowwise")
    a, b, sa, sb = ag_gemm.OP.inputs(world, problem, 3)
    ref = ag_gemm.OP.reference(world, problem, 3)
    for variant, config in ((None, None), ("heap_mm", None), ("heap_mm_overlap", None),
                            ("push", ag_fused("shard", "gathered")), ("pull", ag_fused("row_block"))):
        c = autofuse.ag_gemm(a, b, group=world, scale_a=sa, scale_b=sb, variant=variant, config=config)
        out[("ag_gemm", "rowwise", variant)] = (c.dtype == torch.bfloat16,
                                                float((c.double() - ref).norm() / ref.norm()))
    problem = Problem.make("ag_gemm", FP8, world.size, M=6, N=32, K=64, gather="k", scaling="rowwise")
    a, b, sa, sb = ag_gemm.OP.inputs(world, problem, 3)  # the k form: B has K rows, A_r K/W columns
    ref = ag_gemm.OP.reference(world, problem, 3)
    for variant, config in ((None, None), ("push_ws", ag_fused("tile"))):
        c = autofuse.ag_gemm(a, b, group=world, scale_a=sa, scale_b=sb, variant=variant, config=config)
        out[("ag_gemm", "k", variant)] = (c.dtype == torch.bfloat16, float((c.double() - ref).norm() / ref.norm()))
    return out


def test_public_call_with_keyword_scales():
    for rank in spawn(_public_call, 2, device_kind="cpu", timeout_s=600):
        for key, (ok, err) in rank.items():
            assert ok and err <= 2 ** -6, (key, err)


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
        ((*_fp8(8, 24, 16), one, one), "multiples of 16"),  # torch._scaled_mm's rule on CUDA
    ]
    for args, reason in bad:
        with pytest.raises(InvalidInput, match=reason):
            op.problem_of(w, *args)


def test_ag_gemm_fp8_problems_and_what_does_not_run_fp8_says_so():
    w = _World()
    a, b = _fp8(8, 32, 16)
    one = torch.tensor(1.0)
    p = ag_gemm.OP.problem_of(w, a, b, one, one)
    assert p == Problem.make("ag_gemm", FP8, 2, M=16, N=32, K=16, gather="rows", scaling="tensorwise")
    assert ag_gemm.OP.problem_of(w, a, b, torch.ones(8, 1), torch.ones(1, 32))["scaling"] == "rowwise"
    b_k = torch.randn(32, 32).to(torch.float8_e4m3fn).t()  # B with W x K rows: the k form
    assert ag_gemm.OP.problem_of(w, a, b_k, one, one) == Problem.make("ag_gemm", FP8, 2, M=8, N=32, K=32, gather="k",
                                                                      scaling="tensorwise")
    assert ag_gemm.OP.problem_of(w, a, b_k, torch.ones(8, 1), torch.ones(1, 32))["scaling"] == "rowwise"  # M x 1
    with pytest.raises(InvalidInput, match="neither tensorwise"):  # the k form's scale_a: one per row of A_r
        ag_gemm.OP.problem_of(w, a, b_k, torch.ones(16, 1), torch.ones(1, 32))
    with pytest.raises(InvalidInput, match="stored N x K"):
        ag_gemm.OP.problem_of(w, a, b.contiguous(), one, one)
    with pytest.raises(InvalidInput, match="need scale_a and scale_b"):
        ag_gemm.OP.problem_of(w, a, b)
    rows = Problem.make("ag_gemm", FP8, 2, M=16, N=32, K=64, gather="rows", scaling="rowwise")
    tensor = Problem.make("ag_gemm", FP8, 2, M=16, N=32, K=64, gather="rows", scaling="tensorwise")
    k_rows = Problem.make("ag_gemm", FP8, 2, M=16, N=32, K=64, gather="k", scaling="rowwise")
    k_tensor = Problem.make("ag_gemm", FP8, 2, M=16, N=32, K=64, gather="k", scaling="tensorwise")
    for name in ("heap_mm", "heap_mm_overlap"):  # the hybrids: both kinds of scales, both forms
        v = ag_gemm.OP.variant(name)
        for p in (rows, tensor, k_rows, k_tensor):
            assert v.defaults(p) and all(v.check(p, c) is None for c in v.defaults(p))
    for name in ("pull", "push", "push_ws"):  # the fused kernel: both kinds of scales, both forms
        v = ag_gemm.OP.variant(name)
        for p in (rows, tensor, k_rows, k_tensor):
            assert v.defaults(p) and all(v.check(p, c) is None and c["BLOCK_K"] >= 32 for c in v.defaults(p))
            assert "too small for FP8" in v.check(p, ag_fused("tile", BLOCK_K=16))


def test_torch_symm_checks_take_fp8_of_both_scalings():
    """The peer variants of gemm_ar, gemm_rs and ag_gemm accept FP8 problems of either scaling (no
    config); ag_gemm's refuses the k form (its scaled op is wired with gather_dim 0) and every config."""
    symm = ag_gemm.OP.variant("torch_symm")
    for s in rp.SCALINGS:
        p = Problem.make("ag_gemm", FP8, 2, M=16, N=32, K=64, gather="rows", scaling=s)
        assert symm.check(p, {}) is None and symm.defaults(p) == [{}]
        assert "takes no config" in symm.check(p, {"BLOCK_M": 64})
        for name in ("torch_symm_one_shot", "torch_symm_two_shot"):
            p = Problem.make("gemm_ar", FP8, 2, M=16, N=32, K=64, scaling=s)
            assert gemm_ar.OP.variant(name).check(p, {}) is None
            assert "takes no config" in gemm_ar.OP.variant(name).check(p, {"ALGO": "one_shot"})
        rs = gemm_rs.OP.variant("torch_symm")
        p = Problem.make("gemm_rs", FP8, 2, M=16, N=32, K=64, scaling=s)
        assert rs.check(p, {}) is None and rs.defaults(p) == [{}]
        assert "takes no config" in rs.check(p, {"BLOCK_M": 64})
    k_form = Problem.make("ag_gemm", FP8, 2, M=16, N=32, K=64, gather="k", scaling="tensorwise")
    assert "rows form only" in symm.check(k_form, {})


def _symm_on_cpu(world) -> dict:
    """The torch_symm runners on CPU ranks, torch's symm_mem ops stood in for (tests/_symm_cpu.py):
    FP8 of both scalings, and bf16 beside them. gemm_rs's rows a rank (10 at 2 ranks, 5 at 4) leave
    the row-wise scales' chunks off 16-byte alignment, so torch's op copies them."""
    import _symm_cpu

    cases = {"gemm_ar": [(v, {**ODD, "scaling": s}, FP8, {}) for v in ("torch_symm_one_shot", "torch_symm_two_shot")
                         for s in rp.SCALINGS] + [("torch_symm_two_shot", ODD, "bfloat16", {})],
             "gemm_rs": [("torch_symm", {**ODD, "scaling": s}, FP8, {}) for s in rp.SCALINGS]
             + [("torch_symm", ODD, "bfloat16", {})],
             "ag_gemm": [("torch_symm", AG_T, FP8, {}), ("torch_symm", AG_R, FP8, {}),
                         ("torch_symm", AG, "bfloat16", {})]}
    with _symm_cpu.stand_ins(gemm_ar, gemm_rs, ag_gemm):
        return {name: harness.run_cases(world, OPS[name], c, calls=2) for name, c in cases.items()}


@pytest.mark.parametrize("ranks", [2, 4])
def test_torch_symm_fp8_wiring_on_cpu_stand_ins(ranks):
    results = spawn(_symm_on_cpu, ranks, device_kind="cpu", timeout_s=300)
    for op in ("gemm_ar", "gemm_rs", "ag_gemm"):
        harness.assert_ok([rank[op] for rank in results])
        assert all(row[1] is not None for rank in results for row in rank[op])  # no case skipped


def test_fp8_sweeps_defaults_and_features():
    for op in (gemm_ar.OP, gemm_rs.OP):
        problems = op.sweep("fp8", 2)
        assert problems and {p["scaling"] for p in problems} == {"tensorwise", "rowwise"}
        sizes = lambda ps: {(p["M"], p["N"], p["K"]) for p in ps}  # noqa: E731
        assert sizes(problems) == sizes(op.sweep("default", 2))
        for p in problems + op.sweep("fp8-cpu", 2):
            feats = {**op.features(p)}
            assert all(v == v for v in feats.values())
            for v in op.variants.values():
                if v.name == "mm_ring":  # by design: torch._scaled_mm cannot accumulate onto a partial
                    assert v.defaults(p) == [] and "FP8" in v.check(p, {"CHUNKS": 2}), p
                    continue
                if v.family in ("fused", "hybrid"):
                    assert v.defaults(p) and all(v.check(p, c) is None for c in v.defaults(p)), (v, p)
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
    ag = ag_gemm.OP.sweep("fp8", 2)
    assert len(ag) == 2 * len(ag_gemm.OP.sweep("default", 2)) and all(p.dtype == FP8 for p in ag)
    assert all(ag_gemm.OP.variant("bsp").defaults(p) == [{}] for p in ag + ag_gemm.OP.sweep("fp8-cpu", 2))
    for p in ag + ag_gemm.OP.sweep("fp8-cpu", 2):  # the fused variants: defaults for both kinds of scales
        for name in ("pull", "push", "push_ws"):
            configs = ag_gemm.OP.variant(name).defaults(p)
            assert configs and all(ag_gemm.OP.variant(name).check(p, c) is None and c["BLOCK_K"] >= 32
                                   for c in configs), (name, p)
    assert f["log2_comm_bytes"] == problem_features(bf16, gemm_rs.OP)["log2_comm_bytes"]  # bf16 partials move


# -- GPU: world 2 on one GPU (several ranks per GPU) or two -------------------------------------------
GPU_DIMS = [{"M": 128, "N": 8192, "K": 8192}, {"M": 1024, "N": 8192, "K": 14336}, {"M": 96, "N": 3008, "K": 4096}]  # N: FP8's multiple of 16, no tile's


def _ag_gpu(variants: tuple[str, ...], gather: str, ms: tuple[int, ...]) -> list[harness.Case]:
    """ag_gemm at N=3584, K=8192, both scalings: each variant at its first default (none: no case)."""
    cases = []
    for m in ms:
        for s in rp.SCALINGS:
            dims = {"M": m, "N": 3584, "K": 8192, "gather": gather, "scaling": s}
            problem = Problem.make("ag_gemm", FP8, 2, **dims)
            cases += [(v, dims, FP8, c) for v in variants for c in ag_gemm.OP.variant(v).defaults(problem)[:1]]
    return cases


# The fused kernels' FP8 pointer path (cp.async loads: what gemm.defaults puts first for them at 65-256 rows):
# each fused variant's first default with TMA off, every default that loads by pointer, and the skinny
# 64x64x256 5-stage pointer tile (swap-AB at <= 64 rows), at skinny problems of each op, both scalings
# (two H100, 2026-11-27: passed in run g1, and in g2 with the pointer defaults and the <= 64-row problems; the
# 1024-row problem (512 rows a rank), whose second default is the 6-stage pointer tile, passed in run g6).
SKINNY_PTR = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 256, "num_stages": 5, "num_warps": 4, "TMA": False}


def _ptr_gpu(op, variants: tuple[str, ...], *dims: dict) -> list[harness.Case]:
    cases = []
    for d in ({**x, "scaling": s} for x in dims for s in rp.SCALINGS):
        problem = Problem.make(op.name, FP8, 2, **d)
        for v in variants:
            defaults = op.variant(v).defaults(problem)
            first = defaults[0]
            configs = [dict(first, TMA=False), {**first, **SKINNY_PTR, "SPLIT_K": 1}]
            configs += [c for c in defaults if not c.get("TMA", True)]
            for c in configs:
                if op.variant(v).check(problem, c) is None and (v, d, FP8, c) not in cases:
                    cases.append((v, d, FP8, c))
    return cases


GPU_CASES = {
    "ag_gemm": _ag_gpu(("bsp", "torch_symm", "heap_mm", "heap_mm_overlap"), "rows", (128, 2048))
    + _ag_gpu(("bsp", "heap_mm", "heap_mm_overlap"), "k", (2048,)),
    "gemm_ar": [(v, {**d, "scaling": s}, FP8, c) for d in GPU_DIMS[:1] + GPU_DIMS[2:] for s in rp.SCALINGS
                for v in ("bsp", "torch_symm_one_shot", "torch_symm_two_shot", "mm_heap", "one_shot",
                          "two_shot")
                for c in (gemm_ar.OP.variant(v).defaults(Problem.make("gemm_ar", FP8, 2, **d, scaling=s))[:1])],
    "gemm_rs": [(v, {**d, "scaling": s}, FP8, c) for d in GPU_DIMS[1:] for s in rp.SCALINGS
                for v in ("bsp", "torch_symm", "mm_heap", "mm_heap_overlap", "push_last", "push_reducer")
                for c in (gemm_rs.OP.variant(v).defaults(Problem.make("gemm_rs", FP8, 2, **d, scaling=s))[:1])],
    "ag_gemm_fused": _ag_gpu(("pull", "push", "push_ws"), "rows", (128, 2048)),
    "ag_gemm_fused_k": _ag_gpu(("pull", "push", "push_ws"), "k", (2048,)),
    "ag_gemm_fused_ptr": _ptr_gpu(ag_gemm.OP, ("pull", "push", "push_ws"),
                                  {"M": 128, "N": 3584, "K": 8192, "gather": "rows"}),
    "gemm_ar_fused_ptr": _ptr_gpu(gemm_ar.OP, ("one_shot", "two_shot"), {"M": 128, "N": 3584, "K": 8192},
                                  {"M": 48, "N": 3584, "K": 8192}),
    "gemm_rs_fused_ptr": _ptr_gpu(gemm_rs.OP, ("push_last", "push_reducer"), {"M": 256, "N": 3584, "K": 8192},
                                  {"M": 64, "N": 3584, "K": 8192}, {"M": 1024, "N": 3584, "K": 8192}),
}


@harness.gpu()
@pytest.mark.parametrize("op", list(GPU_CASES))
def test_gpu_fp8_variants_eager_and_graph_replay(op):
    """Two ranks (on one GPU with AUTOFUSE_RANKS_PER_GPU=2: gloo, the IPC heap), every FP8-capable
    variant at its first default, eager calls and CUDA-graph replays with new inputs (BSP's replays
    are skipped where ranks share a GPU: gloo cannot be captured; torch_symm's cases are skipped
    there, with the reason). "ag_gemm_fused" (rows form) and "ag_gemm_fused_k" (k form): its fused
    kernels (both scalings), a spawn each."""
    results = spawn(harness.run_cases, 2, OPS[op.partition("_fused")[0]], GPU_CASES[op], 2, device_kind="cuda",
                    timeout_s=900)
    harness.assert_ok(results, same_bits=SAME_BITS if op == "gemm_ar" else ())
