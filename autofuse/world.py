"""World: the ranks an op runs on, and how they are started.

One process per GPU (NCCL) or, without GPUs, one process per emulated rank (gloo + the `shm`
heap + Triton's interpreter). `spawn` starts N local ranks itself and fails cleanly when any of
them fails; `World.from_env` joins a job started by `torchrun`.
"""
from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank of a spawned job raised, died or timed out; carries which rank and why."""

    def __init__(self, rank: int, reason: str):
        super().__init__(f"rank {rank} failed: {reason}")
        self.rank = rank
        self.reason = reason


def gpu_count() -> int:
    """Number of local CUDA (or ROCm) devices, 0 where there are none."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_device_kind() -> str:
    """'cuda' where local GPUs exist, else 'cpu' (the emulation)."""
    return "cuda" if gpu_count() > 0 else "cpu"


@dataclass
class World:
    """A process group as seen from one rank: its rank, size, device, backend and heap.

    `group` is None for the default (whole-job) group. `heap` is created on first use, one
    symmetric heap per World, since symmetric offsets only agree among the ranks that allocate.
    """

    rank: int
    size: int
    device: torch.device
    backend: str
    group: Any = None
    global_ranks: tuple[int, ...] = ()
    _heap: Any = field(default=None, repr=False)
    _subs: dict = field(default_factory=dict, repr=False)

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def heap(self):
        """This World's symmetric heap (created collectively on first access)."""
        if self._heap is None:
            from autofuse.heap import SymmetricHeap

            self._heap = SymmetricHeap(self)
        return self._heap

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def sync(self) -> None:
        """Finish this rank's device work, then wait for every rank of the group (the host-side barrier)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def sub(self, size: int) -> "World | None":
        """The sub-World of the first `size` ranks (collective: every rank must call it).

        Returns None on the ranks outside it. Sub-Worlds are cached, so calling again is free.
        """
        if size == self.size:
            return self
        if not 1 <= size <= self.size:
            raise ValueError(f"sub-world size {size} must be in 1..{self.size}")
        if size not in self._subs:
            ranks = list(self.global_ranks[:size])
            group = dist.new_group(ranks=ranks, backend=self.backend)
            if self.rank < size:
                self._subs[size] = World(self.rank, size, self.device, self.backend, group, tuple(ranks))
            else:
                self._subs[size] = None
        return self._subs[size]

    def close(self) -> None:
        """Release the heap and this World's sub-Worlds (the process group stays to its owner)."""
        for sub in self._subs.values():
            if sub is not None and sub is not self:
                sub.close()
        self._subs.clear()
        if self._heap is not None:
            self._heap.close()
            self._heap = None

    @classmethod
    def from_group(cls, group: Any = None) -> "World":
        """The World of an initialised torch.distributed group (None: the default group)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: start the job with torchrun, "
                "call autofuse.world.init_from_env(), or use autofuse.world.spawn()"
            )
        backend = str(dist.get_backend(group))
        rank = dist.get_rank(group)
        size = dist.get_world_size(group)
        if group is None:
            ranks = tuple(range(size))
        else:
            ranks = tuple(dist.get_process_group_ranks(group))
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        return cls(rank, size, device, backend, group, ranks)


def _backend_for(device_kind: str) -> str:
    return "nccl" if device_kind == "cuda" else "gloo"


def init_from_env(device_kind: str | None = None, timeout_s: float = 300.0) -> World:
    """Join a job whose ranks were started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
    device_kind = device_kind or default_device_kind()
    rank = int(os.environ["RANK"])
    size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return _init(rank, size, local_rank, device_kind, "env://", timeout_s)


def _init(rank: int, size: int, local_rank: int, device_kind: str, init_method: str, timeout_s: float) -> World:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    backend = _backend_for(device_kind)
    kwargs: dict[str, Any] = {}
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **kwargs,
        )
    return World.from_group(None)


def free_port() -> int:
    """A TCP port on loopback that is free right now (for the rendezvous of spawned ranks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(local_rank: int, size: int, port: int, device_kind: str, fn: Callable, args: tuple,
               results: Any, timeout_s: float) -> None:
    world = None
    try:
        world = _init(local_rank, size, local_rank, device_kind, f"tcp://127.0.0.1:{port}", timeout_s)
        out = fn(world, *args)
        results.put((local_rank, "ok", out))
    except BaseException as exc:  # reported to the launcher, then re-raised so the process fails
        results.put((local_rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise
    finally:
        if world is not None:
            world.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def spawn(fn: Callable[..., Any], size: int, *args: Any, device_kind: str | None = None,
          timeout_s: float = 600.0) -> list[Any]:
    """Run `fn(world, *args)` on `size` local ranks; return each rank's result, rank order.

    GPUs: one process per GPU with NCCL. CPU: `size` processes with gloo and Triton's
    interpreter (TRITON_INTERPRET=1 is set for the children). If any rank raises or dies, the
    others are terminated and `RankFailed` names the first rank that failed and why; past
    `timeout_s` every rank is terminated and `RankFailed` says so. Never waits without bound.
    """
    device_kind = device_kind or default_device_kind()
    if device_kind == "cuda" and size > gpu_count():
        raise ValueError(f"asked for {size} ranks but only {gpu_count()} GPUs are visible")
    if size < 1:
        raise ValueError("world size must be >= 1")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, size, port, device_kind, fn, args, results, timeout_s),
                    daemon=False)
        for r in range(size)
    ]
    saved = os.environ.get("TRITON_INTERPRET")
    if device_kind == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # children read it when their kernels are imported
    try:
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    failure: RankFailed | None = None
    try:
        while len(outcomes) < size:
            while not results.empty():
                rank, status, payload = results.get()
                outcomes[rank] = (status, payload)
                if status == "error" and failure is None:
                    failure = RankFailed(rank, payload)
            if failure is not None:
                break
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcomes]
            if dead:
                time.sleep(0.2)  # a dying rank may still be flushing its error report
                if results.empty():
                    r = dead[0]
                    failure = RankFailed(r, f"process exited with code {procs[r].exitcode} without reporting")
                    break
                continue
            if time.monotonic() > deadline:
                missing = sorted(set(range(size)) - set(outcomes))
                failure = RankFailed(missing[0] if missing else 0,
                                     f"job exceeded its {timeout_s:.0f} s limit; ranks {missing} never finished")
                break
            time.sleep(0.02)
    finally:
        _stop(procs, grace_s=0.0 if failure else 30.0)
    if failure is not None:
        raise failure
    return [outcomes[r][1] for r in range(size)]


def _stop(procs: Sequence[Any], grace_s: float) -> None:
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
