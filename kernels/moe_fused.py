"""MoE's `fused` variants: the grouped GEMMs that move rows themselves.

`combine_gemm_kernel` (moe_combine): the experts' second grouped GEMM whose epilogue stores every output row
straight into its token's rank's return buffer, so the return all-to-all is the GEMM's own stores.
`dispatch_gemm_kernel` (moe_dispatch): one launch whose first programs push the token rows to their experts'
ranks (kernels/moe.py's all-to-all) while its other programs run the experts' first grouped GEMM (+ SwiGLU),
each tile starting as soon as the rows it covers have landed.

Both are persistent launches (at most one program per SM: programs wait for each other, so all of them
must be resident). Counts exchange, flags, parity sets and faults are kernels/moe.py's.

combine_gemm_kernel, three steps in every program:
1. Counts (kernels/moe.py's `exchange_counts`): N[s, e] = rows rank s sent to expert e. CNT doubles as
   READY: a peer raises it when its call starts, so its earlier reads of its return buffer (the weighted
   sum of its previous call) are done.
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

dispatch_gemm_kernel, programs [0, P) move rows, programs [P, P + G) compute:
- Mover p: kernels/moe.py's steps 1 and 2 (counts; its share of my send rows into the owners' receive
  buffers), DATA(me, p) raised on every rank, me included. It does not wait for the rows coming to me.
- Computer: waits for every peer's CNT(peer, 0) (its counts row is then in my inbox; mine is `sent`),
  derives the groups (rows of local expert l from source s start at row
  starts[l] + sum_{s' < s} N[s', first + l]) and walks the tiles of the grouped GEMM as
  combine's does (m-tiles numbered across groups, GROUP_M swizzle). Before a tile it waits for
  DATA(s, p) of every mover p of every source s whose rows the tile covers (once per source: a source's rows
  are dealt over all its movers), then stores act(rows @ w1[l]) into h (SwiGLU: gate and up, two
  accumulators, silu(gate) * up in float32).
  The rows of me come first in no particular order: a tile of rows from fast peers starts while a slow
  peer still sends.
- Capacity rows beyond the used ones and the NaN of a failed call are written by the host's next launch
  (kernels/moe_rows.py `settle_rows_kernel`): which rows a failed call reached is not known to every program.

Faults as everywhere: an unhealthy workspace or a failed wait computes nothing further and sets fault[program]
(the host turns it into NaN outputs without reading it). Flags: kernels/moe.py's layout,
FLAG_BASE + (kind * W + src) * P + program in the epoch's parity set, P the movers (dispatch) or all programs
(combine).
"""
import triton
import triton.language as tl
from autofuse.kernels import gemm_core, moe, shmem

CNT, DATA = moe.CNT, moe.DATA


@triton.jit
def _remote(pointer, me, to, heap_bases):
    """A tile of pointers (my addresses) into the heap of rank `to`, one rank per row (`to`: BLOCK_M x 1).

    shmem.translate with a rank per row: the distance of the heap bases, hinted as a multiple of 16
    elements along the rows (bases are page-aligned), so a row's columns keep 16-byte vector stores."""
    nbytes: tl.constexpr = pointer.dtype.element_ty.primitive_bitwidth // 8
    distance = (tl.load(heap_bases + to) - tl.load(heap_bases + me)) // nbytes
    return pointer + tl.multiple_of(distance, [16, 1])


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
    e_idx = tl.arange(0, E_P2)
    s_idx = tl.arange(0, W_P2)
    l_idx = tl.arange(0, L_P2)

    # 1. counts (and READY)
    ok, n, _ = moe.exchange_counts(sent, box, box_half, ctx, flags, half_flags, epoch, healthy, experts, p, nprog,
                                   W_P2, E_P2)
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
            shmem.signal(moe._flag(flags, half_flags, epoch, DATA, me, p, world, nprog), epoch, me, (me + i) % world,
                         ctx.heap_bases)

    # 3. every peer's rows of this program
    for i in range(1, world):
        q = (me + world - i) % world
        ok = ok & shmem.wait_until(moe._flag(flags, half_flags, epoch, DATA, q, p, world, nprog), epoch, ctx)
    if ok:
        tl.store(fault + p, 0)
    else:
        moe._fill_nan(dst, dst_rows, hidden, p, nprog, BLOCK_M, BLOCK_N)
        tl.store(fault + p, 1)
    shmem.epoch_end(ctx, nprog)


@triton.jit
def dispatch_gemm_kernel(x, rows, w1, h, sent, ids, order, counts_out, fault, scratch, box, box_half, ctx, flags,
                         half_flags, experts, local, topk, hidden, ffn, w1_cols, movers,
                         SWIGLU: tl.constexpr, W_P2: tl.constexpr, E_P2: tl.constexpr, L_P2: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, GROUP_M: tl.constexpr):
    """act(rows @ w1[l]) of the rows each local expert l receives, into h, while they arrive (module doc).

    x: T x hidden (my tokens), rows: my receive buffer (C x hidden, grouped by local expert, then source),
    w1: local x hidden x w1_cols ([gate | up] with SWIGLU, w1_cols = 2 * ffn; else ffn), h: C x ffn,
    sent / ids / order: my routing plan (kernels/moe.py), counts_out: the handle's counts (W x local int64,
    written by mover 0), fault: one int32 per program, scratch: movers x E_P2 int32.

    grid = (movers + computers,): programs below `movers` move rows (BLOCK_R x BLOCK_C a step), the others
    run work items (a group's m-tiles x n-tiles of h) round-robin, GROUP_M m-tiles at a time over the n-tiles.
    """
    p = tl.program_id(0)
    nprog = tl.num_programs(0)
    me = ctx.rank
    world = ctx.world
    epoch, healthy = shmem.epoch_begin(ctx)
    s_idx = tl.arange(0, W_P2)
    l_idx = tl.arange(0, L_P2)
    first = me * local
    if p < movers:
        ok, n, my_sent = moe.exchange_counts(sent, box, box_half, ctx, flags, half_flags, epoch, healthy, experts,
                                             p, movers, W_P2, E_P2)
        if p == 0:
            e_idx = tl.arange(0, E_P2)
            own = (e_idx >= first) & (e_idx < first + local)
            tl.store(counts_out + s_idx[:, None] * local + (e_idx - first)[None, :], n.to(tl.int64),
                     mask=(s_idx < world)[:, None] & own[None, :])
        if ok:
            moe.dispatch_rows(x, rows, ids, order, scratch, n, my_sent, ctx, flags, half_flags, epoch, local, topk,
                              hidden, p, movers, True, W_P2, E_P2, BLOCK_R, BLOCK_C)
    else:
        # the counts of my experts: N[s, first + l], every peer's row once its mover 0 raised CNT
        ok = healthy
        for i in range(1, world):
            q = (me + i) % world
            ok = ok & shmem.wait_until(moe._flag(flags, half_flags, epoch, CNT, q, 0, world, movers), epoch, ctx)
        mine = box + shmem.parity(epoch) * box_half
        l_ok = l_idx < local
        peers = tl.load(mine + s_idx[:, None] * experts + first + l_idx[None, :],
                        mask=((s_idx < world) & (s_idx != me))[:, None] & l_ok[None, :], other=0)
        my_row = tl.load(sent + first + l_idx, mask=l_ok, other=0).to(tl.int32)
        n_own = tl.where((s_idx == me)[:, None], my_row[None, :], peers)      # W_P2 x L_P2
        sizes = tl.sum(n_own, axis=0)                                          # rows of group l
        ends = tl.cumsum(sizes, axis=0)
        starts = ends - sizes
        seg = starts[None, :] + tl.cumsum(n_own, axis=0) - n_own               # where source s's rows of l start
        t_cnt = (sizes + BLOCK_M - 1) // BLOCK_M                               # m-tiles per group
        t_ends = tl.where(l_ok, tl.cumsum(t_cnt, axis=0), 2147483647)
        if ok:
            n_tiles = tl.cdiv(ffn, BLOCK_N)
            work_end = shmem.program_max(tl.sum(t_cnt, axis=0)) * n_tiles
            k_steps = tl.cdiv(hidden, BLOCK_K)
            landed = tl.zeros([W_P2], tl.int32)                                # 1: every row of source s is here
            for work in range(p - movers, work_end, nprog - movers):
                g = tl.sum((t_ends <= work // n_tiles).to(tl.int32), axis=0)  # the group of the work's m-tile
                at_g = l_idx == g
                tile0 = tl.sum(tl.where(at_g, t_ends - t_cnt, 0), axis=0)
                tiles_g = tl.sum(tl.where(at_g, t_cnt, 0), axis=0)
                pid_m, pid_n = gemm_core.swizzle(work - tile0 * n_tiles, tiles_g, n_tiles, GROUP_M)
                row_end = tl.sum(tl.where(at_g, ends, 0), axis=0)
                off_m = tl.sum(tl.where(at_g, starts, 0), axis=0) + pid_m * BLOCK_M
                off_n = pid_n * BLOCK_N
                # wait for the sources whose rows the tile covers (each once)
                lo = tl.sum(tl.where(at_g[None, :], seg, 0), axis=1)
                cnt = tl.sum(tl.where(at_g[None, :], n_own, 0), axis=1)
                need = (cnt > 0) & (lo < off_m + BLOCK_M) & (lo + cnt > off_m) & (landed == 0)
                for s in range(0, world):
                    if shmem.program_max(tl.sum(tl.where(s_idx == s, need, 0).to(tl.int32), axis=0)) > 0:
                        for m in range(0, movers):
                            ok = ok & shmem.wait_until(moe._flag(flags, half_flags, epoch, DATA, s, m, world, movers),
                                                       epoch, ctx)
                        landed = tl.where(s_idx == s, 1, landed)
                if ok:
                    wl = w1 + g.to(tl.int64) * hidden * w1_cols
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    acc = gemm_core.gemm_tile(acc, rows, wl, off_m, off_n, 0, k_steps, row_end, ffn, hidden,
                                              hidden, 1, w1_cols, 1, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
                                              False, False, False)
                    if SWIGLU:
                        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                        up = gemm_core.gemm_tile(up, rows, wl + ffn, off_m, off_n, 0, k_steps, row_end, ffn,
                                                 hidden, hidden, 1, w1_cols, 1, BLOCK_M, BLOCK_N, BLOCK_K,
                                                 NUM_STAGES, False, False, False)
                        acc = acc * tl.sigmoid(acc) * up
                    r = off_m + tl.arange(0, BLOCK_M)
                    c = off_n + tl.arange(0, BLOCK_N)
                    tl.store(h + r.to(tl.int64)[:, None] * ffn + c[None, :], acc.to(h.dtype.element_ty),
                             mask=(r < row_end)[:, None] & (c < ffn)[None, :])
    if ok:
        tl.store(fault + p, 0)
    else:
        tl.store(fault + p, 1)
    shmem.epoch_end(ctx, nprog)
