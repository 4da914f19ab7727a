"""The flags of a ring reduction beside the vendor GEMM: gemm_rs's mm_ring (autofuse/ops/gemm_rs.py).

The host runs the data path: cuBLAS GEMMs on the compute stream (each accumulating onto the partial
that the previous rank of the ring handed on, `addmm_` with beta = 1, so no reduction kernel runs)
and copy-engine pulls of those partials from the previous rank's heap on a pull stream (no SM moves
data). Flags are raised by the copy engine too: a 4-byte copy of my CURRENT word into a neighbour's
flag word, on a stream that first waited for the work it announces (a copy starts only when the
stream's earlier work is complete and visible), so raising a flag launches no kernel. These
one-program kernels do what a copy cannot, read and wait:

    begin_kernel   compute stream, first: the call's epoch (one more than the last finished call's,
                   kept on the device so CUDA-graph replays advance it) into CURRENT; then it waits
                   until the next rank pulled every partial of my previous call (TAKEN == epoch - 1),
                   so this call's GEMMs may overwrite them
    wait_kernel    pull stream: wait until READY + i holds the current epoch (the previous rank's
                   partial i is complete), before the copy that pulls it
    finish_kernel  compute stream, last: NaN into `out` where this rank's workspace saw a fault (a
                   wait ran out here or on a peer), then the epoch published as finished

The copies (autofuse/ops/gemm_rs.py, RingRunner): READY + i on the next rank once my partial i is
written (signal stream, after the GEMM's event), TAKEN on the previous rank once I pulled all of its
partials of this call (pull stream, after the last pull).

Flags (int32 words of the workspace's flags, read by exact epoch, never cleared: epochs only grow,
so a flag another layout left behind never matches): CURRENT (word 0, mine), TAKEN (word 1, raised
by the next rank), READY + i (words 2.., raised by the previous rank). A peer is at most one call
ahead: its begin_kernel waits for my TAKEN of the call before, and its READY flags of the next call
are raised after that, when I have pulled (and waited for) every partial of this one.

Faults: as everywhere (kernels/shmem.py): waits are bounded, the first to run out aborts every
peer, an unhealthy workspace waits for nothing, and finish_kernel leaves NaN in the output of every
call that saw a fault. The copies raise their flags whether or not a fault was seen: a peer they
release is aborted already (its waits return at once and its output is NaN), or it was past its last
wait with the right data.
"""
import triton
import triton.language as tl

from autofuse.kernels import shmem

CURRENT = tl.constexpr(0)
TAKEN = tl.constexpr(1)
READY = tl.constexpr(2)


@triton.jit
def _healthy(ctx):
    """Whether this rank's workspace holds no fault (telling the host mirror if it does)."""
    code = shmem.read_uniform(ctx.status + shmem.CODE, "relaxed")
    if code != 0:
        tl.store(ctx.mirror, code)
    return code == 0


@triton.jit
def begin_kernel(ctx, flags):
    """grid = (1,): CURRENT = the call's epoch; wait until the next rank pulled my last call's partials."""
    epoch = shmem.read_uniform(ctx.counter, "relaxed") + 1
    tl.store(flags + CURRENT, epoch)
    if _healthy(ctx):
        if ctx.world > 1:
            shmem.wait_until(flags + TAKEN, epoch - 1, ctx)


@triton.jit
def wait_kernel(ctx, flags, word):
    """grid = (1,): hold the stream until my flag `word` holds the current epoch (bounded; a wait that
    runs out records the fault, and finish_kernel poisons the output)."""
    epoch = shmem.read_uniform(flags + CURRENT, "relaxed")
    if _healthy(ctx):
        shmem.wait_until(flags + word, epoch, ctx)


@triton.jit
def finish_kernel(ctx, flags, out, numel, BLOCK: tl.constexpr):
    """grid = (P,): NaN into the `numel` contiguous elements of `out` if this rank's workspace saw a
    fault; program 0 publishes the epoch as finished (the next begin_kernel's epoch is one more)."""
    pid = tl.program_id(0)
    if not _healthy(ctx):
        for start in range(pid * BLOCK, numel, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(out + offs, tl.full([BLOCK], float("nan"), out.dtype.element_ty), mask=offs < numel)
    if pid == 0:
        tl.store(ctx.counter, shmem.read_uniform(flags + CURRENT, "relaxed"))
