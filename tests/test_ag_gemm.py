"""ag_gemm on the CPU emulation (gloo, shm heap, Triton's interpreter) at 1, 2 and 4 ranks.

Every variant x gather form x flag granularity against the float64 reference with NaN-poisoned
outputs, several consecutive calls with alternating inputs (epochs and the parity double buffer),
odd shapes, a flag timeout, bad inputs, invalid configs, the sweeps, and an sm_90 compile of each
fused kernel. One spawn per world size runs all of its cases and returns (case, errors) rows.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from autofuse.op import InvalidConfig, InvalidInput, Problem
from autofuse.ops import ag_gemm
from autofuse.ops.ag_gemm import OP
from autofuse.world import World, spawn
from conftest import compile_sm90

FUSED = ("pull", "push", "push_ws")


GATHERED = ("push", "push_ws")


def cfg(bm=16, bn=32, bk=16, flag="row_block", comm=2, group=4) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, "num_warps": 4, "num_stages": 2,
            "FLAG": flag, "COMM_SMS": comm}


def gcfg(bm=16, bn=32, bk=16, comm=2, group=4, split=1) -> dict:
    """A gathered-layout config (FLAG is always shard there)."""
    return {**cfg(bm, bn, bk, "shard", comm, group), "LAYOUT": "gathered", "SPLIT_K": split}


def _cases(world: int) -> list[tuple[str, str, dict, dict, int]]:
    """(variant, dtype, problem dims, config, calls) for a world size."""
    cases = []
    if world == 2:
        for v in FUSED:  # every granularity, both forms, 5 calls (both parities, twice)
            for g in ("rows", "k"):
                for flag in ("tile", "row_block", "shard"):
                    cases.append((v, "bfloat16", dict(M=24, N=48, K=64, gather=g), cfg(flag=flag), 5))
        for v in FUSED:  # other dtypes
            for dt, g, flag in (("float16", "rows", "shard"), ("float32", "k", "tile"),
                                ("float16", "k", "row_block"), ("float32", "rows", "row_block")):
                cases.append((v, dt, dict(M=16, N=32, K=64, gather=g), cfg(flag=flag, bk=32, comm=1), 2))
        for m, bn, flag in ((2, 16, "tile"), (4, 32, "row_block"), (6, 16, "shard"), (8, 32, "tile")):
            for v in FUSED:  # 1..4 rows per rank: BLOCK_M larger than a shard
                cases.append((v, "bfloat16", dict(M=m, N=40, K=32, gather="rows"), cfg(bn=bn, flag=flag, comm=3), 2))
        for v in FUSED:  # k form with 3 rows and a K tail (K/W = 48 = 3 x 16 with BLOCK_K 32)
            cases.append((v, "float32", dict(M=3, N=24, K=96, gather="k"), cfg(bk=32, flag="tile"), 2))
        for v in GATHERED:  # gathered layout: tiles spanning shards, more producers than tiles, K tails,
            # split K (uneven: 4 or 3 BLOCK_K steps over 2..4 splits, the K tail in the last split)
            cases.append((v, "bfloat16", dict(M=24, N=48, K=64, gather="rows"), gcfg(bm=16, comm=3), 5))
            cases.append((v, "bfloat16", dict(M=24, N=48, K=64, gather="k"), gcfg(bm=32, comm=2, split=2), 5))
            cases.append((v, "float32", dict(M=6, N=40, K=96, gather="rows"), gcfg(bk=16, comm=5, split=4),
                          3))  # 6 K steps over 4 splits: 2, 2, 2, 0
            cases.append((v, "float16", dict(M=3, N=24, K=96, gather="k"), gcfg(bk=32, bn=16, comm=1, split=2), 2))
    elif world == 4:
        for i, v in enumerate(FUSED):
            for j, g in enumerate(("rows", "k")):
                flag = ("tile", "row_block", "shard")[(i + j) % 3]
                cases.append((v, "bfloat16", dict(M=32, N=32, K=64, gather=g), cfg(flag=flag, comm=2), 3))
        cases.append(("push", "float32", dict(M=4, N=32, K=64, gather="rows"), cfg(flag="tile"), 2))
        for v, g in zip(GATHERED, ("rows", "k")):
            cases.append((v, "bfloat16", dict(M=32, N=32, K=64, gather=g), gcfg(bm=32, comm=3, split=2), 3))
    else:
        for v in FUSED:
            for g in ("rows", "k"):
                cases.append((v, "float16", dict(M=20, N=32, K=32, gather=g), cfg(flag="tile"), 2))
        for v in GATHERED:
            cases.append((v, "float16", dict(M=20, N=32, K=32, gather="rows"), gcfg(comm=2), 2))
    for g in ("rows", "k"):
        for dt in ("bfloat16", "float16", "float32"):
            cases.append(("bsp", dt, dict(M=4 * world, N=32, K=16 * world, gather=g), {}, 2))
    return cases


def _run(world) -> list[tuple[str, list[float], float]]:
    from autofuse import status
    from autofuse.op import rel_error

    rows = []
    for vname, dtype, dims, config, calls in _cases(world.size):
        problem = Problem.make("ag_gemm", dtype, world.size, **dims)
        runner = OP.variant(vname).build(world, problem, config)
        data = {seed: (OP.inputs(world, problem, seed), OP.reference(world, problem, seed)) for seed in (1, 2)}
        errors = []
        for call in range(calls):
            (a, b), ref = data[1 + call % 2]
            assert OP.problem_of(world, a, b, gather=dims["gather"]) == problem
            out = torch.full((problem["M"], problem["N"]), math.nan, dtype=problem.torch_dtype)
            runner(a, b, out=out)
            status.check(world.heap, "ag_gemm")
            errors.append(rel_error(out, ref))
        name = " ".join(str(config.get(k, "")) for k in ("FLAG", "LAYOUT", "SPLIT_K"))
        rows.append((f"{vname} {problem.key} {name}", errors, OP.tolerance(problem)))
    if world.size == 2:
        rows.append(("flag timeout", [_timeout(world, 128, cfg(flag="row_block"))], 0.5))
        rows.append(("flag timeout gathered", [_timeout(world, 256, gcfg())], 0.5))
    return rows


def _timeout(world, k: int, config: dict) -> float:
    """Only rank 0 calls: its waits must give up and the host must name the op, rank and flag."""
    from autofuse import status

    problem = Problem.make("ag_gemm", "float32", 2, M=64, N=32, K=k, gather="rows")  # a workspace of its own
    os.environ["AUTOFUSE_SPIN_LIMIT"] = "50"
    try:
        runner = OP.variant("push").build(world, problem, config)
    finally:
        del os.environ["AUTOFUSE_SPIN_LIMIT"]
    if world.rank != 0:
        return 0.0
    runner(*OP.inputs(world, problem, 0))
    try:
        status.check(world.heap, "ag_gemm")
    except status.FlagTimeout as exc:
        text = str(exc)
        return 0.0 if "ag_gemm: rank 0 timed out" in text and ".flags[" in text else 1.0
    return 1.0


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_variants_match_reference(nranks):
    results = spawn(_run, nranks, timeout_s=900)
    bad = [f"rank {r}: {name}: errors {errs} > tol {tol:.3g}"
           for r, rows in enumerate(results) for name, errs, tol in rows
           if not all(e <= tol for e in errs)]
    assert not bad, "\n".join(bad)
    assert len(results[0]) == len(_cases(nranks)) + 2 * (nranks == 2)


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
    ({"BLOCK_K": 128}, "larger than the K each rank holds"),
    ({"BLOCK_M": 24}, "power of two"),
    ({"BLOCK_N": 8}, "power of two >= 16"),
    ({"FLAG": "row"}, "FLAG"),
    ({"COMM_SMS": 0}, "COMM_SMS"),
    ({"num_warps": 3}, "num_warps"),
    ({"GROUP_M": 0}, "GROUP_M"),
    ({"extra": 1}, "unknown config keys"),
    ({"LAYOUT": "rows"}, "LAYOUT"),
    ({"SPLIT_K": 2}, "SPLIT_K=2 needs LAYOUT=gathered"),
    ({"SPLIT_K": 3}, "SPLIT_K=3 must be one of"),
])
def test_invalid_configs_rejected_before_launch(change, words):
    problem = Problem.make("ag_gemm", "bfloat16", 2, M=32, N=32, K=128, gather="k")  # 64 K per rank
    config = {**cfg(), **change}
    for v in FUSED:
        assert words in OP.variant(v).check(problem, config)
        with pytest.raises(InvalidConfig, match=words):  # before any heap use: this World has no group
            OP.variant(v).build(_world(2), problem, config)


def test_gathered_layout_rules():
    problem = Problem.make("ag_gemm", "bfloat16", 2, M=32, N=64, K=128, gather="rows")  # 16 rows per rank
    assert "not pull" in OP.variant("pull").check(problem, gcfg())
    with pytest.raises(InvalidConfig, match="not pull"):
        OP.variant("pull").build(_world(2), problem, gcfg())
    for v in GATHERED:
        assert "FLAG must be shard" in OP.variant(v).check(problem, {**gcfg(), "FLAG": "tile"})
        assert OP.variant(v).check(problem, gcfg(bm=32)) is None  # a tile may span shards
        assert "gathered A's 32 rows" in OP.variant(v).check(problem, gcfg(bm=64))
        assert "a shard's 16 rows" in OP.variant(v).check(problem, cfg(bm=32))
        assert "more than the 4 BLOCK_K steps" in OP.variant(v).check(problem, gcfg(bk=32, split=8))
        for m in (8, 64, 256, 1024):  # gathered first up to M=1024, existing configs kept after
            defaults = OP.variant(v).defaults(Problem.make("ag_gemm", "bfloat16", 2, M=m, N=3584, K=8192,
                                                          gather="rows"))
            assert defaults[0]["LAYOUT"] == "gathered" and any("LAYOUT" not in c for c in defaults), (v, m)
        assert all("LAYOUT" not in c for c in OP.variant(v).defaults(GPU))  # M=4096


def test_shared_memory_and_missing_keys_rejected():
    big = {**cfg(bm=256, bn=256, bk=128), "num_stages": 4}
    assert "shared memory estimate" in OP.variant("push").check(GPU, big)
    small = {k: v for k, v in cfg().items() if k != "FLAG"}
    assert "lacks FLAG" in OP.variant("pull").check(GPU, small)
    with pytest.raises(InvalidConfig):
        OP.variant("bsp").build(_world(2), GPU, cfg())


def test_sweeps_defaults_space_and_features():
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for kind, world in (("gpu", 2), ("llama70b", 2), ("llama70b", 8), ("cpu", 2), ("cpu", 4)):
        problems = OP.sweep(kind, world)
        assert problems, kind
        for p in problems:
            ag_gemm.validate(p)
            assert all(math.isfinite(x) for x in OP.features(p).values())
            for v in FUSED:
                defaults = OP.variant(v).defaults(p)
                assert 1 <= len(defaults) <= 4
                assert all(OP.variant(v).check(p, c) is None for c in defaults), (kind, p.key, v)
                if kind == "cpu":
                    assert all(c["BLOCK_M"] <= 32 and c["BLOCK_N"] <= 32 and c["BLOCK_K"] <= 32 for c in defaults)
    assert {p["gather"] for p in OP.sweep("cpu", 2)} == {"rows", "k"}
    assert [p["M"] for p in OP.sweep("gpu", 2)] == list(ag_gemm.GPU_M)
    assert {p["N"] for p in OP.sweep("llama70b", 2)} == {5120, 28672}
    for p in (GPU, OP.sweep("cpu", 2)[0]):  # the tuner keeps one study per problem
        study = optuna.create_study()
        for _ in range(10):
            trial = study.ask()
            config = OP.variant("push").space(trial, p)
            reason = OP.variant("push").check(p, config)
            assert reason is None or isinstance(reason, str)


# ------------------------------------------------------------------------------------------------
# sm_90 compile of every fused kernel at realistic GPU configs
SIG = {**{n: "*bf16" for n in ("a", "b", "c", "data")}, **{n: "*i32" for n in ("flags", "counts", "counter", "status")},
       "heap_bases": "*i64", **{n: "i32" for n in ("rank", "W", "spin_limit", "N", "R", "C", "comm")},
       **{n: "constexpr" for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "FLAG", "GATHER_K", "EVEN_K",
                                            "DOT_F32")}}


@pytest.mark.parametrize("kernel, flag, gather_k, blocks, warps, stages", [
    ("ag_gemm_pull_kernel", "tile", False, (128, 128, 64), 8, 3),
    ("ag_gemm_push_kernel", "row_block", True, (128, 128, 64), 8, 3),
    ("ag_gemm_push_ws_kernel", "shard", False, (128, 128, 64), 8, 3),
    ("ag_gemm_push_kernel", "tile", False, (16, 64, 128), 4, 4),
])
def test_fused_kernels_compile_for_sm90(kernel, flag, gather_k, blocks, warps, stages):
    bm, bn, bk = blocks
    constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "FLAG": ag_gemm.FLAGS[flag],
                  "GATHER_K": gather_k, "EVEN_K": True, "DOT_F32": False}
    out = compile_sm90("autofuse.kernels.ag_gemm", kernel, SIG, constexprs, num_warps=warps, num_stages=stages)
    assert out["shared"] <= ag_gemm.SMEM_LIMIT
    ptx = out["ptx"]
    assert "ld.volatile.global" in ptx  # flag polls are loads, not atomics
    assert "atom.global.sys.release.exch.b32" in ptx  # flags raised with a system-scope release
    assert "bar.sync" in ptx


GATHERED_SIG = {**{k: v for k, v in SIG.items() if v != "constexpr"}, "partials": "*fp32", "tile_counts": "*i32",
                **{n: "constexpr" for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "GATHER_K",
                                            "EVEN_K", "DOT_F32")}}


@pytest.mark.parametrize("kernel, gather_k, blocks, warps, stages, split", [
    ("ag_gemm_push_gathered_kernel", False, (16, 32, 256), 4, 4, 1),
    ("ag_gemm_push_gathered_kernel", False, (64, 32, 128), 4, 4, 2),
    ("ag_gemm_push_gathered_kernel", True, (64, 64, 128), 4, 4, 1),
    ("ag_gemm_push_ws_gathered_kernel", False, (128, 128, 64), 8, 3, 4),
])
def test_gathered_kernels_compile_pipelined_for_sm90(kernel, gather_k, blocks, warps, stages, split):
    """The gathered layout's K loop has no wait inside: with the divisibility a real launch sees
    (aligned pointers, N and K multiples of 16), Triton must pipeline it with cp.async."""
    bm, bn, bk = blocks
    constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "SPLIT_K": split,
                  "GATHER_K": gather_k, "EVEN_K": True, "DOT_F32": False}
    out = compile_sm90("autofuse.kernels.ag_gemm", kernel, GATHERED_SIG, constexprs, num_warps=warps,
                       num_stages=stages, divisible=("a", "b", "c", "data", "N", "C", "partials"))
    assert out["shared"] <= ag_gemm.SMEM_LIMIT
    ptx = out["ptx"]
    assert "cp.async.commit_group" in ptx and "cp.async.wait_group" in ptx, "the K loop is not pipelined"
    if split > 1:
        assert ptx.count("atom.global.gpu.acq_rel.add") >= 2  # the tile's arrival count and epoch_finish
        assert "ld.global.cg" in ptx  # the other splits' partials bypass L1
    assert "ld.volatile.global" in ptx
    assert "atom.global.sys.release.exch.b32" in ptx
    assert "wgmma" in ptx or "mma.sync" in ptx
