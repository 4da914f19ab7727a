"""A round's wait and settlement: what a round does to this group's workspaces (comm/rounds.py keeps
the store's side). `wait` collects every rank's entry, stopping peers that do not come within
rounds.GRACE_S where they may wait inside a call (`stop_peers`: their workspaces' status gets
STOPPED); `settle` then makes every workspace of the group refuse calls where a rank was stopped
inside one, or clears the stop where every rank came. Dispatch's first-call agreement calls both.
"""
from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from autofuse.comm import workspace
from autofuse.comm.rounds import CLOSED, GRACE_S, POLL_S, group_name, keys, prefix, store

if TYPE_CHECKING:
    from autofuse.comm.world import World


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
