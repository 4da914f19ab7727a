"""Tensors of a module split over a process group in place, outside autofuse's parallel layers: what each
rank keeps of them and how `autofuse.nn.full_state_dict` gives them back whole.

A module converted in place keeps its class and its state_dict keys (transformers' code reads its
tensors by name), each holding this rank's piece; its `autofuse_shards` attribute (a `Shards`) says,
per tensor name relative to the module, how the piece was cut:
- `Split(dim, parts)`: the tensor is `parts` side by side along `dim` (one part, or several, e.g. a
  fused [gate | up]); rank r keeps block r of each part, its blocks side by side again;
- `First()`: the tensor is added once to a sum over the group's ranks (the bias after a row-parallel
  product): the group's first rank keeps it, the others hold zeros (a buffer, no gradient).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Split:
    """`parts` (whole sizes along `dim`, side by side) each split in W equal blocks; rank r keeps block r of each."""

    dim: int
    parts: tuple[int, ...]

    def local(self, t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """Rank `rank`'s piece of the whole tensor `t` (a new tensor where there are several parts)."""
        pieces = [p.chunk(world, self.dim)[rank] for p in t.split(list(self.parts), self.dim)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, self.dim)

    def whole(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's piece, in rank order."""
        world = len(pieces)
        split = [p // world for p in self.parts]
        per_rank = [piece.split(split, self.dim) for piece in pieces]
        return torch.cat([per_rank[r][i] for i in range(len(self.parts)) for r in range(world)], self.dim)

    def fits(self, shape: torch.Size, world: int) -> bool:
        return (0 <= self.dim < len(shape) and sum(self.parts) == shape[self.dim]
                and all(p % world == 0 for p in self.parts))


@dataclass(frozen=True)
class First:
    """Added once to a sum over the ranks: the group's first rank keeps it, the others hold zeros."""

    def local(self, t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        return t if rank == 0 else torch.zeros_like(t)


class Shards:
    """How a module's tensors were cut over `group` (module doc): {name relative to the module: Split | First}.
    A deep copy of the module shares it (and the group, which cannot be copied)."""

    def __init__(self, group: Any, specs: dict[str, Split | First]):
        self.group, self.specs = group if group is not None else dist.group.WORLD, dict(specs)
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def __deepcopy__(self, memo: dict) -> "Shards":
        return self

    def cut(self, module: nn.Module) -> None:
        """Swap `module`'s parameters named in `specs` (Split only) for this rank's pieces, copies (never views of
        the whole), a split nn.Linear's features its piece's; record this object as `module.autofuse_shards`."""
        for name, spec in self.specs.items():
            path, _, attr = name.rpartition(".")
            owner = module.get_submodule(path)
            whole = getattr(owner, attr)
            piece = spec.local(whole.detach(), self.rank, self.world).clone(memory_format=torch.contiguous_format)
            setattr(owner, attr, nn.Parameter(piece, requires_grad=whole.requires_grad))
            if isinstance(owner, nn.Linear):
                owner.out_features, owner.in_features = owner.weight.shape
        module.autofuse_shards = self

    def gather(self, name: str, t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
        """The whole tensor `name` from every rank's piece `t` (collective over the group: every rank calls
        it for the same names in the same order; `like` is the module's own tensor of that name, for the
        shape and device). `First`: the first rank's `t`, or None where it gave None (a gradient it does not
        have); the other ranks' `t` is not read."""
        spec = self.specs[name]
        if isinstance(spec, First):
            src = dist.get_global_rank(self.group, 0)
            have = torch.tensor([t is not None], dtype=torch.int64, device=like.device)
            dist.broadcast(have, src, group=self.group)
            if not int(have.item()):
                return None
            out = t.detach().clone() if self.rank == 0 else torch.empty_like(like)
            dist.broadcast(out, src, group=self.group)
            return out
        if t is None:  # a piece on every rank or on none (a parameter without a gradient)
            return None
        t = t.detach().contiguous()
        pieces = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(pieces, t, group=self.group)
        return spec.whole(pieces)

    def __repr__(self) -> str:
        return f"Shards(rank={self.rank}/{self.world}, {self.specs})"
