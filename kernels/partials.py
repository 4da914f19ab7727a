"""Partial tiles of a row-parallel GEMM (gemm_rs, gemm_ar): pushed to peers' inboxes, summed there.

Rank r holds A_r (M x K/W) and B_r (K/W x N); every output tile is the sum over ranks of the
float32 tiles A_q @ B_q. The fused kernels (kernels/gemm_rs.py, kernels/gemm_ar.py) compute their
partial tiles with the GEMM core (kernels/gemm_core.py) and exchange them with these functions.

Inbox layout (one parity half of the op's workspace data): `slots` x `tiles` x BLOCK_M*BLOCK_N,
each tile stored row-major and contiguous (`gemm_core.tile_offsets`). The partial that rank `src`
sends to rank `dst` sits in `dst`'s slot (src - dst - 1) mod W, so the W-1 peers fill slots
0..W-2 and slot W-1 is free for the receiver's own partial where a kernel stores it there.

  partial_tile(...) -> (acc, last)        this rank's float32 partial of one output tile over one K
                                         split (gemm_core.gemm_tile, then split_k_reduce: `last` is
                                         True in the program that holds the whole tile); no K step
                                         runs once `alive` is False
  slot(src, dst, WORLD)                  the slot of src's partial in dst's inbox
  push(box, acc, me, peer, heap_bases)   store the float32 tile `acc`, converted to the inbox dtype,
                                         into `peer`'s copy of the tile at `box` (my address)
  load(box, ...) -> float32 tile          read a tile that peers pushed (after the wait's acquire)
  sum_in_rank_order(mine, box, ...)       mine + every peer's partial, added in rank order 0..W-1
                                         (so every rank computes bitwise the same sum)
  take(flags, stride, count, value, ok, ctx) -> bool
                                         wait until each of `count` flags holds exactly `value`,
                                         then clear it to 0 (see below)
  clean(ctx) -> bool                      this rank's workspace recorded no fault (yet): kernels
                                         stop computing and pushing once it did
  nan_like(acc)                           what a tile holds when its call failed

Flags are taken: every flag (an epoch flag, or an arrival counter) has exactly one reader per
call, which clears it to 0 once its wait succeeds, so between calls every flag of the workspace is
0 whatever problem, config or variant used it (they share one workspace and lay it out
differently) and a counter always starts from 0. Clearing early is safe: the next write to the same
parity's flag comes from a peer's call two epochs on, which cannot start before this call ended
(every call waits for every peer's part of that call). A failed call leaves flags set; the
workspace is aborted then and rebuilding it zeroes them.
"""
import triton
import triton.language as tl

from autofuse.kernels import gemm_core, shmem


@triton.jit
def partial_tile(a_src, b_src, sk_partials, sk_counts, sk_tile, split, off_m, off_n, k_first, k_end, alive,
                 M, N, K, stride_am, stride_ak, stride_bk, stride_bn, scale_a, scale_b,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                 SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr, USE_TMA: tl.constexpr, B_T: tl.constexpr,
                 SCALE: tl.constexpr):
    """(acc, last): A[off_m:+BLOCK_M] @ B[:, off_n:+BLOCK_N] over K steps [k_first, k_end) in float32,
    combined with the tile's other K splits (split-K tile index `sk_tile`); `last` marks the program
    that holds the summed tile, times this rank's FP8 scales (gemm_core.scale_tile; B_T: B stored
    N x K). A program that is not `alive` (a fault was seen) runs no K step."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = gemm_core.gemm_tile(acc, a_src, b_src, off_m, off_n, k_first, tl.where(alive, k_end, k_first), M, N, K,
                              stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
                              SWAP_AB, USE_TMA, False, B_T)
    acc, last = gemm_core.split_k_reduce(acc, sk_partials, sk_counts, sk_tile, split, SPLIT_K, BLOCK_M, BLOCK_N)
    if last:
        acc = gemm_core.scale_tile(acc, scale_a, scale_b, off_m, off_n, M, N, BLOCK_M, BLOCK_N, SCALE)
    return acc, last


@triton.jit
def slot(src, dst, WORLD: tl.constexpr):
    """The inbox slot on `dst` that holds `src`'s partial (src != dst: 0..W-2)."""
    return (src - dst - 1 + WORLD) % WORLD


@triton.jit
def tile_ptr(inbox, slot_index, tile, tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Address of tile `tile` of slot `slot_index` in an inbox of `tiles` tiles per slot (int64 math)."""
    return inbox + (tl.cast(slot_index, tl.int64) * tiles + tile) * (BLOCK_M * BLOCK_N)


@triton.jit
def push(box, acc, from_rank, to_rank, heap_bases, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write the float32 tile `acc` into `to_rank`'s copy of the inbox tile `box`, in the inbox dtype."""
    offs = gemm_core.tile_offsets(BLOCK_M, BLOCK_N)
    shmem.store(box + offs, acc.to(box.dtype.element_ty), from_rank, to_rank, heap_bases)


@triton.jit
def load(box, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """ROWS x BLOCK_N rows of an inbox tile as float32, bypassing L1 (peers wrote it)."""
    return tl.load(box + gemm_core.tile_offsets(ROWS, BLOCK_N), cache_modifier=".cg").to(tl.float32)


@triton.jit
def sum_in_rank_order(mine, box, slot_stride, rank, WORLD: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """float32 sum of the W partials of a tile, added in rank order: `mine` (this rank's partial,
    already rounded to the inbox dtype exactly as the peers received it) and the peers' at `box`
    (slot 0's copy of the tile; slots are `slot_stride` elements apart)."""
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for src in tl.static_range(WORLD):
        if src == rank:
            total += mine.to(tl.float32)
        else:
            total += load(box + slot(src, rank, WORLD) * slot_stride, BLOCK_M, BLOCK_N)
    return total


@triton.jit
def take(flags, stride, count, value, ok, ctx):
    """Wait (shmem.wait_until, bounded) until flags[s * stride] == value for s < count, clearing
    each to 0 once seen; skips everything when `ok` is False. True if every wait succeeded."""
    for s in range(0, count):
        if ok:
            ok = shmem.wait_until(flags + s * stride, value, ctx)
            if ok:
                tl.store(flags + s * stride, 0)
    return ok


@triton.jit
def clean(ctx):
    """True while this rank's workspace holds no fault record: one read of its status code for the
    whole program (shmem.read_uniform), since K loops and pushes branch on it around barriers."""
    return shmem.read_uniform(ctx.status + shmem.CODE, "relaxed") == 0


@triton.jit
def nan_like(acc):
    """A float32 tile of NaN shaped like `acc`: the output of a tile whose call failed."""
    return tl.full(acc.shape, float("nan"), tl.float32)
