"""MoE's one-launch heap all-to-all (the `hybrid` variants of moe_dispatch and moe_combine).

One kernel, two directions (MODE), the same three steps in every program:

1. Counts. Every rank stores its `sent` vector (E rows per expert, this call's routing) into row `me`
   of every rank's counts inbox N (W x E int32, parity of the epoch), then raises CNT(me, program)
   on every peer and waits for every peer's CNT(peer, program). Now every rank holds all of N:
   N[s, e] = rows rank s sends to expert e. The CNT flag doubles as READY: a peer raises it when
   its call starts, so everything it did before on its stream (the vendor GEMM reading its fixed
   receive buffer) is done, and the rows below may be stored into that fixed buffer.
2. Rows. Each program pushes its share of the rows (BLOCK_R rows x BLOCK_C columns a step, rows
   dealt round-robin over the programs) straight into the destination rank's fixed buffer, at rows
   computed here from N (no host reads: the call can be captured in a CUDA graph), then raises
   DATA(me, program) on that rank.
   DISPATCH: my slots in send order (sorted by expert: `order`, slot s = t * k + j) go to the rank
       owning their expert. The owner groups its rows by local expert, then source rank, then the
       source's order, so send row i of expert e lands at row
       i - start_mine[e] + sum_{e' of e's owner, e' < e} sum_s N[s, e'] + sum_{s < me} N[s, e].
       The source row is x[order[i] // k].
   COMBINE: the expert side sends each expert output row back to its token's rank s, into s's buffer
       in s's send order: my rows for s are source-major positions m in [ss_s, ss_s + cnt_s)
       (cnt_s = sum of N[s, e] over my experts, ss_s = sum_{s' < s} cnt_{s'}); position m is grouped
       row inv[m] (the inverse of the handle's `index`) and lands at row
       sum_{e < first expert of mine} N[s, e] + m - ss_s of s's buffer.
3. Wait for every peer's DATA(peer, program): once every program has, the launch has ended with
   every row in place, and the vendor GEMM (dispatch) or the top-k weighted sum (combine) that the
   host queued behind it reads the buffer.

A program whose workspace is unhealthy or whose wait failed pushes nothing it would compute from
counts it did not get, fills its share of the destination buffer with NaN and sets fault[program] = 1
(else 0): the host's epilogue turns a set fault into NaN outputs without reading it, so a graph
replay that failed leaves NaN too. Waits are bounded and faults collective (kernels/shmem.py).

Loop bounds are the program's (`shmem.program_max` of each sum): a sum over a vector small enough to
stay within a warp (a few ranks, a few experts) leaves one copy per warp, and the bounds must not
depend on which copy a thread holds (kernels/shmem.py: decisions are made once per program).

Flags (int32, the workspace's two parity sets; a call of epoch e uses set e % 2 and writes e):
FLAG_BASE + (kind * W + src) * P + program, kind CNT or DATA. Every wait is for the same program
index on a peer, so programs run one at a time (the interpreter) never wait on a later one.
"""
import triton
import triton.language as tl

from autofuse.kernels import shmem

DISPATCH = tl.constexpr(0)
COMBINE = tl.constexpr(1)

CNT = tl.constexpr(0)
DATA = tl.constexpr(1)
FLAG_KINDS = 2
FLAG_BASE = tl.constexpr(16)


@triton.jit
def _flag(flags, half_flags, epoch, kind, src, program, world, programs):
    """My copy of flag (kind, src, program) in the parity set of `epoch`."""
    return flags + shmem.parity(epoch) * half_flags + FLAG_BASE + (kind * world + src) * programs + program


@triton.jit
def _rows(src, src_rows, dst, dst_rows, count, width, me, to, heap_bases, BLOCK_R: tl.constexpr,
          BLOCK_C: tl.constexpr):
    """Row i of `dst` on rank `to` (my address) = row i of my `src`, rows given as int64 vectors;
    `count` of the BLOCK_R are real."""
    keep = tl.arange(0, BLOCK_R) < count
    s64 = src_rows.to(tl.int64)[:, None] * width
    d64 = dst_rows.to(tl.int64)[:, None] * width
    for c0 in range(0, width, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = keep[:, None] & (cols < width)[None, :]
        v = tl.load(src + s64 + cols[None, :], mask=mask)
        shmem.store(dst + d64 + cols[None, :], v, me, to, heap_bases, mask=mask)


@triton.jit
def _fill_nan(dst, dst_rows, width, program, programs, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """NaN into this program's share of the rows of my `dst` (rows dealt round-robin in blocks)."""
    for r0 in range(program * BLOCK_R, dst_rows, programs * BLOCK_R):
        rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        for c0 in range(0, width, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = (rows < dst_rows)[:, None] & (cols < width)[None, :]
            nan = tl.full([BLOCK_R, BLOCK_C], float("nan"), tl.float32).to(dst.dtype.element_ty)
            tl.store(dst + rows[:, None] * width + cols[None, :], nan, mask=mask)


@triton.jit
def exchange_counts(sent, box, box_half, ctx, flags, half_flags, epoch, healthy, experts, program, programs,
                    W_P2: tl.constexpr, E_P2: tl.constexpr):
    """Step 1 (module doc): my `sent` into row `me` of every rank's counts inbox, CNT(me, program) raised on
    every peer, every peer's awaited. Returns (ok, n, my_sent): n the W_P2 x E_P2 counts N (zero where not
    received), my_sent (E_P2, int32). Shared by every MoE kernel that exchanges counts (kernels/moe_fused.py)."""
    me = ctx.rank
    world = ctx.world
    mine = box + shmem.parity(epoch) * box_half
    e_idx = tl.arange(0, E_P2)
    s_idx = tl.arange(0, W_P2)
    e_ok = e_idx < experts
    my_sent = tl.load(sent + e_idx, mask=e_ok, other=0).to(tl.int32)
    if healthy:
        for q in range(0, world):
            shmem.store(mine + me * experts + e_idx, my_sent, me, q, ctx.heap_bases, mask=e_ok)
        for i in range(1, world):
            shmem.signal(_flag(flags, half_flags, epoch, CNT, me, program, world, programs), epoch, me,
                         (me + i) % world, ctx.heap_bases)
    ok = healthy  # an unhealthy call reads nothing: a flag it finds set may be of a peer's other call
    for i in range(1, world):
        q = (me + i) % world
        ok = ok & shmem.wait_until(_flag(flags, half_flags, epoch, CNT, q, program, world, programs), epoch, ctx)
    n_mask = (s_idx < world)[:, None] & e_ok[None, :]
    n = tl.load(mine + s_idx[:, None] * experts + e_idx[None, :], mask=n_mask, other=0)
    n = tl.where(ok, n, 0)  # counts not received: no row moves (and the handle says none came)
    return ok, n, my_sent


@triton.jit
def dispatch_rows(src, dst, ids, order, scratch, n, my_sent, ctx, flags, half_flags, epoch, local, topk, width,
                  program, programs, SIGNAL_SELF: tl.constexpr, W_P2: tl.constexpr, E_P2: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Step 2 of DISPATCH (module doc): this program's share of my send rows into their owners' receive
    buffers, DATA(me, program) raised on each owner after its rows (on me too with SIGNAL_SELF: a kernel
    whose other programs read my own rows, kernels/moe_fused.py)."""
    me = ctx.rank
    world = ctx.world
    e_idx = tl.arange(0, E_P2)
    s_idx = tl.arange(0, W_P2)
    owner = e_idx // local
    colsum = tl.sum(n, axis=0)                                         # rows to expert e, all sources
    below = tl.sum(tl.where(s_idx[:, None] < me, n, 0), axis=0)        # ... from sources before me
    before = tl.cumsum(colsum, axis=0) - colsum                        # ... to experts before e
    block = tl.zeros([E_P2], tl.int32)                                 # ... to experts before e's owner's
    for q in range(0, world):
        block = tl.where(owner == q, tl.sum(tl.where(e_idx < q * local, colsum, 0), axis=0), block)
    start = tl.cumsum(my_sent, axis=0) - my_sent                       # my send row of expert e's first
    tl.store(scratch + program * E_P2 + e_idx, before - block + below - start)
    tl.debug_barrier()  # the shifts are read back by other threads of this program
    for i in range(0, world):
        q = (me + i + 1) % world  # peers first, my own rows last
        lo = shmem.program_max(tl.sum(tl.where(owner < q, my_sent, 0), axis=0))
        hi = lo + shmem.program_max(tl.sum(tl.where(owner == q, my_sent, 0), axis=0))
        for r0 in range(lo + program * BLOCK_R, hi, programs * BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            live = rows < hi
            slot = tl.load(order + rows, mask=live, other=0)
            e = tl.load(ids + slot, mask=live, other=0)
            shift = tl.load(scratch + program * E_P2 + e, mask=live, other=0)
            _rows(src, slot // topk, dst, rows + shift, hi - r0, width, me, q, ctx.heap_bases, BLOCK_R, BLOCK_C)
        if SIGNAL_SELF:
            shmem.signal(_flag(flags, half_flags, epoch, DATA, me, program, world, programs), epoch, me, q,
                         ctx.heap_bases)
        elif q != me:
            shmem.signal(_flag(flags, half_flags, epoch, DATA, me, program, world, programs), epoch, me, q,
                         ctx.heap_bases)


@triton.jit
def all_to_all_kernel(src, dst, sent, ids, order, inv, counts_out, fault, scratch, box, box_half, ctx, flags,
                      half_flags, experts, local, topk, width, dst_rows,
                      MODE: tl.constexpr, W_P2: tl.constexpr, E_P2: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows of my `src` into the ranks' fixed heap buffers `dst` (see the module doc).

    DISPATCH: src = x (T x width), ids = topk_ids flattened (T*k), order = my slots in send order
    (T*k), counts_out = the handle's counts (W x L int64, written by program 0: N's columns of my
    experts), dst = the grouped receive rows (C x width). COMBINE: src = the expert outputs (C x
    width, grouped), inv = source-major position -> grouped row (C), dst = the returned rows in my
    send order (T*k x width). sent: my rows per expert (E, int64). scratch: P x E_P2 int32 (a
    program's per-expert row shifts, read back as a gather). box: the counts inbox (W x E int32 a
    parity, `box_half` apart). fault: P int32, 1 where the program's call failed.

    grid = (P,): program p moves rows p, p + P, ... (in blocks of BLOCK_R) of every destination.
    """
    p = tl.program_id(0)
    nprog = tl.num_programs(0)
    me = ctx.rank
    world = ctx.world
    epoch, healthy = shmem.epoch_begin(ctx)
    e_idx = tl.arange(0, E_P2)
    s_idx = tl.arange(0, W_P2)

    # 1. counts: my row of every rank's N, then CNT; wait for every peer's
    ok, n, my_sent = exchange_counts(sent, box, box_half, ctx, flags, half_flags, epoch, healthy, experts, p, nprog,
                                     W_P2, E_P2)
    first = me * local  # my first expert
    own = (e_idx >= first) & (e_idx < first + local)
    if MODE == DISPATCH:
        if p == 0:
            l_idx = e_idx - first
            tl.store(counts_out + s_idx[:, None] * local + l_idx[None, :], n.to(tl.int64),
                     mask=(s_idx < world)[:, None] & own[None, :])

    # 2. rows
    if ok:
        if MODE == DISPATCH:
            dispatch_rows(src, dst, ids, order, scratch, n, my_sent, ctx, flags, half_flags, epoch, local, topk, width,
                          p, nprog, False, W_P2, E_P2, BLOCK_R, BLOCK_C)
        else:
            cnt = tl.sum(tl.where(own[None, :], n, 0), axis=1)                   # rows I return to each rank
            base = tl.sum(tl.where(e_idx[None, :] < first, n, 0), axis=1)        # where they start there
            for i in range(0, world):
                s = (me + i + 1) % world
                ss = shmem.program_max(tl.sum(tl.where(s_idx < s, cnt, 0), axis=0))
                hi = ss + shmem.program_max(tl.sum(tl.where(s_idx == s, cnt, 0), axis=0))
                at = tl.sum(tl.where(s_idx == s, base, 0), axis=0) - ss
                for r0 in range(ss + p * BLOCK_R, hi, nprog * BLOCK_R):
                    rows = r0 + tl.arange(0, BLOCK_R)
                    grouped = tl.load(inv + rows, mask=rows < hi, other=0)
                    _rows(src, grouped, dst, rows + at, hi - r0, width, me, s, ctx.heap_bases, BLOCK_R, BLOCK_C)
                if s != me:
                    shmem.signal(_flag(flags, half_flags, epoch, DATA, me, p, world, nprog), epoch, me, s,
                                 ctx.heap_bases)

    # 3. every peer's rows of this program
    for i in range(1, world):
        q = (me + world - i) % world
        ok = ok & shmem.wait_until(_flag(flags, half_flags, epoch, DATA, q, p, world, nprog), epoch, ctx)
    if ok:
        tl.store(fault + p, 0)
    else:
        _fill_nan(dst, dst_rows, width, p, nprog, BLOCK_R, BLOCK_C)
        tl.store(fault + p, 1)
    shmem.epoch_end(ctx, nprog)
