"""ag_gemm: the one fused kernel (pull, push, push_ws x layout x FLAG x gather form), BSP, torch_symm.

CPU (gloo, shm heap, Triton's interpreter) at 2 and 4 ranks: the case table below against the
float64 reference into NaN-poisoned outputs (harness.run_cases: repeated calls, then every case
once more interleaved, so runners of other configs share the workspace and its epochs), odd
shapes, bf16/fp16/fp32, TMA and pointer paths, split-K, swap-AB; fault scenarios (a late peer, a
skipped call, a dead peer at two sizes: time to fail independent of size) for every fused
variant; invalid configs and inputs; sweeps, defaults and the search space. sm_90 compiles of the
kernel's switches with Triton 3.9 and, where AUTOFUSE_T36_PYTHON has it, 3.6 (the GPU machines'). GPU (marker
`gpu`, 2 GPUs): the same variants at GPU sizes outside the tuning sweeps, CUDA-graph replay included,
and the fault scenarios on real devices.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

import harness
from autofuse.core import gemm
from autofuse.core.op import InvalidConfig, InvalidInput, Problem
from autofuse.ops import ag_gemm
from autofuse.ops.ag_gemm import OP
from autofuse.comm.workspace import workspaces
from autofuse.comm.world import World, spawn
import conftest
from conftest import CTX, VERSIONS, assert_uniform, compile_request, compile_sm90_versions, needs_t36

FUSED = ("pull", "push", "push_ws")
LAYOUTS = {"pull": ("shard",), "push": ("shard", "gathered"), "push_ws": ("shard", "gathered")}
FLAGS = ("tile", "row_block", "shard")


def cfg(bm=16, bn=32, bk=16, flag="row_block", comm=2, layout="shard", split=1, swap=False, tma=True, group=4,
        warps=4, stages=2) -> dict:
    """A complete fused config (every GEMM key of autofuse.core.gemm and the op's FLAG, COMM_SMS, LAYOUT)."""
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, "num_warps": warps, "num_stages": stages,
            "SPLIT_K": split, "SWAP_AB": swap, "TMA": tma, "WARP_SPEC": False, "FLAG": flag, "COMM_SMS": comm,
            "LAYOUT": layout}


def rows(m, n, k):
    return dict(M=m, N=n, K=k, gather="rows")


def kform(m, n, k):
    return dict(M=m, N=n, K=k, gather="k")


def matrix(row_dims: dict, k_dims: dict, dtype: str, **knobs) -> list[harness.Case]:
    """Every fused variant x layout x FLAG once; the gather form alternates so that every (variant,
    layout) sees both; the TMA and pointer paths alternate, split-K and swap-AB ride along."""
    cases, i = [], 0
    for v in FUSED:
        for layout in LAYOUTS[v]:
            for flag in FLAGS:
                dims = row_dims if i % 2 == 0 else k_dims
                split = 2 if layout == "gathered" and i % 3 == 0 else 1
                cases.append((v, dims, dtype, cfg(flag=flag, layout=layout, tma=i % 3 != 1, split=split,
                                                  swap=i % 4 == 3, **knobs)))
                i += 1
    return cases


BSP = [("bsp", d, dt, {}) for d in (rows(8, 32, 32), kform(4, 32, 64)) for dt in ("bfloat16", "float16", "float32")]

# CPU: world size -> cases. 2 ranks: the full matrix (12 rows of 16 per rank: shard row blocks are
# partial and gathered tiles span both shards; N tails everywhere), other dtypes, 1..4 rows per
# rank (BLOCK_M bigger than a shard), K tails in both forms, split-K over uneven step counts (6
# steps over 4 splits), more producers than chunks, the hybrids through this op.
CPU_CASES = {
    2: matrix(rows(24, 48, 64), kform(24, 48, 64), "bfloat16") + [
        ("push", rows(16, 32, 64), "float16", cfg(bk=32, flag="shard", layout="gathered", comm=1)),
        ("pull", kform(16, 32, 64), "float32", cfg(bk=32, flag="tile", comm=1, tma=False)),
        ("push_ws", rows(16, 32, 64), "float32", cfg(bk=32, flag="row_block", comm=1, swap=True)),
        ("push", rows(2, 40, 32), "bfloat16", cfg(bn=16, flag="tile", comm=3)),
        ("pull", rows(6, 40, 32), "bfloat16", cfg(flag="shard", comm=3, tma=False)),
        ("push_ws", rows(8, 40, 32), "bfloat16", cfg(flag="row_block", layout="gathered", split=2, comm=3)),
        ("push", kform(3, 24, 96), "float16", cfg(bk=32, bn=16, flag="row_block", layout="gathered", split=2)),
        ("pull", kform(3, 24, 96), "float32", cfg(bk=32, flag="tile")),
        ("push_ws", rows(6, 40, 96), "float32", cfg(flag="shard", layout="gathered", split=4, comm=5)),
        ("pull", rows(4, 24, 40), "bfloat16", cfg(flag="tile", split=2)),  # K tails, split-K in the shard layout
        ("push", rows(12, 24, 40), "float16", cfg(flag="tile", layout="gathered", split=2, tma=False)),
        ("heap_mm", rows(8, 32, 64), "bfloat16", OP.variant("heap_mm").defaults(
            harness.problem_of(OP, 2, rows(8, 32, 64), "bfloat16"))[0]),
        ("heap_mm_overlap", kform(8, 32, 64), "float16", OP.variant("heap_mm_overlap").defaults(
            harness.problem_of(OP, 2, kform(8, 32, 64), "float16"))[0]),
    ] + BSP,
    4: [("heap_mm_overlap", rows(8, 32, 64), "bfloat16", OP.variant("heap_mm_overlap").defaults(
            harness.problem_of(OP, 4, rows(8, 32, 64), "bfloat16"))[0]),
        ("pull", rows(32, 32, 64), "bfloat16", cfg(flag="tile")),
        ("push", kform(32, 32, 64), "bfloat16", cfg(flag="row_block", layout="gathered", split=2)),
        ("push_ws", rows(32, 32, 64), "bfloat16", cfg(bm=32, flag="shard", layout="gathered", tma=False)),
        ("push", rows(4, 32, 64), "float32", cfg(flag="tile", comm=3)),
        ("push_ws", kform(32, 32, 64), "float16", cfg(flag="shard", swap=True)),
        ("push", rows(32, 32, 64), "bfloat16", cfg(flag="row_block", split=2)),
        ("bsp", rows(8, 32, 32), "bfloat16", {}), ("bsp", kform(4, 32, 64), "float32", {})],
    1: [(v, d, "float16", cfg(flag=f, layout=layout)) for v, layout in (("pull", "shard"), ("push", "gathered"),
                                                                       ("push_ws", "gathered"))
        for d, f in ((rows(20, 32, 32), "tile"), (kform(20, 32, 32), "shard"))] + [
        ("bsp", rows(8, 32, 32), "float32", {})],
}


def _run_cpu(world):
    return harness.run_cases(world, OP, CPU_CASES[world.size], calls=1)


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_cases_match_reference(nranks):
    results = spawn(_run_cpu, nranks, timeout_s=900)
    harness.assert_ok(results)
    assert len(results[0]) == len(CPU_CASES[nranks])
    names = [row[0] for row in results[0]]
    for v in FUSED:  # the table covers what the module doc says
        for layout in LAYOUTS[v]:
            for flag in FLAGS:
                assert any(n.startswith(f"{v} ") and f"'FLAG': '{flag}'" in n and f"'LAYOUT': '{layout}'" in n
                           for n in names) or nranks != 2, (v, layout, flag)


# ------------------------------------------------------------------------------------------------
# B column-major (b = w.t() of a contiguous N x K weight, as the backward formulas of gemm_rs and the
# linears pass it): every variant reads it in place; the fused kernel's K-major read (B_T) and the
# row-major one alternate on the same runner, so both compiles share the workspace and its epochs.
def column_major_b(inputs: tuple) -> tuple:
    a, b, *rest = inputs
    return (a, b.t().contiguous().t(), *rest)


COLUMN_MAJOR_CASES = {
    2: [("bsp", rows(8, 32, 32), "bfloat16", {}), ("bsp", kform(4, 32, 64), "float32", {}),
        ("heap_mm", rows(8, 32, 64), "bfloat16", OP.variant("heap_mm").defaults(
            harness.problem_of(OP, 2, rows(8, 32, 64), "bfloat16"))[0]),
        ("heap_mm_overlap", kform(8, 32, 64), "float16", OP.variant("heap_mm_overlap").defaults(
            harness.problem_of(OP, 2, kform(8, 32, 64), "float16"))[0]),
        ("pull", rows(12, 40, 32), "bfloat16", cfg(flag="tile", tma=True)),
        ("pull", kform(6, 24, 96), "float32", cfg(bk=32, flag="row_block", tma=False)),
        ("push", rows(12, 40, 32), "float16", cfg(flag="shard", layout="gathered", split=2, tma=False)),
        ("push", kform(6, 24, 96), "bfloat16", cfg(bk=32, bn=16, flag="tile", layout="gathered", tma=True)),
        ("push_ws", rows(24, 48, 64), "bfloat16", cfg(flag="row_block", swap=True, tma=True)),
        ("push_ws", kform(24, 48, 64), "float32", cfg(flag="shard", layout="gathered", split=2, tma=False))],
    4: [("push", rows(32, 32, 64), "bfloat16", cfg(flag="row_block", tma=True)),
        ("push_ws", kform(32, 32, 64), "float16", cfg(flag="tile", layout="gathered", tma=False)),
        ("heap_mm_overlap", rows(8, 32, 64), "bfloat16", OP.variant("heap_mm_overlap").defaults(
            harness.problem_of(OP, 4, rows(8, 32, 64), "bfloat16"))[0]),
        ("bsp", kform(4, 32, 64), "bfloat16", {})],
}


def _run_column_major(world):
    """Each case's runner called with B column-major, then row-major, then column-major again."""
    cases = COLUMN_MAJOR_CASES[world.size]
    out = harness.run_cases(world, OP, cases, calls=1, relayout=column_major_b)
    out += harness.run_cases(world, OP, cases, calls=1)
    return out + harness.run_cases(world, OP, cases, calls=1, relayout=column_major_b)


@pytest.mark.parametrize("nranks", [2, 4])
def test_column_major_b_matches_reference(nranks):
    results = spawn(_run_column_major, nranks, timeout_s=900)
    harness.assert_ok(results)
    assert len(results[0]) == 3 * len(COLUMN_MAJOR_CASES[nranks])


def test_column_major_b_is_accepted_and_other_strides_are_not():
    w = _world(2)
    a, b = torch.randn(4, 32), torch.randn(16, 32).t()  # B = W^T of a contiguous 16 x 32 weight
    assert OP.problem_of(w, a, b) == OP.problem_of(w, a, b.contiguous())  # one problem, one dispatch key's runner
    with pytest.raises(InvalidInput, match="row- or column-major"):
        OP.problem_of(w, a, torch.randn(32, 32)[:, ::2])


# ------------------------------------------------------------------------------------------------
# faults: every fused variant, every scenario, on one pair of ranks (the workspace is rebuilt
# between scenarios); dead_peer also at a size with 8x as many waiting programs.
SMALL, BIG = rows(24, 48, 64), rows(256, 64, 32)
FAULT_CONFIGS = {"pull": cfg(flag="row_block"), "push": cfg(flag="shard", layout="gathered"),
                 "push_ws": cfg(flag="tile")}


def _faults(world, runs):
    out = []
    for variant, dims, scenario in runs:
        out.append((variant, dims["M"], harness.fault_run(world, OP, variant, dims, "float32", FAULT_CONFIGS[variant],
                                                          scenario)))
        for ws in workspaces(world):  # every rank, in the same order: collective
            ws.rebuild()
    return out


def test_faults_raise_on_every_rank_in_bounded_time():
    runs = [(v, SMALL, s) for v in FUSED for s in ("late_peer", "skipped_call", "dead_peer")]
    runs.append(("push", BIG, "dead_peer"))
    results = spawn(_faults, 2, runs, timeout_s=900)
    for i in range(len(runs)):
        harness.check_fault_run([rank_rows[i][2] for rank_rows in results])
    dead = {m: r["first_fault_s"] for v, m, r in results[0] if v == "push" and r["scenario"] == "dead_peer"}
    small, big = dead[SMALL["M"]], dead[BIG["M"]]  # rank 0 is never the victim
    assert big <= small + 3.0, f"time to fail grew with the size: {small:.1f} s at M=24, {big:.1f} s at M=256"


def test_fault_at_four_ranks():
    results = spawn(_faults, 4, [("push_ws", rows(16, 32, 64), "skipped_call")], timeout_s=900)
    harness.check_fault_run([r[0][2] for r in results])


# ------------------------------------------------------------------------------------------------
# host-side validation (no ranks needed: problem_of and check run no collectives)
def _world(size: int = 2) -> World:
    return World(rank=0, size=size, device=torch.device("cpu"), backend="gloo")


def test_problem_of_reads_both_forms():
    w = _world(2)
    a, b = torch.randn(3, 64), torch.randn(64, 32)
    assert OP.problem_of(w, a, b) == Problem.make("ag_gemm", "float32", 2, M=6, N=32, K=64, gather="rows")
    a, b = torch.randn(5, 32, dtype=torch.bfloat16), torch.randn(64, 16, dtype=torch.bfloat16)
    assert OP.problem_of(w, a, b) == Problem.make("ag_gemm", "bfloat16", 2, M=5, N=16, K=64, gather="k")
    a, b = torch.randn(4, 32), torch.randn(32, 32)
    assert OP.problem_of(_world(1), a, b, gather="k")["gather"] == "k"
    assert OP.args == ("a", "b")


def test_problem_of_recovers_every_case():
    """Every CPU case's inputs read back as its problem (the dispatch key), both forms, every world size."""
    for nranks, cases in CPU_CASES.items():
        for _, dims, dtype, _ in cases:
            problem = harness.problem_of(OP, nranks, dims, dtype)
            a, b = OP.inputs(_world(nranks), problem, 0)
            assert OP.problem_of(_world(nranks), a, b, gather=dims["gather"]) == problem


@pytest.mark.parametrize("make, words", [
    (lambda: (torch.randn(4, 32), torch.randn(32, 16, dtype=torch.float16)), "must match"),
    (lambda: (torch.randn(4, 32), torch.randn(48, 16)), "do not fit"),
    (lambda: (torch.randn(4, 32), torch.randn(32, 16), "k"), "gather='k'"),
    (lambda: (torch.randn(32, 4).t(), torch.randn(32, 16)), "contiguous"),
    (lambda: (torch.randn(4, 32, device="meta"), torch.randn(32, 16)), "device"),
    (lambda: (torch.randn(32), torch.randn(32, 16)), "2-D"),
    (lambda: (torch.randn(4, 32, dtype=torch.float64), torch.randn(32, 16, dtype=torch.float64)), "not supported"),
    (lambda: (torch.randn(4, 12, dtype=torch.bfloat16), torch.randn(12, 16, dtype=torch.bfloat16)), "multiple of 8"),
    (lambda: (torch.randn(4, 16), torch.randn(16, 6)), "N=6"),
    (lambda: (torch.randn(4 * 32 + 1)[1:].view(4, 32), torch.randn(32, 16)), "aligned"),
    (lambda: (torch.randn(4, 32), torch.randn(32, 16), "cols"), "gather must be"),
])
def test_bad_inputs_raise_invalid_input(make, words):
    args = make()
    with pytest.raises(InvalidInput) as info:
        OP.problem_of(_world(2), *args[:2], **({"gather": args[2]} if len(args) > 2 else {}))
    assert words in str(info.value)


def test_bad_problems_raise_invalid_input():
    with pytest.raises(InvalidInput, match="not divisible"):
        OP.inputs(_world(4), Problem.make("ag_gemm", "float32", 4, M=6, N=32, K=64, gather="rows"), 0)
    with pytest.raises(InvalidInput, match="K=66 is not divisible"):
        ag_gemm.validate(Problem.make("ag_gemm", "float32", 4, M=8, N=32, K=66, gather="k"))


GPU = Problem.make("ag_gemm", "bfloat16", 2, M=4096, N=3584, K=8192, gather="rows")


@pytest.mark.parametrize("change, words", [
    ({"BLOCK_K": 128}, "BLOCK_K=128 is larger than 64 needs"),  # 64 K per rank
    ({"BLOCK_M": 24}, "power of two"),
    ({"BLOCK_N": 8}, "power of two in 16..256"),
    ({"FLAG": "row"}, "FLAG"),
    ({"COMM_SMS": 0}, "COMM_SMS"),
    ({"COMM_SMS": True}, "COMM_SMS"),
    ({"num_warps": 3}, "num_warps"),
    ({"GROUP_M": 0}, "GROUP_M"),
    ({"extra": 1}, "unknown ['extra']"),
    ({"LAYOUT": "rows"}, "LAYOUT"),
    ({"SPLIT_K": 2}, "SPLIT_K=2 needs LAYOUT=gathered in the k form"),
    ({"SPLIT_K": 0}, "SPLIT_K=0 must be an int"),
    ({"WARP_SPEC": True, "BLOCK_M": 32, "TMA": True}, "WARP_SPEC"),
])
def test_invalid_configs_rejected_before_launch(change, words):
    problem = Problem.make("ag_gemm", "bfloat16", 2, M=32, N=32, K=128, gather="k")  # 64 K per rank
    config = {**cfg(), **change}
    for v in FUSED:
        assert words in OP.variant(v).check(problem, config)
        with pytest.raises(InvalidConfig, match=re.escape(words)):  # before any heap use: no group here
            OP.variant(v).build(_world(2), problem, config)


def test_layout_rules():
    problem = Problem.make("ag_gemm", "bfloat16", 2, M=32, N=64, K=128, gather="rows")  # 16 rows per rank
    gathered = cfg(layout="gathered", flag="shard")
    assert "not pull" in OP.variant("pull").check(problem, gathered)
    with pytest.raises(InvalidConfig, match="not pull"):
        OP.variant("pull").build(_world(2), problem, gathered)
    for v in ("push", "push_ws"):
        for flag in FLAGS:  # every FLAG with either layout
            assert OP.variant(v).check(problem, {**gathered, "FLAG": flag}) is None
        assert OP.variant(v).check(problem, {**gathered, "BLOCK_M": 32}) is None  # a tile may span shards
        assert "the gathered A's 32 rows" in OP.variant(v).check(problem, {**gathered, "BLOCK_M": 64})
        assert "a shard's 16 rows" in OP.variant(v).check(problem, cfg(bm=32))
        assert "more than the 4 BLOCK_K steps" in OP.variant(v).check(problem, {**gathered, "BLOCK_K": 32,
                                                                                 "SPLIT_K": 8})
        for m in (8, 64, 256, 1024, 4096):  # the gathered layout first, a shard-layout config kept
            defaults = OP.variant(v).defaults(Problem.make("ag_gemm", "bfloat16", 2, M=m, N=3584, K=8192,
                                                          gather="rows"))
            assert defaults[0]["LAYOUT"] == "gathered" and any(c["LAYOUT"] == "shard" for c in defaults), (v, m)
    assert all(c["LAYOUT"] == "shard" for c in OP.variant("pull").defaults(GPU))
    ws_comm = max(c["COMM_SMS"] for c in OP.variant("push_ws").defaults(GPU))
    assert ws_comm <= max(c["COMM_SMS"] for c in OP.variant("push").defaults(GPU))


def test_shared_memory_and_missing_keys_rejected():
    big = cfg(bm=128, bn=256, bk=128, warps=8, stages=4)
    assert "shared memory" in OP.variant("push").check(GPU, big)
    small = {k: v for k, v in cfg().items() if k != "FLAG"}
    assert "lacks FLAG" in OP.variant("pull").check(GPU, small)
    assert "FLAG=tile needs" in OP.variant("push").check(
        Problem.make("ag_gemm", "bfloat16", 2, M=65536, N=256, K=16384, gather="rows"),
        cfg(bm=16, bk=16, flag="tile", stages=3))
    with pytest.raises(InvalidConfig):
        OP.variant("bsp").build(_world(2), GPU, cfg())


def test_variants_families_and_sweeps():
    assert list(OP.variants) == ["bsp", "torch_symm", "heap_mm", "heap_mm_overlap", "pull", "push", "push_ws"]
    families = {name: v.family for name, v in OP.variants.items()}
    assert families == {"bsp": "bsp", "torch_symm": "peer", "heap_mm": "hybrid", "heap_mm_overlap": "hybrid",
                        "pull": "fused", "push": "fused", "push_ws": "fused"}
    assert not OP.variant("torch_symm").available(_world(2))
    assert [p["M"] for p in OP.sweep("gpu", 2)] == list(ag_gemm.GPU_M)
    assert {p["N"] for p in OP.sweep("gpu", 2)} == {3584} and {p["K"] for p in OP.sweep("gpu", 2)} == {8192}
    assert {p["N"] for p in OP.sweep("llama70b", 2)} == {5120, 28672}
    models = OP.sweep("models", 2)
    assert {(p["N"], p["K"]) for p in models} >= {(5120, 8192), (28672, 8192), (3072, 4096), (14336, 4096)}
    assert {p["M"] for p in models} >= {8, 128, 512, 8192}  # decode and prefill rows
    assert all(p["M"] % 8 == 0 for p in OP.sweep("models", 8))  # M=1 does not split over 8 ranks
    default = OP.sweep("default", 2)
    assert 8 <= len(default) <= 12 and {p["N"] for p in default} >= {3584, 28672}
    assert {p["gather"] for p in OP.sweep("cpu", 2)} == {"rows", "k"}
    with pytest.raises(ValueError, match="unknown sweep"):
        OP.sweep("bogus", 2)


def test_defaults_space_and_features():
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for kind, world in (("gpu", 2), ("llama70b", 2), ("models", 4), ("default", 2), ("cpu", 2), ("cpu", 4)):
        for p in OP.sweep(kind, world):
            ag_gemm.validate(p)
            assert all(math.isfinite(x) for x in OP.features(p).values())
            assert {"log2_M", "log2_N", "log2_K"} <= set(OP.features(p))
            for v in FUSED:
                defaults = OP.variant(v).defaults(p)
                assert 1 <= len(defaults) <= 4, (kind, p.key, v)
                assert all(OP.variant(v).check(p, c) is None for c in defaults), (kind, p.key, v)
                assert all(set(c) == set(gemm.KEYS) | set(ag_gemm.OP_KEYS) for c in defaults)  # canonical
                if kind == "cpu":
                    assert all(c["BLOCK_M"] <= 32 and c["BLOCK_N"] <= 32 and c["BLOCK_K"] <= 32 for c in defaults)
    small = Problem.make("ag_gemm", "bfloat16", 2, M=64, N=3584, K=8192, gather="rows")
    assert any(c["SPLIT_K"] > 1 or c["SWAP_AB"] for c in OP.variant("push").defaults(small))  # skinny GEMM
    for p in (GPU, OP.sweep("cpu", 2)[0]):  # the tuner keeps one study per problem
        for v in FUSED:
            study = optuna.create_study()
            for _ in range(12):
                trial = study.ask()
                config = OP.variant(v).space(trial, p)
                assert all(config[k] == value for k, value in trial.params.items())  # recorded = measured
                reason = OP.variant(v).check(p, config)
                assert reason is None or isinstance(reason, str)


# ------------------------------------------------------------------------------------------------
# sm_90 compiles of the kernel's switches, Triton 3.9 (this venv) and 3.6 (the GPU machines')
_SIG = {"a": "*bf16", "b": "*bf16", "c": "*bf16", "scale_a": "*fp32", "scale_b": "*fp32", "data": "*bf16",
        "scales": "*fp32", "flags": "*i32", "partials": "*fp32", "counts": "*i32", "ctx": CTX,
        **{n: "i32" for n in ("R", "C", "N", "data_half", "flags_half", "comm_sms")},
        **{n: "constexpr" for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "NUM_STAGES", "SPLIT_K", "SWAP_AB",
                                    "USE_TMA", "FLAG", "GATHER_K", "GATHERED", "PULL", "PERSISTENT", "B_T",
                                    "SCALE")}}
_DIV = ("a", "b", "c", "data", "scales", "R", "C", "N", "data_half")
COMPILES = {  # name: (GEMM config, FLAG, GATHER_K, GATHERED, PULL, dtype)
    "push gathered rows": (gemm.GemmConfig(128, 256, 64, 8, 8, 3), "row_block", False, True, False, "bf16"),
    "push_ws gathered rows": (gemm.GemmConfig(128, 256, 64, 8, 8, 3), "shard", False, True, False, "bf16"),
    "push_ws shard k": (gemm.GemmConfig(128, 128, 64, 8, 8, 4), "tile", True, False, False, "bf16"),
    "push shard rows": (gemm.GemmConfig(128, 256, 64, 8, 8, 3), "shard", False, False, False, "bf16"),
    "pull shard rows": (gemm.GemmConfig(128, 128, 64, 8, 8, 4), "tile", False, False, True, "bf16"),
    "push gathered k split": (gemm.GemmConfig(64, 128, 128, 8, 4, 4, SPLIT_K=2), "shard", True, True, False, "bf16"),
    "pull shard k": (gemm.GemmConfig(128, 128, 64, 8, 8, 3), "row_block", True, False, True, "bf16"),
    "swap split": (gemm.GemmConfig(16, 128, 128, 8, 4, 4, SPLIT_K=4, SWAP_AB=True), "shard", False, True, False,
                   "bf16"),
    "pointer": (gemm.GemmConfig(128, 256, 64, 8, 8, 3, TMA=False), "shard", False, True, False, "bf16"),
    "fp32": (gemm.GemmConfig(64, 64, 32, 8, 4, 3), "tile", False, True, False, "fp32"),
    # gemm.defaults' deep tile (5 stages; on 8 warps in fused kernels, on 4 in the core alone)
    "push deep": (gemm.GemmConfig(128, 128, 64, 8, 8, 5), "shard", False, True, False, "bf16"),
    "push 4-warp deep": (gemm.GemmConfig(128, 128, 64, 8, 4, 5), "shard", False, True, False, "bf16"),
    # FP8 (float8_e4m3fn A and data, B stored N x K, bf16 out): tensorwise scales, or row-wise where the name says
    "fp8 push gathered rows": (gemm.GemmConfig(128, 256, 128, 8, 8, 3), "shard", False, True, False, "fp8e4nv"),
    "fp8 pull shard rows": (gemm.GemmConfig(128, 128, 128, 8, 8, 4), "tile", False, False, True, "fp8e4nv"),
    "fp8 pull deep": (gemm.GemmConfig(128, 128, 128, 8, 8, 5), "tile", False, False, True, "fp8e4nv"),
    "fp8 pull swap split": (gemm.GemmConfig(64, 128, 256, 8, 4, 4, SPLIT_K=4, SWAP_AB=True), "shard", False, False, True,
                            "fp8e4nv"),  # the first default at M=128, N=3584, K=8192
    "fp8 push_ws swap split pointer": (gemm.GemmConfig(16, 128, 128, 8, 4, 4, SPLIT_K=2, SWAP_AB=True, TMA=False),
                                        "row_block", False, True, False, "fp8e4nv"),
    # row-wise scales: the rows form's scales move with the rows (pull: read from the peer's heap)
    "fp8 rowwise push gathered rows": (gemm.GemmConfig(128, 256, 128, 8, 8, 3), "shard", False, True, False,
                                       "fp8e4nv"),
    "fp8 rowwise pull shard rows": (gemm.GemmConfig(128, 128, 128, 8, 8, 4), "tile", False, False, True, "fp8e4nv"),
    "fp8 rowwise push_ws shard rows swap split": (gemm.GemmConfig(64, 128, 256, 8, 8, 4, SPLIT_K=2, SWAP_AB=True),
                                                  "row_block", False, False, False, "fp8e4nv"),
    # the k form: B's shard columns of its N x K storage (shard layout), one K loop over it (gathered)
    "fp8 rowwise push_ws shard k": (gemm.GemmConfig(128, 128, 128, 8, 8, 4), "tile", True, False, False, "fp8e4nv"),
    "fp8 push gathered k split": (gemm.GemmConfig(64, 128, 256, 8, 4, 4, SPLIT_K=2), "shard", True, True, False,
                                  "fp8e4nv"),
    "fp8 pull shard k pointer": (gemm.GemmConfig(128, 128, 128, 8, 8, 3, TMA=False), "row_block", True, False, True,
                                 "fp8e4nv"),
}
DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32", "fp8e4nv": "float8_e4m3fn"}

def _request(name: str) -> dict:
    g, flag, gather_k, gathered, pull, dt = COMPILES[name]
    fp8 = dt == "fp8e4nv"
    sig = {**_SIG, **{n: f"*{dt}" for n in ("a", "b", "data")}, "c": "*bf16" if fp8 else f"*{dt}"}
    consts = dict(BLOCK_M=g.BLOCK_M, BLOCK_N=g.BLOCK_N, BLOCK_K=g.BLOCK_K, GROUP_M=g.GROUP_M, NUM_STAGES=g.num_stages,
                  SPLIT_K=g.SPLIT_K, SWAP_AB=g.SWAP_AB, USE_TMA=g.TMA, FLAG=ag_gemm.FLAGS[flag], GATHER_K=gather_k,
                  GATHERED=gathered, PULL=pull, B_T=fp8,
                  SCALE=gemm.SCALINGS[("rowwise" if "rowwise" in name else "tensorwise") if fp8 else "none"])
    consts["PERSISTENT"] = "push_ws" in name
    return compile_request("autofuse.kernels.ag_gemm", "ag_gemm_kernel", sig, consts, g.num_warps, g.num_stages,
                           _DIV, name=name)


@pytest.fixture(scope="module")
def compiled() -> dict:
    """{version: {case: {'ptx', 'shared'}}} for every entry of conftest.VERSIONS present here."""
    return compile_sm90_versions([_request(name) for name in COMPILES])


@pytest.mark.parametrize("version", VERSIONS)
def test_sm90_compiles_every_switch(compiled, version):
    for name, (g, flag, gather_k, gathered, pull, dt) in COMPILES.items():
        k = compiled[version][name]
        ptx = k["ptx"]
        assert_uniform(k, name)  # every fault decision is the program's (no barrier in a per-thread branch)
        assert k["shared"] <= g.smem_bytes(DTYPE_NAMES[dt]) <= gemm.SMEM_LIMIT, (name, k["shared"])  # one pipeline
        assert "ld.volatile.global" in ptx and "%globaltimer" in ptx, name  # bounded polls with loads
        assert "ld.global.sys.acquire" in ptx, name  # the acquire after a poll
        assert "atom.global.sys.release.exch.b32" in ptx, name  # flags raised with a system-scope release
        assert "atom.global.release.sys.cas.b32" in ptx, name  # give_up aborts every peer
        assert "prefetch.global.L2" in ptx, name  # B's first steps before the wait
        assert re.search(r"\bbar(rier)?\.sync", ptx), name  # every thread's stores before a release
        assert "wgmma.mma_async" in ptx, name
        if flag == "shard":
            assert "atom.global.sys.acq_rel.add" in ptx, name  # producers count themselves at the destination
        if g.TMA:
            assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", ptx), name  # TMA loads
            assert "mbarrier.try_wait" in ptx and "fence.proxy.async.global" in ptx, name
            stores_tma = "cp.async.bulk.tensor.2d.global.shared::cta" in ptx
            assert stores_tma == (gathered or gather_k), name  # shard-layout row blocks: masked pointer stores
        else:
            assert "cp.async.commit_group" in ptx and "cp.async.wait_group" in ptx, name  # pipelined pointer loads
            assert "cp.async.bulk.tensor" not in ptx, name
        if g.SPLIT_K > 1:
            assert "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx, name
        if dt == "fp8e4nv":  # e4m3 wgmma on the FP8 tiles (B read K-major from its N x K storage)
            assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", ptx), name
        if "push_ws" in name:  # work items by ticket; the last program to retire resets the counters
            assert "atom.global.gpu.relaxed.add" in ptx and "atom.global.gpu.acq_rel.add" in ptx, name
        if g.SWAP_AB:
            assert f"wgmma.mma_async.sync.aligned.m64n{g.BLOCK_M}k" in ptx, name  # BLOCK_M on the MMA's N side


@needs_t36
def test_sm90_no_register_spills(compiled, tmp_path):
    """Triton 3.6's ptxas (the GPU machines') assembles every switch without spilling: a 128x256
    float32 accumulator over 8 warps is 128 registers a thread, little room left for the rest."""
    conftest.assert_spills_within(compiled["3.6"], {}, tmp_path)


# ------------------------------------------------------------------------------------------------
# GPU (2 GPUs, `pytest -m gpu tests/test_ag_gemm.py`): sizes outside the tuning sweeps, every
# variant at its first two defaults, the full matrix at one mid size, CUDA-graph replays.
GPU_PROBLEMS = [(rows(8, 3584, 8192), "bfloat16"), (rows(200, 5120, 8192), "float16"),
                (rows(72, 2048, 4096), "float32"),
                (rows(1000, 3584, 8192), "bfloat16"), (kform(1000, 3584, 8192), "float16"),
                (rows(4352, 2560, 4096), "bfloat16"), (kform(96, 1536, 2048), "float32")]


def _gpu_cases(dims: dict, dtype: str, configs: int = 1) -> list[harness.Case]:
    problem = harness.problem_of(OP, 2, dims, dtype)
    cases: list[harness.Case] = [("bsp", dims, dtype, {}), ("torch_symm", dims, dtype, {})]
    for v in ("heap_mm", "heap_mm_overlap", *FUSED):
        cases += [(v, dims, dtype, c) for c in OP.variant(v).defaults(problem)[:configs]]
    return cases


GPU_CASES = ([c for dims, dt in GPU_PROBLEMS for c in _gpu_cases(dims, dt, 2 if dims["M"] == 1000 else 1)]
             + matrix(rows(320, 1024, 2048), kform(320, 1024, 2048), "bfloat16", bm=64, bn=128, bk=64, comm=8,
                      group=8, warps=4, stages=3))
GPU_PARTS = 4  # each part is one spawn, mostly Triton compiles: well inside pytest's 600 s


def _run_gpu(world, cases):
    return harness.gpu_cases(world, OP, cases)


@harness.gpu()
@pytest.mark.parametrize("part", range(GPU_PARTS))
def test_gpu_cases_match_reference_with_graph_replay(part, monkeypatch):
    """A part of the table on the default heap; its copy-engine hybrid cases on the IPC heap
    (harness.on_copy_engine)."""
    cases = GPU_CASES[part::GPU_PARTS]
    on_ce = [c for c in cases if harness.on_copy_engine(c)]
    on_sm = [c for c in cases if c not in on_ce]
    results = spawn(_run_gpu, harness.gpu_world(), on_sm, device_kind="cuda", timeout_s=1500)
    harness.assert_ok(results)
    assert len(results[0]) == len(on_sm)  # torch_symm where torch has it, else skipped with the reason
    if on_ce:
        harness.use_ipc_heap(monkeypatch)
        results = spawn(_run_gpu, harness.gpu_world(), on_ce, device_kind="cuda", timeout_s=900)
        harness.assert_ok(results)
        assert len(results[0]) == len(on_ce)


GPU_COLUMN_MAJOR = [c for dims, dt in ((rows(1000, 3584, 8192), "bfloat16"), (kform(96, 1536, 2048), "float16"))
                    for c in _gpu_cases(dims, dt)]


def _run_gpu_column_major(world):
    return harness.gpu_cases(world, OP, GPU_COLUMN_MAJOR, relayout=column_major_b)


@harness.gpu()
def test_gpu_column_major_b_with_graph_replay():
    """Every variant at its first default with B column-major (the fused kernel's K-major read), graph
    replays included (their static inputs keep the layout)."""
    results = spawn(_run_gpu_column_major, harness.gpu_world(), device_kind="cuda", timeout_s=900)
    harness.assert_ok(results)
    assert len(results[0]) == len(GPU_COLUMN_MAJOR)


@harness.gpu()
def test_gpu_faults_raise_on_every_rank_in_bounded_time():
    runs = [(v, rows(1024, 1024, 2048), s) for v in FUSED for s in ("late_peer", "skipped_call", "dead_peer")]
    runs.append(("push", rows(8192, 1024, 2048), "dead_peer"))
    results = spawn(_faults_gpu, harness.gpu_world(), runs, device_kind="cuda", timeout_s=900)
    for i in range(len(runs)):
        harness.check_fault_run([rank_rows[i][2] for rank_rows in results])
    dead = {m: r["first_fault_s"] for v, m, r in results[0] if v == "push" and r["scenario"] == "dead_peer"}
    assert dead[8192] <= dead[1024] + 3.0, f"time to fail grew with the size: {dead}"


def _faults_gpu(world, runs):
    FAULT_CONFIGS.update({v: OP.variant(v).defaults(harness.problem_of(OP, world.size, rows(1024, 1024, 2048),
                                                                       "float32"))[0] for v in FUSED})
    return _faults(world, runs)
