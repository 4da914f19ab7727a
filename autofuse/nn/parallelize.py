"""`parallelize`: a model's linears swapped for tensor-parallel ones, by a plan or, for Hugging Face
Llama-family models, by itself.

A plan maps module paths to styles: {"layers.*.self_attn.q_proj": "column", "layers.*.self_attn.o_proj":
"row", ...}; `*` stands for one path component (as in transformers' and torch's plans). "column"
becomes ColumnParallelLinear.from_linear, "row" RowParallelLinear.from_linear, both with the
call's `sequence_parallel`. A plan only swaps modules: with sequence_parallel=True the code around
them must hand each column-parallel layer this rank's rows (`autofuse.nn.functional.scatter_rows`)
and gather the rows where the region ends (`gather_rows`); replicated parameters used inside the
region (norms) need their gradients summed over the group (`all_reduce_grad`). For Llama-family
models `parallelize` does all of that itself (autofuse/nn/llama.py).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from autofuse.nn.functional import process_group
from autofuse.nn.plan import apply_plan


def parallelize(model: nn.Module, group: Any = None, plan: dict[str, str] | None = None,
                sequence_parallel: bool = False) -> nn.Module:
    """Make `model` tensor-parallel over `group` (None: the default group; a ProcessGroup or 1-D
    DeviceMesh), in place, and return it. Every rank of the group calls it with the same model (same
    weights: seed alike or load the same checkpoint); each keeps its shards.

    plan=None: a Hugging Face Llama-family model (Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3, GLM-4, OLMo2,
    StarCoder2, ...: the projection sets llama.ATTENTION_FORMS / MLP_FORMS name, per-head or width q/k
    norms, fewer KV heads than ranks replicated; Mixtral, Qwen2-MoE and Qwen3-MoE: MoE blocks made
    expert-parallel over the same group, in either form), parallelized as autofuse/nn/llama.py describes. Otherwise a plan (module doc; applied by
    autofuse/nn/plan.py).
    """
    group = process_group(group)
    if plan is None:
        from autofuse.nn import llama

        llama.parallelize(model, group, sequence_parallel)
    else:
        apply_plan(model, plan, group, sequence_parallel)
    return model
