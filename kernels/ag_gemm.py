"""Fused all-gather + GEMM over the symmetric heap: pull, push and push_ws (host: autofuse/ops/ag_gemm.py).

Every source rank s holds one shard of A, R x C elements with row stride C:
  gather rows (GATHER_K=False): R = M/W rows, C = K; output rows s*R .. s*R+R-1 need shard s only.
  gather k    (GATHER_K=True):  R = M rows, C = K/W columns; every output tile sums over all W
                                shards, shard s multiplying rows s*C .. s*C+C-1 of B.
The workspace `data` holds 2 x W slots of R x C elements: slot (p, s) holds shard s for calls of
epoch parity p (double-buffered so a peer one call ahead never overwrites what is being read).
  push: source s stores its shard into slot (p, s) of every peer (the inbox); the GEMM reads locally.
  pull: source s copies its shard into slot (p, s) of its own heap; peers' GEMMs load it remotely.
A rank's own shard is always read straight from the caller's `a`.

Flags are int32 epochs at the consumer: flags[s * units + u] reaches the call's epoch when unit u
of shard s is readable. A unit is one BLOCK_M x BLOCK_K tile (FLAG == TILE), BLOCK_M rows
(ROW_BLOCK) or the whole shard (SHARD; the last producer program to finish a shard, counted with
an atomic on `counts`, raises it). Producers are the lowest program ids and never wait, so the
interpreter (programs run in id order) and GPUs (lower ids dispatch first) cannot deadlock.
Output tiles are ordered local shard first, then the shard of rank+1, rank+2, ...; producers
serve the peer that needs their shard soonest first.
"""
import triton
import triton.language as tl

from autofuse.kernels import shmem
from autofuse.kernels.gemm_tile import swizzle

TILE = tl.constexpr(0)
ROW_BLOCK = tl.constexpr(1)
SHARD = tl.constexpr(2)


@triton.jit
def _slot(data, parity, src, W, R, C):
    """Slot (parity, src) of the workspace: where shard `src` lives for this call."""
    return data + tl.cast(parity * W + src, tl.int64) * R * C


@triton.jit
def _raise(flag, epoch, rank, dest, W, heap_bases, PULL: tl.constexpr):
    """Publish a unit: push raises it at `dest`; pull raises it at every peer."""
    tl.debug_barrier()  # every thread's stores happen before the release
    if PULL:
        for peer in range(1, W):
            shmem.signal(flag, epoch, rank, (rank + peer) % W, heap_bases)
    else:
        shmem.signal(flag, epoch, rank, dest, heap_bases)


@triton.jit
def _produce(worker, workers, a, data, flags, counts, heap_bases, rank, W, epoch, R, C,
             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, FLAG: tl.constexpr, PULL: tl.constexpr):
    """Producer `worker` of `workers`: copy my shard where peers read it, raising flags per unit.

    Work items are (destination, BLOCK_M rows); push visits rank-1 first (it needs my shard
    right after its own), pull copies each row block once into my own slot.
    """
    RB = tl.cdiv(R, BLOCK_M)
    KB = tl.cdiv(C, BLOCK_K)
    if PULL:
        n_items = tl.where(W > 1, RB, 0)
    else:
        n_items = (W - 1) * RB
    slot = _slot(data, epoch % 2, rank, W, R, C)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    for item in range(worker, n_items, workers):
        if PULL:
            dest = rank
            rb = item
        else:
            dest = (rank + W - 1 - item // RB) % W
            rb = item % RB
        dst = tl.multiple_of(shmem.translate(slot, rank, dest, heap_bases), 16)  # slots are 16-byte aligned
        rows = rb * BLOCK_M + offs_m
        for kb in range(0, KB):
            cols = kb * BLOCK_K + offs_k
            mask = (rows < R)[:, None] & (cols < C)[None, :]
            offs = rows[:, None] * C + cols[None, :]
            tl.store(dst + offs, tl.load(a + offs, mask=mask), mask=mask)
            if FLAG == TILE:
                _raise(flags + rank * RB * KB + rb * KB + kb, epoch, rank, dest, W, heap_bases, PULL)
        if FLAG == ROW_BLOCK:
            _raise(flags + rank * RB + rb, epoch, rank, dest, W, heap_bases, PULL)
        if FLAG == SHARD:
            tl.debug_barrier()
            done = shmem.atomic_add(counts + rank, 1, rank, dest, heap_bases, sem="acq_rel", scope="sys")
            if done == RB - 1:  # the last row block of my shard for `dest`: reset, then publish
                shmem.atomic_xchg(counts + rank, 0, rank, dest, heap_bases, sem="relaxed", scope="sys")
                _raise(flags + rank, epoch, rank, dest, W, heap_bases, PULL)


@triton.jit
def _masked_by(mask, ok):
    """mask & ok for a scalar `ok` (tl.where: the interpreter mis-types a broadcast scalar compare)."""
    return tl.where(ok, mask, False)


@triton.jit
def _wait(flag, epoch, ok, spin_limit, status, heap_bases, rank):
    """Bounded wait for `flag` to reach `epoch`; after one timeout (ok False) waits no more."""
    if ok:
        ok = shmem.wait_until(flag, epoch, spin_limit, status, heap_bases, rank)
        tl.debug_barrier()  # the acquire happens before any thread's loads
    return ok


@triton.jit
def _mma(acc, ok, a_base, b_base, row0, col0, R, N, C, tile_flags, epoch, spin_limit, status, heap_bases, rank,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WAIT_TILES: tl.constexpr,
         EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
    """acc += A[row0:+BLOCK_M, :C] @ B[:C, col0:+BLOCK_N] for one shard (A: R x C, B rows from b_base).

    Rows and columns wrap modulo R and N (the tutorial's trick: no M/N masks; the caller masks
    the store). With WAIT_TILES the flag of each BLOCK_K step is awaited first, and the A load is
    masked by its outcome so no compiler pipelining can hoist the load above the wait. EVEN_K
    (C % BLOCK_K == 0) drops the K mask. DOT_F32 multiplies in float32 (the interpreter's dot is
    wrong for bfloat16, which numpy lacks).
    """
    offs_m = (row0 + tl.arange(0, BLOCK_M)) % R
    offs_n = (col0 + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_base + offs_m[:, None] * C + offs_k[None, :]
    b_ptrs = b_base + offs_k[:, None] * N + offs_n[None, :]
    for kb in range(0, tl.cdiv(C, BLOCK_K)):
        k_mask = offs_k < C - kb * BLOCK_K
        if WAIT_TILES:
            ok = _wait(tile_flags + kb, epoch, ok, spin_limit, status, heap_bases, rank)
            x = tl.load(a_ptrs, mask=_masked_by(k_mask[None, :], ok), other=0.0)
        elif EVEN_K:
            x = tl.load(a_ptrs)
        else:
            x = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        if EVEN_K:
            y = tl.load(b_ptrs)
        else:
            y = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
            y = y.to(tl.float32)
        acc = tl.dot(x, y, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * N
    return acc, ok


@triton.jit
def _shard_mma(acc, ok, src, rb, n0, a, b, data, flags, status, heap_bases, rank, W, epoch, spin_limit, N, R, C,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FLAG: tl.constexpr,
               GATHER_K: tl.constexpr, PULL: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
    """acc += (row block rb of shard src) @ (the rows of B it multiplies), waiting for remote units.

    My own shard comes from `a`; a peer's from its slot (my inbox, or the peer's heap for pull).
    One K loop serves both (one set of pipeline buffers in shared memory), except with tile flags,
    where the remote loop waits per BLOCK_K step and the local one keeps its pipelining.
    """
    RB = tl.cdiv(R, BLOCK_M)
    KB = tl.cdiv(C, BLOCK_K)
    remote = src != rank
    base = a
    if remote:
        base = _slot(data, epoch % 2, src, W, R, C)
        if PULL:  # heap bases and slots are 16-byte aligned: keep vectorised, asynchronous loads
            base = tl.multiple_of(shmem.translate(base, rank, src, heap_bases), 16)
        if FLAG == ROW_BLOCK:
            ok = _wait(flags + src * RB + rb, epoch, ok, spin_limit, status, heap_bases, rank)
        if FLAG == SHARD:
            ok = _wait(flags + src, epoch, ok, spin_limit, status, heap_bases, rank)
    if GATHER_K:
        b_rows = b + tl.cast(src * C, tl.int64) * N
    else:
        b_rows = b
    tile_flags = flags + src * RB * KB + rb * KB
    if FLAG == TILE:
        if remote:
            acc, ok = _mma(acc, ok, base, b_rows, rb * BLOCK_M, n0, R, N, C, tile_flags, epoch, spin_limit, status,
                           heap_bases, rank, BLOCK_M, BLOCK_N, BLOCK_K, True, EVEN_K, DOT_F32)
        else:
            acc, ok = _mma(acc, ok, base, b_rows, rb * BLOCK_M, n0, R, N, C, tile_flags, epoch, spin_limit, status,
                           heap_bases, rank, BLOCK_M, BLOCK_N, BLOCK_K, False, EVEN_K, DOT_F32)
    else:
        acc, ok = _mma(acc, ok, base, b_rows, rb * BLOCK_M, n0, R, N, C, tile_flags, epoch, spin_limit, status,
                       heap_bases, rank, BLOCK_M, BLOCK_N, BLOCK_K, False, EVEN_K, DOT_F32)
    return acc, ok


@triton.jit
def _compute_tile(tile, a, b, c, data, flags, status, heap_bases, rank, W, epoch, spin_limit, N, R, C,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  FLAG: tl.constexpr, GATHER_K: tl.constexpr, PULL: tl.constexpr, EVEN_K: tl.constexpr,
                  DOT_F32: tl.constexpr):
    """One BLOCK_M x BLOCK_N output tile; tile 0.. covers my own shard's rows (or K) first."""
    RB = tl.cdiv(R, BLOCK_M)
    if GATHER_K:
        num_mt = RB
    else:
        num_mt = W * RB
    mt, nt = swizzle(tile, num_mt, tl.cdiv(N, BLOCK_N), GROUP_M)
    n0 = nt * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ok = tl.full([], 1, tl.int1)
    if GATHER_K:
        rb = mt
        for step in range(0, W):
            acc, ok = _shard_mma(acc, ok, (rank + step) % W, rb, n0, a, b, data, flags, status, heap_bases, rank, W,
                                 epoch, spin_limit, N, R, C, BLOCK_M, BLOCK_N, BLOCK_K, FLAG, GATHER_K, PULL,
                                 EVEN_K, DOT_F32)
        out_row0 = rb * BLOCK_M
    else:
        src = (rank + mt // RB) % W
        rb = mt % RB
        acc, ok = _shard_mma(acc, ok, src, rb, n0, a, b, data, flags, status, heap_bases, rank, W, epoch,
                             spin_limit, N, R, C, BLOCK_M, BLOCK_N, BLOCK_K, FLAG, GATHER_K, PULL, EVEN_K,
                             DOT_F32)
        out_row0 = src * R + rb * BLOCK_M
    offs_r = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask = _masked_by((rb * BLOCK_M + offs_r < R)[:, None] & (offs_n < N)[None, :], ok)
    c_ptrs = c + tl.cast(out_row0 + offs_r, tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=mask)


@triton.jit
def ag_gemm_pull_kernel(a, b, c, data, flags, counts, counter, status, heap_bases, rank, W, spin_limit,
                        N, R, C, comm,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        FLAG: tl.constexpr, GATHER_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
    """Programs 0..comm-1 copy my shard into my heap slot and raise peers' flags; the rest compute one
    output tile each, loading remote shards from their owners' heaps inside the K loop.

    grid = (comm + tiles,)
    """
    pid = tl.program_id(0)
    epoch = shmem.epoch_next(counter)
    if pid < comm:
        _produce(pid, comm, a, data, flags, counts, heap_bases, rank, W, epoch, R, C, BLOCK_M, BLOCK_K, FLAG, True)
    else:
        _compute_tile(pid - comm, a, b, c, data, flags, status, heap_bases, rank, W, epoch, spin_limit, N, R, C,
                      BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, FLAG, GATHER_K, True, EVEN_K, DOT_F32)
    shmem.epoch_finish(counter, tl.num_programs(0))


@triton.jit
def ag_gemm_push_kernel(a, b, c, data, flags, counts, counter, status, heap_bases, rank, W, spin_limit,
                        N, R, C, comm,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        FLAG: tl.constexpr, GATHER_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
    """Programs 0..comm-1 store my shard into every peer's inbox and raise its flags; the rest compute
    one output tile each from local memory, waiting per flag for remote units.

    grid = (comm + tiles,)
    """
    pid = tl.program_id(0)
    epoch = shmem.epoch_next(counter)
    if pid < comm:
        _produce(pid, comm, a, data, flags, counts, heap_bases, rank, W, epoch, R, C, BLOCK_M, BLOCK_K, FLAG, False)
    else:
        _compute_tile(pid - comm, a, b, c, data, flags, status, heap_bases, rank, W, epoch, spin_limit, N, R, C,
                      BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, FLAG, GATHER_K, False, EVEN_K, DOT_F32)
    shmem.epoch_finish(counter, tl.num_programs(0))


@triton.jit
def ag_gemm_push_ws_kernel(a, b, c, data, flags, counts, counter, status, heap_bases, rank, W, spin_limit,
                           N, R, C, comm,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, FLAG: tl.constexpr, GATHER_K: tl.constexpr, EVEN_K: tl.constexpr,
                           DOT_F32: tl.constexpr):
    """Persistent, workgroup-specialised push: programs 0..comm-1 push (as in push), the other
    programs loop over output tiles, local tiles first.

    grid = (comm + compute programs,), at most one program per SM
    """
    pid = tl.program_id(0)
    epoch = shmem.epoch_next(counter)
    if pid < comm:
        _produce(pid, comm, a, data, flags, counts, heap_bases, rank, W, epoch, R, C, BLOCK_M, BLOCK_K, FLAG, False)
    else:
        RB = tl.cdiv(R, BLOCK_M)
        if GATHER_K:
            tiles = RB * tl.cdiv(N, BLOCK_N)
        else:
            tiles = W * RB * tl.cdiv(N, BLOCK_N)
        for tile in range(pid - comm, tiles, tl.num_programs(0) - comm):
            _compute_tile(tile, a, b, c, data, flags, status, heap_bases, rank, W, epoch, spin_limit, N, R, C,
                          BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, FLAG, GATHER_K, False, EVEN_K, DOT_F32)
    shmem.epoch_finish(counter, tl.num_programs(0))


# ------------------------------------------------------------------------------------------------
# gathered layout (push, push_ws with LAYOUT="gathered"): every rank's inbox slot `epoch % 2` holds
# the whole gathered A (rows form: W*R x C, shard s at rows s*R..; k form: R x W*C, shard s at
# columns s*C..), own shard included. Consumers wait once for the shards their tile covers, then
# run the tutorial's K loop over local memory, which the compiler pipelines (no wait inside it).
@triton.jit
def _produce_gathered(worker, workers, a, data, flags, counts, heap_bases, rank, W, epoch, R, C,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GATHER_K: tl.constexpr):
    """Producer `worker` of `workers`: copy my shard to its place in every rank's gathered A.

    The shard's BLOCK_M x BLOCK_K tiles are split into `workers` contiguous ranges; each worker
    copies its range to every destination (peers first, mine last), then counts itself done at
    that destination; the last of the `workers` to arrive resets the count and raises flags[rank].
    """
    RB = tl.cdiv(R, BLOCK_M)
    KB = tl.cdiv(C, BLOCK_K)
    if GATHER_K:
        ld = W * C
        place = rank * C
    else:
        ld = C
        place = rank * R * C
    slot = data + tl.cast(epoch % 2, tl.int64) * W * R * C + place
    first = worker * (RB * KB) // workers
    last = (worker + 1) * (RB * KB) // workers
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    for i in range(1, W + 1):
        dest = (rank + i) % W
        dst = tl.multiple_of(shmem.translate(slot, rank, dest, heap_bases), 16)  # rows stay 16-byte aligned
        for t in range(first, last):
            rows = (t // KB) * BLOCK_M + offs_m
            cols = (t % KB) * BLOCK_K + offs_k
            mask = (rows < R)[:, None] & (cols < C)[None, :]
            x = tl.load(a + rows[:, None] * C + cols[None, :], mask=mask)
            tl.store(dst + rows[:, None] * ld + cols[None, :], x, mask=mask)
        tl.debug_barrier()  # every thread's stores happen before the count's release
        done = shmem.atomic_add(counts + rank, 1, rank, dest, heap_bases, sem="acq_rel", scope="sys")
        if done == workers - 1:
            shmem.atomic_xchg(counts + rank, 0, rank, dest, heap_bases, sem="relaxed", scope="sys")
            _raise(flags + rank, epoch, rank, dest, W, heap_bases, False)


@triton.jit
def _gathered_tile(work, b, c, data, flags, status, heap_bases, rank, W, epoch, spin_limit, N, R, C,
                   partials, tile_counts,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   SPLIT_K: tl.constexpr, GATHER_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
    """Work item `work`: split `work // tiles` of the K loop of output tile `work % tiles` of
    (gathered A) @ B. It waits for the shards the tile needs, then runs a pipelined K loop.

    Rows form: tiles start at my own rows (their shard arrives first, by a local copy) and wait for
    the shards their rows span; k form: every tile waits for all W shards. A timed-out wait leaves
    the K loop empty and the store masked off. With SPLIT_K > 1 each split stores its float32
    partial tile, counts itself on tile_counts[tile], and the last to arrive sums the partials,
    stores the tile and resets the count to 0 (so a CUDA graph replays it as is).
    """
    if GATHER_K:
        M = R
        K = W * C
    else:
        M = W * R
        K = C
    num_mt = tl.cdiv(M, BLOCK_M)
    tiles = num_mt * tl.cdiv(N, BLOCK_N)
    tile = work % tiles
    split = work // tiles
    mt, nt = swizzle(tile, num_mt, tl.cdiv(N, BLOCK_N), GROUP_M)
    if GATHER_K:
        s_first = 0
        s_end = W
    else:
        mt = (mt + rank * R // BLOCK_M) % num_mt
        s_first = mt * BLOCK_M // R
        s_end = min(tl.cdiv(mt * BLOCK_M + BLOCK_M, R), W)
    ok = tl.full([], 1, tl.int1)
    for s in range(s_first, s_end):
        ok = _wait(flags + s, epoch, ok, spin_limit, status, heap_bases, rank)
    KB = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(KB, SPLIT_K)
    kb_first = split * per_split
    kb_end = tl.where(ok, min(kb_first + per_split, KB), kb_first)
    m0 = mt * BLOCK_M
    n0 = nt * BLOCK_N
    offs_m = (m0 + tl.arange(0, BLOCK_M)) % M
    offs_n = (n0 + tl.arange(0, BLOCK_N)) % N
    offs_k = kb_first * BLOCK_K + tl.arange(0, BLOCK_K)
    a_ptrs = data + tl.cast(epoch % 2, tl.int64) * M * K + offs_m[:, None] * K + offs_k[None, :]
    b_ptrs = b + offs_k[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_first, kb_end):
        if EVEN_K:
            x = tl.load(a_ptrs)
            y = tl.load(b_ptrs)
        else:
            x = tl.load(a_ptrs, mask=offs_k[None, :] < K - (kb - kb_first) * BLOCK_K, other=0.0)
            y = tl.load(b_ptrs, mask=offs_k[:, None] < K - (kb - kb_first) * BLOCK_K, other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
            y = y.to(tl.float32)
        acc = tl.dot(x, y, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * N
    store = ok
    if SPLIT_K > 1:
        tile_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        mine = partials + (tl.cast(tile, tl.int64) * SPLIT_K + split) * (BLOCK_M * BLOCK_N)
        tl.store(mine + tile_offs, acc)
        tl.debug_barrier()  # every thread's partial is stored before the count's release
        done = tl.atomic_add(tile_counts + tile, 1, sem="acq_rel", scope="gpu")
        store = store & (done == SPLIT_K - 1)
        if done == SPLIT_K - 1:
            tl.debug_barrier()  # the acquire happens before any thread reads the other partials
            tl.store(tile_counts + tile, 0)
            first = partials + tl.cast(tile, tl.int64) * SPLIT_K * (BLOCK_M * BLOCK_N)
            for other in range(0, SPLIT_K):
                if other != split:
                    acc += tl.load(first + other * (BLOCK_M * BLOCK_N) + tile_offs, cache_modifier=".cg")
    offs_r = m0 + tl.arange(0, BLOCK_M)
    offs_c = n0 + tl.arange(0, BLOCK_N)
    mask = _masked_by((offs_r < M)[:, None] & (offs_c < N)[None, :], store)
    c_ptrs = c + tl.cast(offs_r, tl.int64)[:, None] * N + offs_c[None, :]
    tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=mask)


@triton.jit
def ag_gemm_push_gathered_kernel(a, b, c, data, flags, counts, counter, status, heap_bases, rank, W, spin_limit,
                                 N, R, C, comm, partials, tile_counts,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, GATHER_K: tl.constexpr,
                                 EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
    """push, gathered layout: programs 0..comm-1 copy my shard into every rank's gathered A (mine
    too); the rest each take one split of one output tile.

    grid = (comm + SPLIT_K * cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),)
    """
    pid = tl.program_id(0)
    epoch = shmem.epoch_next(counter)
    if pid < comm:
        _produce_gathered(pid, comm, a, data, flags, counts, heap_bases, rank, W, epoch, R, C, BLOCK_M, BLOCK_K,
                          GATHER_K)
    else:
        _gathered_tile(pid - comm, b, c, data, flags, status, heap_bases, rank, W, epoch, spin_limit, N, R, C,
                       partials, tile_counts, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K, GATHER_K, EVEN_K,
                       DOT_F32)
    shmem.epoch_finish(counter, tl.num_programs(0))


@triton.jit
def ag_gemm_push_ws_gathered_kernel(a, b, c, data, flags, counts, counter, status, heap_bases, rank, W,
                                    spin_limit, N, R, C, comm, partials, tile_counts,
                                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, GATHER_K: tl.constexpr,
                                    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
    """push_ws, gathered layout: programs 0..comm-1 copy as in push; the others loop over the work
    items (tile splits) of push.

    grid = (comm + compute programs,), at most one program per SM
    """
    pid = tl.program_id(0)
    epoch = shmem.epoch_next(counter)
    if pid < comm:
        _produce_gathered(pid, comm, a, data, flags, counts, heap_bases, rank, W, epoch, R, C, BLOCK_M, BLOCK_K,
                          GATHER_K)
    else:
        if GATHER_K:
            rows = R
        else:
            rows = W * R
        work = SPLIT_K * tl.cdiv(rows, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for item in range(pid - comm, work, tl.num_programs(0) - comm):
            _gathered_tile(item, b, c, data, flags, status, heap_bases, rank, W, epoch, spin_limit, N, R, C,
                           partials, tile_counts, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K, GATHER_K, EVEN_K,
                           DOT_F32)
    shmem.epoch_finish(counter, tl.num_programs(0))
