"""SwiGLU on a fused gate/up projection's output, forward and backward, one pass each.

`gu` holds rows of 2F values, the gate's F columns then the up projection's F (the output of a
column-parallel gate_up layer, `autofuse.nn.linear.fuse_columns`). Forward: out = silu(gate) * up.
Backward: the gradient of the whole row at once (d gate, d up side by side), so nothing joins the
two halves' gradients afterwards. Math in float32, one rounding to the output dtype.

  swiglu_fwd_kernel: grid (rows, cdiv(F, BLOCK)), one program per BLOCK columns of a row
  swiglu_bwd_kernel: the same grid
"""
import triton
import triton.language as tl


@triton.jit
def swiglu_fwd_kernel(gu, out, F, stride_gu, stride_out, BLOCK: tl.constexpr):
    """out[row, c] = silu(gu[row, c]) * gu[row, F + c]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    g = tl.load(gu + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu + row * stride_gu + F + cols, mask=ok, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(out + row * stride_out + cols, y.to(out.dtype.element_ty), mask=ok)


@triton.jit
def swiglu_bwd_kernel(gu, dy, dgu, F, stride_gu, stride_dy, stride_dgu, BLOCK: tl.constexpr):
    """dgu[row, c] = dy * up * silu'(gate), dgu[row, F + c] = dy * silu(gate), where
    silu'(g) = s (1 + g (1 - s)) with s = sigmoid(g)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    g = tl.load(gu + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu + row * stride_gu + F + cols, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(dy + row * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = d * u * s * (1.0 + g * (1.0 - s))
    du = d * g * s
    tl.store(dgu + row * stride_dgu + cols, dg.to(dgu.dtype.element_ty), mask=ok)
    tl.store(dgu + row * stride_dgu + F + cols, du.to(dgu.dtype.element_ty), mask=ok)
