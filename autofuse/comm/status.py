"""Host side of bounded waits: the wait budget, and a workspace's fault record as a clear exception.

Kernels record a fault in their workspace's status words (kernels/shmem.py: `give_up`): the rank
whose wait ran out writes TIMEOUT in its own record and ABORTED in every peer's, with its rank, the
flag and the epochs. `raise_fault` turns such a record into `FlagTimeout` on every rank; until the
workspace is rebuilt every call on it raises `WorkspaceAborted`. The host writes a third kind, STOPPED,
into its peers' records when they wait inside a call this rank does not take part in (comm/rounds.py):
the record holds the round in which this rank said why, and `fault` raises `PeerRefused` with it.
"""
from __future__ import annotations

import numpy as np

from autofuse.core.settings import wait_timeout_s
from autofuse.kernels import shmem


class FlagTimeout(RuntimeError):
    """A flag wait ran out (here or on a peer): names the op, the rank that ran out and the flag."""

    def __init__(self, op: str, rank: int, origin: int, flag: str, expected: int, seen: int):
        where = (f"rank {rank} timed out waiting on flag {flag}" if origin == rank else
                 f"rank {rank} stopped because rank {origin} timed out waiting on flag {flag}")
        super().__init__(
            f"{op}: {where} for epoch {expected} (last saw {seen}); a peer did not run its part of the call "
            f"(crashed, hung, skipped a call, or called with other shapes). Every rank's {op} workspace is "
            "now aborted and refuses calls until rebuilt: call autofuse.rebuild(group) on every rank, or "
            "restart the job")
        self.op, self.rank, self.origin, self.flag, self.expected, self.seen = op, rank, origin, flag, expected, seen


STOPPED = 3  # a status code's kind (after kernels/shmem.py's TIMEOUT and ABORTED), written by the host only


class PeerRefused(FlagTimeout):
    """A peer did not take part in this call (it raised first, or went on to another call) and stopped
    this rank's waits at once, rather than letting them run out; names that rank and what it did."""

    def __init__(self, op: str, rank: int, origin: int, said: str):
        RuntimeError.__init__(
            self, f"{op}: rank {rank} stopped because rank {origin} did not take part in this call: it {said}. "
            f"Every rank's {op} workspace is now aborted and refuses calls until rebuilt: fix the call on rank "
            f"{origin}, then call autofuse.rebuild(group) on every rank, or restart the job")
        self.op, self.rank, self.origin, self.flag, self.expected, self.seen = op, rank, origin, "", -1, -1
        self.said = said


class WorkspaceAborted(RuntimeError):
    """A call on a workspace that saw a fault: refused until the workspace is rebuilt on every rank."""


class CollectiveTimeout(RuntimeError):
    """A collective library call (a bsp variant's, on the CPU emulation's gloo) did not complete within the
    wait budget: a peer did not take part. The process group cannot be used after it (a late peer's call
    would pair with the abandoned one), so its World refuses every later collective: restart the job."""


def wait_budget_ns(device_type: str) -> int:
    """The wait budget kernels receive (DeviceContext.budget): nanoseconds of wall-clock time."""
    return int(wait_timeout_s(device_type) * 1e9)


def describe_flag(heap, word: int) -> str:
    """'name[i, j]' for the flag at a heap offset given in 4-byte words (every rank's heap has one layout)."""
    offset = word * 4
    alloc = heap.owner_of(offset)
    if alloc is None:
        return f"<heap offset {offset}>"
    index = (offset - alloc.offset) // alloc.dtype.itemsize
    if alloc.shape:
        idx = np.unravel_index(index, alloc.shape)
        return f"{alloc.name}[{', '.join(str(int(i)) for i in idx)}]"
    return f"{alloc.name}[{index}]"


def status_words(world_size: int) -> int:
    """Words of a status record for `world_size` ranks (the code, then 3 per rank)."""
    return shmem.RECORD.value + 3 * world_size


def fault(heap, op: str, words: list[int]) -> FlagTimeout | None:
    """The exception a status record (kernels/shmem.py, CODE and RECORD) stands for, or None if clean."""
    code = words[shmem.CODE.value]
    if code == 0:
        return None
    origin = code // 4 - 1
    if not 0 <= origin < heap.world.size:
        return FlagTimeout(op, heap.world.rank, origin, "<unknown: corrupt status record>", -1, -1)
    flag_word, expected, seen = words[shmem.RECORD.value + 3 * origin:shmem.RECORD.value + 3 * origin + 3]
    if code % 4 == STOPPED:
        return stopped(heap.world, op, origin, expected)
    return FlagTimeout(op, heap.world.rank, origin, describe_flag(heap, flag_word), expected, seen)


def stopped(world, op: str, origin: int, n: int) -> PeerRefused:
    """The error of a call that rank `origin` stopped from round n (comm/rounds.py); this rank takes its
    part in that round (it was inside a call), so the rank waiting there completes it at once."""
    from autofuse.comm import rounds

    try:
        said = rounds.what(rounds.entry_of(world, n, origin))
    except Exception as exc:  # noqa: BLE001 - the store is gone (the job ends): say what is known
        said = f"did not say why ({type(exc).__name__} reading its round)"
    exc = PeerRefused(op, world.rank, origin, said)
    try:
        rounds.join(world, n, {"ok": False, "launched": True, "why": f"PeerRefused: {exc}"})
    except Exception:  # noqa: BLE001 - as above
        pass
    return exc
