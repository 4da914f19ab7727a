"""Small kernels that exercise every device primitive across ranks (doctor and tests use them)."""
import triton
import triton.language as tl

from autofuse.kernels import shmem


@triton.jit
def ring_put_kernel(src, dst, flags, status, heap_bases, rank, world, epoch, spin_limit, n, BLOCK: tl.constexpr):
    """Push my `src` into the next rank's `dst`, raise its flag; wait for the previous rank's push."""
    nxt = (rank + 1) % world
    offs = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        shmem.put(src + start + offs, dst + start + offs, rank, nxt, heap_bases, mask=start + offs < n)
    shmem.signal(flags, epoch, rank, nxt, heap_bases)
    shmem.wait_until(flags, epoch, spin_limit, status, heap_bases, rank)


@triton.jit
def all_to_all_load_kernel(src, out, heap_bases, rank, world, n, BLOCK: tl.constexpr):
    """Program p reads rank p's `src` into row p of `out` (remote loads, no flags: host barriers)."""
    peer = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        m = start + offs < n
        v = shmem.load(src + start + offs, rank, peer, heap_bases, mask=m)
        tl.store(out + peer * n + start + offs, v, mask=m)


@triton.jit
def atomic_add_kernel(counter, heap_bases, rank, world):
    """Add 1 to every rank's counter (a system-scope atomic per peer)."""
    for peer in range(0, world):
        shmem.atomic_add(counter, 1, rank, peer, heap_bases, sem="acq_rel", scope="sys")


@triton.jit
def cas_claim_kernel(lock, old_out, heap_bases, rank):
    """Try to claim rank 0's lock (0 -> rank + 1); record the value found."""
    old = shmem.atomic_cas(lock, 0, rank + 1, rank, 0, heap_bases, sem="acq_rel", scope="sys")
    tl.store(old_out, old)


@triton.jit
def xchg_kernel(word, old_out, heap_bases, rank, world):
    """Write rank + 1 into the next rank's word with exchange; record what was there."""
    old = shmem.atomic_xchg(word, rank + 1, rank, (rank + 1) % world, heap_bases, sem="acq_rel", scope="sys")
    tl.store(old_out, old)


@triton.jit
def get_kernel(src, dst, heap_bases, rank, peer, n, BLOCK: tl.constexpr):
    """Pull `n` elements of `peer`'s `src` into local `dst`, one block per program."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    shmem.get(src + offs, dst + offs, rank, peer, heap_bases, mask=offs < n)


@triton.jit
def ring_token_kernel(flags, status, heap_bases, rank, world, first_epoch, iters, spin_limit):
    """Pass a token round the ring `iters` times with epoch flags (no reset between rounds).

    Rank 0 starts each round; every rank waits for its predecessor's epoch, then raises its
    successor's. With one rank the token goes to itself.
    """
    nxt = (rank + 1) % world
    i = 0
    ok = True
    while (i < iters) & ok:
        epoch = first_epoch + i
        if rank == 0:
            shmem.signal(flags, epoch, rank, nxt, heap_bases)
            ok = shmem.wait_until(flags, epoch, spin_limit, status, heap_bases, rank)
        else:
            ok = shmem.wait_until(flags, epoch, spin_limit, status, heap_bases, rank)
            if ok:
                shmem.signal(flags, epoch, rank, nxt, heap_bases)
        i += 1


@triton.jit
def wait_kernel(flag, status, heap_bases, rank, epoch, spin_limit):
    """Only wait for `flag` to reach `epoch` (tests the bounded wait when nobody raises it)."""
    shmem.wait_until(flag, epoch, spin_limit, status, heap_bases, rank)
