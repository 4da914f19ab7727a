"""Every rank agrees on a new problem before anything is built or launched (DESIGN.md, dispatch).

Each rank publishes its validation outcome (its inputs, and the settings every rank must share:
`settings.lockstep`) and a hash of (problem, variant, config, candidates) in the group's next round
(comm/rounds.py: the job's key-value store) and waits, bounded (the flag-wait budget + 2 s), for all
the others. Any rank's invalid input or setting raises on every rank naming that rank; differing
choices or settings raise DispatchMismatch naming them. A rank that raises before it reaches the
agreement (a check of the library path, a setting read there) publishes its failure in the same
round (`tell`), so nothing pairs the wrong calls. Peers that do not come within the round's grace
(1 s) are stopped where they may wait, inside a call they cached (their flag waits, their gloo
collective): they publish that and raise PeerRefused / CollectiveTimeout naming this rank and
what it did, and this rank raises naming them, all within seconds. Only a rank that never answers
(it died, or hangs elsewhere) leaves the others to the wait's bound; a rank left alone takes the
round back, so it never shifts the pairing of later rounds. Never NCCL: a collective would block
forever if a rank never comes.
"""
from __future__ import annotations

import hashlib
from typing import NoReturn

from autofuse.comm import rounds, stops
from autofuse.core import settings
from autofuse.core.op import InvalidInput, config_key
from autofuse.comm.status import CollectiveTimeout, FlagTimeout, WorkspaceAborted
from autofuse.comm.world import World
from autofuse.dispatch.choice import Choice
from autofuse.dispatch.state import STATE


class DispatchMismatch(RuntimeError):
    """Ranks chose different variants/configs, saw different problems, or did not all take part."""


COLLECTIVE = (FlagTimeout, WorkspaceAborted, CollectiveTimeout)  # every rank raises these together


def agree_timeout_s(device_type: str) -> float:
    """How long a rank waits for the others to take part in an agreement: the flag-wait budget + 2 s,
    so a rank left alone fails within seconds of its peers' flag timeouts."""
    return settings.wait_timeout_s(device_type) + 2.0


def agree(world: World, op: str, choice: Choice | None, invalid: Exception | None) -> None:
    """Publish this rank's outcome, wait for every rank's; raise the same error on every rank if any
    rank's input was invalid or the choices differ."""
    shared = None
    if invalid is None:
        try:
            shared = settings.lockstep(world.device.type)
        except settings.SettingError as exc:
            invalid = exc
    if invalid is not None:
        mine = {"ok": False, "why": f"{type(invalid).__name__}: {invalid}"}
    else:
        cands = ";".join(f"{v}:{config_key(c)}" for v, c in choice.candidates)
        mine = {"ok": True, "hash": hashlib.sha256(
            f"{choice.problem.key}|{choice.variant}|{config_key(choice.config)}|{cands}".encode()).hexdigest()[:16],
            "said": f"{choice.variant} {config_key(choice.config)} for {choice.problem.key} "
                    f"([{choice.basis}] {choice.reason}; decided for {choice.mode or '?'} timing)", "settings": shared}
    try:
        every = exchange(world, op, mine)
    except DispatchMismatch as exc:
        raise told(invalid if invalid is not None else exc) from None  # alone: this rank's own reason if any
    stopped = [r for r, e in enumerate(every) if e.get("launched")]
    note = (f"\nRank(s) {stopped} were stopped inside a call they had cached, so every rank's workspaces of this "
            "group refuse calls until autofuse.rebuild(group) runs on every rank.") if stopped else ""
    if invalid is not None:
        raise told(invalid)  # this rank's own reason; the others raise naming this rank
    bad = [(r, e["why"]) for r, e in enumerate(every) if not e["ok"] and not e.get("launched")]
    if bad:
        lines = "\n".join(f"  rank {r}: {why}" for r, why in bad)
        raise told(InvalidInput(f"autofuse.{op}: invalid input or settings on {len(bad)} of {world.size} ranks, so "
                                f"no rank ran it:\n{lines}{note}"))
    if stopped:
        raise told(DispatchMismatch(
            f"autofuse.{op}: rank(s) {stopped} were in another call (one they had cached: other shapes or "
            f"arguments than this rank's first call of {choice.problem.key}, or a call this rank skipped), where "
            f"they were stopped, so nothing was launched.{note}"))
    differ = sorted({k for e in every for k in e["settings"] if e["settings"][k] != every[0]["settings"].get(k)})
    if differ:
        lines = "\n".join(f"  rank {r}: " + ", ".join(f"{k}={e['settings'][k]!r}" for k in differ)
                          for r, e in enumerate(every))
        raise told(DispatchMismatch(f"autofuse.{op}: ranks run with different settings, so nothing was launched:\n"
                                    f"{lines}\nGive every rank the same AUTOFUSE_* environment."))
    if len({e["hash"] for e in every}) > 1:
        lines = "\n".join(f"  rank {r}: {e['said']}" for r, e in enumerate(every))
        raise told(DispatchMismatch(
            f"autofuse.{op}: ranks disagree on what to run, so nothing was launched:\n{lines}\n"
            "Give every rank the same policy (AUTOFUSE_POLICY / models/), the same AUTOFUSE_VARIANT and "
            "variant=/config= arguments, the same input shapes, and inputs that require grad on every rank or "
            "on none (a training call is decided for AUTOFUSE_TRAIN_MODE's timing)."))


def told(exc: BaseException) -> BaseException:
    """Mark `exc` as shared with every rank (it went through a round), so `tell` does not share it again."""
    try:
        exc.autofuse_told = True
    except AttributeError:  # an exception class with __slots__: telling it again costs one more round
        pass
    return exc


def tell(world: World, op: str, exc: BaseException) -> NoReturn:
    """Raise `exc`, which this rank raised before it took part in a call of `op` (a check on the library
    path, a setting, an argument): first publish it in the group's next round, so that peers waiting in a
    first call raise at once naming this rank, and peers inside a call they cached are stopped there.
    Errors every rank raises together (faults, those a round already shared) are raised as they are."""
    if getattr(exc, "autofuse_told", False) or isinstance(exc, COLLECTIVE) or not isinstance(exc, Exception):
        raise exc
    agree(world, op, None, exc)
    raise exc  # agree raised it already; for type checkers


def exchange(world: World, op: str, mine: dict) -> list[dict]:
    """One JSON value per rank, in rank order: a round through the job's store (comm/rounds.py), bounded;
    peers that do not come within its grace are stopped where they wait, inside a call."""
    if world.size == 1:
        return [mine]
    n = rounds.publish(world, mine)
    STATE.stats.agreements += 1
    timeout = agree_timeout_s(world.device.type)
    every = stops.wait(world, n, timeout)
    if every is None:
        s = rounds.store()
        present = [r for r, k in enumerate(rounds.keys(world, n)) if s.check([k])]
        missing = [r for r in range(world.size) if r not in present]
        if present == [world.rank]:
            # this round did not happen: take it back, so this rank's next agreement pairs with the others'
            # next one (they never entered this round: they are elsewhere, or dead)
            rounds.take_back(world, n)
        raise DispatchMismatch(
            f"autofuse.{op}: rank(s) {missing} did not take part in the first call of this problem within "
            f"{timeout:.0f} s, nor answered when this rank stopped the calls they may wait in: they skipped the "
            "call, hang elsewhere or died.")
    stops.settle(world, n, every, timeout)
    if n > 0:  # every rank has published this round, so all have read the previous one
        rounds.store().delete_key(f"{rounds.prefix(world, n - 1)}/{world.rank}")
    return every
