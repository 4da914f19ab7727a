"""The public entry points and the hot path: `autofuse.<op>(...)`, `call`, `explain`, `rebuild`.

Hot path (a cached problem): a key from the op name, the group and each input's shape, dtype,
device and contiguity, one dict lookup, the runner call. No I/O, no collective, no policy walk.
Miss path: decide (dispatch/decide.py), agree with every rank (dispatch/agreement.py), confirm a
predicted decision by measuring (dispatch/confirm.py), build the runner, cache it, run it.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from autofuse.core import settings
from autofuse.core.op import Config, InvalidConfig, InvalidInput, Op, config_key
from autofuse.dispatch.agreement import agree
from autofuse.dispatch.choice import Choice
from autofuse.dispatch.decide import confirm, decide
from autofuse.dispatch.state import STATE, Entry, op_of, world_of


class CaptureMiss(RuntimeError):
    """A problem was first seen inside CUDA-graph capture, where dispatch cannot decide it."""


def call(op: str | Op, *args: Any, group: Any = None, variant: str | None = None, config: Config | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Run `op` on this rank's inputs with the chosen (or overridden) variant; every rank must call it.

    `group`: a torch.distributed process group (None: the default group) or an autofuse World.
    """
    name = op if op.__class__ is str else op.name
    key = key_of(name, group, variant, config, args)
    entry = STATE.cache.get(key)
    if entry is None:
        return miss(key, op, args, group, variant, config, out)
    STATE.stats.hits += 1
    return run(entry, args, out)


_ENTRY_TEMPLATE = """
def {name}({params}, group=None, *, variant=None, config=None, out=None):
    key = ({name!r}, id(group), variant, None if config is None else config_key(config), {key})
    entry = cache.get(key)
    if entry is None:
        return miss(key, {name!r}, ({params},), group, variant, config, out)
    stats.hits += 1
    result = entry.runner({params}) if out is None else entry.runner({params}, out=out)
    if entry.check:
        check(entry, result)
    return result
"""


def entry_point(name: str) -> Callable[..., torch.Tensor]:
    """The public function `autofuse.<name>`, generated from the op's argument names (`Op.args`).

    Its body is the hot path: one key built inline from each argument's shape, dtype, device and
    contiguity, one dict lookup, the runner call. `key_of` builds the same key for `call`/`explain`.
    """
    op = op_of(name)
    params = ", ".join(op.args)
    key = " ".join(f"{a}.shape, {a}.dtype, {a}.device, {a}.is_contiguous()," for a in op.args)
    namespace = {"cache": STATE.cache, "miss": miss, "check": check, "stats": STATE.stats, "config_key": config_key,
                 "__name__": __name__}  # warnings skip this frame as autofuse's own (state.user_stacklevel)
    exec(_ENTRY_TEMPLATE.format(name=name, params=params, key=key), namespace)  # noqa: S102 - our own template
    fn = namespace[name]
    fn.__doc__ = (f"{op.description}.\n\nEvery rank of `group` (None: the default group) calls it with its own "
                  f"({params}); `variant=`/`config=` force a choice, `out=` is written in place.")
    fn.__module__ = "autofuse"
    fn.__qualname__ = name
    return fn


def explain(op: str | Op, *args: Any, group: Any = None, variant: str | None = None,
            config: Config | None = None) -> Choice:
    """Which variant and config `op(*args)` runs with, and why; builds nothing, no collective.

    Returns this process's cached decision where there is one; `str()` of the result reads well.
    """
    name = op if isinstance(op, str) else op.name
    entry = STATE.cache.get(key_of(name, group, variant, config, args))
    if entry is not None:
        c = entry.choice
        return Choice(c.op, c.problem, c.variant, dict(c.config), c.reason, c.basis, c.policy_path, c.config_source,
                      True, confirmation=c.confirmation, gain=c.gain)
    return decide(op_of(op), world_of(group), args, variant, config)


def runner_of(op: str | Op, *args: Any, group: Any = None, variant: str | None = None,
              config: Config | None = None) -> Any:
    """The runner a cached call of `op(*args)` runs (to call it without dispatch, e.g. to time dispatch).

    Raises LookupError if these shapes have not been called yet in this process.
    """
    name = op if isinstance(op, str) else op.name
    entry = STATE.cache.get(key_of(name, group, variant, config, args))
    if entry is None:
        raise LookupError(f"autofuse.{name}: no cached decision for these arguments; call it once first")
    return entry.runner


def rebuild(group: Any = None) -> None:
    """Clear every fault of `group`'s workspaces so they compute again (collective: every rank calls it).

    After a FlagTimeout or WorkspaceAborted, fix what made a rank late or absent, then call this on
    every rank; cached decisions stay.
    """
    from autofuse.comm.workspace import workspaces

    world = world_of(group)
    for ws in workspaces(world):
        ws.rebuild()
    world.sync()


def reset() -> None:
    """Forget cached decisions, runners, Worlds, policies, warnings and counters (tests)."""
    STATE.reset()


def key_of(name: str, group: Any, variant: str | None, config: Config | None, args: tuple) -> tuple:
    """The cache key: op, group, overrides, and each input's shape, dtype, device and contiguity.

    Contiguity rather than strides: ops that need contiguous inputs reject the others in
    `problem_of` (a new key is a miss, so it runs); ops that take strides read them per call.
    """
    key = [name, id(group), variant, None if config is None else config_key(config)]
    for a in args:
        if isinstance(a, torch.Tensor):
            key += (a.shape, a.dtype, a.device, a.is_contiguous())
        else:
            key.append(a)
    return tuple(key)


def run(entry: Entry, args: tuple, out: torch.Tensor | None) -> torch.Tensor:
    result = entry.runner(*args) if out is None else entry.runner(*args, out=out)
    if entry.check:
        check(entry, result)
    return result


def miss(key: tuple, op: str | Op, args: tuple, group: Any, variant: str | None, config: Config | None,
         out: torch.Tensor | None) -> torch.Tensor:
    """A problem this process has not seen: decide, agree, confirm, build, cache, run."""
    op = op_of(op)
    if capturing(args):
        raise CaptureMiss(
            f"autofuse.{op.name}: these shapes were first seen inside CUDA-graph capture; dispatch must build "
            "the kernels, allocate heap workspace and check that every rank chose the same variant, which "
            "cannot run during capture. Call it once with the same shapes before capturing (warm-up).")
    STATE.stats.misses += 1
    world = world_of(group)
    try:
        choice, invalid = decide(op, world, args, variant, config), None
    except (InvalidInput, InvalidConfig, ValueError) as exc:
        choice, invalid = None, exc
    agree(world, op.name, choice, invalid)
    if choice.candidates:
        choice = confirm(world, op, choice, args)
    runner = op.variant(choice.variant).build(world, choice.problem, choice.config)
    STATE.stats.builds += 1
    every = bool(getattr(runner, "workspaces", ())) and (world.device.type == "cpu" or settings.check_every_call())
    entry = Entry(runner, choice, every)
    STATE.cache[key] = entry
    result = runner(*args) if out is None else runner(*args, out=out)
    check(entry, result)
    return result


def check(entry: Entry, result: torch.Tensor) -> None:
    """Read the fault record of the entry's workspaces (a device sync) and raise what it holds, leaving NaN
    in `result` (the call's output) first: a call that raises never leaves values in it."""
    runner = entry.runner
    if not getattr(runner, "workspaces", ()):
        return
    if runner.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    STATE.stats.checks += 1
    runner.check(result)


def capturing(args: tuple) -> bool:
    """Whether CUDA-graph capture is under way on the current stream (only asked for CUDA inputs)."""
    return any(isinstance(a, torch.Tensor) and a.is_cuda for a in args) and torch.cuda.is_current_stream_capturing()
