"""Fused GEMM + all-reduce: every rank ends with C = sum_r A_r @ B_r (M x N).

Rank r holds A_r (M x K_r) and B_r (K_r x N). One program per output tile computes this rank's
float32 partial, then:
- `gemm_ar_one_shot_kernel`: pushes the partial into every peer's inbox, adds 1 to each peer's
  arrival counter for the tile (release, system scope), waits for the W-1 peer partials of the
  same tile on its own counter and sums all W.
- `gemm_ar_two_shot_kernel`: tile t is owned by rank t % W (reduce-scatter by tiles, so every
  rank owns a share even at small M). A non-owner pushes its partial to the owner and waits for
  the reduced tile; the owner waits for the W-1 partials, sums, writes its output and pushes the
  reduced tile (in the output dtype) into every peer's gather buffer with a flag (all-gather).
  Twice the hops of one-shot, but each rank receives (W-1)/W of a partial plus the reduced rest
  instead of W-1 partials: it pays for large M and W > 2.

Every rank sums the W partials in rank order 0..W-1, its own partial rounded to the inbox dtype
exactly as its peers see it, so all ranks get bitwise identical results. A program only waits on
the same program id of its peers, which never wait on a higher id: no deadlock in the
interpreter (programs run in id order) or on a GPU. Inboxes, gather buffers and counters are
double-buffered by epoch parity (fixed halves of the workspace) and counters are reset by their
reader (see gemm_rs.py for why a peer can never be two calls ahead).
"""
import triton
import triton.language as tl

from autofuse.kernels import shmem
from autofuse.kernels.gemm_rs import _store_rows
from autofuse.kernels.gemm_tile import matmul_tile, swizzle, tile_offsets


@triton.jit
def _sum_in_rank_order(mine, base, slot_stride, rank, WORLD: tl.constexpr, offs):
    """mine (this rank's partial, inbox dtype) + the W-1 peer partials, summed in rank order.

    Peer src's partial sits at slot (src - rank - 1) mod W; `base` points at slot 0 of this
    tile and `slot_stride` is the distance between slots in elements.
    """
    total = tl.zeros(mine.shape, dtype=tl.float32)
    for src in tl.static_range(WORLD):
        if src == rank:
            total += mine.to(tl.float32)
        else:
            slot = (src - rank - 1 + WORLD) % WORLD
            total += tl.load(base + slot * slot_stride + offs, cache_modifier=".cg").to(tl.float32)
    return total


@triton.jit(do_not_specialize=["M"])  # one binary for every M
def gemm_ar_one_shot_kernel(
        a, b, out, inbox, inbox_half, counters, counter_half, epoch_ptr, status, heap_bases,
        rank, M, N, K_r, stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on, spin_limit,
        WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """One program per tile; grid = (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),).

    Each parity half of inbox: [WORLD - 1 peers, tiles, BLOCK_M * BLOCK_N]; of counters: [tiles].
    """
    epoch = shmem.epoch_next(epoch_ptr)
    parity = epoch % 2
    inbox += tl.cast(parity, tl.int64) * inbox_half
    counters += parity * counter_half
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tiles_m * tiles_n
    pid_m, pid_n = swizzle(tl.program_id(0), tiles_m, tiles_n, GROUP_M)
    pos = pid_m * tiles_n + pid_n

    acc = matmul_tile(a, b, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, K_r,
                      stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    mine = acc.to(inbox.dtype.element_ty)
    offs = tile_offsets(BLOCK_M, BLOCK_N)
    slot_stride = tl.cast(num_tiles, tl.int64) * (BLOCK_M * BLOCK_N)
    base = inbox + tl.cast(pos, tl.int64) * (BLOCK_M * BLOCK_N)
    for step in tl.static_range(1, WORLD):
        peer = (rank + step) % WORLD
        tl.store(shmem.translate(base + (WORLD - 1 - step) * slot_stride, rank, peer, heap_bases) + offs, mine)
    tl.debug_barrier()  # every thread's stores precede the releases below
    count = counters + pos
    for step in tl.static_range(1, WORLD):
        shmem.atomic_add(count, 1, rank, (rank + step) % WORLD, heap_bases, sem="release", scope="sys")

    if shmem.wait_until(count, WORLD - 1, spin_limit, status, heap_bases, rank):
        tl.debug_barrier()  # the acquire in wait_until precedes every thread's loads
        total = _sum_in_rank_order(mine, base, slot_stride, rank, WORLD, offs)
        tl.store(count, 0)
        _store_rows(out, total, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, stride_om, stride_on, BLOCK_M, BLOCK_N)
    shmem.epoch_finish(epoch_ptr, tl.num_programs(0))


@triton.jit(do_not_specialize=["M"])  # one binary for every M
def gemm_ar_two_shot_kernel(
        a, b, out, inbox, inbox_half, gathered, gathered_half, counters, flags, counter_half, epoch_ptr,
        status, heap_bases,
        rank, M, N, K_r, stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on, spin_limit,
        WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """One program per tile; grid = (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),).

    Each parity half of inbox: [WORLD - 1 peers, owned tiles, BLOCK_M * BLOCK_N] (owned =
    cdiv(tiles, WORLD)); of gathered: [tiles, BLOCK_M * BLOCK_N] in out's dtype; of counters:
    [owned]; of flags: [tiles]. Counters and flags are two regions of one int32 workspace.
    """
    epoch = shmem.epoch_next(epoch_ptr)
    parity = epoch % 2
    inbox += tl.cast(parity, tl.int64) * inbox_half
    gathered += tl.cast(parity, tl.int64) * gathered_half
    counters += parity * counter_half
    flags += parity * counter_half
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tiles_m * tiles_n
    owned = tl.cdiv(num_tiles, WORLD)
    pid_m, pid_n = swizzle(tl.program_id(0), tiles_m, tiles_n, GROUP_M)
    pos = pid_m * tiles_n + pid_n
    owner = pos % WORLD

    acc = matmul_tile(a, b, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, K_r,
                      stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    mine = acc.to(inbox.dtype.element_ty)
    offs = tile_offsets(BLOCK_M, BLOCK_N)
    slot_stride = tl.cast(owned, tl.int64) * (BLOCK_M * BLOCK_N)
    base = inbox + tl.cast(pos // WORLD, tl.int64) * (BLOCK_M * BLOCK_N)
    count = counters + pos // WORLD
    flag = flags + pos
    result = gathered + tl.cast(pos, tl.int64) * (BLOCK_M * BLOCK_N)
    if owner != rank:
        slot = (rank - owner - 1 + WORLD) % WORLD
        tl.store(shmem.translate(base + slot * slot_stride, rank, owner, heap_bases) + offs, mine)
        tl.debug_barrier()  # every thread's stores precede the release below
        shmem.atomic_add(count, 1, rank, owner, heap_bases, sem="release", scope="sys")
        if shmem.wait_until(flag, 1, spin_limit, status, heap_bases, rank):
            tl.debug_barrier()  # the acquire in wait_until precedes every thread's loads
            reduced = tl.load(result + offs, cache_modifier=".cg")
            tl.store(flag, 0)
            _store_rows(out, reduced, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, stride_om, stride_on, BLOCK_M, BLOCK_N)
    else:
        if shmem.wait_until(count, WORLD - 1, spin_limit, status, heap_bases, rank):
            tl.debug_barrier()  # the acquire in wait_until precedes every thread's loads
            reduced = _sum_in_rank_order(mine, base, slot_stride, rank, WORLD, offs).to(out.dtype.element_ty)
            tl.store(count, 0)
            _store_rows(out, reduced, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, stride_om, stride_on, BLOCK_M, BLOCK_N)
            for step in tl.static_range(1, WORLD):
                tl.store(shmem.translate(result, rank, (rank + step) % WORLD, heap_bases) + offs, reduced)
            tl.debug_barrier()  # every thread's stores precede the releases below
            for step in tl.static_range(1, WORLD):
                shmem.atomic_add(flag, 1, rank, (rank + step) % WORLD, heap_bases, sem="release", scope="sys")
    shmem.epoch_finish(epoch_ptr, tl.num_programs(0))
