"""moe_combine's `fused` variant: the experts' second grouped GEMM whose epilogue stores every output row
straight into its token's rank's return buffer, so the return all-to-all is the GEMM's own stores.

One persistent launch, P programs (at most one per SM: every program waits for its peers' same-index
program at the end, so all of them must be resident), three steps in every program:

1. Counts. As kernels/moe.py: every rank stores its `sent` vector into row `me` of every rank's counts
   inbox N (W x E int32, parity of the epoch), raises CNT(me, program) on every peer and waits for every
   peer's. N[s, e] = rows rank s sent to expert e. CNT doubles as READY: a peer raises it when its call
   starts, so its earlier reads of its return buffer (the weighted sum of its previous call) are done.
2. Tiles. The grouped GEMM h @ w2[l] over the rows of each local expert l (rows ends[l-1] .. ends[l] of
   h: grouped by expert, then source rank), tiles BLOCK_M x BLOCK_N dealt round-robin over the programs,
   m-tiles numbered across the groups (`tile_ends`: the cumulative m-tiles per group, on the device),
   GROUP_M m-tiles of a group at a time over its n-tiles (L2 reuse of w2's columns).
   Epilogue: grouped row r is source-major position m = index[r], which belongs to source rank s
   (m in [ss_s, ss_s + cnt_s), cnt_s = rows s sent to my experts) and lands at row base_s + m - ss_s of
   s's return buffer (base_s = rows s sent to experts of ranks before me: s's buffer is in s's send
   order, sorted by expert). The row goes there directly, a peer's buffer through the heap.
   Then DATA(me, program) is raised on every peer.
3. Wait for every peer's DATA(peer, program): once every program has, every row of every peer is in my
   return buffer and the weighted sum queued behind the launch reads it.

Faults as everywhere: an unhealthy workspace or a failed wait computes nothing further, fills the
program's share of the return buffer with NaN and sets fault[program] (the host turns it into NaN
outputs without reading it). Flags: FLAG_BASE + (kind * W + src) * P + program in the epoch's parity set.
"""
import triton
import triton.language as tl
from autofuse.kernels import gemm_core, shmem

CNT = tl.constexpr(0)
DATA = tl.constexpr(1)
FLAG_BASE = tl.constexpr(16)


@triton.jit
def _flag(flags, half_flags, epoch, kind, src, program, world, programs):
    """My copy of flag (kind, src, program) in the parity set of `epoch`."""
    return flags + shmem.parity(epoch) * half_flags + FLAG_BASE + (kind * world + src) * programs + program


@triton.jit
def _remote(pointer, me, to, heap_bases):
    """A tile of pointers (my addresses) into the heap of rank `to`, one rank per row (`to`: BLOCK_M x 1).

    shmem.translate with a rank per row: the distance of the heap bases, hinted as a multiple of 16
    elements along the rows (bases are page-aligned), so a row's columns keep 16-byte vector stores."""
    nbytes: tl.constexpr = pointer.dtype.element_ty.primitive_bitwidth // 8
    distance = (tl.load(heap_bases + to) - tl.load(heap_bases + me)) // nbytes
    return pointer + tl.multiple_of(distance, [16, 1])


@triton.jit
def _fill_nan(dst, dst_rows, width, program, programs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """NaN into this program's share of the rows of my `dst`."""
    for r0 in range(program * BLOCK_M, dst_rows, programs * BLOCK_M):
        rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        for c0 in range(0, width, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            mask = (rows < dst_rows)[:, None] & (cols < width)[None, :]
            nan = tl.full([BLOCK_M, BLOCK_N], float("nan"), tl.float32).to(dst.dtype.element_ty)
            tl.store(dst + rows[:, None] * width + cols[None, :], nan, mask=mask)


@triton.jit
def combine_gemm_kernel(h, w2, index, ends, tile_ends, dst, sent, fault, box, box_half, ctx, flags, half_flags,
                        experts, local, ffn, hidden, dst_rows,
                        W_P2: tl.constexpr, E_P2: tl.constexpr, L_P2: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NUM_STAGES: tl.constexpr, GROUP_M: tl.constexpr):
    """out rows of (h @ w2[expert]) into the token ranks' return buffers `dst` (see the module doc).

    h: C x ffn (grouped rows), w2: local x ffn x hidden, index: C (grouped row -> source-major
    position, -1 beyond the used rows), ends: local (row ends of the groups), tile_ends: local
    (cumulative m-tiles of BLOCK_M rows per group), dst: my return buffer (dst_rows = T * k rows of
    hidden, in my send order), sent: E int64 (my rows per expert), fault: P int32.

    grid = (P,): program p runs work items p, p + P, ...; a group's items are its m-tiles x n-tiles, walked
    GROUP_M m-tiles at a time column by column (gemm_core.swizzle), so programs running together share
    w2's columns in L2.
    """
    p = tl.program_id(0)
    nprog = tl.num_programs(0)
    me = ctx.rank
    world = ctx.world
    epoch, healthy = shmem.epoch_begin(ctx)
    mine = box + shmem.parity(epoch) * box_half
    e_idx = tl.arange(0, E_P2)
    s_idx = tl.arange(0, W_P2)
    l_idx = tl.arange(0, L_P2)
    e_ok = e_idx < experts
    my_sent = tl.load(sent + e_idx, mask=e_ok, other=0).to(tl.int32)

    # 1. counts (and READY)
    if healthy:
        for q in range(world):
            shmem.store(mine + me * experts + e_idx, my_sent, me, q, ctx.heap_bases, mask=e_ok)
        for i in range(1, world):
            shmem.signal(_flag(flags, half_flags, epoch, CNT, me, p, world, nprog), epoch, me, (me + i) % world,
                         ctx.heap_bases)
    ok = healthy
    for i in range(1, world):
        q = (me + i) % world
        ok = ok & shmem.wait_until(_flag(flags, half_flags, epoch, CNT, q, p, world, nprog), epoch, ctx)
    n = tl.load(mine + s_idx[:, None] * experts + e_idx[None, :], mask=(s_idx < world)[:, None] & e_ok[None, :],
                other=0)
    first = me * local
    own = (e_idx >= first) & (e_idx < first + local)
    cnt = tl.sum(tl.where(own[None, :], n, 0), axis=1)                  # rows I return to each rank s
    base = tl.sum(tl.where(e_idx[None, :] < first, n, 0), axis=1)       # where they start in s's buffer
    ss = tl.cumsum(cnt, axis=0) - cnt                                   # their source-major start here
    shift = (base - ss).to(tl.int64)
    s_end = tl.where(s_idx < world, ss + cnt, 2147483647)

    # 2. tiles, each row stored into its token's rank's buffer
    if ok:
        t_ends = tl.load(tile_ends + l_idx, mask=l_idx < local, other=2147483647)
        n_tiles = tl.cdiv(hidden, BLOCK_N)
        work_end = tl.load(tile_ends + local - 1).to(tl.int32) * n_tiles
        k_steps = tl.cdiv(ffn, BLOCK_K)
        for work in range(p, work_end, nprog):
            g = tl.sum((t_ends <= work // n_tiles).to(tl.int32), axis=0)  # the group of the work's m-tile
            tile0 = tl.load(tile_ends + g - 1, mask=g > 0, other=0).to(tl.int32)
            tiles_g = tl.load(tile_ends + g).to(tl.int32) - tile0
            pid_m, pid_n = gemm_core.swizzle(work - tile0 * n_tiles, tiles_g, n_tiles, GROUP_M)  # B shared in L2
            row0 = tl.load(ends + g - 1, mask=g > 0, other=0).to(tl.int32)
            row_end = tl.load(ends + g).to(tl.int32)
            off_m = row0 + pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = gemm_core.gemm_tile(acc, h, w2 + g.to(tl.int64) * ffn * hidden, off_m, off_n, 0, k_steps,
                                      row_end, hidden, ffn, ffn, 1, hidden, 1, BLOCK_M, BLOCK_N, BLOCK_K,
                                      NUM_STAGES, False, False, False)
            rows = off_m + tl.arange(0, BLOCK_M)
            live = rows < row_end
            m = tl.load(index + rows, mask=live, other=0)
            to = tl.sum((s_end[None, :] <= m[:, None]).to(tl.int32), axis=1)
            drow = tl.sum(tl.where(s_idx[None, :] == to[:, None], shift[None, :], 0), axis=1) + m
            cols = off_n + tl.arange(0, BLOCK_N)
            ptrs = dst + drow[:, None] * hidden + cols[None, :]
            tl.store(_remote(ptrs, me, to[:, None], ctx.heap_bases), acc.to(dst.dtype.element_ty),
                     mask=live[:, None] & (cols < hidden)[None, :])
        for i in range(1, world):
            shmem.signal(_flag(flags, half_flags, epoch, DATA, me, p, world, nprog), epoch, me, (me + i) % world,
                         ctx.heap_bases)

    # 3. every peer's rows of this program
    for i in range(1, world):
        q = (me + world - i) % world
        ok = ok & shmem.wait_until(_flag(flags, half_flags, epoch, DATA, q, p, world, nprog), epoch, ctx)
    if ok:
        tl.store(fault + p, 0)
    else:
        _fill_nan(dst, dst_rows, hidden, p, nprog, BLOCK_M, BLOCK_N)
        tl.store(fault + p, 1)
    shmem.epoch_end(ctx, nprog)
