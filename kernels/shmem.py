"""Iris-style device API over a symmetric heap (DESIGN.md, Device programming model).

Every rank's heap has the same size and layout; `heap_bases[r]` is rank r's heap address as
mapped in this process. A pointer `p` into `from_rank`'s heap names the same object on `to_rank`
at `heap_bases[to_rank] + (p - heap_bases[from_rank])`. Each function below takes Iris's
argument order (`from_rank`, `to_rank`, `heap_bases`): `pointer` lives in `from_rank`'s address
space (normally the calling rank) and the access goes to `to_rank`'s memory.

Flags are int32 epochs: a producer writes the call's epoch (release, system scope) and a consumer
waits until the flag reaches it, so flags never need clearing between calls. Every wait is
bounded: past `spin_limit` polls it records the flag and the values in the heap's status words
and gives up; the host turns that into `autofuse.status.FlagTimeout` naming op, rank and flag.

Everything here runs both compiled (CUDA, ROCm) and under TRITON_INTERPRET=1 (no inline asm).
"""
import triton
import triton.language as tl

# Status words (int32, at the heap's status allocation): the first timeout wins the CAS.
STATUS_CODE = tl.constexpr(0)       # 0 = fine, 1 = a flag wait timed out
STATUS_FLAG_WORD = tl.constexpr(1)  # the flag's offset in the waiting rank's heap, in 4-byte words
STATUS_EXPECTED = tl.constexpr(2)   # the epoch waited for
STATUS_SEEN = tl.constexpr(3)       # the last value read
TIMEOUT = tl.constexpr(1)


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
def load(pointer, from_rank, to_rank, heap_bases, mask=None, other=None):
    """Read `to_rank`'s copy of `pointer` (a block of pointers in `from_rank`'s heap)."""
    return tl.load(translate(pointer, from_rank, to_rank, heap_bases), mask=mask, other=other)


@triton.jit
def store(pointer, value, from_rank, to_rank, heap_bases, mask=None):
    """Write `value` into `to_rank`'s copy of `pointer`."""
    tl.store(translate(pointer, from_rank, to_rank, heap_bases), value, mask=mask)


@triton.jit
def get(from_ptr, to_ptr, from_rank, to_rank, heap_bases, mask=None):
    """Copy `to_rank`'s data at `from_ptr` into local memory at `to_ptr` (a pull)."""
    data = tl.load(translate(from_ptr, from_rank, to_rank, heap_bases), mask=mask)
    tl.store(to_ptr, data, mask=mask)


@triton.jit
def put(from_ptr, to_ptr, from_rank, to_rank, heap_bases, mask=None):
    """Copy local data at `from_ptr` into `to_rank`'s memory at `to_ptr` (a push)."""
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


@triton.jit
def signal(flag, epoch, from_rank, to_rank, heap_bases):
    """Raise `to_rank`'s copy of `flag` to `epoch`, releasing every write made before it.

    The barrier first makes every thread's stores of this program precede the one release.
    """
    tl.debug_barrier()
    tl.atomic_xchg(translate(flag, from_rank, to_rank, heap_bases), epoch, sem="release", scope="sys")


@triton.jit
def _report_timeout(flag, value, seen, status, my_base):
    won = tl.atomic_cas(status + STATUS_CODE, 0, TIMEOUT, sem="relaxed", scope="sys") == 0
    if won:
        word = (tl.cast(flag, tl.uint64) - tl.cast(my_base, tl.uint64)) // 4
        tl.store(status + STATUS_FLAG_WORD, tl.cast(word, tl.int32))
        tl.store(status + STATUS_EXPECTED, value)
        tl.store(status + STATUS_SEEN, seen)


@triton.jit
def wait_until(flag, value, spin_limit, status, heap_bases, rank):
    """Wait until the local int32 `flag` reaches `value` (>=, since epochs only grow).

    Polls with volatile loads (atomics poll ~5x slower across GPUs), then one acquire so the
    data the producer released before the flag is visible. Gives up after `spin_limit` polls,
    records the flag in `status` and returns False; callers then skip their remaining work.
    """
    seen = tl.load(flag, volatile=True)
    spins = 0
    while (seen < value) & (spins < spin_limit):
        seen = tl.load(flag, volatile=True)
        spins += 1
    ok = seen >= value
    if ok:
        tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        tl.debug_barrier()  # no thread of the program reads the data before the acquire
    else:
        _report_timeout(flag, value, seen, status, tl.load(heap_bases + rank))
    return ok


@triton.jit
def epoch_next(counter):
    """The epoch of the call now running: one more than the last published (counter = [epoch, done]).

    Kept on the device so a call captured in a CUDA graph gets a fresh epoch on every replay.
    Every program reads it at its start; `epoch_finish` publishes the next one.
    """
    return tl.load(counter, volatile=True) + 1


@triton.jit
def epoch_finish(counter, num_programs):
    """Every program calls this once at its very end; the last one to arrive publishes the epoch.

    By then every program of the launch has read the epoch, and the next launch on the stream
    cannot start before this one ends, so no program ever sees a half-updated counter.
    """
    done = tl.atomic_add(counter + 1, 1, sem="acq_rel", scope="gpu")
    if done == num_programs - 1:
        tl.store(counter + 1, 0)
        tl.atomic_add(counter, 1, sem="release", scope="gpu")
