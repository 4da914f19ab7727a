"""What dispatch keeps per process, in one place: cached decisions, Worlds, ops, policies, counters.

`STATE` is the only instance. `reset()` forgets everything (the agreement rounds' numbers live in
autofuse/comm/rounds.py: store keys are never reused within a job). The generated entry points bind `STATE.cache` and `STATE.stats`
when made, so those two objects are cleared in place, never replaced.
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

from autofuse.core.op import Op
from autofuse.comm.world import World
from autofuse.dispatch.choice import Choice


@dataclass
class Stats:
    """Counters of this process's dispatch (tests assert on them; `reset()` zeroes them)."""

    hits: int = 0
    misses: int = 0
    agreements: int = 0
    policy_loads: int = 0
    builds: int = 0
    checks: int = 0
    confirmations: int = 0


class Entry:
    """A cached decision: the runner, why it was chosen, whether to read the fault record every call."""

    __slots__ = ("runner", "choice", "check")

    def __init__(self, runner: Any, choice: Choice, check: bool):
        self.runner, self.choice, self.check = runner, choice, check


@dataclass
class State:
    cache: dict[tuple, Entry] = field(default_factory=dict)
    worlds: dict[int, tuple[Any, World]] = field(default_factory=dict)  # id(group) -> (group, World)
    ops: dict[str, Op] = field(default_factory=dict)
    policies: dict[tuple[str, str], Any] = field(default_factory=dict)  # (device kind, timing mode) -> Policy
    forced_policy: Any = None  # set_policy's Policy
    warned: set[str] = field(default_factory=set)
    confirmed: dict[tuple[str, str], dict[str, dict]] = field(  # (kind, mode) -> problem key -> {variant: (us, config)}
        default_factory=dict)
    train_modes: dict[str, str | None] = field(default_factory=dict)  # kind -> the mode training calls decide in,
    # None where it is the process's own (autofuse.dispatch.entry.training_mode)
    train_mode: str | None = None  # set_train_mode's mode (None: AUTOFUSE_TRAIN_MODE)
    stats: Stats = field(default_factory=Stats)

    def reset(self) -> None:
        """Forget cached decisions, runners, Worlds, policies, warnings and counters (tests)."""
        for d in (self.cache, self.worlds, self.ops, self.policies, self.warned, self.confirmed, self.train_modes):
            d.clear()
        self.forced_policy = self.train_mode = None
        for f in fields(self.stats):
            setattr(self.stats, f.name, 0)


STATE = State()


# Packages whose frames lie between the user's call and dispatch: autofuse's own (its generated entry
# points bear autofuse's name) and torch's custom-op, autograd and torch.compile machinery on the
# library path, whose generated code (torch.fx graphs, AOTAutograd wrappers) runs without a __name__.
NOT_THE_USER = ("autofuse", "torch")


def _not_the_user(frame: Any) -> bool:
    name = frame.f_globals.get("__name__")
    return name is None or str(name).split(".")[0] in NOT_THE_USER


def user_stacklevel() -> int:
    """The `stacklevel` that makes warnings.warn, called by the caller of this function, name the first
    frame outside autofuse and torch (the user's call of `autofuse.<op>`, not autofuse's own code, the
    generated entry point, nor the torch frames of a call that requires grad or runs compiled)."""
    level, frame = 2, sys._getframe(2)  # stacklevel k names the frame k - 1 above the caller of warnings.warn
    while frame is not None and _not_the_user(frame):
        level, frame = level + 1, frame.f_back
    return level


def warn_once(text: str, category: type[Warning] = RuntimeWarning) -> None:
    """Warn with `text` once per process, at the user's line that called autofuse."""
    if text not in STATE.warned:
        STATE.warned.add(text)
        warnings.warn(text, category, stacklevel=user_stacklevel())


def op_of(op: str | Op) -> Op:
    """The Op itself, or the registered op called `op` (NotImplementedError if not installed)."""
    if not isinstance(op, str):
        return op
    if op not in STATE.ops:
        from autofuse.core import registry

        try:
            STATE.ops[op] = registry.get(op)
        except ModuleNotFoundError as exc:
            raise NotImplementedError(f"autofuse.{op} is not available in this installation ({exc})") from None
    return STATE.ops[op]


def world_of(group: Any) -> World:
    """The World of a process group (None: the default group), or `group` itself if it is one."""
    if isinstance(group, World):
        return group
    got = STATE.worlds.get(id(group))
    if got is None:
        got = STATE.worlds[id(group)] = (group, World.from_group(group))  # holding `group` keeps its id unique
    return got[1]
