"""Every registered op as a torch custom op (`torch.ops.autofuse.<op>`), generated from its declaration.

`define(op)` reads the op's `Op.args` and `Op.custom` (autofuse/core/custom.py) and registers:
- `autofuse::<op>(Tensor <arg>, ..., str group_name, *, str? variant=None, str? config=None,
  bool training=False) -> Tensor` (`group_name`: the process group by name, as torch's symm_mem ops take
  it; `variant`, `config`: dispatch's overrides, the config as canonical JSON; `training`: autograd
  records the call, so dispatch decides it as a training call (AUTOFUSE_TRAIN_MODE's timing mode; a call
  in a backward is one without it); keyword arguments go after the `*`, where optional inputs can be
  added without breaking earlier callers), e.g.
  `ag_gemm(Tensor a, Tensor b, str group_name, *, str? variant=None, str? config=None, bool training=False) -> Tensor`;
- for each extra output `<name>`: `autofuse::<op>_<name>(...) -> (Tensor, Tensor)`, the output and the
  extra (ag_gemm's `ag_gemm_gathered`: also all_gather(A), M x K, the A every rank multiplied);
- a fake implementation (the declared shapes, the first input's dtype and device; it reads the
  group's size, a host-side value): all torch.compile, torch.export and FakeTensor need;
- autograd: the op's `Backward` (its gradient in terms of other ops' custom ops), or for an
  inference-only op a refusal (`InferenceOnly`) of inputs that require grad; the backward's `Helper`s as
  custom ops of their own (`autofuse::<name>`, e.g. moe_dispatch_backward).

Ops with handles (`Op.handles`, `CustomOp.handle`: MoE's dispatch/combine pair) and ops of several
outputs: a handle argument `h` becomes `Tensor h_<name>, ..., str h_key` (its tensors in the layout's
order, then its key), a handle output becomes its tensors (fresh copies of the runner's buffers: an
autograd graph may keep them past the next call), after the tensor outputs; the library path rebuilds
the `Handle` and returns `Outputs`. Gradients flow through a handle's floating tensors (MoE's routing
weights) like through any input.

Each real implementation is one dispatched call (`autofuse.dispatch.entry.library_call`: the cached
variant, or the first-call decision on a new problem), so a traced graph holds one opaque node per call
and the variant is chosen when the graph runs, on real tensors, never while tracing. The library path's
function passes `training=True` where grad mode is on and an input requires grad: read while tracing,
so a compiled training step's forward graph carries it as a constant. An extra output is
taken from the runner that ran the call (`Extra.take`), found by the same cache lookup.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from autofuse.core import registry
from autofuse.core.custom import CustomOp, HandleLayout, InferenceOnly, refuse_grad
from autofuse.core.op import Op, config_key
from autofuse.core.runner import Handle, Outputs
from autofuse.dispatch.entry import library_call
from autofuse.library.groups import group_of, name_of, world_size

NAMESPACE = "autofuse"
_KW = "*, str? variant=None, str? config=None, bool training=False"
DEFINED: dict[str, Any] = {}  # custom-op name -> its OpOverload (`torch.ops.autofuse.<op>.default`, `<op>_<extra>`)
FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {}  # op name -> `function(op)`, what the library path calls
OPS: dict[str, Op] = {}  # op name -> the Op defined (read while Dynamo traces: no registry import there)


def schema(op: Op, outputs: int = 1) -> str:
    """The custom op's schema, from the op's argument names."""
    tensors = ", ".join(f"Tensor {a}" for a in op.args)
    returns = "Tensor" if outputs == 1 else f"({', '.join(['Tensor'] * outputs)})"
    return f"({tensors}, str group_name, {_KW}) -> {returns}"


def config_text(config: dict | None) -> str | None:
    """A config as the ops take it: canonical JSON (None stays None)."""
    return None if config is None else config_key(config)


def _dispatch(name: str, args: tuple, group_name: str, variant: str | None, config: str | None,
              training: bool) -> Any:
    """One dispatched call (the cached runner, or the first-call decision): its result."""
    return library_call(name, args, group_of(group_name), variant, config, training)[0]


def _dispatch_runner(name: str, args: tuple, group_name: str, variant: str | None, config: str | None,
                     training: bool) -> tuple:
    """One dispatched call and the runner that ran it (what an extra output reads), one cache lookup."""
    out, entry = library_call(name, args, group_of(group_name), variant, config, training)
    if entry is None:
        raise LookupError(f"autofuse.{name}: no cached decision for these arguments; call it once first")
    return out, entry.runner


LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")  # every op's schema, kernel, fake and autograd
IMPLS: dict[str, Callable[..., Any]] = {}  # custom-op name -> the kernel it runs (host profiles time it alone)


def _define(qualname: str, schema_text: str, impl: Callable, fake_impl: Callable) -> Any:
    """`autofuse::<qualname>` with one kernel for every device (CompositeExplicitAutograd) and a fake
    implementation: its OpOverload. Defined with `torch.library.Library` rather than
    `torch.library.custom_op`, whose Python wrappers around the kernel (the backend and aliasing checks
    on every call) were a third of a compiled training step's per-call custom-op host time (8-9 -> 5-7 us
    on a CPU host, `scripts/host_profile_train.py`); the outputs are fresh tensors (a runner's new
    output, clones of its buffers), never an input, which that check was for
    (tests/test_library_hot_path.py checks every op's)."""
    LIBRARY.define(qualname + schema_text)
    LIBRARY.impl(qualname, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{qualname}", fake_impl, lib=LIBRARY)
    IMPLS[qualname] = impl
    return getattr(getattr(torch.ops, NAMESPACE), qualname).default


def _register(qualname: str, op: Op, outputs: int, real: Callable, fake: Callable) -> Any:
    """The custom op taking the op's tensors, then group_name, variant, config, training (`_define`)."""
    n = len(op.args)

    def impl(*args: Any, variant: str | None = None, config: str | None = None, training: bool = False) -> Any:
        return real(args[:n], args[n], variant, config, training)

    def fake_impl(*args: Any, variant: str | None = None, config: str | None = None, training: bool = False) -> Any:
        return fake(args[:n], args[n])

    return _define(qualname, schema(op, outputs), impl, fake_impl)


def _register_autograd(custom: Any, backward: Callable, setup: Callable) -> None:
    """`backward` and `setup` as the custom op's autograd formula (torch.library.register_autograd)."""
    torch.library.register_autograd(custom, backward, setup_context=setup, lib=LIBRARY)


def _autograd(custom: Any, op: Op, decl: CustomOp, extra: str | None) -> None:
    """Register the op's backward on `custom` (the plain custom op, or the one of extra output `extra`)."""
    n = len(op.args)

    def setup(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: Any) -> None:
        tensors, group_name = inputs[:n], inputs[n]
        if decl.backward is None:
            refuse_grad(op.name, tuple((a, t) for a, t in zip(op.args, tensors)
                                       if isinstance(t, torch.Tensor) and t.requires_grad))
        extras = {}
        if extra is not None:
            ctx.mark_non_differentiable(output[1])
            extras = {extra: output[1]}
        kept = decl.backward.keep(tensors, tuple(ctx.needs_input_grad[:n]), extras)
        names = [k for k, v in kept.items() if isinstance(v, torch.Tensor) or v is None]
        ctx.tensor_names, ctx.values = names, {k: v for k, v in kept.items() if k not in names}
        ctx.group_name = group_name
        ctx.save_for_backward(*(kept[k] for k in names))

    def backward(ctx: Any, grad: torch.Tensor, *extra_grads: Any) -> tuple:
        if decl.backward is None:
            raise InferenceOnly(f"autofuse.{op.name} has no backward")
        kept = {**ctx.values, **dict(zip(ctx.tensor_names, ctx.saved_tensors))}
        grads = decl.backward.grads(kept, grad, tuple(ctx.needs_input_grad[:n]), ctx.group_name)
        return (*grads, None)

    _register_autograd(custom, backward, setup)


def _define_helpers(decl: CustomOp) -> None:
    """The backward's helper custom ops (`Helper`: `autofuse::<name>`, schema from the function's hints), once."""
    for h in decl.backward.helpers if decl.backward is not None else ():
        if h.name not in DEFINED:
            helper = torch.library.custom_op(f"{NAMESPACE}::{h.name}", mutates_args=())(h.fn)
            helper.register_fake(h.fake)
            DEFINED[h.name] = helper


def define(op: Op) -> None:
    """Register `op`'s custom op(s) from its declaration (once; an op without `custom` gets none)."""
    decl = op.custom
    if decl is None or op.name in DEFINED:
        return
    _define_helpers(decl)
    if op.handles or len(op.outputs) > 1:
        Structured(op).define()
        return
    name = op.name

    def real(args: tuple, group_name: str, variant: str | None, config: str | None, training: bool) -> Any:
        return _dispatch(name, args, group_name, variant, config, training)

    def fake(args: tuple, group_name: str) -> Any:
        return args[0].new_empty(decl.out_shape(args, world_size(group_name)))

    DEFINED[name] = _register(name, op, 1, real, fake)
    _autograd(DEFINED[name], op, decl, None)
    for extra_name, extra in decl.extras.items():
        def real_extra(args: tuple, group_name: str, variant: str | None, config: str | None, training: bool,
                       take: Callable = extra.take) -> Any:
            out, runner = _dispatch_runner(name, args, group_name, variant, config, training)
            return out, take(runner, args)

        def fake_extra(args: tuple, group_name: str, shape: Callable = extra.shape) -> Any:
            w = world_size(group_name)
            return args[0].new_empty(decl.out_shape(args, w)), args[0].new_empty(shape(args, w))

        qual = f"{name}_{extra_name}"
        DEFINED[qual] = _register(qual, op, 2, real_extra, fake_extra)
        _autograd(DEFINED[qual], op, decl, extra_name)
    FUNCTIONS[name], OPS[name] = function(op), op


def function(op: Op) -> Callable[..., torch.Tensor]:
    """`op` through its custom op, differentiable: (*tensors, group, *, variant, config) -> output. Where
    autograd records the call and an extra output is kept for backward (`Extra.for_backward`), the
    extra's custom op runs and its first output is returned. An inference-only op refuses inputs that
    require grad before anything runs."""
    decl, name = op.custom, op.name
    custom = DEFINED[name]

    def call(*args: Any, variant: str | None = None, config: dict | None = None) -> torch.Tensor:
        *tensors, group = args
        text = config_text(config)
        training = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
        if training:
            if decl.backward is None:
                refuse_grad(name, tuple((a, t) for a, t in zip(op.args, tensors) if isinstance(t, torch.Tensor)))
            for extra_name, extra in decl.extras.items():
                if extra.for_backward is not None and extra.for_backward(tuple(tensors)):
                    return DEFINED[f"{name}_{extra_name}"](*tensors, name_of(group), variant=variant, config=text,
                                                           training=True)[0]
        return custom(*tensors, name_of(group), variant=variant, config=text, training=training)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"autofuse.{name} through its custom op `torch.ops.autofuse.{name}` (differentiable unless inference only)."
    return call


class Structured:
    """The custom op of an op with handles or several outputs (see the module doc): its flat schema,
    real and fake implementations, autograd and the library path's function."""

    def __init__(self, op: Op):
        self.op, self.decl = op, op.custom
        self.layouts: dict[str, HandleLayout] = {a: registry.get(op.partner).custom.handle for a in op.handles}
        self.made = self.decl.handle  # the handle this op outputs (its last output), or None
        self.tensor_outputs = len(op.outputs) - (1 if self.made else 0)
        self.flat = [(typ, n) for a in op.args for typ, n in (
            [("Tensor", f"{a}_{t}") for t in self.layouts[a].names] + [("str", f"{a}_key")]
            if a in self.layouts else [("Tensor", a)])]
        self.returns = self.tensor_outputs + (len(self.made.names) if self.made else 0)

    def flatten(self, args: tuple) -> list:
        out: list = []
        for a, v in zip(self.op.args, args):
            if a in self.layouts:
                if not isinstance(v, Handle):
                    raise TypeError(f"autofuse.{self.op.name}: {a} must be the Handle autofuse.{self.op.partner} "
                                    f"returned, got {type(v).__name__}")
                out += [v.tensors[t] for t in self.layouts[a].names] + [v.key]
            else:
                out.append(v)
        return out

    def unflatten(self, flat: tuple) -> tuple:
        args, i = [], 0
        for a in self.op.args:
            if a in self.layouts:
                names = self.layouts[a].names
                args.append(Handle(flat[i + len(names)], **dict(zip(names, flat[i:i + len(names)]))))
                i += len(names) + 1
            else:
                args.append(flat[i])
                i += 1
        return tuple(args)

    def handle_of(self, args: tuple, tensors: tuple, group_name: str) -> Handle:
        return Handle(self.made.key(args, world_size(group_name)), **dict(zip(self.made.names, tensors)))

    def schema(self) -> str:
        params = ", ".join(f"{typ} {n}" for typ, n in self.flat)
        returns = "Tensor" if self.returns == 1 else f"({', '.join(['Tensor'] * self.returns)})"
        return f"({params}, str group_name, {_KW}) -> {returns}"

    def real(self, flat: tuple, group_name: str, variant: str | None, config: str | None, training: bool) -> Any:
        out = _dispatch(self.op.name, self.unflatten(flat), group_name, variant, config, training)
        if self.returns == 1:
            return out
        tensors = list(out[:self.tensor_outputs])
        if self.made:
            handle = out[self.tensor_outputs]
            tensors += [handle.tensors[t].clone() for t in self.made.names]
        return tuple(tensors)

    def fake(self, flat: tuple, group_name: str) -> Any:
        args, w = self.unflatten(flat), world_size(group_name)
        first = next(t for t in flat if isinstance(t, torch.Tensor))
        shapes = self.decl.out_shape(args, w)
        shapes = [shapes] if self.tensor_outputs == 1 else list(shapes)
        outs = [first.new_empty(s) for s in shapes]
        if self.made:
            outs += [torch.empty(s, dtype=dt, device=first.device) for s, dt in self.made.fake(args, w)]
        return outs[0] if self.returns == 1 else tuple(outs)

    def define(self) -> None:
        op, decl, n = self.op, self.decl, len(self.flat)

        def impl(*args: Any, variant: str | None = None, config: str | None = None, training: bool = False) -> Any:
            return self.real(args[:n], args[n], variant, config, training)

        def fake_impl(*args: Any, variant: str | None = None, config: str | None = None,
                      training: bool = False) -> Any:
            return self.fake(args[:n], args[n])

        custom = _define(op.name, self.schema(), impl, fake_impl)

        def setup(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: Any) -> None:
            flat, group_name = inputs[:n], inputs[n]
            args = self.unflatten(flat)
            if decl.backward is None:
                refuse_grad(op.name, tuple((a, t) for (_, a), t in zip(self.flat, flat)
                                           if isinstance(t, torch.Tensor) and t.requires_grad))
            extras = {}
            if self.made:
                outs = output if isinstance(output, tuple) else (output,)
                extras = {op.outputs[-1]: self.handle_of(args, tuple(outs[self.tensor_outputs:]), group_name)}
            kept = decl.backward.keep(args, tuple(ctx.needs_input_grad[:n]), extras)
            names = [k for k, v in kept.items() if isinstance(v, torch.Tensor) or v is None]
            ctx.tensor_names, ctx.values = names, {k: v for k, v in kept.items() if k not in names}
            ctx.group_name = group_name
            ctx.save_for_backward(*(kept[k] for k in names))

        def backward(ctx: Any, *grads: Any) -> tuple:
            if decl.backward is None:
                raise InferenceOnly(f"autofuse.{op.name} has no backward")
            kept = {**ctx.values, **dict(zip(ctx.tensor_names, ctx.saved_tensors))}
            return (*decl.backward.grads(kept, grads, tuple(ctx.needs_input_grad[:n]), ctx.group_name), None)

        _register_autograd(custom, backward, setup)
        DEFINED[op.name] = custom
        FUNCTIONS[op.name], OPS[op.name] = self.function(custom), op

    def function(self, custom: Any) -> Callable[..., Any]:
        op, decl, name = self.op, self.decl, self.op.name

        def call(*args: Any, variant: str | None = None, config: dict | None = None) -> Any:
            *tensors, group = args
            flat = self.flatten(tuple(tensors))
            training = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat)
            if training and decl.backward is None:
                refuse_grad(name, tuple((a, t) for (_, a), t in zip(self.flat, flat) if isinstance(t, torch.Tensor)))
            group_name = name_of(group)
            res = custom(*flat, group_name, variant=variant, config=config_text(config), training=training)
            if self.returns == 1 and not self.made:
                return res
            res = res if isinstance(res, tuple) else (res,)
            values = list(res[:self.tensor_outputs])
            if self.made:
                values.append(self.handle_of(tuple(tensors), tuple(res[self.tensor_outputs:]), group_name))
            return Outputs(op.outputs, values)

        call.__name__ = call.__qualname__ = name
        call.__doc__ = f"autofuse.{name} through its custom op `torch.ops.autofuse.{name}`."
        return call
