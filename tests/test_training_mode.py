"""Training calls are decided in AUTOFUSE_TRAIN_MODE's timing mode, other calls in AUTOFUSE_MODE's (2 and 4 CPU ranks).

A training call is one autograd records (grad mode on, an input requires grad: the library path's function
passes `training=True` to the custom op, also as a constant in a compiled forward graph) or one made in a
backward (autograd's engine runs it, eager or compiled). On CPU both modes default to eager, so training and
other calls share one decision; to see them part, the ranks let graph mode through on CPU (decisions need no
graph timing there: confirmation is off on CPU) and set AUTOFUSE_TRAIN_MODE=graph, with a stand-in policy
per mode: the eager one runs BSP, the graph one picks a fused variant. The MLP's loss gradients are checked
against float64 autograd of the unsharded MLP, eager and compiled.
"""
from __future__ import annotations

import os

import pytest
import torch

from autofuse.comm.world import spawn
from autofuse.core.op import Op, Problem
from autofuse.dispatch.choice import Choice
from autofuse.dispatch.policy import Policy
from test_autograd import F, T, _mlp_data

TOL = 1e-4
MODES = ("eager", "graph")


class FusedPicks(Policy):
    """A stand-in policy that picks, as if measured, the first variant other than bsp and torch's op that
    takes the problem at its default config."""

    def decide(self, problem: Problem, op: Op, available=None) -> Choice:
        for name in available or op.variants:
            if name in ("bsp", "torch_symm"):
                continue
            config, _ = self.config_for(problem, name, op)
            if config is not None and op.variant(name).check(problem, config) is None:
                return Choice(op.name, problem, name, config, f"measured: {self.refused}", "measured", self.path)
        return super().decide(problem, op, available)


def _data(w: int, r: int) -> dict:
    """test_autograd's MLP: the unsharded float64 tensors, this rank's float32 shards, its rows and columns; `t`
    (the target there) is the output gradient here."""
    d = _mlp_data(w, r)
    d["rows"], d["cols"] = slice(r * T // w, (r + 1) * T // w), slice(r * F // w, (r + 1) * F // w)
    return d


def _reference(full: dict) -> dict:
    leaves = {k: full[k].clone().requires_grad_() for k in ("x", "w1", "w2")}
    ((torch.relu(leaves["x"] @ leaves["w1"]) @ leaves["w2"]) * full["t"]).sum().backward()
    return {k: v.grad for k, v in leaves.items()}


def _entries(cache: dict) -> dict:
    """{cache key: (op, the key's mode suffix or None, variant, the choice's mode, its reason)}."""
    out = {}
    for key, entry in cache.items():
        suffix = key[-1] if isinstance(key[-1], str) and key[-1] in MODES else None
        c = entry.choice
        out[key] = (key[0], suffix, c.variant, c.mode, c.reason)
    return out


def _routing(world, train_mode: str | None) -> dict:
    import autofuse
    from autofuse.core import modes
    from autofuse.dispatch.state import STATE
    from autofuse import dispatch

    torch.set_num_threads(1)
    if train_mode == "graph":
        modes.supported = lambda device_type: modes.MODES  # see the module doc
        os.environ["AUTOFUSE_TRAIN_MODE"] = "graph"
    dispatch.reset()
    STATE.policies["cpu", "eager"] = Policy.bsp("the eager test policy")
    STATE.policies["cpu", "graph"] = FusedPicks.bsp("the graph test policy")

    d = _data(world.size, world.rank)
    m, ref = d["mine"], _reference(d["full"])

    def mlp(x, w1, w2):
        return autofuse.gemm_rs(torch.relu(autofuse.ag_gemm(x, w1, group=world)), w2, group=world)

    def step(fn) -> dict:
        leaves = {k: m[k].clone().requires_grad_() for k in ("x", "w1", "w2")}
        (fn(leaves["x"], leaves["w1"], leaves["w2"]) * m["t"]).sum().backward()
        mine = {"x": ref["x"][d["rows"]], "w1": ref["w1"][:, d["cols"]], "w2": ref["w2"][d["cols"]]}
        return {k: float((leaves[k].grad.double() - mine[k]).norm() / mine[k].norm()) for k in leaves}

    res: dict = {}
    with torch.no_grad():
        mlp(m["x"], m["w1"], m["w2"])
    res["inference"] = _entries(STATE.cache)
    res["eager_errors"] = step(mlp)
    res["eager"] = {k: v for k, v in _entries(STATE.cache).items() if k not in res["inference"]}
    res["explain"] = str(autofuse.explain("ag_gemm", m["x"], m["w1"], group=world, training=True))

    graphs: list = []

    def keep(gm, example_inputs):
        from functorch.compile import make_boxed_func

        graphs.append(gm)
        return make_boxed_func(gm.forward)

    from torch._dynamo.backends.common import aot_autograd

    before = set(STATE.cache)
    compiled = torch.compile(mlp, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    res["compiled_errors"] = step(compiled)
    res["compiled"] = {k: v for k, v in _entries(STATE.cache).items() if k not in before}
    res["graph_training"] = [[bool(n.kwargs.get("training")) for n in gm.graph.nodes
                              if n.op == "call_function" and str(n.target).startswith("autofuse.")] for gm in graphs]
    if train_mode == "graph":  # set_train_mode("eager") over the setting, then back: each mode's entries serve it
        dispatch.set_train_mode("eager")
        before = set(STATE.cache)
        res["switched_errors"] = step(compiled)
        res["switched"] = {k: v for k, v in _entries(STATE.cache).items() if k not in before}
        dispatch.set_train_mode(None)
        before = set(STATE.cache)
        step(compiled)
        res["back"] = {k: v for k, v in _entries(STATE.cache).items() if k not in before}
        try:
            dispatch.set_train_mode("replay")
        except ValueError as exc:
            res["refused"] = str(exc)
    return res


@pytest.mark.parametrize("train_mode,world", [(None, 2), ("graph", 2), ("graph", 4)])
def test_training_calls_are_decided_in_the_training_mode(train_mode, world):
    """AUTOFUSE_TRAIN_MODE=graph (graph let through on CPU): inference calls decide with the eager policy
    (bsp), the training step's forward and backward calls with the graph one (fused), under keys of their
    own, eager and compiled; the gradients equal the unsharded float64 ones; `set_train_mode` switches it
    at run time and back. Unset on CPU (eager, the process's own mode): training calls share the inference
    calls' keys and decisions."""
    for r in spawn(_routing, world, train_mode, timeout_s=300):
        for case in ("eager_errors", "compiled_errors"):
            assert max(r[case].values()) < TOL, (case, r[case])
        inference, training = r["inference"], {**r["eager"], **r["compiled"]}
        assert {op for op, *_ in inference.values()} == {"ag_gemm", "gemm_rs"}
        assert all(s is None and v == "bsp" and mode == "eager" for _, s, v, mode, _ in inference.values()), inference
        # the forward graph passes training=True to each op, the backward graph leaves it to the engine
        forward, backward = r["graph_training"]
        assert forward and all(forward) and backward and not any(backward), r["graph_training"]
        if train_mode is None:
            assert all(s is None and mode == "eager" for _, s, _, mode, _ in training.values()), training
            assert "mode:    eager" in r["explain"]
            continue
        # forward (ag_gemm, gemm_rs) and backward (both ops again, other shapes) calls, eager and compiled
        assert {op for op, *_ in r["eager"].values()} == {"ag_gemm", "gemm_rs"}, r["eager"]
        for op, suffix, variant, mode, reason in training.values():
            assert suffix == "graph" and mode == "graph" and "the graph test policy" in reason, (op, reason)
            assert variant not in ("bsp", "torch_symm"), (op, variant)
        assert "mode:    graph" in r["explain"] and "the graph test policy" in r["explain"]
        # set_train_mode("eager"): the backward's problems, new to eager mode, decided with the eager policy under
        # the plain keys (the forward's are the inference calls' entries); back to the setting: no new entry
        assert max(r["switched_errors"].values()) < TOL, r["switched_errors"]
        assert r["switched"] and all(s is None and v == "bsp" and mode == "eager"
                                     for _, s, v, mode, _ in r["switched"].values()), r["switched"]
        assert r["back"] == {}, r["back"]
        assert "set_train_mode('replay')" in r["refused"], r["refused"]


def test_the_training_mode_setting():
    """AUTOFUSE_TRAIN_MODE: eager by default, graph only where CUDA graphs exist, anything else refused by
    name; the ranks compare it on a first call (lockstep)."""
    from autofuse.core import settings

    saved = os.environ.pop("AUTOFUSE_TRAIN_MODE", None)
    try:
        assert settings.train_mode("cuda") == settings.train_mode("cpu") == "eager"
        os.environ["AUTOFUSE_TRAIN_MODE"] = "graph"
        assert settings.train_mode("cuda") == "graph"
        with pytest.raises(settings.SettingError, match="AUTOFUSE_TRAIN_MODE='graph'"):
            settings.train_mode("cpu")
        os.environ["AUTOFUSE_TRAIN_MODE"] = "replay"
        with pytest.raises(settings.SettingError, match="AUTOFUSE_TRAIN_MODE='replay'"):
            settings.lockstep("cuda")
    finally:
        os.environ.pop("AUTOFUSE_TRAIN_MODE", None)
        if saved is not None:
            os.environ["AUTOFUSE_TRAIN_MODE"] = saved


def _one_rank_trains(world) -> str:
    import autofuse
    from autofuse.core import modes
    from autofuse.dispatch.state import STATE
    from autofuse import dispatch

    torch.set_num_threads(1)
    modes.supported = lambda device_type: modes.MODES  # see the module doc
    os.environ["AUTOFUSE_TRAIN_MODE"] = "graph"
    dispatch.reset()
    STATE.policies["cpu", "eager"] = Policy.bsp("the eager test policy")
    STATE.policies["cpu", "graph"] = FusedPicks.bsp("the graph test policy")
    m = _data(world.size, world.rank)["mine"]
    x, w1 = m["x"], m["w1"].clone().requires_grad_(world.rank == 0)
    try:
        autofuse.ag_gemm(x, w1, group=world)
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
        return f"{type(exc).__name__}: {exc}"
    return "ran"


def test_a_rank_whose_call_alone_trains_raises_on_every_rank():
    """Rank 0's weight requires grad, rank 1's does not: rank 0's call is a training call (graph mode's
    fused pick), rank 1's is not (eager mode's BSP); every rank raises DispatchMismatch naming each rank's
    choice and the timing mode it was decided for, and says that grad must agree; nothing runs."""
    for text in spawn(_one_rank_trains, 2, timeout_s=300):
        assert text.startswith("DispatchMismatch"), text
        assert "decided for graph timing" in text and "decided for eager timing" in text, text
        assert "require grad on every rank or on none" in text, text
