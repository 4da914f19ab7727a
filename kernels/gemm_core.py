"""The GEMM core of every fused kernel: one output tile's float32 accumulator over a K range.

Read it like Triton's tutorial 09 (persistent matmul): `gemm_kernel` at the bottom is a complete
persistent GEMM, C = A @ B, built only from the device functions above it, with its launch grid
in its docstring; `gemm_wait_kernel` is the same loop as a fused consumer runs it (a bounded wait
per tile, B prefetched before it). The fused kernels (ag_gemm pull/push/push_ws, gemm_rs, gemm_ar) call the same
functions with their own waits and epilogues. Host side (configs, checks, launch): autofuse/core/gemm.py.

Operands. A is M x K, B is K x N, C is M x N, any strides with the last one 1 for the TMA path.
`operands(...)` returns the two "sources" every other function takes: with USE_TMA, device-side
tensor descriptors (`tl.make_tensor_descriptor`: TMA loads, out-of-range elements read as zero,
so any M/N/K works; row strides and base addresses must be 16-byte aligned, and the host must
have called `autofuse.core.gemm.ensure_allocator()`); without, the base pointers themselves (masked
`tl.load`s, any strides). A consumer may also build its own descriptors (a peer's inbox, a shard
of a gathered buffer) and pass them: the functions only call `.load([row, col])` on them.

Device functions, in the order a kernel uses them:
  dot(a, b, acc)                      tl.dot, except that under TRITON_INTERPRET=1 bfloat16 blocks
                                      are widened to float32 first (the interpreter multiplies
                                      bfloat16 as raw integers). The one copy of that workaround.
  operands(a, b, M, N, K, strides.., BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA) -> (a_src, b_src)
  work_count(M, N, BLOCK_M, BLOCK_N, SPLIT_K) -> number of work items (tiles x splits)
  schedule(work, M, N, K, ..., GROUP_M, SPLIT_K) -> (pid_m, pid_n, tile, split, k_first, k_end)
                                      work item -> output tile (GROUP_M swizzle) and its K steps
                                      [k_first, k_end) (in BLOCK_K units). Items are split-major:
                                      work = split * tiles + tile.
  prefetch_b(b, off_n, k_first, k_end, N, K, stride_bk, stride_bn, ..., STEPS)
                                      pull B's first STEPS K steps of the tile into L2 (B never
                                      depends on a peer); a no-op under the interpreter.
  gemm_tile(acc, a_src, b_src, off_m, off_n, k_first, k_end, M, N, K, strides.., BLOCK_*,
            NUM_STAGES, SWAP_AB, USE_TMA, WARP_SPEC) -> acc
                                      acc += A[off_m:+BLOCK_M, ks] @ B[ks, off_n:+BLOCK_N] for the
                                      K steps ks in [k_first, k_end), in one `tl.range` loop of
                                      NUM_STAGES pipeline stages. acc is float32 BLOCK_M x BLOCK_N
                                      in C's orientation whatever SWAP_AB says. Rows >= M and
                                      columns >= N of acc hold zeros or garbage: never store them.
  split_k_reduce(acc, partials, counts, tile, split, SPLIT_K, BLOCK_M, BLOCK_N) -> (acc, last)
                                      every split stores its float32 partial and counts itself on
                                      counts[tile]; the last to arrive gets the summed tile (last
                                      True) and resets the count to 0 (CUDA-graph replays need no
                                      clearing). The others get last False and must not store.
                                      The sum runs in split order: bitwise deterministic.
  fixup(acc, partials, counts, count, slot, first, n, BLOCK_M, BLOCK_N) -> (acc, last)
                                      the same for any n contributors in slots first..first+n-1
                                      (split_k_reduce and stream-K both use it).
  stream_k_lanes(num_pid_m, programs, GROUP_M) -> lanes
  stream_k_plan(tiles, steps, programs, lanes, STREAM_K) -> (dp_tiles, lane_iters, lane_programs)
  stream_k_piece(t, p, steps, sk_iters, sk_programs) -> (k_first, k_end, slot, first, n)
                                      the last-wave split (below).
  store_tile(c, acc, off_m, off_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N, USE_TMA)
                                      masked store of the tile in C's dtype (a descriptor with
                                      USE_TMA: TMA clips the edges).
  scale_tile(acc, scale_a, scale_b, off_m, off_n, M, N, BLOCK_M, BLOCK_N, SCALE) -> acc
                                      times the FP8 scales (TENSORWISE or ROWWISE), once per summed tile.
  tile_product(...), finish_tile(...)  gemm_kernel's two loops' shared steps: a tile's accumulator
                                      from zero; scale and store a summed tile.

A fused consumer that waits per tile (the ag_gemm gathered layout, say) keeps the same loop and
puts its wait between B's prefetch and the K loop; `gemm_wait_kernel` below is that template,
runnable alone (tests run it under the interpreter and compile it for sm_90):

    a_src, b_src = gemm_core.operands(a_gathered, b, M, N, K, ..., USE_TMA)   # once per program
    for work in tl.range(pid, gemm_core.work_count(M, N, ...), num_programs):
        pid_m, pid_n, tile, split, k_first, k_end = gemm_core.schedule(work, M, N, K, ...)
        gemm_core.prefetch_b(b, pid_n * BLOCK_N, k_first, k_end, ...)  # B first: it needs no peer
        ok = shmem.wait_until(flag_of_rows(pid_m), epoch, ...)     # only the shards these rows read
        k_end = tl.where(ok, k_end, k_first)                       # a timed-out wait runs no K step
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc = gemm_core.gemm_tile(acc, a_src, b_src, pid_m * BLOCK_M, pid_n * BLOCK_N, k_first,
                                  k_end, ...)                      # pipelined; no wait inside it
        acc, last = gemm_core.split_k_reduce(acc, partials, counts, tile, split, ...)
        if last & ok:
            epilogue(acc)                                          # local store, or a peer's inbox

The wait sits before the K loop, never inside it, so the compiler pipelines the loop exactly as in
gemm_kernel (same shared memory, same TMA/cp.async stages: checked by the AOT tests). A timeout
is recorded in the status word and fails the call on the host (with split-K, other splits of the
tile may still store: the output of a failed call is undefined). Order tiles so the local
shard's come first (they wait for nothing) and peers' in arrival order: remap pid_m (e.g.
(pid_m + first) % num_pid_m) before waiting. Several K ranges (gather-k: one per shard, each its
own descriptor) accumulate by calling gemm_tile again with the same acc.

The last wave (STREAM_K, in gemm_kernel). tiles = T on P persistent programs leave T % P tiles for
a last wave in which the other SMs idle (80 tiles of 128x256 for N=5120 at M=512: 52 of 132 SMs
idle for the whole GEMM). With STREAM_K the whole waves run data-parallel, one program per tile
over all of K, and the tail tiles' K steps are cut into equal shares of consecutive steps, one per
program (stream-K on the tail, "DP + SK"). The tail is dealt to lanes (`stream_k_lanes`): the R
tiles of a column of the swizzled order, which read the same columns of B, go to R lanes whose
shares have equal bounds, so the programs on one column read the same K steps of B at the same
time (one lane, as first built, read B up to R times from HBM and ran slower than no stream-K).
A share may end inside one tile and start the next, so a tail tile has 1..few contributors, all
in its lane; each stores its float32 partial in its own slot (lane, program + tile) and counts
itself, and the last to arrive sums the slots in order (`fixup`): bounded (nobody waits),
deterministic, and runnable under the interpreter. Shares are at least SK_MIN_STEPS K steps, so a
short tail uses fewer programs.

Skinny problems: SPLIT_K splits each tile's K steps over SPLIT_K work items (float32 partials,
the last arrival sums), so few output tiles still fill every SM; SWAP_AB computes the tile as
C^T = B^T A^T so BLOCK_N (>= 64) fills the wgmma's M dimension while BLOCK_M (16..64 rows of A)
becomes its N; the result is transposed back in registers once per K range.

WARP_SPEC asks the compiler to warp-specialise the K loop (`tl.range(warp_specialize=True)`):
producer warps issue the TMA loads, consumer warpgroups run the MMAs. It is optional. Seen in
sm_90 AOT compiles with Triton 3.6 and 3.9: with TMA, 16-bit inputs, num_warps=4 and an MMA M side
>= 64 the kernel becomes 12 warps (one producer, two consumer warpgroups, setmaxnreg); with 8 warps
or split-K it is silently not applied; the pointer path, float32, and any kernel whose tile loop
also holds a spin-wait loop or inline PTX (gemm_wait_kernel, prefetch_b) fail to compile
("NVGPUWarpSpecialization" pass). Run on an H100 (Triton 3.6, scripts/diag_warp_spec.py,
2026-11-27): with two consumer warpgroups (MMA M side 128) at 5 or 6 stages the outputs were wrong
(non-finite, not repeatable); 2-4 stages and 64-row tiles at 2-6 were right; 64 x 256 tiles do not
compile. autofuse.core.gemm.check rejects all of these with the reason; fused consumers that wait
per tile must run WARP_SPEC=False.
"""
import os

import triton
import triton.language as tl

from autofuse.kernels import shmem

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
SK_MIN_STEPS = tl.constexpr(4)  # fewest K steps in a stream-K share (the pipeline's depth)
NO_SCALE = tl.constexpr(0)      # SCALE: the output is A @ B as accumulated
TENSORWISE = tl.constexpr(1)    # SCALE: times scale_a[0] * scale_b[0] (FP8 per-tensor scales)
ROWWISE = tl.constexpr(2)       # SCALE: times scale_a[row] * scale_b[column] (FP8 row-wise scales)


@triton.jit
def dot(a, b, acc):
    """acc + a @ b with float32 accumulation; bfloat16 is widened first under the interpreter."""
    if INTERPRETED:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
        if b.dtype == tl.bfloat16:
            b = b.to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def operands(a, b, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr,
             B_T: tl.constexpr = False):
    """(A source, B source) for gemm_tile: TMA descriptors of A (M x K) and B (K x N) with
    USE_TMA (stride_ak must be 1, and stride_bn, or with B_T stride_bk: B stored transposed, N x K
    row-major, as FP8 weights and torch._scaled_mm's B are), else the base pointers unchanged."""
    if USE_TMA:
        a_src = tl.make_tensor_descriptor(a, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
        if B_T:
            b_src = tl.make_tensor_descriptor(b, shape=[N, K], strides=[stride_bn, 1], block_shape=[BLOCK_N, BLOCK_K])
        else:
            b_src = tl.make_tensor_descriptor(b, shape=[K, N], strides=[stride_bk, 1], block_shape=[BLOCK_K, BLOCK_N])
    else:
        a_src = a
        b_src = b
    return a_src, b_src


@triton.jit
def work_count(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """Work items of a GEMM: output tiles times K splits."""
    return tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N) * SPLIT_K


@triton.jit
def swizzle(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile index -> (pid_m, pid_n), walking GROUP_M tile rows column by column so that programs
    running together share B's columns in L2 (Triton's matmul tutorial)."""
    num_in_group = GROUP_M * num_pid_n
    group = tile // num_in_group
    first_m = group * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % num_in_group) % group_m
    pid_n = (tile % num_in_group) // group_m
    return pid_m, pid_n


@triton.jit
def schedule(work, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr):
    """Work item -> (pid_m, pid_n, tile, split, k_first, k_end).

    Items are split-major (work = split * tiles + tile), so one wave covers many tiles of one
    split. The K steps cdiv(K, BLOCK_K) are divided as evenly as possible: split s runs
    [s * steps // SPLIT_K, (s + 1) * steps // SPLIT_K), never empty while SPLIT_K <= steps.
    """
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles = num_pid_m * num_pid_n
    tile = work % tiles
    split = work // tiles
    pid_m, pid_n = swizzle(tile, num_pid_m, num_pid_n, GROUP_M)
    steps = tl.cdiv(K, BLOCK_K)
    k_first = split * steps // SPLIT_K
    k_end = (split + 1) * steps // SPLIT_K
    return pid_m, pid_n, tile, split, k_first, k_end


@triton.jit
def prefetch_b(b, off_n, k_first, k_end, N, K, stride_bk, stride_bn,
               BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr):
    """Ask L2 for B's rows of the tile's first STEPS K steps (one `prefetch.global.L2` per 128
    bytes); nothing waits for it. `b` is B's base pointer. A no-op under the interpreter, which
    has no inline PTX."""
    if not INTERPRETED:
        LINE: tl.constexpr = 128 * 8 // b.dtype.element_ty.primitive_bitwidth  # elements per 128 bytes
        PER_ROW: tl.constexpr = max(BLOCK_N // LINE, 1)
        rows = k_first * BLOCK_K + tl.arange(0, STEPS * BLOCK_K)
        cols = off_n + tl.arange(0, PER_ROW) * LINE
        ok = (rows < min(k_end * BLOCK_K, K))[:, None] & (cols < N)[None, :]
        ptrs = b + rows[:, None].to(tl.int64) * stride_bk + cols[None, :] * stride_bn
        ptrs = tl.where(ok, ptrs, b)
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load(src, off_r, off_c, R, C, stride_r, stride_c,
          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, USE_TMA: tl.constexpr):
    """BLOCK_R x BLOCK_C block at (off_r, off_c) of an R x C matrix, zeros outside it."""
    if USE_TMA:
        block = src.load([off_r, off_c])
    else:
        offs_r = off_r + tl.arange(0, BLOCK_R)
        offs_c = off_c + tl.arange(0, BLOCK_C)
        mask = (offs_r < R)[:, None] & (offs_c < C)[None, :]
        block = tl.load(src + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c, mask=mask, other=0.0)
    return block


@triton.jit
def _load_b(src, off_k, off_n, K, N, stride_bk, stride_bn,
            BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, B_T: tl.constexpr):
    """B's BLOCK_K x BLOCK_N block at (off_k, off_n); with B_T and TMA the descriptor is over B's
    N x K storage, so the block is loaded N x K (K-major, as FP8 wgmma wants it) and transposed."""
    if B_T and USE_TMA:
        block = tl.trans(src.load([off_n, off_k]))
    else:
        block = _load(src, off_k, off_n, K, N, stride_bk, stride_bn, BLOCK_K, BLOCK_N, USE_TMA)
    return block


@triton.jit
def gemm_tile(acc, a_src, b_src, off_m, off_n, k_first, k_end, M, N, K,
              stride_am, stride_ak, stride_bk, stride_bn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
              SWAP_AB: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr, B_T: tl.constexpr = False):
    """acc + A[off_m:+BLOCK_M, k-range] @ B[k-range, off_n:+BLOCK_N] over K steps [k_first, k_end).

    acc: float32 BLOCK_M x BLOCK_N. a_src/b_src come from `operands` (or the consumer's own
    descriptors/pointers: the strides are read only by the pointer path). The loop is one
    structured `tl.range` with NUM_STAGES stages, which the compiler software-pipelines (TMA or
    cp.async loads NUM_STAGES - 1 steps ahead of the wgmma). With SWAP_AB the MMA computes the
    transposed tile, (B^T)(A^T), so BLOCK_N sits on the MMA's M side.
    """
    if SWAP_AB:
        acc_t = tl.trans(acc)
        for ki in tl.range(k_first, k_end, num_stages=NUM_STAGES, warp_specialize=WARP_SPEC):
            off_k = ki * BLOCK_K
            a = _load(a_src, off_m, off_k, M, K, stride_am, stride_ak, BLOCK_M, BLOCK_K, USE_TMA)
            b = _load_b(b_src, off_k, off_n, K, N, stride_bk, stride_bn, BLOCK_K, BLOCK_N, USE_TMA, B_T)
            acc_t = dot(tl.trans(b), tl.trans(a), acc_t)
        acc = tl.trans(acc_t)
    else:
        for ki in tl.range(k_first, k_end, num_stages=NUM_STAGES, warp_specialize=WARP_SPEC):
            off_k = ki * BLOCK_K
            a = _load(a_src, off_m, off_k, M, K, stride_am, stride_ak, BLOCK_M, BLOCK_K, USE_TMA)
            b = _load_b(b_src, off_k, off_n, K, N, stride_bk, stride_bn, BLOCK_K, BLOCK_N, USE_TMA, B_T)
            acc = dot(a, b, acc)
    return acc


@triton.jit
def tile_offsets(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row-major offsets of a BLOCK_M x BLOCK_N tile stored contiguously (partials, inboxes)."""
    return tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]


@triton.jit
def fixup(acc, partials, counts, count, slot, first, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Sum the n partial accumulators of one output tile, stored at slots first .. first + n - 1 of
    `partials` (float32 BLOCK_M x BLOCK_N each); this program's own is `acc`, for slot `slot`.
    Returns (acc, last): every contributor stores its partial and counts itself on counts[count];
    the last to arrive gets the sum (last True) and resets the count to 0 (CUDA-graph replays need
    no clearing); the others get last False and must not store. The sum always runs from slot
    `first` upwards, whoever arrives last, so results are bitwise deterministic. No program ever
    waits for another (bounded by construction; runs under the interpreter, whose programs run one
    after another). With n == 1 it returns (acc, True) and touches nothing.
    """
    last = n == 1
    if n > 1:
        offs = tile_offsets(BLOCK_M, BLOCK_N)
        tl.store(partials + tl.cast(slot, tl.int64) * (BLOCK_M * BLOCK_N) + offs, acc)
        tl.debug_barrier()  # every thread's partial is stored before the count's release
        done = tl.atomic_add(counts + count, 1, sem="acq_rel", scope="gpu")
        last = done == n - 1
        if last:
            tl.debug_barrier()  # the acquire happens before any thread reads the other partials
            tl.store(counts + count, 0)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in range(first, first + n):
                acc += tl.load(partials + tl.cast(s, tl.int64) * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
    return acc, last


@triton.jit
def split_k_reduce(acc, partials, counts, tile, split,
                   SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Combine the SPLIT_K partial accumulators of output tile `tile`; returns (acc, last) as
    `fixup` (deterministic: the splits are summed in split order).

    partials: float32, tiles x SPLIT_K x BLOCK_M x BLOCK_N; counts: int32, one per tile, zero
    before the first launch and left at zero by every launch. With SPLIT_K == 1 it returns
    (acc, True) and touches nothing.
    """
    last = tl.full([], 1, tl.int1)
    if SPLIT_K > 1:
        acc, last = fixup(acc, partials, counts, tile, tile * SPLIT_K + split, tile * SPLIT_K, SPLIT_K,
                          BLOCK_M, BLOCK_N)
    return acc, last


@triton.jit
def stream_k_lanes(num_pid_m, programs, GROUP_M: tl.constexpr):
    """Lanes of the stream-K tail: R tiles in a row of the swizzled order that share B's columns
    (one column of a GROUP_M group: R = the tile rows when they fit in one group, GROUP_M when
    the groups are whole, else 1). Each lane streams its own tail tiles with programs // R
    programs whose shares have the same bounds in every lane, so the R programs that read a
    column of B read the same K steps at the same time and B crosses HBM once (with one lane,
    the programs on a column sat at different K offsets and B was read up to R times: one H100,
    2026-11-26, 512 x 5120 x 8192 ran 143 us with stream-K against 87 us without)."""
    lanes = tl.where(num_pid_m <= GROUP_M, num_pid_m, tl.where(num_pid_m % GROUP_M == 0, GROUP_M, 1))
    return tl.where(lanes <= programs, lanes, 1)


@triton.jit
def stream_k_plan(tiles, steps, programs, lanes, STREAM_K: tl.constexpr):
    """(dp_tiles, lane_iters, lane_programs): how a persistent launch of `programs` programs shares
    `tiles` output tiles of `steps` K steps each. The first dp_tiles (whole waves, cut to a
    multiple of `lanes`) run data-parallel, one program per tile over all of K. With STREAM_K the
    other tiles (the last, partial wave) are dealt round-robin to `lanes` lanes (tail tile t to
    lane t % lanes); each lane lays its tiles' K steps end to end (lane_iters of them) and cuts
    them into lane_programs equal shares of consecutive steps (stream-K), so no SM idles through
    the last wave; shares are at least SK_MIN_STEPS K steps, so fewer programs take part when
    the tail is short. Without STREAM_K every tile is data-parallel."""
    if STREAM_K:
        dp_tiles = (tiles - tiles % programs) // lanes * lanes
        lane_iters = (tiles - dp_tiles) // lanes * steps
        lane_programs = max(min(programs // lanes, lane_iters // SK_MIN_STEPS), 1)
    else:
        dp_tiles = tiles
        lane_iters = tiles * 0
        lane_programs = lane_iters + 1
    return dp_tiles, lane_iters, lane_programs


@triton.jit
def stream_k_owner(it, sk_iters, sk_programs):
    """The stream-K program (of a lane) whose share holds K step `it` of the lane (shares: program p
    runs steps [p * sk_iters // sk_programs, (p + 1) * sk_iters // sk_programs))."""
    return ((it + 1) * sk_programs - 1) // sk_iters


@triton.jit
def stream_k_piece(t, p, steps, sk_iters, sk_programs):
    """Program p's piece of the lane's tile t (both counted within one lane): (k_first, k_end, slot,
    first, n). [k_first, k_end) are the tile's K steps in p's share (empty when none); the tile's n
    contributors are programs owner(first step) .. owner(last step), and the piece of program q in
    tile t has partial slot q + t, so the tile's slots are first .. first + n - 1 with first =
    owner(first step) + t (a lane's slots: sk_programs + its tiles)."""
    it0 = p * sk_iters // sk_programs
    it1 = (p + 1) * sk_iters // sk_programs
    k_first = max(it0 - t * steps, 0)
    k_end = min(it1 - t * steps, steps)
    lo = stream_k_owner(t * steps, sk_iters, sk_programs)
    hi = stream_k_owner((t + 1) * steps - 1, sk_iters, sk_programs)
    return k_first, k_end, p + t, lo + t, hi - lo + 1


@triton.jit
def scale_tile(acc, scale_a, scale_b, off_m, off_n, M, N,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE: tl.constexpr):
    """acc times the FP8 scales (float32): SCALE TENSORWISE multiplies by scale_a[0] * scale_b[0],
    ROWWISE by scale_a[row] (one per row of A) and scale_b[column] (one per column of B), as
    torch._scaled_mm does; NO_SCALE returns acc. Apply it once, to the summed tile."""
    if SCALE == TENSORWISE:
        acc = acc * (tl.load(scale_a) * tl.load(scale_b))
    elif SCALE == ROWWISE:
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        sa = tl.load(scale_a + rows, mask=rows < M, other=0.0)
        sb = tl.load(scale_b + cols, mask=cols < N, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    return acc


@triton.jit
def store_tile(c, acc, off_m, off_n, M, N, stride_cm, stride_cn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr):
    """Store the tile in C's dtype: through a TMA descriptor (USE_TMA: `c` from
    make_tensor_descriptor, edges clipped by the hardware) or masked pointer stores."""
    if USE_TMA:
        c.store([off_m, off_n], acc.to(c.dtype))
    else:
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        ptrs = c + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
        tl.store(ptrs, acc.to(c.dtype.element_ty), mask=mask)


@triton.jit
def tile_product(a_src, b_src, pid_m, pid_n, k_first, k_end, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                 SWAP_AB: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr, B_T: tl.constexpr):
    """Output tile (pid_m, pid_n)'s float32 accumulator over K steps [k_first, k_end) (gemm_tile from zero)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return gemm_tile(acc, a_src, b_src, pid_m * BLOCK_M, pid_n * BLOCK_N, k_first, k_end, M, N, K,
                     stride_am, stride_ak, stride_bk, stride_bn,
                     BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, SWAP_AB, USE_TMA, WARP_SPEC, B_T)


@triton.jit
def finish_tile(c_dst, acc, scale_a, scale_b, pid_m, pid_n, M, N, stride_cm, stride_cn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, SCALE: tl.constexpr):
    """The summed tile (pid_m, pid_n) times its FP8 scales (scale_tile), stored in C's dtype (store_tile)."""
    acc = scale_tile(acc, scale_a, scale_b, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, BLOCK_M, BLOCK_N, SCALE)
    store_tile(c_dst, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N, USE_TMA)


@triton.jit
def gemm_kernel(a, b, c, partials, counts, scale_a, scale_b, M, N, K,
                stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                NUM_STAGES: tl.constexpr, SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr, USE_TMA: tl.constexpr,
                WARP_SPEC: tl.constexpr, STREAM_K: tl.constexpr, B_T: tl.constexpr, SCALE: tl.constexpr):
    """C = A @ B (times the FP8 scales: scale_tile), persistent: each program loops over work
    items (output tile, K split), then, with STREAM_K, over its share of the last wave's K steps
    (stream_k_plan). B_T: B is stored N x K (see operands). scale_a/scale_b: float32 scales, unused
    with SCALE NO_SCALE.

    grid = (min(cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) * SPLIT_K, NUM_SMS),), or (NUM_SMS,) with STREAM_K.
    partials/counts: split-K workspace (see split_k_reduce; unused when SPLIT_K == 1) or, with
    STREAM_K, GemmConfig.stream_k_slots partial slots and a count per tail tile (see fixup).
    """
    a_src, b_src = operands(a, b, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                            BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_T)
    if USE_TMA:
        c_dst = tl.make_tensor_descriptor(c, shape=[M, N], strides=[stride_cm, 1], block_shape=[BLOCK_M, BLOCK_N])
    else:
        c_dst = c
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    steps = tl.cdiv(K, BLOCK_K)
    lanes = stream_k_lanes(num_pid_m, programs, GROUP_M)
    dp_tiles, lane_iters, lane_programs = stream_k_plan(num_pid_m * num_pid_n, steps, programs, lanes, STREAM_K)
    for work in tl.range(pid, dp_tiles * SPLIT_K, programs):
        pid_m, pid_n, tile, split, k_first, k_end = schedule(work, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                                             SPLIT_K)
        acc = tile_product(a_src, b_src, pid_m, pid_n, k_first, k_end, M, N, K, stride_am, stride_ak, stride_bk,
                           stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, SWAP_AB, USE_TMA, WARP_SPEC, B_T)
        acc, last = split_k_reduce(acc, partials, counts, tile, split, SPLIT_K, BLOCK_M, BLOCK_N)
        if last:
            finish_tile(c_dst, acc, scale_a, scale_b, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N,
                        USE_TMA, SCALE)
    if STREAM_K:
        lane = pid % lanes
        p = pid // lanes  # this program's place in its lane
        if p < lane_programs:
            base = lane * (lane_programs + lane_iters // steps)  # the lane's first partial slot
            it0 = p * lane_iters // lane_programs
            it1 = (p + 1) * lane_iters // lane_programs
            for j in range(it0 // steps, tl.cdiv(it1, steps)):
                k_first, k_end, slot, first, n = stream_k_piece(j, p, steps, lane_iters, lane_programs)
                t = j * lanes + lane  # the tail tile; the lanes' j-th tiles share B's columns
                pid_m, pid_n = swizzle(dp_tiles + t, num_pid_m, num_pid_n, GROUP_M)
                acc = tile_product(a_src, b_src, pid_m, pid_n, k_first, k_end, M, N, K, stride_am, stride_ak,
                                   stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, SWAP_AB, USE_TMA,
                                   False, B_T)
                acc, last = fixup(acc, partials, counts, t, base + slot, base + first, n, BLOCK_M, BLOCK_N)
                if last:
                    finish_tile(c_dst, acc, scale_a, scale_b, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M,
                                BLOCK_N, USE_TMA, SCALE)


@triton.jit
def gemm_wait_kernel(a, b, c, partials, counts, ready, epoch, ctx, M, N, K,
                     stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     NUM_STAGES: tl.constexpr, SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr,
                     USE_TMA: tl.constexpr, PREFETCH: tl.constexpr):
    """gemm_kernel as a fused consumer runs it: before each tile's K loop, B's first PREFETCH K
    steps are sent to L2, then the program waits (bounded, shmem.wait_until) for ready[pid_m] to
    hold `epoch`, as a consumer waits for the shard holding the tile's rows of A. A timed-out
    wait is recorded in the status words of `ctx` and its tile gets no K step and is stored as NaN
    (a fault never looks like a result). The template the
    fused kernels follow; tests run it, and the AOT checks show the wait keeps the K loop
    pipelined. (No WARP_SPEC: Triton's Hopper warp specialisation rejects a kernel whose tile
    loop holds a spin loop or inline PTX.)

    grid = (min(cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) * SPLIT_K, NUM_SMS),)
    """
    a_src, b_src = operands(a, b, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                            BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA)
    if USE_TMA:
        c_dst = tl.make_tensor_descriptor(c, shape=[M, N], strides=[stride_cm, 1], block_shape=[BLOCK_M, BLOCK_N])
    else:
        c_dst = c
    for work in tl.range(tl.program_id(0), work_count(M, N, BLOCK_M, BLOCK_N, SPLIT_K), tl.num_programs(0)):
        pid_m, pid_n, tile, split, k_first, k_end = schedule(work, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                                             SPLIT_K)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if PREFETCH > 0:
            prefetch_b(b, off_n, k_first, k_end, N, K, stride_bk, stride_bn, BLOCK_K, BLOCK_N, PREFETCH)
        ok = shmem.wait_until(ready + pid_m, epoch, ctx)
        k_end = tl.where(ok, k_end, k_first)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = gemm_tile(acc, a_src, b_src, off_m, off_n, k_first, k_end, M, N, K,
                        stride_am, stride_ak, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, SWAP_AB, USE_TMA, False)
        acc, last = split_k_reduce(acc, partials, counts, tile, split, SPLIT_K, BLOCK_M, BLOCK_N)
        if last:
            acc = tl.where(ok, acc, float("nan"))
            store_tile(c_dst, acc, off_m, off_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N, USE_TMA)
