"""Autograd of the custom ops: every backward GEMM that communicates is itself an autofuse op call.

Rank r's shards, W ranks, dC the gradient of this rank's output:
- ag_gemm, rows form, C = all_gather_rows(A) @ B_r:
  dA_r = reduce_scatter_rows(dC @ B_r^T) = gemm_rs(dC, B_r^T);
  dB_r = all_gather_rows(A)^T @ dC: from the gathered A kept by the forward (`ag_gemm_gathered`),
  or gathered again: concat_cols(A_s^T) @ dC = ag_gemm(A_r^T, dC) in the k form.
- ag_gemm, k form, C = concat_cols(A) @ B_r:
  dA_r = (sum_s B_s @ dC_s^T)[rows of block r]^T = gemm_rs(B_r, dC^T)^T;
  dB_r = concat_cols(A)^T @ dC: kept, or gathered again: ag_gemm(A_r^T, dC) in the rows form.
- gemm_rs, C_r = rows r of sum_q A_q @ B_q: with G = all_gather_rows(dC),
  dA_q = G @ B_q^T = ag_gemm(dC, B_q^T) and dB_q = A_q^T @ G: one ag_gemm_gathered call when both
  are needed (dC is gathered once), else ag_gemm(dC, B_q^T), or for dB alone
  ag_gemm(dC^T, A_q)^T in the k form.
- gemm_ar, C = sum_q A_q @ B_q on every rank: dA_q = dC @ B_q^T, dB_q = A_q^T @ dC, local GEMMs.
  The output is taken as replicated (Megatron's convention): every rank's dC must be the same,
  which it is when every rank computes the same loss from it.
- flash_decode is for inference: a call whose inputs require grad raises.
Each backward call is dispatched like any call (its own problem, policy, first-call agreement), so
it runs the tuned fused or hybrid variant for its shapes; `AUTOFUSE_VARIANT` forces it per op.
Operands of a backward ag_gemm whose K or N is not a multiple of 16 bytes (e.g. a decode batch of
one row) are zero-padded to the next multiple: the result is the same, the problem valid.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from autofuse.library import ops


def _padded(n: int, q: int) -> int:
    return -(-n // q) * q


def ag_gemm_any(a: torch.Tensor, b: torch.Tensor, group_name: str, gathered: bool = False) -> Any:
    """ag_gemm (and, with `gathered`, the gathered A too) on operands of any K and N: pads A's
    columns and B's rows (per shard in the k form) and B's columns with zeros to multiples of 16
    bytes, which ag_gemm needs, and cuts the results back."""
    form = ops.gather_form(a, b)
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
    a, b = a.contiguous(), b.contiguous()
    if not gathered:
        out = torch.ops.autofuse.ag_gemm(a, b, group_name)
        return out if np_ == n else out[:, :n]
    out, full = torch.ops.autofuse.ag_gemm_gathered(a, b, group_name)
    if cp != c:
        full = full[:, :c] if form == "rows" else full.reshape(full.shape[0], -1, cp)[:, :, :c].flatten(1)
    return (out if np_ == n else out[:, :n]), full


# -- ag_gemm --------------------------------------------------------------------------------------------
def _setup_ag_gemm(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: Any) -> None:
    a, b, group_name = inputs
    need_a, need_b = ctx.needs_input_grad[:2]
    ctx.group_name, ctx.form = group_name, ops.gather_form(a, b)
    ctx.save_for_backward(a if need_b else None, b if need_a else None)


def _grad_a_of_ag_gemm(ctx: Any, grad: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """dA of ag_gemm: gemm_rs(dC, B^T) in the rows form, gemm_rs(B, dC^T)^T in the k form."""
    if ctx.form == "rows":
        return torch.ops.autofuse.gemm_rs(grad, b.t(), ctx.group_name)
    return torch.ops.autofuse.gemm_rs(b, grad.t(), ctx.group_name).t()


def _backward_ag_gemm(ctx: Any, grad: torch.Tensor) -> tuple:
    a, b = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    grad = grad.contiguous()
    da = _grad_a_of_ag_gemm(ctx, grad, b) if need_a else None
    db = ag_gemm_any(a.t().contiguous(), grad, ctx.group_name) if need_b else None  # the other form
    return da, db, None


def _setup_ag_gemm_gathered(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: Any) -> None:
    a, b, group_name = inputs
    need_a, need_b = ctx.needs_input_grad[:2]
    ctx.group_name, ctx.form = group_name, ops.gather_form(a, b)
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(b if need_a else None, output[1] if need_b else None)


def _backward_ag_gemm_gathered(ctx: Any, grad: torch.Tensor, _grad_gathered: Any) -> tuple:
    b, full = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    grad = grad.contiguous()
    da = _grad_a_of_ag_gemm(ctx, grad, b) if need_a else None
    db = full.t() @ grad if need_b else None
    return da, db, None


# -- gemm_rs, gemm_ar -----------------------------------------------------------------------------------
def _setup_row_parallel(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: Any) -> None:
    a, b, group_name = inputs
    need_a, need_b = ctx.needs_input_grad[:2]
    ctx.group_name = group_name
    ctx.save_for_backward(a if need_b else None, b if need_a else None)


def _backward_gemm_rs(ctx: Any, grad: torch.Tensor) -> tuple:
    a, b = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    grad = grad.contiguous()
    if need_a and need_b:
        da, full = ag_gemm_any(grad, b.t().contiguous(), ctx.group_name, gathered=True)
        return da, a.t() @ full, None
    if need_a:
        return ag_gemm_any(grad, b.t().contiguous(), ctx.group_name), None, None
    return None, ag_gemm_any(grad.t().contiguous(), a, ctx.group_name).t(), None


def _backward_gemm_ar(ctx: Any, grad: torch.Tensor) -> tuple:
    a, b = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    return (grad @ b.t() if need_a else None), (a.t() @ grad if need_b else None), None


# -- flash_decode ---------------------------------------------------------------------------------------
class InferenceOnly(RuntimeError):
    """An inference-only op was called on inputs that require grad."""


def refuse_grad(op: str, tensors: tuple) -> None:
    """Raise InferenceOnly, naming `op` and the inputs that require grad."""
    names = ", ".join(f"{n} {tuple(t.shape)}" for n, t in tensors if t.requires_grad)
    raise InferenceOnly(
        f"autofuse.{op} is inference only (it has no backward), but {names} require grad: call it under "
        "torch.no_grad() / torch.inference_mode(), or pass tensors that do not require grad (.detach()).")


def _setup_flash_decode(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: Any) -> None:
    refuse_grad("flash_decode", tuple(zip(("q", "k", "v"), inputs[:3])))


def _backward_flash_decode(ctx: Any, grad: torch.Tensor) -> tuple:
    raise InferenceOnly("autofuse.flash_decode has no backward")


def register() -> None:
    """Register every op's autograd formula (once, at import of autofuse.library)."""
    ops.ag_gemm.register_autograd(_backward_ag_gemm, setup_context=_setup_ag_gemm)
    ops.ag_gemm_gathered.register_autograd(_backward_ag_gemm_gathered, setup_context=_setup_ag_gemm_gathered)
    ops.gemm_rs.register_autograd(_backward_gemm_rs, setup_context=_setup_row_parallel)
    ops.gemm_ar.register_autograd(_backward_gemm_ar, setup_context=_setup_row_parallel)
    ops.flash_decode.register_autograd(_backward_flash_decode, setup_context=_setup_flash_decode)
