"""World: the ranks an op runs on, and how they are started.

One process per GPU (NCCL) or, without GPUs, one process per emulated rank (gloo + the `shm`
heap + Triton's interpreter). `spawn` starts N local ranks itself and fails cleanly when any of
them fails; `init_from_env` joins a job started by `torchrun`.

Groups: `World.from_group(group)` wraps any torch process group (user code's TP group inside DP,
say), `World.of_ranks(ranks)` and `World.sub(size)` create one (collectively over the job, as
torch requires). All three cache per process group, so a group has one World and one symmetric
heap whichever way it is reached, and heaps of different groups may be created on different
ranks in any order (see autofuse.comm.heap for why that needs autofuse's own rendezvous).

Several ranks on one GPU (tests and diagnostics only): with `ranks_per_gpu` > 1 (spawn's argument,
or AUTOFUSE_RANKS_PER_GPU for spawn and init_from_env), a job of more ranks than visible GPUs puts
its ranks on the GPUs round-robin, each rank its own process and CUDA context. NCCL refuses two
ranks on one device, so such a job runs its host-side collectives on gloo (CUDA tensors are fine
for it) and its Worlds say `shares_gpu`: the heap is the CUDA-IPC one (provider `torch`; torch's
symmetric memory refuses ranks that share a device), `torch_symm` variants are unavailable, BSP runs
on gloo (eagerly: gloo collectives cannot be captured in a CUDA graph), and nothing is timed
(autofuse.measure.timing refuses; dispatch does not confirm by measuring). Kernels of the ranks run
side by side on the GPU (their spin-waits see each other's stores), so correctness and fault
behaviour can be checked there; timings cannot, since the contexts time-slice the GPU.
"""
from __future__ import annotations

import contextlib
import datetime
import multiprocessing.connection
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autofuse.comm import rounds
from autofuse.core import settings


# torch.distributed's tensor collectives under the names the installed torch wants (2.13 renamed them)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

class RankFailed(RuntimeError):
    """A rank of a spawned job raised, died or timed out; carries which rank and why."""

    def __init__(self, rank: int, reason: str):
        super().__init__(f"rank {rank} failed: {reason}")
        self.rank = rank
        self.reason = reason


def gpu_count() -> int:
    """Number of local CUDA (or ROCm) devices, 0 where there are none."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_plan(size: int, ranks_per_gpu: int = 1, gpus: int | None = None) -> list[int]:
    """The GPU index of each of `size` local ranks: one GPU each where there are enough, else (with
    ranks_per_gpu > 1) round-robin over the visible GPUs, at most `ranks_per_gpu` ranks on one. Raises
    ValueError, saying what to set, where they do not fit."""
    gpus = gpu_count() if gpus is None else gpus
    if size > gpus * ranks_per_gpu:
        hint = (f" with at most {ranks_per_gpu} ranks per GPU" if ranks_per_gpu > 1 else
                f"; for tests and diagnostics, AUTOFUSE_RANKS_PER_GPU={-(-size // max(gpus, 1))} lets ranks share "
                "them (no timing)" if gpus else "")
        raise ValueError(f"asked for {size} ranks but only {gpus} GPUs are visible{hint}")
    return [r % min(size, gpus) for r in range(size)]


def default_device_kind() -> str:
    """'cuda' where local GPUs exist, else 'cpu' (the emulation)."""
    return "cuda" if gpu_count() > 0 else "cpu"


_cache: dict[int, tuple[Any, "World"]] = {}  # id(process group) -> (the group, its World)
_made: dict[tuple[int, ...], Any] = {}  # groups autofuse created (World.of_ranks), by global ranks
_cache_job: list[Any] = [None]  # the default group the two caches belong to
_shares_gpu: list[bool] = [False]  # this process joined a job whose ranks share GPUs (autofuse's launchers)


def _fresh_caches() -> None:
    """Forget cached Worlds and groups of an earlier job (the default group was re-created)."""
    job = dist.group.WORLD
    if _cache_job[0] is not job:
        _cache.clear()
        _made.clear()
        _cache_job[0] = job


@dataclass
class World:
    """A process group as seen from one rank: its rank, size, device, backend and heap.

    `group` is None for the default (whole-job) group. `shares_gpu`: its ranks may share GPUs (a job
    started with several ranks per GPU, see the module doc: gloo, the IPC heap, no timing). `heap` is
    created on first use, one
    symmetric heap per World, since symmetric offsets only agree among the ranks that allocate.
    Worlds made by `from_group`, `of_ranks` and `sub` are cached per process group, so one group
    has one World and one heap however it is reached (the launcher's World, `from_group(None)`,
    dispatch's `group=`, the tuner's `sub`).
    """

    rank: int
    size: int
    device: torch.device
    backend: str
    group: Any = None
    global_ranks: tuple[int, ...] = ()
    shares_gpu: bool = False
    _heap: Any = field(default=None, repr=False)
    broken: str | None = field(default=None, repr=False)  # why collectives are refused (see `collective`)

    @property
    def spans_job(self) -> bool:
        """True if this World holds every rank of the job (what torch's own symmetric memory needs)."""
        return not dist.is_initialized() or self.size == dist.get_world_size()

    @property
    def heap(self):
        """This World's symmetric heap (created collectively on first access, bounded by
        AUTOFUSE_HEAP_TIMEOUT; see autofuse.comm.heap)."""
        if self._heap is None:
            from autofuse.comm.heap import SymmetricHeap

            with torch.inference_mode(False):  # it outlives the caller's mode (see Variant.build)
                self._heap = SymmetricHeap(self)
        return self._heap

    def barrier(self) -> None:
        """Wait for every rank of this World (host side only)."""
        if "nccl" in self.backend and self.device.type == "cuda" and self.device.index is not None:
            dist.barrier(group=self.group, device_ids=[self.device.index])
        else:
            dist.barrier(group=self.group)

    def sync(self) -> None:
        """Finish this rank's device work, then wait for every rank of this World.

        The host-side fence between phases that touch peers' memory (before and after a
        kernel that reads or writes the heap without its own flags, around timing loops).
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.barrier()

    def collective(self, fn: Callable[..., Any], *args: Any, what: str = "collective", **kwargs: Any) -> None:
        """Run the torch.distributed collective `fn(*args, group=<this World's group>, **kwargs)` (what bsp
        variants call), bounded. On gloo (the CPU emulation, ranks sharing a GPU) the wait gives up after
        the flag-wait budget (AUTOFUSE_WAIT_TIMEOUT) with CollectiveTimeout, and this World refuses every
        later collective (the group is unusable: a late peer's call would pair with the abandoned one).
        On NCCL the host does not wait (it runs on the stream): the process group's timeout bounds it
        (NCCL's watchdog), so the hot path gains no host synchronisation."""
        if "nccl" in self.backend:
            fn(*args, group=self.group, **kwargs)
            return
        from autofuse.comm.status import CollectiveTimeout
        from autofuse.core.settings import wait_timeout_s

        if self.broken:
            raise CollectiveTimeout(self.broken)
        work = fn(*args, group=self.group, async_op=True, **kwargs)
        budget = wait_timeout_s(self.device.type)
        stop = self._wait_bounded(work, budget)
        if stop is None:
            return
        origin, said = stop
        if origin is None:
            self.broken = (f"{what}: rank {self.rank}'s collective did not complete within {budget:g} s "
                           f"(AUTOFUSE_WAIT_TIMEOUT; {said}): a peer did not take part (it skipped the call, made "
                           "another op's call or died). This process group cannot be used any more: restart the job")
        else:
            self.broken = (f"{what}: rank {self.rank} stopped because rank {origin} did not take part in this "
                           f"collective: it {said}. This process group cannot be used any more: restart the job")
        if origin is not None:
            with contextlib.suppress(Exception):  # the rank that stopped it waits for this rank's part of its round
                rounds.join(self, rounds.current(self), {"ok": False, "launched": True,
                                                         "why": f"CollectiveTimeout: {self.broken}"})
        raise CollectiveTimeout(self.broken)

    def _wait_bounded(self, work: Any, budget: float) -> tuple[int | None, str] | None:
        """Wait for a gloo collective: None once it completes; (rank, what it did) when a peer stopped it
        from its round (comm/rounds.py) and it did not complete within rounds.GRACE_S more; (None, why)
        when `budget` seconds pass first."""
        deadline = time.monotonic() + budget
        origin = None
        while True:
            left = deadline - time.monotonic()
            try:
                work.wait(timeout=datetime.timedelta(seconds=max(0.001, min(left, rounds.POLL_S))))
                return None
            except Exception as exc:  # noqa: BLE001 - gloo's timeout error type differs across torch versions
                if time.monotonic() >= deadline:
                    if origin is not None:
                        break
                    return None, type(exc).__name__
            if origin is None:
                with contextlib.suppress(Exception):
                    origin = rounds.stopper(self, rounds.current(self))
                if origin is not None:  # the peer may have finished its part just before: give ours time to end
                    deadline = min(deadline, time.monotonic() + rounds.GRACE_S)
        n = rounds.current(self)
        try:
            said = rounds.what(rounds.entry_of(self, n, origin))
        except Exception:  # noqa: BLE001 - the store is gone (the job ends)
            said = "did not say why"
        return origin, said

    def rank_max(self, value: float) -> float:
        """The largest of every rank's `value` (collective: every rank calls it): how the ranks agree
        on a verdict (1.0 where a rank failed), a count or a rank-max time."""
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def sub(self, size: int) -> "World | None":
        """The World of this World's first `size` ranks; None on the ranks outside it.

        Creates a process group, which torch needs every rank of the job to do together and in
        the same order: call it on every rank, on a World that spans the job. Cached: calling
        again (from any World of the job) returns the same World and heap.
        """
        if size == self.size:
            return self
        if not 1 <= size <= self.size:
            raise ValueError(f"sub-world size {size} must be in 1..{self.size}")
        if not self.spans_job:
            raise ValueError(
                f"World.sub({size}) on a {self.size}-rank World of a {dist.get_world_size()}-rank job: creating a "
                "group needs every rank of the job, and the ranks outside this World do not call it. Call "
                "World.of_ranks(ranks) on every rank of the job instead"
            )
        return World.of_ranks(self.global_ranks[:size])

    @classmethod
    def of_ranks(cls, ranks: Sequence[int]) -> "World | None":
        """The World of these global ranks; None on ranks outside them (collective over the job).

        Every rank of the job must call it with the same ranks, in the same order as its other
        group creations (torch.distributed.new_group's rule). Cached by ranks.
        """
        _require_dist()
        _fresh_caches()
        job = dist.get_world_size()
        key = tuple(sorted({int(r) for r in ranks}))
        if not key or key[0] < 0 or key[-1] >= job:
            raise ValueError(f"ranks {list(ranks)} must be a non-empty subset of 0..{job - 1}")
        if key == tuple(range(job)):
            return cls.from_group(None)
        group = _made.get(key)
        if group is None:
            group = _made[key] = dist.new_group(ranks=list(key))
        if dist.get_rank() not in key:
            return None
        return cls.from_group(group)

    def close(self) -> None:
        """Release this World's heap; on the default group's World, every cached World's heap too.

        The process groups stay to their owner. Heaps are created again on next use.
        """
        worlds = [self]
        if self.group is None:
            worlds += [w for _, w in _cache.values() if w is not self]
            _cache.clear()
            _made.clear()
        else:
            for key, (_, w) in list(_cache.items()):
                if w is self:
                    del _cache[key]
        for w in sorted(worlds, key=lambda w: (w.global_ranks, str(_group_name(w)))):  # one order on every rank
            if w._heap is not None:
                heap, w._heap = w._heap, None
                heap.close()

    @classmethod
    def from_group(cls, group: Any = None) -> "World":
        """The World of an initialised torch.distributed group (None: the default group).

        Cached per group: the same group always gives the same World, hence the same heap.
        Not collective (the heap, on first use, is collective over the group's ranks).
        """
        _require_dist()
        _fresh_caches()
        pg = dist.group.WORLD if group is None else group
        if isinstance(pg, int) or dist.get_rank(pg) < 0:  # new_group gives non-members an int marker
            raise ValueError(
                f"global rank {dist.get_rank()} is not a member of this process group: "
                "only its members can make its World"
            )
        hit = _cache.get(id(pg))
        if hit is not None and hit[0] is pg:
            return hit[1]
        backend = str(dist.get_backend(pg))
        rank = dist.get_rank(pg)
        size = dist.get_world_size(pg)
        if pg is dist.group.WORLD:
            ranks = tuple(range(size))
        else:
            ranks = tuple(dist.get_process_group_ranks(pg))
        shares = _shares_gpu[0] and backend == "gloo"
        cuda = "nccl" in backend or shares
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        world = cls(rank, size, device, backend, None if pg is dist.group.WORLD else pg, ranks, shares)
        _cache[id(pg)] = (pg, world)  # holding the group keeps its id unique
        return world


def _group_name(world: World) -> str:
    try:
        return (world.group if world.group is not None else dist.group.WORLD).group_name
    except Exception:
        return ""


def _require_dist() -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: start the job with torchrun, "
            "call autofuse.comm.world.init_from_env(), or use autofuse.comm.world.spawn()"
        )


def _backend_for(device_kind: str) -> str:
    return "nccl" if device_kind == "cuda" else "gloo"


def init_from_env(device_kind: str | None = None, timeout_s: float = 300.0) -> World:
    """Join a job whose ranks were started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, ...); with
    AUTOFUSE_RANKS_PER_GPU > 1, the node's LOCAL_WORLD_SIZE ranks may share its GPUs (module doc)."""
    device_kind = device_kind or default_device_kind()
    rank = int(os.environ["RANK"])
    size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    index, shared = local_rank, False
    if device_kind == "cuda":
        plan = device_plan(int(os.environ.get("LOCAL_WORLD_SIZE", size)), settings.ranks_per_gpu())
        index, shared = plan[local_rank], len(set(plan)) < len(plan)
    return _init(rank, size, index, device_kind, "env://", timeout_s, shared)


def _init(rank: int, size: int, device_index: int, device_kind: str, init_method: str, timeout_s: float,
          shares_gpu: bool = False) -> World:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    backend = "gloo" if shares_gpu else _backend_for(device_kind)  # NCCL refuses two ranks on one device
    _shares_gpu[0] = shares_gpu
    kwargs: dict[str, Any] = {}
    if device_kind == "cuda":
        torch.cuda.set_device(device_index)
        if not shares_gpu:
            kwargs["device_id"] = torch.device("cuda", device_index)
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


class _Environ:
    """The launcher's environment, put in place as the rank unpickles it: a forkserver child starts with the
    fork server's environment, not the launcher's current one, and this comes first in the rank's arguments,
    so the launcher's settings hold before the job's function and arguments are unpickled (and import what
    they need)."""

    def __init__(self, values: dict[str, str]):
        self.values = values

    def __getstate__(self) -> dict[str, str]:
        return self.values

    def __setstate__(self, values: dict[str, str]) -> None:
        self.values = values
        os.environ.clear()
        os.environ.update(values)


# imported once by the fork server, so a CPU rank starts in milliseconds instead of importing them again
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "triton", "autofuse.comm.world")


def _context(device_kind: str, start_method: str | None) -> Any:
    """The multiprocessing context ranks start from: `start_method` if given; else a fork server for CPU
    ranks (their imports are the start's cost: about 2 s a rank on a small host) and fresh interpreters
    for GPU ranks (nothing CUDA-related is ever forked)."""
    if start_method not in (None, "spawn", "forkserver"):
        raise ValueError(f"start_method {start_method!r}: use 'spawn', 'forkserver' or None (forkserver on CPU, spawn on "
                         f"GPUs); 'fork' would copy this process's torch and CUDA state into every rank")
    method = start_method or ("forkserver" if device_kind == "cpu" and "forkserver" in mp.get_all_start_methods()
                              else "spawn")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


def _rank_main(environ: _Environ, local_rank: int, size: int, port: int, device_kind: str, fn: Callable,
               args: tuple, results: Any, timeout_s: float, device_index: int, shares_gpu: bool) -> None:
    world = None
    try:
        world = _init(local_rank, size, device_index, device_kind, f"tcp://127.0.0.1:{port}", timeout_s, shares_gpu)
        out = fn(world, *args)
        results.send(("ok", out))
    except BaseException as exc:  # reported to the launcher, then re-raised so the process fails
        results.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise
    finally:
        results.close()
        if world is not None:
            world.close()
        _leave_store(local_rank, size)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


LEAVE_WAIT_S = 10.0  # how long the store's rank waits for the others to leave it (a dead peer never does)


def _leave_store(rank: int, size: int) -> None:
    """The job's store lives in rank 0's process: rank 0 exits only once every rank has left it (or after
    LEAVE_WAIT_S), so a peer still in a store exchange (a refusal, an agreement) never finds the store gone."""
    if not dist.is_initialized():
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        store.add("autofuse/spawn/left", 1)
        deadline = time.monotonic() + LEAVE_WAIT_S
        while rank == 0 and store.add("autofuse/spawn/left", 0) < size and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - a store already gone (rank 0 died) leaves nothing to wait for
        pass


@contextlib.contextmanager
def temporary_env(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ while the block runs, each variable restored (or removed) after: what
    ranks started inside it read at their start (`spawn` passes its children's settings this way)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn(fn: Callable[..., Any], size: int, *args: Any, device_kind: str | None = None,
          timeout_s: float = 600.0, ranks_per_gpu: int | None = None, start_method: str | None = None) -> list[Any]:
    """Run `fn(world, *args)` on `size` local ranks; return each rank's result, rank order.

    GPUs: one process per GPU with NCCL; with more ranks than GPUs and `ranks_per_gpu` > 1 (default
    AUTOFUSE_RANKS_PER_GPU, else 1), up to that many ranks share each GPU, round-robin, with gloo
    (module doc: for tests and diagnostics; nothing is timed). CPU: `size` processes with gloo and
    Triton's interpreter (TRITON_INTERPRET=1 is set for the children). If any rank raises or dies,
    the others are terminated and `RankFailed` names the first rank that failed and why; past
    `timeout_s` every rank is terminated and `RankFailed` says so. Never waits without bound.

    Ranks start from a fork server on CPU (torch and Triton imported once, not once per rank) and as
    fresh interpreters on GPUs; `start_method` ("spawn", "forkserver") overrides it, e.g. "spawn" where a
    rank must be a child of this process (`autofuse tune`'s ranks die with it). Either way a rank sees
    this process's environment as it was when `spawn` was called, plus what spawn sets for it.
    """
    device_kind = device_kind or default_device_kind()
    if size < 1:
        raise ValueError("world size must be >= 1")
    devices, shared = list(range(size)), False
    if device_kind == "cuda":
        devices = device_plan(size, settings.ranks_per_gpu() if ranks_per_gpu is None else ranks_per_gpu)
        shared = len(set(devices)) < size
    ctx = _context(device_kind, start_method)
    # one pipe per rank, not a multiprocessing queue: a queue's locks are named semaphores
    # (/dev/shm/sem.mp-*) that a killed job would leave behind
    pipes = [ctx.Pipe(duplex=False) for _ in range(size)]
    port = free_port()
    child_env = {}  # what the children read from the environment at start
    if device_kind == "cpu":
        child_env["TRITON_INTERPRET"] = "1"  # read when their kernels are imported
    if shared and ranks_per_gpu is not None:
        child_env["AUTOFUSE_RANKS_PER_GPU"] = str(ranks_per_gpu)  # their settings say what the job does
    environ = _Environ({**os.environ, **child_env})
    procs = [
        ctx.Process(target=_rank_main, args=(environ, r, size, port, device_kind, fn, args, pipes[r][1], timeout_s,
                                             devices[r], shared), daemon=False)
        for r in range(size)
    ]
    try:
        with temporary_env(child_env):
            for p in procs:
                p.start()
    finally:
        for _, sender in pipes:
            sender.close()  # the children hold the sending ends; a dead child's pipe then reads EOF
    readers = {p[0]: r for r, p in enumerate(pipes)}
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    failure: RankFailed | None = None
    try:
        while len(outcomes) < size and failure is None:
            for conn in multiprocessing.connection.wait(list(readers), timeout=0.05):
                rank = readers.pop(conn)
                try:
                    outcomes[rank] = conn.recv()
                except EOFError:  # exited without reporting
                    procs[rank].join(timeout=5)
                    failure = failure or RankFailed(
                        rank, f"process exited with code {procs[rank].exitcode} without reporting")
                    continue
                if outcomes[rank][0] == "error":
                    failure = failure or RankFailed(rank, outcomes[rank][1])
            if failure is None and time.monotonic() > deadline:
                missing = sorted(set(range(size)) - set(outcomes))
                failure = RankFailed(missing[0] if missing else 0,
                                     f"job exceeded its {timeout_s:.0f} s limit; ranks {missing} never finished")
    finally:
        _stop(procs, grace_s=0.0 if failure else 30.0)
        for conn in [p[0] for p in pipes]:
            conn.close()
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
