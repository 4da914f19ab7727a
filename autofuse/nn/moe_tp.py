"""Tensor-parallel experts: a sparse MoE block that autofuse's expert-parallel ops cannot run (experts with
biases or another activation, e.g. GPT-OSS's clamped SwiGLU on interleaved gate/up columns; a router of its
own kind, e.g. Llama 4's scaling the experts' input) split over a process group by each expert's intermediate
width, and run by the block's own forward. A shared expert (an MLP of `forms.MLP_FORMS` inside the block) is
split as a tensor-parallel MLP; any other parameter outside the router is kept whole (a gate multiplying a
partial output, Qwen2-MoE's shared_expert_gate) or by the first rank (added once), as the simulation finds.

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
first whose W simulated ranks, each run through a converted copy of the block on random rows (eval, no
grad), sum to the whole block's output within the dtype's rounding. A block no cut fits (a forward that
reaches weights the copy does not hold, experts of another form) is refused, never run wrong. The
converted block keeps its class and transformers' state_dict keys, each holding this rank's piece;
`autofuse_shards` (autofuse/nn/shards.py) says how, for `full_state_dict`.
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
from autofuse.nn.forms import MLP_FORMS, first, form_of
from autofuse.nn.grads import GradSum
from autofuse.nn.moe import jitter, router_of
from autofuse.nn.shards import First, Shards, Split

WIDTH_NAMES = ("intermediate_dim", "intermediate_size", "expert_dim", "moe_intermediate_size", "ffn_dim")  # experts' F
MAX_CUTS = 64  # cut combinations tried per block


@dataclass
class Plan:
    """How one rank splits a block: `specs` per expert parameter (dotted names relative to the block) and
    `block`, this rank's converted copy (not yet hooked up: `from_module` does that)."""

    specs: dict[str, Split | First]
    width: int
    block: nn.Module


def width(block: nn.Module) -> int | None:
    """The experts' intermediate width F: an attribute of the experts module (WIDTH_NAMES; not its config's
    `intermediate_size`, which may be a dense MLP's), else the smallest size of the experts' 3-D parameters
    whose double is another of their sizes (gate/up's 2F beside down's F)."""
    experts = getattr(block, "experts", None)
    for name in WIDTH_NAMES:
        v = getattr(experts, name, None)
        if isinstance(v, int) and v > 0:
            return v
    sizes = {d for p in experts.parameters() if p.dim() >= 3 for d in p.shape[1:]} if experts is not None else set()
    return next((d for d in sorted(sizes) if 2 * d in sizes), None)


class Whole:
    """A parameter outside the router that every rank keeps whole (a gate multiplying a partial output, as
    Qwen2-MoE's shared_expert_gate): its gradient is summed over the group, as the router's."""

    def local(self, t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        return t

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Whole)

    def __hash__(self) -> int:
        return hash(Whole)

    def __repr__(self) -> str:
        return "Whole()"


def _options(name: str, p: torch.Tensor, f: int, world: int, layout: str) -> list[Split | First | Whole]:
    """The cuts of parameter `name` of the block. An expert parameter (dim 0: the experts): along a 2F-wide
    dimension as [gate | up] halves (`layout` 'halves') or as interleaved pairs ('pairs': one block of whole
    pairs), along an F-wide one; then the first rank's (added once after the product; also where the hidden
    width equals F). Any other (outside the router and shared MLPs): whole on every rank (a gate multiplying a
    partial output), or the first rank's (added once)."""
    if not name.startswith("experts."):
        return [Whole(), First()]
    dims = range(1 if p.dim() > 1 else 0, p.dim())
    out: list[Split | First | Whole] = [Split(d, (f, f)) if layout == "halves" else Split(d, (2 * f,))
                                        for d in dims if p.shape[d] == 2 * f]
    out += [Split(d, (f,)) for d in dims if p.shape[d] == f]
    return [c for c in out if c.fits(p.shape, world)] + [First()]


def _shared_mlps(block: nn.Module, router: nn.Module, world: int) -> dict[str, Split | First]:
    """The cuts of every MLP inside the block outside its experts and router (a shared expert: an MLP_FORMS
    form), as a tensor-parallel MLP: columns' weights and biases split by rows (a fused gate_up part by part),
    the row projection's weight by columns and its bias on the first rank."""
    specs: dict[str, Split | First] = {}
    for path, m in block.named_modules():
        if not path or path == "experts" or path.startswith("experts.") or m is router:
            continue
        form = form_of(m, MLP_FORMS)
        if form is None:
            continue
        for col in form.columns:
            lin = getattr(m, col)
            parts = (lin.out_features // 2,) * 2 if col == "gate_up_proj" else (lin.out_features,)
            for t in ("weight", "bias"):
                if getattr(lin, t) is not None:
                    specs[f"{path}.{col}.{t}"] = Split(0, parts)
        row = getattr(m, form.row)
        specs[f"{path}.{form.row}.weight"] = Split(1, (row.in_features,))
        if row.bias is not None:
            specs[f"{path}.{form.row}.bias"] = First()
        if row.in_features % world:
            raise ValueError(f"{type(block).__name__}: its {path} width {row.in_features} is not divisible by the "
                             f"group size {world}")
    return specs


def plan(block: nn.Module, group: Any, hidden: int | None = None) -> Plan:
    """This rank's cut of `block` (module doc), checked by simulating every rank; ValueError naming why not.
    Nothing of `block` changes."""
    group = tpf.process_group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    name = type(block).__name__
    experts, router = getattr(block, "experts", None), router_of(block)
    if not isinstance(experts, nn.Module) or router is None:
        raise ValueError(f"{name}: no `experts` module and router (`gate` or `router`)")
    if jitter(block):
        raise ValueError(f"{name}: router jitter noise is not supported (set router_jitter_noise=0)")
    routers = {id(p) for p in router.parameters()}
    params = {n: p for n, p in block.named_parameters() if id(p) not in routers}
    if not any(n.startswith("experts.") for n in params):
        raise ValueError(f"{name}: its experts hold no parameters")
    if not all(p.is_floating_point() for p in params.values()):
        raise ValueError(f"{name}: its experts are quantized ({', '.join(sorted({str(p.dtype) for p in params.values()}))}"
                         "): load the model dequantized (e.g. quantization_config=Mxfp4Config(dequantize=True))")
    f = width(block)
    if f is None:
        raise ValueError(f"{name}: its experts' intermediate width is not known (none of {', '.join(WIDTH_NAMES)})")
    if f % world:
        raise ValueError(f"{name}: the experts' intermediate width {f} is not divisible by the group size {world}")
    hidden = hidden or _hidden(block, params)
    shared = _shared_mlps(block, router, world)
    searched = {n: p for n, p in params.items() if n not in shared}
    template = _copy(block, {n: First() for n in params}, f, 1, world)  # the block's code, no weights to cut
    tol = _tolerance(next(iter(params.values())))
    tried: set[tuple] = set()
    worst = None
    for layout in ("halves", "pairs"):
        choices = [_options(n, p, f, world, layout) for n, p in searched.items()]
        for combo in itertools.islice(itertools.product(*choices), MAX_CUTS):
            if combo in tried or not any(isinstance(c, Split) for c in combo):  # nothing split: no parallelism
                continue
            tried.add(combo)
            cuts = {**shared, **dict(zip(searched, combo))}
            err = _simulate(block, template, cuts, params, world, hidden)
            if err <= tol:
                specs = {n: c for n, c in cuts.items() if not isinstance(c, Whole)}
                return Plan(specs, f, _copy(block, cuts, f, rank, world))
            worst = err if worst is None else min(worst, err)
    raise ValueError(f"{name}: no cut of its experts' width over {world} ranks reproduces its forward (best "
                     f"relative error {worst:.2g} on random rows): a forward reaching weights outside the block, or "
                     "experts of another form")


def _hidden(block: nn.Module, params: dict[str, torch.Tensor]) -> int:
    """The block's input width: the last dimension of its router's weight."""
    for n, p in block.named_parameters():
        if n not in params and p.dim() == 2:
            return p.shape[-1]
    raise ValueError(f"{type(block).__name__}: its input width is not known (no router weight): pass hidden=")


def _tolerance(p: torch.Tensor) -> float:
    return 1e-4 if p.dtype in (torch.float32, torch.float64) else 3e-2


def _copy(block: nn.Module, specs: dict[str, Split | First | Whole], f: int, rank: int, world: int) -> nn.Module:
    """A deep copy of `block` holding rank `rank`'s pieces (copies, never views of the block's tensors); a
    First parameter becomes a zero buffer on the other ranks (empty where every one is First: `plan`'s
    template, run only with the pieces given to functional_call); the experts' width attributes are F / W and
    a split nn.Linear's features its piece's."""
    memo: dict[int, Any] = {}
    for n, spec in specs.items():
        p = block.get_parameter(n)
        keep = not isinstance(spec, First) or rank == 0
        memo[id(p)] = tpf.copied_parameter(spec.local(p.detach(), rank, world) if keep else p.new_empty(0),
                                           p.requires_grad)
    local = copy.deepcopy(block, memo)
    for m in local.modules():
        if isinstance(m, nn.Linear) and m.weight.dim() == 2 and m.weight.numel():
            m.out_features, m.in_features = m.weight.shape
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
            want = first(block(x)).float()
            got = torch.zeros_like(want)
            for r in range(world):
                pieces = {n: s.local(params[n].detach(), r, world) for n, s in specs.items()}
                got += first(torch.func.functional_call(local, pieces, (x,))).float()
    except Exception:  # noqa: BLE001 - a cut the block's forward cannot take (shapes that do not fit)
        return float("inf")
    finally:
        block.train(was[0])
        local.train(was[1])
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


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
        y = first(output)
        if not self.sequence_parallel:
            y = tpf.sum_partials(y, self.group)
        else:  # (W B, S'/W, H), or its rows flattened (Llama 4's): this rank's part in the same layout
            shape = y.shape
            y = tpf.scatter_rows(tpf.sum_partials(y.reshape(-1, shape[-1]), self.group), self.group)
            y = y.view(shape[0] // self.world, *shape[1:])
        return (y, *output[1:]) if isinstance(output, tuple) else y
