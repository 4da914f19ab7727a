"""Compiling a run's configs ahead of their measurement, in child processes, so the GPUs never wait on a compile.

Triton compiles a kernel on its first launch; in a tuning run that happens inside `measure`'s first
call, on every rank at once, while the GPUs idle. The ranks cannot build configs on a thread ahead
of time (a build allocates on the symmetric heap, which every rank must do in the same order), but
Triton's compiled kernels live in its on-disk cache, shared by every process of the user: a child
process that compiles a config's kernels there makes the ranks' first call a cache load.

- `CompileAhead(workers, ...)` (rank 0): worker processes fed every known-good config the run will
  measure, in the order the scheduler will measure them (`submit`); `reached(...)` tells it which
  config the ranks reached, so that workers skip what is already behind. Sampled configs asked ahead
  in the search come later, one at a time (`submit(..., ordered=False)`): the search takes them in its
  own order, so reaching one skips nothing, and each is compiled (a worker may still be at it when the ranks
  reach it: they then compile it too, as without compiling ahead); `close()` stops them and
  returns counts (compiled, failed, skipped) and the workers' seconds. Failures of any kind (a
  config the stand-in cannot build, a worker that dies) are counted and otherwise ignored: the ranks
  then compile that config themselves, as without compiling ahead.
- `compile_config` (the default compile function, CUDA): builds the variant's runner against a
  `stand_in_world` (the problem's rank count, this GPU, a one-process gloo group for the few host
  collectives a build makes, and a `StandInHeap` whose allocations are plain device tensors at the
  offsets the real heap would give them) and calls it with Triton's JIT in compile-only mode
  (`JITFunction.run(..., warmup=True)`: compiled into the cache, never launched), once as each
  rank (a rank's index is a kernel argument Triton may specialise on). Generic over the registry:
  nothing names an op or a kernel.
- Off by default on CPU (the interpreter compiles nothing: `default_workers`); tests give a
  `compile_fn` ('module:function', called as compile_fn(op_ref, problem_key, variant, config,
  device_kind)) that records what it was fed, or fails.
"""
from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import queue as queue_mod
import signal
import time
from typing import Any, Callable, Iterator, Sequence

from autofuse.core.op import Config, Op, Problem, config_key

DEFAULT_FN = "autofuse.tuning.compile_ahead:compile_config"
MAX_WORKERS = 8
CLOSE_GRACE_S = 1.0  # how long `close` lets the workers end on SIGTERM before it kills them


def default_workers(ranks: int, cores: int | None = None) -> int:
    """Workers where nobody asked: the cores the ranks leave idle (one kept for the host), up to MAX_WORKERS."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return max(0, min(MAX_WORKERS, cores - ranks - 1))


def _resolve(ref: str) -> Callable[..., Any]:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _worker(jobs: Any, results: Any, reached: Any, fn_ref: str, device_kind: str, index: int, parent: int) -> None:
    """A worker process: compile jobs (seq, op_ref, problem_key, variant, config) until the None sentinel,
    skipping those the ranks already reached; report (seq, ok, seconds, error) for each."""
    from autofuse.tuning.lifecycle import die_with_parent

    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run's Ctrl-C is the ranks' business
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a supervised rank ignores SIGTERM; its workers must not
    try:
        fn = _resolve(fn_ref)
        if device_kind == "cuda":
            import torch

            torch.cuda.set_device(index % max(1, torch.cuda.device_count()))
    except Exception as exc:  # noqa: BLE001 - reported, then the worker ends
        results.put((-1, False, 0.0, f"worker start: {type(exc).__name__}: {exc}"))
        return
    while True:
        job = jobs.get()
        if job is None:
            return
        seq, op_ref, key, variant, config, ordered = job
        if ordered and seq <= reached.value:
            results.put((seq, None, 0.0, "reached"))
            continue
        t0 = time.perf_counter()
        try:
            fn(op_ref, key, variant, config, device_kind)
            results.put((seq, True, time.perf_counter() - t0, ""))
        except BaseException as exc:  # noqa: BLE001 - counted; the rank compiles it itself
            results.put((seq, False, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"[:300]))


class CompileAhead:
    """Rank 0's compile-ahead workers (see the module docstring)."""

    def __init__(self, workers: int, device_kind: str = "cuda", compile_fn: str | None = None,
                 op_refs: dict[str, str] | None = None, start: bool = True):
        ctx = multiprocessing.get_context("spawn")
        self.jobs, self.results = ctx.Queue(), ctx.Queue()
        self.reached_seq = ctx.RawValue("q", -1)
        self.op_refs = dict(op_refs or {})
        self.seq: dict[tuple, int] = {}
        self.unordered: set[int] = set()  # seqs of configs submitted with ordered=False
        self.counts = {"compile_submitted": 0, "compile_sampled": 0, "compiled": 0, "compile_failed": 0,
                       "compile_skipped": 0, "compile_ahead_s": 0.0}
        self.errors: list[str] = []
        self.procs = [ctx.Process(target=_worker, args=(self.jobs, self.results, self.reached_seq,
                                                        compile_fn or DEFAULT_FN, device_kind, i, os.getpid()),
                                  daemon=True, name=f"autofuse-compile-{i}") for i in range(workers)]
        if start:
            self.start()

    def start(self) -> None:
        """Start the worker processes (each imports torch first: seconds)."""
        for p in self.procs:
            if p.pid is None:
                p.start()

    def wait(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until every submitted config has a result; whether all have."""
        end = time.monotonic() + timeout_s
        while self._settled() < len(self.seq) and time.monotonic() < end:
            try:
                self._count(*self.results.get(timeout=0.1))
            except queue_mod.Empty:
                pass
        return self._settled() >= len(self.seq)

    def _settled(self) -> int:
        return self.counts["compiled"] + self.counts["compile_failed"] + self.counts["compile_skipped"]

    def _key(self, op: str, problem: str, variant: str, config: Config) -> tuple:
        return (op, problem, variant, config_key(config))

    def submit(self, items: Sequence[tuple[Op, Problem, str, Config]], ordered: bool = True) -> int:
        """Queue configs to compile (each once); returns how many were new. `ordered`: in the order the ranks
        will reach them (reaching one skips those before it); False: sampled configs asked ahead, which the
        search reaches in its own order (never skipped)."""
        new = 0
        for op, problem, variant, config in items:
            key = self._key(op.name, problem.key, variant, config)
            if key in self.seq:
                continue
            self.seq[key] = len(self.seq)
            if not ordered:
                self.unordered.add(self.seq[key])
            self.jobs.put((self.seq[key], self.op_refs.get(op.name, op.name), problem.key, variant, dict(config),
                           ordered))
            new += 1
        self.counts["compile_submitted"] += new
        if not ordered:
            self.counts["compile_sampled"] += new
        return new

    def reached(self, op: str, problem: str, variant: str, config: Config) -> None:
        """The ranks are about to measure this config: workers skip it and everything queued before it."""
        seq = self.seq.get(self._key(op, problem, variant, config))
        if seq is not None and seq not in self.unordered and seq > self.reached_seq.value:
            self.reached_seq.value = seq
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                self._count(*self.results.get_nowait())
            except (queue_mod.Empty, OSError, EOFError, ValueError):
                return

    def _count(self, seq: int, ok: bool | None, seconds: float, error: str) -> None:
        self.counts["compile_ahead_s"] += seconds
        if ok is None:
            self.counts["compile_skipped"] += 1
        elif ok:
            self.counts["compiled"] += 1
        else:
            self.counts["compile_failed"] += seq >= 0  # seq -1: a worker that could not start
            if len(self.errors) < 5:
                self.errors.append(error)

    def close(self) -> dict[str, Any]:
        """Stop the workers (a compile in flight is dropped: the run no longer needs it); the counts.
        A worker still alive a moment after SIGTERM is killed: waiting on it only delays the run's end."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        end = time.monotonic() + CLOSE_GRACE_S
        for p in self.procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._drain()
        for q in (self.jobs, self.results):
            q.cancel_join_thread()
            q.close()
        return dict(self.counts, compile_errors=list(self.errors))


# -- the default compile function: a stand-in World, Triton in compile-only mode -------------------------

@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """Every Triton JIT launch in this block compiles its kernel (into the on-disk cache) and returns
    without launching it."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["warmup"] = True
        return original(self, *args, **kwargs)

    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = original


class StandInHeap:
    """What a build sees of a World's symmetric heap, in one process: every allocation a plain tensor on
    this device at the offset the real heap would give it (so offsets, alignments and kernel arguments
    match); every rank's base is this process's one, since nothing is launched."""

    def __init__(self, world: Any):
        import torch

        from autofuse.comm.heap import ALIGN, STATUS_WORDS

        self.world, self.provider, self.align = world, "torch", ALIGN
        self.size = 1 << 40
        self._top = 0
        self._allocs: list[Any] = []
        self._tensors: list[tuple[int, int, int]] = []  # (data_ptr, nbytes, offset)
        anchor = torch.empty(ALIGN, dtype=torch.uint8, device=world.device)
        self._anchor = anchor
        self.bases = torch.tensor([anchor.data_ptr()] * world.size, dtype=torch.int64, device=world.device)
        self.status = self.zeros(STATUS_WORDS, dtype=torch.int32, name="status")

    def _alloc(self, shape: tuple[int, ...], dtype: Any, name: str) -> Any:
        import torch

        from autofuse.comm.heap import Allocation

        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * dtype.itemsize
        offset = -(-self._top // self.align) * self.align
        self._top = offset + nbytes
        self._allocs.append(Allocation(name, offset, nbytes, dtype, shape))
        t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.world.device)[:nbytes].view(dtype).view(shape)
        self._tensors.append((t.data_ptr(), nbytes, offset))
        return t

    def empty(self, *shape: Any, dtype: Any = None, name: str = "", verify: bool = True) -> Any:
        import torch

        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        return self._alloc(tuple(int(s) for s in shape), dtype or torch.float32, name or f"buf{len(self._allocs)}")

    def zeros(self, *shape: Any, dtype: Any = None, name: str = "", verify: bool = True) -> Any:
        return self.empty(*shape, dtype=dtype, name=name).zero_()

    def full(self, shape: tuple[int, ...], value: float, dtype: Any = None, name: str = "") -> Any:
        return self.empty(*shape, dtype=dtype, name=name).fill_(value)

    def randn(self, *shape: Any, dtype: Any = None, name: str = "", generator: Any = None) -> Any:
        return self.empty(*shape, dtype=dtype, name=name).normal_(generator=generator)

    def offset_of(self, t: Any) -> int:
        ptr = t.data_ptr()
        for start, nbytes, offset in self._tensors:
            if start <= ptr < start + max(nbytes, 1):
                return offset + ptr - start
        raise ValueError("tensor is not on this symmetric heap")

    def contains(self, t: Any) -> bool:
        try:
            self.offset_of(t)
            return True
        except ValueError:
            return False

    def owner_of(self, offset: int) -> Any:
        return next((a for a in self._allocs if a.offset <= offset < a.offset + a.nbytes), None)

    @property
    def used(self) -> int:
        return self._top

    def peer_tensor(self, t: Any, rank: int) -> Any:
        return t

    def close(self) -> None:
        self._tensors.clear()


_STAND_INS: dict[tuple[int, int], Any] = {}


def stand_in_world(size: int, rank: int, device_kind: str = "cuda") -> Any:
    """A World of `size` ranks seen as `rank`, in this process alone (see the module docstring); cached."""
    import torch
    import torch.distributed as dist

    from autofuse.comm.world import World

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    key = (size, rank)
    if key not in _STAND_INS:
        device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
        w = World(rank=rank, size=size, device=device, backend="gloo", group=None, global_ranks=tuple(range(size)))
        w._heap = StandInHeap(w)
        _STAND_INS[key] = w
    return _STAND_INS[key]


def compile_config(op_ref: str, problem_key: str, variant: str, config: Config, device_kind: str = "cuda") -> None:
    """Compile one config's Triton kernels into Triton's cache, as every rank of its problem would (CUDA)."""
    from autofuse.core import registry

    op = _resolve(op_ref) if ":" in op_ref else registry.get(op_ref)  # as `tuning.tune.resolve_op`, sans Optuna
    problem = Problem.from_key(problem_key)
    v = op.variant(variant)
    for rank in range(problem.world):
        world = stand_in_world(problem.world, rank, device_kind)
        with compile_only():
            runner = v.build(world, problem, config)
            runner(*stand_in_inputs(op, runner, world, problem))


def stand_in_inputs(op: Op, runner: Any, world: Any, problem: Problem) -> tuple:
    """The op's inputs on a stand-in World; for an op that takes a partner's handle (moe_combine: its inputs
    are the partner dispatch's outputs, made collectively, which on a one-process group would wait out
    the collective timeout), zeros of the runner's input specs instead, the handle filled from its
    producer's layout (`CustomOp.handle`) with zeros: the kernels only compile."""
    import torch

    from autofuse.core import registry
    from autofuse.core.runner import Handle, HandleSpec

    if not any(isinstance(spec, HandleSpec) for spec in runner.in_specs):
        return tuple(op.inputs(world, problem, 0))
    args: list[Any] = []
    for spec in runner.in_specs:
        if isinstance(spec, HandleSpec):
            made = Problem.from_key(spec.key)
            producer = registry.get(made.op)
            layout = producer.custom.handle
            shapes = layout.fake(tuple(producer.inputs(world, made, 0)), made.world)
            args.append(Handle(spec.key, **{n: torch.zeros(shape, dtype=dt, device=world.device)
                                            for n, (shape, dt) in zip(layout.names, shapes)}))
        else:
            args.append(torch.zeros(spec.shape, dtype=spec.dtype, device=world.device))
    return tuple(args)
