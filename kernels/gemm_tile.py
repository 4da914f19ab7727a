"""One output tile of a tutorial-style Triton matmul, shared by the fused GEMM kernels.

`swizzle` maps a linear tile index to (pid_m, pid_n) in groups of GROUP_M tile rows, so programs
that run together reuse the same B columns from L2 (Triton's matmul tutorial). `matmul_tile`
returns one BLOCK_M x BLOCK_N tile of A @ B accumulated in float32; the caller decides where the
tile goes (a local output, a peer's inbox). Row and column indices wrap modulo the matrix size
(the tutorial's trick), so loads need no M/N masks and only the K tail is masked; rows and
columns past the edge hold garbage the caller must not store.

Triton's interpreter multiplies bfloat16 blocks as raw uint16 in `tl.dot` (seen on 3.9: garbage
results), so under TRITON_INTERPRET=1 bfloat16 operands are widened to float32 first: exact
products, the same float32 accumulation. Compiled kernels keep the bfloat16 tensor-core dot.
"""
import os

import triton
import triton.language as tl

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def swizzle(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Linear tile index -> (pid_m, pid_n), walking GROUP_M tile rows column by column."""
    num_in_group = GROUP_M * num_pid_n
    group = tile // num_in_group
    first_m = group * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % num_in_group) % group_m
    pid_n = (tile % num_in_group) // group_m
    return pid_m, pid_n


@triton.jit
def matmul_tile(a, b, row0, col0, rows, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """float32 tile of A[row0:row0+BLOCK_M] @ B[:, col0:col0+BLOCK_N] for A with `rows` rows.

    `a` points at row 0 of the (rows x K) block of A this tile belongs to; `row0` is relative to it.
    EVEN_K (K % BLOCK_K == 0) drops the K mask.
    """
    offs_m = (row0 + tl.arange(0, BLOCK_M)) % rows
    offs_n = (col0 + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(a_ptrs)
            y = tl.load(b_ptrs)
        else:
            x = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0)
            y = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
        if INTERPRETED:
            if x.dtype == tl.bfloat16:
                x = x.to(tl.float32)
                y = y.to(tl.float32)
        acc = tl.dot(x, y, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def tile_offsets(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row-major offsets of a BLOCK_M x BLOCK_N tile stored contiguously (tile-major inboxes)."""
    return tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
