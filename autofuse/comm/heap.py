"""Symmetric heap: the same-sized region on every rank of a group, addressable by every rank's kernels.

One class, four providers (DESIGN.md, Heap providers):
- `torch` (default on GPUs): device memory from torch's caching allocator; the group's ranks swap
  CUDA IPC handles (`torch.multiprocessing.reductions`) through autofuse's own bounded rendezvous
  and each rank opens every peer's heap on its own device (the driver enables peer access).
  Heap bases are those mapped addresses. Works for any group, of any size, in any order.
- `symm`: torch's own symmetric memory (`_symmetric_memory.empty` + `rendezvous`), kept as a
  fallback for groups that span the whole job only (see below why never on other groups).
- `iris`: Iris's own heap where `import iris` works (ROCm); whole job only, optional.
- `shm`: CPU emulation: one shared-memory file per rank, mapped into every rank's process; the
  files are made once every rank has arrived and unlinked as soon as every rank has mapped them, so
  nothing is left even after a crash or a kill (a rank waiting for late peers has made none yet).

Why autofuse does not use torch's rendezvous for its heaps (issue 17). In torch 2.11 (and any
release without the upstream fix, pytorch/pytorch#196350), `_SymmetricMemory.rendezvous` swaps its requests through a single file-static
`StoreExchange` per backend (`CUDASymmetricMemory.cu`: `static StoreExchange storeExchange`)
whose store keys are `<prefix>/<seq_id_>/<rank>`, and `seq_id_` is one counter per *process*,
raised by every all-gather and barrier of every rendezvous on any group
(`CUDASymmetricMemoryUtils.hpp`, `StoreExchange::all_gather`: `++seq_id_`). A rendezvous on a
group that leaves some ranks out (a 1-rank world, TP inside DP, the tuner's `--world 1,2`)
advances the counter only on its members; the next rendezvous on a larger group then has its
ranks write and wait on different keys, and every rank waits in `store->wait` until the store's
timeout (pytorch/pytorch#196082; #196350 scopes the counter to the group).
Nothing on the Python side can reset the counter, and making every rank of the job perform the
same rendezvous sequence is impossible for groups that user code creates and uses on some ranks
only (`World.from_group`). So heaps are exchanged by autofuse itself:

- `Rendezvous`: bounded all-gathers of small payloads through the job's store, keyed by the
  group's global ranks, its name and a per-group sequence number, so groups never share keys
  and ranks agree on keys whatever other groups they rendezvoused on before. Every wait has a
  deadline (`AUTOFUSE_HEAP_TIMEOUT`, default 300 s); a timeout names the group, its ranks and the
  ranks that never arrived. A last phase agrees on success, so either every rank has a working
  heap or every rank raises.
- A 1-rank heap needs no exchange at all: plain device memory, `bases = [its address]`.
- CUDA IPC handles of caching-allocator memory (rather than carving sub-heaps out of one job-wide
  heap, which would need every rank of the job at the first allocation of any group, or exporting
  torch's symmetric-memory handles ourselves, which needs file descriptors passed over sockets).
  The mapping is the same NVLink peer mapping that kernels and the copy engine read through.

A bump allocator hands out tensors; every allocation is checked to sit at the same offset on
every rank, since kernels translate addresses by offset.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import mmap
import os
import pickle
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import torch
import torch.distributed as dist

from autofuse.core import settings


class Ranks(Protocol):
    """What a heap (and a round, comm/rounds.py) reads of its World (`autofuse.comm.world.World`), named
    here so that neither imports the module that creates it."""

    rank: int
    size: int
    device: torch.device
    group: Any
    global_ranks: Any
    shares_gpu: bool


ALIGN = 256
STATUS_WORDS = 8
DEFAULT_SIZE = {"cpu": 64 << 20, "cuda": 8 << 30}
SHM_DIR = "/dev/shm"
SHM_PREFIX = "autofuse-heap"
PROVIDERS = settings.HEAP_PROVIDERS
MIN_SIZE = settings.MIN_HEAP_SIZE
parse_size = settings.parse_size  # AUTOFUSE_HEAP_SIZE's syntax, also for an explicit size
WHOLE_JOB_ONLY = ("symm", "iris")


class HeapFull(MemoryError):
    """An allocation did not fit in the symmetric heap."""


class HeapRendezvousError(RuntimeError):
    """Creating a group's heap failed or timed out; the message names the group and what to do."""


def _mib(*sizes: int) -> int:
    """The largest of `sizes` in MiB, rounded up (a size to suggest in a message)."""
    return -(-max(sizes) // (1 << 20))


def default_provider(device: torch.device, spans_job: bool = False, shares_gpu: bool = False) -> str:
    """'shm' on CPU; 'iris' where Iris imports on ROCm; on CUDA 'symm' (torch's symmetric memory) for a
    group that spans the whole job, 'torch' (CUDA IPC handles exchanged by `Rendezvous`) for any other
    and wherever ranks share a GPU (torch's symmetric memory refuses allocations from one device in
    several ranks).

    Measured on two H200 (2026-11-22, `autofuse doctor`), the two move bytes and flags alike (copy
    engine 368-371 GB/s, Triton pull 320-331 GB/s, flag round trip 3.7 us either way once the GPUs are
    warm; the first measurement in a fresh process took 28-34 us with either). Whole-job groups use
    torch's own symmetric memory, the path PyTorch supports and the one autofuse's shipped tables were
    measured on; its rendezvous must never see a group that leaves ranks out (`Rendezvous` says why),
    so every other group uses IPC.
    """
    if device.type == "cpu":
        return "shm"
    if getattr(torch.version, "hip", None):
        try:
            import iris  # noqa: F401

            return "iris"
        except ImportError:
            pass
    return "symm" if spans_job and not shares_gpu else "torch"


SHARED_GPU_SYMM = ("ranks share a GPU here (AUTOFUSE_RANKS_PER_GPU), and torch's symmetric memory refuses "
                   "allocations from one device in several ranks")


def torch_symm_unavailable(world: Ranks, op: str) -> str | None:
    """Why torch's own symmetric-memory op `torch.ops.symm_mem.<op>` cannot run on `world`, None where it
    can: it needs a CUDA World of one GPU per rank that spans the whole job (torch's rendezvous hangs
    once groups that leave ranks out used it: `Rendezvous` says why) and a torch that registers the op
    (importing `_symmetric_memory` does)."""
    if world.device.type != "cuda":
        return f"torch's symmetric memory needs CUDA, not {world.device.type}"
    if world.shares_gpu:
        return SHARED_GPU_SYMM
    if not _spans_job(world):
        return "torch's symmetric-memory rendezvous serves only groups that span the whole job"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (importing registers torch.ops.symm_mem)

        if hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, op):
            return None
    except (ImportError, AttributeError, RuntimeError):
        pass
    return f"this torch ({torch.__version__}) has no torch.ops.symm_mem.{op}"


def torch_symm_group(world: Ranks) -> str:
    """The World's group name with torch's symmetric memory enabled for it (what the torch_symm
    variants pass torch's ops); enabling is needed before torch 2.13 and warns after it."""
    import warnings

    import torch.distributed._symmetric_memory as symm

    group = (world.group if world.group is not None else dist.group.WORLD).group_name
    enabled = getattr(symm, "is_symm_mem_enabled_for_group", lambda name: True)
    if hasattr(symm, "enable_symm_mem_for_group") and not enabled(group):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm.enable_symm_mem_for_group(group)
    return group


# -- rendezvous --------------------------------------------------------------------------------------

_seq: dict[tuple, int] = {}
_seq_job: list[Any] = [None]


def _group_of(world: Ranks) -> Any:
    return world.group if world.group is not None else dist.group.WORLD


def _global_ranks(world: Ranks) -> tuple[int, ...]:
    return tuple(world.global_ranks) if world.global_ranks else tuple(range(world.size))


def describe_group(world: Ranks) -> str:
    """'group "3" (global ranks [0, 1])': how errors name a World's group."""
    try:
        name = _group_of(world).group_name
    except Exception:
        name = "?"
    return f"group {name!r} (global ranks {list(_global_ranks(world))})"


def _next_seq(key: tuple) -> int:
    """This process's count of rendezvous on one group; reset when the job's default group changes."""
    job = dist.group.WORLD
    if _seq_job[0] is not job:
        _seq.clear()
        _seq_job[0] = job
    n = _seq.get(key, 0)
    _seq[key] = n + 1
    return n


def _base_stores(store: Any) -> list[Any]:
    chain = [store]
    while hasattr(chain[-1], "underlying_store"):
        chain.append(chain[-1].underlying_store)
    return chain


@contextlib.contextmanager
def store_timeout(seconds: float) -> Iterator[None]:
    """Bound every blocking wait on the job's store (and the stores it wraps) for a while.

    torch's symmetric-memory rendezvous waits on the store without its own timeout; this is the
    only bound that reaches it.
    """
    chain = _base_stores(dist.distributed_c10d._get_default_store())
    saved = [s.timeout for s in chain]
    for s in chain:
        s.set_timeout(datetime.timedelta(seconds=max(seconds, 0.001)))
    try:
        yield
    finally:
        for s, t in zip(chain, saved):
            s.set_timeout(t)


class Rendezvous:
    """Bounded all-gathers of small picklable payloads among one World's ranks, via the job's store.

    Keys are `autofuse/heap/<global ranks>/<group name>/<n>/<phase>/<rank>` where n counts this
    group's rendezvous in this process; only the group's own members ever touch them, so what
    other groups did on some ranks cannot shift them. Collective over the World's ranks.
    """

    def __init__(self, world: Ranks, provider: str, size: int, timeout_s: float | None = None):
        self.world = world
        self.timeout_s = settings.heap_timeout_s() if timeout_s is None else float(timeout_s)
        self.ranks = _global_ranks(world)
        self.group_name = str(_group_of(world).group_name)
        self.header = {"group": self.group_name, "ranks": self.ranks, "provider": provider, "size": size}
        seq = _next_seq((self.ranks, self.group_name))
        self.prefix = f"autofuse/heap/{'_'.join(map(str, self.ranks))}/{self.group_name}/{seq}"
        self.store = dist.distributed_c10d._get_default_store()
        self.deadline = time.monotonic() + self.timeout_s

    @property
    def label(self) -> str:
        return f"group {self.group_name!r} (global ranks {list(self.ranks)})"

    def remaining(self) -> float:
        return max(self.deadline - time.monotonic(), 0.001)

    def all_gather(self, phase: str, payload: Any) -> list[dict]:
        """Every rank's {'group', 'ranks', 'provider', 'size', 'host', 'pid', 'data': payload}."""
        w = self.world
        mine = dict(self.header, host=socket.gethostname(), pid=os.getpid(), data=payload)
        keys = [f"{self.prefix}/{phase}/{r}" for r in range(w.size)]
        if w.size == 1:
            return [mine]
        self.store.set(keys[w.rank], pickle.dumps(mine))
        others = [k for r, k in enumerate(keys) if r != w.rank]
        try:
            self.store.wait(others, datetime.timedelta(seconds=self.remaining()))
        except RuntimeError as exc:  # DistStoreError on timeout; RuntimeError where the store went away
            missing = [self.ranks[r] for r, k in enumerate(keys) if r != w.rank and not self._present(k)]
            raise HeapRendezvousError(
                f"symmetric heap rendezvous of {self.label}, {self.header['provider']} provider, phase "
                f"{phase!r}: global rank {self.ranks[w.rank]} waited {self.timeout_s:g} s and global ranks "
                f"{missing or '(unknown)'} never arrived ({type(exc).__name__}: {exc}). Every rank of a group "
                "must create the group's heap together (its first `world.heap`, or the first fused op on it); "
                "a rank that skipped it, crashed or waits elsewhere (another collective, another group's "
                "heap in a different order) leaves the others here. If the ranks are only slow, raise "
                "AUTOFUSE_HEAP_TIMEOUT (seconds)."
            ) from None
        got = [mine if r == w.rank else pickle.loads(self.store.get(k)) for r, k in enumerate(keys)]
        for field in ("group", "ranks", "provider", "size"):
            seen = [g[field] for g in got]
            if any(s != seen[0] for s in seen):
                hint = " (set AUTOFUSE_HEAP_SIZE / AUTOFUSE_HEAP_PROVIDER alike on every rank)" \
                    if field in ("size", "provider") else ""
                raise HeapRendezvousError(
                    f"symmetric heap rendezvous of {self.label}: ranks disagree on the heap's {field}, "
                    f"{dict(zip(self.ranks, seen))}{hint}"
                )
        return got

    def agree(self, phase: str, error: str | None, what: str) -> None:
        """Raise on every rank if any rank reports an error for `what` (so no rank goes on alone)."""
        every = self.all_gather(phase, error)
        failed = {self.ranks[r]: g["data"] for r, g in enumerate(every) if g["data"]}
        if failed:
            lines = "; ".join(f"global rank {r}: {e}" for r, e in failed.items())
            raise HeapRendezvousError(f"symmetric heap of {self.label}: {what} failed on {lines}")

    def _present(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except RuntimeError:
            return False


@dataclass
class Allocation:
    name: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class SymmetricHeap:
    """The symmetric heap of one World; allocate with `empty/zeros/full/randn`.

    `bases` is an int64 tensor on the World's device: `bases[r]` is rank r's heap address as
    mapped in this process, what the device API's `heap_bases` argument expects. `status` is
    a small int32 region at offset 0 that bounded waits write on timeout (see `autofuse.comm.status`).
    Creating a heap is collective over the World's ranks and bounded by `timeout_s`
    (default AUTOFUSE_HEAP_TIMEOUT or 300 s); it raises HeapRendezvousError instead of hanging.
    """

    def __init__(self, world: Ranks, size: int | str | None = None, provider: str | None = None,
                 timeout_s: float | None = None):
        self.world = world
        shares = world.shares_gpu
        default = DEFAULT_SIZE[world.device.type] // (settings.ranks_per_gpu() if shares else 1)  # one GPU's worth
        self.size = parse_size(size) if size is not None else settings.heap_size() or default
        self.provider = provider or settings.heap_provider() or default_provider(world.device, _spans_job(world), shares)
        if self.provider not in PROVIDERS:
            raise ValueError(f"unknown heap provider {self.provider!r}: use {', '.join(PROVIDERS)}")
        self._top = 0
        self._allocs: list[Allocation] = []
        self._peers: list[torch.Tensor] = []
        self._maps: list[mmap.mmap] = []
        self._handle: Any = None
        if self.provider in WHOLE_JOB_ONLY and shares:
            raise HeapRendezvousError(f"the {self.provider} heap provider cannot serve {describe_group(world)}: "
                                      f"{SHARED_GPU_SYMM}; use the torch provider (unset AUTOFUSE_HEAP_PROVIDER)")
        if self.provider in WHOLE_JOB_ONLY and not _spans_job(world):
            raise HeapRendezvousError(
                f"the {self.provider} heap provider can only serve a group that spans the whole job, not "
                f"{describe_group(world)} of a {dist.get_world_size()}-rank job"
                + (": torch's symmetric-memory rendezvous hangs once groups that leave ranks out have "
                   "rendezvoused (pytorch/pytorch#196082)" if self.provider == "symm" else "")
                + "; use the default torch provider (unset AUTOFUSE_HEAP_PROVIDER)"
            )
        rv = Rendezvous(world, self.provider, self.size, timeout_s) if dist.is_initialized() else None
        if rv is None and world.size > 1:
            raise RuntimeError("a symmetric heap for several ranks needs torch.distributed initialised")
        getattr(self, f"_open_{self.provider}")(rv)
        self.status = self.zeros(STATUS_WORDS, dtype=torch.int32, name="status")

    # providers -------------------------------------------------------------------------------
    def _open_shm(self, rv: Rendezvous | None) -> None:
        w = self.world
        if w.device.type != "cpu":
            raise ValueError("the shm heap provider emulates GPUs on CPU; use torch or iris on GPUs")
        if rv:  # every rank is here before any file exists: a rank killed while it waits leaves none behind
            rv.all_gather("arrived", None)
        path = os.path.join(SHM_DIR, f"{SHM_PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:12]}-{w.rank}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.size)
        finally:
            os.close(fd)
        maps: list[mmap.mmap] = []
        try:
            paths = [g["data"] for g in rv.all_gather("paths", path)] if rv else [path]
            error = None
            try:
                for p in paths:
                    fd = os.open(p, os.O_RDWR)
                    try:
                        maps.append(mmap.mmap(fd, self.size))
                    finally:
                        os.close(fd)
            except OSError as exc:
                error = f"cannot map a peer's heap file: {exc}"
            if rv:
                rv.agree("mapped", error, "mapping the peers' heap files")
            elif error:
                raise HeapRendezvousError(error)
        finally:
            os.unlink(path)  # every rank has mapped it (or gave up): the mappings outlive the name
        self._maps = maps
        self._local = torch.frombuffer(maps[w.rank], dtype=torch.uint8)
        addrs = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in maps]
        self.bases = torch.tensor(addrs, dtype=torch.int64)
        self.paths = paths

    def _open_torch(self, rv: Rendezvous | None) -> None:
        w = self.world
        local = torch.empty(self.size, dtype=torch.uint8, device=w.device)
        self._local = local
        if w.size == 1:
            self._peers = [local]
        else:
            from torch.multiprocessing.reductions import reduce_tensor, rebuild_cuda_tensor

            try:
                exported: tuple = (reduce_tensor(local)[1], None)
            except Exception as exc:
                exported = (None, f"{type(exc).__name__}: {exc}")
            every = rv.all_gather("handles", exported)
            failed = {rv.ranks[r]: g["data"][1] for r, g in enumerate(every) if g["data"][1]}
            if failed:
                raise HeapRendezvousError(
                    f"symmetric heap of {rv.label}: exporting the heap for CUDA IPC failed on {failed} (CUDA IPC "
                    "needs torch's caching allocator, not PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync)"
                )
            hosts = sorted({g["host"] for g in every})
            if len(hosts) > 1:
                raise HeapRendezvousError(
                    f"the torch heap provider maps peers' memory with CUDA IPC, which needs every rank of "
                    f"{rv.label} on one host; it spans {hosts}. Run fused ops on intra-node groups"
                )
            index = w.device.index if w.device.index is not None else torch.cuda.current_device()
            peers: list[torch.Tensor] = []
            error = None
            try:
                for r, g in enumerate(every):
                    if r == w.rank:
                        peers.append(local)
                        continue
                    a = list(g["data"][0])
                    a[6] = index  # open on this rank's device: the driver maps it there, peer access on
                    peers.append(rebuild_cuda_tensor(*a))
            except Exception as exc:
                error = (f"cannot open global rank {rv.ranks[len(peers)]}'s heap on cuda:{index} "
                         f"({type(exc).__name__}: {exc}); every GPU of the group must be visible to every "
                         "rank (CUDA_VISIBLE_DEVICES) and peer-capable")
            rv.agree("opened", error, "opening the peers' heaps")
            self._peers = peers
        self.bases = torch.tensor([p.data_ptr() for p in self._peers], dtype=torch.int64, device=w.device)

    def _open_symm(self, rv: Rendezvous | None) -> None:
        import torch.distributed._symmetric_memory as symm

        w = self.world
        if rv is None:
            raise RuntimeError("the symm heap provider needs torch.distributed initialised")
        buf = symm.empty(self.size, dtype=torch.uint8, device=w.device)
        rv.all_gather("arrive", None)  # every rank is here: torch's exchange will not wait on an absent one
        try:
            with store_timeout(rv.remaining()):
                handle = symm.rendezvous(buf, rv.group_name)
        except RuntimeError as exc:
            raise HeapRendezvousError(
                f"torch's symmetric-memory rendezvous of {rv.label} failed or timed out ({exc}); torch 2.11 "
                "hangs there after any rendezvous on a group that left ranks out (pytorch/pytorch#196082), "
                "e.g. a torch_symm op on a sub-group: use the default torch heap provider"
            ) from None
        self._local = buf
        self._handle = handle
        self.bases = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=w.device)

    def _open_iris(self, rv: Rendezvous | None) -> None:
        import iris

        shmem = iris.iris(self.size)
        self._iris = shmem
        # One Iris allocation holds our whole heap; it sits at the same offset in Iris's heap on
        # every rank, so translating by Iris's own heap bases stays correct.
        self._local = shmem.zeros(self.size, dtype=torch.uint8)
        self.bases = shmem.get_heap_bases().to(torch.int64)

    # allocation ------------------------------------------------------------------------------
    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, name: str, verify: bool) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * dtype.itemsize
        offset = -(-self._top // ALIGN) * ALIGN
        if offset + nbytes > self._local.numel():
            raise HeapFull(
                f"symmetric heap full: {name!r} needs {nbytes} B at offset {offset}, heap is "
                f"{self.size} B ({self._top} B used); raise AUTOFUSE_HEAP_SIZE (e.g. {_mib(2 * self.size, offset + nbytes)}M)"
            )
        if verify:
            self._verify_offset(offset, nbytes, name)
        self._top = offset + nbytes
        self._allocs.append(Allocation(name, offset, nbytes, dtype, shape))
        return self._local[offset:offset + nbytes].view(dtype).view(shape)

    def _verify_offset(self, offset: int, nbytes: int, name: str) -> None:
        w = self.world
        if w.size == 1:
            return
        mine = torch.tensor([offset, nbytes], dtype=torch.int64, device=w.device)
        every = [torch.empty_like(mine) for _ in range(w.size)]
        dist.all_gather(every, mine, group=w.group)
        seen = [tuple(t.tolist()) for t in every]
        if len(set(seen)) != 1:
            raise RuntimeError(
                f"symmetric allocation {name!r} disagrees across ranks (offset, bytes) = {seen}: "
                "every rank must allocate the same sequence of buffers"
            )

    def empty(self, *shape: int, dtype: torch.dtype = torch.float32, name: str = "", verify: bool = True) -> torch.Tensor:
        """An uninitialised tensor on the heap, at the same offset on every rank."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        return self._alloc(tuple(int(s) for s in shape), dtype, name or f"buf{len(self._allocs)}", verify)

    def zeros(self, *shape: int, dtype: torch.dtype = torch.float32, name: str = "", verify: bool = True) -> torch.Tensor:
        t = self.empty(*shape, dtype=dtype, name=name, verify=verify)
        t.zero_()
        return t

    def full(self, shape: tuple[int, ...], value: float, dtype: torch.dtype = torch.float32, name: str = "") -> torch.Tensor:
        t = self.empty(*shape, dtype=dtype, name=name)
        t.fill_(value)
        return t

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32, name: str = "",
              generator: torch.Generator | None = None) -> torch.Tensor:
        t = self.empty(*shape, dtype=dtype, name=name)
        t.copy_(torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.device, dtype))
        return t

    # introspection ---------------------------------------------------------------------------
    def offset_of(self, t: torch.Tensor) -> int:
        """Byte offset of a tensor's first element inside this rank's heap."""
        off = t.data_ptr() - self._local.data_ptr()
        if not 0 <= off < self._local.numel():
            raise ValueError("tensor is not on this symmetric heap")
        return off

    def owner_of(self, offset: int) -> Allocation | None:
        """The allocation that holds a byte offset (for naming a flag in an error)."""
        for a in self._allocs:
            if a.offset <= offset < a.offset + a.nbytes:
                return a
        return None

    def contains(self, t: torch.Tensor) -> bool:
        off = t.data_ptr() - self._local.data_ptr()
        return 0 <= off < self._local.numel()

    @property
    def used(self) -> int:
        return self._top

    def peer_tensor(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        """A host-side tensor viewing `rank`'s copy of heap tensor `t` (copy engine, tests).

        `rank` is the rank in this heap's World. On GPUs it is a tensor on this rank's device
        whose memory is the peer's (reads and writes go over the peer link).
        """
        off = self.offset_of(t)
        nbytes = t.numel() * t.element_size()
        if self.provider == "torch":
            raw = self._peers[rank]
        elif self.provider == "shm":
            raw = torch.frombuffer(self._maps[rank], dtype=torch.uint8)
        elif self.provider == "symm":
            return self._handle.get_buffer(rank, tuple(t.shape), t.dtype, off // t.element_size())
        else:
            raise NotImplementedError(f"peer tensors are not available on the {self.provider} heap")
        return raw[off:off + nbytes].view(t.dtype).view(t.shape)

    def close(self) -> None:
        """Drop the mappings and the buffer; tensors from this heap become invalid.

        The torch provider first drops its views of the peers' heaps, then waits (briefly,
        best effort) for the group's other ranks to do the same before freeing its own heap, so
        no rank frees memory a peer still maps (torch would keep it and warn at exit).
        """
        self._allocs.clear()
        peers, self._peers = self._peers, []
        if self.provider == "torch" and len(peers) > 1 and dist.is_initialized():
            del peers
            with contextlib.suppress(Exception):
                Rendezvous(self.world, "torch", self.size, timeout_s=min(10.0, settings.heap_timeout_s())).all_gather(
                    "closed", None)
        self._local = None
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a tensor still views it; the mapping goes with the process
        self._maps = []
        self._handle = None


def _spans_job(world: Ranks) -> bool:
    spans = getattr(world, "spans_job", None)
    if spans is not None:
        return bool(spans)
    return not dist.is_initialized() or world.size == dist.get_world_size()
