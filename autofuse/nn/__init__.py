"""Tensor-parallel modules on autofuse's ops, and `parallelize` for whole models.

- `ColumnParallelLinear`, `RowParallelLinear` (autofuse/nn/linear.py): nn.Linear split over a process
  group, with or without sequence parallelism; `from_linear(linear, group)` shards an existing layer.
- `autofuse.nn.functional`: the same as functions, and the row scatter/gather of sequence parallelism.
- `parallelize(model, group, plan=None, sequence_parallel=False)` (autofuse/nn/parallelize.py): swaps a
  model's linears for the modules above, by a plan or, for Hugging Face Llama-family models, by itself.
"""
from autofuse.nn import functional
from autofuse.nn.linear import ColumnParallelLinear, RowParallelLinear
from autofuse.nn.parallelize import parallelize

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "functional", "parallelize"]
