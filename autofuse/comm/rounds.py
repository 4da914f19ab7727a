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
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from autofuse.comm.heap import Ranks

GRACE_S = 1.0  # how long a round waits for its peers before it stops them where they may wait instead
POLL_S = 0.05  # how often bounded waits look at the store
CLOSED = "closed"

_next: dict[str, int] = {}  # group name -> the next round's number; never reset (store keys are never reused)


def group_name(world: Ranks) -> str:
    """The torch process group name of `world` (the store keys' prefix)."""
    return (world.group if world.group is not None else dist.group.WORLD).group_name


def store() -> Any:
    """The job's key-value store."""
    return dist.distributed_c10d._get_default_store()


def current(world: Ranks) -> int:
    """The number of the round this rank takes part in next."""
    return _next.get(group_name(world), 0)


def prefix(world: Ranks, n: int) -> str:
    return f"autofuse/agree/{group_name(world)}/{n}"


def keys(world: Ranks, n: int) -> list[str]:
    """Every rank's entry key of round n, in rank order."""
    return [f"{prefix(world, n)}/{r}" for r in range(world.size)]


def publish(world: Ranks, entry: dict) -> int:
    """Publish this rank's entry in its next round and take that round; returns its number."""
    n = current(world)
    _next[group_name(world)] = n + 1
    store().set(keys(world, n)[world.rank], json.dumps(entry))
    return n


def take_back(world: Ranks, n: int) -> None:
    """Forget round n on this rank (it ran it alone): its next round is n again."""
    _next[group_name(world)] = n
    s = store()
    s.delete_key(keys(world, n)[world.rank])
    for k in ("state", "stopped"):
        s.delete_key(f"{prefix(world, n)}/{k}")


def join(world: Ranks, n: int, entry: dict) -> None:
    """Take part in round n with `entry` unless this rank already did (a rank stopped inside a call)."""
    if current(world) == n:
        publish(world, entry)


def entry_of(world: Ranks, n: int, rank: int) -> dict | None:
    """Rank `rank`'s entry of round n, None if it has not published one."""
    s, key = store(), keys(world, n)[rank]
    return json.loads(s.get(key)) if s.check([key]) else None


def stopper(world: Ranks, n: int) -> int | None:
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
