"""Tensor-parallel modules on autofuse's ops, and `parallelize` for whole models.

- `ColumnParallelLinear`, `RowParallelLinear` (autofuse/nn/linear.py): nn.Linear split over a process
  group, with or without sequence parallelism; `from_linear(linear, group)` shards an existing layer.
- `ExpertParallelMoE` (autofuse/nn/moe.py): a sparse MoE block (router, SwiGLU experts, optional shared
  expert) with its experts split over a process group, on `moe_dispatch` / `moe_combine`;
  `from_module(block, group)` converts a transformers MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE); `TopKRouter`.
- `autofuse.nn.moe_tp`: an MoE block ExpertParallelMoE cannot read (GPT-OSS's experts with biases and a
  clamped SwiGLU, Llama 4's with a shared expert) split by each expert's width and run by the block's own
  forward (`parallelize` uses it).
- `ShardedRMSNorm` (autofuse/nn/norm.py): an RMSNorm over a column-parallel projection's whole width
  (OLMo2's q_norm / k_norm), from its shards.
- `autofuse.nn.functional`: the same as functions, and the row scatter/gather of sequence parallelism.
- `parallelize(model, group, plan=None, sequence_parallel=False)` (autofuse/nn/parallelize.py): swaps a
  model's linears for the modules above, by a plan or, for Hugging Face Llama-family models (Qwen3,
  Phi-3, GLM-4, OLMo2 and more included, and the MoE models Mixtral, Qwen2-MoE and Qwen3-MoE, their MoE blocks made expert-parallel,
  GPT-OSS, Llama 4, HunYuan-MoE, GraniteMoE and DeepSeek-V2/V3 (latent attention), their experts tensor-parallel),
  by itself.
- `full_state_dict(model)` (autofuse/nn/checkpoint.py): the unsharded state_dict of a parallelized model;
  `full_grads(model)` its parameters' gradients likewise.
- `ColwiseParallel`, `RowwiseParallel` (autofuse/nn/styles.py): the same as torch ParallelStyles, for
  `torch.distributed.tensor.parallel.parallelize_module` (imported on first use: they load DTensor).
"""
from typing import Any

from autofuse.nn import functional
from autofuse.nn.checkpoint import full_grads, full_state_dict
from autofuse.nn.linear import ColumnParallelLinear, RowParallelLinear
from autofuse.nn.moe import ExpertParallelMoE, TopKRouter
from autofuse.nn.norm import ShardedRMSNorm
from autofuse.nn.parallelize import parallelize

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ShardedRMSNorm", "ExpertParallelMoE", "TopKRouter", "ColwiseParallel", "RowwiseParallel", "full_state_dict", "full_grads",
           "functional", "parallelize"]


def __getattr__(name: str) -> Any:
    if name in ("ColwiseParallel", "RowwiseParallel"):
        from autofuse.nn import styles

        return getattr(styles, name)
    raise AttributeError(f"module 'autofuse.nn' has no attribute {name!r}")
