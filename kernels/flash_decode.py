"""Split-KV decode attention across ranks (device code of the `flash_decode` op).

Layout (host side: `autofuse/ops/flash_decode.py`):
- q (B, Hq, D), the same on every rank; K, V (B, Hkv, S, D) per rank, unit stride along D;
  lengths (B,) int32: how many of this rank's S slots hold tokens of each sequence (clamped to
  [0, S] on the device). GQA: query head h reads KV head h // G, G = Hq // Hkv.
- A *unit* is (b, kv head, head block): HEADS query heads of one KV head, padded to BLOCK_H rows
  for tl.dot; unit = (b * Hkv + kvh) * (G // HEADS) + head_block. A unit's K/V stream is split
  along the sequence into NUM_SPLITS chunks of whole BLOCK_N blocks, sized from that sequence's
  length so ragged batches keep every split busy.
- Partials are (O, LSE) in float32: O normalised, LSE = log2(sum(exp2(scores))) of scores
  already scaled by log2(e) / sqrt(D) (base 2 throughout; natural LSE = LSE * ln 2). No tokens:
  LSE = -inf and O = 0, and every merge below keeps that NaN-free.
- Split partials: part_o[(row * NUM_SPLITS + split) * D + d], part_lse[row * NUM_SPLITS + split],
  row = b * Hq + h. A rank partial (O_r, LSE_r) is a *slot* of rows * (D + 1) floats:
  O at [row * D + d], LSE at [rows * D + row]. BSP all-gathers slots; push stores its slot into
  every rank's inbox[(parity * W + src) * slot_stride], parity = epoch % 2.
- Flags: int32 epochs at flags[src, row // rows_per_flag] (row stride flag_stride) on every rank,
  raised by the last row of the group to be pushed (local arrival counters, reset by it).

Kernels, each with its launch grid:
- `split_kernel` (units * NUM_SPLITS): attention of one split -> split partial.
- `local_combine_kernel` (rows): merge a row's splits in one round trip -> rank partial; BSP
  writes it to a local slot, push stores it into every rank's inbox and raises group flags.
- `global_combine_kernel` (units): merge the W rank partials in rank order (every rank gets the
  same bits), waiting on flags first when pushed -> O in q's dtype.
- `fused_kernel` (units * NUM_SPLITS): the three above in one launch; the last split program of
  a unit to finish merges, pushes, waits for the peers' partials of that unit and writes O.
"""
import triton
import triton.language as tl

from autofuse.kernels import shmem


@triton.jit
def _unit_rows(unit, Hq, Hkv, G, HEADS, BLOCK_H: tl.constexpr):
    """Decode a unit id -> (b, kv head, first row of its query heads, head offsets, head mask)."""
    n_hblk = G // HEADS
    hblk = unit % n_hblk
    bh = unit // n_hblk
    kvh = bh % Hkv
    b = bh // Hkv
    offs_h = tl.arange(0, BLOCK_H)
    row0 = b * Hq + kvh * G + hblk * HEADS
    return b, kvh, row0, offs_h, offs_h < HEADS


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """tl.dot accumulating in fp32. UPCAST (set on CPU only) multiplies in fp32, exactly for
    bf16 inputs: Triton 3.9's interpreter multiplies the raw bit patterns of bf16 operands."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _attend_split(Q, K, V, Lengths, b, kvh, row0, offs_h, hmask, split, num_splits, S,
                  stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, scale,
                  D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, UPCAST: tl.constexpr):
    """Online-softmax attention of one unit's query heads over one split of its sequence.

    Returns (O, LSE): O (BLOCK_H, D) normalised, LSE (BLOCK_H,) base 2; no tokens -> (0, -inf).
    """
    length = tl.minimum(tl.maximum(tl.load(Lengths + b), 0), S)
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, length)

    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + (row0 + offs_h)[:, None].to(tl.int64) * D + offs_d[None, :], mask=hmask[:, None], other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n
        valid = n < hi
        k = tl.load(k_base + n[:, None].to(tl.int64) * stride_ks + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = _dot(q, tl.trans(k), UPCAST) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None].to(tl.int64) * stride_vs + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m = m_new
    has = l > 0
    o = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
    return o, lse


@triton.jit
def _merge(m, l, acc, lse_s, o_s):
    """Fold one partial (o_s normalised, lse_s) into the running (max, weight sum, weighted sum)."""
    m_new = tl.maximum(m, lse_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    beta = tl.exp2(lse_s - m_safe)
    return m_new, l * alpha + beta, acc * alpha[:, None] + o_s * beta[:, None]


@triton.jit
def _finish(m, l, acc):
    """Running merge state -> (O, LSE); no tokens anywhere -> (0, -inf)."""
    has = l > 0
    l_safe = tl.where(has, l, 1.0)
    return acc / l_safe[:, None], tl.where(has, m + tl.log2(l_safe), float("-inf"))


@triton.jit
def _store_split(PartO, PartLse, row0, offs_h, hmask, split, num_splits, o, lse, D: tl.constexpr):
    rows = (row0 + offs_h).to(tl.int64) * num_splits + split
    tl.store(PartO + rows[:, None] * D + tl.arange(0, D)[None, :], o, mask=hmask[:, None])
    tl.store(PartLse + rows, lse, mask=hmask)


@triton.jit
def _combine_splits(PartO, PartLse, row, num_splits, D: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """Merge one row's split partials -> (O_r (D,), LSE_r); one round trip per SPLIT_BLOCK splits.

    The partials were written by other programs: read past L1 (.cg).
    """
    offs_d = tl.arange(0, D)
    offs_s = tl.arange(0, SPLIT_BLOCK)
    base = tl.cast(row, tl.int64) * num_splits
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        s = s0 + offs_s
        valid = s < num_splits
        lse = tl.load(PartLse + base + s, mask=valid, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(PartO + (base + s)[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0,
                    cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe)
        l = l * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m = m_new
    has = l > 0
    l_safe = tl.where(has, l, 1.0)
    return acc / l_safe, tl.where(has, m + tl.log2(l_safe), float("-inf"))


@triton.jit
def _push_row(Inbox, n_rows, slot_stride, row, o, lse, epoch, rank, world, heap_bases, D: tl.constexpr):
    """Store one row of this rank's partial into every rank's inbox, slot [epoch % 2, rank]."""
    slot = Inbox + tl.cast((epoch % 2) * world + rank, tl.int64) * slot_stride
    row64 = tl.cast(row, tl.int64)
    o_ptrs = slot + row64 * D + tl.arange(0, D)
    for i in range(0, world):
        peer = (rank + 1 + i) % world
        shmem.store(o_ptrs, o, rank, peer, heap_bases)
        shmem.store(slot + n_rows * D + row64, lse, rank, peer, heap_bases)


@triton.jit
def _raise(Flags, Arrive, flag, arrivals, flag_stride, epoch, rank, world, heap_bases):
    """After this program's pushes, count it in flag group `flag`; the last of its `arrivals`
    programs (all of them when arrivals == 1) raises the flag to `epoch` on every rank."""
    tl.debug_barrier()  # every thread's stores precede the release below
    last = arrivals <= 1
    if arrivals > 1:
        last = tl.atomic_add(Arrive + flag, 1, sem="acq_rel", scope="sys") == arrivals - 1
    if last:
        if arrivals > 1:
            tl.store(Arrive + flag, 0)  # the whole group has counted: ready for the next call
        for i in range(0, world):
            shmem.signal(Flags + rank * flag_stride + flag, epoch, rank, (rank + 1 + i) % world, heap_bases)


@triton.jit
def _combine_ranks(Src, src_stride, Flags, n_rows, row0, offs_h, hmask, flag, flag_stride, epoch, rank, world,
                   heap_bases, status, spin_limit, WAIT: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr):
    """Merge the W rank partials of a unit in rank order; with WAIT, first wait for each one's flag.

    Returns (O, ok); ok is False when a wait timed out (the output is then not to be written).
    """
    offs_d = tl.arange(0, D)
    rows = (row0 + offs_h).to(tl.int64)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    ok = rank >= 0
    for src in range(0, world):
        if ok:
            if WAIT:
                ok = shmem.wait_until(Flags + src * flag_stride + flag, epoch, spin_limit, status, heap_bases, rank)
            if ok:
                slot = Src + tl.cast(src, tl.int64) * src_stride
                lse_s = tl.load(slot + n_rows * D + rows, mask=hmask, other=float("-inf"), cache_modifier=".cg")
                o_s = tl.load(slot + rows[:, None] * D + offs_d[None, :], mask=hmask[:, None], other=0.0,
                              cache_modifier=".cg")
                m, l, acc = _merge(m, l, acc, lse_s, o_s)
    o, _ = _finish(m, l, acc)
    return o, ok


@triton.jit
def _store_out(Out, row0, offs_h, hmask, o, D: tl.constexpr):
    rows = (row0 + offs_h).to(tl.int64)
    tl.store(Out + rows[:, None] * D + tl.arange(0, D)[None, :], o.to(Out.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def split_kernel(Q, K, V, Lengths, PartO, PartLse, S, Hq, Hkv, G, HEADS, num_splits,
                 stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, scale,
                 D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, UPCAST: tl.constexpr):
    """One split of one unit -> its split partial. Grid: (units * num_splits,), unit-major."""
    pid = tl.program_id(0)
    unit = pid // num_splits
    split = pid % num_splits
    b, kvh, row0, offs_h, hmask = _unit_rows(unit, Hq, Hkv, G, HEADS, BLOCK_H)
    o, lse = _attend_split(Q, K, V, Lengths, b, kvh, row0, offs_h, hmask, split, num_splits, S,
                           stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, scale,
                           D, BLOCK_N, BLOCK_H, UPCAST)
    _store_split(PartO, PartLse, row0, offs_h, hmask, split, num_splits, o, lse, D)


@triton.jit
def local_combine_kernel(PartO, PartLse, Dest, Flags, Arrive, Counter, n_rows, slot_stride, num_splits,
                         rows_per_flag, flag_stride, rank, world, heap_bases,
                         PUSH: tl.constexpr, D: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """Merge one row's splits -> this rank's partial of the row. Grid: (rows,).

    BSP (PUSH=False): into the local slot `Dest`. Push: into every rank's inbox `Dest`; the last
    row of each flag group raises the group's flag to this call's epoch (read from `Counter`; the
    global combine kernel, the last of the call, publishes the next one).
    """
    row = tl.program_id(0)
    o, lse = _combine_splits(PartO, PartLse, row, num_splits, D, SPLIT_BLOCK)
    if PUSH:
        epoch = shmem.epoch_next(Counter)
        _push_row(Dest, n_rows, slot_stride, row, o, lse, epoch, rank, world, heap_bases, D)
        _raise(Flags, Arrive, row // rows_per_flag, rows_per_flag, flag_stride, epoch, rank, world, heap_bases)
    else:
        row64 = tl.cast(row, tl.int64)
        tl.store(Dest + row64 * D + tl.arange(0, D), o)
        tl.store(Dest + n_rows * D + row64, lse)


@triton.jit
def global_combine_kernel(Src, Out, Flags, Counter, status, n_rows, slot_stride, Hq, Hkv, G, HEADS, rows_per_flag,
                          flag_stride, rank, world, heap_bases, spin_limit,
                          WAIT: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr):
    """Merge the W rank partials of one unit -> O. Grid: (units,).

    BSP (WAIT=False): `Src` is the all-gathered (W, slot) buffer. Push: `Src` is the inbox; this
    call's parity half is read, each source once its flag for the unit's group reached the
    epoch; the last program to finish publishes the next epoch.
    """
    unit = tl.program_id(0)
    _, _, row0, offs_h, hmask = _unit_rows(unit, Hq, Hkv, G, HEADS, BLOCK_H)
    epoch = 0
    base = Src
    if WAIT:
        epoch = shmem.epoch_next(Counter)
        base = Src + ((epoch % 2) * world).to(tl.int64) * slot_stride
    o, ok = _combine_ranks(base, slot_stride, Flags, n_rows, row0, offs_h, hmask, row0 // rows_per_flag, flag_stride,
                           epoch, rank, world, heap_bases, status, spin_limit, WAIT, D, BLOCK_H)
    if ok:
        _store_out(Out, row0, offs_h, hmask, o, D)
    if WAIT:
        shmem.epoch_finish(Counter, tl.num_programs(0))


@triton.jit
def fused_kernel(Q, K, V, Lengths, PartO, PartLse, Inbox, Out, Flags, Arrive, Counter, status,
                 S, Hq, Hkv, G, HEADS, num_splits, n_rows, slot_stride, flag_stride, rank, world, heap_bases,
                 spin_limit, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, scale,
                 D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                 UPCAST: tl.constexpr):
    """Split attention, then the last split of each unit merges, pushes and combines. Grid: (units * num_splits,).

    Unit-major program ids: a unit's last arriver only waits for the same unit on the peers,
    whose split programs never wait, so no program waits on one that may not have started
    (in-order dispatch on GPUs, program-id order in the interpreter).
    """
    pid = tl.program_id(0)
    epoch = shmem.epoch_next(Counter)
    unit = pid // num_splits
    split = pid % num_splits
    b, kvh, row0, offs_h, hmask = _unit_rows(unit, Hq, Hkv, G, HEADS, BLOCK_H)
    o, lse = _attend_split(Q, K, V, Lengths, b, kvh, row0, offs_h, hmask, split, num_splits, S,
                           stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, scale,
                           D, BLOCK_N, BLOCK_H, UPCAST)
    _store_split(PartO, PartLse, row0, offs_h, hmask, split, num_splits, o, lse, D)
    tl.debug_barrier()  # every thread's partial precedes the release below
    if tl.atomic_add(Arrive + unit, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
        tl.store(Arrive + unit, 0)  # all splits counted: ready for the next call
        for j in range(0, HEADS):
            o_r, lse_r = _combine_splits(PartO, PartLse, row0 + j, num_splits, D, SPLIT_BLOCK)
            _push_row(Inbox, n_rows, slot_stride, row0 + j, o_r, lse_r, epoch, rank, world, heap_bases, D)
        _raise(Flags, Arrive, unit, 1, flag_stride, epoch, rank, world, heap_bases)
        base = Inbox + ((epoch % 2) * world).to(tl.int64) * slot_stride
        o, ok = _combine_ranks(base, slot_stride, Flags, n_rows, row0, offs_h, hmask, unit, flag_stride, epoch, rank,
                               world, heap_bases, status, spin_limit, True, D, BLOCK_H)
        if ok:
            _store_out(Out, row0, offs_h, hmask, o, D)
    shmem.epoch_finish(Counter, tl.num_programs(0))
