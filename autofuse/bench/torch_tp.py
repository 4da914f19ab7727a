"""torch's own tensor parallelism for transformers' Llama, as torchtitan lays it out: the baseline the
training benchmarks (`bench_train_layer`, `bench_train_model`) race autofuse against.

`parallelize_layer`: DTensor TP with sequence parallelism on one LlamaDecoderLayer (SequenceParallel
norms, PrepareModuleInput all-gathers, ColwiseParallel q/k/v/gate/up, RowwiseParallel o/down
reduce-scattering to Shard(1)); its input and output are this rank's Shard(1) block of the tokens. As in
torchtitan, the all-gathered input reaches the column-parallel linears as a DTensor (PrepareModuleInput's
`use_local_output=False`): its gradient is then a reduce-scatter, which inductor's micro-pipeline pass
fuses with the matmul; a local tensor there makes the backward an all-reduce (twice the traffic) that
async TP cannot fuse (`scripts/async_tp_patterns.py` counts what the pass finds).
`enable_async_tp`: torch's async TP as torchtitan turns it on (inductor's micro-pipeline TP pass and
symmetric memory for the group); it acts on what is compiled afterwards. `async_tp_unavailable` says
why it cannot run here (it needs CUDA symmetric memory).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from autofuse.comm.world import World


def mesh(world: World) -> Any:
    """The 1-D DeviceMesh of `world`'s group."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(world.group if world.group is not None else torch.distributed.group.WORLD,
                                 world.device.type)


def parallelize_layer(layer: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """torch's DTensor tensor parallelism with sequence parallelism on a LlamaDecoderLayer (torchtitan's plan)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
    plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(**gather),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    return parallelize_module(layer, mesh, plan)


def async_tp_unavailable(world: World) -> str | None:
    """Why torch's async TP cannot run here (None where it can): it needs torch's symmetric memory."""
    from autofuse.comm.heap import torch_symm_unavailable

    return torch_symm_unavailable(world, "fused_all_gather_matmul")


def enable_async_tp(world: World) -> None:
    """Turn on torch's async TP for what is compiled next: inductor's micro-pipeline TP pass, which
    fuses the all-gathers and reduce-scatters with the matmuls, and symmetric memory for the group."""
    import torch._inductor.config as inductor
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor._micro_pipeline_tp = True
    group = world.group if world.group is not None else torch.distributed.group.WORLD
    enable_symm_mem_for_group(group.group_name)
