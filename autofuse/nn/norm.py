"""ShardedRMSNorm: an RMSNorm over the whole width of a column-parallel projection's output, from its shards.

OLMo2's q_norm and k_norm normalise q_proj's and k_proj's whole output (every head's width at once),
so a rank holding its heads' columns sees only part of each row's mean square: the sums of squares
are added over the group (one all-reduce of a (..., 1) tensor per call, differentiable: its gradient
is summed over the group too), then each rank scales its own columns by its shard of the weight.
Where the projection's shards are replicated (fewer KV heads than ranks, autofuse/nn/linear.py),
every distinct shard is held by `world / shards` ranks, so the sum is divided by that, and the
weight's gradient summed over the replicas, as the projection's.

The arithmetic is RMSNorm's: float32 x * rsqrt(mean(x²) + eps), times the weight, cast back to the
input's dtype. `from_norm` checks that the norm it replaces computes that (on a random input), and
refuses one that does not (a LayerNorm, Gemma's 1 + weight).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autofuse.nn import functional as tpf


class ShardedRMSNorm(nn.Module):
    """This rank's shard of an RMSNorm of `width` features whose input is split like a column-parallel
    projection's output part of `shards` shards (default: the group size)."""

    def __init__(self, width: int, eps: float, group: Any = None, shards: int | None = None,
                 device: Any = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.group = tpf.process_group(group)
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.width, self.eps = width, eps
        self.shards = shards or self.world
        if self.world % self.shards or width % self.shards:
            raise ValueError(f"ShardedRMSNorm: width {width} in {self.shards} shards over {self.world} ranks: the shards "
                             "must divide the width and the group size")
        self.weight = nn.Parameter(torch.ones(width // self.shards, device=device, dtype=dtype))

    @property
    def replicas(self) -> int:
        """How many ranks hold each shard."""
        return self.world // self.shards

    def __deepcopy__(self, memo: dict) -> "ShardedRMSNorm":
        return tpf.deepcopy_sharing_group(self, memo)

    @classmethod
    def from_norm(cls, norm: nn.Module, group: Any = None, shards: int | None = None) -> "ShardedRMSNorm":
        """This rank's shard of `norm` (a weight-only RMSNorm: its weight copied, its eps read from
        `variance_epsilon` or `eps`); ValueError if `norm` computes something else."""
        weight, eps = cls.check(norm)
        m = cls(weight.shape[0], eps, group, shards, device="meta", dtype=weight.dtype)
        step = m.width // m.shards
        start = m.rank * m.shards // m.world * step
        m.weight = tpf.copied_parameter(weight[start:start + step], weight.requires_grad)
        return m

    @staticmethod
    def check(norm: nn.Module) -> tuple[torch.Tensor, float]:
        """`norm`'s (weight, eps) if it is a weight-only RMSNorm (eps read from `variance_epsilon` or `eps`;
        run on a random input to see it computes RMSNorm); ValueError otherwise. Changes nothing."""
        weight = getattr(norm, "weight", None)
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        params = [n for n, _ in norm.named_parameters()]
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or params != ["weight"] or not isinstance(eps, float):
            raise ValueError(f"{type(norm).__name__} is not an RMSNorm of one weight and an eps; autofuse splits only those "
                             "over a projection's width")
        if not _computes_rms_norm(norm, weight, eps):
            raise ValueError(f"{type(norm).__name__} does not compute x * rsqrt(mean(x²) + eps) * weight; autofuse does "
                             "not know how to split it over a projection's width")
        return weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        squares = tpf.sum_over_group(h.pow(2).sum(-1, keepdim=True), self.group)
        h = h * torch.rsqrt(squares / (self.replicas * self.width) + self.eps)
        weight = self.weight
        if self.replicas > 1:
            weight = tpf.sum_replicas(weight, ((0, weight.shape[0], self.shards),), self.group)
        return (weight * h).to(dtype)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The whole weight-shaped tensor (the weight, its gradient) from every rank's shard; on every
        rank (collective)."""
        t = t.detach().contiguous()
        shards = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(shards, t, group=self.group)
        return torch.cat([shards[j * self.replicas] for j in range(self.shards)])

    def extra_repr(self) -> str:
        return (f"width={self.width}, eps={self.eps}, rank={self.rank}/{self.world}, shards={self.shards}, "
                f"shard={tuple(self.weight.shape)}")


def _computes_rms_norm(norm: nn.Module, weight: torch.Tensor, eps: float) -> bool:
    """Whether `norm`, on a random input in its weight's dtype, gives RMSNorm's result with its weight and
    eps (within that dtype's rounding). A weight on the meta device cannot be run: then the class's name
    must say RMSNorm."""
    if weight.is_meta:
        return type(norm).__name__.endswith("RMSNorm")
    x = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    w = weight.detach().to("cpu", torch.float64)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    with torch.no_grad():
        got = norm(x.to(weight.device, weight.dtype)).to("cpu", torch.float64)
    tol = 1e-4 if weight.dtype in (torch.float32, torch.float64) else 3e-2
    return got.shape == want.shape and bool(torch.allclose(got, want, rtol=tol, atol=tol * float(w.abs().max()) + 1e-6))
