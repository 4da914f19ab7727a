"""MoE's `hybrid` variants (kernels/moe.py's heap all-to-all beside the grouped GEMM) on CPU ranks under
Triton's interpreter: against float64 and against bsp (the same handle, so either combine takes either
dispatch's), uniform / skewed / empty-expert routings, a rank receiving no rows and one sending none to
its peers, several programs and rows wider than a copy step; gradients when both pick hybrid (eager and
torch.compile); a late peer (bounded wait, every rank raises, NaN outputs, refused until rebuilt); the
configs; an sm_90 compile of the kernel; on GPUs (marker gpu) a CUDA graph replayed over changing routings, and
the gradient and late-peer jobs again (device-agnostic: float32 on CPU ranks, bfloat16 on GPUs)."""
from __future__ import annotations

import os
import time

import pytest
import torch

import harness
from autofuse.comm.world import spawn
from conftest import CTX, VERSIONS, assert_uniform, compile_request, compile_sm90_versions
from autofuse.ops import moe
from test_moe import _dtype_for, _global, _grads, _shard, _tol_for

T, F, K = 4, 16, 2
TOL = 1e-5
SMALL = {"COMM_SMS": 2, "BLOCK": 1024, "num_warps": 4}  # H=32: one program moves 32-row blocks
# H=1536: BLOCK_C 1024, so two column steps (the second masked), one row per step, four programs
WIDE = {"COMM_SMS": 4, "BLOCK": 1024, "num_warps": 4}
ROUTINGS = ("uniform", "skewed", "empty_experts", "self")


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error of `a` from `b` (either on any device), in float64 on the CPU."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / max(b.norm(), 1e-30))


CASES = ((32, "swiglu", SMALL), (32, "none", SMALL), (1536, "swiglu", WIDE))  # H, act, config


def _forward(world) -> dict:
    """Every routing through both hybrids and across (hybrid dispatch -> bsp combine and back); 4 ranks skip
    act none (the interpreter's time grows with the ranks sharing 2 cores)."""
    from autofuse.ops import moe_combine, moe_dispatch

    out = {}
    for hid, act, cfg in CASES if world.size == 2 else CASES[::2]:
        p = moe.make_problem(moe.DISPATCH, "float32", world.size, T, hid, F, 2 * world.size, K, act)
        hybrid, bsp = moe_dispatch.Hybrid().build(world, p, cfg), moe_dispatch.Bsp().build(world, p, {})
        cp = _combine_problem(world, p)
        chybrid, cbsp = moe_combine.Hybrid().build(world, cp, cfg), moe_combine.Bsp().build(world, cp, {})
        for kind in ROUTINGS:
            ranks, w1, w2 = _global(p, kind, 1)
            x, ids, weights = ranks[world.rank]
            w1r, w2r = _shard(p, w1, w2, world.rank)
            ref = moe.unsharded(x.double(), ids, weights.double(), w1.double(), w2.double(), act)
            h, handle, hb, handle_b, used, same = _beside_bsp(hybrid, bsp, kind, x, ids, weights, w1r)
            out[(hid, act, kind)] = {
                "used": used, "same": same, "pad_zero": bool((h[used:] == 0).all()),
                "h": _err(h, hb), "y": _err(chybrid(h, w2r, handle), ref),
                "y bsp dispatch": _err(chybrid(hb, w2r, handle_b), ref),  # hybrid combine, bsp's handle
                "y bsp combine": _err(cbsp(h, w2r, handle), ref)}         # bsp combine, hybrid's handle
    return out


def _beside_bsp(runner, bsp, kind: str, x, ids, weights, w1r) -> tuple:
    """A heap dispatch (`runner`, int32 ids for the `self` routing) and bsp's on the same call, copied:
    (h, handle, h bsp, handle bsp, used rows, {handle tensor: equal to bsp's}, rows compared up to `used`)."""
    h, handle = runner(x, ids.int() if kind == "self" else ids, weights, w1r)
    h, handle = h.clone(), _copy(handle)
    hb, handle_b = bsp(x, ids, weights, w1r)
    hb, handle_b = hb.clone(), _copy(handle_b)
    used = int(handle.tensors["counts"].sum())
    same = {n: bool(torch.equal(handle.tensors[n], handle_b.tensors[n]))
            for n in ("counts", "sent", "order", "index", "weights")}
    same["rows"] = bool(torch.equal(handle.tensors["rows"][:used], handle_b.tensors["rows"][:used]))
    return h, handle, hb, handle_b, used, same


def _combine_problem(world, p):
    from autofuse.core.op import Problem

    return Problem.make(moe.COMBINE, p.dtype, p.world, **dict(p.dims))


def _copy(handle):
    from autofuse.core.runner import Handle

    return Handle(handle.key, **{n: t.clone() for n, t in handle.tensors.items()})


@pytest.mark.parametrize("world", [2, 4])
def test_hybrid_matches_float64_and_bsp(world):
    results = spawn(_forward, world, timeout_s=600)
    for rank, r in enumerate(results):
        for case, v in r.items():
            assert all(v["same"].values()), (rank, case, v["same"])
            assert v["pad_zero"], (rank, case)
            assert max(v[n] for n in ("h", "y", "y bsp dispatch", "y bsp combine")) < TOL, (rank, case, v)
    for case in results[0]:
        if case[2] == "skewed":  # every row to rank 0: the other ranks receive none
            assert results[0][case]["used"] == world * T * K and all(r[case]["used"] == 0 for r in results[1:])


def _grads_hybrid(world) -> dict:
    """test_moe's `_grads` (device-agnostic) eager and compiled with both ops forced to hybrid, and what
    explain() says ran: {"errs": {kind: errors}, "tol", "backend" (the compiled one's), "chosen"}."""
    import autofuse
    from autofuse.ops import moe_dispatch

    os.environ["AUTOFUSE_VARIANT"] = "moe_dispatch:hybrid,moe_combine:hybrid"
    eager, compiled = _grads(world, False), _grads(world, True)
    errs = {**eager["errs"], **{f"compiled {k}": v for k, v in compiled["errs"].items()}}
    p = moe.make_problem(moe.DISPATCH, _dtype_for(world.device), world.size, T, 32, F, 2 * world.size, K, "swiglu")
    x, ids, weights, w1 = moe_dispatch.inputs(world, p, 0)
    h, handle = autofuse.moe_dispatch(x, ids, weights, w1, group=world)
    w2 = moe.rank_inputs(p, world.rank, 0, world.device)[4]
    chosen = (autofuse.explain("moe_dispatch", x, ids, weights, w1, group=world).variant,
              autofuse.explain("moe_combine", h, w2, handle, group=world).variant)
    return {"errs": errs, "tol": eager["tol"], "backend": compiled["backend"], "chosen": chosen}


def _assert_grads_hybrid(results: list) -> None:
    for rank, r in enumerate(results):
        assert r["chosen"] == ("hybrid", "hybrid"), r["chosen"]
        for kind, errs in r["errs"].items():
            assert max(errs.values()) < r["tol"], (rank, kind, r["tol"], errs)


def test_gradients_when_dispatch_and_combine_pick_hybrid_eager_and_compiled():
    """test_moe's float64 gradient check with both ops forced to hybrid, eager and under
    torch.compile(fullgraph=True, backend aot_eager); explain() says hybrid ran."""
    results = spawn(_grads_hybrid, 2, timeout_s=600)
    assert all(r["tol"] == TOL and r["backend"] == "aot_eager" for r in results), results
    _assert_grads_hybrid(results)


def _confirm_pair(world) -> dict:
    """First-use confirmation (what dispatch runs on a problem no table holds) of each op with hybrid
    against bsp: the dispatch's outputs hold a handle, the combine takes one."""
    from autofuse.dispatch import confirm
    from autofuse.ops import moe_combine, moe_dispatch

    confirm.ROTATE_ON_CPU = True  # several input sets and scratch outputs, as on GPUs
    p = moe.make_problem(moe.DISPATCH, "float32", world.size, T, 32, F, 2 * world.size, K, "swiglu")
    args = moe_dispatch.inputs(world, p, 0)
    got = {"dispatch": confirm.confirm(world, moe_dispatch.OP, p, args, [("hybrid", SMALL)], "eager", budget_s=0.5)}
    cp = _combine_problem(world, p)
    got["combine"] = confirm.confirm(world, moe_combine.OP, cp, moe_combine.inputs(world, cp, 0), [("hybrid", SMALL)],
                                     "eager", budget_s=0.5)
    return {name: (sorted(v for v, _, _ in c.timed), c.dropped, c.sets) for name, c in got.items()}


def test_first_use_confirmation_compares_outputs_beside_a_handle():
    """Confirmation compared BSP's (output, handle) with a candidate's and died on the handle
    (AttributeError on every GPU call of an untuned MoE problem); with several input sets (GPUs) its
    scratch outputs must be Outputs beside a handle too."""
    for rank, r in enumerate(spawn(_confirm_pair, 2, timeout_s=600)):
        for name, (timed, dropped, sets) in r.items():
            assert timed == ["bsp", "hybrid"] and not dropped and sets > 1, (rank, name, timed, dropped, sets)


def _late_peer(world, combine: str = "hybrid", combine_config: dict | None = None, dispatch: str = "hybrid",
               dispatch_config: dict | None = None) -> dict:
    """Per op (the `combine` / `dispatch` variant at its config, default hybrid at SMALL, else the variant's
    first default): 4 calls; the last rank sleeps past the wait budget before call 1. What each call did:
    ('returned', error) or (exception, elements of the output that are not NaN: the kernel's own
    epilogue's, before the host check, and after it, seconds it took); then autofuse.rebuild and a 5th call.
    Device-agnostic: {"tol", "seen": {op: rows}}; inputs drawn on the CPU (float32, rounded to bfloat16 on
    GPUs) and moved to world.device, the float64 reference kept on the CPU."""
    import autofuse
    from autofuse.comm.status import FlagTimeout, WorkspaceAborted
    from autofuse.ops import moe_combine, moe_dispatch

    os.environ["AUTOFUSE_WAIT_TIMEOUT"] = str(harness.FAULT_BUDGET_S)  # before the workspaces are made
    dev = world.device
    p = moe.make_problem(moe.DISPATCH, _dtype_for(dev), world.size, T, 32, F, 2 * world.size, K, "swiglu")
    cp = _combine_problem(world, p)
    ranks, w1, w2 = _global(p, "uniform", 1)
    x, ids, weights = ranks[world.rank]
    x, w1, w2 = (t.to(p.torch_dtype) for t in (x, w1, w2))
    ref = moe.unsharded(x.double(), ids, weights.double(), w1.double(), w2.double(), "swiglu")
    x, ids, weights = (t.to(dev) for t in (x, ids, weights))
    w1r, w2r = (t.to(dev) for t in _shard(p, w1, w2, world.rank))
    hb, handle = moe_dispatch.Bsp().build(world, p, {})(x, ids, weights, w1r)
    hb, handle = hb.clone(), _copy(handle)
    def build(op, variant: str, config: dict | None, problem):
        v = op.variant(variant)
        return v.build(world, problem, config or (SMALL if variant == "hybrid" else v.defaults(problem)[0]))

    cases = (("dispatch", build(moe_dispatch.OP, dispatch, dispatch_config, p), (x, ids, weights, w1r),
              lambda o: _err(o[0], hb)),
             ("combine", build(moe_combine.OP, combine, combine_config, cp), (hb, w2r, handle),
              lambda o: _err(o, ref)))
    if dev.type == "cuda":
        _warm(world, [(runner, args) for _, runner, args, _ in cases])
    seen = {}
    for name, runner, args, check in cases:
        rows = []
        for i in range(5):
            if i == 4:
                autofuse.rebuild(world)
            if i == 1 and world.rank == world.size - 1:
                time.sleep(harness.FAULT_BUDGET_S + 1.0)
            out, t0 = None, time.monotonic()
            try:
                out = runner(*args)
                first = out[0] if name == "dispatch" else out
                kernel_nan = int((~torch.isnan(first)).sum())
                runner.check(out)
                rows.append(("returned", check(out)))
            except (FlagTimeout, WorkspaceAborted) as exc:
                if out is None:  # refused before launching
                    rows.append((type(exc).__name__, -1, -1, time.monotonic() - t0))
                else:
                    first = out[0] if name == "dispatch" else out
                    rows.append((type(exc).__name__, kernel_nan, int((~torch.isnan(first)).sum()),
                                 time.monotonic() - t0))
            world.sync()
        seen[name] = rows
    return {"tol": _tol_for(p), "seen": seen}


def _warm(world, calls: list) -> None:
    """GPUs: one call of each (runner, args), then autofuse.rebuild (clean workspaces whatever happened):
    Triton compiles a kernel at a rank's first launch, and ranks whose compiles end further apart than the
    fault runs' budget (harness.FAULT_BUDGET_S) would time out before the scenario starts."""
    import autofuse

    for runner, args in calls:
        try:
            runner.check(runner(*args))
        except harness.FAULTS:
            pass
        world.sync()
    autofuse.rebuild(world)


def _assert_late_peer(results: list) -> None:
    for rank, r in enumerate(results):
        for name, rows in r["seen"].items():
            assert rows[0] == ("returned", rows[0][1]) and rows[0][1] < r["tol"], (rank, name, rows)
            kind, kernel_left, left, took = rows[1]
            assert kind == "FlagTimeout", (rank, name, rows)
            assert kernel_left == 0 and left == 0, (rank, name, rows)  # NaN from the kernel's epilogue already
            assert took <= harness.FAULT_BUDGET_S + 5.0, (rank, name, rows)
            assert [row[0] for row in rows[2:4]] == ["WorkspaceAborted"] * 2, (rank, name, rows)
            assert rows[4][0] == "returned" and rows[4][1] < r["tol"], (rank, name, rows)


def test_late_peer_raises_on_every_rank_leaves_nan_and_is_refused_until_rebuilt():
    results = spawn(_late_peer, 2, timeout_s=600)
    assert all(r["tol"] == TOL for r in results), results
    _assert_late_peer(results)


class Trial:
    """A search space that takes the first choice of everything (a variant's `space` checked without Optuna)."""

    def suggest_categorical(self, name, choices):
        return choices[0]


def test_configs_space_defaults_and_checks():
    from autofuse.ops import moe_combine, moe_dispatch

    for op in (moe_dispatch.OP, moe_combine.OP):
        v = op.variant("hybrid")
        assert v.family == "hybrid" and v.tunable
        for t, hid, k in ((1, 7168, 8), (64, 2048, 8), (4096, 7168, 8)):
            p = moe.make_problem(op.name, "bfloat16", 8, t, hid, 2048, 256, k, "swiglu")
            assert v.defaults(p) and all(v.check(p, c) is None for c in v.defaults(p)), p.key
            assert v.check(p, v.space(Trial(), p)) is None
        assert "ENGINE" in v.check(p, {**v.defaults(p)[0], "ENGINE": "sm"})
        assert "BLOCK" in v.check(p, {**v.defaults(p)[0], "BLOCK": 100})
        assert "COMM_SMS" in v.check(p, {**v.defaults(p)[0], "COMM_SMS": 0})
    small = moe.make_problem(moe.DISPATCH, "bfloat16", 8, 1, 7168, 2048, 256, 8, "swiglu")
    big = moe.make_problem(moe.DISPATCH, "bfloat16", 8, 4096, 7168, 2048, 256, 8, "swiglu")
    assert moe_dispatch.OP.variant("hybrid").defaults(small)[0]["COMM_SMS"] < \
        moe_dispatch.OP.variant("hybrid").defaults(big)[0]["COMM_SMS"]


# -- sm_90 compiles --------------------------------------------------------------------------------------
A2A_SIG = {"src": "*bf16", "dst": "*bf16", "sent": "*i64", "ids": "*i64", "order": "*i64", "inv": "*i64",
           "counts_out": "*i64", "fault": "*i32", "scratch": "*i32", "box": "*i32", "box_half": "i32", "ctx": CTX,
           "flags": "*i32", "half_flags": "i32", "experts": "i32", "local": "i32", "topk": "i32", "width": "i32",
           "dst_rows": "i32", "MODE": "constexpr", "W_P2": "constexpr", "E_P2": "constexpr", "BLOCK_R": "constexpr",
           "BLOCK_C": "constexpr"}
A2A_DIV = ["src", "dst", "box", "box_half", "flags", "half_flags", "width", "scratch"]


@pytest.mark.parametrize("version", VERSIONS)
def test_all_to_all_compiles_for_sm90_with_uniform_bounded_waits_and_vector_rows(version):
    """Both directions (int64 and int32 ids; the DeepSeek-like 256 experts over 8 ranks, 8 warps and 16;
    Mixtral's 8 over 2, where sums stay within a warp) compile for Hopper: no barrier in a per-thread branch, 16-byte row stores, waits polled and bounded,
    flags released at system scope, a timed-out wait aborting the peers."""
    reqs = []
    big, small = {"W_P2": 8, "E_P2": 256, "BLOCK_R": 1, "BLOCK_C": 8192}, {"W_P2": 2, "E_P2": 8, "BLOCK_R": 2, "BLOCK_C": 4096}
    for name, mode, ids, warps, tile in (("dispatch", 0, "*i64", 8, big), ("dispatch_i32", 0, "*i32", 16, big),
                                         ("combine", 1, "*i64", 8, big), ("dispatch_mixtral", 0, "*i64", 4, small),
                                         ("combine_mixtral", 1, "*i64", 4, small)):
        consts = {"MODE": mode, **tile}
        reqs.append(compile_request("autofuse.kernels.moe", "all_to_all_kernel", {**A2A_SIG, "ids": ids}, consts,
                                    num_warps=warps, num_stages=1, divisible=A2A_DIV, name=name))
    for name, k in compile_sm90_versions(reqs)[version].items():
        assert_uniform(k, name)
        ptx = k["ptx"]
        assert "st.global.v4" in ptx, name
        assert "ld.volatile.global" in ptx and "%globaltimer" in ptx, name
        assert "atom.global.sys.release.exch.b32" in ptx and "atom.global.release.sys.cas.b32" in ptx, name


ROWS_SIG = {"pre": "*bf16", "h": "*bf16", "ends": "*i64", "last": "i32", "fault": "*i1", "rows": "i32", "width": "i32",
            "ACT": "constexpr", "BLOCK_R": "constexpr", "BLOCK_C": "constexpr"}
SUM_SIG = {"back": "*bf16", "pos": "*i64", "weights": "*fp32", "out": "*bf16", "fault": "*i1", "tokens": "i32",
           "width": "i32", "TOPK": "constexpr", "BLOCK_T": "constexpr", "BLOCK_C": "constexpr"}
SETTLE_SIG = {"h": "*bf16", "ends": "*i64", "last": "i32", "fault": "*i1", "rows": "i32", "width": "i32",
              "BLOCK_R": "constexpr", "BLOCK_C": "constexpr"}


@pytest.mark.parametrize("version", VERSIONS)
def test_row_epilogues_compile_for_sm90_with_vector_rows(version):
    """The row epilogues (kernels/moe_rows.py) compile for Hopper with 16-byte row loads and stores (the
    launch's block sizes at F=768 and H=7168, SwiGLU and copy, top-8; the fused dispatch's settle pass)."""
    reqs = [compile_request("autofuse.kernels.moe_rows", "act_rows_kernel", ROWS_SIG,
                            {"ACT": act, "BLOCK_R": 16, "BLOCK_C": 256}, num_warps=4, num_stages=1,
                            divisible=["pre", "h", "width"], name=f"act{act}") for act in (0, 1)]
    reqs.append(compile_request("autofuse.kernels.moe_rows", "weighted_sum_kernel", SUM_SIG,
                                {"TOPK": 8, "BLOCK_T": 4, "BLOCK_C": 512}, num_warps=4, num_stages=1,
                                divisible=["back", "out", "width"], name="weighted_sum"))
    reqs.append(compile_request("autofuse.kernels.moe_rows", "settle_rows_kernel", SETTLE_SIG,
                                {"BLOCK_R": 16, "BLOCK_C": 256}, num_warps=4, num_stages=1, divisible=["h", "width"],
                                name="settle"))
    for name, k in compile_sm90_versions(reqs)[version].items():
        ptx = k["ptx"]
        assert "st.global.v4" in ptx or "st.global.v2" in ptx, name
        if name != "settle":  # settle only stores
            assert "ld.global.v4" in ptx or "ld.global.nc.v4" in ptx or "ld.global.v2" in ptx, name


# -- GPU (marker gpu): bfloat16, torch._grouped_mm, one CUDA graph replayed over changing routings ------------
GPU_DIMS = dict(tokens=64, hidden=2048, ffn=768, topk=4, act="swiglu")  # Qwen3-30B-A3B's H and F, 8 experts a rank


def _gpu_routing(problem, kind: str, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uniform, skewed (every row to rank 0's experts: the others receive none) or empty_experts (only the
    first k experts of rank 0 and the last expert: most experts and the middle ranks get none)."""
    ids, weights = moe.routing(problem, rank, seed)
    if kind == "skewed":
        ids = torch.stack([torch.randperm(problem["E"] // problem.world, generator=torch.Generator().manual_seed(
            seed * 1000 + rank * 100 + t))[:problem["k"]] for t in range(problem["T"])])
    elif kind == "empty_experts":
        ids = torch.tensor([[*range(problem["k"] - 1), problem["E"] - 1]] * problem["T"])
    return ids, weights


def _gpu_graph(world, combine: str = "hybrid", dispatch: str = "hybrid") -> list[tuple[str, float, float]]:
    """(case, relative error vs float64, tolerance): eager through the public API with dispatch forced to
    `dispatch` and combine to `combine`, then the runner pair captured once in a CUDA graph and replayed with each routing's inputs
    copied in (the counts change between replays; the host never reads them)."""
    import autofuse
    from autofuse.measure.timing import capture
    from autofuse.ops import moe_combine, moe_dispatch

    os.environ["AUTOFUSE_VARIANT"] = f"moe_dispatch:{dispatch},moe_combine:{combine}"
    p = moe.make_problem(moe.DISPATCH, "bfloat16", world.size, experts=8 * world.size, **GPU_DIMS)
    tol, dev, out = moe.tolerance(p), world.device, []
    _, _, _, w1r, w2r = (t.to(dev) for t in moe.rank_inputs(p, world.rank, 0))
    w1, w2 = (t.to(p.torch_dtype).double() for t in moe.expert_weights(p, 0))

    def case(kind: str, seed: int):
        ids, weights = _gpu_routing(p, kind, world.rank, seed)
        x = moe.tokens(p, world.rank, seed).to(p.torch_dtype)
        ref = moe.unsharded(x.double(), ids, weights.double(), w1, w2, "swiglu").to(dev)
        return x.to(dev), ids.to(dev), weights.to(dev), ref

    for i, kind in enumerate(("uniform", "skewed", "empty_experts")):
        x, ids, weights, ref = case(kind, i)
        h, handle = autofuse.moe_dispatch(x, ids, weights, w1r, group=world)
        out.append((f"eager {kind}", _err(autofuse.moe_combine(h, w2r, handle, group=world), ref), tol))
    dr = moe_dispatch.OP.variant(dispatch).build(world, p, moe_dispatch.OP.variant(dispatch).defaults(p)[0])
    cp = _combine_problem(world, p)
    cr = moe_combine.OP.variant(combine).build(world, cp, moe_combine.OP.variant(combine).defaults(cp)[0])
    x_s, ids_s, w_s, _ = case("uniform", 10)
    y = torch.empty(p["T"], p["H"], dtype=p.torch_dtype, device=dev)

    def step():
        h, handle = dr(x_s, ids_s, w_s, w1r)
        cr(h, w2r, handle, out=y)

    graph = capture(world, step)
    for i, kind in enumerate(("uniform", "skewed", "empty_experts", "uniform")):
        x, ids, weights, ref = case(kind, 20 + i)
        x_s.copy_(x), ids_s.copy_(ids), w_s.copy_(weights)
        y.fill_(float("nan"))
        world.sync()
        graph.replay()
        world.sync()
        dr.check(), cr.check()
        out.append((f"graph replay {i} {kind}", _err(y, ref), tol))
    return out


@harness.gpu()
def test_gpu_eager_and_graph_replay_over_changing_routings():
    for rank, rows in enumerate(spawn(_gpu_graph, harness.gpu_world(), timeout_s=600)):
        bad = [r for r in rows if not r[1] <= r[2]]
        assert not bad, (rank, bad, rows)


@harness.gpu()
def test_gpu_gradients_when_both_ops_pick_hybrid_eager_and_compiled():
    """The CPU test's job on GPUs: bfloat16 (torch._grouped_mm forward and in the backward's custom ops, NCCL
    all-to-alls there), at moe.tolerance, eager and torch.compile(fullgraph=True, backend inductor)."""
    results = spawn(_grads_hybrid, harness.gpu_world(), device_kind="cuda", timeout_s=600)
    assert all(r["backend"] == "inductor" for r in results), [r["backend"] for r in results]
    _assert_grads_hybrid(results)


@harness.gpu()
def test_gpu_late_peer_raises_on_every_rank_leaves_nan_and_is_refused_until_rebuilt():
    """The CPU test's job on GPUs (bfloat16, after a warm-up call of each runner and a rebuild)."""
    _assert_late_peer(spawn(_late_peer, harness.gpu_world(), device_kind="cuda", timeout_s=600))
