"""MoE expert parallelism on CPU ranks: `autofuse.moe_dispatch` + `autofuse.moe_combine` against the
unsharded block in float64 (uniform, skewed and empty-expert routings, a rank receiving no rows, a rank
sending none to its peers), gradients against float64 autograd of the unsharded block, and a
torch.compile(fullgraph=True) graph of the pair, forward and backward."""
from __future__ import annotations

import pytest
import torch

from autofuse.comm.world import spawn
from autofuse.ops import moe

T, H, F, K = 4, 32, 16, 2
TOL = 1e-5


def _problem(world: int, local: int = 2, act: str = "swiglu") -> object:
    return moe.make_problem(moe.DISPATCH, "float32", world, T, H, F, local * world, K, act)


def _routing(kind: str, problem, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids and topk_weights of `rank` for a routing kind (the same on every rank that rebuilds it)."""
    ids, weights = moe.routing(problem, rank, seed)
    e, w = problem["E"], problem.world
    local = e // w
    if kind == "skewed":  # every row to rank 0's experts: the other ranks receive none
        ids = torch.stack([torch.randperm(local, generator=torch.Generator().manual_seed(seed + 100 * rank + t))[:K]
                           for t in range(T)])
    elif kind == "empty_experts":  # only the first and the last expert: the others (and middle ranks) get none
        ids = torch.tensor([[0, e - 1]] * T)
    elif kind == "self":  # rank 1 routes to its own experts only: it sends nothing to its peers
        if rank == 1:
            ids = local + torch.stack([torch.randperm(local, generator=torch.Generator().manual_seed(t))[:K]
                                       for t in range(T)])
    return ids, weights


def _global(problem, kind: str, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Every rank's (x, ids, weights) and the global w1, w2 (float32)."""
    w1, w2 = moe.expert_weights(problem, seed)
    ranks = [(moe.tokens(problem, r, seed), *_routing(kind, problem, r, seed)) for r in range(problem.world)]
    return ranks, w1, w2


def _shard(problem, w1: torch.Tensor, w2: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = problem["E"] // problem.world
    mine = slice(rank * local, (rank + 1) * local)
    return w1[mine].reshape(moe.w1_shape(problem)).contiguous(), w2[mine].contiguous()


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b).norm() / max(b.norm(), 1e-30))


def _forward_cases(world) -> dict:
    import autofuse
    from autofuse import dispatch
    from autofuse.dispatch.policy import Policy
    from autofuse.ops import moe_combine, moe_dispatch

    dispatch.set_policy(Policy.bsp("moe tests"))
    out = {}
    for act in ("swiglu", "none"):
        problem = _problem(world.size, act=act)
        for kind in ("uniform", "skewed", "empty_experts", "self"):
            ranks, w1, w2 = _global(problem, kind, 1)
            x, ids, weights = ranks[world.rank]
            w1r, w2r = _shard(problem, w1, w2, world.rank)
            h, handle = autofuse.moe_dispatch(x, ids, weights, w1r, group=world)
            y = autofuse.moe_combine(h, w2r, handle, group=world)
            ref = moe.unsharded(x.double(), ids, weights.double(), w1.double(), w2.double(), act)
            used = int(handle.tensors["counts"].sum())
            out[(act, kind)] = {"y": _err(y, ref), "used": used, "pad_zero": bool((h[used:] == 0).all()),
                                "C": h.shape[0]}
    # the ops' own problems and references (what the tuner checks), skew even and 100%
    for skew in (None, 100):
        p = moe.make_problem(moe.DISPATCH, "float32", world.size, T, H, F, 2 * world.size, K, "swiglu", skew)
        h, handle = autofuse.moe_dispatch(*moe_dispatch.inputs(world, p, 3), group=world)
        cp = moe_combine.problem_of(world, h, moe.rank_inputs(p, world.rank, 3)[4], handle)
        out[("reference", skew)] = {"h": _err(h, moe_dispatch.reference(world, p, 3)[0]),
                                    "y": _err(moe_combine.Bsp().build(world, cp, {})(*moe_combine.inputs(world, cp, 3)),
                                              moe_combine.reference(world, cp, 3))}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_and_combine_match_the_unsharded_block(world):
    results = spawn(_forward_cases, world, timeout_s=600)
    for rank, r in enumerate(results):
        for case, v in r.items():
            assert max(x for k, x in v.items() if k in ("y", "h")) < TOL, (rank, case, v)
            if "C" in v:
                assert v["C"] == world * T * K and v["pad_zero"], (rank, case, v)
    for act in ("swiglu", "none"):
        assert sum(r[(act, "skewed")]["used"] for r in results) == world * T * K
        assert results[0][(act, "skewed")]["used"] == world * T * K  # rank 0 received every row
        assert all(r[(act, "skewed")]["used"] == 0 for r in results[1:])  # the others none
        if world == 4:
            assert results[1][(act, "empty_experts")]["used"] == 0 == results[2][(act, "empty_experts")]["used"]


def _grads(world, compiled: bool) -> dict:
    import autofuse
    from autofuse import dispatch
    from autofuse.dispatch.policy import Policy

    dispatch.set_policy(Policy.bsp("moe tests"))
    problem = _problem(world.size)
    out = {}
    for kind in ("uniform", "skewed"):
        ranks, w1, w2 = _global(problem, kind, 2)
        gens = [torch.Generator().manual_seed(50 + r) for r in range(world.size)]
        gs = [torch.randn(T, H, generator=g) for g in gens]
        # float64 autograd of the unsharded block, every rank's tokens (rank r's loss term uses its own g)
        xs = [x.double().requires_grad_() for x, _, _ in ranks]
        ws = [wt.double().requires_grad_() for _, _, wt in ranks]
        g1, g2 = w1.double().requires_grad_(), w2.double().requires_grad_()
        sum((moe.unsharded(x, ids, wt, g1, g2, "swiglu") * g.double()).sum()
            for x, (_, ids, _), wt, g in zip(xs, ranks, ws, gs)).backward()
        r = world.rank
        x, ids, weights = ranks[r]
        w1r, w2r = _shard(problem, w1, w2, r)
        leaves = [t.clone().requires_grad_() for t in (x, weights, w1r, w2r)]

        def block(x, weights, w1r, w2r):
            h, handle = autofuse.moe_dispatch(x, ids, weights, w1r, group=world)
            return autofuse.moe_combine(h, w2r, handle, group=world)

        fn = torch.compile(block, fullgraph=True, backend="aot_eager") if compiled else block
        y = fn(*leaves)
        (y * gs[r]).sum().backward()
        local = problem["E"] // world.size
        mine = slice(r * local, (r + 1) * local)
        refs = (xs[r].grad, ws[r].grad, g1.grad[mine].reshape(moe.w1_shape(problem)), g2.grad[mine])
        out[kind] = {"y": _err(y, moe.unsharded(x.double(), ids, weights.double(), w1.double(), w2.double(), "swiglu")),
                     **{n: _err(t.grad, ref) for n, t, ref in zip(("dx", "dweights", "dw1", "dw2"), leaves, refs)}}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_gradients_match_float64_autograd_of_the_unsharded_block(world):
    for rank, r in enumerate(spawn(_grads, world, False, timeout_s=600)):
        for kind, errs in r.items():
            assert max(errs.values()) < TOL, (rank, kind, errs)


def test_dispatch_and_combine_compile_fullgraph_forward_and_backward():
    for rank, r in enumerate(spawn(_grads, 2, True, timeout_s=600)):
        for kind, errs in r.items():
            assert max(errs.values()) < TOL, (rank, kind, errs)


def _bad_inputs(world) -> list[str]:
    import autofuse
    from autofuse import dispatch
    from autofuse.core.op import InvalidInput
    from autofuse.core.runner import Handle
    from autofuse.dispatch.policy import Policy

    dispatch.set_policy(Policy.bsp("moe tests"))
    problem = _problem(world.size)
    x, ids, weights, w1r, w2r = moe.rank_inputs(problem, world.rank, 0)
    said = []
    for call in (lambda: autofuse.moe_dispatch(x, ids, weights, w1r[:, 1:].contiguous(), group=world),
                 lambda: autofuse.moe_combine(torch.zeros(3, F), w2r, Handle("nope"), group=world)):
        try:
            call()
        except InvalidInput as exc:
            said.append(str(exc))
    return said


def test_bad_arguments_raise_on_every_rank_saying_what():
    for said in spawn(_bad_inputs, 2, timeout_s=300):
        assert len(said) == 2
        assert "w1" in said[0] and "handle" in said[1], said


def test_tune_measures_the_pair_on_cpu(tmp_path):
    """`autofuse tune` checks and times both ops (several outputs, a handle made by the partner) on CPU ranks."""
    import subprocess
    import sys

    from autofuse.measure.store import Store

    db = tmp_path / "moe.db"
    proc = subprocess.run([sys.executable, "-m", "autofuse", "tune", "--op", "moe_dispatch,moe_combine", "--limit", "1",
                           "--world", "2", "--db", str(db)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "covered: moe_dispatch 1/1 problems, moe_combine 1/1 problems" in proc.stdout, proc.stdout[-3000:]
    with Store.open(db, readonly=True) as store:
        assert {r["op"] for r in store.best(None, "eager")} == {"moe_dispatch", "moe_combine"}


def test_a_default_gpu_tune_leaves_moe_out_and_the_moe_sweep_takes_it():
    """On GPUs a plain `autofuse tune` plans the TP ops only: MoE's BSP has no graph-mode baseline and its
    references run on the host (on 4x H200, 2026-11-27, two MoE baselines spent 130 s of a 3.5-minute
    default tune and failed); `--sweep moe` tunes the MoE ops."""
    from autofuse.tuning.tune import TuneOptions, make_plan

    default = make_plan(TuneOptions(db="x.db"), "cuda", 2)
    assert not {op.name for _, op, _, _ in default.items} & {"moe_dispatch", "moe_combine"}
    moe = make_plan(TuneOptions(db="x.db", sweep="moe"), "cuda", 2)
    assert {op.name for _, op, _, _ in moe.items} == {"moe_dispatch", "moe_combine"}
