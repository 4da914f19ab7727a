"""MoE expert parallelism on CPU ranks: `autofuse.moe_dispatch` + `autofuse.moe_combine` against the
unsharded block in float64 (uniform, skewed and empty-expert routings, a rank receiving no rows, a rank
sending none to its peers), gradients against float64 autograd of the unsharded block, and a
torch.compile(fullgraph=True) graph of the pair, forward and backward. The gradient job (`_grads`) is
device-agnostic: test_moe_hybrid runs it on GPUs too (bfloat16)."""
from __future__ import annotations

import pytest
import torch

from autofuse.comm.world import spawn
from autofuse.ops import moe

T, H, F, K = 4, 32, 16, 2
TOL = 1e-5  # float32 on CPU ranks


def _problem(world: int, local: int = 2, act: str = "swiglu", dtype: str = "float32") -> object:
    return moe.make_problem(moe.DISPATCH, dtype, world, T, H, F, local * world, K, act)


def _dtype_for(device: torch.device) -> str:
    """The dtype of a device-agnostic job: float32 on CPU ranks (the interpreter); bfloat16 on GPUs, where the
    grouped GEMMs run torch._grouped_mm (forward and backward: what models train in)."""
    return "bfloat16" if device.type == "cuda" else "float32"


def _tol_for(problem) -> float:
    """TOL for float32 (CPU ranks), else the op's own tolerance (moe.tolerance: bfloat16 on GPUs)."""
    return TOL if problem.dtype == "float32" else moe.tolerance(problem)


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
    """Norm-wise relative error of `a` (any device) from the float64 `b`, on the CPU."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / max(b.norm(), 1e-30))


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
    """This rank's output and gradients (x, topk_weights, w1, w2) against float64 autograd of the unsharded
    block over every rank's tokens, uniform and skewed routings: {"tol", "backend", "errs": {kind: errors}}.
    Device-agnostic: inputs drawn on the CPU in float32, rounded to the job's dtype (`_dtype_for`) and moved to
    world.device; the references take the rounded values and stay on the CPU. Compiled
    (torch.compile(fullgraph=True)): aot_eager on CPU ranks, inductor on GPUs."""
    import autofuse
    from autofuse import dispatch
    from autofuse.dispatch.policy import Policy

    dispatch.set_policy(Policy.bsp("moe tests"))
    problem = _problem(world.size, dtype=_dtype_for(world.device))
    dev, dt = world.device, problem.torch_dtype
    backend = "inductor" if dev.type == "cuda" else "aot_eager"
    errs = {}
    for kind in ("uniform", "skewed"):
        ranks, w1, w2 = _global(problem, kind, 2)
        ranks = [(x.to(dt), ids, wt) for x, ids, wt in ranks]
        w1, w2 = w1.to(dt), w2.to(dt)
        gens = [torch.Generator().manual_seed(50 + r) for r in range(world.size)]
        gs = [torch.randn(T, H, generator=g).to(dt) for g in gens]
        # float64 autograd of the unsharded block, every rank's tokens (rank r's loss term uses its own g)
        xs = [x.double().requires_grad_() for x, _, _ in ranks]
        ws = [wt.double().requires_grad_() for _, _, wt in ranks]
        g1, g2 = w1.double().requires_grad_(), w2.double().requires_grad_()
        sum((moe.unsharded(x, ids, wt, g1, g2, "swiglu") * g.double()).sum()
            for x, (_, ids, _), wt, g in zip(xs, ranks, ws, gs)).backward()
        r = world.rank
        x, ids, weights = ranks[r]
        w1r, w2r = _shard(problem, w1, w2, r)
        leaves = [t.to(dev).clone().requires_grad_() for t in (x, weights, w1r, w2r)]
        ids_dev = ids.to(dev)

        def block(x, weights, w1r, w2r):
            h, handle = autofuse.moe_dispatch(x, ids_dev, weights, w1r, group=world)
            return autofuse.moe_combine(h, w2r, handle, group=world)

        fn = torch.compile(block, fullgraph=True, backend=backend) if compiled else block
        y = fn(*leaves)
        (y * gs[r].to(dev)).sum().backward()
        local = problem["E"] // world.size
        mine = slice(r * local, (r + 1) * local)
        refs = (xs[r].grad, ws[r].grad, g1.grad[mine].reshape(moe.w1_shape(problem)), g2.grad[mine])
        errs[kind] = {"y": _err(y, moe.unsharded(x.double(), ids, weights.double(), w1.double(), w2.double(), "swiglu")),
                      **{n: _err(t.grad, ref) for n, t, ref in zip(("dx", "dweights", "dw1", "dw2"), leaves, refs)}}
    return {"tol": _tol_for(problem), "backend": backend if compiled else "eager", "errs": errs}


@pytest.mark.parametrize("world", [2, 4])
def test_gradients_match_float64_autograd_of_the_unsharded_block(world):
    for rank, r in enumerate(spawn(_grads, world, False, timeout_s=600)):
        assert r["tol"] == TOL and r["backend"] == "eager", r
        for kind, errs in r["errs"].items():
            assert max(errs.values()) < TOL, (rank, kind, errs)


def test_dispatch_and_combine_compile_fullgraph_forward_and_backward():
    for rank, r in enumerate(spawn(_grads, 2, True, timeout_s=600)):
        assert r["tol"] == TOL and r["backend"] == "aot_eager", r
        for kind, errs in r["errs"].items():
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
    bad_ids = ids.clone()
    if world.rank == 1:  # one rank's routing names an expert the group does not have
        bad_ids[0, 0] = problem["E"]
    for call in (lambda: autofuse.moe_dispatch(x, ids, weights, w1r[:, 1:].contiguous(), group=world),
                 lambda: autofuse.moe_combine(torch.zeros(3, F), w2r, Handle("nope"), group=world),
                 lambda: autofuse.moe_dispatch(x, bad_ids, weights, w1r, group=world)):
        try:
            call()
        except InvalidInput as exc:
            said.append(str(exc))
    return said


def test_bad_arguments_raise_on_every_rank_saying_what():
    results = spawn(_bad_inputs, 2, timeout_s=300)
    for said in results:
        assert len(said) == 3
        assert "w1" in said[0] and "handle" in said[1], said
    assert "topk_ids must be expert ids in [0, 4)" in results[1][2] and "from 0 to 4" in results[1][2], results
    assert "rank 1" in results[0][2] and "topk_ids" in results[0][2], results  # every rank says which rank


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
    """On GPUs a plain `autofuse tune` plans the TP ops only (on 4x H200, 2026-11-27, two MoE baselines spent
    130 s of a 3.5-minute default tune and failed; not re-measured since their fixes); `--sweep moe` tunes
    the MoE ops."""
    from autofuse.tuning.tune import TuneOptions, make_plan

    default = make_plan(TuneOptions(db="x.db"), "cuda", 2)
    assert not {op.name for _, op, _, _ in default.items} & {"moe_dispatch", "moe_combine"}
    moe = make_plan(TuneOptions(db="x.db", sweep="moe"), "cuda", 2)
    assert {op.name for _, op, _, _ in moe.items} == {"moe_dispatch", "moe_combine"}


# -- inputs and float64 references: made on the device, vectorised, only the experts a rank needs --------
def _oracle_rows(problem, rank: int, seed: int, second: bool) -> torch.Tensor:
    """The straightforward float64 loop (the references' former code): every slot of every source in
    received order, one matvec per row, every expert materialised."""
    w, local, k = problem.world, problem["E"] // problem.world, problem["k"]
    w1, w2 = (t.to(problem.torch_dtype).double() for t in moe.expert_weights(problem, seed))
    rows: list[list[torch.Tensor]] = [[] for _ in range(local)]
    for src in range(w):
        x, ids, *_ = moe.rank_inputs(problem, src, seed)
        x, flat = x.double(), ids.reshape(-1)
        for s in torch.sort(flat, stable=True).indices.tolist():
            e = int(flat[s])
            if e // local == rank:
                rows[e % local].append(x[s // k])
    out = torch.zeros(problem["C"], problem["H"] if second else problem["F"], dtype=torch.float64)
    i = 0
    for j, group in enumerate(rows):
        e = rank * local + j
        for row in group:
            v = moe._act64(row @ w1[e], problem["act"])
            out[i] = v @ w2[e] if second else v
            i += 1
    return out


def _oracle_block(problem, rank: int, seed: int) -> torch.Tensor:
    """y_t = sum_j w_tj * expert_{id_tj}(x_t), one token and one slot at a time, in float64."""
    w1, w2 = (t.to(problem.torch_dtype).double() for t in moe.expert_weights(problem, seed))
    x, ids, weights, *_ = moe.rank_inputs(problem, rank, seed)
    y = torch.zeros(problem["T"], problem["H"], dtype=torch.float64)
    for t in range(problem["T"]):
        for j in range(problem["k"]):
            e = int(ids[t, j])
            y[t] += float(weights[t, j]) * (moe._act64(x[t].double() @ w1[e], problem["act"]) @ w2[e])
    return y


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("skew", [None, 75, 100])
@pytest.mark.parametrize("act", ["swiglu", "none"])
def test_references_equal_the_float64_loop(world, skew, act):
    p = moe.make_problem(moe.DISPATCH, "float32", world, 5, 8, 6, 2 * world, 2, act, skew)
    for rank in range(world):
        for second in (False, True):
            torch.testing.assert_close(moe.expert_rows_reference(p, rank, 4, second), _oracle_rows(p, rank, 4, second),
                                       rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(moe.moe_reference(p, rank, 4), _oracle_block(p, rank, 4), rtol=1e-12, atol=1e-12)


def test_a_bfloat16_reference_uses_the_weights_the_op_gets():
    """The references round tokens and weights to the problem's dtype, as the op's inputs are."""
    p = moe.make_problem(moe.DISPATCH, "bfloat16", 2, 3, 8, 6, 4, 2, "swiglu")
    torch.testing.assert_close(moe.moe_reference(p, 1, 0), _oracle_block(p, 1, 0), rtol=1e-12, atol=1e-12)


def test_routing_keeps_its_meaning():
    """k distinct experts per token; weights rows summing to 1; skew 100 sends every row to rank 0's experts,
    an even routing spreads them; deterministic in (problem, rank, seed), different across ranks."""
    even = moe.make_problem(moe.DISPATCH, "float32", 4, 256, 8, 6, 16, 3, "swiglu")
    ids, weights = moe.routing(even, 1, 0)
    assert ids.shape == (256, 3) and ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert all(len(set(row)) == 3 for row in ids.tolist())
    torch.testing.assert_close(weights.sum(1), torch.ones(256))
    assert torch.equal(ids, moe.routing(even, 1, 0)[0]) and not torch.equal(ids, moe.routing(even, 2, 0)[0])
    per_rank = torch.bincount(ids.reshape(-1) // 4, minlength=4) / ids.numel()
    assert per_rank.max() < 0.4, per_rank
    full = moe.make_problem(moe.DISPATCH, "float32", 4, 256, 8, 6, 16, 3, "swiglu", 100)
    assert (moe.routing(full, 2, 0)[0] < 4).all()
    half = moe.make_problem(moe.DISPATCH, "float32", 4, 2048, 8, 6, 16, 3, "swiglu", 50)
    share = float((moe.routing(half, 3, 0)[0] < 4).float().mean())
    assert 0.45 < share < 0.55, share


def test_inputs_make_only_the_ranks_experts(monkeypatch):
    """A Mixtral-like routing (E 8, top-2, T 1 per rank) over 4 ranks: a rank's inputs generate its 2 experts
    only, its references only the experts they use; any rank rebuilds any expert alike."""
    made: list[int] = []
    real = moe._expert

    def counting(problem, expert, seed, device):
        made.append(expert)
        return real(problem, expert, seed, device)

    monkeypatch.setattr(moe, "_expert", counting)
    p = moe.make_problem(moe.DISPATCH, "bfloat16", 4, 1, 16, 8, 8, 2, "swiglu")
    x, ids, weights, w1, w2 = moe.rank_inputs(p, 1, 0)
    assert sorted(made) == [2, 3]
    assert w1.shape == (2, 16, 2, 8) and w2.shape == (2, 8, 16) and w1.dtype == w2.dtype == torch.bfloat16
    made.clear()
    moe.moe_reference(p, 1, 0)
    assert sorted(made) == sorted(set(ids.reshape(-1).tolist()))
    made.clear()
    moe.expert_rows_reference(p, 1, 0, second=True)
    assert set(made) <= {2, 3} and len(made) == len(set(made))
    monkeypatch.setattr(moe, "_expert", real)
    all1, all2 = moe.expert_weights(p, 0, dtype=torch.bfloat16)
    assert torch.equal(w1.reshape(2, 16, 16), all1[2:4]) and torch.equal(w2, all2[2:4])
