"""The op contract beyond one tensor in, one out (what MoE's dispatch/combine pair needs), on CPU with a
toy pair (tests/_toy_pair.py): named outputs, a handle passed to a partner op, capacity-bounded
problems, extra features; and dispatch caching a call that takes a handle."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from autofuse.comm.world import spawn
from autofuse.core.features import problem_features
from autofuse.core.op import InvalidInput, Op, Problem, rel_error
from autofuse.core.runner import Handle, Outputs, Runner, TensorSpec

WORLD = SimpleNamespace(device=torch.device("cpu"), size=1, rank=0)  # what a runner reads of its World


def _pair():
    from _toy_pair import COMBINE_OP, ROUTE_OP

    return ROUTE_OP, COMBINE_OP


def _route(x: torch.Tensor, used: int):
    route, _ = _pair()
    counts = torch.tensor([used], dtype=torch.int32)
    return route, route.problem_of(WORLD, x, counts), counts


def test_named_outputs_and_a_handle_reach_the_partner():
    route, combine = _pair()
    x = torch.randn(8, 4)
    _, problem, counts = _route(x, 3)
    runner = route.variant("bsp").build(WORLD, problem, {})
    outs = runner(x, counts)
    assert isinstance(outs, Outputs) and outs.names == ("y", "handle") and outs["y"] is outs[0]
    assert isinstance(outs["handle"], Handle) and outs["handle"].key == problem.key
    assert torch.equal(outs["y"][:3], 2 * x[:3]) and not outs["y"][3:].any()
    assert rel_error(outs[:1], route.reference(WORLD, problem, 0)[:1]) >= 0  # a tuple against one ref per output
    cproblem = combine.problem_of(WORLD, outs["y"], outs["handle"])
    back = combine.variant("bsp").build(WORLD, cproblem, {})(outs["y"], outs["handle"])
    assert torch.equal(back[:3], x[:3]) and not back[3:].any()
    with pytest.raises(InvalidInput, match="handle"):
        back_runner = combine.variant("bsp").build(WORLD, cproblem, {})
        back_runner(outs["y"], Handle("toy_route|C=16,H=4,skew=1|float32|w1"))


def test_a_capacity_keeps_the_problem_and_the_runner_static():
    x = torch.randn(8, 4)
    route, p3, c3 = _route(x, 3)
    _, p6, c6 = _route(x, 6)
    assert p3 == p6 and p3["C"] == 8  # the counts' values never enter the problem
    runner = route.variant("bsp").build(WORLD, p3, {})
    assert int(runner(x, c6)["y"].abs().sum(1).gt(0).sum()) == 6
    assert int(runner(x, c3)["y"].abs().sum(1).gt(0).sum()) == 3


def test_outputs_take_out_and_are_poisoned_when_a_launch_fails():
    class Failing(Runner):
        def launch(self, x, out):
            raise RuntimeError("a peer stopped")

    r = Failing(WORLD, Problem.make("t", "float32", 1, M=2), [TensorSpec("x", (2,), torch.float32)],
                [TensorSpec("v", (2,), torch.float32), TensorSpec("i", (2,), torch.int64)])
    v, i = torch.zeros(2), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError):
        r(torch.zeros(2), out=(v, i))
    assert v.isnan().all() and (i == -1).all()
    with pytest.raises(InvalidInput, match="takes 2 outputs"):
        r(torch.zeros(2), out=(v,))


def test_extra_features_enter_as_values_and_the_declaration_is_checked():
    route, _ = _pair()
    problem = Problem.make("toy_route", "float32", 1, C=64, H=16, skew=4)
    features = problem_features(problem, route)
    assert features["skew"] == 4.0 and "log2_skew" not in features and features["log2_C"] == 6.0
    with pytest.raises(ValueError, match="partner"):
        Op(name="bad", args=("x", "h"), variants=[], problem_of=None, inputs=None, reference=None, tolerance=None,
           features=None, sweep=None, handles=("h",))


def _dispatch_pair(world) -> dict:
    from autofuse import dispatch
    from autofuse.dispatch.policy import Policy

    for name, op in zip(("toy_route", "toy_combine"), _pair()):
        dispatch.STATE.ops[name] = op  # known to dispatch without a registry line (one module, two ops)
    toy_route, toy_combine = dispatch.entry_point("toy_route"), dispatch.entry_point("toy_combine")
    dispatch.set_policy(Policy.bsp("op contract"))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(world.rank))
    out = []
    for used in (3, 6, 3):
        outs = toy_route(x, torch.tensor([used], dtype=torch.int32), group=world)
        back = toy_combine(outs["y"], outs["handle"], group=world)
        out.append(bool(torch.equal(back[:used], x[:used])) and not back[used:].any())
    return {"right": out, "builds": dispatch.stats.builds, "hits": dispatch.stats.hits}


def test_dispatch_caches_a_call_that_takes_a_handle():
    for r in spawn(_dispatch_pair, 2, timeout_s=300):
        assert r["right"] == [True, True, True]
        assert r["builds"] == 2 and r["hits"] == 4, r


def test_a_registered_op_pickles_as_its_registry_entry() -> None:
    """Spawned ranks receive ops by pickle: a registered op (whose declarations hold lambdas) arrives as
    the very OP its module defines, also where the receiver must register it first."""
    import pickle

    from autofuse.core import registry

    for name in registry.names():
        op = registry.get(name)
        assert pickle.loads(pickle.dumps(op)) is op
    registry.unregister("toy_pickled")
    try:
        op = registry.registered("toy_pickled", "_toy_op")
        assert registry.MODULES["toy_pickled"] == "_toy_op" and op is registry.get("toy_pickled")
    finally:
        registry.unregister("toy_pickled")


def test_rel_error_is_the_norm_ratio_in_chunks_and_inf_on_a_non_finite_output(monkeypatch):
    """rel_error runs on the output's device in float64 chunks (one host sync): chunked or not, it is
    ||out - ref|| / ||ref||; a NaN or inf anywhere in the output (poison left unwritten) is inf."""
    import autofuse.core.op as op_module
    from autofuse.core.op import rel_error

    g = torch.Generator().manual_seed(0)
    out = torch.randn(301, 17, generator=g).to(torch.bfloat16)
    ref = out.double() + 1e-3 * torch.randn(301, 17, generator=g, dtype=torch.float64)
    want = float((out.double() - ref).norm() / ref.norm())
    monkeypatch.setattr(op_module, "REL_ERROR_CHUNK", 100)  # 52 chunks, the last one short
    assert abs(rel_error(out, ref) - want) < 1e-12 * want
    assert abs(rel_error(out.t(), ref.t()) - want) < 1e-12 * want  # non-contiguous
    bad = out.clone()
    bad[300, 16] = float("nan")  # in the last chunk
    assert rel_error(bad, ref) == float("inf")
    assert rel_error((out, bad), (ref, ref)) == float("inf")


def test_a_variant_without_parameters_has_no_default_where_its_check_refuses_the_problem():
    """Variant.defaults: the empty config, or none where `check` refuses the problem with it, for every
    config-less variant (ag_gemm's torch_symm has no FP8 kernel for the k form; gemm_ar's torch all-reduces
    none for float16), so the tuner measures nothing there and dispatch drops the variant before its pick."""
    from autofuse.core.op import Variant
    from autofuse.ops import ag_gemm, gemm_ar

    fp8 = "float8_e4m3fn"
    symm = ag_gemm.OP.variant("torch_symm")
    assert symm.defaults(Problem.make("ag_gemm", fp8, 2, M=6, N=32, K=64, gather="k", scaling="rowwise")) == []
    assert symm.defaults(Problem.make("ag_gemm", fp8, 2, M=12, N=32, K=64, gather="rows", scaling="rowwise")) == [{}]
    assert symm.defaults(Problem.make("ag_gemm", "bfloat16", 2, M=8, N=32, K=64, gather="k")) == [{}]
    one_shot = gemm_ar.OP.variant("torch_symm_one_shot")
    assert one_shot.defaults(Problem.make("gemm_ar", "float16", 2, M=4, N=64, K=64)) == []

    class Picky(Variant):
        name, family = "picky", "peer"

        def check(self, problem: Problem, config: dict) -> str | None:
            return "no kernel for float16" if problem.out_dtype == torch.float16 else super().check(problem, config)

    assert Picky().defaults(Problem.make("gemm_ar", "float16", 2, M=4, N=64, K=64)) == []
    assert Picky().defaults(Problem.make("gemm_ar", "bfloat16", 2, M=4, N=64, K=64)) == [{}]
