"""What an op declares for its torch custom op (`Op.custom`); the custom-op layer (autofuse/library)
registers `torch.ops.autofuse.<op>` from it for every registered op, so adding an op needs no edit there.

The schema comes from the op's argument names (`Op.args`): `<op>(Tensor <arg>, ..., str group_name, *,
str? variant=None, str? config=None) -> Tensor`. The op declares the rest:
- `out_shape(inputs, world_size)`: the output's shape from the inputs' shapes alone (the fake
  implementation torch.compile, torch.export and FakeTensor run; dtype and device: the first input's).
- `extras`: named extra outputs (`Extra`), each a custom op `<op>_<name>` returning (out, extra):
  ag_gemm's `gathered` (all_gather(A), which a training step keeps for B's gradient).
- `backward` (`Backward`): the gradient in terms of other ops' custom ops (`torch.ops.autofuse.*`) and of
  the op's own `Helper` custom ops, or None for an inference-only op (inputs that require grad raise
  `InferenceOnly`).
- `handle` (`HandleLayout`): for an op whose last output is a handle (`Op.outputs`, e.g. moe_dispatch's),
  how it travels through custom ops: its tensors become outputs of this op's custom op and inputs of its
  partner's (`Tensor <arg>_<name>` each, then `str <arg>_key`), so autograd and torch.compile see them.
  An op of several outputs returns them as `Outputs` from the library path too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

Shape = Callable[[tuple, int], tuple]  # (inputs, world size) -> shape


class InferenceOnly(RuntimeError):
    """An inference-only op was called on inputs that require grad."""


def refuse_grad(op: str, tensors: tuple) -> None:
    """Raise InferenceOnly, naming `op` and the (name, tensor) inputs that require grad."""
    names = ", ".join(f"{n} {tuple(t.shape)}" for n, t in tensors if t.requires_grad)
    raise InferenceOnly(
        f"autofuse.{op} is inference only (it has no backward), but {names} require grad: call it under "
        "torch.no_grad() / torch.inference_mode(), or pass tensors that do not require grad (.detach()).")


@dataclass(frozen=True)
class Extra:
    """A named extra output: `shape(inputs, world_size)` for the fake implementation, and
    `take(runner, inputs)`: a fresh tensor computed after the call from the runner that ran it (its
    buffers where it holds the value whole) and the call's inputs. Not differentiable.
    `for_backward(inputs)`: whether a call that records autograd takes `<op>_<name>` instead of the
    plain custom op, so its backward finds the extra (`Backward.keep`'s `extras`); None: never."""

    shape: Shape
    take: Callable[[Any, tuple], torch.Tensor]
    for_backward: Callable[[tuple], bool] | None = None


@dataclass(frozen=True)
class HandleLayout:
    """A handle output's tensors through custom ops: `names` in order; `fake(inputs, world_size)`: (shape,
    dtype) per name, from the producing call's inputs (the fake implementation); `key(inputs, world_size)`:
    the handle's key (text: the partner's custom op takes it as a str), from the same."""

    names: tuple[str, ...]
    fake: Callable[[tuple, int], Sequence[tuple[tuple, Any]]]
    key: Callable[[tuple, int], str]


@dataclass(frozen=True)
class Helper:
    """A computation a backward runs as one opaque custom op, `torch.ops.autofuse.<name>` (e.g. MoE's
    bulk-synchronous backward all-to-alls): `fn` its real implementation (the schema is inferred from its
    type hints), `fake(*args)` its outputs' shapes for torch.compile. The custom-op layer registers it
    beside the op that declares it, so op modules define no custom ops themselves."""

    name: str
    fn: Callable[..., Any]
    fake: Callable[..., Any]


@dataclass(frozen=True)
class Backward:
    """The gradient of an op in terms of other ops.

    - `keep(inputs, needs, extras)`: what backward needs, by name: tensors (kept with the autograd
      context; None where not needed) and plain values. `needs`: which inputs need a gradient;
      `extras`: the extra outputs of this call by name (empty for the plain custom op).
    - `grads(kept, grad, needs, group_name)`: one gradient (or None) per input.

    Ops with handles (taken or made, `CustomOp.handle`): `inputs` are the op's arguments (a handle as a
    `Handle`), `needs` and the gradients returned run over the custom op's inputs (a handle argument
    spans its tensors, then its key), `extras` holds the handle this call made (by its output name), and
    `grad` is the tuple of every custom-op output's gradient (tensor outputs, then the handle's tensors;
    None where none flows).
    """

    keep: Callable[[tuple, tuple[bool, ...], Mapping[str, torch.Tensor]], dict[str, Any]]
    grads: Callable[[dict[str, Any], torch.Tensor, tuple[bool, ...], str], tuple]
    helpers: tuple[Helper, ...] = ()


@dataclass(frozen=True)
class CustomOp:
    """An op's custom-op declaration (see the module doc)."""

    out_shape: Shape
    backward: Backward | None = None
    extras: Mapping[str, Extra] = field(default_factory=dict)
    handle: HandleLayout | None = None

    @property
    def inference_only(self) -> bool:
        return self.backward is None
