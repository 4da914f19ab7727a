"""Fused all-gather + GEMM over the symmetric heap: one kernel, `ag_gemm_kernel` (host: autofuse/ops/ag_gemm.py).

Every source rank s holds one shard of A, R x C elements with row stride C:
  rows form (GATHER_K=False): R = M/W rows, C = K; output rows s*R .. s*R+R-1 need shard s only.
  k form    (GATHER_K=True):  R = M rows, C = K/W; every output tile sums over all W shards,
                              shard s multiplying rows s*C .. s*C+C-1 of B.

The kernel is one algorithm with constexpr switches; its programs are split in two roles:
  programs 0 .. comm_sms-1   producers: copy my shard where the consumers read it, raise flags;
                             the fewest that keep NVLink busy (COMM_SMS), so the GEMM keeps its
                             waves (with PERSISTENT they join the consumers when done, on GPUs).
  the other programs         consumers: work items (output tile x K split), each through the
                             GEMM core of kernels/gemm_core.py (TMA descriptors or pointer loads,
                             one tl.range K loop, split-K, swap-AB).

Constexpr switches (with the GEMM core's BLOCK_*, GROUP_M, NUM_STAGES, SPLIT_K, SWAP_AB, USE_TMA):
  PERSISTENT  push_ws: one program per SM; consumers take work items by ticket, in order, from a
              counter the last program resets; else (pull, push) one program per work item (the
              hardware hands SMs to programs as others finish).
  PULL        producers copy my shard into my own heap (parity slot) and raise flags at every
              peer; consumers read peers' shards from the peers' heaps (TMA or pointer loads).
              Else (push) producers store my shard into every peer's workspace and raise its
              flags there; consumers read only local memory.
  GATHERED    the layout of the workspace `data` (per epoch parity) and what tiles cover:
              False ("shard"): slot s (R x C at s*R*C) holds peer s's shard; my own shard is
                read straight from the caller's `a`. Rows form: tiles never span shards (each
                shard has cdiv(R, BLOCK_M) row blocks). k form: a tile runs one K loop per
                shard, mine first.
              True ("gathered", push only): `data` holds the whole gathered A (rows form: W*R x
                C, the slots stacked; k form: R x W*C, shard s at columns s*C). Rows form: tiles
                cover M rows and may span shards; a tile inside my own rows reads `a`, so my own
                rows are copied into `data` only when some tile spans two shards. k form: one K
                loop over W*C. SPLIT_K > 1 splits a tile's K loop (not in the k form's shard layout).
  FLAG        what one flag covers (flags[s, ...] in my heap, epoch values, two parity sets):
              SHARD     a whole source shard (every producer counts itself at the destination;
                        the last one resets the count and raises the flag);
              ROW_BLOCK BLOCK_M rows x all C columns of a source shard;
              TILE      one BLOCK_M x BLOCK_K tile of a source shard.
              A work item waits once, before its K loop (once per shard in the k form's shard
              layout), for exactly the flags of the rows and K steps it reads; B's first K steps
              are prefetched into L2 before the wait (B never depends on a peer).
  GATHER_K    the k form (else the rows form).
  B_T, SCALE  FP8, both forms: A and the workspace data are float8_e4m3fn (producers move the
              bytes as they move bf16 elements), B is stored N x K (b = w.t(), read K-major as the
              GEMM core's B_T; the k form's shard layout reads shard s's K columns of it), and each
              summed output tile is multiplied by the scales (gemm_core.scale_tile, SCALE) before
              it is stored in C's bfloat16: TENSORWISE, or ROWWISE, scale_a[row] x scale_b[col].
              Row-wise scale_a in the rows form is one per row of my shard: producers carry my
              rows' scales with my rows (into `scales`, the workspace's W*R float32 after the
              data, rows rank*R..), each unit's before the flag that publishes it, so a consumer's
              waits for a tile's rows cover their scales; the tile then scales its rows from my
              own scale_a (my rows) or from `scales` (a peer's: in that peer's heap with PULL).
              In the k form every rank's scale_a already covers all M rows: nothing moves.

Order: the consumers start at my own rows (they wait for nothing), then the rows of rank+1,
rank+2, ... which is the order the data arrives in: push producers serve rank-1, rank-2, ... in
turn, so every rank receives from one peer at a time, rank+1 first. In the k form a tile's K loops
run my shard first. Producers are the lowest program ids and never wait while producing, so the
interpreter (programs run in id order) and GPUs (low ids dispatch first) cannot deadlock; under
the interpreter they never consume (a producer taking work could wait for a later producer).

Epochs and faults (kernels/shmem.py): every program calls epoch_begin first and epoch_end last; a
call of epoch e uses parity e % 2 of `data` and `flags`, and waits for exactly e. When the
workspace is unhealthy or a wait gives up, the work item skips its K loops and stores NaN: a fault
never looks like a result. SPLIT_K partials of a failed item are NaN, so the summed tile is too.
"""
import triton
import triton.language as tl

from autofuse.kernels import gemm_core, shmem

TILE = tl.constexpr(0)
ROW_BLOCK = tl.constexpr(1)
SHARD = tl.constexpr(2)
PREFETCH = tl.constexpr(2)  # K steps of B sent to L2 before a wait (a power of two)


# -- producers ----------------------------------------------------------------------------------
@triton.jit
def _raise(flag, epoch, dest, also_mine, ctx, PULL: tl.constexpr):
    """Publish one unit: at `dest` (push; and at me when `also_mine`), at every peer (pull)."""
    if PULL:
        for i in range(1, ctx.world):
            shmem.signal(flag, epoch, ctx.rank, (ctx.rank + i) % ctx.world, ctx.heap_bases)
    else:
        shmem.signal(flag, epoch, ctx.rank, dest, ctx.heap_bases)
        if also_mine:
            shmem.signal(flag, epoch, ctx.rank, ctx.rank, ctx.heap_bases)


@triton.jit
def _count(count, flag, epoch, dest, producers, ctx, PULL: tl.constexpr):
    """Count one producer done at `dest`; the last of `producers` resets the count and raises `flag`."""
    tl.debug_barrier()  # every thread's stores precede the count's release
    done = shmem.atomic_add(count, 1, ctx.rank, dest, ctx.heap_bases, sem="acq_rel", scope="sys")
    if done == producers - 1:
        shmem.atomic_xchg(count, 0, ctx.rank, dest, ctx.heap_bases, sem="relaxed", scope="sys")
        _raise(flag, epoch, dest, False, ctx, PULL)


@triton.jit
def _copy(a, dst, mine, also_mine, row0, col0, R, C, ld, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Copy A[row0:+BLOCK_R, col0:+BLOCK_C] of my shard (R x C) to `dst` (and `mine`) with row stride ld."""
    rows = row0 + tl.arange(0, BLOCK_R)
    cols = col0 + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(a + rows[:, None] * C + cols[None, :], mask=mask)
    offs = rows[:, None] * ld + cols[None, :]
    tl.store(dst + offs, x, mask=mask)
    if also_mine:
        tl.store(mine + offs, x, mask=mask)


@triton.jit
def _copy_flat(a, dst, mine, also_mine, first, end, BLOCK: tl.constexpr):
    """Copy elements [first, end) of my shard (contiguous at both ends) to `dst` (and `mine`). The loop
    counts its steps: over the start offset instead, Triton 3.6 tests the loop's exit on one thread's
    mask lane for 1-byte elements, and the barrier of the flag raised after it reads as per-thread
    (tests/divergence.py)."""
    for step in range(0, tl.cdiv(end - first, BLOCK)):
        offs = first + step * BLOCK + tl.arange(0, BLOCK)
        mask = offs < end
        x = tl.load(a + offs, mask=mask)
        tl.store(dst + offs, x, mask=mask)
        if also_mine:
            tl.store(mine + offs, x, mask=mask)


@triton.jit
def _copy_scales(scale_a, dst, mine, also_mine, row0, R, BLOCK_M: tl.constexpr):
    """Copy my FP8 row-wise scale_a[row0:+BLOCK_M] (R rows) to `dst` (and `mine`): the scales of the
    rows a flag unit publishes, stored before its flag so that every wait for those rows finds them."""
    rows = row0 + tl.arange(0, BLOCK_M)
    mask = rows < R
    x = tl.load(scale_a + rows, mask=mask)
    tl.store(dst + rows, x, mask=mask)
    if also_mine:
        tl.store(mine + rows, x, mask=mask)


@triton.jit
def produce(a, scale_a, data_p, scales_p, flags_p, counts_p, epoch, worker, producers, ctx, R, C,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, FLAG: tl.constexpr, GATHER_K: tl.constexpr,
            GATHERED: tl.constexpr, PULL: tl.constexpr, ROW_SCALES: tl.constexpr):
    """Producer `worker` of `producers`: copy my shard where consumers read it, raising its flags.

    Steps: push sends to rank-1, rank-2, ... in turn (the gathered layout also copies into my own
    buffer during the first step, or alone at W = 1, where tiles read it: the k form, and rows
    form tiles that span two shards); pull copies once, into my own heap.
    Within a step the chunks go round-robin over the producers, low rows first. A chunk is one
    flag unit (TILE: a BLOCK_M x BLOCK_K tile, ROW_BLOCK: BLOCK_M rows) or, for SHARD, COPY
    elements, after which every producer counts itself done at the destination. Rows are
    contiguous at both ends except in the gathered k layout (row stride W*C there), so whole row
    blocks and shard pieces are copied as flat ranges of 16-byte vectors.
    ROW_SCALES (FP8 row-wise, rows form): my R scales go to rows rank*R.. of `scales_p` wherever my
    rows go, each before a flag that covers them: a TILE or ROW_BLOCK unit carries its BLOCK_M rows'
    scales (TILE: in each of the row block's K tiles, so a split-K item's own waits cover them), a
    SHARD step the whole shard's (row blocks round-robin over the producers, before they count).
    """
    COPY: tl.constexpr = 16384  # elements per flat copy step (32 KB of bf16 in flight per program)
    W = ctx.world
    rank = ctx.rank
    RB = tl.cdiv(R, BLOCK_M)
    KB = tl.cdiv(C, BLOCK_K)
    FLAT: tl.constexpr = not (GATHER_K and GATHERED)
    COPY_K: tl.constexpr = max(BLOCK_K, COPY // BLOCK_M)  # columns per step of a 2-D (gathered k) copy
    scales_mine = scales_p + rank * R
    if FLAT:  # my slot, R x C
        ld = C
        mine = data_p + tl.cast(rank, tl.int64) * R * C
    else:  # my columns of the gathered R x W*C
        ld = W * C
        mine = data_p + rank * C
    if FLAG == TILE:
        chunks = RB * KB
    elif FLAG == ROW_BLOCK:
        chunks = RB
    elif FLAT:
        chunks = tl.cdiv(R * C, COPY)
    else:
        chunks = RB * tl.cdiv(C, COPY_K)
    # the gathered layout needs my own rows in `data` only for tiles that span shards (rows form)
    need_mine = (R % BLOCK_M != 0) | GATHER_K
    if PULL:
        steps = 1
    elif GATHERED:
        steps = tl.where(need_mine, max(W - 1, 1), W - 1)
    else:
        steps = W - 1
    for step in range(0, steps):
        if PULL:
            dest = rank
        else:
            dest = (rank + 2 * W - 1 - step) % W
        also_mine = (step == 0) & (dest != rank) & need_mine & GATHERED
        dst = tl.multiple_of(shmem.translate(mine, rank, dest, ctx.heap_bases), 16)  # rows stay 16-byte aligned
        scales_dst = shmem.translate(scales_mine, rank, dest, ctx.heap_bases)
        for chunk in range(worker, chunks, producers):
            if FLAG == TILE:
                rb = chunk // KB
                kb = chunk % KB
                _copy(a, dst, mine, also_mine, rb * BLOCK_M, kb * BLOCK_K, R, C, ld, BLOCK_M, BLOCK_K)
                if ROW_SCALES:
                    _copy_scales(scale_a, scales_dst, scales_mine, also_mine, rb * BLOCK_M, R, BLOCK_M)
                _raise(flags_p + (rank * RB + rb) * KB + kb, epoch, dest, also_mine, ctx, PULL)
            elif FLAG == ROW_BLOCK:
                if ROW_SCALES:
                    _copy_scales(scale_a, scales_dst, scales_mine, also_mine, chunk * BLOCK_M, R, BLOCK_M)
                if FLAT:
                    _copy_flat(a, dst, mine, also_mine, chunk * BLOCK_M * C, min(chunk * BLOCK_M + BLOCK_M, R) * C,
                               COPY)
                else:
                    for col0 in range(0, C, COPY_K):
                        _copy(a, dst, mine, also_mine, chunk * BLOCK_M, col0, R, C, ld, BLOCK_M, COPY_K)
                _raise(flags_p + rank * RB + chunk, epoch, dest, also_mine, ctx, PULL)
            elif FLAT:
                _copy_flat(a, dst, mine, also_mine, chunk * COPY, min(chunk * COPY + COPY, R * C), COPY)
            else:
                pieces = tl.cdiv(C, COPY_K)
                _copy(a, dst, mine, also_mine, (chunk // pieces) * BLOCK_M, (chunk % pieces) * COPY_K, R, C, ld,
                      BLOCK_M, COPY_K)
        if FLAG == SHARD:
            if ROW_SCALES:
                for rb in range(worker, RB, producers):
                    _copy_scales(scale_a, scales_dst, scales_mine, also_mine, rb * BLOCK_M, R, BLOCK_M)
            _count(counts_p + rank, flags_p + rank, epoch, dest, producers, ctx, PULL)
            if also_mine:
                _count(counts_p + rank, flags_p + rank, epoch, rank, producers, ctx, False)


# -- consumers ----------------------------------------------------------------------------------
@triton.jit
def _wait_one(flag, epoch, ok, ctx):
    """shmem.wait_until (bounded, exact epoch, acquire) unless an earlier wait failed."""
    if ok:
        ok = shmem.wait_until(flag, epoch, ctx)
    return ok


@triton.jit
def _wait(flags_p, s, rb_first, rb_last, kb_first, kb_last, RB, KB, epoch, ok, ctx, FLAG: tl.constexpr):
    """Wait (bounded, exact epoch) for shard s's units covering row blocks [rb_first, rb_last] and
    K blocks [kb_first, kb_last]; after one failure waits no more. True if every flag came."""
    if FLAG == SHARD:
        ok = _wait_one(flags_p + s, epoch, ok, ctx)
    elif FLAG == ROW_BLOCK:
        for rb in range(rb_first, rb_last + 1):
            ok = _wait_one(flags_p + s * RB + rb, epoch, ok, ctx)
    else:
        for rb in range(rb_first, rb_last + 1):
            for kb in range(kb_first, kb_last + 1):
                ok = _wait_one(flags_p + (s * RB + rb) * KB + kb, epoch, ok, ctx)
    return ok


@triton.jit
def _tma_visible(USE_TMA: tl.constexpr):
    """After an acquire: make the peers' (generic-proxy) stores visible to this thread's TMA loads."""
    if USE_TMA and not gemm_core.INTERPRETED:
        tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _source(ptr, rows, cols, ld, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, USE_TMA: tl.constexpr):
    """What gemm_core.gemm_tile reads a rows x cols matrix (row stride ld) through: a TMA descriptor
    (USE_TMA; 16-byte aligned base and row stride) or the pointer itself."""
    if USE_TMA:
        return tl.make_tensor_descriptor(ptr, shape=[rows, cols], strides=[ld, 1], block_shape=[BLOCK_R, BLOCK_C])
    else:
        return ptr


@triton.jit
def _prefetch_b(b, off_n, k_first, k_end, N, K, ldb, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                B_T: tl.constexpr):
    """gemm_core.prefetch_b for B (K x N, row stride ldb) over K steps [k_first, k_end); with B_T, B is
    stored N x K (row stride ldb), so the prefetch runs over that storage: the tile's BLOCK_N rows,
    their first PREFETCH K steps."""
    if B_T:
        gemm_core.prefetch_b(b, k_first * BLOCK_K, off_n // BLOCK_N, off_n // BLOCK_N + 1, min(k_end * BLOCK_K, K), N,
                             ldb, 1, BLOCK_N, PREFETCH * BLOCK_K, 1)
    else:
        gemm_core.prefetch_b(b, off_n, k_first, k_end, N, K, ldb, 1, BLOCK_K, BLOCK_N, PREFETCH)


@triton.jit
def _mma(acc, ok, src, b_src, off_m, off_n, k_first, k_end, rows, N, K, ldb,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
         SWAP_AB: tl.constexpr, USE_TMA: tl.constexpr, B_T: tl.constexpr):
    """acc += A[off_m:+BLOCK_M, steps] @ B[steps, off_n:+BLOCK_N] over K steps [k_first, k_end) for
    A (rows x K, row stride K) read through `src`, B (K x N) through `b_src`, row-major or with B_T
    stored N x K, with row stride ldb; no step when not ok. Each caller's K loop is its own pipeline:
    sequential loops share shared memory, loops in the two arms of an `if` do not."""
    if B_T:
        stride_bk = 1
        stride_bn = ldb
    else:
        stride_bk = ldb
        stride_bn = 1
    return gemm_core.gemm_tile(acc, src, b_src, off_m, off_n, k_first, tl.where(ok, k_end, k_first), rows, N, K,
                               K, 1, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, SWAP_AB, USE_TMA,
                               False, B_T)


@triton.jit
def _peer_source(data_p, g_src, s, ctx, R, C, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_TMA: tl.constexpr, PULL: tl.constexpr):
    """Where shard s lives for a consumer: peer s's own slot (pull), else the local data (g_src)."""
    if PULL:
        slot = shmem.translate(data_p + tl.cast(s, tl.int64) * R * C, ctx.rank, s, ctx.heap_bases)
        return _source(tl.multiple_of(slot, 16), R, C, C, BLOCK_M, BLOCK_K, USE_TMA)
    else:
        return g_src


@triton.jit
def _peer_scales(scales_p, s, ctx, R, PULL: tl.constexpr):
    """Where shard s's R row-wise scales live for a consumer: in peer s's heap (pull), else in mine."""
    if PULL:
        return shmem.translate(scales_p + s * R, ctx.rank, s, ctx.heap_bases)
    else:
        return scales_p + s * R


@triton.jit
def _finish(acc, ok, partials, counts, tile, split, c, c_dst, s, rb, m0, off_n, R, M, N, scale_a, sa_off, sa_rows,
            scale_b, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, USE_TMA: tl.constexpr,
            SHARD_ROWS: tl.constexpr, SCALE: tl.constexpr):
    """NaN for a failed item, split-K reduction, the FP8 scales (SCALE; ROWWISE: the tile's rows are
    rows sa_off.. of the sa_rows scales at scale_a), then the store (by the last split)."""
    acc = tl.where(ok, acc, float("nan"))
    acc, last = gemm_core.split_k_reduce(acc, partials, counts, tile, split, SPLIT_K, BLOCK_M, BLOCK_N)
    if last:
        acc = gemm_core.scale_tile(acc, scale_a, scale_b, sa_off, off_n, sa_rows, N, BLOCK_M, BLOCK_N, SCALE)
        if SHARD_ROWS:  # rows past the shard's last row belong to the next shard: masked pointer store
            gemm_core.store_tile(c + tl.cast(s, tl.int64) * R * N, acc, rb * BLOCK_M, off_n, R, N, N, 1,
                                 BLOCK_M, BLOCK_N, False)
        else:
            gemm_core.store_tile(c_dst, acc, m0, off_n, M, N, N, 1, BLOCK_M, BLOCK_N, USE_TMA)


@triton.jit
def _rows_work(i, LOCAL: tl.constexpr, start, count, a_src, g_src, b, b_src, c, c_dst, scale_a, scale_b, data_p,
               scales_p, flags_p, partials, counts, epoch, healthy, ctx, R, C, N, MT, RB, KB,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               NUM_STAGES: tl.constexpr, SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr, USE_TMA: tl.constexpr,
               FLAG: tl.constexpr, GATHERED: tl.constexpr, PULL: tl.constexpr, B_T: tl.constexpr,
               SCALE: tl.constexpr):
    """Rows form: work item i of the `count` row tiles from row tile `start` (mod MT), all reading my
    own shard (LOCAL: straight from `a`, no wait) or none of them (after the waits for the rows
    they read). GATHERED: rows [m0, m0 + BLOCK_M) of the gathered A; else row block rb of shard s.
    FP8 row-wise scales: my rows' from the caller's scale_a, a peer's from the gathered copy at
    `scales_p` (`_peer_scales`), which the waits for those rows cover."""
    W = ctx.world
    rank = ctx.rank
    pid_m, pid_n, _, split, k_first, k_end = gemm_core.schedule(i, count * BLOCK_M, N, C, BLOCK_M, BLOCK_N,
                                                                BLOCK_K, GROUP_M, SPLIT_K)
    mt = (start + pid_m) % MT
    off_n = pid_n * BLOCK_N
    if GATHERED:
        m0 = mt * BLOCK_M
        s = 0
        rb = 0
        off_local = m0 - rank * R
        off_remote = m0
    else:
        s = mt // RB
        rb = mt % RB
        m0 = s * R + rb * BLOCK_M
        off_local = rb * BLOCK_M
        off_remote = off_local
        if not PULL:
            off_remote += s * R
    ldb = N
    if B_T:  # B stored N x K, K = C
        ldb = C
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ok = healthy
    if LOCAL:
        acc = _mma(acc, ok, a_src, b_src, off_local, off_n, k_first, k_end, R, N, C, ldb,
                   BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, SWAP_AB, USE_TMA, B_T)
    else:
        _prefetch_b(b, off_n, k_first, k_end, N, C, ldb, BLOCK_K, BLOCK_N, B_T)
        if GATHERED:  # every shard that rows [m0, m0 + BLOCK_M) touch, mine included
            for src in range(m0 // R, min(tl.cdiv(m0 + BLOCK_M, R), W)):
                first_row = max(m0 - src * R, 0)
                last_row = min(m0 + BLOCK_M - src * R, R) - 1
                ok = _wait(flags_p, src, first_row // BLOCK_M, last_row // BLOCK_M, k_first, k_end - 1, RB, KB,
                           epoch, ok, ctx, FLAG)
        else:
            ok = _wait(flags_p, s, rb, rb, k_first, k_end - 1, RB, KB, epoch, ok, ctx, FLAG)
        _tma_visible(USE_TMA)
        r_rows = W * R
        if PULL:  # a peer's own slot, R x C
            r_rows = R
        acc = _mma(acc, ok, _peer_source(data_p, g_src, s, ctx, R, C, BLOCK_M, BLOCK_K, USE_TMA, PULL), b_src,
                   off_remote, off_n, k_first, k_end, r_rows, N, C, ldb, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
                   SWAP_AB, USE_TMA, B_T)
    sa = scale_a
    sa_off = off_local
    sa_rows = R
    if SCALE == gemm_core.ROWWISE and not LOCAL:
        if GATHERED:  # rows m0.. of the gathered M scales
            sa = scales_p
            sa_off = m0
            sa_rows = W * R
        else:
            sa = _peer_scales(scales_p, s, ctx, R, PULL)
    _finish(acc, ok, partials, counts, mt * tl.cdiv(N, BLOCK_N) + pid_n, split, c, c_dst, s, rb, m0, off_n, R,
            W * R, N, sa, sa_off, sa_rows, scale_b, BLOCK_M, BLOCK_N, SPLIT_K, USE_TMA, not GATHERED, SCALE)


@triton.jit
def _b_shard(b, s, C, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr,
             B_T: tl.constexpr):
    """k form, shard layout: (pointer, source) of B's rows s*C .. s*C+C-1 (K x N row-major), or with
    B_T of the same K columns of its N x K storage (row stride K)."""
    if B_T:
        ptr = b + tl.cast(s, tl.int64) * C
        return ptr, _source(ptr, N, C, K, BLOCK_N, BLOCK_K, USE_TMA)
    else:
        ptr = b + tl.cast(s, tl.int64) * C * N
        return ptr, _source(ptr, C, N, N, BLOCK_K, BLOCK_N, USE_TMA)


@triton.jit
def _k_work(i, a_src, g_src, b, b_src, c_dst, scale_a, scale_b, data_p, flags_p, partials, counts, epoch, healthy,
            ctx, R, C, N, MT, RB, KB,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
            NUM_STAGES: tl.constexpr, SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr, USE_TMA: tl.constexpr,
            FLAG: tl.constexpr, GATHERED: tl.constexpr, PULL: tl.constexpr, B_T: tl.constexpr,
            SCALE: tl.constexpr):
    """k form: work item i. GATHERED: one K loop over the gathered R x W*C after the waits for the
    shards its K steps cover; else one K loop per shard, mine (from `a`) first, each peer's after
    its wait. FP8: the caller's scales cover the whole A (row-wise: all R = M rows), nothing to gather."""
    W = ctx.world
    rank = ctx.rank
    K = W * C
    ldb = N
    if B_T:  # B stored N x K
        ldb = K
    pid_m, pid_n, tile, split, k_first, k_end = gemm_core.schedule(i, MT * BLOCK_M, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                                                   GROUP_M, SPLIT_K)
    m0 = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ok = healthy
    if GATHERED:
        lo = k_first * BLOCK_K
        hi = min(k_end * BLOCK_K, K)
        _prefetch_b(b, off_n, k_first, k_end, N, K, ldb, BLOCK_K, BLOCK_N, B_T)
        for src in range(lo // C, tl.cdiv(hi, C)):
            first_col = max(lo - src * C, 0)
            last_col = min(hi - src * C, C) - 1
            ok = _wait(flags_p, src, pid_m, pid_m, first_col // BLOCK_K, last_col // BLOCK_K, RB, KB, epoch, ok,
                       ctx, FLAG)
        _tma_visible(USE_TMA)
        acc = _mma(acc, ok, g_src, b_src, m0, off_n, k_first, k_end, R, N, K, ldb,
                   BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, SWAP_AB, USE_TMA, B_T)
    else:
        _, b_mine = _b_shard(b, rank, C, N, K, BLOCK_N, BLOCK_K, USE_TMA, B_T)
        acc = _mma(acc, ok, a_src, b_mine, m0, off_n, 0, KB, R, N, C, ldb,
                   BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, SWAP_AB, USE_TMA, B_T)
        for j in range(1, W):
            s = (rank + j) % W
            b_s, b_s_src = _b_shard(b, s, C, N, K, BLOCK_N, BLOCK_K, USE_TMA, B_T)
            _prefetch_b(b_s, off_n, 0, KB, N, C, ldb, BLOCK_K, BLOCK_N, B_T)
            ok = _wait(flags_p, s, pid_m, pid_m, 0, KB - 1, RB, KB, epoch, ok, ctx, FLAG)
            _tma_visible(USE_TMA)
            off_remote = m0
            r_rows = R
            if not PULL:  # the slots stacked, W*R x C
                off_remote += s * R
                r_rows = W * R
            acc = _mma(acc, ok, _peer_source(data_p, g_src, s, ctx, R, C, BLOCK_M, BLOCK_K, USE_TMA, PULL),
                       b_s_src, off_remote, off_n, 0, KB, r_rows, N, C, ldb,
                       BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, SWAP_AB, USE_TMA, B_T)
    _finish(acc, ok, partials, counts, tile, split, c_dst, c_dst, 0, 0, m0, off_n, R, R, N, scale_a, m0, R, scale_b,
            BLOCK_M, BLOCK_N, SPLIT_K, USE_TMA, False, SCALE)


@triton.jit
def _ticket(tickets):
    """The next work item of a persistent launch (taken in order by whichever program is free)."""
    return tl.atomic_add(tickets, 1, sem="relaxed", scope="gpu")


@triton.jit
def _retire(tickets, takers):
    """A program holding a ticket past the work retires; the last of `takers` resets both counters."""
    done = tl.atomic_add(tickets + 1, 1, sem="acq_rel", scope="gpu")
    if done == takers - 1:
        tl.store(tickets, 0)
        tl.store(tickets + 1, 0)


@triton.jit
def consume(a, b, c, scale_a, scale_b, data_p, scales_p, flags_p, partials, counts, epoch, healthy, worker, workers,
            ctx, R, C, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
            NUM_STAGES: tl.constexpr, SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr, USE_TMA: tl.constexpr,
            FLAG: tl.constexpr, GATHER_K: tl.constexpr, GATHERED: tl.constexpr, PULL: tl.constexpr,
            PERSISTENT: tl.constexpr, B_T: tl.constexpr, SCALE: tl.constexpr):
    """Consumer `worker` of `workers` (see the module doc for the order of the work).

    Static (not PERSISTENT): items worker, worker + workers, ...; dynamic (PERSISTENT): tickets
    from the counter at counts[tiles], the exits counted at counts[tiles + 1]. Rows form: the
    items reading my own shard come first (their own loop), then the others (a second loop, so
    each K loop is one pipeline in shared memory: loops in the two arms of an `if` are not shared).
    """
    W = ctx.world
    rank = ctx.rank
    RB = tl.cdiv(R, BLOCK_M)
    KB = tl.cdiv(C, BLOCK_K)
    NT = tl.cdiv(N, BLOCK_N)
    if GATHER_K:
        M = R
        K = W * C
        MT = RB
    else:
        M = W * R
        K = C
        if GATHERED:
            MT = tl.cdiv(M, BLOCK_M)
        else:
            MT = W * RB
    tickets = counts + MT * NT
    if GATHER_K and GATHERED:  # the gathered R x W*C
        g_rows = R
        g_cols = W * C
    else:  # the slots stacked, W*R x C
        g_rows = W * R
        g_cols = C
    a_src = _source(a, R, C, C, BLOCK_M, BLOCK_K, USE_TMA)
    g_src = a_src
    if not PULL:
        g_src = _source(data_p, g_rows, g_cols, g_cols, BLOCK_M, BLOCK_K, USE_TMA)
    b_src = a_src  # the k form's shard layout reads B per shard (_b_shard)
    if not (GATHER_K and not GATHERED):
        if B_T:  # B stored N x K
            b_src = _source(b, N, K, K, BLOCK_N, BLOCK_K, USE_TMA)
        else:
            b_src = _source(b, K, N, N, BLOCK_K, BLOCK_N, USE_TMA)
    c_dst = c
    if USE_TMA and (GATHER_K or GATHERED):
        c_dst = tl.make_tensor_descriptor(c, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    n_all = MT * NT * SPLIT_K
    if GATHER_K:
        if PERSISTENT:
            i = _ticket(tickets)
            while i < n_all:
                nxt = _ticket(tickets)  # taken before the work: its latency hides behind it
                _k_work(i, a_src, g_src, b, b_src, c_dst, scale_a, scale_b, data_p, flags_p, partials, counts, epoch,
                        healthy, ctx, R, C, N, MT, RB, KB, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES, SPLIT_K,
                        SWAP_AB, USE_TMA, FLAG, GATHERED, PULL, B_T, SCALE)
                i = nxt
            _retire(tickets, workers)
        else:
            for i in tl.range(worker, n_all, workers):
                _k_work(i, a_src, g_src, b, b_src, c_dst, scale_a, scale_b, data_p, flags_p, partials, counts, epoch,
                        healthy, ctx, R, C, N, MT, RB, KB, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES, SPLIT_K,
                        SWAP_AB, USE_TMA, FLAG, GATHERED, PULL, B_T, SCALE)
    else:
        # my row tiles [lo, lo + L) first, then the others from lo + L on (mod MT): rank+1's first
        if GATHERED:  # the row tiles inside my own rows
            lo = tl.cdiv(rank * R, BLOCK_M)
            L = max((rank * R + R) // BLOCK_M - lo, 0)
            lo = tl.where(L > 0, lo, rank * R // BLOCK_M)
        else:
            lo = rank * RB
            L = RB
        n_local = L * NT * SPLIT_K
        if PERSISTENT:
            i = _ticket(tickets)
            while i < n_local:
                nxt = _ticket(tickets)  # taken before the work: its latency hides behind it
                _rows_work(i, True, lo, L, a_src, g_src, b, b_src, c, c_dst, scale_a, scale_b, data_p, scales_p,
                           flags_p, partials, counts, epoch, healthy, ctx, R, C, N, MT, RB, KB, BLOCK_M, BLOCK_N,
                           BLOCK_K, GROUP_M, NUM_STAGES, SPLIT_K, SWAP_AB, USE_TMA, FLAG, GATHERED, PULL, B_T, SCALE)
                i = nxt
            while i < n_all:
                nxt = _ticket(tickets)
                _rows_work(i - n_local, False, lo + L, MT - L, a_src, g_src, b, b_src, c, c_dst, scale_a, scale_b,
                           data_p, scales_p, flags_p, partials, counts, epoch, healthy, ctx, R, C, N, MT, RB, KB,
                           BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES, SPLIT_K, SWAP_AB, USE_TMA, FLAG, GATHERED,
                           PULL, B_T, SCALE)
                i = nxt
            _retire(tickets, workers)
        else:
            for i in tl.range(worker, n_local, workers):
                _rows_work(i, True, lo, L, a_src, g_src, b, b_src, c, c_dst, scale_a, scale_b, data_p, scales_p,
                           flags_p, partials, counts, epoch, healthy, ctx, R, C, N, MT, RB, KB, BLOCK_M, BLOCK_N,
                           BLOCK_K, GROUP_M, NUM_STAGES, SPLIT_K, SWAP_AB, USE_TMA, FLAG, GATHERED, PULL, B_T, SCALE)
            first_remote = worker + tl.cdiv(max(n_local - worker, 0), workers) * workers
            for i in tl.range(first_remote, n_all, workers):
                _rows_work(i - n_local, False, lo + L, MT - L, a_src, g_src, b, b_src, c, c_dst, scale_a, scale_b,
                           data_p, scales_p, flags_p, partials, counts, epoch, healthy, ctx, R, C, N, MT, RB, KB,
                           BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES, SPLIT_K, SWAP_AB, USE_TMA, FLAG, GATHERED,
                           PULL, B_T, SCALE)


# -- the kernel ---------------------------------------------------------------------------------
@triton.jit
def ag_gemm_kernel(a, b, c, scale_a, scale_b, data, scales, flags, partials, counts, ctx, R, C, N, data_half,
                   flags_half, comm_sms, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr, SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr,
                   USE_TMA: tl.constexpr, FLAG: tl.constexpr, GATHER_K: tl.constexpr, GATHERED: tl.constexpr,
                   PULL: tl.constexpr, PERSISTENT: tl.constexpr, B_T: tl.constexpr, SCALE: tl.constexpr):
    """C = all_gather(A) @ B on this rank: producers 0..comm_sms-1, consumers after them.

    a: my shard, R x C; b: K x N (B_T: stored N x K); c: M x N (all row-major). scale_a/scale_b:
    FP8's float32 scales (SCALE; any pointer otherwise): tensorwise, or row-wise scale_a (R x 1:
    my rows' in the rows form, the whole A's in the k form) and scale_b (1 x N). scales: FP8
    row-wise in the rows form: the workspace's float32 gathered scale_a, W*R per parity half, the
    halves as far apart as data's (any pointer otherwise). data/flags: the workspace's data (in
    A's dtype) and int32 flags, each two parity halves of data_half / flags_half elements; a
    half holds W arrival counts (FLAG = SHARD; always left at 0), then the unit flags, so calls
    with other configs never see a count they did not leave at 0. partials: float32 SPLIT_K
    partial tiles (gemm_core.split_k_reduce; unused when SPLIT_K == 1); counts: int32, one
    split-K arrival count per tile, then PERSISTENT's ticket and exit counters (all left at 0).
    ctx: the workspace's shmem.DeviceContext.

    grid = (comm_sms + work,)                        pull, push: one program per work item
    grid = (comm_sms + min(work, SMs - comm_sms),)   push_ws (PERSISTENT): work items by ticket;
                                                     on GPUs the producers join when done
    where work = tiles x SPLIT_K, tiles = m tiles x cdiv(N, BLOCK_N), m tiles = cdiv(M, BLOCK_M)
    (GATHERED rows form), W * cdiv(R, BLOCK_M) (rows form, shard layout), cdiv(R, BLOCK_M) (k form).
    Under the interpreter producers never consume: programs run one after another there, and a
    producer taking work could wait for a later producer's flag.
    """
    JOIN: tl.constexpr = PERSISTENT and not gemm_core.INTERPRETED
    ROW_SCALES: tl.constexpr = SCALE == gemm_core.ROWWISE and not GATHER_K
    epoch, healthy = shmem.epoch_begin(ctx)
    parity = shmem.parity(epoch)
    data_p = data + tl.cast(parity, tl.int64) * data_half
    DATA_BYTES: tl.constexpr = data.dtype.element_ty.primitive_bitwidth // 8
    scales_p = scales + tl.cast(parity, tl.int64) * data_half * DATA_BYTES // 4  # parity halves as data's
    counts_p = flags + parity * flags_half
    flags_p = counts_p + ctx.world
    pid = tl.program_id(0)
    if pid < comm_sms:
        if healthy:
            produce(a, scale_a, data_p, scales_p, flags_p, counts_p, epoch, pid, comm_sms, ctx, R, C,
                    BLOCK_M, BLOCK_K, FLAG, GATHER_K, GATHERED, PULL, ROW_SCALES)
    if (pid >= comm_sms) | JOIN:
        if JOIN:
            takers = tl.num_programs(0)
        else:
            takers = tl.num_programs(0) - comm_sms
        consume(a, b, c, scale_a, scale_b, data_p, scales_p, flags_p, partials, counts, epoch, healthy, pid - comm_sms,
                takers, ctx, R, C, N, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES, SPLIT_K, SWAP_AB, USE_TMA,
                FLAG, GATHER_K, GATHERED, PULL, PERSISTENT, B_T, SCALE)
    shmem.epoch_end(ctx, tl.num_programs(0))
