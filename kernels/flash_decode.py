"""Split-KV decode attention across ranks: the device code of the `flash_decode` op.

Host side (configs, runners, expected cost of each variant): autofuse/ops/flash_decode.py.

Data
- q (B, Hq, D) contiguous, the same on every rank; k, v (B, Hkv, S, D) of this rank with unit stride
  along D only (their other strides are arguments, so a slice of a bigger cache works); lengths (B,)
  int32: the valid slots of each sequence on this rank, clamped to [0, S] here. GQA: query head h
  reads KV head h // G, G = Hq // Hkv.
- Rows: row = b * Hq + h, the B * Hq rows of q and of the output. A *unit* is HEADS consecutive rows
  that share one KV head (HEADS divides G): unit u holds rows [u * HEADS, (u + 1) * HEADS). Its
  tokens are split into NUM_SPLITS chunks of whole BLOCK_N blocks, sized from its sequence's length,
  so a ragged batch keeps every split busy.
- Partials (O, LSE) are float32: O normalised, LSE the log2 of the softmax denominator of scores
  scaled by log2(e) / sqrt(D) (base 2 throughout). No tokens: O = 0, LSE = -inf; every merge keeps
  that NaN-free, so an empty sequence gives O = 0 and a rank without tokens adds nothing.
- Split partials (local scratch): o_split[(row * NUM_SPLITS + split) * D + d], lse_split[row *
  NUM_SPLITS + split].
- A rank partial is a *slot*: O at slot[row * D + d], LSE at slot[rows * D + row]. Slots of the W
  ranks lie `slot_stride` floats apart: BSP's all-gathered buffer, or the heap inbox (one slot per
  source rank in each parity half; a source writes its slot on every rank, its own included).

Kernels, each with its launch grid (`units` = B * Hq / HEADS):
- `split_kernel`        (units * NUM_SPLITS,)           one split of one unit -> split partial
- `merge_splits_kernel` (units * D / BLOCK_D,)          [bsp] a unit's splits -> this rank's slot
- `merge_ranks_kernel`  (units * D / BLOCK_D,)          [bsp] the W gathered slots -> O, rank order
- `heap_combine_kernel` (groups * D / BLOCK_D,)         [hybrid] merge splits, push, wait, merge ranks
- `fused_kernel`        (units * NUM_SPLITS,)           [fused] split_kernel; a unit's last split
                                                        program then does heap_combine for the unit
Every rank merges the W rank partials in rank order with the same code, so O has the same bits on
every rank.
"""
import triton
import triton.language as tl

from autofuse.kernels import gemm_core, shmem


# -- device functions --------------------------------------------------------------------------
@triton.jit
def _attend(q, k, v, row0, b, kvh, lo, hi, HEADS, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
            stride_vs, scale, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    """Online-softmax attention of rows [row0, row0 + HEADS) over tokens [lo, hi) of KV head kvh of
    sequence b -> (O (BLOCK_H, D) normalised, LSE (BLOCK_H,)); no tokens -> (0, -inf)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = q + (row0 + offs_h).to(tl.int64)[:, None] * D + offs_d[None, :]
    qb = tl.load(q_rows, mask=(offs_h < HEADS)[:, None], other=0.0)
    k_head = k + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_head = v + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n
        valid = n < hi
        kb = tl.load(k_head + n.to(tl.int64)[:, None] * stride_ks + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = gemm_core.dot(qb, tl.trans(kb), tl.zeros([BLOCK_H, BLOCK_N], tl.float32)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every block holds a valid token
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        vb = tl.load(v_head + n.to(tl.int64)[:, None] * stride_vs + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc = gemm_core.dot(p.to(vb.dtype), vb, acc * alpha[:, None])
        m = m_new
    return _finish(m, l, acc)


@triton.jit
def _finish(m, l, acc):
    """Running merge state (max, weight sum, weighted sum) -> (O, LSE); no weight -> (0, -inf)."""
    has = l > 0
    l_safe = tl.where(has, l, 1.0)
    return acc / l_safe[:, None], tl.where(has, m + tl.log2(l_safe), float("-inf"))


@triton.jit
def _split_of(pid, q, k, v, lengths, o_split, lse_split, S, Hq, Hkv, HEADS, num_splits,
              stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, scale,
              D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program `pid` of a (units * num_splits,) unit-major grid: attention of one split of one unit,
    stored as its split partial. Returns the unit."""
    unit = pid // num_splits
    split = pid % num_splits
    row0 = unit * HEADS
    b = row0 // Hq
    kvh = (row0 % Hq) // (Hq // Hkv)
    length = tl.minimum(tl.maximum(tl.load(lengths + b), 0), S)
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, length)
    o, lse = _attend(q, k, v, row0, b, kvh, lo, hi, HEADS, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
                     stride_vs, scale, D, BLOCK_N, BLOCK_H)
    offs_h = tl.arange(0, BLOCK_H)
    idx = (row0 + offs_h).to(tl.int64) * num_splits + split
    tl.store(o_split + idx[:, None] * D + tl.arange(0, D)[None, :], o, mask=(offs_h < HEADS)[:, None])
    tl.store(lse_split + idx, lse, mask=offs_h < HEADS)
    return unit


@triton.jit
def _merge_splits(o_split, lse_split, row0, n, col0, num_splits, D: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_D: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """Rows [row0, row0 + n) x columns [col0, col0 + BLOCK_D) merged over their split partials ->
    (O (BLOCK_R, BLOCK_D), LSE (BLOCK_R,)). SPLIT_BLOCK splits per load round trip; the partials were
    written by other programs, so they are read past L1 (.cg)."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_c = col0 + tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, SPLIT_BLOCK)
    base = (row0 + offs_r).to(tl.int64) * num_splits
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        s = s0 + offs_s
        valid = (s[:, None] < num_splits) & (offs_r[None, :] < n)                    # (SPLIT_BLOCK, BLOCK_R)
        idx = base[None, :] + s[:, None]
        lse = tl.load(lse_split + idx, mask=valid, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(o_split + idx[:, :, None] * D + offs_c[None, None, :], mask=valid[:, :, None], other=0.0,
                    cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe[None, :])
        l = l * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        m = m_new
    return _finish(m, l, acc)


@triton.jit
def _merge_ranks(slots, slot_stride, n_rows, row0, n, col0, world, D: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Rows [row0, row0 + n) x columns [col0, col0 + BLOCK_D) of the W slots merged in rank order -> O."""
    offs_r = tl.arange(0, BLOCK_R)
    rows = (row0 + offs_r).to(tl.int64)
    rmask = offs_r < n
    offs_c = col0 + tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for src in range(0, world):
        slot = slots + tl.cast(src, tl.int64) * slot_stride
        lse = tl.load(slot + n_rows * D + rows, mask=rmask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(slot + rows[:, None] * D + offs_c[None, :], mask=rmask[:, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe)
        l = l * alpha + w
        acc = acc * alpha[:, None] + o * w[:, None]
        m = m_new
    o, _ = _finish(m, l, acc)
    return o


@triton.jit
def _store_rows(dest, row0, n, col0, x, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """x (BLOCK_R, BLOCK_D) -> dest[row, col] (row stride D) for the n valid rows, in dest's dtype."""
    offs_r = tl.arange(0, BLOCK_R)
    ptrs = dest + (row0 + offs_r).to(tl.int64)[:, None] * D + col0 + tl.arange(0, BLOCK_D)[None, :]
    tl.store(ptrs, x.to(dest.dtype.element_ty), mask=(offs_r < n)[:, None])


@triton.jit
def _heap_combine(o_split, lse_split, inbox, flags, out, ctx, epoch, healthy, row0, row_end, col0, flag, n_flags,
                  n_rows, num_splits, slot_stride, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                  SPLIT_BLOCK: tl.constexpr):
    """Rows [row0, row_end) x columns [col0, col0 + BLOCK_D) of one call: merge this rank's splits,
    push the rank partial into slot `rank` of every rank's inbox, raise flag `flag` of source `rank`
    on every peer, wait for the peers' flag `flag`, merge the W slots in rank order, write O.

    `inbox` and `flags` are this call's parity half. Push before wait: a program only waits for the
    same program of its peers, which pushes before it waits, so no wait depends on a program that
    has not started (in-order scheduling on GPUs, program-id order in the interpreter). An unhealthy
    workspace or a failed wait writes NaN instead of O.
    """
    rank = ctx.rank
    world = ctx.world
    my_slot = inbox + tl.cast(rank, tl.int64) * slot_stride
    offs_r = tl.arange(0, BLOCK_R)
    offs_c = col0 + tl.arange(0, BLOCK_D)
    if healthy:
        for r0 in range(row0, row_end, BLOCK_R):
            n = row_end - r0
            o, lse = _merge_splits(o_split, lse_split, r0, n, col0, num_splits, D, BLOCK_R, BLOCK_D, SPLIT_BLOCK)
            rows = (r0 + offs_r).to(tl.int64)
            rmask = offs_r < n
            for i in range(0, world):  # peers first, my own slot last
                to_rank = (rank + 1 + i) % world
                shmem.store(my_slot + rows[:, None] * D + offs_c[None, :], o, rank, to_rank, ctx.heap_bases,
                            mask=rmask[:, None])
                shmem.store(my_slot + n_rows * D + rows, lse, rank, to_rank, ctx.heap_bases, mask=rmask)
        tl.debug_barrier()  # my own slot is complete before any thread of this program reads it
        for i in range(1, world):
            shmem.signal(flags + rank * n_flags + flag, epoch, rank, (rank + i) % world, ctx.heap_bases)
    ok = healthy
    for i in range(1, world):
        if ok:
            ok = shmem.wait_until(flags + ((rank + i) % world) * n_flags + flag, epoch, ctx)
    for r0 in range(row0, row_end, BLOCK_R):
        o = tl.full([BLOCK_R, BLOCK_D], float("nan"), tl.float32)
        if ok:
            o = _merge_ranks(inbox, slot_stride, n_rows, r0, row_end - r0, col0, world, D, BLOCK_R, BLOCK_D)
        _store_rows(out, r0, row_end - r0, col0, o, D, BLOCK_R, BLOCK_D)


# -- kernels -----------------------------------------------------------------------------------
@triton.jit
def split_kernel(q, k, v, lengths, o_split, lse_split, S, Hq, Hkv, HEADS, num_splits,
                 stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, scale,
                 D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    """Split-KV attention: one split of one unit -> its split partial (local, no peers).

    grid = (units * num_splits,), unit-major (program p: unit p // num_splits, split p % num_splits).
    BLOCK_H >= 16 rows (HEADS of them valid) so both products run on tensor cores; K and V stream
    through BLOCK_N-token tiles, pipelined num_stages deep.
    """
    _split_of(tl.program_id(0), q, k, v, lengths, o_split, lse_split, S, Hq, Hkv, HEADS, num_splits,
              stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, scale, D, BLOCK_N, BLOCK_H)


@triton.jit
def merge_splits_kernel(o_split, lse_split, slot, n_rows, HEADS, num_splits,
                        D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """BSP: merge one unit's splits over BLOCK_D columns -> this rank's slot (local).

    grid = (units * D // BLOCK_D,): program p = unit p // (D // BLOCK_D), column block p % (D // BLOCK_D).
    """
    pid = tl.program_id(0)
    row0 = (pid // (D // BLOCK_D)) * HEADS
    col0 = (pid % (D // BLOCK_D)) * BLOCK_D
    o, lse = _merge_splits(o_split, lse_split, row0, HEADS, col0, num_splits, D, BLOCK_R, BLOCK_D, SPLIT_BLOCK)
    _store_rows(slot, row0, HEADS, col0, o, D, BLOCK_R, BLOCK_D)
    offs_r = tl.arange(0, BLOCK_R)
    tl.store(slot + n_rows * D + row0 + offs_r, lse, mask=offs_r < HEADS)


@triton.jit
def merge_ranks_kernel(slots, out, slot_stride, n_rows, HEADS, world,
                       D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """BSP: merge the W all-gathered slots of one unit over BLOCK_D columns, in rank order -> O.

    grid = (units * D // BLOCK_D,), as merge_splits_kernel.
    """
    pid = tl.program_id(0)
    row0 = (pid // (D // BLOCK_D)) * HEADS
    col0 = (pid % (D // BLOCK_D)) * BLOCK_D
    o = _merge_ranks(slots, slot_stride, n_rows, row0, HEADS, col0, world, D, BLOCK_R, BLOCK_D)
    _store_rows(out, row0, HEADS, col0, o, D, BLOCK_R, BLOCK_D)


@triton.jit
def heap_combine_kernel(o_split, lse_split, inbox, flags, out, ctx, n_rows, GROUP_ROWS, num_splits, slot_stride,
                        inbox_half, flags_half,
                        D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """Hybrid: the one-launch heap combine after split_kernel. One program per flag: a group of
    GROUP_ROWS rows (FLAG tile: one unit; row_block: one sequence; shard: every row) x BLOCK_D columns
    merges its splits, pushes the rank partial to every rank's inbox, raises its flag on every peer,
    waits for the peers' same flag and writes O merged in rank order (`_heap_combine`).

    grid = (cdiv(n_rows, GROUP_ROWS) * D // BLOCK_D,): program p = group p // (D // BLOCK_D), column
    block p % (D // BLOCK_D); flag p of each source. Inbox and flags are parity double-buffered on
    the device epoch (`inbox_half` floats, `flags_half` ints apart).
    """
    epoch, healthy = shmem.epoch_begin(ctx)
    pid = tl.program_id(0)
    par = shmem.parity(epoch)
    row0 = (pid // (D // BLOCK_D)) * GROUP_ROWS
    row_end = tl.minimum(row0 + GROUP_ROWS, n_rows)
    col0 = (pid % (D // BLOCK_D)) * BLOCK_D
    _heap_combine(o_split, lse_split, inbox + tl.cast(par, tl.int64) * inbox_half, flags + par * flags_half, out,
                  ctx, epoch, healthy, row0, row_end, col0, pid, tl.num_programs(0), n_rows, num_splits, slot_stride,
                  D, BLOCK_R, BLOCK_D, SPLIT_BLOCK)
    shmem.epoch_end(ctx, tl.num_programs(0))


@triton.jit
def fused_kernel(q, k, v, lengths, o_split, lse_split, arrivals, inbox, flags, out, ctx, S, Hq, Hkv, HEADS, num_splits,
                 slot_stride, inbox_half, flags_half, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                 scale, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                 SPLIT_BLOCK: tl.constexpr):
    """Fused: split_kernel, then the last split program of each unit to finish runs the heap combine
    for that unit (all D columns, flag = unit), all in one launch.

    grid = (units * num_splits,), unit-major, as split_kernel. `arrivals` (units int32, local, zero
    before the first call) counts a unit's finished splits; the last arriver resets it. It is not in
    the workspace's flags: other runners' epoch flags there would be miscounted as arrivals. A
    unit's last arriver waits only for the same unit on its peers, whose split programs never wait
    and precede every later unit's programs, so no wait depends on a program that cannot start.
    """
    epoch, healthy = shmem.epoch_begin(ctx)
    par = shmem.parity(epoch)
    units = tl.num_programs(0) // num_splits
    unit = _split_of(tl.program_id(0), q, k, v, lengths, o_split, lse_split, S, Hq, Hkv, HEADS, num_splits,
                     stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, scale, D, BLOCK_N, BLOCK_H)
    tl.debug_barrier()  # every thread's split partial precedes the release below
    if tl.atomic_add(arrivals + unit, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
        tl.store(arrivals + unit, 0)  # every split counted: ready for the next call
        _heap_combine(o_split, lse_split, inbox + tl.cast(par, tl.int64) * inbox_half, flags + par * flags_half,
                      out, ctx, epoch, healthy, unit * HEADS, unit * HEADS + HEADS, 0, unit, units, units * HEADS,
                      num_splits, slot_stride, D, BLOCK_R, D, SPLIT_BLOCK)
    shmem.epoch_end(ctx, tl.num_programs(0))
