"""ag_gemm on operands of any K and N, as the backward formulas of ag_gemm and gemm_rs call it.

ag_gemm needs K and N on the 16-byte grid; a backward operand (a decode batch of one row, a shard
of 6 columns) may be off it. `ag_gemm_any` zero-pads A's columns and B's rows (per shard in the k
form) and B's columns to multiples of 16 bytes, calls the custom op (`torch.ops.autofuse.ag_gemm`,
or `ag_gemm_gathered` for the gathered A too) and cuts the results back: the same result, a valid
problem. Calls go through the custom ops by name, so this module imports no op module.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def gather_form(a: torch.Tensor, b: torch.Tensor) -> str:
    """ag_gemm's form from the shapes alone: B with as many rows as A has columns is the rows form."""
    return "rows" if b.shape[0] == a.shape[1] else "k"


def _padded(n: int, q: int) -> int:
    return -(-n // q) * q


def ag_gemm_any(a: torch.Tensor, b: torch.Tensor, group_name: str, gathered: bool = False) -> Any:
    """ag_gemm (and, with `gathered`, the gathered A too) on operands of any K and N (see the module doc)."""
    form = gather_form(a, b)
    q = 16 // a.element_size()
    c, n = a.shape[1], b.shape[1]
    cp, np_ = _padded(c, q), _padded(n, q)
    if cp != c:
        a = F.pad(a, (0, cp - c))
        if form == "rows":
            b = F.pad(b, (0, 0, 0, cp - c))
        else:
            w = b.shape[0] // c
            b = F.pad(b.reshape(w, c, n), (0, 0, 0, cp - c)).reshape(w * cp, n)
    if np_ != n:
        b = F.pad(b, (0, np_ - n))
    a = a.contiguous()
    b = b if b.is_contiguous() or b.t().is_contiguous() else b.contiguous()  # ag_gemm reads either layout of B
    if not gathered:
        out = torch.ops.autofuse.ag_gemm(a, b, group_name)
        return out if np_ == n else out[:, :n]
    out, full = torch.ops.autofuse.ag_gemm_gathered(a, b, group_name)
    if cp != c:
        full = full[:, :c] if form == "rows" else full.reshape(full.shape[0], -1, cp)[:, :, :c].flatten(1)
    return (out if np_ == n else out[:, :n]), full
