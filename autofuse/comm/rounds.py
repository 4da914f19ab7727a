"""Rounds: how the ranks of a group tell each other what each is about to do, through the job's store.

A round is one numbered exchange per group: every rank publishes one JSON entry under
`autofuse/agree/<group>/<n>/<rank>` and waits, bounded, for the others'. Dispatch's first-call
agreement is a round (autofuse/dispatch/agreement.py), and so is a rank's refusal of a call it
cannot take part in: it publishes its failure in its next round instead of leaving silently.

A rank waiting in round n past GRACE_S for peers that do not come claims the round's stop (its
`state` key, set once: `stop:<rank>`) and stops them where they may wait instead, inside a call the
others cached: every peer's status on this group's heap gets the code STOPPED (kernels/shmem.py:
their flag waits end at once), after each peer finished the calls this rank finished (its epoch
counter caught up), and `World.collective` (a bsp collective on gloo) polls the state key. A rank
so stopped publishes its own entry (`launched`: it was inside a call) and raises, naming the rank
and what it did (comm/status.py: PeerRefused). When the round is complete every rank settles it
(`settle`): where a rank was stopped inside a call, every rank's workspaces of the group refuse
calls until `autofuse.rebuild(group)`; where the stop only met slow peers (every rank came to the
round), each rank clears its own status words, so nothing is left aborted.
"""
from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from autofuse.comm.world import World

GRACE_S = 1.0  # how long a round waits for its peers before it stops them where they may wait instead
POLL_S = 0.05  # how often bounded waits look at the store
CLOSED = "closed"

_next: dict[str, int] = {}  # group name -> the next round's number; never reset (store keys are never reused)


def group_name(world: World) -> str:
    """The torch process group name of `world` (the store keys' prefix)."""
    return (world.group if world.group is not None else dist.group.WORLD).group_name


def store() -> Any:
    """The job's key-value store."""
    return dist.distributed_c10d._get_default_store()


def current(world: World) -> int:
    """The number of the round this rank takes part in next."""
    return _next.get(group_name(world), 0)


def prefix(world: World, n: int) -> str:
    return f"autofuse/agree/{group_name(world)}/{n}"


def keys(world: World, n: int) -> list[str]:
    """Every rank's entry key of round n, in rank order."""
    return [f"{prefix(world, n)}/{r}" for r in range(world.size)]


def publish(world: World, entry: dict) -> int:
    """Publish this rank's entry in its next round and take that round; returns its number."""
    n = current(world)
    _next[group_name(world)] = n + 1
    store().set(keys(world, n)[world.rank], json.dumps(entry))
    return n


def take_back(world: World, n: int) -> None:
    """Forget round n on this rank (it ran it alone): its next round is n again."""
    _next[group_name(world)] = n
    s = store()
    s.delete_key(keys(world, n)[world.rank])
    for k in ("state", "stopped"):
        s.delete_key(f"{prefix(world, n)}/{k}")


def join(world: World, n: int, entry: dict) -> None:
    """Take part in round n with `entry` unless this rank already did (a rank stopped inside a call)."""
    if current(world) == n:
        publish(world, entry)


def entry_of(world: World, n: int, rank: int) -> dict | None:
    """Rank `rank`'s entry of round n, None if it has not published one."""
    s, key = store(), keys(world, n)[rank]
    return json.loads(s.get(key)) if s.check([key]) else None


def stopper(world: World, n: int) -> int | None:
    """The rank that claimed round n's stop, None if none did (one store look-up)."""
    s, key = store(), f"{prefix(world, n)}/state"
    if not s.check([key]):
        return None
    state = s.get(key).decode()
    return int(state.split(":")[1]) if state.startswith("stop:") else None


def what(entry: dict | None) -> str:
    """What a rank's entry says it did, for messages."""
    if entry is None:
        return "did not say why"
    if entry.get("ok"):
        return f"made the first call of another problem instead ({entry.get('said', '?')})"
    return f"raised {entry.get('why', '?')}"


def wait(world: World, n: int, timeout_s: float) -> list[dict] | None:
    """Every rank's entry of round n (rank order) once all are published, stopping absent peers after
    GRACE_S; None when `timeout_s` passes first. Polls (`check`, never a blocking wait that logs its
    timeouts), every millisecond at first, then every POLL_S."""
    s, ks = store(), keys(world, n)
    start = time.monotonic()
    pause, stopped = 0.0005, False
    while not s.check(ks):
        elapsed = time.monotonic() - start
        if elapsed >= timeout_s:
            return None
        if not stopped and elapsed >= GRACE_S:
            stop_peers(world, n)
            stopped = True
        time.sleep(pause)
        pause = min(2 * pause, POLL_S)
    return [json.loads(s.get(k)) for k in ks]


def stop_peers(world: World, n: int) -> None:
    """Claim round n's stop and, if this rank is the one that claims it, stop every peer inside a call
    on this group's heap (their workspaces' status) once they finished what this rank finished."""
    from autofuse.comm import workspace

    s = store()
    mine = f"stop:{world.rank}"
    if s.compare_set(f"{prefix(world, n)}/state", "", mine).decode() != mine:
        return  # closed (everyone came) or claimed by another rank
    try:
        for ws in workspace.workspaces(world):
            ws.stop_peers(n)
    finally:
        s.set(f"{prefix(world, n)}/stopped", "1")


def settle(world: World, n: int, every: list[dict], timeout_s: float) -> bool:
    """After round n completed: whether a rank was stopped inside a call (then every workspace of the
    group refuses calls on this rank until rebuilt); where a stop only met ranks that all came to the
    round, clear this rank's status words of it."""
    from autofuse.comm import workspace

    s = store()
    state = s.compare_set(f"{prefix(world, n)}/state", "", CLOSED).decode()
    launched = [r for r, e in enumerate(every) if e.get("launched")]
    if state.startswith("stop:"):
        end = time.monotonic() + max(timeout_s, 1.0)
        while not s.check([f"{prefix(world, n)}/stopped"]):
            if time.monotonic() > end:  # the stopper died mid-way: leave its marks (rebuild clears them)
                return True
            time.sleep(POLL_S / 10)
    if launched:
        why = f"rank(s) {launched} were stopped inside a call (round {n} of group {group_name(world)})"
        for ws in workspace.workspaces(world):
            ws.refuse(why)
        return True
    if state.startswith("stop:"):
        for ws in workspace.workspaces(world):
            ws.clear_stop()
    if n > 0 and world.rank == 0:
        for k in ("state", "stopped"):
            s.delete_key(f"{prefix(world, n - 1)}/{k}")
    return False
