"""The row epilogues of MoE's `hybrid` variants: one pass each over the rows the all-to-all moved, with
the used row count read on the device (the host reads nothing, so a CUDA graph replays them).

- `act_rows_kernel` (dispatch): h = act(pre) on the used rows (SwiGLU: silu(gate) * up, gate the
  first half of pre's columns; or a copy), zero on the capacity rows beyond them (their `pre` is never
  read), NaN everywhere when the call's all-to-all failed. Before this kernel, the activation, the
  mask and the NaN fill were five passes of torch over all C = W * T * k capacity rows: at Mixtral
  T=4096 they cost more than the expert GEMM.
- `weighted_sum_kernel` (combine): out[t] = sum_j weights[t, j] * back[pos[t * k + j]] in float32,
  NaN when the call's all-to-all failed (one read of the returned rows instead of a float32 copy of
  them, a product and a sum).
- `settle_rows_kernel` (dispatch's `fused`, whose GEMM wrote the used rows of h itself): zero on the
  capacity rows beyond the used ones, NaN everywhere when the call failed; a block of used rows of a call
  that did not fail costs two loads.
"""
import triton
import triton.language as tl

SWIGLU = tl.constexpr(0)
COPY = tl.constexpr(1)


@triton.jit
def act_rows_kernel(pre, h, ends, last, fault, rows, width, ACT: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    """h (rows x width) from pre (rows x 2*width for SwiGLU, rows x width for COPY); the used rows are
    those below ends[last] (the group ends, on the device); fault: the call's fault (one bool).

    grid = (cdiv(rows, BLOCK_R), cdiv(width, BLOCK_C)): a program writes a BLOCK_R x BLOCK_C tile of h.
    """
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    used = tl.load(ends + last)
    failed = tl.load(fault) != 0
    r64 = r.to(tl.int64)[:, None]
    out_mask = (r < rows)[:, None] & (c < width)[None, :]
    live = out_mask & (r < used)[:, None]
    if ACT == SWIGLU:
        g = tl.load(pre + r64 * (2 * width) + c[None, :], mask=live, other=0.0).to(tl.float32)
        u = tl.load(pre + r64 * (2 * width) + width + c[None, :], mask=live, other=0.0).to(tl.float32)
        v = g * tl.sigmoid(g) * u
    else:
        v = tl.load(pre + r64 * width + c[None, :], mask=live, other=0.0).to(tl.float32)
    v = tl.where(live, v, 0.0)
    v = tl.where(failed, float("nan"), v)
    tl.store(h + r64 * width + c[None, :], v.to(h.dtype.element_ty), mask=out_mask)


@triton.jit
def weighted_sum_kernel(back, pos, weights, out, fault, tokens, width, TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    """out (tokens x width) = the top-k weighted sum of the returned rows `back` (row pos[s] holds slot
    s = t * TOPK + j); weights (tokens x TOPK) any float; fault: the call's fault (one bool).

    grid = (cdiv(tokens, BLOCK_T), cdiv(width, BLOCK_C)): a program sums BLOCK_T tokens' BLOCK_C columns.
    """
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    failed = tl.load(fault) != 0
    t_ok = t < tokens
    mask = t_ok[:, None] & (c < width)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(TOPK):
        slot = t.to(tl.int64) * TOPK + j
        row = tl.load(pos + slot, mask=t_ok, other=0).to(tl.int64)
        w = tl.load(weights + slot, mask=t_ok, other=0.0).to(tl.float32)
        v = tl.load(back + row[:, None] * width + c[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += w[:, None] * v
    acc = tl.where(failed, float("nan"), acc)
    tl.store(out + t.to(tl.int64)[:, None] * width + c[None, :], acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def settle_rows_kernel(h, ends, last, fault, rows, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """h (rows x width): rows at or beyond ends[last] (the used count, on the device) to zero, every row to
    NaN if `fault` (the call's, one bool); other rows untouched.

    grid = (cdiv(rows, BLOCK_R),): a program settles BLOCK_R rows, BLOCK_C columns a step.
    """
    r0 = tl.program_id(0) * BLOCK_R
    used = tl.load(ends + last)
    failed = tl.load(fault) != 0
    if failed | (r0 + BLOCK_R > used):
        r = r0 + tl.arange(0, BLOCK_R)
        r64 = r.to(tl.int64)[:, None]
        settle = (r < rows) & (((r >= used).to(tl.int32) + failed.to(tl.int32)) > 0)
        for c0 in range(0, width, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            v = tl.where(failed, float("nan"), tl.zeros([BLOCK_R, BLOCK_C], tl.float32))
            tl.store(h + r64 * width + c[None, :], v.to(h.dtype.element_ty),
                     mask=settle[:, None] & (c < width)[None, :])
