"""The public ops as torch custom ops (`torch.ops.autofuse.*`): schemas, real and fake implementations.

Each op's real implementation is one dispatched call (`autofuse.dispatch.call`: the cached variant,
or the first-call decision on a new problem), so a traced graph holds one opaque node per call and
the variant is chosen when the graph runs, on real tensors, never while tracing. The fake (meta)
implementations give the output's shape, dtype and device from the inputs' alone (they read the
group's size, a host-side value), which is all torch.compile, torch.export and FakeTensor need.

Schemas (`group_name`: the process group by name, as torch's symm_mem ops take it; `variant`,
`config`: dispatch's overrides, the config as canonical JSON; keyword arguments go after the `*`,
where optional inputs such as scales can be added without breaking earlier callers):

    ag_gemm(Tensor a, Tensor b, str group_name, *, str? variant=None, str? config=None) -> Tensor
    ag_gemm_gathered(Tensor a, Tensor b, str group_name, *, ...) -> (Tensor out, Tensor gathered)
    gemm_rs(Tensor a, Tensor b, str group_name, *, ...) -> Tensor
    gemm_ar(Tensor a, Tensor b, str group_name, *, ...) -> Tensor
    flash_decode(Tensor q, Tensor k, Tensor v, Tensor lengths, str group_name, *, ...) -> Tensor

`ag_gemm_gathered` is ag_gemm that also returns all_gather(A) (M x K, the A every rank multiplied):
what a training step keeps for B's gradient (autofuse/library/grads.py). It takes it from the
buffers of the variant that ran where it holds the whole gathered A (its runner's
`gathered_input()`: bsp and the heap hybrids heap_mm, heap_mm_overlap), else (the fused kernels,
whose tiles never sit whole in one buffer, and torch_symm) it gathers A once more with
torch.distributed, bounded as bsp's collectives are (`World.collective`: on gloo within the wait
budget, stopped at once by a peer that did not take part).
"""
from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from autofuse.comm.world import World, all_gather_single
from autofuse.library.groups import group_of, world_size

NAMESPACE = "autofuse"
_KW = "*, str? variant=None, str? config=None"
SCHEMAS = {
    "ag_gemm": f"(Tensor a, Tensor b, str group_name, {_KW}) -> Tensor",
    "ag_gemm_gathered": f"(Tensor a, Tensor b, str group_name, {_KW}) -> (Tensor, Tensor)",
    "gemm_rs": f"(Tensor a, Tensor b, str group_name, {_KW}) -> Tensor",
    "gemm_ar": f"(Tensor a, Tensor b, str group_name, {_KW}) -> Tensor",
    "flash_decode": f"(Tensor q, Tensor k, Tensor v, Tensor lengths, str group_name, {_KW}) -> Tensor",
}


def config_text(config: dict | None) -> str | None:
    """A config as the ops take it: canonical JSON (None stays None)."""
    if config is None:
        return None
    from autofuse.core.op import config_key

    return config_key(config)


def _call(name: str, args: tuple, group_name: str, variant: str | None, config: str | None) -> torch.Tensor:
    from autofuse import dispatch

    return dispatch.call(name, *args, group=group_of(group_name), variant=variant,
                         config=None if config is None else json.loads(config))


def gather_form(a: torch.Tensor, b: torch.Tensor) -> str:
    """ag_gemm's form from the shapes alone: B with as many rows as A has columns is the rows form."""
    return "rows" if b.shape[0] == a.shape[1] else "k"


def _ag_gemm_shape(a: torch.Tensor, b: torch.Tensor, group_name: str) -> tuple[int, int]:
    w = world_size(group_name)
    return (a.shape[0] * w if gather_form(a, b) == "rows" else a.shape[0], b.shape[1])


def _all_gather(a: torch.Tensor, group_name: str) -> torch.Tensor:
    """all_gather_rows(A) (rows form) or concat_cols(A) (k form, M x K) with torch.distributed."""
    group = group_of(group_name)
    world = World.from_group(None if group is dist.group.WORLD else group)
    a = a.contiguous()
    shards = a.new_empty((world.size * a.shape[0], a.shape[1]))
    world.collective(all_gather_single, shards, a, what="autofuse.ag_gemm (all_gather of A for B's gradient)")
    return shards


def _gathered(a: torch.Tensor, b: torch.Tensor, group_name: str, variant: str | None,
              config: str | None) -> torch.Tensor:
    """A fresh M x K tensor holding the A the last ag_gemm call multiplied (see the module doc)."""
    from autofuse import dispatch

    runner = dispatch.runner_of("ag_gemm", a, b, group=group_of(group_name), variant=variant,
                                config=None if config is None else json.loads(config))
    full = runner.gathered_input()
    if full is not None:
        return full.clone()
    shards = _all_gather(a, group_name)
    if gather_form(a, b) == "rows":
        return shards
    w, (m, c) = shards.shape[0] // a.shape[0], a.shape
    return shards.view(w, m, c).transpose(0, 1).reshape(m, w * c)


def _gemm_op(name: str, out_shape: Any) -> Any:
    """The custom op `autofuse::<name>` of a two-operand GEMM op: one dispatched call; fake: `out_shape`."""

    @torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=(), schema=SCHEMAS[name])
    def op(a: torch.Tensor, b: torch.Tensor, group_name: str, *, variant: str | None = None,
           config: str | None = None) -> torch.Tensor:
        return _call(name, (a, b), group_name, variant, config)

    @op.register_fake
    def _(a, b, group_name, *, variant=None, config=None):
        return a.new_empty(out_shape(a, b, group_name))

    return op


ag_gemm = _gemm_op("ag_gemm", _ag_gemm_shape)
gemm_rs = _gemm_op("gemm_rs", lambda a, b, group_name: (a.shape[0] // world_size(group_name), b.shape[1]))
gemm_ar = _gemm_op("gemm_ar", lambda a, b, group_name: (a.shape[0], b.shape[1]))


@torch.library.custom_op(f"{NAMESPACE}::ag_gemm_gathered", mutates_args=(), schema=SCHEMAS["ag_gemm_gathered"])
def ag_gemm_gathered(a: torch.Tensor, b: torch.Tensor, group_name: str, *, variant: str | None = None,
                     config: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out = _call("ag_gemm", (a, b), group_name, variant, config)
    return out, _gathered(a, b, group_name, variant, config)


@ag_gemm_gathered.register_fake
def _(a, b, group_name, *, variant=None, config=None):
    m, n = _ag_gemm_shape(a, b, group_name)
    return a.new_empty((m, n)), a.new_empty((m, b.shape[0]))


@torch.library.custom_op(f"{NAMESPACE}::flash_decode", mutates_args=(), schema=SCHEMAS["flash_decode"])
def flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, group_name: str, *,
                 variant: str | None = None, config: str | None = None) -> torch.Tensor:
    return _call("flash_decode", (q, k, v, lengths), group_name, variant, config)


@flash_decode.register_fake
def _(q, k, v, lengths, group_name, *, variant=None, config=None):
    return q.new_empty(q.shape)
