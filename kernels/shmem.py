"""Iris-style device API over a symmetric heap (DESIGN.md, Device programming model).

Every rank's heap has the same size and layout; `heap_bases[r]` is rank r's heap address as mapped
in this process. Data moves from `from_rank` to `to_rank`, as in Iris:

    load(pointer, to_rank, from_rank, heap_bases)        read from_rank's copy; to_rank = me
    store(pointer, value, from_rank, to_rank, heap_bases) write to_rank's copy; from_rank = me
    get(from_ptr, to_ptr, from_rank, to_rank, ...)        copy from_rank's data into my memory
    put(from_ptr, to_ptr, from_rank, to_rank, ...)        copy my data into to_rank's memory
    atomic_*(pointer, ..., from_rank, to_rank, ...)       update to_rank's copy; from_rank = me

A pointer is always given in the calling rank's address space.

**Device context.** Kernels that synchronise across ranks take one `DeviceContext` argument (a
named tuple, passed as a single kernel argument): this rank, the world size, the heap bases, the
workspace's status words (on the heap, so peers can write them), its epoch counter, the wait budget
and a host-visible mirror of the status code. The host builds it (`autofuse.comm.workspace.Workspace.ctx`).

**Epochs.** `epoch_begin` gives every call a number one higher than the last (kept on the device,
so CUDA-graph replays advance it); flags carry the epoch of the call that raised them, in two
parity sets, so a peer one call ahead writes the other set. A wait is satisfied only by the exact
epoch it expects: data of a later (or skipped) call never satisfies it.

**Faults are collective.** `wait_until` gives up when the budget (wall-clock: `%globaltimer` ns on
GPUs, the host clock under the interpreter) runs out, or at once when the status code says this
rank or a peer already gave up. The first rank to give up records the flag and epochs in its
status words and marks every peer's status "aborted" with its own rank, so every rank stops
waiting and the host raises `autofuse.comm.status.FlagTimeout` on every rank. A workspace whose status
is not clean computes nothing: kernels fill their outputs with NaN until the host rebuilds it.

**Decisions are made once per program.** A scalar in a Triton program lives in every thread, and
a volatile load is issued by every thread: two threads of one program can read a status word or a
flag a moment apart and see different values. A branch on such a value splits the program, and
a split program deadlocks at its next barrier (a K loop's pipeline, a reduction, the broadcast of
an atomic's result), or pairs barriers wrongly: seen on GPUs as a fused kernel that never ended
after a fault, with a fraction of its programs stuck (docs/results/faults.md). So every value a
branch depends on is program-uniform: flags and status words are read with `read_uniform` (one
thread reads, Triton broadcasts the value through shared memory), clocks are combined with
`program_max`; only the hot polling loop reads per thread, and nothing inside it branches
around a barrier.

Everything here runs compiled (CUDA) and under TRITON_INTERPRET=1 (no inline asm there).
"""
import os
import time
from collections import namedtuple

import triton
import triton.language as tl

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

DeviceContext = namedtuple("DeviceContext", ["rank", "world", "heap_bases", "status", "counter", "budget",
                                             "mirror"])

# Status words (int32, a workspace's status allocation on the heap; see autofuse/comm/status.py).
# Word CODE is 0 while healthy, else (origin rank + 1) * 4 + kind: kind TIMEOUT where this rank's
# wait ran out, ABORTED where a peer's did. Rank r's record of its timeout sits in words
# RECORD + 3r .. RECORD + 3r + 2 (flag offset in 4-byte words, epoch waited for, last value seen),
# written before the code is set (release), so whoever sees the code sees the origin's record.
CODE = tl.constexpr(0)
RECORD = tl.constexpr(1)
TIMEOUT = tl.constexpr(1)
ABORTED = tl.constexpr(2)
POLLS_PER_CHECK = tl.constexpr(64)  # flag polls between two reads of the clock and the status word
MAX_THREADS = tl.constexpr(1024)    # threads of one program at most (32 warps): program_max spans them all


# -- address translation and remote access ------------------------------------------------------
@triton.jit
def translate(pointer, from_rank, to_rank, heap_bases):
    """`pointer` in `from_rank`'s heap -> the same object in `to_rank`'s heap (same type).

    Computed as `pointer + distance` in elements, the distance between the two heap bases hinted
    as a multiple of 16 elements (heap bases are page-aligned), so the compiler keeps `pointer`'s
    alignment and tiles moved through it use 16-byte vector accesses; integer casts would lose it.
    """
    nbytes: tl.constexpr = pointer.dtype.element_ty.primitive_bitwidth // 8
    distance = (tl.load(heap_bases + to_rank) - tl.load(heap_bases + from_rank)) // nbytes
    return pointer + tl.multiple_of(distance, 16)


@triton.jit
def load(pointer, to_rank, from_rank, heap_bases, mask=None, other=None):
    """Read `from_rank`'s copy of `pointer` (my address, `to_rank` = me)."""
    return tl.load(translate(pointer, to_rank, from_rank, heap_bases), mask=mask, other=other)


@triton.jit
def store(pointer, value, from_rank, to_rank, heap_bases, mask=None):
    """Write `value` into `to_rank`'s copy of `pointer` (my address, `from_rank` = me)."""
    tl.store(translate(pointer, from_rank, to_rank, heap_bases), value, mask=mask)


@triton.jit
def get(from_ptr, to_ptr, from_rank, to_rank, heap_bases, mask=None):
    """Copy `from_rank`'s data at `from_ptr` into my memory at `to_ptr` (`to_rank` = me)."""
    data = tl.load(translate(from_ptr, to_rank, from_rank, heap_bases), mask=mask)
    tl.store(to_ptr, data, mask=mask)


@triton.jit
def put(from_ptr, to_ptr, from_rank, to_rank, heap_bases, mask=None):
    """Copy my data at `from_ptr` into `to_rank`'s memory at `to_ptr` (`from_rank` = me)."""
    data = tl.load(from_ptr, mask=mask)
    tl.store(translate(to_ptr, from_rank, to_rank, heap_bases), data, mask=mask)


@triton.jit
def atomic_add(pointer, val, from_rank, to_rank, heap_bases, mask=None, sem=None, scope=None):
    """Atomically add `val` to `to_rank`'s copy of `pointer`; returns the old value."""
    return tl.atomic_add(translate(pointer, from_rank, to_rank, heap_bases), val, mask=mask, sem=sem, scope=scope)


@triton.jit
def atomic_cas(pointer, cmp, val, from_rank, to_rank, heap_bases, sem=None, scope=None):
    """Compare-and-swap on `to_rank`'s copy of `pointer`; returns the old value."""
    return tl.atomic_cas(translate(pointer, from_rank, to_rank, heap_bases), cmp, val, sem=sem, scope=scope)


@triton.jit
def atomic_xchg(pointer, val, from_rank, to_rank, heap_bases, mask=None, sem=None, scope=None):
    """Exchange on `to_rank`'s copy of `pointer`; returns the old value."""
    return tl.atomic_xchg(translate(pointer, from_rank, to_rank, heap_bases), val, mask=mask, sem=sem, scope=scope)


# -- flags --------------------------------------------------------------------------------------
@triton.jit
def signal(flag, epoch, from_rank, to_rank, heap_bases):
    """Set `to_rank`'s copy of `flag` to `epoch`, releasing every write this program made before.

    The barrier first makes every thread's stores of this program precede the one release.
    """
    tl.debug_barrier()
    tl.atomic_xchg(translate(flag, from_rank, to_rank, heap_bases), epoch, sem="release", scope="sys")


if os.environ.get("TRITON_INTERPRET", "0") == "1":
    @triton.jit
    def now_ns():
        """Nanoseconds of a monotonic clock (the host's, under the interpreter)."""
        return tl.full([], time.monotonic_ns(), tl.int64)
else:
    @triton.jit
    def now_ns():
        """Nanoseconds of the GPU's global timer."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)


@triton.jit
def read_uniform(pointer, sem):
    """The int32 at `pointer`, read once for the whole program (with `sem`: relaxed or acquire, system scope).

    A scalar atomic whose result is used: Triton lets one thread do it and broadcasts the value to
    every thread through shared memory (a barrier), so every thread takes the same branch on it
    (Triton 3.6 emits `ld.global.sys.<sem>` on one thread, st.shared, bar.sync, ld.shared; checked
    by tests/test_gemm_rs.py). A volatile load is per thread: see the module doc. Call it where
    every thread of the program is (it holds a barrier), never inside a per-thread loop.
    """
    return tl.atomic_add(pointer, 0, sem=sem, scope="sys")


@triton.jit
def program_max(x):
    """The largest of the values of the scalar `x` that the program's threads hold, in every thread.

    A reduction over a tensor with an element per thread (and more): the threads' copies of `x`
    meet in shared memory, so a per-thread value (a clock read) becomes one value the whole
    program agrees on. Holds barriers: call it where every thread of the program is.
    """
    return tl.max(tl.zeros([MAX_THREADS], x.dtype) + x, axis=0)


@triton.jit
def _record(kind, flag_word, value, seen, target, ctx):
    """Write my timeout record into `target`'s status, then set its code unless it holds one already."""
    slot = ctx.status + RECORD + 3 * ctx.rank
    atomic_xchg(slot, flag_word, ctx.rank, target, ctx.heap_bases, sem="relaxed", scope="sys")
    atomic_xchg(slot + 1, value, ctx.rank, target, ctx.heap_bases, sem="relaxed", scope="sys")
    atomic_xchg(slot + 2, seen, ctx.rank, target, ctx.heap_bases, sem="relaxed", scope="sys")
    atomic_cas(ctx.status + CODE, 0, (ctx.rank + 1) * 4 + kind, ctx.rank, target, ctx.heap_bases,
               sem="release", scope="sys")


@triton.jit
def give_up(flag, value, seen, ctx):
    """This rank's wait on `flag` ran out: record it here, abort every peer, tell the host mirror."""
    base = tl.load(ctx.heap_bases + ctx.rank)
    word = tl.cast((tl.cast(flag, tl.uint64) - tl.cast(base, tl.uint64)) // 4, tl.int32)
    _record(TIMEOUT, word, value, seen, ctx.rank, ctx)
    for peer in range(0, ctx.world):
        if peer != ctx.rank:
            _record(ABORTED, word, value, seen, peer, ctx)
    tl.store(ctx.mirror, tl.load(ctx.status + CODE, volatile=True))


@triton.jit
def wait_until(flag, value, ctx):
    """Wait until the local int32 `flag` holds exactly `value`; True if it did (the same in every thread).

    First one acquire read of the flag for the whole program (`read_uniform`): a flag that is
    already up costs nothing more. Otherwise it polls with volatile loads (atomics poll ~5x slower
    across GPUs), POLLS_PER_CHECK at a time per thread, then reads the flag (acquire) and the
    status word once for the program and takes the program's latest clock (`program_max`), so
    every thread leaves the loop in the same round. Gives up (returns False) when this rank's
    status is no longer clean (a peer or another program of this rank gave up: every wait then
    returns at once, so the time to fail does not grow with the number of waiting programs) or
    when `ctx.budget` ns pass; the first to run out calls `give_up`. Callers skip the work that
    needed the flag and write NaN instead.
    """
    seen = read_uniform(flag, "acquire")
    code = tl.zeros([], tl.int32)
    if seen != value:
        code = read_uniform(ctx.status + CODE, "relaxed")
        start = now_ns()
        elapsed = tl.zeros([], tl.int64)
        while (seen != value) & (code == 0) & (elapsed <= ctx.budget):
            polls = 0
            hot = tl.load(flag, volatile=True)
            while (hot != value) & (polls < POLLS_PER_CHECK):  # the hot loop: one volatile load per thread
                hot = tl.load(flag, volatile=True)
                polls += 1
            seen = read_uniform(flag, "acquire")
            code = read_uniform(ctx.status + CODE, "relaxed")
            elapsed = program_max(now_ns() - start)
    ok = seen == value
    if ok:
        tl.debug_barrier()  # no thread of the program reads the data before the acquire
    elif code == 0:
        give_up(flag, value, seen, ctx)
    else:
        tl.store(ctx.mirror, code)
    return ok


# -- epochs -------------------------------------------------------------------------------------
@triton.jit
def epoch_begin(ctx):
    """(epoch of the call now running, whether the workspace is healthy).

    The epoch is one more than the last published (`counter` = [epoch, programs done]); it stays
    on the device so a call captured in a CUDA graph gets a fresh epoch on every replay. Every
    program reads it at its start; `epoch_end` publishes the next one. An unhealthy workspace (a
    fault was recorded and not yet cleared by the host) must not compute: callers write NaN.
    """
    epoch = read_uniform(ctx.counter, "relaxed") + 1  # the program's flag waits compare with it
    code = read_uniform(ctx.status + CODE, "relaxed")  # the program's K loops and pushes branch on it
    if code != 0:
        tl.store(ctx.mirror, code)
    return epoch, code == 0


@triton.jit
def epoch_end(ctx, num_programs):
    """Every program calls this once at its very end; the last one to arrive publishes the epoch.

    By then every program of the launch has read the epoch, and the next launch on the stream
    cannot start before this one ends, so no program ever sees a half-updated counter.
    """
    done = tl.atomic_add(ctx.counter + 1, 1, sem="acq_rel", scope="gpu")
    if done == num_programs - 1:
        tl.store(ctx.counter + 1, 0)
        tl.atomic_add(ctx.counter, 1, sem="release", scope="gpu")


@triton.jit
def parity(epoch):
    """0 or 1: which of the two flag and inbox sets this call uses."""
    return epoch % 2
