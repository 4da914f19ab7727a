"""torch's ParallelStyle form of autofuse's linears, for `torch.distributed.tensor.parallel.parallelize_module`.

    from torch.distributed.tensor.parallel import parallelize_module
    from autofuse.nn import ColwiseParallel, RowwiseParallel
    parallelize_module(block, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})

Each style turns the nn.Linear it is applied to into ColumnParallelLinear / RowParallelLinear in
place (the same object, its class and parameters changed: parallelize_module keeps the modules it
visits), over the 1-D mesh's process group. The tensors stay plain tensors (no DTensor): inputs and
outputs are this rank's shards as autofuse/nn/functional.py describes, so a plan of autofuse styles
replaces torch's ColwiseParallel/RowwiseParallel with their default layouts (replicated input,
replicated output); sequence_parallel=True is torch's input_layouts / output_layouts Shard(0).
"""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from autofuse.nn.linear import ColumnParallelLinear, RowParallelLinear, _ParallelLinear


def convert(module: nn.Module, cls: type[_ParallelLinear], group: Any, sequence_parallel: bool) -> nn.Module:
    """Turn the nn.Linear `module` into `cls` in place (its own shard; hooks and name kept)."""
    if isinstance(module, _ParallelLinear):
        raise ValueError(f"{module!r} is already tensor-parallel")
    made = cls.from_linear(module, group, sequence_parallel)
    for name in ("weight", "bias"):
        module._parameters[name] = made._parameters[name]
    for name, value in made.__dict__.items():  # the layer's own attributes, not nn.Module's state
        if not name.startswith("_") and name != "training":
            module.__dict__[name] = value
    module.__class__ = cls
    return module


class _Style(ParallelStyle):
    cls: type[_ParallelLinear]

    def __init__(self, *, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return convert(module, self.cls, device_mesh, self.sequence_parallel)

    def __repr__(self) -> str:
        return f"autofuse.nn.{type(self).__name__}(sequence_parallel={self.sequence_parallel})"


class ColwiseParallel(_Style):
    """An nn.Linear becomes a ColumnParallelLinear over the mesh's group (autofuse's ops)."""

    cls = ColumnParallelLinear


class RowwiseParallel(_Style):
    """An nn.Linear becomes a RowParallelLinear over the mesh's group (autofuse's ops)."""

    cls = RowParallelLinear
