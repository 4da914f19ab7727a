"""Host side of bounded flag waits: turn a kernel's timeout record into a clear exception."""
from __future__ import annotations

import os

import numpy as np

from autofuse.kernels import shmem

DEFAULT_SPIN_LIMIT = {"cpu": 100_000, "cuda": 1 << 25}


class FlagTimeout(RuntimeError):
    """A kernel gave up waiting on a flag: names the op, the rank and the flag."""

    def __init__(self, op: str, rank: int, flag: str, expected: int, seen: int):
        super().__init__(
            f"{op}: rank {rank} timed out waiting on flag {flag} for epoch {expected} (last saw {seen}); "
            "a peer did not run its part of the call (crashed, hung, or launched a different op). "
            "The op's flags are now out of step: rebuild its workspace or restart the job"
        )
        self.op, self.rank, self.flag, self.expected, self.seen = op, rank, flag, expected, seen


def spin_limit(device_type: str) -> int:
    """Polls before a wait gives up: AUTOFUSE_SPIN_LIMIT, else a default per device type."""
    env = os.environ.get("AUTOFUSE_SPIN_LIMIT")
    return int(env) if env else DEFAULT_SPIN_LIMIT[device_type]


def describe_flag(heap, word: int) -> str:
    """'name[i, j]' for the flag at a heap offset given in 4-byte words."""
    offset = word * 4
    alloc = heap.owner_of(offset)
    if alloc is None:
        return f"<heap offset {offset}>"
    index = (offset - alloc.offset) // alloc.dtype.itemsize
    if alloc.shape:
        idx = np.unravel_index(index, alloc.shape)
        return f"{alloc.name}[{', '.join(str(int(i)) for i in idx)}]"
    return f"{alloc.name}[{index}]"


def check(heap, op: str) -> None:
    """Raise FlagTimeout if a kernel on this rank recorded a timeout; clears the record.

    Reads device memory, so it synchronises with the device: call it where a sync is paid anyway
    (tests, measurement, the first call of a problem) or every call with AUTOFUSE_CHECK=1.
    """
    words = heap.status[:4].tolist()
    if words[shmem.STATUS_CODE.value] == 0:
        return
    heap.status.zero_()
    raise FlagTimeout(op, heap.world.rank, describe_flag(heap, words[shmem.STATUS_FLAG_WORD.value]),
                      words[shmem.STATUS_EXPECTED.value], words[shmem.STATUS_SEEN.value])
