"""Autograd through autofuse's GEMM ops, and torch.compile / torch.export of code that calls them.

CPU ranks (gloo, shm heap, Triton's interpreter), float32, tiny shapes:
- gradients of every GEMM op and form (ag_gemm rows and k, gemm_rs, gemm_ar) with the forward's
  variant forced to bsp and to each hybrid and fused variant in turn, and the backward's own ops
  forced to another variant each (AUTOFUSE_VARIANT), the gathered A kept and gathered again,
  against float64 autograd of the unsharded computation (2 ranks: every variant; 4 ranks: a few);
  shapes whose backward ag_gemm needs padding (K or rows per rank not a multiple of 16 bytes);
- a three-step SGD loop of a sequence-parallel two-layer MLP on fused variants, whose losses
  match the unsharded float64 loop;
- torch.compile(fullgraph=True, backend="aot_eager") of that MLP and of examples/llama_layer.py's
  prefill, forward and backward equal to eager, every call one autofuse node in the forward and
  backward graphs (a graph break fails fullgraph); torch.export keeps each call as one node;
- flash_decode refuses inputs that require grad, every op FP8 inputs that do; fake tensors trace the public ops to their custom
  ops with no first-call agreement, and an op without one raises TraceMiss naming it;
- ag_gemm's kept gathered A comes from the bsp and heap_mm runners' buffers and from the push kernels'
  workspace (no second all-gather), and is gathered again after pull.
GPU (marker gpu; gpu_world() ranks, which AUTOFUSE_RANKS_PER_GPU lets share one GPU): every available
variant's gradients in bf16 at GPU sizes; torch.compile with inductor and mode="reduce-overhead"
(three steps: warm-up, record, replay) of the MLP, and inductor of the example layer, equal to eager.
A detached output (no grad_fn), a missing or wrong gradient, or a graph break fails these tests.
"""
from __future__ import annotations

import os
from dataclasses import fields

import pytest
import torch

import harness
from autofuse.comm.world import spawn

TOL = 1e-4  # float32 sums of <= 64 products against float64: ~1e-6 relative; a wrong term is O(1)

# (op, gather form, forward variant, backward AUTOFUSE_VARIANT, AUTOFUSE_SAVE_GATHERED)
# Every forward variant once per op and form; the backward's gemm_rs / ag_gemm variants rotate.
CASES_W2 = [
    ("ag_gemm", "rows", "bsp", "", "1"),
    ("ag_gemm", "rows", "heap_mm", "gemm_rs:push_last,ag_gemm:push", "0"),
    ("ag_gemm", "rows", "heap_mm_overlap", "gemm_rs:mm_heap", "1"),
    ("ag_gemm", "rows", "pull", "gemm_rs:push_reducer,ag_gemm:heap_mm", "0"),
    ("ag_gemm", "rows", "push", "gemm_rs:mm_heap_overlap", "1"),
    ("ag_gemm", "rows", "push_ws", "gemm_rs:bsp,ag_gemm:push_ws", "0"),
    ("ag_gemm", "k", "bsp", "gemm_rs:push_last,ag_gemm:pull", "0"),
    ("ag_gemm", "k", "heap_mm", "gemm_rs:mm_heap", "1"),
    ("ag_gemm", "k", "heap_mm_overlap", "gemm_rs:push_reducer,ag_gemm:heap_mm_overlap", "0"),
    ("ag_gemm", "k", "pull", "gemm_rs:mm_heap_overlap", "1"),
    ("ag_gemm", "k", "push", "", "0"),
    ("ag_gemm", "k", "push_ws", "gemm_rs:push_last", "1"),
    ("gemm_rs", "", "bsp", "ag_gemm:push", "1"),
    ("gemm_rs", "", "mm_heap", "ag_gemm:heap_mm", "1"),
    ("gemm_rs", "", "mm_heap_overlap", "ag_gemm:pull", "1"),
    ("gemm_rs", "", "push_last", "ag_gemm:push_ws", "1"),
    ("gemm_rs", "", "push_reducer", "ag_gemm:heap_mm_overlap", "1"),
    ("gemm_ar", "", "bsp", "", "1"),
    ("gemm_ar", "", "mm_heap", "", "1"),
    ("gemm_ar", "", "one_shot", "", "1"),
    ("gemm_ar", "", "two_shot", "", "1"),
]
CASES_W4 = [
    ("ag_gemm", "rows", "push", "gemm_rs:push_last,ag_gemm:push", "0"),
    ("ag_gemm", "k", "heap_mm", "gemm_rs:mm_heap", "1"),
    ("gemm_rs", "", "push_reducer", "ag_gemm:push_ws", "1"),
    ("gemm_ar", "", "two_shot", "", "1"),
]
# (M, K, N): global rows, global K, columns per rank (ag_gemm) or global N (gemm_rs / gemm_ar), per world
DIMS = {2: (16, 32, 16), 4: (16, 32, 16)}
# Backward operands off the 16-byte grid (padded): 3 rows per rank; gemm_rs with 6 K columns per rank.
ODD = [("ag_gemm", "rows", "push", "gemm_rs:push_last,ag_gemm:push", "0", (6, 32, 12)),
       ("ag_gemm", "k", "bsp", "gemm_rs:bsp,ag_gemm:pull", "0", (6, 32, 12)),
       ("gemm_rs", "", "bsp", "ag_gemm:push", "1", (6, 12, 20)),
       ("gemm_rs", "", "push_last", "ag_gemm:push", "0", (6, 12, 20)),
       # the gathered A kept from the push kernels' workspace, through the padded path
       ("ag_gemm", "rows", "push_ws", "gemm_rs:bsp", "1", (6, 32, 12)),
       ("ag_gemm", "k", "push", "gemm_rs:push_last", "1", (6, 32, 12))]


def unsharded(op: str, form: str, w: int, r: int, dims: tuple[int, int, int], seed: int,
              dtype: torch.dtype = torch.float32, device: str = "cpu") -> dict:
    """This rank's shards in `dtype` on `device` (a, b, the loss weights g) and float64 references of its
    output and of its shards' gradients, from autograd of the unsharded loss sum(C * G) over the same
    rounded values (gemm_ar: the loss every rank computes alike, taken once)."""
    m, k, n = dims
    gen = torch.Generator().manual_seed(seed)
    cols = n * w if op == "ag_gemm" else n

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(torch.float64)

    A, B, G = rand(m, k).requires_grad_(), rand(k, cols).requires_grad_(), rand(m, cols)
    C = A @ B
    (C * G).sum().backward()
    rows, kb, nb = (slice(r * m // w, (r + 1) * m // w), slice(r * k // w, (r + 1) * k // w),
                    slice(r * n, (r + 1) * n))
    if op == "ag_gemm":
        a_idx = (rows, slice(None)) if form == "rows" else (slice(None), kb)
        b_idx, c_idx = (slice(None), nb), (slice(None), nb)
    else:
        a_idx, b_idx = (slice(None), kb), (kb, slice(None))
        c_idx = (rows, slice(None)) if op == "gemm_rs" else (slice(None), slice(None))
    mine = {"a": A.detach()[a_idx], "b": B.detach()[b_idx], "g": G[c_idx]}
    return {**{k: v.to(device=device, dtype=dtype).contiguous() for k, v in mine.items()},
            "c": C.detach()[c_idx], "da": A.grad[a_idx], "db": B.grad[b_idx]}


def rel(x: torch.Tensor | None, ref: torch.Tensor) -> float:
    if x is None:
        return float("inf")
    return float((x.detach().double().cpu() - ref.cpu()).norm() / ref.norm())


def _fresh_dispatch(env: str, save: str) -> None:
    """Forget cached decisions (AUTOFUSE_VARIANT is read on a problem's first call) and skip the policy
    search: every unforced op runs BSP."""
    from autofuse import dispatch
    from autofuse.dispatch.policy import Policy

    os.environ["AUTOFUSE_VARIANT"] = env
    os.environ["AUTOFUSE_SAVE_GATHERED"] = save
    dispatch.set_policy(Policy.bsp("autograd tests"))


def _grad_cases(world, cases: list, dtype: torch.dtype = torch.float32, dims: tuple | None = None) -> list:
    import autofuse

    out = []
    for i, (op, form, variant, env, save, *odd) in enumerate(cases):
        _fresh_dispatch(env, save)
        s = unsharded(op, form, world.size, world.rank, odd[0] if odd else dims or DIMS[world.size], seed=i,
                      dtype=dtype, device=str(world.device))
        a, b = s["a"].requires_grad_(), s["b"].requires_grad_()
        c = getattr(autofuse, op)(a, b, group=world, variant=variant)
        attached = c.grad_fn is not None
        (c * s["g"]).sum().backward()
        out.append((op, form, variant, env, save, attached, rel(c.detach(), s["c"]), rel(a.grad, s["da"]),
                    rel(b.grad, s["db"])))
    return out


def _check(results: list, tol: float = TOL) -> None:
    bad = []
    for rank, rows in enumerate(results):
        for op, form, variant, env, save, attached, ec, ea, eb in rows:
            if not (attached and ec <= tol and ea <= tol and eb <= tol):
                bad.append(f"rank {rank} {op} {form} {variant} [{env}] save={save}: grad_fn={attached} "
                           f"out {ec:.2g} dA {ea:.2g} dB {eb:.2g}")
    assert not bad, "\n".join(bad)


def test_gradients_every_variant_w2():
    _check(spawn(_grad_cases, 2, CASES_W2 + ODD, timeout_s=300))


def test_gradients_w4():
    _check(spawn(_grad_cases, 4, CASES_W4, timeout_s=300))


def test_flash_decode_refuses_grad():
    import autofuse
    from autofuse.library import InferenceOnly

    q = torch.randn(1, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(InferenceOnly, match=r"flash_decode is inference only.*q \(1, 4, 16\)"):
        autofuse.flash_decode(q, k, k, torch.full((1,), 8, dtype=torch.int32))


def test_fp8_inputs_that_require_grad_raise():
    import autofuse

    a = torch.randn(4, 16).to(torch.float8_e4m3fn).requires_grad_()
    b = torch.randn(16, 16).to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match=r"autofuse.ag_gemm: FP8 inputs \(torch.float8_e4m3fn, .*no backward"):
        autofuse.ag_gemm(a, b)
    one = torch.ones(())
    with pytest.raises(NotImplementedError, match=r"autofuse.gemm_rs: FP8 inputs .*no backward"):
        autofuse.gemm_rs(a, b.t(), scale_a=one, scale_b=one)  # the scaled form never detaches either


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar"])
def test_fp8_scales_that_require_grad_raise(op):
    """A scale that requires grad (the FP8 inputs do not) is refused at the call, naming it: fused variants
    would return an output cut off from it, BSP's _scaled_mm fail in backward."""
    import autofuse
    from autofuse import dispatch

    a = torch.randn(4, 16).to(torch.float8_e4m3fn)
    b = torch.randn(16, 16).to(torch.float8_e4m3fn).t()
    one, grad = torch.ones(()), torch.ones((), requires_grad=True)
    for sa, sb, named in ((grad, one, r"scale_a \(\) torch.float32"), (one, grad, r"scale_b \(\) torch.float32")):
        with pytest.raises(NotImplementedError, match=rf"autofuse.{op} with FP8 scales has no backward, but {named} "
                                                      "require grad"):
            getattr(autofuse, op)(a, b, scale_a=sa, scale_b=sb)
        with pytest.raises(NotImplementedError, match=rf"autofuse.{op} with FP8 scales has no backward"):
            dispatch.call(op, a, b, sa, sb)


# -- a training loop, torch.compile, torch.export ---------------------------------------------------------
T, H, F, STEPS, LR = 16, 32, 64, 3, 0.05


def _mlp_data(w: int, r: int) -> dict:
    """The unsharded MLP (float64) and this rank's float32 shards: x rows, W1 columns, W2 rows."""
    gen = torch.Generator().manual_seed(7)
    full = {"x": torch.randn(T, H, generator=gen, dtype=torch.float64),
            "w1": torch.randn(H, F, generator=gen, dtype=torch.float64) * H ** -0.5,
            "w2": torch.randn(F, H, generator=gen, dtype=torch.float64) * F ** -0.5,
            "t": torch.randn(T, H, generator=gen, dtype=torch.float64)}
    rows, cols = slice(r * T // w, (r + 1) * T // w), slice(r * F // w, (r + 1) * F // w)
    mine = {"x": full["x"][rows], "w1": full["w1"][:, cols], "w2": full["w2"][cols], "t": full["t"][rows]}
    return {"full": full, "mine": {k: v.float().contiguous() for k, v in mine.items()}}


def mlp(ops, x, w1, w2, group):
    """Sequence-parallel MLP: all-gather + column-parallel, ReLU, row-parallel + reduce-scatter."""
    return ops.gemm_rs(torch.relu(ops.ag_gemm(x, w1, group=group)), w2, group=group)


def _losses_unsharded(full: dict) -> list[float]:
    w1, w2 = full["w1"].clone().requires_grad_(), full["w2"].clone().requires_grad_()
    out = []
    for _ in range(STEPS):
        loss = ((torch.relu(full["x"] @ w1) @ w2 - full["t"]) ** 2).sum() / T
        loss.backward()
        with torch.no_grad():
            w1 -= LR * w1.grad
            w2 -= LR * w2.grad
        w1.grad = w2.grad = None
        out.append(loss.item())
    return out


def _train(world, ops, data: dict) -> list[float]:
    import torch.distributed as dist

    m = data["mine"]
    w1, w2 = m["w1"].clone().requires_grad_(), m["w2"].clone().requires_grad_()
    out = []
    for _ in range(STEPS):
        loss = ((mlp(ops, m["x"], w1, w2, world) - m["t"]) ** 2).sum() / T  # this rank's rows' part
        loss.backward()
        with torch.no_grad():
            w1 -= LR * w1.grad
            w2 -= LR * w2.grad
        w1.grad = w2.grad = None
        total = loss.detach().double().reshape(1)
        dist.all_reduce(total, group=world.group)
        out.append(total.item())
    return out


class _Recorder:
    """An aot_eager backend that keeps the forward and backward graphs it is given."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd

        self.graphs: list = []
        self.backend = aot_autograd(fw_compiler=self.keep, bw_compiler=self.keep)

    def keep(self, gm, example_inputs):
        from functorch.compile import make_boxed_func

        self.graphs.append(gm)
        return make_boxed_func(gm.forward)


def autofuse_nodes(gm) -> list[str]:
    """The autofuse custom ops a graph calls, in order."""
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("autofuse.")]


def _fwd_bwd(fn, *inputs):
    """fn's output and the gradients of every input (all require grad) for the output's sum."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.sum().backward()
    return [out.detach(), *(t.grad for t in leaves)]


def _untraced_id(obj: object) -> int:
    """id() for the entry points' globals: a trace that reaches dispatch's key fails here (torch 2.11's
    Dynamo cannot trace id(None) at all; 2.13 can, so this makes the CPU test see what the GPU saw)."""
    if torch.compiler.is_compiling():
        raise AssertionError("a traced autofuse call built dispatch's key: the library path must not")
    return id(obj)


def _layer_compile(world) -> dict:
    """examples/llama_layer.py's prefill (autofuse ops), eager and compiled: output, input and weight grads.
    The entry points' id() fails inside a trace: a traced call must take the library path before any key."""
    import autofuse
    from test_layer import example

    for name in ("ag_gemm", "gemm_rs", "gemm_ar"):
        getattr(autofuse, name).__globals__["id"] = _untraced_id

    ex = example()
    cfg = ex.CONFIGS["tiny"]
    weights = ex.random_weights(cfg, world.rank, world.size, seed=0, dtype=torch.float32)
    names = [f.name for f in fields(weights) if f.name != "qkv_rows"]  # qkv_rows: decode's
    x = torch.randn(16 // world.size, cfg.hidden, generator=torch.Generator().manual_seed(world.rank))

    def prefill(x, *tensors):
        w = ex.TPWeights(qkv_rows=weights.qkv_rows, **dict(zip(names, tensors)))
        return ex.TPLlamaLayer(cfg, w, ex.AutofuseOps(world.group), world.group).prefill(x)

    params = [getattr(weights, n) for n in names]
    eager = _fwd_bwd(prefill, x, *params)
    rec = _Recorder()
    compiled = _fwd_bwd(torch.compile(prefill, fullgraph=True, backend=rec.backend), x, *params)
    return {"diff": max(rel(c, e.double()) for c, e in zip(compiled, eager)),
            "nodes": [autofuse_nodes(g) for g in rec.graphs]}


def _no_agreement_while_tracing(world) -> dict:
    """Fake tensors: the public op traces to its custom op (no dispatch, no agreement); an op without
    one raises TraceMiss naming it."""
    import autofuse
    from autofuse import dispatch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from _toy_op import OP as TOY

    before = dispatch.stats.agreements
    with FakeTensorMode():
        a, b = torch.randn(4, 32), torch.randn(32, 16, requires_grad=True)
        shape = tuple(autofuse.ag_gemm(a, b, group=world).shape)
        try:
            dispatch.call(TOY, a, b.detach(), group=world)
            miss = ""
        except dispatch.TraceMiss as exc:
            miss = str(exc)
    return {"shape": shape, "agreements": dispatch.stats.agreements - before, "miss": miss}


def _gathered_sources(world, dims: tuple = (4, 32, 16), dtype: torch.dtype = torch.float32) -> dict:
    """ag_gemm_gathered's gathered A per forward variant (and layout) this job can run: taken from the runner's
    buffer (bsp, heap_mm) or from the push kernels' workspace and A (push, push_ws, both layouts): no second
    all-gather; gathered again after pull, and after torch_symm's first call only (later ones return it).
    Two calls each, of other As: the second reads push's other parity half. Always the exact all_gather(A)
    (rows and k forms). dims: (M rows per rank in the rows form, K, N)."""
    from autofuse.core.op import config_key
    from autofuse.library.groups import name_of
    from autofuse.ops import ag_gemm as ag

    extra = []
    gather = ag._all_gather
    ag._all_gather = lambda a, w: extra.append(1) or gather(a, w)  # count the second gathers
    out = {}
    rows, k, n = dims
    for form, m in (("rows", rows * world.size), ("k", 2 * rows)):
        s = unsharded("ag_gemm", form, world.size, world.rank, (m, k, n), seed=9, dtype=dtype,
                      device=str(world.device))
        problem = ag.problem_of(world, s["a"], s["b"])
        cases = [(v, None, None) for v in ("bsp", "heap_mm", "torch_symm") if ag.OP.variant(v).available(world)
                 and ag.OP.variant(v).check(problem, {}) is None]
        for v in ("push", "push_ws", "pull"):
            layouts = {c["LAYOUT"]: c for c in ag.OP.variant(v).defaults(problem)}
            cases += [(v, layout, config_key(c)) for layout, c in sorted(layouts.items())]
        for variant, layout, config in cases:
            before, same = len(extra), []
            for scale in (1.0, -2.0):
                a = s["a"] * scale
                full_a = torch.cat(gather(a, world).chunk(world.size), dim=0 if form == "rows" else 1)
                _, gathered = torch.ops.autofuse.ag_gemm_gathered(a, s["b"], name_of(world), variant=variant,
                                                                  config=config)
                same.append(bool(torch.equal(gathered, full_a)))
            out[f"{form} {variant}" + (f" {layout}" if layout else "")] = (len(extra) - before, all(same))
    ag._all_gather = gather
    return out


def gathered_expected(results: dict) -> dict:
    """What `_gathered_sources` must find for the variants it ran: second all-gathers only after pull (each
    call) and torch_symm (its first), and always the exact gathered A."""
    return {case: (2 if " pull " in f"{case} " else 1 if "torch_symm" in case else 0, True) for case in results}


def _train_compile_export(world) -> dict:
    import autofuse

    _fresh_dispatch("ag_gemm:push,gemm_rs:push_last", "1")
    data = _mlp_data(world.size, world.rank)
    result = {"losses": _train(world, autofuse, data), "ref": _losses_unsharded(data["full"])}

    m = data["mine"]
    fn = lambda x, w1, w2: mlp(autofuse, x, w1, w2, world)  # noqa: E731
    eager = _fwd_bwd(fn, m["x"], m["w1"], m["w2"])
    rec = _Recorder()
    compiled = _fwd_bwd(torch.compile(fn, fullgraph=True, backend=rec.backend), m["x"], m["w1"], m["w2"])
    result["compile_diff"] = max(rel(c, e.double()) for c, e in zip(compiled, eager))
    result["compile_nodes"] = [autofuse_nodes(g) for g in rec.graphs]

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = torch.nn.Parameter(m["w1"].clone()), torch.nn.Parameter(m["w2"].clone())

        def forward(self, x):
            return mlp(autofuse, x, self.w1, self.w2, world)

    exported = torch.export.export(Mlp(), (m["x"],))
    result["export_nodes"] = autofuse_nodes(exported.graph_module)
    _fresh_dispatch("", "1")
    result["layer"] = _layer_compile(world)
    result["fake"] = _no_agreement_while_tracing(world)
    result["gathered"] = _gathered_sources(world)
    return result


def test_training_compile_export_w2():
    for r in spawn(_train_compile_export, 2, timeout_s=300):
        assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(r["losses"], r["ref"])), (r["losses"], r["ref"])
        assert r["losses"][-1] < r["losses"][0]  # it trains
        assert r["compile_diff"] <= 1e-6, r["compile_diff"]
        fwd, bwd = r["compile_nodes"]
        assert fwd == ["autofuse.ag_gemm_gathered.default", "autofuse.gemm_rs.default"], fwd
        assert bwd == ["autofuse.ag_gemm_gathered.default", "autofuse.gemm_rs.default"], bwd  # gemm_rs's, ag_gemm's
        assert r["export_nodes"] == ["autofuse.ag_gemm_gathered.default", "autofuse.gemm_rs.default"], r["export_nodes"]
        layer = r["layer"]
        assert layer["diff"] <= 1e-6, layer["diff"]
        fwd, bwd = layer["nodes"]  # qkv, o_proj, gate_up, down; backward in reverse
        assert fwd == ["autofuse.ag_gemm_gathered.default", "autofuse.gemm_rs.default"] * 2, fwd
        assert sorted(bwd) == sorted(fwd), bwd
        ran = {f"{f} {v}" for f in ("rows", "k") for v in ("bsp", "heap_mm")}
        ran |= {f"{f} {v} {layout}" for f in ("rows", "k") for v in ("push", "push_ws") for layout in ("gathered", "shard")}
        ran |= {f"{f} pull shard" for f in ("rows", "k")}
        assert set(r["gathered"]) == ran, sorted(r["gathered"])
        assert r["gathered"] == gathered_expected(r["gathered"]), r["gathered"]
        fake = r["fake"]
        assert fake["shape"] == (8, 16) and fake["agreements"] == 0, fake
        assert "autofuse.toy_mm ((4, 32) torch.float32, (32, 16) torch.float32) was called while a trace runs" in \
            fake["miss"], fake["miss"]


def test_kept_gathered_a_w4():
    """Four ranks: the kept A of every variant and layout (three peers' slots in the push workspace, both
    parity halves) equals all_gather(A) exactly; only pull gathers it a second time."""
    for r in spawn(_gathered_sources, 4, timeout_s=300):
        assert {c.split()[1] for c in r} == {"bsp", "heap_mm", "push", "push_ws", "pull"}, sorted(r)
        assert r == gathered_expected(r), r


# -- GPU (marker gpu): bf16 at GPU sizes, inductor and reduce-overhead ------------------------------------
GPU_DIMS = (512, 1024, 256)  # M, K, N (ag_gemm: N per rank)
GPU_TOL = 2e-2  # bf16 operands (the reference takes the same rounded values), float32 accumulation; the
# output, partials and gradients are rounded to bf16 (u = 2^-8) a few times: ~1e-2 at worst, a wrong term O(1)


def _gpu_cases(world) -> list:
    """Every forward variant this job can run, of every GEMM op and form; the backward's gemm_rs and ag_gemm
    variants rotate over theirs; the gathered A kept and gathered again in turns."""
    from autofuse.core import registry

    avail = {op: [v for v, var in registry.get(op).variants.items() if var.available(world)]
             for op in ("ag_gemm", "gemm_rs", "gemm_ar")}
    forms = {"ag_gemm": ("rows", "k"), "gemm_rs": ("",), "gemm_ar": ("",)}
    cases = []
    for op, op_forms in forms.items():
        for form in op_forms:
            for v in avail[op]:
                i = len(cases)
                env = ",".join(f"{o}:{avail[o][i % len(avail[o])]}" for o in ("gemm_rs", "ag_gemm"))
                cases.append((op, form, v, env, str(i % 2)))
    return cases


def _gpu_compile(world) -> dict:
    """The MLP eager vs inductor (fullgraph) vs reduce-overhead over three steps of new inputs, and the
    example layer's prefill eager vs inductor; every op on heap variants (capturable with ranks sharing a
    GPU too, where the collective library is gloo)."""
    import autofuse

    _fresh_dispatch("ag_gemm:heap_mm,gemm_rs:mm_heap", "1")
    dev, dt = world.device, torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(world.rank)
    w1 = torch.randn(1024, 512, generator=gen, device=dev).mul_(1024 ** -0.5).to(dt)
    w2 = torch.randn(512, 1024, generator=gen, device=dev).mul_(512 ** -0.5).to(dt)
    fn = lambda x, w1, w2: mlp(autofuse, x, w1, w2, world)  # noqa: E731
    inductor = torch.compile(fn, fullgraph=True)
    graphs = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    worst = {"inductor": 0.0, "reduce-overhead": 0.0}
    for step in range(3):
        x = torch.randn(128, 1024, generator=gen, device=dev).to(dt)
        eager = _fwd_bwd(fn, x, w1, w2)
        for name, compiled in (("inductor", inductor), ("reduce-overhead", graphs)):
            got = _fwd_bwd(compiled, x, w1, w2)
            worst[name] = max(worst[name], *(rel(c, e.double()) for c, e in zip(got, eager)))
    result = {"mlp": worst}
    _fresh_dispatch("", "1")
    from test_layer import example

    ex = example()
    cfg = ex.CONFIGS["tiny"]
    weights = ex.random_weights(cfg, world.rank, world.size, seed=0, device=dev, dtype=dt)
    names = [f.name for f in fields(weights) if f.name != "qkv_rows"]
    x = torch.randn(64 // world.size, cfg.hidden, generator=gen, device=dev).to(dt)

    def prefill(x, *tensors):
        w = ex.TPWeights(qkv_rows=weights.qkv_rows, **dict(zip(names, tensors)))
        return ex.TPLlamaLayer(cfg, w, ex.AutofuseOps(world.group), world.group).prefill(x)

    params = [getattr(weights, n) for n in names]
    eager = _fwd_bwd(prefill, x, *params)
    got = _fwd_bwd(torch.compile(prefill, fullgraph=True), x, *params)
    result["layer"] = max(rel(c, e.double()) for c, e in zip(got, eager))
    return result


def _gpu_grads(world) -> list:
    return _grad_cases(world, _gpu_cases(world), torch.bfloat16, GPU_DIMS)


@harness.gpu(2)
def test_gpu_gradients_every_variant():
    """GPU: gradients of every available variant of every GEMM op and form, bf16, against float64."""
    _check(spawn(_gpu_grads, harness.gpu_world(), device_kind="cuda", timeout_s=540), GPU_TOL)


@harness.gpu(2)
def test_gpu_gathered_a_without_a_second_all_gather():
    """GPU: the A that ag_gemm_gathered keeps, bf16, per variant (torch_symm's return_A included): exact, and
    gathered a second time only where the variant cannot give it."""
    for r in spawn(_gathered_sources, harness.gpu_world(), GPU_DIMS, torch.bfloat16, device_kind="cuda",
                   timeout_s=300):
        assert r == gathered_expected(r) and any("torch_symm" in c for c in r) == (not harness.ranks_share_gpus()), r


@harness.gpu(2)
def test_gpu_inductor_and_reduce_overhead():
    """GPU: torch.compile (inductor, fullgraph) and mode="reduce-overhead" forward and backward equal eager."""
    for c in spawn(_gpu_compile, harness.gpu_world(), device_kind="cuda", timeout_s=540):
        assert c["mlp"]["inductor"] <= GPU_TOL and c["mlp"]["reduce-overhead"] <= GPU_TOL, c
        assert c["layer"] <= GPU_TOL, c


def _weight_copies_in_backward(world, variant: str) -> list:
    """Shapes of the tensors aten copies (clone, copy_, _to_copy) make in gemm_rs's backward that have
    the transposed weight's shape (N x K_r): the copy `b.t().contiguous()` made before ag_gemm read B^T."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import autofuse

    _fresh_dispatch(f"ag_gemm:{variant}", "1")
    s = unsharded("gemm_rs", "", world.size, world.rank, (16, 32, 48), seed=3)
    a, b = s["a"].requires_grad_(), s["b"].requires_grad_()
    c = autofuse.gemm_rs(a, b, group=world, variant="bsp")
    copies = []

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_, torch.ops.aten._to_copy):
                if isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(b.t().shape):
                    copies.append(str(func))
            return out

    with Copies():
        (c * s["g"]).sum().backward()
    return [copies, rel(a.grad, s["da"]), rel(b.grad, s["db"])]


@pytest.mark.parametrize("variant", ["bsp", "push"])
def test_gemm_rs_backward_reads_the_weight_transposed_in_place(variant):
    """dA = ag_gemm(dC, B^T) takes B^T as the column-major view it is (no transposed copy of the weight:
    at Llama-3-70B sizes such copies cost ~1.2 ms a training step on H200), and stays exact."""
    for copies, ea, eb in spawn(_weight_copies_in_backward, 2, variant, timeout_s=300):
        assert copies == [] and ea <= TOL and eb <= TOL, (copies, ea, eb)
