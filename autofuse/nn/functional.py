"""Tensor-parallel linears as functions, and the row scatter/gather around sequence-parallel regions.

A linear layer y = x Wᵀ + b split over the W ranks of a process group (Megatron's forms):
- column-parallel: rank r holds rows r of the weight (out/W, in) and of the bias, and returns its
  out/W columns of y. Replicated input: a local GEMM; the input's gradient is the sum over ranks of
  dy_r W_r, an all-reduce fused with its GEMM (`autofuse.gemm_ar`). Sequence-parallel input (rank r
  holds rows r of x): `autofuse.ag_gemm`, all_gather_rows(x) W_rᵀ.
- row-parallel: rank r holds columns r of the weight (out, in/W) and the whole bias, takes columns r
  of x and returns x W ᵀ summed over ranks: all-reduced on every rank (`autofuse.gemm_ar`), or only
  its rows r (`autofuse.gemm_rs`, sequence parallel); the bias is added once, after the sum.
"Rows" are dim 0 of the activation (tokens; the sequence in Megatron's (seq, batch, hidden) layout):
a sequence-parallel rank holds dim-0 block r, and the gathered result is the blocks in rank order.

Weights are in nn.Linear's (out, in) shape. The ops take B = Wᵀ row-major, so weights kept for them
are stored transposed (`transposed_parameter`): `weight.t()` is then a contiguous view, no copy per
call, and gradients reach the parameter through it. Any other layout is copied per call.

Groups: None (the default group), a ProcessGroup, or a one-dimensional DeviceMesh.

The ops are called as `public.<op>` (autofuse/nn/public.py): the functions `autofuse.<op>` names.
"""
from __future__ import annotations

import copy
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from autofuse.comm.world import all_gather_single
from autofuse.nn import public


def process_group(group: Any) -> Any:
    """The ProcessGroup (None: the default group) of `group` (None, a ProcessGroup or a 1-D DeviceMesh)."""
    mesh_type = getattr(getattr(dist, "device_mesh", None), "DeviceMesh", None)
    if mesh_type is not None and isinstance(group, mesh_type):
        if group.ndim != 1:
            raise ValueError(f"a tensor-parallel group must be a 1-D DeviceMesh, got {group.ndim} dimensions "
                             "(slice it first, e.g. mesh['tp'])")
        return group.get_group()
    return group


def _collective_group(group: Any) -> Any:
    """The group as functional collectives take it (they need the default group spelt out)."""
    return dist.group.WORLD if group is None else group


_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # all_gather_tensor before the rename


def _c10d_eagerly(x: torch.Tensor, group: Any) -> bool:
    """Whether a collective on x runs as the plain c10d call instead of the functional one: CUDA
    tensors on gloo (ranks sharing a GPU), outside a trace. There torch 2.11's functional all-gather
    killed the process (SIGSEGV in gloo, one H100, 2026-11-26), while c10d's, which the ops' BSP
    variants use, works."""
    return x.is_cuda and not torch.compiler.is_compiling() and dist.get_backend(group) == "gloo"


def _gather0(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's x concatenated along dim 0 (a functional collective: traceable by torch.compile)."""
    x = x.contiguous()
    if _c10d_eagerly(x, group):
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        all_gather_single(out, x, group=group)
        return out
    return funcol.wait_tensor(_all_gather(x, 0, _collective_group(group)))


def _sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """x summed over the group, out of place (a functional collective: traceable by torch.compile)."""
    x = x.contiguous()
    if _c10d_eagerly(x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", _collective_group(group)))


def transposed_parameter(weight: torch.Tensor, requires_grad: bool = True) -> torch.nn.Parameter:
    """A Parameter with `weight`'s values and (out, in) shape, stored (in, out) row-major, so that
    `param.t()` is the contiguous K x N operand the ops take; always a copy, never a view of `weight`
    (a shard of one row or column is already contiguous transposed)."""
    return torch.nn.Parameter(weight.detach().t().clone(memory_format=torch.contiguous_format).t(),
                              requires_grad=requires_grad)


def copied_parameter(t: torch.Tensor, requires_grad: bool = True) -> torch.nn.Parameter:
    """A Parameter holding a contiguous copy of `t` (say a shard sliced from a user's layer): never a
    view, so changing either (an optimizer step) never reaches the other."""
    return torch.nn.Parameter(t.detach().clone(memory_format=torch.contiguous_format), requires_grad=requires_grad)


M = TypeVar("M", bound=torch.nn.Module)


def deepcopy_sharing_group(module: M, memo: dict) -> M:
    """`module`'s deep copy (its `__deepcopy__`) sharing its process group `module.group`: a group cannot be
    copied; the copy's tensors are its own."""
    memo[id(module.group)] = module.group
    new = object.__new__(type(module))
    memo[id(module)] = new
    new.__dict__.update(copy.deepcopy(module.__dict__, memo))
    return new


def _operand(weight: torch.Tensor) -> torch.Tensor:
    """Wᵀ as a contiguous (in, out) matrix: a view for a transposed parameter, else a copy."""
    wt = weight.t()
    return wt if wt.is_contiguous() else wt.contiguous()


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype torch.autocast runs matmuls in on x's device type where it is enabled there, else None.
    The ops are not on autocast's lists (a custom op runs with the dtypes it is given), so the layers cast
    their operands as autocast casts F.linear's: a model parallelized with float32 weights trains under
    `torch.autocast(..., dtype=torch.bfloat16)` with bfloat16 GEMMs and float32 gradients."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _autocast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """(x, weight, bias) in autocast's dtype where autocast is on (differentiable casts), else as given."""
    dtype = autocast_dtype(x)
    if dtype is None or not x.is_floating_point():
        return x, weight, bias
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _rows(x: torch.Tensor, what: str, features: int) -> torch.Tensor:
    """x as a contiguous 2-D (rows, features) matrix (leading dims flattened)."""
    if x.dim() < 1 or x.shape[-1] != features:
        raise ValueError(f"{what}: the input's last dim is {tuple(x.shape)[-1:] or 'missing'}, this rank's "
                         f"weight takes {features} features")
    return x.reshape(-1, features).contiguous()


def group_name(group: Any) -> str:
    """The process group's name (None: the default group): how a traced call names its group."""
    return (dist.group.WORLD if group is None else group).group_name


class _ColumnLocal(torch.autograd.Function):
    """y = x Wᵀ + b on a replicated x; dx = all_reduce(dy W) via autofuse.gemm_ar (Megatron's f + linear).

    The backward names the group by its name while torch.compile traces it (the ops' custom-op form
    takes names; resolving a group object there would mutate state inside the traced function)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Any,
                name: str) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.name, ctx.has_bias = group, name, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            group = ctx.name if torch.compiler.is_compiling() else ctx.group
            dx = public.gemm_ar(dy, weight.contiguous(), group=group)
        if ctx.needs_input_grad[1]:
            dw = dy.t() @ x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db, None, None


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; the gradient is summed over the group (a replicated parameter whose users
    see only this rank's rows: sequence-parallel biases and norms)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return _sum(g, ctx.group), None


class _SumOverGroup(torch.autograd.Function):
    """x summed over the group; its gradient likewise (every rank's x reaches every rank's sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _sum(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return _sum(g, ctx.group), None


def sum_over_group(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """x summed over the group, out of place, differentiable (the all-reduce's adjoint is itself)."""
    return _SumOverGroup.apply(x, process_group(group))


class _SumReplicas(torch.autograd.Function):
    """Identity forward on a column-parallel weight or bias; backward: the rows of each replicated part
    (`rows`: (start, stop, shards)) summed over the ranks holding the same shard (rank r holds shard
    r * shards // W), the other rows as they are. One all-reduce over the group of a buffer holding each
    part's every shard, zero but this rank's: no subgroups to make, and traceable by torch.compile."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, rows: tuple, group: Any, w: int, r: int) -> torch.Tensor:
        ctx.rows, ctx.group, ctx.w, ctx.r = rows, group, w, r
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        slots = []
        for start, stop, shards in ctx.rows:
            slot = g.new_zeros((shards, stop - start, *g.shape[1:]))
            slot[ctx.r * shards // ctx.w] = g[start:stop]
            slots.append(slot.flatten())
        summed = _sum(torch.cat(slots), ctx.group)
        pieces, at, offset = [], 0, 0
        for (start, stop, shards), slot in zip(ctx.rows, slots):
            pieces.append(g[at:start])
            mine = summed[offset:offset + slot.numel()].view(shards, stop - start, *g.shape[1:])
            pieces.append(mine[ctx.r * shards // ctx.w])
            at, offset = stop, offset + slot.numel()
        pieces.append(g[at:])
        return torch.cat(pieces), None, None, None, None


def sum_replicas(t: torch.Tensor, rows: tuple[tuple[int, int, int], ...], group: Any = None) -> torch.Tensor:
    """t itself (a column-parallel weight (out/W.., in) or bias), whose gradient's rows `rows` ((start,
    stop, shards) each: a part split into fewer shards than ranks) are summed in the backward pass over
    the ranks holding the same shard, so every replica gets the whole gradient."""
    if not rows:
        return t
    group = process_group(group)
    return _SumReplicas.apply(t, tuple(rows), group, dist.get_world_size(group), dist.get_rank(group))


def _rows_aligned(dtype: torch.dtype, *widths: int) -> bool:
    """Whether rows `widths` elements of `dtype` wide start 16 bytes apart, as `autofuse.ag_gemm`
    requires of N and K (its `validate`)."""
    return all(n * dtype.itemsize % 16 == 0 for n in widths)


class _ScatterRows(torch.autograd.Function):
    """This rank's (rank r of w) block of dim 0 of a replicated x; backward: the blocks' gradients all-gathered.

    The block is a copy, not a view of x: a compiled module whose forward pre-hook scatters (the first
    sequence-parallel layer under `torch.compile`) receives it as a graph input, and AOTAutograd
    replays an input that views a base from the base, differentiating the slice instead of this
    backward (every rank's gradient then held only its own rows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, w: int, r: int) -> torch.Tensor:
        ctx.group = group
        n = x.shape[0] // w
        return x[r * n:(r + 1) * n].clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return _gather0(g, ctx.group), None, None, None


class _GatherRows(torch.autograd.Function):
    """Every rank's dim-0 block concatenated; backward: this rank's (rank r of w) block of the
    gradient, which is replicated (the code after the gather is), or with `summed` a partial one
    summed over the group first (each rank's columns contribute to every gathered row: the
    all-gather's adjoint, a reduce-scatter, as an all-reduce and a slice)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, w: int, r: int, summed: bool) -> torch.Tensor:
        ctx.group, ctx.w, ctx.r, ctx.summed = group, w, r, summed
        return _gather0(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        n = g.shape[0] // ctx.w
        if ctx.summed:
            g = _sum(g, ctx.group)
        return g[ctx.r * n:(ctx.r + 1) * n], None, None, None, None


def scatter_rows(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Enter a sequence-parallel region: this rank's block r of dim 0 of x, which every rank holds whole
    (dim 0 must divide by the group size). Its gradient is all-gathered, so the replicated code before
    it gets the whole gradient on every rank."""
    group = process_group(group)
    w = dist.get_world_size(group)
    if x.shape[0] % w:
        raise ValueError(f"scatter_rows: dim 0 ({x.shape[0]}) is not divisible by the group size {w}")
    return _ScatterRows.apply(x, group, w, dist.get_rank(group))


def gather_rows(x: torch.Tensor, group: Any = None, summed: bool = False) -> torch.Tensor:
    """Leave a sequence-parallel region: every rank's x concatenated along dim 0 in rank order. The
    code after it must be replicated (every rank computes the same gradient), so the backward keeps
    this rank's block of the gradient; with `summed` the code after it is split over the ranks (each
    computes a part of every row's result) and the gradient is summed over the group first (the
    all-gather's adjoint, a reduce-scatter)."""
    group = process_group(group)
    return _GatherRows.apply(x, group, dist.get_world_size(group), dist.get_rank(group), summed)


class _SumPartials(torch.autograd.Function):
    """x summed over the group; the gradient passes as it is (the code after the sum is replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _sum(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return g, None


def sum_partials(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's partial result x summed over the group, out of place (Megatron's reduce after a
    row-parallel layer): the code after it is replicated, so each rank's gradient passes as it is."""
    return _SumPartials.apply(x, process_group(group))


class _KeepShare(torch.autograd.Function):
    """Identity forward; backward: rows r, r + w, r + 2w, ... of the gradient (rank r of w), zero elsewhere."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: int, r: int) -> torch.Tensor:
        ctx.w, ctx.r = w, r
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        out = torch.zeros_like(g)
        out[ctx.r::ctx.w] = g[ctx.r::ctx.w]
        return out, None, None


def keep_share(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """x itself (a tensor every rank computes alike from partial work whose gradients the group then sums,
    e.g. tensor-parallel experts' router logits), whose gradient keeps this rank's share of the rows (rows
    r, r + W, ...) and zero elsewhere: the code after it is replicated, so the group's sum is its gradient once."""
    group = process_group(group)
    return _KeepShare.apply(x, dist.get_world_size(group), dist.get_rank(group))


def all_reduce_grad(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """x itself, whose gradient is summed over the group in the backward pass."""
    return _AllReduceGrad.apply(x, process_group(group))


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           group: Any = None, sequence_parallel: bool = False) -> torch.Tensor:
    """This rank's out/W columns of x Wᵀ + b; weight, bias: rows r of W and b ((out/W, in), (out/W,)).

    sequence_parallel=False: x (..., in) replicated -> (..., out/W). True: x (m, ..., in) is this
    rank's rows, the result (W m, ..., out/W) every rank's rows (`autofuse.ag_gemm`; where its rows
    would not be 16-byte aligned, out/W or in not a multiple of 16 bytes, which ag_gemm refuses: the
    rows all-gathered, then a local GEMM, the input's gradient summed and scattered back).
    """
    group = process_group(group)
    x, weight, bias = _autocast(x, weight, bias)
    x2 = _rows(x, "column_parallel_linear", weight.shape[1])
    if sequence_parallel:
        if x.dim() < 2:
            raise ValueError(f"column_parallel_linear: sequence parallelism gathers dim 0 of a (rows, ..., in) "
                             f"input, got {tuple(x.shape)}")
        if _rows_aligned(x2.dtype, *weight.shape):
            y = public.ag_gemm(x2, _operand(weight), group=group)
        else:  # a shard width ag_gemm refuses: the rows gathered, then this rank's columns
            w = dist.get_world_size(group)
            y = F.linear(_GatherRows.apply(x2, group, w, dist.get_rank(group), True), weight)
        y = y.view(dist.get_world_size(group) * x.shape[0], *x.shape[1:-1], weight.shape[0])
        return y if bias is None else y + bias
    if torch.is_grad_enabled() and (x2.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        y = _ColumnLocal.apply(x2, weight, bias, group, group_name(group))
    else:
        y = F.linear(x2, weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        group: Any = None, sequence_parallel: bool = False) -> torch.Tensor:
    """x Wᵀ + b summed over ranks; weight: columns r of W (out, in/W); bias: all of b (replicated).

    x (d0, ..., in/W) is this rank's columns. sequence_parallel=False: every rank gets (d0, ..., out)
    (`autofuse.gemm_ar`). True: rank r gets its block (d0/W, ..., out) of dim 0 (`autofuse.gemm_rs`;
    d0 must divide by W), and the bias's gradient is summed over the ranks.
    """
    group = process_group(group)
    x, weight, bias = _autocast(x, weight, bias)
    x2 = _rows(x, "row_parallel_linear", weight.shape[1])
    if sequence_parallel:
        w = dist.get_world_size(group)
        if x.dim() < 2 or x.shape[0] % w:
            raise ValueError(f"row_parallel_linear: sequence parallelism splits dim 0 of the output over {w} ranks, "
                             f"but the input is {tuple(x.shape)}")
        y = public.gemm_rs(x2, _operand(weight), group=group).view(x.shape[0] // w, *x.shape[1:-1], weight.shape[0])
        return y if bias is None else y + all_reduce_grad(bias, group)
    y = public.gemm_ar(x2, _operand(weight), group=group).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias
