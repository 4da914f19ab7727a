"""Fused GEMM + all-reduce: every rank ends with C = sum_q A_q @ B_q (M x N).

Rank r holds A_r (M x K_r) and B_r (K_r x N). A persistent program computes this rank's float32
partial of each of its output tiles with the GEMM core (kernels/gemm_core.py; split-K partials are
combined first), then, by the constexpr TWO_SHOT:
- one-shot (False): pushes the partial into every peer's inbox with an epoch flag per (source,
  tile), waits for the W-1 peer partials of the same tile and sums all W. Latency-optimal: one hop.
- two-shot (True): tile t is owned by rank t % W (a reduce-scatter by tiles, so every rank owns a
  share even at small M). A non-owner pushes its partial to the owner and waits for the reduced
  tile; the owner waits for the W-1 partials, sums them, stores its output and pushes the reduced
  tile (output dtype) into every peer's gather buffer with a flag (the all-gather). Two hops, but
  each rank receives about 2/W of a partial per tile instead of W-1 partials: for large M, W > 2.

Every rank sums the W partials in rank order 0..W-1, its own rounded to the inbox dtype exactly as
its peers received it (kernels/partials.py), so all ranks return bitwise identical results. Work
items are the same on every rank and a program only waits for what the same program id of its
peers pushed before waiting itself: no deadlock under the interpreter or on a GPU.

Per parity half: inbox [W - 1 slots, tiles (one-shot) or owned = cdiv(tiles, W) (two-shot),
BLOCK_M * BLOCK_N] in the partial dtype (PARTIAL); gathered (two-shot) [tiles, BLOCK_M * BLOCK_N]
in the output dtype; flags: one-shot [W - 1, tiles]; two-shot [W - 1, owned] partial flags, then
[tiles] result flags; every flag cleared by its reader (kernels/partials.py: `take`). Faults: as
in kernels/gemm_rs.py, the tiles of a failed call are NaN.
"""
import triton
import triton.language as tl

from autofuse.kernels import gemm_core, partials, shmem


@triton.jit(do_not_specialize=["M"])  # one binary for every M
def gemm_ar_kernel(a, b, out, scale_a, scale_b, inbox, inbox_half, gathered, gathered_half, flags, half_flags, sk_partials, sk_counts,
                   ctx, M, N, K_r, stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
                   WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr, SPLIT_K: tl.constexpr,
                   SWAP_AB: tl.constexpr, USE_TMA: tl.constexpr, TWO_SHOT: tl.constexpr, B_T: tl.constexpr,
                   SCALE: tl.constexpr):
    """out (M x N) = sum_q A_q @ B_q on every rank; a: M x K_r, b: K_r x N.

    grid = (min(cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) * SPLIT_K, NUM_SMS),)
    sk_partials/sk_counts: the core's split-K workspace (unused when SPLIT_K == 1). FP8: b stored
    N x K_r (B_T) and this rank's scale_a/scale_b (SCALE: gemm_core.TENSORWISE or ROWWISE) applied
    to its partial tiles.
    """
    epoch, healthy = shmem.epoch_begin(ctx)
    parity = shmem.parity(epoch)
    inbox += tl.cast(parity, tl.int64) * inbox_half
    gathered += tl.cast(parity, tl.int64) * gathered_half
    flags += parity * half_flags
    rank = ctx.rank
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    owned = tl.cdiv(tiles, WORLD)
    a_src, b_src = gemm_core.operands(a, b, M, N, K_r, stride_am, stride_ak, stride_bk, stride_bn,
                                      BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_T)
    alive = healthy
    for work in tl.range(tl.program_id(0), tiles * SPLIT_K, tl.num_programs(0)):
        pid_m, pid_n, tile, split, k_first, k_end = gemm_core.schedule(work, M, N, K_r, BLOCK_M, BLOCK_N, BLOCK_K,
                                                                       GROUP_M, SPLIT_K)
        pos = pid_m * tiles_n + pid_n
        alive = alive & partials.clean(ctx)
        acc, last = partials.partial_tile(a_src, b_src, sk_partials, sk_counts, tile, split, pid_m * BLOCK_M,
                                          pid_n * BLOCK_N, k_first, k_end, alive, M, N, K_r, stride_am, stride_ak,
                                          stride_bk, stride_bn, scale_a, scale_b, BLOCK_M, BLOCK_N, BLOCK_K,
                                          NUM_STAGES, SPLIT_K, SWAP_AB, USE_TMA, B_T, SCALE)
        if last:
            mine = acc.to(inbox.dtype.element_ty)
            ok = alive
            if TWO_SHOT:
                owner = pos % WORLD
                idx = pos // WORLD
                result = partials.tile_ptr(gathered, 0, pos, tiles, BLOCK_M, BLOCK_N)
                if owner != rank:
                    s = partials.slot(rank, owner, WORLD)
                    if ok:
                        partials.push(partials.tile_ptr(inbox, s, idx, owned, BLOCK_M, BLOCK_N), mine, rank, owner,
                                      ctx.heap_bases, BLOCK_M, BLOCK_N)
                        shmem.signal(flags + s * owned + idx, epoch, rank, owner, ctx.heap_bases)
                    ok = partials.take(flags + (WORLD - 1) * owned + pos, 1, 1, epoch, ok, ctx)
                    if ok:
                        total = partials.load(result, BLOCK_M, BLOCK_N)
                    else:
                        total = partials.nan_like(acc)
                else:
                    ok = partials.take(flags + idx, owned, WORLD - 1, epoch, ok, ctx)
                    if ok:
                        reduced = partials.sum_in_rank_order(
                            mine, partials.tile_ptr(inbox, 0, idx, owned, BLOCK_M, BLOCK_N),
                            tl.cast(owned, tl.int64) * (BLOCK_M * BLOCK_N), rank, WORLD, BLOCK_M, BLOCK_N,
                        ).to(out.dtype.element_ty)
                        for step in tl.static_range(1, WORLD):
                            partials.push(result, reduced, rank, (rank + step) % WORLD, ctx.heap_bases,
                                          BLOCK_M, BLOCK_N)
                        for step in tl.static_range(1, WORLD):
                            shmem.signal(flags + (WORLD - 1) * owned + pos, epoch, rank, (rank + step) % WORLD,
                                         ctx.heap_bases)
                        total = reduced.to(tl.float32)
                    else:
                        total = partials.nan_like(acc)
            else:
                if ok:
                    for step in tl.static_range(1, WORLD):
                        peer = (rank + step) % WORLD
                        partials.push(partials.tile_ptr(inbox, partials.slot(rank, peer, WORLD), pos, tiles,
                                                        BLOCK_M, BLOCK_N), mine, rank, peer, ctx.heap_bases,
                                      BLOCK_M, BLOCK_N)
                    for step in tl.static_range(1, WORLD):
                        peer = (rank + step) % WORLD
                        shmem.signal(flags + partials.slot(rank, peer, WORLD) * tiles + pos, epoch, rank, peer,
                                     ctx.heap_bases)
                ok = partials.take(flags + pos, tiles, WORLD - 1, epoch, ok, ctx)
                if ok:
                    total = partials.sum_in_rank_order(mine, partials.tile_ptr(inbox, 0, pos, tiles, BLOCK_M, BLOCK_N),
                                                       tl.cast(tiles, tl.int64) * (BLOCK_M * BLOCK_N), rank, WORLD,
                                                       BLOCK_M, BLOCK_N)
                else:
                    total = partials.nan_like(acc)
            gemm_core.store_tile(out, total, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, stride_om, stride_on,
                                 BLOCK_M, BLOCK_N, False)
    shmem.epoch_end(ctx, tl.num_programs(0))
