"""Runner: one built (problem, variant, config) on one rank, called with this rank's inputs.

Every variant's runner derives from `Runner`, which does what all of them need on every call,
cheaply (this is the hot path): check the inputs against what it was built for (shape, dtype,
device, layout), make or check `out`, refuse a workspace that saw a fault (leaving NaN in `out`),
then `launch` (which leaves NaN in `out` where it raises). A
subclass only implements `launch(*inputs, out)`. Calls may be captured in a CUDA graph: runners
keep their epochs on the device and allocate nothing per call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from autofuse.core.op import InvalidInput, Problem
from autofuse.comm.workspace import Workspace

if TYPE_CHECKING:
    from autofuse.comm.world import World

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


class Runner:
    """Base of every variant's runner: call checks, `out` handling, fault refusal, then `launch`."""

    def __init__(self, world: World, problem: Problem, inputs: Sequence[TensorSpec], out: TensorSpec,
                 workspaces: Sequence[Workspace] = ()):
        for spec in (*inputs, out):
            if spec.layout not in LAYOUTS:
                raise ValueError(f"unknown layout {spec.layout!r} for {spec.name}: use one of {LAYOUTS}")
        self.world, self.problem = world, problem
        self.device = world.device
        self.in_specs, self.out_spec = tuple(inputs), out
        self.workspaces = tuple(workspaces)

    def __call__(self, *inputs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        specs, device = self.in_specs, self.device
        if len(inputs) != len(specs) or not all(s.fits(t, device) for s, t in zip(specs, inputs)):
            self._reject(inputs)
        spec = self.out_spec
        if out is None:
            out = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        elif not spec.fits(out, device):
            raise InvalidInput(f"{self.problem.op}: out: {spec.problem_with(out, device)} (out was not written)")
        for ws in self.workspaces:
            if ws.faulty():
                out.fill_(math.nan)  # a refused call leaves NaN, never the previous call's values
                ws.refuse_if_faulty()
        try:
            self.launch(*inputs, out=out)
        except Exception:
            out.fill_(math.nan)  # a launch that raises (a collective a peer stopped) leaves NaN too
            raise
        return out

    def launch(self, *inputs: torch.Tensor, out: torch.Tensor) -> None:
        """Compute into `out` (subclasses)."""
        raise NotImplementedError

    def gathered_input(self) -> torch.Tensor | None:
        """An all-gathering runner's gathered A of its last call (M x K, row-major), valid until its next
        call, where it holds it whole (autofuse/library keeps a copy for B's gradient); else None."""
        return None

    def check(self, out: torch.Tensor | None = None) -> None:
        """Raise the fault any of this runner's workspaces recorded (synchronises with the device).

        `out`: the output of the call just made; on a fault it is filled with NaN before raising,
        since a kernel that finished before a peer gave up may have written finite values the
        fault makes meaningless (data of a peer's other call, or this rank's part alone)."""
        try:
            for ws in self.workspaces:
                ws.check()
        except Exception:
            if out is not None:
                out.fill_(math.nan)
            raise

    def _reject(self, inputs: Sequence[Any]) -> None:
        if len(inputs) != len(self.in_specs):
            raise InvalidInput(f"{self.problem.op}: takes {len(self.in_specs)} inputs "
                               f"({', '.join(s.name for s in self.in_specs)}), got {len(inputs)}")
        for spec, t in zip(self.in_specs, inputs):
            why = spec.problem_with(t, self.device)
            if why:
                raise InvalidInput(f"{self.problem.op}: built for {self.problem.key}: {why}")
