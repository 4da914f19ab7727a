"""Symmetric heap: the same-sized region on every rank, addressable by every rank's kernels.

One class, three providers (DESIGN.md, Heap providers):
- `torch`: one torch symmetric-memory buffer per process, one rendezvous; heap bases are its
  `buffer_ptrs` (CUDA, ROCm builds of torch too).
- `iris`: Iris's own heap where `import iris` works (ROCm); optional.
- `shm`: CPU emulation: one shared-memory file per rank, mapped into every rank's process; the
  files are unlinked as soon as every rank has mapped them, so nothing is left even after a crash.

A bump allocator hands out tensors; every allocation is checked to sit at the same offset on
every rank, since kernels translate addresses by offset.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

ALIGN = 256
STATUS_WORDS = 8
DEFAULT_SIZE = {"cpu": 64 << 20, "cuda": 8 << 30}
SHM_DIR = "/dev/shm"
SHM_PREFIX = "autofuse-heap"


class HeapFull(MemoryError):
    """An allocation did not fit in the symmetric heap."""


def parse_size(text: str | int) -> int:
    """'64M', '2G', '1048576' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)i?[bB]?\s*", str(text))
    if not m:
        raise ValueError(f"cannot read heap size {text!r}: use bytes or a number with K, M or G")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def default_provider(device: torch.device) -> str:
    """'shm' on CPU, 'iris' where Iris imports on ROCm, else 'torch'."""
    if device.type == "cpu":
        return "shm"
    if getattr(torch.version, "hip", None):
        try:
            import iris  # noqa: F401

            return "iris"
        except ImportError:
            pass
    return "torch"


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
    a small int32 region at offset 0 that bounded waits write on timeout (see `autofuse.status`).
    """

    def __init__(self, world: Any, size: int | str | None = None, provider: str | None = None):
        self.world = world
        env = os.environ.get("AUTOFUSE_HEAP_SIZE")
        self.size = parse_size(size if size is not None else env if env else DEFAULT_SIZE[world.device.type])
        self.provider = provider or os.environ.get("AUTOFUSE_HEAP_PROVIDER") or default_provider(world.device)
        self._top = 0
        self._allocs: list[Allocation] = []
        self._keep: list[Any] = []
        if self.provider == "shm":
            self._open_shm()
        elif self.provider == "torch":
            self._open_torch()
        elif self.provider == "iris":
            self._open_iris()
        else:
            raise ValueError(f"unknown heap provider {self.provider!r}: use torch, shm or iris")
        self.status = self.zeros(STATUS_WORDS, dtype=torch.int32, name="status")

    # providers -------------------------------------------------------------------------------
    def _open_shm(self) -> None:
        w = self.world
        if w.device.type != "cpu":
            raise ValueError("the shm heap provider emulates GPUs on CPU; use torch or iris on GPUs")
        tag = [uuid.uuid4().hex[:12] if w.rank == 0 else None]
        dist.broadcast_object_list(tag, src=w.global_ranks[0], group=w.group)
        paths = [os.path.join(SHM_DIR, f"{SHM_PREFIX}-{tag[0]}-{r}") for r in range(w.size)]
        fd = os.open(paths[w.rank], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.size)
        finally:
            os.close(fd)
        dist.barrier(group=w.group)
        maps = []
        try:
            for p in paths:
                fd = os.open(p, os.O_RDWR)
                try:
                    maps.append(mmap.mmap(fd, self.size))
                finally:
                    os.close(fd)
        finally:
            dist.barrier(group=w.group)
            os.unlink(paths[w.rank])  # every rank has mapped it: the mappings outlive the name
        self._maps = maps
        self._local = torch.frombuffer(maps[w.rank], dtype=torch.uint8)
        addrs = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in maps]
        self.bases = torch.tensor(addrs, dtype=torch.int64)
        self.paths = paths

    def _open_torch(self) -> None:
        import torch.distributed._symmetric_memory as symm

        w = self.world
        buf = symm.empty(self.size, dtype=torch.uint8, device=w.device)
        group_name = (w.group if w.group is not None else dist.group.WORLD).group_name
        handle = symm.rendezvous(buf, group_name)
        self._local = buf
        self._handle = handle
        self.bases = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=w.device)

    def _open_iris(self) -> None:
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
                f"{self.size} B ({self._top} B used); raise AUTOFUSE_HEAP_SIZE (e.g. {2 * self.size >> 20}M)"
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
        """A host-side tensor viewing `rank`'s copy of heap tensor `t` (copy engine, tests)."""
        off = self.offset_of(t)
        if self.provider == "torch":
            return self._handle.get_buffer(rank, tuple(t.shape), t.dtype, off // t.element_size())
        if self.provider == "shm":
            raw = torch.frombuffer(self._maps[rank], dtype=torch.uint8)
            return raw[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        raise NotImplementedError(f"peer tensors are not available on the {self.provider} heap")

    def close(self) -> None:
        """Drop the mappings (shm) or the buffer (torch); tensors from this heap become invalid."""
        self._allocs.clear()
        self._local = None
        if self.provider == "shm":
            for m in getattr(self, "_maps", []):
                try:
                    m.close()
                except BufferError:
                    pass  # a tensor still views it; the mapping goes with the process
            self._maps = []
        self._handle = None
