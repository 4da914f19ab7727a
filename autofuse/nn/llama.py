"""Hugging Face transformers Llama-family decoder models (Llama, Mistral, Qwen2, Qwen3, Phi-3, GLM-4, OLMo2, ...) made tensor-parallel.

What is recognised: a model whose base model (`model.base_model`), or in a vision-language model (Llava,
Qwen2.5-VL, Gemma 3, Mistral 3, ...) its language model (`text_model`: the vision tower and projector
stay whole on every rank, their gradients whole too), has `layers`, each with `self_attn`
and `mlp` holding one of the projection sets `ATTENTION_FORMS` / `MLP_FORMS` name (nn.Linear layers):
attention q_proj, k_proj, v_proj, o_proj, or qkv_proj (q, k, v fused: Phi-3) and o_proj; MLP
gate_proj, up_proj, down_proj, or gate_up_proj (fused: Phi-3, GLM-4) and down_proj, or an ungated
up_proj / down_proj (Arcee, Apertus) or c_fc / c_proj (StarCoder2). Besides them, attention may hold
per-head norms of q and k (Qwen3's `q_norm` / `k_norm`, HunYuan's `query_layernorm` /
`key_layernorm`: weight [head_dim], applied to each head alike) or norms over q_proj's / k_proj's
whole width (OLMo2's `q_norm` / `k_norm`, below), and the MLP a learnable activation's
parameters (Apertus's xIELU scalars); anything else with parameters is refused, naming it. Heads and
the MLP width must divide by the group size; rank r keeps query heads block r. KV heads either divide
by the group size (rank r keeps KV heads block r) or divide it (fewer KV heads than ranks, MQA: as
vLLM does, each KV head is replicated on the group size / KV heads ranks whose query heads read it,
rank r keeps KV head r * KV heads // W, and each replica's gradient is summed over the ranks holding
it); the KV cache holds this rank's KV heads. A fused projection is split part by part (rank r keeps
its block of q, of k and of v). An attention whose forward slices a fused qkv_proj with the config's
head counts (Phi-3) gets a copy of the config with this rank's counts (`self_attn.config`; the
model's own config stays whole, so a later change of the model's attention implementation does not
reach these layers: choose it before parallelize).
Embeddings, the final norm and lm_head stay whole on every rank (replicated). The per-head norms and
activation parameters are replicated too and need nothing in the forward (each rank normalises its
own heads); their gradients come from this rank's heads or columns only, so they are summed over the
group (tensor hooks on the parameters, the same hooks as sequence parallelism's norms below), in
either form. A norm over a whole projection's width (OLMo2's q_norm over q_proj's output, k_norm over
k_proj's) becomes `autofuse.nn.ShardedRMSNorm` (autofuse/nn/norm.py): the rows' sums of squares added
over the group, each rank scaling its own columns by its shard of the weight.

sequence_parallel=False (the layout of transformers' own tensor-parallel plan for these models): the
hidden states are whole on every rank; q/k/v and gate/up are column-parallel (local GEMMs; their
input gradients all-reduced by gemm_ar), o and down row-parallel (gemm_ar). The state_dict keeps
transformers' keys, each holding this rank's shard.

sequence_parallel=True: inside the decoder layers each rank holds a block of the token rows, so norms
and residual adds run on 1/W of them. The hidden states (B, S, H) are padded along the sequence to S'
(the next multiple of W; decode steps of one token are padded to W), flattened to B S' rows, and rank
r keeps rows block r, shaped (B, S'/W, H) for transformers' code: a container, not positions
S'/W r.. of each sequence. q/k/v are one column-parallel layer `self_attn.qkv_proj` (one all-gather
of the rows per layer, inside `ag_gemm`), gate/up another, `mlp.gate_up_proj`; the separate
projections become `FusedPart` views of their columns. An attention's own fused qkv_proj (Phi-3)
becomes the layer `self_attn.qkv_proj_parallel`, its `qkv_proj` the FusedPart of all its columns. An
MLP with one column projection (fused gate_up, or ungated) runs it on the rows as they are: its
output, (W B, S'/W, ...), holds every rank's rows, which the row projection hands back as this
rank's block. o and down are row-parallel with gemm_rs, which hands each rank its row block back. The first layer scatters the rows (its gradient
all-gathered), the last gathers them (its gradient kept per block), so everything outside the layers
runs whole. Norm weights inside the layers see only this rank's rows: their gradients are summed over
the group (tensor hooks on the parameters). Hidden states recorded between layers
(output_hidden_states) are the row blocks. `autofuse.nn.full_state_dict` gives transformers' keys
back. Decode steps (one token) pay W-fold padding here: generate with sequence_parallel=False.

MoE models (transformers Mixtral, Qwen2-MoE, Qwen3-MoE: a layer's `mlp` is a sparse MoE block, see
autofuse/nn/moe.py): attention as above; each MoE block becomes `autofuse.nn.ExpertParallelMoE`
over the same group (expert parallel group = tensor parallel group: rank r keeps experts block r; the
experts must divide by the group size); dense layers (Qwen2-MoE's mlp_only_layers) are split as
Llama's MLP, in either form. sequence_parallel=False: the block routes every token on every rank,
sends row block r of the tokens from rank r through moe_dispatch / moe_combine and all-gathers the
rows back, so the hidden states stay whole on every rank between layers; Qwen2-MoE's shared expert
is tensor-parallel (gemm_ar), its gate replicated. sequence_parallel=True: the block is given this
rank's row block (ExpertParallelMoE with sequence_parallel=True): it routes and sends its own rows,
with no all-gather; the shared expert runs on the rows as the MLP above (gate/up one ag_gemm, down
gemm_rs); the router's and the shared expert gate's gradients are summed over the group. Padding
rows (zero rows in these models: o_proj has no bias) are routed and sent like the others; an
expert's output for them is zero, they reach no other row (no expert capacity limit), get no
gradient and are dropped with the padding. Router logits recorded for transformers'
load-balancing loss (output_router_logits=True; `aux_loss`, added to `loss` with labels) are this
rank's row blocks; a forward hook on the base model gathers them and drops the padding rows, so
`router_logits`, `aux_loss` and its gradients are the unsharded model's (layers parallelized one by
one with `parallelize_layer` keep the row blocks).

An MoE block `ExpertParallelMoE` cannot read (GPT-OSS's: experts with biases, a clamped SwiGLU on interleaved
gate/up columns, a router with a bias; Llama 4's, with a shared expert) is split by each expert's width instead
(`autofuse/nn/moe_tp.py`, in either form; `moe_plan` decides, before any layer changes). A layer's MLP (or MoE
block) is its `mlp` or, in Llama 4, its `feed_forward`, in GraniteMoE its `block_sparse_moe` (`MLP_NAMES`).
DeepSeek-V2/V3's multi-head latent attention (`LATENT`) is split by heads: q_proj or q_b_proj and kv_b_proj keep
this rank's heads' rows, o_proj is row-parallel; q_a_proj, kv_a_proj_with_mqa and their norms are replicated
(their gradients summed over the group) and run on every token (under sequence parallelism on every rank's rows,
gathered), and the KV cache holds the compressed latents, whole on every rank. Per-head vectors of the attention (GPT-OSS's
`sinks`: one value per query head, 1-D, not a norm's) are split with the heads (`autofuse_shards`).

Generation: transformers' KV caches size themselves from the keys they are given (this rank's heads),
the dynamic one and, in transformers 5, the static one (`cache_implementation="static"`) too; a cache
sized from the config (the whole model's heads, transformers 4's StaticCache) does not fit.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autofuse.nn import functional as tpf
from autofuse.nn.grads import GradSum
from autofuse.nn.linear import ColumnParallelLinear, FusedPart, RowParallelLinear, feed_parts, fuse_columns
from autofuse.nn.swiglu import FusedForward, fuse_gated_mlp
from autofuse.nn import moe_tp
from autofuse.nn.moe import ExpertParallelMoE, is_moe_block
from autofuse.nn.norm import ShardedRMSNorm
from autofuse.nn.forms import ATTENTION_FORMS, MLP_FORMS, Block, first, form_of, with_first
from autofuse.nn.shards import Shards, Split


MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")  # a layer's MLP or MoE block: Llama's, Llama 4's, GraniteMoE's


def mlp_name(layer: nn.Module) -> str:
    """The name of a decoder layer's MLP (or MoE block): the first of MLP_NAMES it has, else "mlp"."""
    return next((n for n in MLP_NAMES if isinstance(getattr(layer, n, None), nn.Module)), "mlp")


def text_model(model: nn.Module) -> nn.Module:
    """The module holding the decoder `layers`: the base model (`model.base_model`), or in a vision-language
    model (Llava, Qwen2.5-VL, Gemma 3, Mistral 3, ...) its language model (`language_model` or
    `text_model`, or that one's base model), whose layers are made tensor-parallel while the vision tower
    and projector stay whole on every rank."""
    base = getattr(model, "base_model", model)
    if isinstance(getattr(base, "layers", None), nn.ModuleList):
        return base
    for name in ("language_model", "text_model", "model"):  # Llama 4's causal LM names its prefix but holds `model`
        sub = getattr(base, name, None)
        for m in (sub, getattr(sub, "base_model", None), getattr(sub, "model", None)):
            if isinstance(getattr(m, "layers", None), nn.ModuleList):
                return m
    return base


def text_config(config: Any) -> Any:
    """The decoder's config: a vision-language model's text config, else the config itself."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Llama-family model; ValueError naming what is missing otherwise, or what is
    tensor-parallel already (a model given to `parallelize` a second time)."""
    layers = getattr(text_model(model), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(model).__name__} is not a Llama-family model (no base_model.layers): "
                         "pass parallelize(model, group, plan={...}) naming its linears")
    for i, layer in enumerate(layers):
        done = next((f"{n} is a {type(m).__name__}" for n, m in layer.named_modules()
                     if isinstance(m, (ColumnParallelLinear, RowParallelLinear, FusedPart, ExpertParallelMoE))), None)
        if done:
            raise ValueError(f"{type(model).__name__} is tensor-parallel already (layers.{i}.{done}): "
                             "parallelize a model once, from its whole weights")
        for block, forms in (("self_attn", ATTENTION_FORMS), (mlp_name(layer), MLP_FORMS)):
            mod = getattr(layer, block, None)
            if forms is MLP_FORMS and mod is not None and is_moe_block(mod):
                continue  # a sparse MoE block: ExpertParallelMoE.from_module checks it
            if block == "self_attn" and mod is not None and is_latent_attention(mod):
                extra = [n for n, _ in mod.named_parameters() if n.split(".")[0] not in LATENT]
                if extra:
                    raise ValueError(f"{type(model).__name__}: layers.{i}.self_attn (latent attention) has parameters "
                                     f"outside {', '.join(LATENT)} ({', '.join(extra)}); autofuse does not know how to "
                                     "split them")
                continue
            form = form_of(mod, forms)
            if mod is None:
                raise ValueError(f"{type(model).__name__}: layers.{i} has no {block} (its blocks: "
                                 f"{', '.join(n for n, _ in layer.named_children())}); "
                                 "parallelize(model, group, plan={...}) takes other models")
            if form is None:
                raise ValueError(f"{type(model).__name__}: layers.{i}.{block} has none of the nn.Linear projection sets "
                                 f"autofuse knows ({', '.join(map(str, forms))}); "
                                 "parallelize(model, group, plan={...}) takes other models")
            extra = [n for n, _ in mod.named_parameters() if n.split(".")[0] not in form.names]
            if block == "self_attn":
                extra = [n for n in extra if not (_per_head(mod, n) or _head_vector(mod, n) or _width_norm(mod, form, n))]
                where = "projections, q/k norms (per head, or over q_proj's / k_proj's width) and per-head vectors"
            else:
                extra, where = [n for n in extra if not n.startswith("act_fn.")], "projections and activation"
            if extra:
                raise ValueError(f"{type(model).__name__}: layers.{i}.{block} has parameters outside its {where} "
                                 f"({', '.join(extra)}); autofuse does not know how to split them")
    return layers


LATENT_HEADS = ("q_proj", "q_b_proj", "kv_b_proj")  # latent attention's projections to every head's q / k and v
LATENT = (*LATENT_HEADS, "q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm", "o_proj")


def is_latent_attention(attn: nn.Module) -> bool:
    """Whether `attn` is DeepSeek-V2/V3's multi-head latent attention: low-rank q (q_a_proj, q_a_layernorm,
    q_b_proj) or a plain q_proj, the shared compressed KV (kv_a_proj_with_mqa, kv_a_layernorm) expanded per
    head by kv_b_proj, and o_proj."""
    linear = lambda n: isinstance(getattr(attn, n, None), nn.Linear)  # noqa: E731
    return all(linear(n) for n in ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")) and (linear("q_b_proj") or linear("q_proj"))


def _split_latent_attention(attn: nn.Module, group: Any, sequence_parallel: bool) -> None:
    """Latent attention made tensor-parallel in place: the per-head projections (q_proj or q_b_proj, kv_b_proj)
    keep this rank's heads' rows (`autofuse_shards`), o_proj is row-parallel; the low-rank projections and their
    norms are replicated, their gradients summed over the group (each rank's heads give part of it). The cache
    holds the compressed latents, whole on every rank. The input's gradient is summed by the caller's hook."""
    world = dist.get_world_size(group)
    specs = {}
    for n in LATENT_HEADS:
        lin = getattr(attn, n, None)
        if isinstance(lin, nn.Linear):
            for t in ("weight", "bias"):
                if getattr(lin, t) is not None:
                    specs[f"{n}.{t}"] = Split(0, (lin.out_features,))
    Shards(group, specs).cut(attn)
    attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, group, sequence_parallel)
    if isinstance(getattr(attn, "num_heads", None), int):
        attn.num_heads //= world
    GradSum(group).register(attn, [n for n, _ in attn.named_parameters()
                                   if n.split(".")[0] not in (*LATENT_HEADS, "o_proj")])


def _per_head(attn: nn.Module, name: str) -> bool:
    """Whether parameter `name` of `attn` (outside its projections) is a per-head norm's (Qwen3's q_norm /
    k_norm, HunYuan's query_layernorm / key_layernorm): a norm's, 1-D and head_dim long, so applied to each
    head alike, and it splits with the heads as is (a norm over all heads' width, OLMo2's, does not)."""
    p = attn.get_parameter(name)
    return "norm" in name.split(".")[0] and p.dim() == 1 and p.shape[0] == heads(attn)[2]


def _head_vector(attn: nn.Module, name: str) -> bool:
    """Whether parameter `name` of `attn` holds one value per query head (GPT-OSS's attention `sinks`), split
    with the heads: rank r keeps query heads block r's values."""
    p = attn.get_parameter(name)
    return not _per_head(attn, name) and p.dim() == 1 and p.shape[0] == heads(attn)[0]


WIDTH_NORMS = {"q_norm": "q_proj", "k_norm": "k_proj"}  # OLMo2's: an RMSNorm over the projection's whole output


def _width_norm(attn: nn.Module, form: Block, name: str) -> bool:
    """Whether parameter `name` of `attn` is the weight of a norm over a whole projection's output (OLMo2's
    q_norm over q_proj's width), which `ShardedRMSNorm` splits with the projection's columns."""
    norm, _, attr = name.partition(".")
    proj = WIDTH_NORMS.get(norm)
    p = attn.get_parameter(name)
    return (attr == "weight" and proj in form.columns and p.dim() == 1
            and p.shape[0] == getattr(attn, proj).out_features)


def heads(attn: nn.Module) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a transformers attention module, from its config."""
    cfg = getattr(attn, "config", None)
    if cfg is None:  # older transformers: the module's own counts
        n = attn.num_heads
        return n, getattr(attn, "num_key_value_heads", None) or n, attn.head_dim
    n = cfg.num_attention_heads
    head_dim = getattr(attn, "head_dim", None) or getattr(cfg, "head_dim", None) or cfg.hidden_size // n
    return n, getattr(cfg, "num_key_value_heads", None) or n, head_dim


def check_sizes(config: Any, world: int, what: str = "the model", dense_mlp: bool = True) -> None:
    """ValueError unless heads and (`dense_mlp`: some layer has a dense MLP) the MLP width of `config` (a
    transformers config or a dict of its fields) divide by the group size, and its KV heads divide by it
    or divide it (module doc)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    n = get("num_attention_heads")
    kv = get("num_key_value_heads") or n
    sizes = {"num_attention_heads": n}
    if dense_mlp:
        sizes["intermediate_size"] = get("intermediate_size")
    bad = [f"{k}={v}" for k, v in sizes.items() if v % world]
    if bad:
        raise ValueError(f"{what}: {', '.join(bad)} not divisible by the tensor-parallel size {world}")
    if kv % world and world % kv:
        raise ValueError(f"{what}: num_key_value_heads={kv} neither divisible by the tensor-parallel size {world} "
                         f"nor dividing it (fewer KV heads than ranks are replicated, group size / KV heads ranks each)")


def kv_shards(attn: nn.Module, world: int) -> int:
    """How many shards the KV projections of `attn` are split into: the group size, or the KV heads where
    there are fewer (each replicated; module doc)."""
    kv = heads(attn)[1]
    return world if kv % world == 0 else kv


def _columns(attn_or_mlp: nn.Module, name: str, world: int, kv: int) -> dict:
    """`from_linear`'s parts and shards for column projection `name` of a block (k/v: `kv` shards; a
    fused projection: its parts)."""
    if name in ("k_proj", "v_proj"):
        return {"shards": kv}
    if name == "qkv_proj":
        n, kvh, d = heads(attn_or_mlp)
        return {"parts": (n * d, kvh * d, kvh * d), "shards": (world, kv, kv)}
    if name == "gate_up_proj":
        half = getattr(attn_or_mlp, name).out_features // 2
        return {"parts": (half, half)}
    return {}


def _local_head_counts(attn: nn.Module, world: int, kv_shards: int) -> None:
    """Give the attention this rank's head counts where its code reads them: older transformers' own
    counts (num_heads, num_key_value_heads: one KV head where KV heads are replicated), the query heads
    per KV head that repeat_kv and SDPA's GQA read (`num_key_value_groups`: changed only where KV heads
    are replicated), and, for a fused qkv_proj (whose forward slices it with the config's head counts),
    a copy of the config with this rank's counts (the model's own config is left whole)."""
    for name, split in (("num_heads", world), ("num_key_value_heads", kv_shards), ("num_attention_heads", world)):
        if isinstance(getattr(attn, name, None), int):
            setattr(attn, name, getattr(attn, name) // split)
    if isinstance(getattr(attn, "hidden_size", None), int) and hasattr(attn, "num_heads"):
        attn.hidden_size = attn.num_heads * attn.head_dim
    if isinstance(getattr(attn, "num_key_value_groups", None), int):
        attn.num_key_value_groups = attn.num_key_value_groups * kv_shards // world
    if isinstance(getattr(attn, "qkv_proj", None), nn.Linear):
        n, kv, _ = heads(attn)
        attn.config = copy.copy(attn.config)
        attn.config.num_attention_heads, attn.config.num_key_value_heads = n // world, kv // kv_shards


def parallelize(model: nn.Module, group: Any, sequence_parallel: bool) -> None:
    """Make a Llama-family model tensor-parallel in place (module doc)."""
    layers = decoder_layers(model)
    world = dist.get_world_size(group)
    moe = [is_moe_block(getattr(layer, mlp_name(layer))) for layer in layers]
    config = text_config(model.config)
    check_sizes(config, world, type(model).__name__, dense_mlp=not all(moe))
    plans = _check_layers(layers, group, getattr(config, "hidden_size", None))
    for layer, planned in zip(layers, plans):
        parallelize_layer(layer, group, sequence_parallel, moe=planned)
    if sequence_parallel:
        sp = _SequenceParallel(group, world)
        layers[0].register_forward_pre_hook(sp.enter, with_kwargs=True)
        layers[-1].register_forward_hook(sp.leave, with_kwargs=True)
    tensor = [moe_tp.is_tensor_parallel(getattr(layer, mlp_name(layer))) for layer, m in zip(layers, moe) if m]
    if sequence_parallel and any(moe) or any(tensor):
        text_model(model).register_forward_hook(_RouterLogits(group, world, sequence_parallel, tensor))


def _check_layers(layers: nn.ModuleList, group: Any, hidden: int | None) -> list[Any]:
    """What `parallelize` refuses by content, checked on every layer before any layer changes (a refusal
    half-way would leave the user's model half converted): width q/k norms that are not RMSNorm
    (`ShardedRMSNorm.check`), MoE blocks it can split neither by experts nor by their width (`moe_plan`).
    Returns each layer's MoE plan (None for a dense MLP)."""
    plans = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        form = form_of(attn, ATTENTION_FORMS)
        for n in WIDTH_NORMS:
            if isinstance(getattr(attn, n, None), nn.Module) and _width_norm(attn, form, f"{n}.weight"):
                ShardedRMSNorm.check(getattr(attn, n))
        name = mlp_name(layer)
        mlp = getattr(layer, name)
        plans.append(moe_plan(mlp, group, hidden, f"layers.{i}.{name}") if is_moe_block(mlp) else None)
    return plans


def moe_plan(block: nn.Module, group: Any, hidden: int | None = None, where: str = "mlp") -> Any:
    """How an MoE block is split: "expert" (`ExpertParallelMoE`: top-k routed SwiGLU experts, as many as
    divide by the group size) or, where that cannot read it, a `moe_tp.Plan` (tensor-parallel experts run by
    the block's own forward: GPT-OSS's). ValueError giving both reasons where neither fits."""
    world = dist.get_world_size(group)
    try:
        experts = ExpertParallelMoE.read(block)[0].shape[0]
        if experts % world == 0:
            return "expert"
        why = f"{experts} experts are not divisible by the group size {world}"
    except ValueError as exc:
        why = str(exc)
    try:
        return moe_tp.plan(block, group, hidden)
    except ValueError as exc:
        raise ValueError(f"{where}: autofuse splits this MoE block neither by experts ({why}) nor by each expert's "
                         f"width ({exc})") from None


def parallelize_layer(layer: nn.Module, group: Any, sequence_parallel: bool, moe: Any = None) -> nn.Module:
    """One decoder layer made tensor-parallel in place (the caller checks that heads divide). With
    sequence_parallel its input and output are this rank's row block (B, S'/W, H) (module doc): the
    caller scatters and gathers the rows (`parallelize` hooks the first and last layer for that). `moe`:
    the MoE block's `moe_plan`, made earlier (else made here)."""
    world = dist.get_world_size(group)
    slot = mlp_name(layer)
    if moe is None and is_moe_block(getattr(layer, slot)):
        moe = moe_plan(getattr(layer, slot), group)
    attn = layer.self_attn
    if is_latent_attention(attn):
        _split_latent_attention(attn, group, sequence_parallel)
        if sequence_parallel:
            _SequenceParallel(group, world).layer(layer, None, {}, moe)
            return layer
        attn.register_forward_pre_hook(_SumInputGrad(group), with_kwargs=True)
        _mlp(layer, slot, group, world, moe)
        return layer
    attention = form_of(attn, ATTENTION_FORMS)
    kv = kv_shards(attn, world)
    shapes = {name: _columns(attn, name, world, kv) for name in attention.columns}
    widths = [n for n in WIDTH_NORMS if isinstance(getattr(attn, n, None), nn.Module)
              and _width_norm(attn, attention, f"{n}.weight")]
    norms = {n: ShardedRMSNorm.from_norm(getattr(attn, n), group, shards=shapes[WIDTH_NORMS[n]].get("shards", world))
             for n in widths}  # made (and checked) before anything of the layer changes
    for n, norm in norms.items():
        setattr(attn, n, norm)
    split = _split_head_vectors(attn, group)
    _local_head_counts(attn, world, kv)
    GradSum(group).register(attn, [n for n, _ in attn.named_parameters()
                                   if n.split(".")[0] not in (*attention.names, *widths) and n not in split])
    if sequence_parallel:
        _SequenceParallel(group, world).layer(layer, attention, shapes, moe)
        return layer
    _split(attn, attention, shapes, group, False)
    _mlp(layer, slot, group, world, moe)
    return layer


def _mlp(layer: nn.Module, slot: str, group: Any, world: int, moe: Any) -> None:
    """A layer's MLP (or MoE block, `moe` its plan) made tensor-parallel in place, without sequence parallelism."""
    block = getattr(layer, slot)
    if moe is not None:
        setattr(layer, slot, _moe(block, group, False, moe))
        return
    mlp = form_of(block, MLP_FORMS)
    _split(block, mlp, {n: _columns(block, n, world, world) for n in mlp.columns}, group, False)
    _activation_grads(block, group)


class _SumInputGrad:
    """A forward pre-hook summing the gradient of a block's input over the group (the block's replicated
    projections feed this rank's heads only); a deep copy shares it."""

    def __init__(self, group: Any):
        self.group = group

    def __deepcopy__(self, memo: dict) -> "_SumInputGrad":
        return self

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, keyword = _hidden(args, kwargs)
        return _with_hidden(args, kwargs, tpf.all_reduce_grad(hidden, self.group), keyword)


def _split_head_vectors(attn: nn.Module, group: Any) -> list[str]:
    """Swap each per-head vector of `attn` (GPT-OSS's `sinks`) for this rank's query heads' values (a copy),
    recorded in `attn.autofuse_shards` for full_state_dict; their names."""
    names = [n for n, _ in attn.named_parameters() if "." not in n and _head_vector(attn, n)]
    if not names:
        return []
    Shards(group, {n: Split(0, (heads(attn)[0],)) for n in names}).cut(attn)
    return names


def _moe(block: nn.Module, group: Any, sequence_parallel: bool, planned: Any) -> nn.Module:
    """The MoE block made as `moe_plan` decided: expert-parallel, or tensor-parallel experts."""
    if planned == "expert":
        return ExpertParallelMoE.from_module(block, group, sequence_parallel=sequence_parallel)
    return moe_tp.from_module(block, group, sequence_parallel, planned=planned)


def _activation_grads(mlp: nn.Module, group: Any) -> None:
    """A learnable activation's parameters (Apertus's xIELU: scalars applied to every element) are
    replicated; each rank's gradient comes from its own columns of the MLP: summed over the group."""
    GradSum(group).register(mlp, [n for n, _ in mlp.named_parameters() if n.startswith("act_fn.")])


def _split(block: nn.Module, form: Block, shapes: dict, group: Any, sequence_parallel: bool) -> None:
    """Swap a block's projections for their shards in place: columns (`shapes`: their parts and shards)
    column-parallel, the row projection row-parallel."""
    for name in form.columns:
        setattr(block, name, ColumnParallelLinear.from_linear(getattr(block, name), group, sequence_parallel,
                                                              **shapes[name]))
    setattr(block, form.row, RowParallelLinear.from_linear(getattr(block, form.row), group, sequence_parallel))


def _seq_len(kwargs: dict) -> int:
    """The sequence length S of this forward, from the layer's rotary embeddings or positions."""
    pe = kwargs.get("position_embeddings")
    if pe is not None:
        return pe[0].shape[-2]
    return kwargs["position_ids"].shape[-1]


def _hidden(args: tuple, kwargs: dict) -> tuple[torch.Tensor, bool]:
    """(hidden_states, whether it came as a keyword)."""
    return (kwargs["hidden_states"], True) if "hidden_states" in kwargs else (args[0], False)


def _with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor, keyword: bool) -> tuple[tuple, dict]:
    if keyword:
        return args, {**kwargs, "hidden_states": hidden}
    return (hidden, *args[1:]), kwargs


class _RouterLogits:
    """The base model's recorded router logits (output_router_logits: one tensor per MoE layer) made the
    unsharded model's, for transformers' load-balancing loss: under sequence parallelism an expert-parallel
    layer's are this rank's row block (B S'/W, E), gathered (one all-gather for every such layer), and the
    padding rows dropped. A tensor-parallel experts layer's are whole on every rank (its router saw every
    row) and its router's gradient is summed over the group: their gradient keeps this rank's share of the
    rows (`functional.keep_share`), so the sum is the loss's gradient once. `tensor`: per MoE layer, whether
    it is tensor-parallel experts."""

    def __init__(self, group: Any, world: int, sequence_parallel: bool, tensor: list[bool]):
        self.group, self.world, self.sequence_parallel, self.tensor = group, world, sequence_parallel, tensor

    def __deepcopy__(self, memo: dict) -> "_RouterLogits":
        return self

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        logits = getattr(output, "router_logits", None)
        hidden = getattr(output, "last_hidden_state", None)
        if not logits or hidden is None or len(logits) != len(self.tensor):
            return output
        b, s = hidden.shape[:2]
        rows = list(logits)
        blocks = [i for i, tp in enumerate(self.tensor) if self.sequence_parallel and not tp]
        if blocks:
            whole = tpf.gather_rows(torch.cat([rows[i] for i in blocks], -1), self.group)
            for i, t in zip(blocks, whole.split([rows[i].shape[-1] for i in blocks], -1)):
                rows[i] = t
        rows = [tpf.keep_share(t, self.group) if tp else t for t, tp in zip(rows, self.tensor)]
        if self.sequence_parallel:
            sp = -(-s // self.world) * self.world
            rows = [t.reshape(b, sp, -1)[:, :s].reshape(b * s, -1) for t in rows]
        output.router_logits = tuple(rows)
        return output


class _SequenceParallel(GradSum):
    """The hooks that keep the token rows split between a layer's projections (module doc)."""

    def __init__(self, group: Any, world: int):
        super().__init__(group)
        self.world = world

    def padded(self, s: int) -> int:
        return -(-s // self.world) * self.world

    def layer(self, layer: nn.Module, attention: Block | None, shapes: dict, moe: Any = None) -> None:
        """Swap one decoder layer's projections (`shapes`: the attention's column parts and shards) and
        hook its blocks; sum its norms' gradients. Attention: its column projections one layer (one
        all-gather of the rows), fed to the attention as its input (B, S, ...) by a pre-hook. MLP: gated
        with separate gate/up, the same; a single column projection (fused gate_up, ungated) runs on the
        rows as they are, its output (W B, S'/W, ...) every rank's rows, which the row projection
        (gemm_rs) hands back as this rank's block; an MoE block (`moe`: its plan): ExpertParallelMoE on the
        row block, or tensor-parallel experts that gather every rank's rows. `attention` None: a latent
        attention, split already (`_split_latent_attention`), given every rank's rows gathered."""
        slot = mlp_name(layer)
        attn, mlp, g = layer.self_attn, getattr(layer, slot), self.group
        if attention is None:
            attn.register_forward_pre_hook(self.latent_in, with_kwargs=True)
        elif len(attention.columns) > 1:
            fuse_columns(attn, attention.columns, "qkv_proj", g, sequence_parallel=True,
                         shards=tuple(shapes[n].get("shards", self.world) for n in attention.columns))
        else:  # one fused projection the attention calls itself: the layer beside it, the projection its output
            name = attention.columns[0]
            made = ColumnParallelLinear.from_linear(getattr(attn, name), g, True, **shapes[name])
            made.part_names = (name,)
            setattr(attn, f"{name}_parallel", made)
            setattr(attn, name, FusedPart(0, made.weight.shape[0]))
        if attention is not None:
            setattr(attn, attention.row, RowParallelLinear.from_linear(getattr(attn, attention.row), g, sequence_parallel=True))
            attn.register_forward_pre_hook(self.attention_in, with_kwargs=True)
        attn.register_forward_hook(self.attention_out, with_kwargs=True)
        getattr(attn, "o_proj" if attention is None else attention.row).register_forward_pre_hook(self.rows_in)
        form = None if moe is not None else form_of(mlp, MLP_FORMS)
        if form is None:
            setattr(layer, slot, _moe(mlp, g, True, moe))  # takes (B, S'/W, H) rows
        elif len(form.columns) > 1:
            fuse_columns(mlp, form.columns, "gate_up_proj", g, sequence_parallel=True)
            setattr(mlp, form.row, RowParallelLinear.from_linear(getattr(mlp, form.row), g, sequence_parallel=True))
            fuse_gated_mlp(mlp)  # a SiLU-gated MLP: one SwiGLU kernel each way, eagerly
            mlp.register_forward_pre_hook(self.mlp_in)
            mlp.register_forward_hook(self.mlp_out)
            getattr(mlp, form.row).register_forward_pre_hook(self.rows_in)
        else:
            _split(mlp, form, {n: _columns(mlp, n, self.world, self.world) for n in form.columns}, g, True)
        if form is not None:
            _activation_grads(mlp, g)
        self.register(layer, [name for name, _ in layer.named_parameters()
                              if not name.startswith(("self_attn.", f"{slot}."))])

    # The first layer's input (B, S, H), whole -> this rank's rows (B, S'/W, H); the last layer's back.
    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, keyword = _hidden(args, kwargs)
        b, s, h = hidden.shape
        sp = self.padded(s)
        if sp != s:
            hidden = F.pad(hidden, (0, 0, 0, sp - s))
        rows = tpf.scatter_rows(hidden.reshape(b * sp, h), self.group)
        return _with_hidden(args, kwargs, rows.view(b, sp // self.world, h), keyword)

    def leave(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        rows = first(output)
        b, t, h = rows.shape
        whole = tpf.gather_rows(rows.reshape(b * t, h), self.group).view(b, t * self.world, h)
        return with_first(output, whole[:, :_seq_len(kwargs)])

    # Attention: rows -> q/k/v of every token (B, S, ...) for transformers' code; o_proj -> rows again.
    def attention_in(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, keyword = _hidden(args, kwargs)
        b, t, h = hidden.shape
        fused = module._modules.get("qkv_proj_parallel") or module.qkv_proj  # Phi-3's own, or q/k/v fused
        qkv = fused(hidden.reshape(b * t, h)).view(b, t * self.world, -1)[:, :_seq_len(kwargs)]
        feed_parts(module, fused.part_names, qkv)
        return _with_hidden(args, kwargs, qkv, keyword)

    def latent_in(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A latent attention's input: every rank's rows gathered (B, S, H), the gradient reduce-scattered (its
        replicated low-rank projections feed this rank's heads only)."""
        hidden, keyword = _hidden(args, kwargs)
        b, t, h = hidden.shape
        rows = tpf.gather_rows(hidden.reshape(b * t, h), self.group, summed=True).view(b, t * self.world, h)
        return _with_hidden(args, kwargs, rows[:, :_seq_len(kwargs)], keyword)

    def rows_in(self, module: nn.Module, args: tuple) -> tuple:
        """o_proj / down_proj: (B, S, in/W) -> padded, flattened rows (B S', in/W) for gemm_rs."""
        x = args[0]
        b, s, k = x.shape
        sp = self.padded(s)
        if sp != s:
            x = F.pad(x, (0, 0, 0, sp - s))
        return (x.reshape(b * sp, k), *args[1:])

    def attention_out(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        b, s = _hidden(args, kwargs)[0].shape[:2]
        return with_first(output, first(output).view(b, self.padded(s) // self.world, -1))

    # MLP: rows -> gate/up of every token (B, S', ...); down_proj -> rows (B, S'/W, H).
    def mlp_in(self, module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        b, t, h = x.shape
        gate_up = module.gate_up_proj(x.reshape(b * t, h)).view(b, t * self.world, -1)
        if not isinstance(vars(module).get("forward"), FusedForward):  # one SwiGLU reads the whole output
            feed_parts(module, module.gate_up_proj.part_names, gate_up)
        return (gate_up, *args[1:])

    def mlp_out(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        b, sp = args[0].shape[:2]
        return output.view(b, sp // self.world, -1)

