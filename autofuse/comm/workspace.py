"""Workspace: the part of the symmetric heap that one op's (or collective's) kernels share across ranks.

Every op gets its workspace the same way (`workspace(world, name, data_bytes, flags)`), made of:
- `data`: bytes in two parity halves (inboxes, gathered buffers), viewed in any dtype by `data_view`;
- `flags`: int32 in two parity halves (epoch flags, arrival counters), zero when made;
- `counter`: the epoch, [last epoch, programs done] (kernels/shmem.py: epoch_begin/epoch_end);
- `status`: the fault record (shmem.CODE, RECORD), on the heap so that peers can abort it;
- `mirror`: the status code where the host reads it without a device sync (pinned memory on GPUs,
  written by kernels that see a fault), so a faulty workspace is refused at the next call.
A call of epoch e uses parity e % 2 of data and flags, so a peer one call ahead never writes what
is being read. Workspaces are cached per (heap, name); a problem that needs more capacity gets a
new, bigger workspace (capacities are powers of two) with its own epoch. Making one is collective:
every rank builds runners in the same order (dispatch and the tuner guarantee it), and a barrier
after zeroing the flags keeps a fast peer from raising a flag before this rank has zeroed it.
"""
from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from autofuse.comm import status
from autofuse.core.settings import wait_timeout_s
from autofuse.kernels import shmem
from autofuse.core.sizes import next_pow2

if TYPE_CHECKING:
    from autofuse.comm.world import World

MIN_DATA = 1 << 12   # capacities are powers of two from these up, so growth steps stay few
MIN_FLAGS = 1 << 6

_by_heap: "weakref.WeakKeyDictionary[Any, dict[str, list[Workspace]]]" = weakref.WeakKeyDictionary()


class Workspace:
    """One named workspace on one World's heap (see the module docstring); made by `workspace()`."""

    def __init__(self, world: World, name: str, data_bytes: int, flags: int):
        heap = world.heap
        self.world, self.name = world, name
        self.data = heap.empty(2 * data_bytes, dtype=torch.uint8, name=f"{name}.data")
        self.flags = heap.zeros(2 * flags, dtype=torch.int32, name=f"{name}.flags")
        self.counter = heap.zeros(2, dtype=torch.int32, name=f"{name}.epoch")
        self.status = heap.zeros(status.status_words(world.size), dtype=torch.int32, name=f"{name}.status")
        self.mirror = torch.zeros(1, dtype=torch.int32, pin_memory=world.device.type == "cuda")
        self._mirror = self.mirror.numpy()
        self.aborted: str | None = None
        self._ctx = shmem.DeviceContext(world.rank, world.size, heap.bases, self.status, self.counter,
                                        status.wait_budget_ns(world.device.type), self.mirror)
        world.sync()  # every rank has zeroed its flags before any peer may raise one

    @property
    def half_bytes(self) -> int:
        """Bytes of one parity half of `data`."""
        return self.data.numel() // 2

    @property
    def half_flags(self) -> int:
        """Flags in one parity half of `flags`."""
        return self.flags.numel() // 2

    @property
    def ctx(self) -> shmem.DeviceContext:
        """The device context kernels take (one argument)."""
        return self._ctx

    def data_view(self, dtype: torch.dtype, offset: int = 0) -> tuple[torch.Tensor, int]:
        """(a `dtype` view of parity 0's data from byte `offset` on, the parity stride in elements)."""
        if offset % dtype.itemsize or self.half_bytes % dtype.itemsize:
            raise ValueError(f"{self.name}: offset {offset} is not aligned for {dtype}")
        return self.data[offset:].view(dtype), self.half_bytes // dtype.itemsize

    def faulty(self) -> bool:
        """Whether a fault was seen here (no device sync: reads the host mirror)."""
        return self.aborted is not None or self._mirror[0] != 0

    def refuse_if_faulty(self) -> None:
        """Raise WorkspaceAborted if a fault was seen (no device sync: reads the host mirror)."""
        if self.aborted is None and self._mirror[0] == 0:
            return
        if self.aborted is None:
            self.check()
        raise status.WorkspaceAborted(
            f"{self.name}: this workspace saw a fault and refuses to compute until it is rebuilt on every rank "
            f"(autofuse.rebuild(group)); the fault: {self.aborted}")

    def check(self) -> None:
        """Read the fault record (synchronises with the device) and raise FlagTimeout if there is one."""
        if self.world.device.type == "cuda":
            torch.cuda.synchronize(self.world.device)
        exc = status.fault(self.world.heap, self.name, self.status.tolist())
        if exc is not None:
            self.aborted = str(exc)
            self._mirror[0] = max(int(self._mirror[0]), 1)
            raise exc

    def stop_peers(self, n: int) -> None:
        """Stop every peer's waits on this workspace with STOPPED from round n (comm/rounds.py), once its
        epoch counter reached this rank's: calls this rank finished are left to finish on the peers."""
        world, heap = self.world, self.world.heap
        mine = int(self.counter[0])
        deadline = time.monotonic() + wait_timeout_s(world.device.type)
        code, slot = (world.rank + 1) * 4 + status.STOPPED, shmem.RECORD.value + 3 * world.rank
        record = torch.tensor([-1, n, 0], dtype=torch.int32, device=self.status.device)
        for r in range(world.size):
            if r == world.rank:
                continue
            try:
                counter, words = heap.peer_tensor(self.counter, r), heap.peer_tensor(self.status, r)
            except NotImplementedError:
                return  # a heap without host views of its peers (iris): their waits run out instead
            while int(counter[0]) < mine and time.monotonic() < deadline:
                time.sleep(0.001)
            if int(words[shmem.CODE.value]) == 0:
                words[slot:slot + 3] = record
                words[shmem.CODE.value] = code
        if world.device.type == "cuda":
            torch.cuda.synchronize(world.device)

    def refuse(self, why: str) -> None:
        """Refuse calls from now on (host side), until rebuilt: a peer was stopped inside a call."""
        if self.aborted is None:
            self.aborted = why
        self._mirror[0] = max(int(self._mirror[0]), 1)

    def clear_stop(self) -> None:
        """Clear this rank's status code where it holds a STOPPED that met no call (every rank was in the round)."""
        if int(self.status[shmem.CODE.value]) % 4 == status.STOPPED:
            self.status[shmem.CODE.value] = 0

    def rebuild(self) -> None:
        """Clear flags, epoch and fault record on every rank (collective), so the workspace computes again."""
        self.world.sync()
        for t in (self.flags, self.counter, self.status):
            t.zero_()
        self.mirror.zero_()
        self.aborted = None
        self.world.sync()


def workspace(world: World, name: str, data_bytes: int = 0, flags: int = 0) -> Workspace:
    """The workspace `name` on `world` with at least `data_bytes` per parity of data and `flags` per
    parity of flags; the cached one if it is big enough, else a new one (collective)."""
    made = _by_heap.setdefault(world.heap, {}).setdefault(name, [])
    ws = made[-1] if made else None
    if ws is None or ws.half_bytes < data_bytes or ws.half_flags < flags:
        grow = (ws.half_bytes, ws.half_flags) if ws is not None else (0, 0)
        data = max(data_bytes, grow[0])
        ws = Workspace(world, name, next_pow2(max(data, MIN_DATA)) if data else 0,
                       next_pow2(max(flags, MIN_FLAGS, grow[1])))
        made.append(ws)
    return ws


def workspaces(world: World) -> list[Workspace]:
    """Every workspace made on `world`'s heap so far, outgrown ones included (runners may still use them)."""
    heap = getattr(world, "_heap", None)
    return [ws for made in _by_heap.get(heap, {}).values() for ws in made] if heap is not None else []
