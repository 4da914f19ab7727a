"""Deciding a new problem: the variant= argument, AUTOFUSE_VARIANT, an earlier confirmation on this
machine, then the policy; and confirming a predicted decision by measuring it on first use."""
from __future__ import annotations

import warnings
from typing import Any

import torch

from autofuse.core import settings
from autofuse.core.op import Config, InvalidConfig, InvalidInput, Op, config_key
from autofuse.core.runner import Handle
from autofuse.comm.world import World
from autofuse.dispatch import online
from autofuse.dispatch.choice import Choice
from autofuse.dispatch.policy_files import policy_for
from autofuse.dispatch.state import STATE, user_stacklevel


def decide(op: Op, world: World, args: tuple, variant: str | None, config: Config | None,
           mode: str | None = None) -> Choice:
    """The Choice for `op(*args)` on this rank (validates the inputs; no collective, builds nothing), decided for
    timing `mode` (None: AUTOFUSE_MODE's; a training call's is AUTOFUSE_TRAIN_MODE's): the policy fitted in
    it, confirmations made in it."""
    mode = mode or settings.mode(world.device.type)
    choice = _decide(op, world, args, variant, config, mode)
    choice.mode = mode
    return choice


def _decide(op: Op, world: World, args: tuple, variant: str | None, config: Config | None, mode: str) -> Choice:
    for name, a in zip(op.args, args):
        if name in op.handles:
            if not isinstance(a, Handle):
                raise InvalidInput(f"autofuse.{op.name}: {name} must be a Handle made by autofuse.{op.partner}, "
                                   f"got {type(a).__name__}")
        elif not isinstance(a, torch.Tensor):
            raise InvalidInput(f"autofuse.{op.name}: {name} must be a tensor, got {type(a).__name__}")
    problem = op.problem_of(world, *args)
    available = [n for n, v in op.variants.items() if v.available(world)]
    if variant is None and config is not None:
        raise ValueError(f"autofuse.{op.name}: config= needs variant= (a config belongs to one variant)")
    basis, reason = "override", f"override: variant={variant!r} argument"
    if variant is None:
        variant = settings.variant_override(op.name)
        basis, reason = "env", f"override: AUTOFUSE_VARIANT={settings.variant_text()}"
    policy = policy_for(world, mode)
    if variant is not None:
        v = op.variant(variant)
        if variant not in available:
            raise ValueError(f"autofuse.{op.name}: variant {variant!r} ({reason}) is not available on "
                             f"{world.device.type} ({v.unavailable(world)}); available: {available}")
        if config is None:
            config, config_source = policy.config_for(problem, variant, op)
            if config is None:
                raise InvalidConfig(f"{op.name}.{variant}: no config accepts {problem.key}")
        else:
            config, config_source = dict(config), "override: config= argument"
            why = v.check(problem, config)
            if why:
                raise InvalidConfig(f"{op.name}.{variant} cannot run {problem.key} with {config_key(config)}: {why}")
        return Choice(op.name, problem, variant, config, reason, basis, policy.path, config_source)
    confirmed = online.confirmed_choice(op, world, problem, available, policy, mode)
    if confirmed is not None:
        return confirmed
    choice = policy.decide(problem, op, available)
    if not policy.needs_confirmation(problem, choice):
        return choice
    if settings.online(world.device.type, world.shares_gpu):
        # twice as many as are timed: the later ones stand in for candidates that cannot run here; torch's op too
        choice.candidates, choice.keep = policy.confirmation_candidates(problem, op, available, settings.confirm_k())
    elif problem.op in policy.stale_ops:
        return bsp_fallback(op, problem, policy, f"fallback: {policy.stale_ops[problem.op]}, and confirmation on "
                            "first use is off (AUTOFUSE_ONLINE=0, the CPU emulation or ranks sharing a GPU): bsp")
    elif getattr(policy, "other_host", False):
        choice.reason += ("; but confirmation on first use is off (AUTOFUSE_ONLINE=0, the CPU emulation or ranks "
                          "sharing a GPU): used unconfirmed")
    return choice


def confirm(world: World, op: Op, choice: Choice, args: tuple) -> Choice:
    """Measure BSP and the choice's candidates on `args` (every rank), keep the fastest correct one,
    record the measurements in this machine's online store."""
    from autofuse.dispatch.confirm import confirm as measure_candidates

    mode = choice.mode or settings.mode(world.device.type)
    policy: Any = policy_for(world, mode)
    bsp_config, _ = policy.config_for(choice.problem, "bsp", op)
    result = measure_candidates(world, op, choice.problem, args, choice.candidates, mode,
                                bsp_config=bsp_config, keep=choice.keep or settings.confirm_k())
    STATE.stats.confirmations += 1
    if world.rank == 0:
        online.record(world, choice.problem, result)
    online.remember(world, choice.problem, result.timed, mode)
    stale = "stale: confirmed: " if choice.reason.startswith("stale:") else ""
    return Choice(op.name, choice.problem, result.variant, result.config,
                  f"{stale}{result.describe()}; the policy said: [{choice.basis}] {choice.reason}", "confirmed",
                  choice.policy_path, "measured on first use", confirmation=result, mode=mode)


def bsp_fallback(op: Op, problem: Any, policy: Any, reason: str) -> Choice:
    """The Choice that runs `problem` on bsp (at the policy's bsp config, if it has one) because of `reason`."""
    config, source = policy.config_for(problem, "bsp", op)
    return Choice(op.name, problem, "bsp", config or {}, reason, "fallback", policy.path, source)


class HeapFallback(UserWarning):
    """A chosen variant's workspaces did not fit in the symmetric heap: its problem runs bsp instead."""


class WorldFallback(UserWarning):
    """A chosen variant this World cannot run (`Variant.refuses`: e.g. copy-engine pulls on a heap without peer
    views), though the policy's machine could: its problem runs bsp instead."""


FORCED = ("override", "env")  # Choice bases a user set: never replaced behind their back


def build(world: World, op: Op, choice: Choice) -> tuple[Any, Choice]:
    """Build the runner of `choice`, or where the symmetric heap cannot hold its variant's workspaces
    (HeapFull), give a variant dispatch chose (policy, measurement, confirmation) way to bsp, with one warning
    naming AUTOFUSE_HEAP_SIZE: the model runs, and the shape's choice says why (`explain`); likewise, with a
    WorldFallback warning, a variant this World refuses (`Variant.refuses`: its heap, its devices). A variant
    the user forced (variant=, AUTOFUSE_VARIANT), or bsp itself, raises instead.

    The heap is symmetric: every rank makes the same allocations in the same order (each one's offset is
    checked across the ranks), so every rank of the group finds it full at the same allocation, before the
    workspace's collective, and takes the same branch here without a word to its peers.
    """
    from autofuse.comm.heap import HeapFull

    try:
        return op.variant(choice.variant).build(world, choice.problem, choice.config), choice
    except HeapFull as exc:
        why = str(exc).splitlines()[0]
        if choice.basis in FORCED or choice.variant == "bsp":
            raise HeapFull(f"autofuse.{op.name}: {choice.variant} cannot run {choice.problem.key} here: {why}") from exc
        because, kind = (f"{choice.variant}'s workspaces do not fit in the symmetric heap ({why}); bsp instead (a larger "
                         "AUTOFUSE_HEAP_SIZE, alike on every rank, lets it run)"), HeapFallback
    except InvalidConfig as exc:
        if choice.basis in FORCED or choice.variant == "bsp":
            raise
        because, kind = f"this World refuses {choice.variant} ({exc}); bsp instead", WorldFallback
    fallback = bsp_fallback(op, choice.problem, policy_for(world, choice.mode or None),
                            f"fallback: {because} of [{choice.basis}] {choice.reason}")
    fallback.mode = choice.mode
    warnings.warn(f"autofuse.{op.name} {choice.problem.key}: {fallback.reason}", kind, stacklevel=user_stacklevel())
    return op.variant("bsp").build(world, choice.problem, fallback.config), fallback
