"""moe_combine's `fused` variant (kernels/moe_fused.py: the grouped GEMM storing each output row into its
token's rank's return buffer) on CPU ranks under Triton's interpreter: against float64 and against hybrid
with either dispatch's handle, at 2 and 4 ranks, uniform / skewed / empty-expert routings (a rank
receiving no rows, groups of zero rows), several m- and n-tiles per group; a late peer (bounded wait,
every rank raises, NaN outputs, refused until rebuilt); the configs; an sm_90 compile; on GPUs (marker
gpu) the pair captured in a CUDA graph and replayed over changing routings, and the late peer again."""
from __future__ import annotations

import harness
import pytest
import torch
from conftest import (
    VERSIONS,
    assert_pipelined_gemm,
    assert_uniform,
    compile_request,
    compile_sm90_versions,
)
from test_moe import _global, _shard
from test_moe_hybrid import (
    ROUTINGS,
    SMALL,
    TOL,
    Trial,
    _assert_late_peer,
    _beside_bsp,
    _combine_problem,
    _copy,
    _err,
    _gpu_graph,
    _late_peer,
)

from autofuse.comm.world import spawn
from autofuse.ops import moe

T, F, K = 4, 16, 2
# (tokens, H, config). H=32: one n-tile, 32-row m-tiles; H=1536 with 256-column tiles: 6 n-tiles
CASES = ((T, 32, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "NUM_STAGES": 2, "GROUP_M": 4, "num_warps": 4}),
         (T, 1536, {"BLOCK_M": 32, "BLOCK_N": 256, "BLOCK_K": 32, "NUM_STAGES": 2, "GROUP_M": 4, "num_warps": 4}))
TINY_M = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "NUM_STAGES": 2, "GROUP_M": 4, "num_warps": 4}


def _forward(world) -> dict:
    """Every routing: fused combine on bsp's and on hybrid's dispatch handle, vs float64 and vs hybrid combine."""
    from autofuse.ops import moe_combine, moe_dispatch

    out = {}
    for tokens, hid, cfg in CASES:
        p = moe.make_problem(moe.DISPATCH, "float32", world.size, tokens, hid, F, 2 * world.size, K, "swiglu")
        cp = _combine_problem(world, p)
        bsp, hybrid = moe_dispatch.Bsp().build(world, p, {}), moe_dispatch.Hybrid().build(world, p, SMALL)
        fused = moe_combine.Fused().build(world, cp, cfg)
        chybrid = moe_combine.Hybrid().build(world, cp, SMALL)
        for kind in ROUTINGS:
            ranks, w1, w2 = _global(p, kind, 1)
            x, ids, weights = ranks[world.rank]
            w1r, w2r = _shard(p, w1, w2, world.rank)
            ref = moe.unsharded(x.double(), ids, weights.double(), w1.double(), w2.double(), "swiglu")
            hb, handle_b = bsp(x, ids, weights, w1r)
            hb, handle_b = hb.clone(), _copy(handle_b)
            hh, handle_h = hybrid(x, ids.int() if kind == "self" else ids, weights, w1r)
            hh, handle_h = hh.clone(), _copy(handle_h)
            y_b = fused(hb, w2r, handle_b).clone()
            y_h = fused(hh, w2r, handle_h).clone()
            out[(tokens, hid, kind)] = {"y bsp dispatch": _err(y_b, ref), "y hybrid dispatch": _err(y_h, ref),
                                "vs hybrid combine": _err(y_h, chybrid(hh, w2r, handle_h)),
                                "used": int(handle_b.tensors["counts"].sum())}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_fused_combine_matches_float64_and_hybrid(world):
    results = spawn(_forward, world, timeout_s=600)
    for rank, r in enumerate(results):
        for case, v in r.items():
            assert max(v[n] for n in ("y bsp dispatch", "y hybrid dispatch", "vs hybrid combine")) < TOL, (rank, case, v)
    for case in results[0]:
        if case[2] == "skewed":  # every row to rank 0: the other ranks receive none, so run no tile
            assert all(r[case]["used"] == 0 for r in results[1:]), case


def _many_tiles(world) -> dict:
    """24 tokens a rank, each routed to both of rank 0's two experts: rank 0's groups hold 24 * W rows, several
    16-row m-tiles each, walked GROUP_M=4 at a time over 4 n-tiles; the other ranks receive nothing."""
    from autofuse.ops import moe_combine, moe_dispatch

    tokens, hid = 24, 256
    p = moe.make_problem(moe.DISPATCH, "float32", world.size, tokens, hid, F, 2 * world.size, K, "swiglu")
    w1, w2 = moe.expert_weights(p, 3)
    x = moe.tokens(p, world.rank, 3)
    ids = torch.tensor([[0, 1]] * tokens)
    weights = torch.rand(tokens, K, generator=torch.Generator().manual_seed(world.rank)) + 0.1
    ref = moe.unsharded(x.double(), ids, weights.double(), w1.double(), w2.double(), "swiglu")
    w1r, w2r = _shard(p, w1, w2, world.rank)
    h, handle = moe_dispatch.Bsp().build(world, p, {})(x, ids, weights, w1r)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "NUM_STAGES": 2, "GROUP_M": 4, "num_warps": 4}
    y = moe_combine.Fused().build(world, _combine_problem(world, p), cfg)(h, w2r, handle)
    return {"err": _err(y, ref), "rows": int(handle.tensors["counts"].sum())}


def test_fused_combine_with_several_m_tiles_per_expert_walked_in_groups():
    results = spawn(_many_tiles, 2, timeout_s=600)
    assert results[0]["rows"] == 2 * 24 * K and results[1]["rows"] == 0, results
    assert all(r["err"] < TOL for r in results), results


# (H, act, config): H=32 one n-tile of F=16 (masked), 16-row m-tiles; H=256 with F=16: 4 k-steps, 4 movers
D_SMALL = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "NUM_STAGES": 2, "GROUP_M": 4, "num_warps": 4,
           "COMM_SMS": 2, "BLOCK": 1024}
D_CASES = ((32, "swiglu", D_SMALL), (32, "none", D_SMALL), (256, "swiglu", {**D_SMALL, "BLOCK_M": 32, "COMM_SMS": 4}))


def _dispatch_forward(world) -> dict:
    """Every routing: fused dispatch vs bsp's (h, handle), vs float64 through either combine."""
    from autofuse.ops import moe_combine, moe_dispatch

    out = {}
    for hid, act, cfg in D_CASES if world.size == 2 else D_CASES[::2]:
        p = moe.make_problem(moe.DISPATCH, "float32", world.size, T, hid, F, 2 * world.size, K, act)
        fused, bsp = moe_dispatch.Fused().build(world, p, cfg), moe_dispatch.Bsp().build(world, p, {})
        cp = _combine_problem(world, p)
        cbsp = moe_combine.Bsp().build(world, cp, {})
        cfused = moe_combine.Fused().build(world, cp, TINY_M)
        for kind in ROUTINGS:
            ranks, w1, w2 = _global(p, kind, 1)
            x, ids, weights = ranks[world.rank]
            w1r, w2r = _shard(p, w1, w2, world.rank)
            ref = moe.unsharded(x.double(), ids, weights.double(), w1.double(), w2.double(), act)
            h, handle, hb, handle_b, used, same = _beside_bsp(fused, bsp, kind, x, ids, weights, w1r)
            out[(hid, act, kind)] = {"used": used, "same": same, "pad_zero": bool((h[used:] == 0).all()),
                                     "h": _err(h, hb), "y bsp combine": _err(cbsp(h, w2r, handle), ref),
                                     "y fused combine": _err(cfused(h, w2r, handle), ref)}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_fused_dispatch_matches_float64_and_bsp(world):
    results = spawn(_dispatch_forward, world, timeout_s=900)
    for rank, r in enumerate(results):
        for case, v in r.items():
            assert all(v["same"].values()), (rank, case, v["same"])
            assert v["pad_zero"], (rank, case)
            assert max(v[n] for n in ("h", "y bsp combine", "y fused combine")) < TOL, (rank, case, v)
    for case in results[0]:
        if case[2] == "skewed":  # every row to rank 0: the other ranks receive none, so wait for no tile
            assert results[0][case]["used"] == world * T * K and all(r[case]["used"] == 0 for r in results[1:])


def _dispatch_many_tiles(world) -> dict:
    """24 tokens a rank, each routed to both of rank 0's experts: rank 0's groups hold 24 * W rows from every
    source, several 16-row m-tiles each (tiles spanning two sources' rows), 2 n-tiles of F; stale rows of an
    earlier call with more rows are zeroed beyond the used ones."""
    from autofuse.ops import moe_dispatch

    tokens, hid, ffn = 24, 64, 96
    p = moe.make_problem(moe.DISPATCH, "float32", world.size, tokens, hid, ffn, 2 * world.size, K, "swiglu")
    w1, _ = moe.expert_weights(p, 3)
    x = moe.tokens(p, world.rank, 3)
    w1r = w1.reshape(world.size, -1, *w1.shape[1:])[world.rank].reshape(moe.w1_shape(p)).contiguous()
    cfg = {**D_SMALL, "BLOCK_N": 64}
    fused, bsp = moe_dispatch.Fused().build(world, p, cfg), moe_dispatch.Bsp().build(world, p, {})
    weights = torch.rand(tokens, K, generator=torch.Generator().manual_seed(world.rank)) + 0.1
    out = {}
    for name, ids in (("all to rank 0", torch.tensor([[0, 1]] * tokens)),
                      ("half as many", torch.tensor([[0, 1]] * (tokens // 2) + [[2, 3]] * (tokens // 2)))):
        h = fused(x, ids, weights, w1r)[0].clone()
        hb, handle = bsp(x, ids, weights, w1r)
        used = int(handle.tensors["counts"].sum())
        out[name] = {"err": _err(h, hb), "rows": used, "pad_zero": bool((h[used:] == 0).all())}
    return out


def test_fused_dispatch_with_tiles_across_sources_and_fewer_rows_than_the_last_call():
    results = spawn(_dispatch_many_tiles, 2, timeout_s=900)
    assert results[0]["all to rank 0"]["rows"] == 2 * 24 * K and results[1]["all to rank 0"]["rows"] == 0, results
    assert results[0]["half as many"]["rows"] == 24 * K, results
    assert all(v["err"] < TOL and v["pad_zero"] for r in results for v in r.values()), results


def test_fused_dispatch_late_peer_raises_on_every_rank_leaves_nan_and_is_refused_until_rebuilt():
    results = spawn(_late_peer, 2, "hybrid", None, "fused", D_SMALL, timeout_s=600)
    assert all(r["tol"] == TOL for r in results), results
    _assert_late_peer(results)


def test_fused_combine_late_peer_raises_on_every_rank_leaves_nan_and_is_refused_until_rebuilt():
    results = spawn(_late_peer, 2, "fused", TINY_M, timeout_s=600)
    assert all(r["tol"] == TOL for r in results), results
    _assert_late_peer(results)


def test_fused_configs_space_defaults_and_checks():
    from autofuse.ops import moe_combine

    v = moe_combine.OP.variant("fused")
    assert v.family == "fused" and v.tunable and v.capturable
    for t, hid, f, e, k in ((1, 7168, 2048, 256, 8), (64, 2048, 768, 128, 8), (4096, 4096, 14336, 8, 2)):
        p = moe.make_problem(moe.COMBINE, "bfloat16", 2, t, hid, f, e, k, "swiglu")
        assert v.defaults(p) and all(v.check(p, c) is None for c in v.defaults(p)), p.key
        assert v.check(p, v.space(Trial(), p)) is None
    decode = moe.make_problem(moe.COMBINE, "bfloat16", 2, 1, 7168, 2048, 256, 8, "swiglu")
    prefill = moe.make_problem(moe.COMBINE, "bfloat16", 2, 4096, 4096, 14336, 8, 2, "swiglu")
    assert v.defaults(decode)[0]["BLOCK_M"] < v.defaults(prefill)[0]["BLOCK_M"]
    cfg = v.defaults(prefill)[0]
    assert "ENGINE" in v.check(prefill, {**cfg, "ENGINE": 1})
    assert "BLOCK_N" in v.check(prefill, {**cfg, "BLOCK_N": 96})
    assert "shared memory" in v.check(prefill, {**cfg, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "NUM_STAGES": 4})
    huge = moe.make_problem(moe.COMBINE, "bfloat16", 2, 65536, 4096, 14336, 8, 2, "swiglu")  # C x F > 2**31
    assert "2**31" in v.check(huge, cfg)


def test_fused_dispatch_configs_space_defaults_and_checks():
    from autofuse.ops import moe_dispatch

    v = moe_dispatch.OP.variant("fused")
    assert v.family == "fused" and v.tunable and v.capturable
    for t, hid, f, e, k in ((1, 7168, 2048, 256, 8), (64, 2048, 768, 128, 8), (4096, 4096, 14336, 8, 2)):
        p = moe.make_problem(moe.DISPATCH, "bfloat16", 2, t, hid, f, e, k, "swiglu")
        assert v.defaults(p) and all(v.check(p, c) is None for c in v.defaults(p)), p.key
        assert v.check(p, v.space(Trial(), p)) is None
    decode = moe.make_problem(moe.DISPATCH, "bfloat16", 2, 1, 7168, 2048, 256, 8, "swiglu")
    prefill = moe.make_problem(moe.DISPATCH, "bfloat16", 2, 4096, 4096, 14336, 8, 2, "swiglu")
    assert v.defaults(decode)[0]["BLOCK_M"] == 16 and v.defaults(prefill)[0]["BLOCK_M"] == 128
    assert v.defaults(decode)[0]["COMM_SMS"] < v.defaults(prefill)[0]["COMM_SMS"]
    cfg = v.defaults(prefill)[0]
    assert "COMM_SMS" in v.check(prefill, {k: c for k, c in cfg.items() if k != "COMM_SMS"})
    assert "COMM_SMS" in v.check(prefill, {**cfg, "COMM_SMS": 3})
    assert "BLOCK must" in v.check(prefill, {**cfg, "BLOCK": 100})
    assert "spill" in v.check(prefill, {**cfg, "BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8})  # two accumulators
    plain = moe.make_problem(moe.DISPATCH, "bfloat16", 2, 4096, 4096, 14336, 8, 2, "none")
    assert v.check(plain, {**cfg, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "num_warps": 8}) is None


SIG = {"h": "*bf16", "w2": "*bf16", "index": "*i64", "ends": "*i64", "tile_ends": "*i64", "dst": "*bf16",
       "sent": "*i64", "fault": "*i32", "box": "*i32", "box_half": "i32", "ctx": ["i32", "i32", "*i64", "*i32",
       "*i32", "*i32", "i64"], "flags": "*i32", "half_flags": "i32", "experts": "i32", "local": "i32", "ffn": "i32",
       "hidden": "i32", "dst_rows": "i32"}
DIV = ["h", "w2", "dst", "box", "box_half", "flags", "half_flags", "ffn", "hidden"]


@pytest.mark.parametrize("version", VERSIONS)
def test_fused_combine_compiles_for_sm90_with_uniform_bounded_waits_and_vector_rows(version):
    """Mixtral-like (8 experts over 2 ranks) and DeepSeek-like (256 over 8) launches compile for Hopper: no
    barrier in a per-thread branch, wgmma with cp.async loads pipelined in NUM_STAGES buffers, no spills,
    16-byte row stores into the peers' buffers, bounded waits, peers aborted on a timeout."""
    from test_moe_hybrid import A2A_SIG

    ctx = A2A_SIG["ctx"]
    reqs = []
    for name, consts, warps in (("mixtral", {"W_P2": 2, "E_P2": 8, "L_P2": 4, "BLOCK_M": 128, "BLOCK_N": 128,
                                             "BLOCK_K": 64, "NUM_STAGES": 3, "GROUP_M": 8}, 8),
                                ("deepseek", {"W_P2": 8, "E_P2": 256, "L_P2": 32, "BLOCK_M": 64, "BLOCK_N": 128,
                                              "BLOCK_K": 64, "NUM_STAGES": 3, "GROUP_M": 1}, 4)):
        sig = {**SIG, "ctx": ctx, **{k: "constexpr" for k in consts}}
        reqs.append(compile_request("autofuse.kernels.moe_fused", "combine_gemm_kernel", sig, consts,
                                    num_warps=warps, num_stages=1, divisible=DIV, name=name))
    consts = {r["name"]: r["constexprs"] for r in reqs}
    for name, k in compile_sm90_versions(reqs)[version].items():
        assert_uniform(k, name)
        assert_pipelined_gemm(k["ptx"], k["shared"], {**consts[name], "USE_TMA": False}, 227 << 10)
        assert "st.global.v4" in k["ptx"], name  # rows into the peers' buffers: 16-byte stores


D_SIG = {"x": "*bf16", "rows": "*bf16", "w1": "*bf16", "h": "*bf16", "sent": "*i64", "ids": "*i64", "order": "*i64",
         "counts_out": "*i64", "fault": "*i32", "scratch": "*i32", "box": "*i32", "box_half": "i32", "ctx": None,
         "flags": "*i32",
         "half_flags": "i32", "experts": "i32", "local": "i32", "topk": "i32", "hidden": "i32", "ffn": "i32",
         "w1_cols": "i32", "movers": "i32"}
D_DIV = ["x", "rows", "w1", "h", "box", "box_half", "flags", "half_flags", "hidden", "ffn", "w1_cols", "scratch"]


@pytest.mark.parametrize("version", VERSIONS)
def test_fused_dispatch_compiles_for_sm90_with_uniform_bounded_waits_and_two_accumulators(version):
    """The fused dispatch (Mixtral-like 8 experts over 2 ranks, 128 x 128 at 8 warps; DeepSeek-like 256 over 8,
    64 x 128 at 4 warps, and the decode default's 16-row tiles) compiles for Hopper: no barrier in a per-thread
    branch, wgmma (mma.sync at 16 rows) over cp.async loads pipelined in NUM_STAGES buffers, SwiGLU's two
    accumulators without spills, 16-byte row stores into the owners' buffers, bounded waits."""
    from test_moe_hybrid import A2A_SIG

    reqs = []
    for name, consts, warps in (("mixtral", {"W_P2": 2, "E_P2": 8, "L_P2": 4, "BLOCK_R": 1, "BLOCK_C": 4096,
                                             "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "NUM_STAGES": 3,
                                             "GROUP_M": 8}, 8),
                                ("deepseek", {"W_P2": 8, "E_P2": 256, "L_P2": 32, "BLOCK_R": 1, "BLOCK_C": 2048,
                                              "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "NUM_STAGES": 3,
                                              "GROUP_M": 1}, 4),
                                ("decode", {"W_P2": 8, "E_P2": 256, "L_P2": 32, "BLOCK_R": 1, "BLOCK_C": 2048,
                                            "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64, "NUM_STAGES": 3,
                                            "GROUP_M": 1}, 4)):
        sig = {**D_SIG, "ctx": A2A_SIG["ctx"], "SWIGLU": "constexpr", **{k: "constexpr" for k in consts}}
        reqs.append(compile_request("autofuse.kernels.moe_fused", "dispatch_gemm_kernel", sig,
                                    {**consts, "SWIGLU": True}, num_warps=warps, num_stages=1, divisible=D_DIV,
                                    name=name))
    consts = {r["name"]: r["constexprs"] for r in reqs}
    for name, k in compile_sm90_versions(reqs)[version].items():
        assert_uniform(k, name)
        if name == "decode":  # 16-row tiles: below wgmma's 64 rows, Triton uses mma.sync; still pipelined, no spills
            assert "mma.sync" in k["ptx"] and "cp.async.commit_group" in k["ptx"], name
            assert "ld.local" not in k["ptx"] and "st.local" not in k["ptx"], name
        else:
            assert_pipelined_gemm(k["ptx"], k["shared"], {**consts[name], "USE_TMA": False}, 227 << 10)
        assert "st.global.v4" in k["ptx"], name  # rows into the owners' buffers: 16-byte stores
        assert "atom.global.sys.release.exch.b32" in k["ptx"], name  # DATA released at system scope


@harness.gpu()
def test_gpu_fused_combine_eager_and_graph_replay_over_changing_routings():
    for rank, rows in enumerate(spawn(_gpu_graph, harness.gpu_world(), "fused", timeout_s=600)):
        bad = [r for r in rows if not r[1] <= r[2]]
        assert not bad, (rank, bad, rows)


@harness.gpu()
def test_gpu_fused_combine_late_peer_raises_on_every_rank_leaves_nan_and_is_refused_until_rebuilt():
    _assert_late_peer(spawn(_late_peer, harness.gpu_world(), "fused", None, device_kind="cuda", timeout_s=600))


@harness.gpu()
def test_gpu_fused_pair_eager_and_graph_replay_over_changing_routings():
    for rank, rows in enumerate(spawn(_gpu_graph, harness.gpu_world(), "fused", "fused", timeout_s=600)):
        bad = [r for r in rows if not r[1] <= r[2]]
        assert not bad, (rank, bad, rows)


@harness.gpu()
def test_gpu_fused_dispatch_late_peer_raises_on_every_rank_leaves_nan_and_is_refused_until_rebuilt():
    _assert_late_peer(spawn(_late_peer, harness.gpu_world(), "hybrid", None, "fused", None, device_kind="cuda",
                            timeout_s=600))

