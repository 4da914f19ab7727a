"""Tensor-parallel experts: a sparse MoE block that autofuse's expert-parallel ops cannot run (experts with
biases or another activation, e.g. GPT-OSS's clamped SwiGLU on interleaved gate/up columns; a router of its
own kind) split over a process group by each expert's intermediate width, and run by the block's own
forward.

Rank r of the W ranks keeps block r of every expert's intermediate width F: the columns of the
parameters that make it (gate/up, side by side or interleaved in pairs, and their biases) and the rows of
the one that reads it (down); a parameter with no F-wide dimension (down's bias, added after the product)
is kept by the group's first rank, the others hold zeros. Every parameter outside `experts` (the router)
is replicated. The block's own forward then computes, on every rank, every token's routing and this
rank's part of each expert's output (the activation is elementwise over F), and the parts are summed:
- sequence_parallel=False: the input is whole on every rank; its gradient is summed over the group
  (each rank's part reaches it) and the output summed over the group (`functional.sum_partials`);
- sequence_parallel=True: the input is this rank's rows (B, S'/W, H); every rank's rows are gathered
  (W B, S'/W, H) (the gradient reduce-scattered), the block runs on them and this rank's rows of the
  summed output are kept.
The router's gradient is summed over the group (each rank's part of the experts reaches it).

How each expert parameter is cut is not read from names: `plan` tries the cuts the parameters' shapes
allow (an F-wide dimension; a 2F-wide one as [gate | up] halves or as interleaved pairs) and keeps the
first whose W simulated ranks, each run through this rank's converted copy of the block on random rows
(eval, no grad), sum to the whole block's output within the dtype's rounding. A block no cut fits (a
shared expert, which the sum would add W times; a forward that reaches weights the copy does not hold)
is refused, never run wrong. The converted block keeps its class and transformers' state_dict keys,
each holding this rank's piece; `autofuse_shards` (autofuse/nn/shards.py) says how, for
`full_state_dict`.
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autofuse.nn import functional as tpf
from autofuse.nn.grads import GradSum
from autofuse.nn.shards import First, Shards, Split

WIDTH_NAMES = ("intermediate_size", "expert_dim", "moe_intermediate_size", "ffn_dim")  # the experts' F, by attribute
MAX_CUTS = 64  # cut combinations tried per block


@dataclass
class Plan:
    """How one rank splits a block: `specs` per expert parameter (dotted names relative to the block) and
    `block`, this rank's converted copy (not yet hooked up: `from_module` does that)."""

    specs: dict[str, Split | First]
    width: int
    block: nn.Module


def width(block: nn.Module) -> int | None:
    """The experts' intermediate width F, from the experts module's attributes (or its config's)."""
    experts = getattr(block, "experts", None)
    for owner in (experts, getattr(experts, "config", None)):
        for name in WIDTH_NAMES:
            v = getattr(owner, name, None)
            if isinstance(v, int) and v > 0:
                return v
    return None


def _jitter(block: nn.Module) -> float:
    router = getattr(block, "router", None) or getattr(block, "gate", None)
    return max(float(getattr(m, n, 0) or 0) for m in (block, router) for n in ("jitter_noise", "router_jitter_noise"))


def _options(p: torch.Tensor, f: int, world: int, layout: str) -> list[Split | First]:
    """The cuts of expert parameter `p` (dim 0: the experts) that split F: a 2F-wide dimension as [gate | up]
    halves (`layout` 'halves') or as interleaved pairs ('pairs': one block of whole pairs), an F-wide one whole;
    last, the first rank's (added once after the product; also where the hidden width equals F)."""
    dims = range(1 if p.dim() > 1 else 0, p.dim())
    out: list[Split | First] = [Split(d, (f, f)) if layout == "halves" else Split(d, (2 * f,))
                                for d in dims if p.shape[d] == 2 * f]
    out += [Split(d, (f,)) for d in dims if p.shape[d] == f]
    return [s for s in out if s.fits(p.shape, world)] + [First()]


def plan(block: nn.Module, group: Any, hidden: int | None = None) -> Plan:
    """This rank's cut of `block` (module doc), checked by simulating every rank; ValueError naming why not.
    Nothing of `block` changes."""
    group = tpf.process_group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    name = type(block).__name__
    experts = getattr(block, "experts", None)
    if not isinstance(experts, nn.Module):
        raise ValueError(f"{name}: no `experts` module")
    if _jitter(block):
        raise ValueError(f"{name}: router jitter noise is not supported (set router_jitter_noise=0)")
    params = {n: p for n, p in block.named_parameters() if n.startswith("experts.")}
    if not params:
        raise ValueError(f"{name}: its experts hold no parameters")
    f = width(block)
    if f is None:
        raise ValueError(f"{name}: its experts' intermediate width is not known (none of {', '.join(WIDTH_NAMES)})")
    if f % world:
        raise ValueError(f"{name}: the experts' intermediate width {f} is not divisible by the group size {world}")
    hidden = hidden or _hidden(block, params)
    template = _copy(block, {n: First() for n in params}, f, 1, world)  # the block's code, no expert weights
    tol = _tolerance(next((p for p in params.values() if p.is_floating_point()), None))
    tried: set[tuple] = set()
    worst = None
    for layout in ("halves", "pairs"):
        choices = [_options(p, f, world, layout) for p in params.values()]
        for combo in itertools.islice(itertools.product(*choices), MAX_CUTS):
            if combo in tried or all(isinstance(c, First) for c in combo):  # all on the first rank: no split
                continue
            tried.add(combo)
            specs = dict(zip(params, combo))
            err = _simulate(block, template, specs, params, world, hidden)
            if err <= tol:
                return Plan(specs, f, _copy(block, specs, f, rank, world))
            worst = err if worst is None else min(worst, err)
    raise ValueError(f"{name}: no cut of its experts' width over {world} ranks reproduces its forward (best "
                     f"relative error {worst:.2g} on random rows): a shared expert, a forward reaching weights "
                     "outside its experts, or experts of another form")


def _hidden(block: nn.Module, params: dict[str, torch.Tensor]) -> int:
    """The block's input width: the last dimension of its router's weight."""
    for n, p in block.named_parameters():
        if n not in params and p.dim() == 2:
            return p.shape[-1]
    raise ValueError(f"{type(block).__name__}: its input width is not known (no router weight): pass hidden=")


def _tolerance(p: torch.Tensor | None) -> float:
    return 1e-4 if p is not None and p.dtype in (torch.float32, torch.float64) else 3e-2


def _copy(block: nn.Module, specs: dict[str, Split | First], f: int, rank: int, world: int) -> nn.Module:
    """A deep copy of `block` holding rank `rank`'s pieces (copies, never views of the block's tensors); a
    First parameter becomes a zero buffer on the other ranks (empty where every one is First: `plan`'s
    template, run only with the pieces given to functional_call); the experts' width attributes are F / W."""
    memo: dict[int, Any] = {}
    for n, spec in specs.items():
        p = block.get_parameter(n)
        piece = spec.local(p.detach(), rank, world) if isinstance(spec, Split) or rank == 0 else p.new_empty(0)
        memo[id(p)] = tpf.copied_parameter(piece, p.requires_grad)
    local = copy.deepcopy(block, memo)
    for n, spec in specs.items():
        if isinstance(spec, First) and rank != 0:
            path, _, attr = n.rpartition(".")
            owner = local.get_submodule(path)
            del owner._parameters[attr]
            whole = block.get_parameter(n)
            template = all(isinstance(c, First) for c in specs.values())
            owner.register_buffer(attr, whole.new_empty(0) if template else torch.zeros_like(whole))
    for attr in WIDTH_NAMES:  # what an experts implementation may shape its work by
        if getattr(local.experts, attr, None) == f:
            setattr(local.experts, attr, f // world)
    return local


def _simulate(block: nn.Module, local: nn.Module, specs: dict[str, Split | First], params: dict[str, torch.Tensor],
              world: int, hidden: int) -> float:
    """Relative error between the whole block's output on 5 random rows and the sum over W simulated ranks
    of `local` (a converted copy: the code that will run) run with each rank's pieces (views)."""
    p0 = next((p for p in block.parameters() if p.is_floating_point()), next(iter(params.values())))
    x = torch.randn(1, 5, hidden, generator=torch.Generator().manual_seed(0)).to(p0.device, p0.dtype)
    was = block.training, local.training
    block.eval()
    local.eval()
    try:
        with torch.no_grad():
            want = _first(block(x)).float()
            got = torch.zeros_like(want)
            for r in range(world):
                pieces = {n: s.local(params[n].detach(), r, world) for n, s in specs.items()}
                got += _first(torch.func.functional_call(local, pieces, (x,))).float()
    except Exception:  # noqa: BLE001 - a cut the block's forward cannot take (shapes that do not fit)
        return float("inf")
    finally:
        block.train(was[0])
        local.train(was[1])
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def from_module(block: nn.Module, group: Any, sequence_parallel: bool = False, hidden: int | None = None,
                planned: Plan | None = None) -> nn.Module:
    """This rank's tensor-parallel copy of a transformers MoE block (module doc), hooked up to the group; the
    block itself is left as it was. `planned`: `plan`'s result made earlier (parallelize checks every layer
    before it converts any)."""
    group = tpf.process_group(group)
    made = planned or plan(block, group, hidden)
    local = made.block
    local.autofuse_shards = Shards(group, made.specs)
    GradSum(group).register(local, [n for n, _ in local.named_parameters() if n not in made.specs])
    exchange = _Exchange(group, sequence_parallel)
    local.register_forward_pre_hook(exchange.enter)
    local.register_forward_hook(exchange.leave)
    return local


def is_tensor_parallel(module: nn.Module) -> bool:
    """Whether `module` is a block `from_module` made."""
    return isinstance(getattr(module, "autofuse_shards", None), Shards)


class _Exchange:
    """The block's input and output across the group (module doc); a deep copy of the block shares it."""

    def __init__(self, group: Any, sequence_parallel: bool):
        self.group, self.sequence_parallel = group, sequence_parallel
        self.world = dist.get_world_size(group)

    def __deepcopy__(self, memo: dict) -> "_Exchange":
        return self

    def enter(self, module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if not self.sequence_parallel:
            return (tpf.all_reduce_grad(x, self.group), *args[1:])
        b, t, h = x.shape
        rows = tpf.gather_rows(x.reshape(b * t, h), self.group, summed=True)
        return (rows.view(self.world * b, t, h), *args[1:])

    def leave(self, module: nn.Module, args: tuple, output: Any) -> Any:
        y = _first(output)
        if not self.sequence_parallel:
            y = tpf.sum_partials(y, self.group)
        else:
            wb, t, h = y.shape
            y = tpf.scatter_rows(tpf.sum_partials(y.reshape(wb * t, h), self.group), self.group)
            y = y.view(wb // self.world, t, h)
        return (y, *output[1:]) if isinstance(output, tuple) else y
