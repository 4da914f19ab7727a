"""The whole model's state_dict from a tensor-parallel one: for saving a checkpoint every loader reads.

A parallelized model's own state_dict holds this rank's shards (and, under Llama sequence
parallelism, fused `qkv_proj` / `gate_up_proj` layers). `full_state_dict` gathers every
tensor-parallel layer and splits fused ones back into the layers they were made from, so the result
has the unsharded model's keys and shapes (expert-parallel MoE blocks' experts gathered and given back
in the layout their transformers block had; sharded norms' weights and the tensors of modules split in place,
`autofuse_shards` (tensor-parallel experts, attention sinks), gathered), e.g. for `save_pretrained(dir, state_dict=...)`;
`full_grads` does the same for the parameters' gradients.
"""
from __future__ import annotations

import torch
from torch import nn

from autofuse.nn.linear import _ParallelLinear
from autofuse.nn.moe import ExpertParallelMoE
from autofuse.nn.norm import ShardedRMSNorm
from autofuse.nn.shards import Shards


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model's state_dict, on every rank (collective: every rank of each layer's group
    calls it, in the same order). Tensor-parallel weights and split biases are gathered, fused layers
    split into their parts' keys; every other entry is the model's own tensor."""
    return _unsharded(model, model.state_dict())


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model's parameter gradients under its state_dict keys, as `full_state_dict` gives
    the weights (collective likewise); parameters without a gradient are left out. For checking a
    parallel model's backward against the unsharded model's."""
    return _unsharded(model, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})


def _unsharded(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (keyed like the model's state_dict, shaped like its entries) gathered and split back
    into the unsharded model's keys."""
    layers = {path: m for path, m in model.named_modules() if isinstance(m, _ParallelLinear)}
    experts = {path: m for path, m in model.named_modules() if isinstance(m, ExpertParallelMoE)}
    norms = {path: m for path, m in model.named_modules() if isinstance(m, ShardedRMSNorm)}
    out: dict[str, torch.Tensor] = {}
    split = _split_in_place(model, tensors)
    for key, t in [*tensors.items(), *((k, None) for k in split if k not in tensors)]:
        if key in split:
            if split[key] is not None:
                out[key] = split[key]
            continue
        path, _, name = key.rpartition(".")
        block = experts.get(path)
        if block is not None and name in ("w1", "w2"):  # expert-parallel experts: gathered, in their source layout
            out.update({f"{path}.{k}" if path else k: v for k, v in block.unshard(name, t).items()})
            continue
        if path in norms:  # a norm over a projection's width: its weight's shards gathered
            out[key] = norms[path].gather(t)
            continue
        layer = layers.get(path)
        if layer is None:
            out[key] = t
            continue
        whole = layer.gather(t, bias=name == "bias")
        if not layer.part_names:
            out[key] = whole
            continue
        parent = path.rpartition(".")[0]
        if len(layer.part_names) == 1:  # one name: the whole layer under it (a fused projection's own)
            out[f"{parent}.{layer.part_names[0]}.{name}" if parent else f"{layer.part_names[0]}.{name}"] = whole
            continue
        for part, piece in zip(layer.part_names, whole.split(list(layer.parts), 0)):
            out[f"{parent}.{part}.{name}" if parent else f"{part}.{name}"] = piece.clone()
    return out


def _split_in_place(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The whole tensors of modules split in place (`autofuse_shards`), keyed like `tensors`: every rank
    gathers every such tensor the module holds, in the module's order, whether or not it is in `tensors`
    on this rank (a first-rank bias has no gradient elsewhere); None where the whole has none."""
    out: dict[str, torch.Tensor | None] = {}
    for path, m in model.named_modules():
        shards = getattr(m, "autofuse_shards", None)
        if not isinstance(shards, Shards):
            continue
        own = {**dict(m.named_parameters()), **dict(m.named_buffers())}
        for name in sorted(shards.specs):
            key = f"{path}.{name}" if path else name
            out[key] = shards.gather(name, tensors.get(key), own[name])
    return out
