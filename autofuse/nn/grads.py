"""Replicated parameters whose gradient is summed over a process group: parameters every rank holds whole
whose users see only this rank's part of the work (norms under sequence parallelism: this rank's rows;
per-head norms: this rank's heads; an MoE router beside tensor-parallel experts: this rank's part of
every expert), so every rank gets the unsharded model's gradient."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class GradSum:
    """Tensor hooks that sum replicated parameters' gradients over the group: for parameters that see
    only this rank's part of the work (norms under sequence parallelism: this rank's rows; per-head
    norms: this rank's heads), so every rank gets the unsharded model's gradient."""

    def __init__(self, group: Any):
        self.group = group

    def __deepcopy__(self, memo: dict) -> "GradSum":
        return self  # no state but the group, which a copied model shares

    def register(self, root: nn.Module, names: list[str]) -> None:
        """Sum the gradients of `root`'s parameters `names` (dotted) over the group: each becomes a
        `Summed` parameter (the same data) whose hook sums its gradient, in a deep copy too."""
        for name in names:
            path, _, attr = name.rpartition(".")
            owner = root.get_submodule(path)
            p = getattr(owner, attr)
            if p.requires_grad and not isinstance(p, Summed):
                setattr(owner, attr, Summed.of(p.data, self))

    def sum_grad(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=self.group)
        return grad


class Summed(nn.Parameter):
    """A replicated parameter whose gradient a tensor hook sums over the group (`GradSum`). Tensor hooks
    are not copied with a model (copy.deepcopy, torch.optim.swa_utils.AveragedModel): this parameter's
    deep copy registers the hook again, so a copy of a parallelized model trains like the original."""

    group_sum: GradSum

    @staticmethod
    def of(data: torch.Tensor, group_sum: GradSum) -> "Summed":
        p = Summed(data, requires_grad=True)
        p.group_sum = group_sum
        p.register_hook(group_sum.sum_grad)
        return p

    def __deepcopy__(self, memo: dict) -> "Summed":
        if id(self) not in memo:
            memo[id(self)] = Summed.of(self.data.clone(memory_format=torch.preserve_format), self.group_sum)
        return memo[id(self)]
