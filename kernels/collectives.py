"""One-launch collectives on the symmetric heap: all-gather, reduce-scatter, all-reduce (Iris-style API).

Every kernel takes one `ctx` (shmem.DeviceContext) of its workspace and moves a 2-D region of
`rows x width` elements per rank (the host reshapes contiguous tensors into rows that suit the
tiles). Work is cut into *chunks* (row ranges, for overlap with a consumer) and each chunk into
*pieces*, one per program: program k moves piece k of every chunk, and every flag belongs to one
(source rank, chunk, piece). A program therefore only ever waits for the same program index on
another rank (never for a later program of its own launch: the interpreter runs programs one by
one), and a consumer waits for exactly the data it moves next.

Flags (int32, in the workspace's two parity sets; a call of epoch e uses set e % 2 and writes e):
    word 0 of set 0   WDONE: the last epoch whose consumers finished (see `chunk_wait_kernel`)
    FLAG_BASE + ((kind * W + src) * chunks + chunk) * P + piece, kind one of
    DATA   the data of (src, chunk, piece) is where the reader looks for it
    DONE   (local) the piece is final in my gathered buffer: overlap waits poll it
    READY  (src, 0, piece): src has started this call, so its fixed buffer is free to be written
    DATA2  all-reduce two-shot: the reduced piece of owner src is in my second inbox

Why buffers are safe to reuse without host knowledge of the epoch
------------------------------------------------------------------
Every collective makes each rank wait for data that every peer produces in the same call, so a
peer is at most one call ahead. Buffers that peers write are either parity buffers (the parity of
the device epoch; a peer one call ahead writes the other set) or fixed buffers that peers write
only after a READY flag raised in the same call (a rank raises READY when its call starts, so all
its earlier work on the stream, vendor kernels reading the buffer included, is done). Buffers that
a vendor kernel reads or writes (torch.matmul) are fixed, since a CUDA graph bakes their pointers
in: the gathered output of an all-gather, the partial a reduce-scatter or all-reduce reads.

Algorithms (`all_gather_kernel` ALGO; the host's config key is `ALGO`, `ENGINE` for the copy engine)
-----------------------------------------------------------------------------------------------
    PUSH   raise READY, wait for every peer's READY, store my shard straight into every peer's
           fixed gathered buffer, raise DATA; wait for every peer's DATA. 2 flag hops, no copy.
    INBOX  store my shard into every peer's parity inbox, raise DATA; wait for every peer's DATA,
           copy its inbox slot into my gathered buffer. 1 flag hop + a local copy (HBM).
    PULL   copy my shard into my parity source buffer, raise DATA; wait for every peer's DATA and
           load its source buffer. 1 flag hop + a remote read round trip.
    CE_READY / CE_DONE   the copy-engine path: a flag kernel raises and awaits READY, the host
           issues copy-engine copies of my shard into every peer's fixed buffer (torch copies of
           peer-mapped heap tensors), a second flag kernel raises and awaits DATA.
Reduce-scatter (`reduce_kernel` MODE RS): push every owner's rows of my partial into its parity
inbox (or, on the copy engine, into its fixed inbox after the READY handshake), raise DATA; the
owner sums the W partials in float32 in rank order (its own from the local partial), so results
do not depend on timing. It is one step (each slice travels once): one-shot and two-shot are the
all-reduce's forms. All-reduce: AR_ONE (one-shot: every rank pushes its whole partial to every
peer and sums all W in rank order; bitwise the same on every rank) and AR_TWO (two-shot:
reduce-scatter, then each owner pushes its reduced rows into every peer's second inbox; the
bits are the owner's, so the same everywhere).

Costs on two H200 (paper estimates written before measuring; graph mode; hop = one flag one way
~1.25 us; launch ~0.7 us per kernel in a graph, ~10 us of CPU eager; NVLink ~330 GB/s SM stores,
260-290 GB/s SM loads, ~370 GB/s copy engine; HBM ~3 TB/s; a copy-engine copy ~2 us to start)
-------------------------------------------------------------------------------------------
    all-gather 64 KB/rank:  INBOX 0.7 + 0.2 + 1.25 + ~1 (local copy) ~ 3-3.5 us;
                            PUSH 0.7 + 2 x 1.25 + 0.2 ~ 3.5-4 us; PULL 0.7 + 0.5 + 1.25 + 2.5 ~ 5 us;
                            CE 2 x 0.7 + 2 x 1.25 + 2 copies x ~2 ~ 8-10 us; NCCL 9.3 us.
    all-gather 16 MB/rank:  PUSH 16 MB / 330 GB/s = 51 + 3 ~ 54 us (~310 GB/s);
                            INBOX ~55-60 us (the local copy pipelines behind the arrivals);
                            PULL 16 MB / 275 GB/s ~ 61 us; CE 45 + 8 ~ 53 us, at 64 MB 181 + 8 us
                            (~355 GB/s): only the copy engine can reach 340 GB/s per direction.
    reduce-scatter (W=2) 64 KB partial: 0.7 + 0.1 + 1.25 + sum ~ 3 us; 16 MB: 8 MB sent ~ 25 us
                            + sum (24 MB of HBM traffic, pipelined per piece) ~ 30 us.
    all-reduce (W=2) 256 KB: one-shot 0.7 + 0.8 + 1.25 + sum ~ 3.5 us; two-shot 2 hops ~ 5 us.
                            At W=2 both send the same bytes: one-shot wins at every size; at W=8
                            two-shot sends 2 x 7/8 instead of 7 partials and wins from a few MB.
    data-as-flag (LL) forms would save about one fence round trip (~1 us) below 64 KB and double
    the bytes: not built; the flag protocol above is the baseline to measure them against.

Faults: a program whose workspace is unhealthy, or whose wait failed, writes NaN into every output
element it owns instead of data; waits are exact and bounded (kernels/shmem.py). An unhealthy call
reads no peer's data even where it finds a flag set: after a fault, a flag of this epoch may have
been raised by a peer's other call (one this rank skipped).
Every kernel here compiles for sm_90 with Triton 3.6 and runs under the 3.9 interpreter.
"""
import triton
import triton.language as tl

from autofuse.kernels import shmem

# all_gather_kernel ALGO
PUSH = tl.constexpr(0)
INBOX = tl.constexpr(1)
PULL = tl.constexpr(2)
CE_READY = tl.constexpr(3)
CE_DONE = tl.constexpr(4)

# reduce_kernel MODE
RS = tl.constexpr(0)
AR_ONE = tl.constexpr(1)
AR_TWO = tl.constexpr(2)

# reduce_kernel SEND: what the sending phase does
SEND_NONE = tl.constexpr(0)    # no sending phase (a launch that only reduces)
SEND_DATA = tl.constexpr(1)    # store the slices into the owners' inboxes, then raise DATA
SEND_FLAGS = tl.constexpr(2)   # raise DATA only (the copy engine moved the data before this launch)

# flag kinds and layout
DATA = tl.constexpr(0)
DONE = tl.constexpr(1)
READY = tl.constexpr(2)
DATA2 = tl.constexpr(3)
FLAG_KINDS = 4
WDONE = tl.constexpr(0)
FLAG_BASE = tl.constexpr(16)


# -- helpers --------------------------------------------------------------------------------------
@triton.jit
def _flag(flags, half_flags, epoch, kind, src, chunk, piece, world, chunks, programs):
    """My copy of flag (kind, src, chunk, piece) in the parity set of `epoch`."""
    index = ((kind * world + src) * chunks + chunk) * programs + piece
    return flags + shmem.parity(epoch) * half_flags + FLAG_BASE + index


@triton.jit
def _piece(chunk, piece, rows, chunk_rows, piece_rows):
    """Rows [lo, hi) of `piece` of `chunk` (empty where the rows run out)."""
    start = chunk * chunk_rows
    stop = tl.minimum(start + chunk_rows, rows)
    lo = tl.minimum(start + piece * piece_rows, stop)
    hi = tl.minimum(lo + piece_rows, stop)
    return lo, hi


@triton.jit
def _clamp(lo, hi, owner, owner_rows, total_rows):
    """[lo, hi) cut to the rows that `owner` really has (the last owners may have fewer)."""
    top = tl.maximum(total_rows - owner * owner_rows, 0)
    hi = tl.minimum(hi, top)
    return tl.minimum(lo, hi), hi


@triton.jit
def _offsets(r0, c0, src_ld, dst_ld, hi, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(source offsets, destination offsets, mask) of the tile at row r0, column c0 (64-bit rows)."""
    rows = r0 + tl.arange(0, BLOCK_R)
    cols = c0 + tl.arange(0, BLOCK_C)
    mask = (rows < hi)[:, None] & (cols < width)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    return r64 * src_ld + cols[None, :], r64 * dst_ld + cols[None, :], mask


@triton.jit
def _move(src, src_ld, dst, dst_ld, lo, hi, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """dst row i = src row i for lo <= i < hi (row i at base + i * ld; pointers may be a peer's)."""
    for r0 in range(lo, hi, BLOCK_R):
        for c0 in range(0, width, BLOCK_C):
            so, do, mask = _offsets(r0, c0, src_ld, dst_ld, hi, width, BLOCK_R, BLOCK_C)
            tl.store(dst + do, tl.load(src + so, mask=mask), mask=mask)


@triton.jit
def _send(src, src_ld, own, own_ld, peer, peer_ld, lo, hi, width, ctx, OWN: tl.constexpr,
          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows [lo, hi) of `src` into every peer's copy of `peer` (and into my `own` if OWN): one load per tile."""
    for r0 in range(lo, hi, BLOCK_R):
        for c0 in range(0, width, BLOCK_C):
            so, do, mask = _offsets(r0, c0, src_ld, own_ld, hi, width, BLOCK_R, BLOCK_C)
            _, po, _ = _offsets(r0, c0, src_ld, peer_ld, hi, width, BLOCK_R, BLOCK_C)
            v = tl.load(src + so, mask=mask)
            if OWN:
                tl.store(own + do, v, mask=mask)
            for i in range(1, ctx.world):
                shmem.store(peer + po, v, ctx.rank, (ctx.rank + i) % ctx.world, ctx.heap_bases, mask=mask)


@triton.jit
def _fill_nan(dst, dst_ld, lo, hi, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """NaN into rows [lo, hi) of `dst`: what a faulty call leaves instead of data."""
    for r0 in range(lo, hi, BLOCK_R):
        for c0 in range(0, width, BLOCK_C):
            _, do, mask = _offsets(r0, c0, 0, dst_ld, hi, width, BLOCK_R, BLOCK_C)
            # made in float32, then cast: Triton has no FP8 constants (e4m3fn's NaN survives the cast)
            nan = tl.full([BLOCK_R, BLOCK_C], float("nan"), tl.float32).to(dst.dtype.element_ty)
            tl.store(dst + do, nan, mask=mask)


@triton.jit
def _signal_peers(flags, half_flags, epoch, kind, chunk, piece, world, chunks, programs, ctx):
    """Raise flag (kind, me, chunk, piece) on every peer (releasing my earlier stores)."""
    flag = _flag(flags, half_flags, epoch, kind, ctx.rank, chunk, piece, world, chunks, programs)
    for i in range(1, ctx.world):
        shmem.signal(flag, epoch, ctx.rank, (ctx.rank + i) % ctx.world, ctx.heap_bases)


@triton.jit
def _finish(ctx, flags, epoch, PUBLISH: tl.constexpr, WAITED: tl.constexpr):
    """Last thing a program does: record WDONE unless overlap waits will, and publish the epoch."""
    if PUBLISH:
        if not WAITED:
            tl.store(flags + WDONE, epoch)
        shmem.epoch_end(ctx, tl.num_programs(0))


# -- all-gather -----------------------------------------------------------------------------------
@triton.jit
def all_gather_kernel(x, out, buf, ctx, flags, half_flags, data_half, rows, width, dst_ld, src_step,
                      chunks, chunk_rows, piece_rows,
                      ALGO: tl.constexpr, WAITED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Gather every rank's `rows x width` shard `x` into `out` (source s's row i at
    out + s * src_step + i * dst_ld: rows form dst_ld = width, src_step = rows * width; columns
    form dst_ld = W * width, src_step = width). `buf` is the heap region of INBOX (W slots of
    rows * width per parity) or PULL (my shard per parity), `data_half` its parity stride;
    `out` must be on the heap (fixed) for PUSH and the copy-engine path. WAITED: consumers will
    call `chunk_wait_kernel` for every chunk (it records WDONE), so DONE flags are raised.

    grid = (P,): program k moves piece k of every chunk (chunks of `chunk_rows`, pieces of
    `piece_rows`), for every source.
    """
    k = tl.program_id(0)
    nprog = tl.num_programs(0)
    me = ctx.rank
    world = ctx.world
    epoch, healthy = shmem.epoch_begin(ctx)
    mine = buf + shmem.parity(epoch) * data_half
    own_out = out + me * src_step
    if (ALGO == PUSH) | (ALGO == CE_READY):
        if healthy:
            _signal_peers(flags, half_flags, epoch, READY, 0, k, world, chunks, nprog, ctx)
    ready = healthy
    if (ALGO == PUSH) | (ALGO == CE_READY):
        for i in range(1, world):
            q = (me + i) % world
            ready = ready & shmem.wait_until(_flag(flags, half_flags, epoch, READY, q, 0, k, world, chunks, nprog),
                                             epoch, ctx)
    if ALGO != CE_READY:
        for j in range(0, chunks + 1):
            if j < chunks:  # produce chunk j
                lo, hi = _piece(j, k, rows, chunk_rows, piece_rows)
                if ALGO == PUSH:
                    if ready:
                        _send(x, width, own_out, dst_ld, own_out, dst_ld, lo, hi, width, ctx, True, BLOCK_R, BLOCK_C)
                        _signal_peers(flags, half_flags, epoch, DATA, j, k, world, chunks, nprog, ctx)
                    else:
                        _fill_nan(own_out, dst_ld, lo, hi, width, BLOCK_R, BLOCK_C)
                elif ALGO == INBOX:
                    if healthy:
                        _send(x, width, own_out, dst_ld, mine + me * rows * width, width, lo, hi, width, ctx, True,
                              BLOCK_R, BLOCK_C)
                        _signal_peers(flags, half_flags, epoch, DATA, j, k, world, chunks, nprog, ctx)
                    else:
                        _fill_nan(own_out, dst_ld, lo, hi, width, BLOCK_R, BLOCK_C)
                elif ALGO == PULL:
                    if healthy:
                        _move(x, width, mine, width, lo, hi, width, BLOCK_R, BLOCK_C)
                        _signal_peers(flags, half_flags, epoch, DATA, j, k, world, chunks, nprog, ctx)
                        _move(x, width, own_out, dst_ld, lo, hi, width, BLOCK_R, BLOCK_C)
                    else:
                        _fill_nan(own_out, dst_ld, lo, hi, width, BLOCK_R, BLOCK_C)
                else:  # CE_DONE: the copy engine moved my shard (own rows too) before this launch
                    if healthy:
                        _signal_peers(flags, half_flags, epoch, DATA, j, k, world, chunks, nprog, ctx)
                    else:
                        _fill_nan(own_out, dst_ld, lo, hi, width, BLOCK_R, BLOCK_C)
            if j > 0:  # consume chunk j - 1 (the peers produced it while I produced chunk j)
                c = j - 1
                lo, hi = _piece(c, k, rows, chunk_rows, piece_rows)
                for i in range(1, world):
                    s = (me + world - i) % world
                    dst = out + s * src_step
                    ok = healthy  # an unhealthy call reads nothing: a flag it finds set may be of a peer's other call
                    ok = ok & shmem.wait_until(_flag(flags, half_flags, epoch, DATA, s, c, k, world, chunks, nprog),
                                               epoch, ctx)
                    if ok:
                        if ALGO == INBOX:
                            _move(mine + s * rows * width, width, dst, dst_ld, lo, hi, width, BLOCK_R, BLOCK_C)
                        elif ALGO == PULL:
                            _move(shmem.translate(mine, me, s, ctx.heap_bases), width, dst, dst_ld, lo, hi, width,
                                  BLOCK_R, BLOCK_C)
                    else:
                        _fill_nan(dst, dst_ld, lo, hi, width, BLOCK_R, BLOCK_C)
                    if WAITED:
                        done = _flag(flags, half_flags, epoch, DONE, s, c, k, world, chunks, nprog)
                        shmem.signal(done, epoch, me, me, ctx.heap_bases)
    _finish(ctx, flags, epoch, ALGO != CE_READY, WAITED)


@triton.jit
def _missing(first, offs, mask, value):
    """(the flags as this thread loaded them, how many of them miss `value`, the same in every thread).

    The flags are loaded per thread (volatile); where the vector is smaller than the program, warps
    hold copies and the sum runs per warp, so warps may count differently: program_max makes it
    one count for the program (the largest: a flag missing for any warp is missing)."""
    seen = tl.load(first + offs, mask=mask, other=value, volatile=True)
    return seen, shmem.program_max(tl.sum((seen != value).to(tl.int32), axis=0))


@triton.jit
def _wait_all(first, count, value, ctx, BLOCK: tl.constexpr):
    """Wait until the `count` local int32 flags from `first` on all hold exactly `value`; True if they did.

    shmem.wait_until for many flags at once: one vector of volatile loads per poll and ONE acquire at
    the end (a successful wait_until costs a system-scope atomic each: ~P of them per chunk), with
    the same exact-epoch, wall-clock budget and collective-abort semantics (the first missing flag is
    the one reported). Every decision is the program's, as in wait_until (`_missing`, the status word
    and the clock are read for the whole program). `count` <= BLOCK.
    """
    offs = tl.arange(0, BLOCK)
    mask = offs < count
    seen, missing = _missing(first, offs, mask, value)
    code = tl.zeros([], tl.int32)
    if missing > 0:
        code = shmem.read_uniform(ctx.status + shmem.CODE, "relaxed")
        start = shmem.now_ns()
        elapsed = tl.zeros([], tl.int64)
        while (missing > 0) & (code == 0) & (elapsed <= ctx.budget):
            seen, missing = _missing(first, offs, mask, value)
            code = shmem.read_uniform(ctx.status + shmem.CODE, "relaxed")
            elapsed = shmem.program_max(shmem.now_ns() - start)
    ok = missing == 0
    if ok:
        # the acquire's result is used, else Triton drops it (an unused atomic add of 0 is a dead load)
        ok = shmem.read_uniform(first, "acquire") == value
        tl.debug_barrier()
    elif code == 0:
        index = tl.min(tl.where(seen != value, offs, BLOCK), axis=0)
        shmem.give_up(first + index, value, tl.load(first + index, volatile=True), ctx)
    else:
        tl.store(ctx.mirror, code)
    return ok


@triton.jit
def chunk_wait_kernel(ctx, flags, half_flags, out, src, chunk, lo, hi, width, dst_ld, src_step, chunks, programs,
                      LAST: tl.constexpr, WAIT_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Hold the stream it runs on until chunk `chunk` of source `src` is final in my gathered `out`.

    Launched by a consumer (e.g. the matmul's stream) beside an all-gather started with WAITED:
    the epoch it waits for is WDONE + 1, since WDONE advances once per call (here, when LAST, or
    by the collective itself when nobody waits). It does not touch the epoch counter (the
    all-gather may be running on another stream). It polls the chunk's DONE flags (one per
    all-gather program, contiguous; WAIT_BLOCK >= programs) as one vector. On a failed wait it
    writes NaN into rows [lo, hi) of the chunk, so the consumer never reads stale data.

    grid = (1,)
    """
    epoch = shmem.read_uniform(flags + WDONE, "relaxed") + 1
    first = _flag(flags, half_flags, epoch, DONE, src, chunk, 0, ctx.world, chunks, programs)
    ok = _wait_all(first, programs, epoch, ctx, WAIT_BLOCK)
    if ok == 0:
        _fill_nan(out + src * src_step, dst_ld, lo, hi, width, BLOCK_R, BLOCK_C)
    if LAST:
        tl.store(flags + WDONE, epoch)


# -- reduce-scatter and all-reduce ----------------------------------------------------------------
@triton.jit
def reduce_kernel(x, out, buf, ctx, flags, half_flags, data_half, owner_rows, total_rows, width, chunks, chunk_rows,
                  piece_rows, only_owner, only_chunk, box2,
                  MODE: tl.constexpr, SEND: tl.constexpr, REDUCE: tl.constexpr, FIXED: tl.constexpr,
                  PUBLISH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Reduce-scatter (MODE RS) or all-reduce (AR_ONE, AR_TWO) of the local partial `x`.

    x: total_rows x width (RS, AR_TWO: owner q's rows are q * owner_rows + i, the last owners'
    cut at total_rows; AR_ONE: owner_rows = total_rows, every rank owns all rows), contiguous,
    local (e.g. a matmul's output; may be `out` for the all-reduces). out: my rows (RS) or all
    rows (AR). buf: the heap inbox, slot q (owner_rows x width) holds rank q's slice; parity sets
    `data_half` apart, unless FIXED (the copy-engine path's fixed inbox). AR_TWO's second inbox
    (the owners' reduced rows, slot q = owner q's) starts `box2` elements into each parity set.
    SEND: SEND_DATA pushes my slices and raises DATA, SEND_FLAGS only raises DATA. REDUCE: wait
    for the W - 1 slices of each piece and sum them in rank order (AR_TWO: then push the reduced
    rows to every peer and gather the peers' reduced rows). A call may be split into several
    launches on one stream (overlap: one SEND launch per owner chunk, `only_owner`/`only_chunk`
    >= 0, then one REDUCE launch): all read the same epoch, and only the last (PUBLISH) ends it.

    Within a launch the chunks are pipelined: program k sends chunk t while it sums chunk t - 1
    (and, AR_TWO, gathers chunk t - 2), so local sums overlap the transfer.

    grid = (P,): program k handles piece k of every chunk of every owner's rows.
    """
    k = tl.program_id(0)
    nprog = tl.num_programs(0)
    me = ctx.rank
    world = ctx.world
    epoch, healthy = shmem.epoch_begin(ctx)
    box = buf
    if not FIXED:
        box = buf + shmem.parity(epoch) * data_half
    slot = owner_rows * width
    x_mine = 0
    out_mine = out
    if MODE != AR_ONE:
        x_mine = me * owner_rows
    if MODE == AR_TWO:
        out_mine = out + me * slot
    # a software pipeline over chunks: send chunk t, reduce chunk t - 1, gather chunk t - 2 (AR_TWO)
    for t in range(0, chunks + 2):
        if SEND != SEND_NONE:
            if healthy & (t < chunks) & ((only_chunk < 0) | (only_chunk == t)):
                lo, hi = _piece(t, k, owner_rows, chunk_rows, piece_rows)
                if SEND == SEND_DATA:
                    if MODE == AR_ONE:
                        _send(x, width, x, width, box + me * slot, width, lo, hi, width, ctx, False, BLOCK_R, BLOCK_C)
                    else:
                        for i in range(1, world):
                            q = (me + i) % world
                            if (only_owner < 0) | (only_owner == q):
                                qlo, qhi = _clamp(lo, hi, q, owner_rows, total_rows)
                                _move(x + q * slot, width, shmem.translate(box + me * slot, me, q, ctx.heap_bases),
                                      width, qlo, qhi, width, BLOCK_R, BLOCK_C)
                for i in range(1, world):
                    q = (me + i) % world
                    if (only_owner < 0) | (only_owner == q):
                        flag = _flag(flags, half_flags, epoch, DATA, me, t, k, world, chunks, nprog)
                        shmem.signal(flag, epoch, me, q, ctx.heap_bases)
        if REDUCE:
            if (t >= 1) & (t <= chunks):
                j = t - 1
                lo, hi = _piece(j, k, owner_rows, chunk_rows, piece_rows)
                if MODE != AR_ONE:
                    lo, hi = _clamp(lo, hi, me, owner_rows, total_rows)
                ok = healthy
                for i in range(1, world):
                    s = (me + world - i) % world
                    ok = ok & shmem.wait_until(_flag(flags, half_flags, epoch, DATA, s, j, k, world, chunks, nprog),
                                               epoch, ctx)
                if ok:
                    for r0 in range(lo, hi, BLOCK_R):
                        for c0 in range(0, width, BLOCK_C):
                            so, _, mask = _offsets(r0, c0, width, width, hi, width, BLOCK_R, BLOCK_C)
                            acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
                            for q in range(0, world):
                                if q == me:
                                    v = tl.load(x + x_mine * width + so, mask=mask)
                                else:
                                    v = tl.load(box + q * slot + so, mask=mask)
                                acc += v.to(tl.float32)
                            val = acc.to(out.dtype.element_ty)
                            tl.store(out_mine + so, val, mask=mask)
                            if MODE == AR_TWO:
                                for i in range(1, world):
                                    shmem.store(box + box2 + me * slot + so, val, me, (me + i) % world,
                                                ctx.heap_bases, mask=mask)
                    if MODE == AR_TWO:
                        _signal_peers(flags, half_flags, epoch, DATA2, j, k, world, chunks, nprog, ctx)
                else:
                    _fill_nan(out_mine, width, lo, hi, width, BLOCK_R, BLOCK_C)
            if MODE == AR_TWO:
                if t >= 2:
                    j = t - 2
                    lo, hi = _piece(j, k, owner_rows, chunk_rows, piece_rows)
                    for i in range(1, world):
                        s = (me + world - i) % world
                        slo, shi = _clamp(lo, hi, s, owner_rows, total_rows)
                        ok = healthy
                        ok = ok & shmem.wait_until(_flag(flags, half_flags, epoch, DATA2, s, j, k, world, chunks,
                                                         nprog), epoch, ctx)
                        if ok:
                            _move(box + box2 + s * slot, width, out + s * slot, width, slo, shi, width, BLOCK_R,
                                  BLOCK_C)
                        else:
                            _fill_nan(out + s * slot, width, slo, shi, width, BLOCK_R, BLOCK_C)
    _finish(ctx, flags, epoch, PUBLISH, False)
