"""Low-latency (data-as-flag) all-reduce on the symmetric heap: one launch, no flag round trip.

The flag protocol of kernels/collectives.py costs a release fence and a flag hop after the data:
about 6-7 us per all-reduce of up to 256 KB on two H200, where the partial itself moves in well
under a microsecond. Here every 8-byte word a rank sends carries its own flag (NCCL's LL form):

    word = (epoch << 32) | payload     payload: 32 bits of the partial (two 16-bit elements or one float32)

A 64-bit aligned store is single-copy atomic, so a reader that sees the call's epoch in a word's
high half also sees that word's payload: no fence, no flag, no acquire. Twice the bytes move, which
is cheap where latency dominates (the host refuses messages above 4 MB per rank).

Layout: `inbox` (int64 words, my heap) holds one slot of `words` per source rank, in the parity
half of the call's epoch (a peer one call ahead writes the other half). Program k sends words
[k * piece, (k + 1) * piece) of my partial to every peer's slot `me`, then, word block by word
block, polls the same range of every peer's slot in my inbox until every word carries the epoch,
and sums the W partials in float32 in rank order (so every rank gets bitwise the same result, the
same bits as the flag protocol's one-shot all-reduce).

Why a stale word never passes for a current one: within one life of the workspace (from zeroed
flags and epoch counter, when it is made or rebuilt) the inbox half of parity p holds only zeros
and words of epochs of parity p up to the current one, and the current epoch's only from this call:
- the first call of a life (epoch 1) cannot trust its inbox (garbage or words of an earlier life,
  whose epochs restart at 1): it also raises a flag per program after its words (released) and
  waits for every peer's flag before it polls; before it sends anything it zeroes inbox half 0;
- the second call (epoch 2) zeroes inbox half 1 before it sends.
A peer writes half 0 in epoch 2 (half 1 in epoch 3) only after it received every program's words
of my epoch 1 (2), which I send after the zeroing and a system-scope fence: the zeros land first.

Faults (kernels/shmem.py): an unhealthy workspace sends nothing and writes NaN; a poll is bounded
by the workspace's wall-clock budget and the status word, and the first program to run out records
the missing word and aborts every peer (shmem.give_up), so every rank raises; its output is NaN.

grid = (P,): program k handles words [k * piece, (k + 1) * piece) (none where they run out).
"""
import triton
import triton.language as tl
from autofuse.kernels import shmem

POLLS_PER_CHECK = tl.constexpr(16)  # polls of a block between two reads of the clock and the status word


@triton.jit
def _fence_sys():
    """Order every memory access of this thread before all later ones, system-wide (fence.acq_rel.sys)."""
    if not shmem.INTERPRETED:
        tl.inline_asm_elementwise("fence.acq_rel.sys;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _zero(box, start, stop, BLOCK: tl.constexpr):
    """Words [start, stop) of `box` = 0 (tag 0: no epoch)."""
    offs = tl.arange(0, BLOCK)
    for s in range(start, stop, BLOCK):
        tl.store(box + s + offs, tl.zeros([BLOCK], tl.int64), mask=s + offs < stop)


@triton.jit
def _arrived(src, offs, mask, epoch):
    """(the words at src + offs, loaded once per thread, volatile; how many lack `epoch`, program-uniform)."""
    v = tl.load(src + offs, mask=mask, other=0, volatile=True)
    late = ((v >> 32).to(tl.int32) != epoch) & mask
    return v, shmem.program_max(tl.sum(late.to(tl.int32), axis=0))


@triton.jit
def _receive(src, offs, mask, epoch, ctx):
    """Poll the words at src + offs until all carry `epoch`: (the words, True if they did; program-uniform).

    Bounded like shmem.wait_until: gives up when the workspace's budget runs out (recording the first
    late word and aborting every peer) or at once when the status word says a peer gave up."""
    v, missing = _arrived(src, offs, mask, epoch)
    if missing > 0:
        code = shmem.read_uniform(ctx.status + shmem.CODE, "relaxed")
        start = shmem.now_ns()
        elapsed = tl.zeros([], tl.int64)
        while (missing > 0) & (code == 0) & (elapsed <= ctx.budget):
            polls = 0
            while (missing > 0) & (polls < POLLS_PER_CHECK):
                v, missing = _arrived(src, offs, mask, epoch)
                polls += 1
            code = shmem.read_uniform(ctx.status + shmem.CODE, "relaxed")
            elapsed = shmem.program_max(shmem.now_ns() - start)
        if missing > 0:
            if code == 0:
                tags = (v >> 32).to(tl.int32)
                first = tl.min(tl.where((tags != epoch) & mask, offs, 2147483647), axis=0)
                seen = tl.max(tl.where(offs == first, tags, -2147483647), axis=0)
                shmem.give_up(src + first, epoch, seen, ctx)
            else:
                tl.store(ctx.mirror, code)
    return v, missing == 0


@triton.jit
def _float(bits, FP16: tl.constexpr):
    """int16 bits as float32: of float16 where FP16, else of bfloat16."""
    if FP16:
        return bits.to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return bits.to(tl.bfloat16, bitcast=True).to(tl.float32)


@triton.jit
def _bits(value, FP16: tl.constexpr):
    """float32 rounded to float16 (FP16) or bfloat16, as int32 holding its 16 bits (high half zero)."""
    if FP16:
        b = value.to(tl.float16).to(tl.int16, bitcast=True)
    else:
        b = value.to(tl.bfloat16).to(tl.int16, bitcast=True)
    return b.to(tl.int32) & 0xFFFF


@triton.jit
def _halves(w, FP16: tl.constexpr):
    """The two 16-bit elements of the int32 words `w` (low, high) as float32."""
    return _float((w & 0xFFFF).to(tl.int16), FP16), _float(((w >> 16) & 0xFFFF).to(tl.int16), FP16)


@triton.jit
def _pack(lo, hi, FP16: tl.constexpr):
    """int32 words of two float32 sums rounded to the 16-bit dtype (low half first)."""
    return _bits(lo, FP16) | (_bits(hi, FP16) << 16)


@triton.jit
def ll_all_reduce_kernel(x, out, inbox, ctx, flags, half_flags, inbox_half, capacity, words, piece, nan_word,
                         PAIRS: tl.constexpr, FP16: tl.constexpr, BLOCK: tl.constexpr):
    """out = the sum over ranks of x, every rank bitwise the same (see the module docstring).

    x, out: int32 views of the partial and the result (`words` each; out may be x). inbox: int64, slot
    q = words [q * words, (q + 1) * words) of the parity half (`inbox_half` words apart; `capacity`
    words per half are zeroed at the start of a life). flags: int32, parity halves `half_flags` apart,
    flag (src, program) at src * P + program (epoch 1 only). PAIRS: a word holds two 16-bit elements
    (float16 where FP16, else bfloat16), else one float32. nan_word: the word a failed call leaves (NaN in every element).

    grid = (P,)
    """
    k = tl.program_id(0)
    nprog = tl.num_programs(0)
    me = ctx.rank
    world = ctx.world
    epoch, healthy = shmem.epoch_begin(ctx)
    box = inbox + shmem.parity(epoch) * inbox_half
    lo = tl.minimum(k * piece, words)
    hi = tl.minimum(lo + piece, words)
    offs0 = tl.arange(0, BLOCK)
    if epoch <= 2:  # a new life: zero the half that peers write next, before they can (module doc)
        share = tl.cdiv(capacity, nprog)
        other = inbox + (1 - shmem.parity(epoch)) * inbox_half
        _zero(other, tl.minimum(k * share, capacity), tl.minimum((k + 1) * share, capacity), BLOCK)
        tl.debug_barrier()
        _fence_sys()
    if healthy:
        tag = epoch.to(tl.int64) << 32
        for s in range(lo, hi, BLOCK):
            offs = s + offs0
            mask = offs < hi
            tagged = tag | tl.load(x + offs, mask=mask).to(tl.uint32, bitcast=True).to(tl.int64)
            for i in range(1, world):
                q = (me + i) % world
                tl.store(shmem.translate(box + me * words + offs, me, q, ctx.heap_bases), tagged, mask=mask)
    ok = healthy
    if epoch == 1:  # the inbox may hold words of an earlier life: trust a released flag first
        mine = flags + shmem.parity(epoch) * half_flags + k
        if healthy:
            for i in range(1, world):
                shmem.signal(mine + me * nprog, epoch, me, (me + i) % world, ctx.heap_bases)
        for i in range(1, world):
            if ok:
                ok = ok & shmem.wait_until(mine + ((me + world - i) % world) * nprog, epoch, ctx)
    for s in range(lo, hi, BLOCK):
        offs = s + offs0
        mask = offs < hi
        acc_lo = tl.zeros([BLOCK], tl.float32)
        acc_hi = tl.zeros([BLOCK], tl.float32)
        for q in range(world):
            if ok:
                if q == me:
                    w = tl.load(x + offs, mask=mask)
                else:
                    v, got = _receive(box + q * words, offs, mask, epoch, ctx)
                    ok = ok & got
                    w = v.to(tl.int32)  # the payload: the low half
                if PAIRS:
                    a, b = _halves(w, FP16)
                    acc_lo += a
                    acc_hi += b
                else:
                    acc_lo += w.to(tl.float32, bitcast=True)
        if ok:
            if PAIRS:
                result = _pack(acc_lo, acc_hi, FP16)
            else:
                result = acc_lo.to(tl.int32, bitcast=True)
            tl.store(out + offs, result, mask=mask)
        else:
            tl.store(out + offs, tl.zeros([BLOCK], tl.int32) + nan_word, mask=mask)
    shmem.epoch_end(ctx, nprog)
