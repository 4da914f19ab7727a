"""Runner: one built (problem, variant, config) on one rank, called with this rank's inputs.

Every variant's runner derives from `Runner`, which does what all of them need on every call,
cheaply (this is the hot path): check the inputs against what it was built for (shape, dtype,
device, layout), make or check `out`, refuse a workspace that saw a fault (leaving NaN in `out`),
then `launch` (which leaves NaN in `out` where it raises). A
subclass only implements `launch(*inputs, out)`. Calls may be captured in a CUDA graph: runners
keep their epochs on the device and allocate nothing per call.

Several named outputs (`Op.outputs`): a runner built with a list of output specs makes one tensor
per spec and returns them as `Outputs` (a tuple, each also read by its name); `launch` gets the
same object as `out`. A refused or failed call leaves NaN in floating outputs and -1 in integer ones.
A `Handle` is what one op's call hands to its partner's (`Op.partner`, e.g. MoE dispatch's routing
for its combine): a host object with a static `key` and the tensors it carries; as an output it is
made by the runner (a `HandleSpec`), as an input it is checked against the key the runner was
built for (dispatch's cache key reads the same `key`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from autofuse.core.problem import InvalidInput, Problem

if TYPE_CHECKING:
    from autofuse.core.contracts import World, Workspace

LAYOUTS = ("contiguous", "dense", "rows")


@dataclass(frozen=True)
class TensorSpec:
    """What one argument must be. layout: 'contiguous' (row-major), 'dense' (row- or column-major
    2-D), or 'rows' (unit stride along the last dimension only, e.g. a slice of a bigger cache)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str = "contiguous"

    def problem_with(self, t: Any, device: torch.device) -> str | None:
        """Why `t` does not fit this spec (None if it does)."""
        if not isinstance(t, torch.Tensor):
            return f"{self.name} must be a tensor, got {type(t).__name__}"
        if tuple(t.shape) != self.shape or t.dtype != self.dtype or t.device != device:
            return (f"{self.name} must be {self.shape} {self.dtype} on {device}, got {tuple(t.shape)} {t.dtype} "
                    f"on {t.device}")
        if self.layout == "contiguous" and not t.is_contiguous():
            return f"{self.name} must be contiguous (row-major); call .contiguous()"
        if self.layout == "dense" and not (t.is_contiguous() or t.t().is_contiguous()):
            return f"{self.name} must be row- or column-major dense (strides {t.stride()})"
        if self.layout == "rows" and t.stride(-1) != 1:
            return f"{self.name} needs unit stride along its last dimension (strides {t.stride()})"
        return None

    def fits(self, t: torch.Tensor, device: torch.device) -> bool:
        """The hot-path version of `problem_with` (no message)."""
        if t.__class__ is not torch.Tensor and not isinstance(t, torch.Tensor):
            return False
        if t.shape != self.shape or t.dtype != self.dtype or t.device != device:
            return False
        if self.layout == "contiguous":
            return t.is_contiguous()
        if self.layout == "rows":
            return t.stride(-1) == 1
        return t.is_contiguous() or t.t().is_contiguous()


class Handle:
    """What a call of one op hands to its partner's call: `key` (hashable, static: what the partner's
    problem and dispatch's cache key read, e.g. the producer's problem key) and `tensors` (buffers the
    partner's kernels read: the producer's own, so a CUDA graph replays with the same pointers)."""

    __slots__ = ("key", "tensors")

    def __init__(self, key: Any, **tensors: torch.Tensor):
        self.key, self.tensors = key, dict(tensors)

    def __repr__(self) -> str:
        return f"Handle({self.key!r}, {sorted(self.tensors)})"


@dataclass(frozen=True)
class HandleSpec:
    """A handle argument or output: a Handle whose key is `key`."""

    name: str
    key: Any
    layout: str = "contiguous"  # (no layout: kept so every spec reads alike)

    def problem_with(self, h: Any, device: torch.device) -> str | None:
        if not isinstance(h, Handle):
            return f"{self.name} must be a Handle (the partner op's output), got {type(h).__name__}"
        return None if h.key == self.key else f"{self.name} is a handle for {h.key!r}, this call needs {self.key!r}"

    def fits(self, h: Any, device: torch.device) -> bool:
        return isinstance(h, Handle) and h.key == self.key


class Outputs(tuple):
    """A runner's several outputs: a tuple in the specs' order, each also read by its name (`outs["x"]`)."""

    names: tuple[str, ...]

    def __new__(cls, names: Sequence[str], values: Sequence[Any]) -> "Outputs":
        self = super().__new__(cls, values)
        self.names = tuple(names)
        return self

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            try:
                return tuple.__getitem__(self, self.names.index(key))
            except ValueError:
                raise KeyError(f"no output {key!r}: outputs are {list(self.names)}") from None
        return tuple.__getitem__(self, key)


def _poison(out: Any) -> None:
    """Leave no value of a refused or failed call: NaN in floating outputs, -1 in integer ones."""
    for t in (out if isinstance(out, Outputs) else (out,)):
        if isinstance(t, torch.Tensor):
            t.fill_(math.nan if t.is_floating_point() or t.is_complex() else -1)


class Runner:
    """Base of every variant's runner: call checks, `out` handling, fault refusal, then `launch`."""

    def __init__(self, world: World, problem: Problem, inputs: Sequence[TensorSpec | HandleSpec],
                 out: TensorSpec | Sequence[TensorSpec | HandleSpec], workspaces: Sequence[Workspace] = ()):
        outs = (out,) if isinstance(out, TensorSpec) else tuple(out)
        for spec in (*inputs, *outs):
            if spec.layout not in LAYOUTS:
                raise ValueError(f"unknown layout {spec.layout!r} for {spec.name}: use one of {LAYOUTS}")
        self.world, self.problem = world, problem
        self.device = world.device
        self.in_specs, self.out_spec = tuple(inputs), outs[0]
        self.out_specs = outs if not isinstance(out, TensorSpec) else None  # None: one output (a tensor)
        self.workspaces = tuple(workspaces)

    def __call__(self, *inputs: Any, out: Any = None) -> Any:
        specs, device = self.in_specs, self.device
        if len(inputs) != len(specs) or not all(s.fits(t, device) for s, t in zip(specs, inputs)):
            self._reject(inputs)
        out = self._outputs(out) if self.out_specs is not None else self._output(out)
        for ws in self.workspaces:
            if ws.faulty():
                _poison(out)  # a refused call leaves NaN, never the previous call's values
                ws.refuse_if_faulty()
        try:
            self.launch(*inputs, out=out)
        except Exception:
            _poison(out)  # a launch that raises (a collective a peer stopped) leaves NaN too
            raise
        return out

    def _output(self, out: torch.Tensor | None) -> torch.Tensor:
        spec, device = self.out_spec, self.device
        if out is None:
            return torch.empty(spec.shape, dtype=spec.dtype, device=device)
        if not spec.fits(out, device):
            raise InvalidInput(f"{self.problem.op}: out: {spec.problem_with(out, device)} (out was not written)")
        return out

    def _outputs(self, out: Sequence[Any] | None) -> Outputs:
        """The named outputs: made (a handle output: a new Handle of its key, which `launch` fills with
        the runner's buffers) or the caller's `out=` (one per output, in order) checked."""
        specs, device = self.out_specs, self.device
        if out is None:
            out = [Handle(s.key) if isinstance(s, HandleSpec) else torch.empty(s.shape, dtype=s.dtype, device=device)
                   for s in specs]
        elif len(out) != len(specs):
            raise InvalidInput(f"{self.problem.op}: out= takes {len(specs)} outputs "
                               f"({', '.join(s.name for s in specs)}), got {len(out)} (out was not written)")
        else:
            for s, t in zip(specs, out):
                if not s.fits(t, device):
                    raise InvalidInput(f"{self.problem.op}: out {s.name}: {s.problem_with(t, device)} "
                                       "(out was not written)")
        return Outputs([s.name for s in specs], out)

    def launch(self, *inputs: Any, out: Any) -> None:
        """Compute into `out` (subclasses): a tensor, or `Outputs` for several named outputs."""
        raise NotImplementedError

    def check(self, out: Any = None) -> None:
        """Raise the fault any of this runner's workspaces recorded (synchronises with the device).

        `out`: the output of the call just made; on a fault it is filled with NaN before raising,
        since a kernel that finished before a peer gave up may have written finite values the
        fault makes meaningless (data of a peer's other call, or this rank's part alone)."""
        try:
            for ws in self.workspaces:
                ws.check()
        except Exception:
            if out is not None:
                _poison(out)
            raise

    def _reject(self, inputs: Sequence[Any]) -> None:
        if len(inputs) != len(self.in_specs):
            raise InvalidInput(f"{self.problem.op}: takes {len(self.in_specs)} inputs "
                               f"({', '.join(s.name for s in self.in_specs)}), got {len(inputs)}")
        for spec, t in zip(self.in_specs, inputs):
            why = spec.problem_with(t, self.device)
            if why:
                raise InvalidInput(f"{self.problem.op}: built for {self.problem.key}: {why}")
