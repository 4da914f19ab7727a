"""Small kernels that exercise every device primitive across ranks (doctor and tests use them).

Each has its launch grid in its docstring; `ctx` is the DeviceContext of the `selftest` workspace.
"""
import triton
import triton.language as tl

from autofuse.kernels import shmem


@triton.jit
def ring_put_kernel(src, dst, flag, ctx, epoch, n, BLOCK: tl.constexpr):
    """Push my `src` into the next rank's `dst`, raise its flag; wait for the previous rank's push.

    grid = (1,)
    """
    nxt = (ctx.rank + 1) % ctx.world
    offs = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        shmem.put(src + start + offs, dst + start + offs, ctx.rank, nxt, ctx.heap_bases, mask=start + offs < n)
    shmem.signal(flag, epoch, ctx.rank, nxt, ctx.heap_bases)
    shmem.wait_until(flag, epoch, ctx)


@triton.jit
def all_to_all_load_kernel(src, out, heap_bases, rank, n, BLOCK: tl.constexpr):
    """Program p reads rank p's `src` into row p of `out` (remote loads, no flags: host barriers).

    grid = (world,)
    """
    peer = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        m = start + offs < n
        v = shmem.load(src + start + offs, rank, peer, heap_bases, mask=m)
        tl.store(out + peer * n + start + offs, v, mask=m)


@triton.jit
def atomic_add_kernel(counter, heap_bases, rank, world):
    """Add 1 to every rank's counter (a system-scope atomic per peer). grid = (1,)"""
    for peer in range(0, world):
        shmem.atomic_add(counter, 1, rank, peer, heap_bases, sem="acq_rel", scope="sys")


@triton.jit
def cas_claim_kernel(lock, old_out, heap_bases, rank):
    """Try to claim rank 0's lock (0 -> rank + 1); record the value found. grid = (1,)"""
    old = shmem.atomic_cas(lock, 0, rank + 1, rank, 0, heap_bases, sem="acq_rel", scope="sys")
    tl.store(old_out, old)


@triton.jit
def xchg_kernel(word, old_out, heap_bases, rank, world):
    """Write rank + 1 into the next rank's word with exchange; record what was there. grid = (1,)"""
    old = shmem.atomic_xchg(word, rank + 1, rank, (rank + 1) % world, heap_bases, sem="acq_rel", scope="sys")
    tl.store(old_out, old)


@triton.jit
def get_kernel(src, dst, heap_bases, rank, peer, n, BLOCK: tl.constexpr):
    """Copy `n` elements of `peer`'s `src` into my local `dst`. grid = (cdiv(n, BLOCK),)"""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    shmem.get(src + offs, dst + offs, peer, rank, heap_bases, mask=offs < n)


@triton.jit
def ring_token_kernel(flag, ctx, first_epoch, iters):
    """Pass a token round the ring `iters` times with epoch flags (no reset between rounds).

    Rank 0 starts each round; every rank waits for its predecessor's epoch, then raises its
    successor's. With one rank the token goes to itself. grid = (1,)
    """
    nxt = (ctx.rank + 1) % ctx.world
    i = 0
    ok = True
    while (i < iters) & ok:
        epoch = first_epoch + i
        if ctx.rank == 0:
            shmem.signal(flag, epoch, ctx.rank, nxt, ctx.heap_bases)
            ok = shmem.wait_until(flag, epoch, ctx)
        else:
            ok = shmem.wait_until(flag, epoch, ctx)
            if ok:
                shmem.signal(flag, epoch, ctx.rank, nxt, ctx.heap_bases)
        i += 1


@triton.jit
def wait_kernel(flag, ctx, epoch):
    """Only wait for `flag` to hold `epoch` (tests the bounded wait when nobody raises it). grid = (1,)"""
    shmem.wait_until(flag, epoch, ctx)
