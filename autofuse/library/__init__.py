"""autofuse's ops as torch custom ops with autograd: the path of training and of torch.compile / export.

`autofuse.ag_gemm(...)` and friends run plain eager calls that need no gradient on dispatch's hot
path (autofuse/dispatch). A call whose inputs require grad (with grad mode on), a call made while
torch.compile / torch.export traces, and a call on tensor subclasses (FakeTensor, ...) goes through
`route` to the custom ops `torch.ops.autofuse.<op>` instead, which this package generates for every
registered op from the op's own declaration (`Op.custom`: autofuse/library/custom.py), backward
included (each op module's formula, whose communicating GEMMs are autofuse ops too). In a traced
graph each call is one node; the variant is chosen when the graph runs.

Dispatch never imports this package: it installs itself into dispatch at import (`use_library`),
and dispatch loads it through the registry (`core.registry.library`) where a call needs it first.
An op registered later (`core.registry.register`) gets its custom op at once.

The gathered operand of ag_gemm: B's gradient needs all_gather(A). By default (as torch's async TP
does) the forward keeps it (M x K per call, until backward); AUTOFUSE_SAVE_GATHERED=0 keeps only
this rank's A and gathers it again in backward, inside an ag_gemm of the other form (dispatched
like any call, so a fused variant overlaps the gather with the GEMM): less memory, more traffic.
Read at each call (at trace time under torch.compile); every rank must set it alike, which the first
call of each problem checks with every rank (settings.lockstep), as the other shared settings.

Requires torch.distributed to be initialised; ops take their process group by name
(`ProcessGroup.group_name`). Importing this module registers the ops (namespace `autofuse`): import
it before loading an exported program that holds them.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from autofuse.core import registry
from autofuse.core.custom import InferenceOnly, refuse_grad
from autofuse.dispatch import entry
from autofuse.dispatch.entry import tracing
from autofuse.dispatch.state import op_of
from autofuse.library import custom
from autofuse.library.groups import group_of, name_of

__all__ = [*registry.MODULES, "route", "InferenceOnly", "refuse_grad", "group_of", "name_of"]


def _define(name: str) -> None:
    custom.define(registry.get(name))


def __getattr__(name: str) -> Callable[..., torch.Tensor]:
    """`autofuse.library.<op>`: the op through its custom op, differentiable (custom.function)."""
    fn = custom.FUNCTIONS.get(name)
    if fn is None:
        raise AttributeError(f"module 'autofuse.library' has no attribute {name!r}")
    return fn


def refuse_fp8(op: str, tensors: list) -> None:
    """Raise for 8-bit floating-point inputs that need grad: the ops have no FP8 backward."""
    fp8 = [t for t in tensors if t.is_floating_point() and t.element_size() == 1]
    if fp8:
        raise NotImplementedError(f"autofuse.{op}: FP8 inputs ({', '.join(str(t.dtype) for t in fp8)}) have no "
                                  "backward here; call it under torch.no_grad() or on tensors that do not require grad")


def refuse_scaled(op: str, args: tuple) -> None:
    """A call with FP8 scales that needs autograd (any input, a scale included, requires grad) or is traced:
    raise, naming the inputs (the custom ops carry no scales, and a scale's gradient would be lost).
    `args`: the op's positional inputs, then each optional one (None where not given)."""
    o = custom.OPS.get(op) or op_of(op)  # the defined op needs no registry import (a trace may run)
    names = (*o.args, *o.optional)
    named = [(n, t) for n, t in zip(names, args) if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for _, t in named):
        refuse_fp8(op, [t for _, t in named if t.requires_grad])
        grads = ", ".join(f"{n} {tuple(t.shape)} {t.dtype}" for n, t in named if t.requires_grad)
        raise NotImplementedError(f"autofuse.{op} with FP8 scales has no backward, but {grads} require grad: call it "
                                  "under torch.no_grad(), or pass tensors that do not require grad (.detach())")
    raise entry.TraceMiss(f"autofuse.{op} with FP8 scales ({entry.shapes_of(args)}) was called while a trace runs; its custom "
                    "op takes no scales yet, so it cannot be traced: call it outside torch.compile / torch.export")


def route(op: str, args: tuple, group: Any, variant: str | None, config: dict | None,
          out: torch.Tensor | None) -> torch.Tensor | None:
    """The custom op's result where `autofuse.<op>(*args)` must take the library path (an input needs
    grad, or a trace is running, or an input is a tensor subclass other than Parameter), else None
    (the caller runs its eager hot path)."""
    tensors = [t for t in args if isinstance(t, torch.Tensor)]
    traced = tracing(args)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not traced and (not grad or any(t.is_meta for t in tensors)):
        return None  # the eager path; it refuses meta tensors (no data) with every rank, as any bad input
    fn = custom.FUNCTIONS.get(op)
    if fn is not None and len(args) > len(custom.OPS[op].args):  # call(op, a, b, scale_a, ...): FP8 scales
        refuse_scaled(op, args)
    if out is not None:
        why = "inputs that require grad" if grad else "tracing (torch.compile / torch.export)"
        raise ValueError(f"autofuse.{op}: out= is not supported with {why} (as torch's out= functions); "
                         "drop out= and use the returned tensor")
    if grad:
        refuse_fp8(op, tensors)
    if fn is None and traced:
        raise entry.trace_miss(op, args)
    if fn is None:
        with_grad = [n for n, o in custom.OPS.items() if not o.custom.inference_only]
        raise NotImplementedError(f"autofuse.{op} has no autograd (its output would be cut off from the graph) and "
                                  f"its inputs require grad; ops with autograd: {with_grad}")
    return fn(*args, group, variant=variant, config=config)


for _name in registry.names():
    _define(_name)
registry.on_register(_define)  # an op registered later (tests, plug-ins) gets its custom op at once
entry.use_library(sys.modules[__name__])
