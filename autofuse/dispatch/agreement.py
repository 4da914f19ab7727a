"""Every rank agrees on a new problem before anything is built or launched (DESIGN.md, dispatch).

Each rank publishes its validation outcome (its inputs, and the settings every rank must share:
`settings.lockstep`) and a hash of (problem, variant, config, candidates) through the job's
key-value store and waits, bounded (the flag-wait budget + 2 s), for all the others. Any rank's
invalid input or setting raises on every rank naming that rank; differing choices or settings raise
DispatchMismatch naming them; a rank that does not take part (it ran a cached call with other
shapes, or died) makes the others raise DispatchMismatch when the wait runs out, and they take the
round back (its sequence number and their keys), so a rank left alone never shifts the pairing of
later rounds. Never NCCL: a collective would block forever if a rank never comes.
"""
from __future__ import annotations

import datetime
import hashlib
import json

import torch.distributed as dist

from autofuse.core import settings
from autofuse.core.op import InvalidInput, config_key
from autofuse.comm.world import World
from autofuse.dispatch.choice import Choice
from autofuse.dispatch.state import STATE


class DispatchMismatch(RuntimeError):
    """Ranks chose different variants/configs, saw different problems, or did not all take part."""


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
                    f"([{choice.basis}] {choice.reason})", "settings": shared}
    try:
        every = exchange(world, op, mine)
    except DispatchMismatch:
        if invalid is not None:
            raise invalid from None  # alone on a first call: this rank's own reason is the one to read
        raise
    bad = [(r, e["why"]) for r, e in enumerate(every) if not e["ok"]]
    if invalid is not None:
        raise invalid  # this rank's own reason; the others raise naming this rank
    if bad:
        lines = "\n".join(f"  rank {r}: {why}" for r, why in bad)
        raise InvalidInput(f"autofuse.{op}: invalid input or settings on {len(bad)} of {world.size} ranks, so no "
                           f"rank ran it:\n{lines}")
    differ = sorted({k for e in every for k in e["settings"] if e["settings"][k] != every[0]["settings"].get(k)})
    if differ:
        lines = "\n".join(f"  rank {r}: " + ", ".join(f"{k}={e['settings'][k]!r}" for k in differ)
                          for r, e in enumerate(every))
        raise DispatchMismatch(f"autofuse.{op}: ranks run with different settings, so nothing was launched:\n{lines}\n"
                               "Give every rank the same AUTOFUSE_* environment.")
    if len({e["hash"] for e in every}) > 1:
        lines = "\n".join(f"  rank {r}: {e['said']}" for r, e in enumerate(every))
        raise DispatchMismatch(
            f"autofuse.{op}: ranks disagree on what to run, so nothing was launched:\n{lines}\n"
            "Give every rank the same policy (AUTOFUSE_POLICY / models/), the same AUTOFUSE_VARIANT and "
            "variant=/config= arguments, and the same input shapes.")


def exchange(world: World, op: str, mine: dict) -> list[dict]:
    """One JSON value per rank, in rank order, through the job's key-value store (bounded wait)."""
    if world.size == 1:
        return [mine]
    store = dist.distributed_c10d._get_default_store()
    group = (world.group if world.group is not None else dist.group.WORLD).group_name
    seq = STATE.agreement_seq.get(group, 0)
    STATE.agreement_seq[group] = seq + 1
    prefix = f"autofuse/agree/{group}/{seq}"
    keys = [f"{prefix}/{r}" for r in range(world.size)]
    store.set(keys[world.rank], json.dumps(mine))
    STATE.stats.agreements += 1
    timeout = agree_timeout_s(world.device.type)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - the store's timeout error type differs across torch versions
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        # this round did not happen: take it back, so this rank's next agreement pairs with the others' next
        # one (they never entered this round: they ran a cached call, or will call again)
        STATE.agreement_seq[group] = seq
        store.delete_key(keys[world.rank])
        raise DispatchMismatch(
            f"autofuse.{op}: rank(s) {missing} did not take part in the first call of this problem within "
            f"{timeout:.0f} s ({type(exc).__name__}). A rank that ran a cached call with other shapes, skipped "
            "the call or died leaves the others here; its own kernels time out on their flags.") from None
    every = [json.loads(store.get(k)) for k in keys]
    if seq > 0:  # every rank has published this round, so all have read the previous one
        store.delete_key(f"autofuse/agree/{group}/{seq - 1}/{world.rank}")
    return every
