"""autofuse.nn's expert-parallel MoE on CPU ranks: `ExpertParallelMoE` and `autofuse.parallelize` on tiny
random transformers Mixtral, Qwen2-MoE and Qwen3-MoE models (config objects, no download).

One spawned job per world size (2 and 4) runs every check and returns what it measured. Each rank
builds the same float32 model (same seed); the reference is the unsharded model in float64, the
parallel one runs in float32, so outputs differ by float32 roundoff (~1e-7 relative): TOL = 1e-5 on
logits, GRAD_TOL = 1e-4 on gradients (sums over tokens with cancellation); a wrong expert shard, a
token sent twice or lost, or a missing gradient sum is off by O(1). Routings: the models' own
(random), skewed (a forward hook on every router makes all tokens pick rank 0's experts: the other
ranks receive no rows), empty experts (every token picks the first and the last expert), and one
token (fewer tokens than ranks: every rank but rank 0 sends only a padding row, to its own experts);
the other cases have 12 tokens, a multiple of both world sizes. With sequence_parallel=True (SP_CASES):
7 tokens a sequence (padded to a multiple of W), one token, transformers' load-balancing loss (router
logits gathered, padding dropped), a deep copy of the parallelized model, and (world 2) a skewed routing
and the model under torch.compile(fullgraph=True), forward and backward.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import harness
from harness import rel

pytest.importorskip("transformers")

TOL = 1e-5
GRAD_TOL = 1e-4
# bfloat16 GEMMs on both sides, summed in another order: logits ~4.7e-3; gradients up to 4.4e-2 (layer 1's
# q/k projections, small sums with cancellation; 4.9e-2 with the experts in float32, before they were cast).
# A wrong expert, shard or lost gradient is O(1).
AUTOCAST_TOL = 1e-1
WORLDS = (2, 4)


def tiny_mixtral(world: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=world if world > 2 else 2, head_dim=8, num_local_experts=2 * world,
                        num_experts_per_tok=2, max_position_embeddings=32, attn_implementation="eager",
                        experts_implementation="eager")
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg)


def tiny_qwen2_moe(world: int):
    """Qwen2-MoE: q/k/v biases, a shared expert with its sigmoid gate, norm_topk_prob False, layer 1 dense."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                         shared_expert_intermediate_size=32, num_experts=2 * world, num_experts_per_tok=2,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, mlp_only_layers=[1],
                         max_position_embeddings=32, attn_implementation="eager",
                        experts_implementation="eager")
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(cfg)
    with torch.no_grad():
        for m in model.modules():  # transformers zeroes them; a bias given to the wrong rank must show
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.normal_(0.0, 0.5)
    return model


def tiny_qwen3_moe(world: int):
    """Qwen3-MoE: per-head q/k norms in attention (random weights: the ones transformers gives hide a norm
    left out), norm_topk_prob True, layer 1 dense."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                         num_experts=2 * world, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=world if world > 2 else 2, head_dim=8, mlp_only_layers=[1],
                         max_position_embeddings=32, attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(0)
    return harness.random_head_norms(Qwen3MoeForCausalLM(cfg))


def _force(model: nn.Module, kind: str, world: int) -> None:
    """Make every router pick `kind`'s experts (a forward hook, copied with the router by from_module)."""
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:
            continue
        e, k = gate.num_experts, gate.top_k
        allowed = torch.arange(e // world) if kind == "skewed" else torch.tensor([0, e - 1])

        def hook(module, args, output, allowed=allowed, k=k):
            logits, weights, _ = output
            mask = torch.full_like(logits, -1e9)
            mask[:, allowed] = 0
            return logits, weights, torch.topk(logits.detach() + mask, k, dim=-1).indices

        gate.register_forward_hook(hook)


def _model_case(world, make, kind: str, shape: tuple[int, int], sp: bool = False, aux: bool = False,
                copied: bool = False, compiled: bool = False, autocast: bool = False) -> dict:
    """Logits, loss and every weight's gradient of the parallelized model against the float64 unsharded one.
    `sp`: sequence_parallel=True. `aux`: output_router_logits=True with router_aux_loss_coef 1 (transformers'
    load-balancing loss in the loss) and an attention mask hiding sequence 1's last two tokens (which the loss
    leaves out of the router statistics); its aux_loss compared too. `copied`: a deep copy of the parallelized
    model is run (its gradient sums must survive the copy). `compiled`: the model runs under
    torch.compile(fullgraph=True) (the rows received are not counted: a count read on the host breaks the graph).
    `autocast`: both models under torch.autocast("cpu", bfloat16), the unsharded one in float32 (mixed precision)."""
    import autofuse

    base = make(world.size)
    if kind in ("skewed", "empty"):
        _force(base, kind, world.size)
    if aux:
        base.router_aux_loss_coef = 1.0
    ids = torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(3))
    labels = ids if shape[1] > 1 else None  # one token has no next-token target: the logits' mean square then
    mask = None
    if aux:
        mask = torch.ones(shape, dtype=torch.long)
        mask[1, -2:] = 0
    auxes = []

    def loss(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            o = m(input_ids=ids, labels=labels, attention_mask=mask, output_router_logits=aux)
        auxes.append(o.aux_loss)
        return o.logits, o.loss if labels is not None else o.logits.square().mean()

    want = harness.unsharded_run(copy.deepcopy(base) if autocast else copy.deepcopy(base).double(), loss)
    model = autofuse.parallelize(copy.deepcopy(base), world.group, sequence_parallel=sp)
    if copied:
        model = copy.deepcopy(model)
    from autofuse.nn import public

    received, dtypes, dispatch = [], set(), public.moe_dispatch

    def counting(*args, **kwargs):
        h, handle = dispatch(*args, **kwargs)
        received.append(int(handle.tensors["counts"].sum()))
        dtypes.add(str(args[0].dtype))
        return h, handle

    if not compiled:
        public.moe_dispatch = counting  # the rows each call brought to this rank's experts (what the blocks call)
    try:
        got = harness.against(model, loss, want, call=torch.compile(model, fullgraph=True) if compiled else None)
    finally:
        public.moe_dispatch = dispatch
    if aux:
        got["aux"] = rel(auxes[1], auxes[0])
    return {**got, "received": received, "expert dtypes": sorted(dtypes),
            "blocks": sum(isinstance(m, autofuse.nn.ExpertParallelMoE) for m in model.modules()),
            "shared swiglu": sorted({type(vars(m).get("forward")).__name__ for m in model.modules()
                                     if getattr(m, "gate_up_proj", None) is not None and hasattr(m, "act_fn")})}


def _copies(world) -> dict:
    """from_module copies: changing the transformers block afterwards leaves the EP block as it was."""
    from autofuse.nn import ExpertParallelMoE

    block = tiny_mixtral(world.size).model.layers[0].mlp
    ep = ExpertParallelMoE.from_module(block, world.group)
    before = [t.clone() for t in (ep.w1, ep.w2, ep.gate.weight)]
    ptrs = {p.data_ptr() for p in block.parameters()}
    with torch.no_grad():
        for p in block.parameters():
            p.add_(1.0)
    try:  # a block whose forward scales the routed output differs from what was read: refused
        ExpertParallelMoE.from_module(_Block4(16, 8, 2 * world.size, 2, scale=2.5), world.group)
        scaled = "no error"
    except ValueError as exc:
        scaled = str(exc)
    return {"unchanged": all(torch.equal(a, b) for a, b in zip(before, (ep.w1, ep.w2, ep.gate.weight))),
            "shared storage": any(p.data_ptr() in ptrs for p in ep.parameters()), "scaled": scaled}


class _Expert(nn.Module):
    """A transformers-4 style expert (gate_proj / up_proj / down_proj nn.Linear)."""

    def __init__(self, h: int, f: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False), \
            nn.Linear(f, h, bias=False)
        self.act_fn = nn.SiLU()


class _Block4(nn.Module):
    """A transformers-4 style sparse MoE block: an nn.Linear gate, a list of experts, norm_topk_prob off;
    its forward routes as transformers 4's Mixtral (softmax, top-k, not renormalised) and returns
    (hidden states, router logits). `scale` multiplies the routed output (a routed scaling factor, which
    ExpertParallelMoE does not apply: from_module must refuse such a block)."""

    def __init__(self, h: int, f: int, e: int, k: int, scale: float = 1.0):
        super().__init__()
        self.gate, self.experts = nn.Linear(h, e, bias=False), nn.ModuleList(_Expert(h, f) for _ in range(e))
        self.top_k, self.norm_topk_prob, self.scale = k, False, scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.reshape(-1, x.shape[-1])
        logits = self.gate(rows)
        weights, ids = torch.topk(torch.softmax(logits, -1), self.top_k, -1)
        out = torch.zeros_like(rows)
        for j in range(self.top_k):
            for i, ex in enumerate(self.experts):
                hit = ids[:, j] == i
                y = ex.down_proj(ex.act_fn(ex.gate_proj(rows[hit])) * ex.up_proj(rows[hit]))
                out[hit] += weights[hit, j:j + 1] * y
        return (self.scale * out).view_as(x), logits


def _standalone(world) -> dict:
    """ExpertParallelMoE alone, from a transformers-4 style block (an nn.Linear gate, norm_topk_prob off,
    gate_proj/up_proj/down_proj experts), against float64 autograd of the same block written with
    ops/moe.unsharded: the input replicated, and with sequence_parallel=True (each rank its own rows;
    the router's gradient summed over the group). Gradients compared under the block's own keys
    (full_grads gives the experts back in their source layout)."""
    from autofuse.nn import ExpertParallelMoE, full_grads
    from autofuse.ops import moe

    w, r = world.size, world.rank
    h, f, e, k, t = 32, 16, 2 * w, 2, 3
    torch.manual_seed(1)
    block = _Block4(h, f, e, k)
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(t, h, generator=gen) for _ in range(w)]  # rank i's rows (sequence parallel)
    dys = [torch.randn(t, h, generator=gen) for _ in range(w)]
    out = {}
    for sp in (False, True):
        b64 = copy.deepcopy(block).double()
        w1 = torch.stack([torch.cat([ex.gate_proj.weight.t(), ex.up_proj.weight.t()], 1) for ex in b64.experts])
        w2 = torch.stack([ex.down_proj.weight.t() for ex in b64.experts])
        whole = torch.cat(xs).double().requires_grad_()
        weights, ids = torch.topk(torch.softmax(b64.gate(whole), -1), k, -1)  # not renormalised
        want = moe.unsharded(whole, ids, weights, w1, w2, "swiglu")
        (want * torch.cat(dys).double()).sum().backward()
        ep = ExpertParallelMoE.from_module(block, world.group, sequence_parallel=sp)
        x = (xs[r] if sp else torch.cat(xs)).clone().requires_grad_()
        y = ep(x)
        (y * (dys[r] if sp else torch.cat(dys))).sum().backward()
        mine = slice(r * t, (r + 1) * t) if sp else slice(None)
        grads, want_grads = full_grads(ep), dict(b64.named_parameters())
        out[f"sp={sp}"] = {"y": rel(y, want[mine]), "dx": rel(x.grad, whole.grad[mine]),
                           "keys": sorted(grads) == sorted(want_grads),
                           "worst grad": max(rel(grads[n], p.grad) for n, p in want_grads.items())}
    return out


def _tensor_parallel(world) -> dict:
    """autofuse.nn.moe_tp on a Mixtral block (experts [gate | up] halves, where GPT-OSS's in test_nn are
    interleaved pairs) and a Qwen2-MoE block (its shared expert split with the experts, its shared expert gate
    kept whole), made tensor-parallel though ExpertParallelMoE could take them: output, input gradient and
    every parameter's gradient (full_grads, under the block's own keys) against float64 autograd of the block,
    input replicated and with sequence_parallel=True; the gathered state_dict equal to the block's; the block
    left as it was (copies); a block whose forward reaches weights outside it refused; GPT-OSS with its
    load-balancing loss, both forms (the tensor-parallel routers record every row on every rank and their
    gradient is summed: the loss's gradient must reach them once) and a deep copy of the parallel model; at
    world 2, Llama 4 (sequence parallel) under torch.compile(fullgraph=True)."""
    from autofuse.nn import full_grads, full_state_dict, moe_tp
    from autofuse.nn.shards import Split

    w, r = world.size, world.rank
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(1, 3, 32, generator=gen) for _ in range(w)]  # rank i's rows (sequence parallel)
    dys = [torch.randn(1, 3, 32, generator=gen) for _ in range(w)]
    out: dict = {}
    for name, make in (("mixtral", tiny_mixtral), ("qwen2_moe", tiny_qwen2_moe)):
        block = make(w).model.layers[0].mlp
        before = {k: v.clone() for k, v in block.state_dict().items()}
        for sp in (False, True):
            b64 = copy.deepcopy(block).double()
            whole = torch.cat(xs, 1).double().requires_grad_()
            want = b64(whole)
            want = want[0] if isinstance(want, tuple) else want
            (want * torch.cat(dys, 1).double()).sum().backward()
            tp = moe_tp.from_module(block, world.group, sequence_parallel=sp)
            x = (xs[r] if sp else torch.cat(xs, 1)).clone().requires_grad_()
            y = tp(x)
            y = y[0] if isinstance(y, tuple) else y
            (y * (dys[r] if sp else torch.cat(dys, 1))).sum().backward()
            mine = slice(r * 3, (r + 1) * 3) if sp else slice(None)
            grads, want_grads = full_grads(tp), dict(b64.named_parameters())
            state = full_state_dict(tp)
            specs = tp.autofuse_shards.specs
            out[(name, sp)] = {"y": rel(y, want[:, mine]), "dx": rel(x.grad, whole.grad[:, mine]),
                               "keys": sorted(grads) == sorted(want_grads),
                               "worst grad": max(rel(grads[n], p.grad) for n, p in want_grads.items()),
                               "state": sorted(state) == sorted(before) and all(torch.equal(state[k], v)
                                                                                for k, v in before.items()),
                               "halves": any(isinstance(c, Split) and len(c.parts) == 2 for c in specs.values()),
                               "shared split": all(n in specs for n in before if n.startswith("shared_expert."))}
        out[(name, "unchanged")] = all(torch.equal(block.state_dict()[k], v) for k, v in before.items())
    block = tiny_mixtral(w).model.layers[0].mlp
    block.forward = lambda h, forward=block.forward: forward(h)  # a copy of it would still run this block's weights
    try:
        moe_tp.plan(block, world.group)
        out["reaches outside"] = "no error"
    except ValueError as exc:
        out["reaches outside"] = str(exc)
    import test_nn

    import autofuse

    oss = test_nn.tiny_family("gpt_oss")
    oss.config.output_router_logits = True
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(6))
    loss = test_nn.lm_loss(ids)
    want = harness.unsharded_run(copy.deepcopy(oss).double(), loss)
    for sp in (False, True):
        out[f"gpt_oss aux sp={sp}"] = harness.against(autofuse.parallelize(copy.deepcopy(oss), world.group,
                                                                          sequence_parallel=sp), loss, want)
    made = autofuse.parallelize(copy.deepcopy(oss), world.group)  # a deep copy of it trains as it would
    out["gpt_oss copied"] = harness.against(copy.deepcopy(made), loss, want)
    if w == 2:  # Llama 4's MoE has no data-dependent shapes: the whole model compiles (GPT-OSS's eager experts loop does not)
        l4 = test_nn.tiny_family("llama4_text")
        want = harness.unsharded_run(copy.deepcopy(l4).double(), loss)
        model = autofuse.parallelize(copy.deepcopy(l4), world.group, sequence_parallel=True)
        out["llama4 compiled sp"] = harness.against(model, loss, want,
                                                    call=torch.compile(model, fullgraph=True, backend="aot_eager"))
    return out


def _job(world) -> dict:
    torch.set_num_threads(1)
    out: dict = {"copies": _copies(world), "standalone": _standalone(world), "tensor parallel": _tensor_parallel(world)}
    for name, make in MODELS.items():
        for kind in ("random", "skewed", "empty"):
            out[(name, kind)] = _model_case(world, make, kind, (2, 6))
    for sp in (False, True):
        out[("qwen2_moe", "autocast", sp)] = _model_case(world, tiny_qwen2_moe, "random", (2, 7), sp=sp, autocast=True)
    out[("mixtral", "one token")] = _model_case(world, tiny_mixtral, "random", (1, 1))
    for name, kind, shape in SP_CASES[world.size]:
        out[(name, kind, "sp")] = _model_case(world, MODELS[name], kind, shape, sp=True, aux=kind == "aux",
                                              copied=kind == "copied", compiled=kind == "compiled")
    return out


# sequence_parallel=True: 7 tokens (padded to 8 rows per sequence), one token (rank 0 holds it, the others
# padding only), the load-balancing loss, a deep copy, a skewed routing, torch.compile(fullgraph=True);
# world 4 a subset (CI time).
SP_CASES = {
    2: [("mixtral", "random", (2, 7)), ("qwen2_moe", "random", (2, 7)), ("qwen3_moe", "random", (2, 7)),
        ("mixtral", "one token", (1, 1)), ("qwen3_moe", "aux", (2, 7)), ("qwen2_moe", "copied", (2, 7)),
        ("qwen3_moe", "skewed", (2, 7)), ("qwen3_moe", "compiled", (2, 7))],
    4: [("qwen3_moe", "random", (2, 7)), ("qwen2_moe", "aux", (2, 7))],
}


MODELS = {"mixtral": tiny_mixtral, "qwen2_moe": tiny_qwen2_moe, "qwen3_moe": tiny_qwen3_moe}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def job(request) -> tuple[int, list[dict]]:
    return request.param, harness.cpu_job(_job, request.param)


# ------------------------------------------------------------------------------------------ tests
def test_parallel_moe_models_match_the_unsharded_float64_model(job) -> None:
    """Mixtral, Qwen2-MoE and Qwen3-MoE (per-head q/k norms: their gradients summed over the group): logits,
    loss and every weight gradient (gathered back into transformers' keys and layouts) match, with the
    models' routing, a skewed one and one leaving experts empty; with sequence parallelism Qwen2-MoE's shared
    expert runs its SwiGLU through autofuse.nn.swiglu."""
    w, ranks = job
    for r, res in enumerate(ranks):
        for case, v in res.items():
            if not isinstance(case, tuple) or case[1] == "autocast":
                continue
            assert v["logits"] <= TOL and v["loss"] <= TOL, (w, r, case, v)
            assert v["grad keys"] and v["state keys"] and v["worst grad"] <= GRAD_TOL, (w, r, case, v)
            assert v["blocks"] == (2 if case[0] == "mixtral" else 1), (case, v)
            assert v.get("aux", 0.0) <= TOL, (w, r, case, v)
            if case[0] == "qwen2_moe" and case[-1] == "sp":  # its shared expert's SwiGLU: one kernel each way
                assert v["shared swiglu"] == ["FusedForward"], (case, v["shared swiglu"])
    sp = [case for case in ranks[0] if isinstance(case, tuple) and case[-1] == "sp"]
    assert len(sp) == len(SP_CASES[w]) and (w == 4 or {c[1] for c in sp} >= {"aux", "copied", "skewed", "compiled"}), sp


def test_experts_run_in_autocasts_dtype(job) -> None:
    """float32 weights under torch.autocast(bfloat16) (mixed precision): the experts get bfloat16 rows and
    weights (they ran in float32 before), and logits, loss and every float32 gradient equal the unsharded
    model's under the same autocast within bfloat16 rounding, both forms."""
    w, ranks = job
    for r, res in enumerate(ranks):
        for sp in (False, True):
            v = res[("qwen2_moe", "autocast", sp)]
            assert v["expert dtypes"] == ["torch.bfloat16"], (w, r, sp, v)
            assert v["grad keys"] and max(v["logits"], v["loss"], v["worst grad"]) <= AUTOCAST_TOL, (w, r, sp, v)


def test_skewed_and_empty_routings_leave_ranks_without_rows(job) -> None:
    w, ranks = job
    for model in MODELS:
        rows = [res[(model, "skewed")]["received"] for res in ranks]
        assert all(n > 0 for n in rows[0]) and all(n == 0 for rr in rows[1:] for n in rr), (model, rows)
        rows = [res[(model, "empty")]["received"] for res in ranks]
        assert all(n > 0 for n in rows[0] + rows[-1]), (model, rows)
        assert all(n == 0 for rr in rows[1:-1] for n in rr), (model, rows)  # world 4: ranks 1, 2 get none
    assert sum(sum(res[("mixtral", "one token")]["received"]) for res in ranks) == 2 * w * 2  # padded to W rows, top-2
    if w == 2:  # sequence parallel: each rank sends its own rows (padding included), none reach rank 1's experts
        rows = [res[("qwen3_moe", "skewed", "sp")]["received"] for res in ranks]
        assert rows[0] == [2 * 8 * 2] and rows[1] == [0], rows  # 2 sequences padded to 8 rows, top-2, one MoE layer
        assert sum(sum(res[("mixtral", "one token", "sp")]["received"]) for res in ranks) == 2 * w * 2


def test_standalone_block_and_sequence_parallel(job) -> None:
    w, ranks = job
    for r, res in enumerate(ranks):
        for sp, v in res["standalone"].items():
            assert v["keys"] and max(v["y"], v["dx"]) <= TOL and v["worst grad"] <= GRAD_TOL, (w, r, sp, v)


def test_tensor_parallel_experts_match_float64_and_refuse_a_block_they_cannot_reproduce(job) -> None:
    w, ranks = job
    for r, res in enumerate(ranks):
        tp = res["tensor parallel"]
        for name in ("mixtral", "qwen2_moe"):
            for sp in (False, True):
                v = tp[(name, sp)]
                assert v["keys"] and v["state"] and v["halves"] and v["shared split"], (w, r, name, sp, v)
                assert max(v["y"], v["dx"]) <= TOL and v["worst grad"] <= GRAD_TOL, (w, r, name, sp, v)
            assert tp[(name, "unchanged")], (w, r, name)
        assert "no cut of its experts' width" in tp["reaches outside"], tp["reaches outside"]
        cases = [f"gpt_oss aux sp={sp}" for sp in (False, True)] + ["gpt_oss copied"] + (["llama4 compiled sp"] if w == 2 else [])
        for case in cases:
            v = tp[case]
            assert v["logits"] <= TOL and v["loss"] <= TOL and v["grad keys"] and v["worst grad"] <= GRAD_TOL, (w, r, case, v)


def test_from_module_copies(job) -> None:
    _, ranks = job
    for res in ranks:
        c = dict(res["copies"])
        scaled = c.pop("scaled")
        assert c == {"unchanged": True, "shared storage": False}, res["copies"]
        assert "its forward differs from top-k routed SwiGLU experts" in scaled and "so it is not split" in scaled, scaled


def test_bench_moe_checks_and_times_on_cpu() -> None:
    """`autofuse bench moe` on 2 CPU ranks, skew 100 (every row on rank 0's experts): every contender agrees
    with bsp and the float64 block, is timed (block, dispatch, combine), no speedup from the interpreter,
    and the moved bytes are rank 1's 4 x 2 rows of H=32 float32 (rank 0 keeps its own); the heap all-to-all
    alone moves the same rows as NCCL's."""
    from autofuse.bench import bench_moe
    from autofuse.bench.bench import BenchOptions

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = bench_moe.run(BenchOptions(target="moe", world=2, tokens=["4"], skew=100, reps=1,
                                            progress=False).resolved())
    (row,) = result["rows"]
    assert result["contenders"][-1] == "autofuse" and "bsp" in result["contenders"], result["contenders"]
    assert row["ok"] and max(row["ref_diff"].values()) <= result["tolerance"], row
    assert all(v > 0 for part in ("us", "dispatch_us", "combine_us") for v in row[part].values()), row
    assert row["x_bsp"] == {} and row["dispatch_GBps"] == {} and result["interpreted"], row
    assert row["autofuse_vs_best"] is None, row  # no ratios from the interpreter's times
    assert row["moved_bytes"] == 4 * 2 * 32 * 4 and row["model"] == "tiny" and row["skew"] == 100, row
    assert {"fused", "hybrid", "hybrid/fused"} <= set(row["us"]), row["us"]  # fused: both ops'; the pair mixed
    a2a = row["a2a"]  # the heap all-to-all alone: its rows equal NCCL's, timed both ways; rank 0 receives
    assert not a2a["wrong"] and all(a2a["us"][n] > 0 for n in ("nccl", "dispatch", "combine")), a2a
    assert a2a["recv_bytes"] == 4 * 2 * 32 * 4 and a2a["back_bytes"] == 4 * 2 * 32 * 4, a2a  # rank 1's rows


def test_bench_moe_contenders_name_their_pair() -> None:
    from autofuse.bench.bench_moe import _pair

    dispatch = {"bsp": 0, "hybrid": 0, "fused": 0}
    assert _pair("autofuse", dispatch) == (None, None) and _pair("fused", dispatch) == ("fused", "fused")
    assert _pair("hybrid/fused", dispatch) == ("hybrid", "fused")
    assert _pair("fused", {"bsp": 0, "hybrid": 0}) == ("hybrid", "fused")  # a combine variant dispatch has not


def test_bench_moe_autofuse_over_the_fastest_forced_contender() -> None:
    from autofuse.bench.bench_moe import _vs_best

    us = {"bsp": {"block": 10.0}, "hybrid": {"block": 5.0}, "fused": {"block": 4.0}, "autofuse": {"block": 5.0}}
    assert _vs_best(us) == 1.25
    assert _vs_best({"bsp": {"block": 10.0}}) is None and _vs_best({"autofuse": {"block": 3.0}}) is None


def test_bench_moe_routing_skew() -> None:
    from autofuse.bench.bench_moe import routing

    ids, weights = routing(4000, 8, 2, 2, 75, torch.Generator().manual_seed(0))
    share = float((ids < 4).float().mean())
    assert abs(share - 0.75) < 0.03 and torch.allclose(weights.sum(1), torch.ones(4000))
    assert all(len(set(r.tolist())) == 2 for r in ids[:100])  # distinct experts per token
