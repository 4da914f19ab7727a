"""Fused GEMM + reduce-scatter (rows): each rank's partial tiles go straight to their owner's inbox.

Rank r holds A_r (M x K_r) and B_r (K_r x N); the result C = sum_r A_r @ B_r is split by rows, and
rank o owns rows [o * M_r, (o + 1) * M_r) with M_r = M / W. Every rank computes its partial of
every owner's tiles; the GEMM epilogue stores each finished tile into the owner's inbox (tile-major,
one BLOCK_M x BLOCK_N block per tile) and then adds 1 to an arrival counter on the owner, with
release semantics at system scope. The owner sums the partials in float32 as they arrive.

Program order: a rank computes the tiles of the next owner first and its own tiles last
(owner = rank + 1, rank + 2, ..., rank). Producers therefore get the lower program ids (the
interpreter runs programs in id order; GPUs schedule low ids first), and by the time a rank
reaches its own tiles its peers have usually pushed theirs.

Inboxes and counters are double-buffered by the parity of the call's epoch: a peer can be at most
one call ahead (its next call needs this rank's contribution, which comes after this rank has
consumed the current one), so it never writes the buffer being read. The two parities are fixed
halves of the workspace (`inbox_half` elements, `counter_half` counters apart), independent of the
problem, so calls of different problems, configs or variants sharing one workspace never overlap
across parities. The consumer resets each counter to 0 after reading, which keeps counters small
(no overflow) and all zero again before the same parity is used two calls later.

Two variants:
- `gemm_rs_push_last_kernel`: the owner's own program for a tile, after its GEMM, waits for the
  W-1 peer arrivals on the tile's counter (in the common case it arrives last and finds them all
  there) and sums them with its own float32 accumulator into the output. The sum always runs on
  the owner because the output is the caller's tensor on that rank, which peers cannot address.
- `gemm_rs_push_reducer_kernel`: every tile, own ones included, goes to the inbox; after the GEMM
  programs, REDUCERS persistent reducer programs (higher program ids, so they take SMs as GEMM
  programs retire) wait per tile or per row block (FLAG_GRAN) and sum the W partials.
"""
import triton
import triton.language as tl

from autofuse.kernels import shmem
from autofuse.kernels.gemm_tile import matmul_tile, swizzle, tile_offsets


@triton.jit
def _owner_tile(pid, rank, M_r, N, WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                GROUP_M: tl.constexpr):
    """GEMM program id -> (owner, pid_m, pid_n, position of the tile in the owner's tile grid)."""
    tiles_m = tl.cdiv(M_r, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_owner = tiles_m * tiles_n
    owner = (rank + 1 + pid // per_owner) % WORLD
    pid_m, pid_n = swizzle(pid % per_owner, tiles_m, tiles_n, GROUP_M)
    return owner, pid_m, pid_n, pid_m * tiles_n + pid_n


@triton.jit
def _store_rows(out, tile, row0, col0, rows, N, stride_om, stride_on, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store a float32 tile into out[row0:, col0:] (masked to rows x N), converting to out's dtype."""
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < rows) & (offs_n[None, :] < N)
    tl.store(out + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             tile.to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M_r"])  # one binary for every M
def gemm_rs_push_last_kernel(
        a, b, out, inbox, inbox_half, counters, counter_half, epoch_ptr, status, heap_bases,
        rank, M_r, N, K_r, stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on, spin_limit,
        WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """One program per (owner, tile); grid = (WORLD * cdiv(M_r, BLOCK_M) * cdiv(N, BLOCK_N),).

    Each parity half of inbox: [WORLD - 1 peers, tiles, BLOCK_M * BLOCK_N] (fp32 or out dtype);
    of counters: [tiles] int32, zero between calls.
    """
    epoch = shmem.epoch_next(epoch_ptr)
    parity = epoch % 2
    pid = tl.program_id(0)
    per_owner = tl.cdiv(M_r, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    owner, pid_m, pid_n, pos = _owner_tile(pid, rank, M_r, N, WORLD, BLOCK_M, BLOCK_N, GROUP_M)

    acc = matmul_tile(a + owner * M_r * stride_am, b, pid_m * BLOCK_M, pid_n * BLOCK_N, M_r, N, K_r,
                      stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)

    offs = tile_offsets(BLOCK_M, BLOCK_N)
    count = counters + parity * counter_half + pos
    box = inbox + tl.cast(parity, tl.int64) * inbox_half + tl.cast(pos, tl.int64) * (BLOCK_M * BLOCK_N)
    slot_stride = tl.cast(per_owner, tl.int64) * (BLOCK_M * BLOCK_N)
    if owner != rank:
        slot = (rank - owner - 1 + WORLD) % WORLD
        dst = shmem.translate(box + slot * slot_stride, rank, owner, heap_bases)
        tl.store(dst + offs, acc.to(inbox.dtype.element_ty))
        tl.debug_barrier()  # every thread's stores precede the release below
        shmem.atomic_add(count, 1, rank, owner, heap_bases, sem="release", scope="sys")
    else:
        if shmem.wait_until(count, WORLD - 1, spin_limit, status, heap_bases, rank):
            tl.debug_barrier()  # the acquire in wait_until precedes every thread's loads
            for slot in tl.static_range(WORLD - 1):
                acc += tl.load(box + slot * slot_stride + offs, cache_modifier=".cg").to(tl.float32)
            tl.store(count, 0)
            _store_rows(out, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, M_r, N, stride_om, stride_on, BLOCK_M, BLOCK_N)
    shmem.epoch_finish(epoch_ptr, tl.num_programs(0))


@triton.jit
def _reduce_tile(out, inbox, pos, per_owner, tiles_n, M_r, N, stride_om, stride_on,
                 WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RED_M: tl.constexpr):
    """Sum the WORLD partials of one tile (RED_M rows at a time) into the output.

    `inbox` is this call's parity half: [WORLD slots, tiles, BLOCK_M * BLOCK_N].
    """
    pid_m = pos // tiles_n
    pid_n = pos % tiles_n
    offs = tile_offsets(RED_M, BLOCK_N)
    box = inbox + tl.cast(pos, tl.int64) * (BLOCK_M * BLOCK_N)
    slot_stride = tl.cast(per_owner, tl.int64) * (BLOCK_M * BLOCK_N)
    for r0 in tl.static_range(0, BLOCK_M, RED_M):
        total = tl.zeros((RED_M, BLOCK_N), dtype=tl.float32)
        for slot in tl.static_range(WORLD):
            total += tl.load(box + slot * slot_stride + r0 * BLOCK_N + offs, cache_modifier=".cg").to(tl.float32)
        _store_rows(out, total, pid_m * BLOCK_M + r0, pid_n * BLOCK_N, M_r, N, stride_om, stride_on, RED_M, BLOCK_N)


@triton.jit(do_not_specialize=["M_r", "num_gemm", "num_reducers"])  # one binary for every M
def gemm_rs_push_reducer_kernel(
        a, b, out, inbox, inbox_half, counters, counter_half, epoch_ptr, status, heap_bases,
        rank, M_r, N, K_r, stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on, spin_limit,
        num_gemm, num_reducers,
        WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, ROW_BLOCK: tl.constexpr, RED_M: tl.constexpr):
    """GEMM programs [0, num_gemm), then persistent reducers; grid = (num_gemm + num_reducers,).

    Each parity half of inbox: [WORLD sources (own = slot WORLD - 1), tiles, BLOCK_M * BLOCK_N];
    of counters: [units] int32, a unit being a tile or (ROW_BLOCK) a row of tiles.
    """
    epoch = shmem.epoch_next(epoch_ptr)
    parity = epoch % 2
    inbox += tl.cast(parity, tl.int64) * inbox_half
    counters += parity * counter_half
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M_r, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_owner = tiles_m * tiles_n
    if ROW_BLOCK:
        units = tiles_m
        target = WORLD * tiles_n
    else:
        units = per_owner
        target = WORLD

    if pid < num_gemm:
        owner, pid_m, pid_n, pos = _owner_tile(pid, rank, M_r, N, WORLD, BLOCK_M, BLOCK_N, GROUP_M)
        acc = matmul_tile(a + owner * M_r * stride_am, b, pid_m * BLOCK_M, pid_n * BLOCK_N, M_r, N, K_r,
                          stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        slot = (rank - owner - 1 + WORLD) % WORLD
        dst = shmem.translate(inbox + tl.cast(slot * per_owner + pos, tl.int64) * (BLOCK_M * BLOCK_N), rank, owner, heap_bases)
        tl.store(dst + tile_offsets(BLOCK_M, BLOCK_N), acc.to(inbox.dtype.element_ty))
        tl.debug_barrier()  # every thread's stores precede the release below
        if ROW_BLOCK:
            unit = pid_m
        else:
            unit = pos
        shmem.atomic_add(counters + unit, 1, rank, owner, heap_bases, sem="release", scope="sys")
    else:
        ok = True
        for unit in range(pid - num_gemm, units, num_reducers):
            if ok:
                count = counters + unit
                ok = shmem.wait_until(count, target, spin_limit, status, heap_bases, rank)
                if ok:
                    tl.debug_barrier()  # the acquire in wait_until precedes every thread's loads
                    if ROW_BLOCK:
                        for pid_n in range(0, tiles_n):
                            _reduce_tile(out, inbox, unit * tiles_n + pid_n, per_owner, tiles_n, M_r, N,
                                         stride_om, stride_on, WORLD, BLOCK_M, BLOCK_N, RED_M)
                    else:
                        _reduce_tile(out, inbox, unit, per_owner, tiles_n, M_r, N,
                                     stride_om, stride_on, WORLD, BLOCK_M, BLOCK_N, RED_M)
                    tl.store(count, 0)
    shmem.epoch_finish(epoch_ptr, tl.num_programs(0))
