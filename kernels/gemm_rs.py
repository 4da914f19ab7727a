"""Fused GEMM + reduce-scatter (rows): partial tiles go straight from the GEMM to their owner's inbox.

Rank r holds A_r (M x K_r) and B_r (K_r x N); C = sum_q A_q @ B_q is split by rows, rank o owning
rows [o * M_r, (o + 1) * M_r) with M_r = M / W. Every rank computes its partial of every owner's
tiles with the GEMM core (kernels/gemm_core.py: persistent, TMA or pointer loads, pipelined K loop,
split-K, swap-AB) and exchanges them with kernels/partials.py.

Work. A work item is one (tile position, K split) of the M_r x N tile grid, the same on every
rank; its program computes that tile for every owner in turn, owner = rank + 1, rank + 2, ...,
rank: the peers' copies first, each pushed as soon as it is summed, its own last. The flags of the
pushes are raised after the own tile's K loop, which hides the transfers (a release waits until
the program's stores have landed). Peers run the same schedule, so the peers' partials of a tile
arrive while a rank computes its own, and a program only ever waits for what the same program id
of its peers raised before waiting itself: no deadlock under the interpreter (programs run one by
one in id order) nor on a GPU (lower ids are scheduled first and never wait for higher ones).

Two algorithms, one kernel (constexpr PUSH_ALL):
- push_last (PUSH_ALL False): after the own tile's GEMM the program waits for the W-1 peer
  partials (one epoch flag per source and tile) and adds them to its float32 accumulator, then
  stores the output tile. The sum stays on the owner: the output is the caller's tensor there,
  which peers cannot address.
- push_reducer (PUSH_ALL True): every partial, the own one too, goes to the owner's inbox; the
  COMM_SMS programs after the GEMM programs (higher ids: they never hold up a producer) wait per
  tile (FLAG "tile": W epoch flags) or per row of tiles (FLAG "row_block": an arrival counter
  reaching W * tiles_n) and sum RED_M rows at a time.

Per parity half (the call's epoch picks the half, so a peer one call ahead writes the other):
inbox [W - 1 (push_last) or W slots, tiles, BLOCK_M * BLOCK_N] in the partial dtype (float32 or
the output dtype: PARTIAL); flags [slots, tiles] epoch flags, or [tiles_m] counters (row_block),
each cleared by its reader (kernels/partials.py: `take`).

Faults: a program of an unhealthy workspace, or one that sees a fault recorded (a wait that ran
out here or on a peer), computes and pushes nothing more and writes NaN into the output tiles it
owns, so a failed call never looks valid.
"""
import triton
import triton.language as tl

from autofuse.kernels import gemm_core, partials, shmem


@triton.jit
def _reduce_tile(out, inbox, pos, pid_m, pid_n, tiles, ok, M_r, N, stride_om, stride_on,
                 WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RED_M: tl.constexpr):
    """out tile (pid_m, pid_n) = the sum of its W inbox slots, RED_M rows at a time (NaN unless ok)."""
    for r0 in tl.static_range(0, BLOCK_M, RED_M):
        total = tl.zeros((RED_M, BLOCK_N), dtype=tl.float32)
        if ok:
            for s in tl.static_range(WORLD):
                total += partials.load(partials.tile_ptr(inbox, s, pos, tiles, BLOCK_M, BLOCK_N) + r0 * BLOCK_N,
                                       RED_M, BLOCK_N)
        else:
            total = partials.nan_like(total)
        gemm_core.store_tile(out, total, pid_m * BLOCK_M + r0, pid_n * BLOCK_N, M_r, N, stride_om, stride_on,
                             RED_M, BLOCK_N, False)


@triton.jit(do_not_specialize=["M_r", "gemm_programs"])  # one binary for every M
def gemm_rs_kernel(a, b, out, scale_a, scale_b, inbox, inbox_half, flags, half_flags, sk_partials, sk_counts, ctx,
                   M_r, N, K_r, stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on, gemm_programs,
                   WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr, SPLIT_K: tl.constexpr,
                   SWAP_AB: tl.constexpr, USE_TMA: tl.constexpr,
                   PUSH_ALL: tl.constexpr, ROW_BLOCK: tl.constexpr, RED_M: tl.constexpr, B_T: tl.constexpr,
                   SCALE: tl.constexpr):
    """out (M_r x N) = this rank's rows of sum_q A_q @ B_q; a: M x K_r, b: K_r x N.

    push_last:    grid = (gemm_programs,),            gemm_programs = min(tiles * SPLIT_K, NUM_SMS)
    push_reducer: grid = (gemm_programs + COMM_SMS,), gemm_programs = min(tiles * SPLIT_K, NUM_SMS - COMM_SMS)
    with tiles = cdiv(M_r, BLOCK_M) * cdiv(N, BLOCK_N). sk_partials/sk_counts: the core's split-K
    workspace for W * tiles tiles (unused when SPLIT_K == 1). ctx: shmem.DeviceContext. FP8: b
    stored N x K_r (B_T) and this rank's scale_a/scale_b (SCALE) applied to its partial tiles.
    """
    epoch, healthy = shmem.epoch_begin(ctx)
    parity = shmem.parity(epoch)
    inbox += tl.cast(parity, tl.int64) * inbox_half
    flags += parity * half_flags
    rank = ctx.rank
    tiles_m = tl.cdiv(M_r, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    pid = tl.program_id(0)
    if pid < gemm_programs:
        a_src, b_src = gemm_core.operands(a, b, M_r * WORLD, N, K_r, stride_am, stride_ak, stride_bk, stride_bn,
                                          BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_T)
        alive = healthy
        for work in tl.range(pid, tiles * SPLIT_K, gemm_programs):
            pid_m, pid_n, tile, split, k_first, k_end = gemm_core.schedule(work, M_r, N, K_r, BLOCK_M, BLOCK_N,
                                                                           BLOCK_K, GROUP_M, SPLIT_K)
            pos = pid_m * tiles_n + pid_n
            pushed = 0  # bit g: this program pushed the tile of owner rank + 1 + g
            for g in range(0, WORLD - 1):
                owner = (rank + 1 + g) % WORLD
                alive = alive & partials.clean(ctx)
                acc, last = partials.partial_tile(a_src, b_src, sk_partials, sk_counts, g * tiles + tile, split,
                                                  owner * M_r + pid_m * BLOCK_M, pid_n * BLOCK_N, k_first, k_end,
                                                  alive, M_r * WORLD, N, K_r, stride_am, stride_ak, stride_bk,
                                                  stride_bn, scale_a, scale_b, BLOCK_M, BLOCK_N, BLOCK_K,
                                                  NUM_STAGES, SPLIT_K, SWAP_AB, USE_TMA, B_T, SCALE)
                if last & alive:
                    partials.push(partials.tile_ptr(inbox, partials.slot(rank, owner, WORLD), pos, tiles,
                                                    BLOCK_M, BLOCK_N), acc, rank, owner, ctx.heap_bases,
                                  BLOCK_M, BLOCK_N)
                    pushed = pushed | (1 << g)
            # my own tile last: its K loop runs while the pushes above cross the link, so raising
            # their flags after it (a release waits for the stores) costs no stall
            alive = alive & partials.clean(ctx)
            acc, last = partials.partial_tile(a_src, b_src, sk_partials, sk_counts, (WORLD - 1) * tiles + tile, split,
                                              rank * M_r + pid_m * BLOCK_M, pid_n * BLOCK_N, k_first, k_end, alive,
                                              M_r * WORLD, N, K_r, stride_am, stride_ak, stride_bk, stride_bn,
                                              scale_a, scale_b, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, SPLIT_K,
                                              SWAP_AB, USE_TMA, B_T, SCALE)
            if PUSH_ALL:
                if last & alive:  # into my own inbox's slot W - 1 (a local store)
                    partials.push(partials.tile_ptr(inbox, WORLD - 1, pos, tiles, BLOCK_M, BLOCK_N), acc, rank, rank,
                                  ctx.heap_bases, BLOCK_M, BLOCK_N)
                    pushed = pushed | (1 << (WORLD - 1))
            for g in range(0, WORLD):
                if (pushed >> g) & 1:
                    owner = (rank + 1 + g) % WORLD
                    if ROW_BLOCK:
                        tl.debug_barrier()  # every thread's stores precede the release
                        shmem.atomic_add(flags + pid_m, 1, rank, owner, ctx.heap_bases, sem="release", scope="sys")
                    else:
                        shmem.signal(flags + partials.slot(rank, owner, WORLD) * tiles + pos, epoch, rank, owner,
                                     ctx.heap_bases)
            if not PUSH_ALL:
                if last:
                    ok = partials.take(flags + pos, tiles, WORLD - 1, epoch, alive, ctx)
                    if ok:
                        for s in range(0, WORLD - 1):
                            acc += partials.load(partials.tile_ptr(inbox, s, pos, tiles, BLOCK_M, BLOCK_N),
                                                 BLOCK_M, BLOCK_N)
                    else:
                        acc = partials.nan_like(acc)
                    gemm_core.store_tile(out, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, M_r, N, stride_om, stride_on,
                                         BLOCK_M, BLOCK_N, False)
    else:
        if ROW_BLOCK:
            for pid_m in range(pid - gemm_programs, tiles_m, tl.num_programs(0) - gemm_programs):
                ok = partials.take(flags + pid_m, 1, 1, WORLD * tiles_n, healthy, ctx)
                for pid_n in range(0, tiles_n):
                    _reduce_tile(out, inbox, pid_m * tiles_n + pid_n, pid_m, pid_n, tiles, ok, M_r, N,
                                 stride_om, stride_on, WORLD, BLOCK_M, BLOCK_N, RED_M)
        else:
            for tile in range(pid - gemm_programs, tiles, tl.num_programs(0) - gemm_programs):
                pid_m, pid_n = gemm_core.swizzle(tile, tiles_m, tiles_n, GROUP_M)  # the order tiles are made in
                pos = pid_m * tiles_n + pid_n
                ok = partials.take(flags + pos, tiles, WORLD, epoch, healthy, ctx)
                _reduce_tile(out, inbox, pos, pid_m, pid_n, tiles, ok, M_r, N, stride_om, stride_on,
                             WORLD, BLOCK_M, BLOCK_N, RED_M)
    shmem.epoch_end(ctx, tl.num_programs(0))
