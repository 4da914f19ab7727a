"""The custom ops' cached call (what a compiled training step runs per autofuse node) does the least host work.

CPU ranks (gloo), float32, tiny shapes, BSP: after each problem's first call, every further call of
`torch.ops.autofuse.<op>` (ag_gemm_gathered and gemm_rs: a training step's forward and backward
nodes; the overrides' `variant=`/`config=` text too) is one cache lookup and one runner call: no
generic key building (`key_of`), no public `call` and its library-path test, no second lookup for an
extra output (`runner_of`), no JSON parsing of the config, no decision, agreement or validation
(`problem_of`), one hit and one launch per call. Counted with wrappers, never timed
(scripts/host_profile_train.py measures the microseconds).
"""
from __future__ import annotations

import pytest
import torch

import harness
from autofuse.comm.world import spawn

CALLS = 5


def _job(world) -> dict:
    import json
    import os

    import autofuse.library  # noqa: F401 - registers torch.ops.autofuse.*
    from autofuse import dispatch
    from autofuse.core import registry
    from autofuse.dispatch import entry
    from autofuse.dispatch.policy import Policy
    from autofuse.dispatch.state import STATE
    from autofuse.library.groups import name_of

    torch.set_num_threads(1)
    os.environ["AUTOFUSE_VARIANT"] = ""
    dispatch.reset()
    dispatch.set_policy(Policy.bsp("library hot-path test"))
    g = torch.Generator().manual_seed(world.rank)
    x, w = torch.randn(8, 16, generator=g), torch.randn(16, 24, generator=g)  # ag_gemm rows: (8 W, 24)
    y, v = torch.randn(16, 8, generator=g), torch.randn(8, 16, generator=g)  # gemm_rs: (16 / W, 16)
    name = name_of(world.group)
    ops = torch.ops.autofuse
    calls = {"ag_gemm_gathered": lambda: ops.ag_gemm_gathered.default(x, w, name),
             "gemm_rs": lambda: ops.gemm_rs.default(y, v, name),
             "gemm_rs_config": lambda: ops.gemm_rs.default(y, v, name, variant="bsp", config="{}")}
    with torch.no_grad():
        first = {k: fn() for k, fn in calls.items()}  # each problem's first call: decided, agreed, cached
        c = harness.Counter()
        for fn_name in ("key_of", "call", "library_path", "runner_of", "miss", "decide", "agree"):
            c.wrap(entry, fn_name, fn_name)
        for fn_name in ("call", "runner_of"):  # the public names the implementations called before
            c.wrap(dispatch, fn_name, f"dispatch.{fn_name}")
        c.wrap(json, "loads", "json.loads")
        for op in ("ag_gemm", "gemm_rs"):
            c.wrap(registry.get(op), "problem_of", "problem_of")
        for e in STATE.cache.values():
            c.wrap(e.runner, "launch", "launch")
        before = dict(vars(STATE.stats))
        try:
            got = {k: [fn() for _ in range(CALLS)] for k, fn in calls.items()}
        finally:
            c.restore()
        after = dict(vars(STATE.stats))

    def same(a, b) -> bool:
        return all(torch.equal(p, q) for p, q in zip(a, b)) if isinstance(a, tuple) else torch.equal(a, b)

    return {"counts": c.counts, "delta": {k: after[k] - before[k] for k in after},
            "same": all(same(r, first[k]) for k, rs in got.items() for r in rs), "entries": len(STATE.cache)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(_job, 2, timeout_s=300)


def test_cached_custom_op_call_is_one_lookup_and_one_launch(results) -> None:
    for rank, r in enumerate(results):
        counts = dict(r["counts"])
        assert counts.pop("launch") == 3 * CALLS, (rank, r["counts"])
        assert all(n == 0 for n in counts.values()), (rank, counts)
        d = r["delta"]
        assert (d["hits"], d["misses"], d["agreements"], d["builds"], d["policy_loads"]) == (3 * CALLS, 0, 0, 0, 0), d
        assert r["same"] and r["entries"] == 3, r


def _fresh_job(world) -> dict:
    """Every registered op through its custom op (the library path, `autofuse.library.<op>`), on its first CPU
    problem, and ag_gemm's extra output: which outputs share storage with an input."""
    import os

    import autofuse.library as library
    from autofuse import dispatch
    from autofuse.core import registry
    from autofuse.core.runner import Handle, Outputs
    from autofuse.library import custom

    def tensors(x) -> list:
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, Handle):
            return list(x.tensors.values())
        if isinstance(x, (Outputs, tuple, list)):
            return [t for v in x for t in tensors(v)]
        return []

    def shared_with(outs, args) -> list[int]:
        ins = {t.untyped_storage().data_ptr() for t in tensors(tuple(args)) if t.numel()}
        return [i for i, t in enumerate(tensors(outs)) if t.numel() and t.untyped_storage().data_ptr() in ins]

    os.environ["AUTOFUSE_VARIANT"] = ""
    dispatch.reset()
    shared, handles = {}, {}
    with torch.no_grad():
        for name in sorted(registry.names(), key=lambda n: bool(registry.get(n).handles)):  # partners first
            op = registry.get(name)
            if name not in custom.FUNCTIONS:
                continue
            args = list(op.inputs(world, op.sweep("cpu", world.size)[0], 0))
            for i, a in enumerate(op.args):  # a partner's handle: made by calling the partner first
                if a in op.handles:
                    args[i] = handles[op.partner]
            outs = getattr(library, name)(*args, world.group)
            if isinstance(outs, Outputs) and isinstance(outs[len(outs) - 1], Handle):
                handles[name] = outs[len(outs) - 1]
            shared[name] = shared_with(outs, args)
        ag = registry.get("ag_gemm")
        a, b = ag.inputs(world, ag.sweep("cpu", world.size)[0], 0)[:2]
        outs = torch.ops.autofuse.ag_gemm_gathered.default(a, b, library.name_of(world.group))  # an extra output
        shared["ag_gemm_gathered"] = shared_with(outs, (a, b))
    return shared


def test_every_custom_ops_outputs_are_fresh_tensors() -> None:
    """The custom ops are defined with torch.library.Library, which, unlike torch.library.custom_op, does not
    check on every call that no output aliases an input (autograd and functionalization assume it): every
    op's outputs, handles included, share no storage with its inputs."""
    from autofuse.core import registry

    declared = {n for n in registry.names() if registry.get(n).custom is not None}
    for shared in spawn(_fresh_job, 2, timeout_s=300):
        assert set(shared) == declared | {"ag_gemm_gathered"}, shared
        assert all(not v for v in shared.values()), shared
