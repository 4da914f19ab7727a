"""autofuse's ops as torch custom ops with autograd: the path of training and of torch.compile / export.

`autofuse.ag_gemm(...)` and friends run plain eager calls that need no gradient on dispatch's hot
path (autofuse/dispatch). A call whose inputs require grad (with grad mode on), a call made while
torch.compile / torch.export traces, and a call on tensor subclasses (FakeTensor, ...) goes through
`route` to the custom ops `torch.ops.autofuse.<op>` instead (autofuse/library/ops.py), whose
autograd (autofuse/library/grads.py) runs the backward GEMMs as autofuse ops too. In a traced
graph each call is one node; the variant is chosen when the graph runs.

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

from typing import Any

import torch

from autofuse.core import settings
from autofuse.dispatch.entry import tracing
from autofuse.library import grads, ops
from autofuse.library.groups import group_of, name_of
from autofuse.library.grads import InferenceOnly, refuse_grad

__all__ = ["ag_gemm", "gemm_rs", "gemm_ar", "flash_decode", "route", "InferenceOnly", "group_of", "name_of"]


grads.register()


def ag_gemm(a: torch.Tensor, b: torch.Tensor, group: Any = None, *, variant: str | None = None,
            config: dict | None = None) -> torch.Tensor:
    """all_gather(A) @ B_r (rows or K form, from the shapes) through the custom op, differentiable."""
    name, text = name_of(group), ops.config_text(config)
    if b.requires_grad and torch.is_grad_enabled() and settings.save_gathered(not torch.compiler.is_compiling()):
        return torch.ops.autofuse.ag_gemm_gathered(a, b, name, variant=variant, config=text)[0]
    return torch.ops.autofuse.ag_gemm(a, b, name, variant=variant, config=text)


def gemm_rs(a: torch.Tensor, b: torch.Tensor, group: Any = None, *, variant: str | None = None,
            config: dict | None = None) -> torch.Tensor:
    """reduce_scatter_rows(A_r @ B_r) through the custom op, differentiable."""
    return torch.ops.autofuse.gemm_rs(a, b, name_of(group), variant=variant, config=ops.config_text(config))


def gemm_ar(a: torch.Tensor, b: torch.Tensor, group: Any = None, *, variant: str | None = None,
            config: dict | None = None) -> torch.Tensor:
    """all_reduce(A_r @ B_r) through the custom op, differentiable (dC taken as the same on every rank)."""
    return torch.ops.autofuse.gemm_ar(a, b, name_of(group), variant=variant, config=ops.config_text(config))


def flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, group: Any = None, *,
                 variant: str | None = None, config: dict | None = None) -> torch.Tensor:
    """Split-KV decode attention through the custom op; inference only (inputs requiring grad raise)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        refuse_grad("flash_decode", (("q", q), ("k", k), ("v", v)))
    return torch.ops.autofuse.flash_decode(q, k, v, lengths, name_of(group), variant=variant,
                                           config=ops.config_text(config))


FUNCTIONS = {"ag_gemm": ag_gemm, "gemm_rs": gemm_rs, "gemm_ar": gemm_ar, "flash_decode": flash_decode}


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
    from autofuse.dispatch.state import op_of

    names = (*op_of(op).args, *op_of(op).optional)
    named = [(n, t) for n, t in zip(names, args) if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for _, t in named):
        refuse_fp8(op, [t for _, t in named if t.requires_grad])
        grads = ", ".join(f"{n} {tuple(t.shape)} {t.dtype}" for n, t in named if t.requires_grad)
        raise NotImplementedError(f"autofuse.{op} with FP8 scales has no backward, but {grads} require grad: call it "
                                  "under torch.no_grad(), or pass tensors that do not require grad (.detach())")
    from autofuse.dispatch.entry import TraceMiss, shapes_of

    raise TraceMiss(f"autofuse.{op} with FP8 scales ({shapes_of(args)}) was called while a trace runs; its custom "
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
    from autofuse.dispatch.state import op_of

    if op in FUNCTIONS and len(args) > len(op_of(op).args):  # call(op, a, b, scale_a, ...): FP8 scales
        refuse_scaled(op, args)
    if out is not None:
        why = "inputs that require grad" if grad else "tracing (torch.compile / torch.export)"
        raise ValueError(f"autofuse.{op}: out= is not supported with {why} (as torch's out= functions); "
                         "drop out= and use the returned tensor")
    if grad:
        refuse_fp8(op, tensors)
    fn = FUNCTIONS.get(op)
    if fn is None and traced:
        from autofuse.dispatch.entry import trace_miss

        raise trace_miss(op, args)
    if fn is None:
        with_grad = [n for n in FUNCTIONS if n != "flash_decode"]
        raise NotImplementedError(f"autofuse.{op} has no autograd (its output would be cut off from the graph) and "
                                  f"its inputs require grad; ops with autograd: {with_grad}")
    return fn(*args, group, variant=variant, config=config)
