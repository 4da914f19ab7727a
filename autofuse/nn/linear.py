"""ColumnParallelLinear and RowParallelLinear: nn.Linear split over a process group, on autofuse's ops.

Each rank holds its shard of one logical nn.Linear(in_features, out_features) (see
autofuse/nn/functional.py for the forms and what each op computes). A module is made from an
existing nn.Linear by slicing its weight (`from_linear`), or fresh: `reset_parameters` draws the
whole weight as nn.Linear would and keeps this rank's shard, so ranks seeded alike hold the shards of
the nn.Linear a single process seeded the same way would make (row-parallel biases are replicated
and must agree on every rank: seed alike, or load them). `to_linear` gathers the whole layer back.

`weight` has nn.Linear's (out, in) orientation with this rank's shard shape; where an op reads it
(every form but the replicated-input column-parallel one) it is stored transposed, so `weight.t()`
is the op's contiguous operand. state_dict holds this rank's shard under nn.Linear's keys.

A column-parallel part may be split into fewer shards than ranks (`shards`, a divisor of the group size:
the KV projections of a model with fewer KV heads than ranks, as vLLM replicates them): rank r holds
shard r * shards // W, the same on W / shards consecutive ranks, and each replica's gradient is summed
over the ranks that hold it (each saw only its own query heads' work), so every replica stays equal.

`fuse_columns` makes several projections of one block that read the same input (q/k/v; gate/up) one
column-parallel layer, each projection becoming a `FusedPart` view of its columns, so the block's own
forward runs unchanged once a forward pre-hook hands it the fused layer's output (sequence parallelism:
one all-gather of the rows for all of them).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autofuse.nn import functional as tpf


def _world(group: Any) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _split(n: int, by: int, what: str, layer: str, into: str = "the group size") -> int:
    if n % by:
        raise ValueError(f"{layer}: {what}={n} is not divisible by {into} {by}")
    return n // by


class _ParallelLinear(nn.Module):
    """What both forms share: the group, the logical sizes, the shard, init and repr."""

    split_dim: int  # the dim of the (out, in) weight that is split: 0 column-parallel, 1 row-parallel
    bias_split: bool  # whether the bias is split with the weight (column) or replicated (row)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group: Any = None,
                 sequence_parallel: bool = False, device: Any = None, dtype: torch.dtype | None = None,
                 parts: tuple[int, ...] | None = None, shards: tuple[int, ...] | None = None):
        super().__init__()
        self.group = tpf.process_group(group)
        self.world, self.rank = _world(self.group)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = bool(sequence_parallel)
        self.parts = tuple(parts) if parts else (out_features,)
        self.shards = tuple(shards) if shards else (self.world,) * len(self.parts)
        self.replicated = any(s != self.world for s in self.shards)  # some part's shards held by several ranks
        # the layers a fused one was made from (`from_linears`), or one name: the fused projection it stands for
        self.part_names: tuple[str, ...] = ()
        name = type(self).__name__
        if sum(self.parts) != out_features or (len(self.parts) > 1 and self.split_dim != 0):
            raise ValueError(f"{name}: parts {self.parts} must add up to out_features={out_features} "
                             "(only a column-parallel layer has parts)")
        if len(self.shards) != len(self.parts) or (self.split_dim != 0 and self.shards != (self.world,)):
            raise ValueError(f"{name}: shards {self.shards} must give one count per part {self.parts} "
                             "(only a column-parallel layer replicates shards)")
        for n, s in zip(self.parts, self.shards):
            if s < 1 or self.world % s:
                raise ValueError(f"{name}: a part split into {s} shards over {self.world} ranks: the shards must "
                                 "divide the group size (each held by group size / shards ranks)")
            _split(n, s, "out_features" if len(self.parts) == 1 else "a part's out_features", name,
                   "the group size" if s == self.world else "its shard count")
        shape = [out_features, in_features]
        if self.split_dim == 0:
            shape[0] = sum(n // s for n, s in zip(self.parts, self.shards))
        else:
            shape[1] = _split(in_features, self.world, "in_features", name)
        empty = torch.empty(shape, device=device, dtype=dtype)
        self.weight = tpf.transposed_parameter(empty) if self.transposed else nn.Parameter(empty)
        if bias:
            n = shape[0] if self.bias_split else out_features
            self.bias = nn.Parameter(torch.empty(n, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    @property
    def transposed(self) -> bool:
        """Whether `weight` is stored (in, out) row-major (an op reads it)."""
        return True

    def __deepcopy__(self, memo: dict) -> "_ParallelLinear":
        """A copy sharing the process group (a group cannot be copied; the copy's shards are its own)."""
        return tpf.deepcopy_sharing_group(self, memo)

    def _layout(self, dim: int, size: int) -> list[tuple[int, int]]:
        """(whole size, shards) of each part along `dim` (a tensor `size` long there)."""
        if dim != 0:
            return [(size, self.world)]
        return list(zip(self.parts, self.shards))

    def _shard(self, t: torch.Tensor, dim: int, rank: int | None = None) -> torch.Tensor:
        """Rank `rank`'s (default: this rank's) shard of a whole tensor along `dim`: its block of each
        part (of a part with s shards, block rank * s // W)."""
        rank = self.rank if rank is None else rank
        blocks, start = [], 0
        for n, s in self._layout(dim, t.shape[dim]):
            step = n // s
            blocks.append(t.narrow(dim, start + rank * s // self.world * step, step))
            start += n
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim)

    def _unshard(self, shards: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The whole tensor from every rank's shard along `dim` (the inverse of `_shard`; a replicated
        shard is taken from the first rank holding it)."""
        layout = self._layout(dim, shards[0].shape[dim] * self.world)
        if len(layout) == 1 and layout[0][1] == self.world:
            return torch.cat(shards, dim)
        steps = [n // s for n, s in layout]
        split = [t.split(steps, dim) for t in shards]
        return torch.cat([split[j * self.world // s][p] for p, (_, s) in enumerate(layout) for j in range(s)], dim)

    def replica_rows(self) -> tuple[tuple[int, int, int], ...]:
        """(start, stop, shards) of this rank's rows of each part whose shards are replicated (the rows
        whose gradient `functional.sum_replicas` sums over the ranks holding the same shard)."""
        out, start = [], 0
        for n, s in zip(self.parts, self.shards):
            if s != self.world:
                out.append((start, start + n // s, s))
            start += n // s
        return tuple(out)

    def shard_of(self, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's shard of a whole (out, in) weight and (out,) bias."""
        w = self._shard(weight, self.split_dim)
        if bias is not None and self.bias_split:
            bias = self._shard(bias, 0)
        return w, bias

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation of the whole layer (same RNG draws), keeping this rank's shard."""
        if self.weight.is_meta:
            return
        full = torch.empty(self.out_features, self.in_features, device=self.weight.device, dtype=self.weight.dtype)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        full_bias = None
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            full_bias = torch.empty(self.out_features, device=full.device, dtype=full.dtype).uniform_(-bound, bound)
        self._load_whole(full, full_bias)

    def _load_whole(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        w, b = self.shard_of(weight, bias)
        with torch.no_grad():
            self.weight.copy_(w)
            if self.bias is not None:
                self.bias.copy_(b)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any = None, sequence_parallel: bool = False,
                    shards: int | tuple[int, ...] | None = None, parts: tuple[int, ...] | None = None) -> "_ParallelLinear":
        """This rank's shard of `linear` (copied; `linear` is left as it was), same dtype and device.
        Column-parallel only: `parts`, the output features of the projections a fused `linear` holds side by
        side (q, k, v of a qkv_proj), rank r keeping its block of each; `shards`, how many shards each part
        (or the whole) is split into, a divisor of the group size (module doc)."""
        if isinstance(shards, int):
            shards = (shards,)
        return cls.from_linears([linear], group, sequence_parallel, shards=shards, parts=parts)

    @classmethod
    def from_linears(cls, linears: list[nn.Linear], group: Any = None, sequence_parallel: bool = False,
                     names: tuple[str, ...] = (), shards: tuple[int, ...] | None = None,
                     parts: tuple[int, ...] | None = None) -> "_ParallelLinear":
        """One layer from several that read the same input, their outputs side by side (q, k and v;
        gate and up): this rank holds its block of each, so one call gathers the input once.
        `names`: the layers' module names, under which `full_state_dict` gives them back; `shards`: each
        layer's shard count (default: the group size; module doc). The shards are copied: the layers
        are left as they were, and never share storage with the new one."""
        for lin in linears:
            if not isinstance(lin, nn.Linear):
                raise TypeError(f"{cls.__name__}.from_linear takes nn.Linear layers, got {type(lin).__name__}")
        first = linears[0]
        if any(lin.in_features != first.in_features or (lin.bias is None) != (first.bias is None) or
               lin.weight.dtype != first.weight.dtype for lin in linears):
            raise ValueError(f"{cls.__name__}.from_linears: the layers differ in in_features, bias or dtype")
        if parts is not None and len(linears) > 1:
            raise ValueError(f"{cls.__name__}.from_linears: parts are the layers' out_features; give parts only "
                             "for one fused layer")
        parts = tuple(parts) if parts else tuple(lin.out_features for lin in linears)
        m = cls(first.in_features, sum(parts), bias=first.bias is not None, group=group,
                sequence_parallel=sequence_parallel, device="meta", dtype=first.weight.dtype, parts=parts, shards=shards)
        whole = torch.cat([lin.weight.detach() for lin in linears]) if len(linears) > 1 else first.weight.detach()
        bias = None
        if first.bias is not None:
            bias = torch.cat([lin.bias.detach() for lin in linears]) if len(linears) > 1 else first.bias.detach()
        shard, bias = m.shard_of(whole, bias)
        grad = first.weight.requires_grad
        # copies (a shard is a view of the user's layer): a change of either never reaches the other
        m.weight = tpf.transposed_parameter(shard, grad) if m.transposed else tpf.copied_parameter(shard, grad)
        if bias is not None:
            m.bias = tpf.copied_parameter(bias, first.bias.requires_grad)
        if names:
            if len(names) != len(linears):
                raise ValueError(f"{cls.__name__}.from_linears: {len(names)} names for {len(linears)} layers")
            m.part_names = tuple(names)
        return m

    def gather(self, t: torch.Tensor, bias: bool = False) -> torch.Tensor:
        """The whole tensor from every rank's shard of a weight-shaped tensor (the weight, its gradient,
        an optimizer state) or, with `bias`, a bias-shaped one; a new tensor, on every rank
        (collective: every rank of the group calls it)."""
        t = t.detach().contiguous()
        if bias and not self.bias_split:
            return t.clone()
        shards = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(shards, t, group=self.group)
        return self._unshard(shards, 0 if bias else self.split_dim)

    def to_linear(self) -> nn.Linear:
        """The whole layer as an nn.Linear on every rank (collective: every rank of the group calls it)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.gather(self.weight))
        if self.bias is not None:
            linear.bias = nn.Parameter(self.gather(self.bias, bias=True))
        return linear

    def extra_repr(self) -> str:
        parts = f", parts={self.parts}" if len(self.parts) > 1 else ""
        if self.replicated:
            parts += f", shards={self.shards}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}, rank={self.rank}/{self.world}, "
                f"shard={tuple(self.weight.shape)}{parts}")


class ColumnParallelLinear(_ParallelLinear):
    """nn.Linear(in_features, out_features) whose output features are split over the group: rank r holds
    weight rows r (out/W, in) and bias rows r, and returns its out/W output columns.

    sequence_parallel=False: the input (..., in) is replicated; the forward is a local GEMM, the input's
    gradient an all-reduce fused with its GEMM (`autofuse.gemm_ar`). True: the input (m, ..., in) is
    this rank's dim-0 block, the output (W m, ..., out/W) holds every rank's rows (`autofuse.ag_gemm`).
    """

    split_dim = 0
    bias_split = True

    @property
    def transposed(self) -> bool:
        return self.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.replicated:
            rows = self.replica_rows()
            weight = tpf.sum_replicas(weight, rows, self.group)
            bias = None if bias is None else tpf.sum_replicas(bias, rows, self.group)
        return tpf.column_parallel_linear(x, weight, bias, self.group, self.sequence_parallel)


class RowParallelLinear(_ParallelLinear):
    """nn.Linear(in_features, out_features) whose input features are split over the group: rank r holds
    weight columns r (out, in/W) and the whole bias, takes its in/W input columns, and the ranks'
    products are summed, the bias added once.

    sequence_parallel=False: every rank gets the whole output (..., out) (`autofuse.gemm_ar`). True:
    rank r gets its dim-0 block (d0/W, ..., out) (`autofuse.gemm_rs`), and the bias's gradient is
    summed over the ranks.
    """

    split_dim = 1
    bias_split = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tpf.row_parallel_linear(x, self.weight, self.bias, self.group, self.sequence_parallel)


class FusedPart(nn.Module):
    """Columns [start, stop) of the input's last dim: one projection's output inside a fused one's.

    Sliced part by part, each slice's backward grows a zero-filled gradient of the fused output's whole
    width, which autograd then sums (q/k/v: 3 fills, 3 copies, 2 adds of the whole width; measured on
    the 70B layer, 2x H200, round 22: eager autofuse's main excess over torch TP). `feed_parts` instead
    splits the fused output once and hands each part its piece: the backward joins them with one cat.
    A piece is taken only by a call on the very tensor it was cut from; any other input is sliced."""

    def __init__(self, start: int, stop: int):
        super().__init__()
        self.start, self.stop = start, stop
        self._fed: tuple[torch.Tensor, torch.Tensor] | None = None  # (the fused output, this part's piece)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fed, self._fed = self._fed, None
        if fed is not None and fed[0] is x:
            return fed[1]
        if self.start == 0 and self.stop == x.shape[-1]:
            return x
        return x[..., self.start:self.stop]

    def extra_repr(self) -> str:
        return f"columns={self.start}:{self.stop}"


def feed_parts(block: nn.Module, names: tuple[str, ...], fused_out: torch.Tensor) -> None:
    """Hand the FusedParts `names` of `block` their columns of `fused_out`, split once (FusedPart's doc), for
    the block's next calls on `fused_out`. Eager only: under torch.compile inductor fuses the slices'
    backward itself, and the parts slice. Does nothing unless the parts tile `fused_out`'s last dim in order."""
    if torch.compiler.is_compiling():
        return
    parts = [getattr(block, n, None) for n in names]
    if len(parts) < 2 or not all(isinstance(p, FusedPart) for p in parts):  # one part: the whole, no slice
        return
    for part in parts:  # a piece a call before left untaken: dropped, not kept alive
        part._fed = None
    if not (torch.is_grad_enabled() and fused_out.requires_grad):
        return
    if [p.start for p in parts] != [0] + [p.stop for p in parts[:-1]] or parts[-1].stop != fused_out.shape[-1]:
        return
    for part, piece in zip(parts, fused_out.split([p.stop - p.start for p in parts], -1)):
        part._fed = (fused_out, piece)


def fuse_columns(block: nn.Module, names: tuple[str, ...], fused: str, group: Any = None,
                 sequence_parallel: bool = False, shards: tuple[int, ...] | None = None) -> ColumnParallelLinear:
    """The nn.Linear projections `names` of `block` made one ColumnParallelLinear `block.<fused>` (copied:
    `from_linears`; `shards` as there), each replaced by a FusedPart view of this rank's columns of it
    (module doc). The caller feeds the block the fused layer's output (a forward pre-hook)."""
    linears = [getattr(block, name) for name in names]
    layer = ColumnParallelLinear.from_linears(linears, group, sequence_parallel, names, shards)
    setattr(block, fused, layer)
    start = 0
    for name, lin, s in zip(names, linears, layer.shards):
        width = lin.out_features // s
        setattr(block, name, FusedPart(start, start + width))
        start += width
    return layer
