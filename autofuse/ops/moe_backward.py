"""The MoE pair's backward, run as two torch custom ops (`autofuse::moe_dispatch_backward`,
`autofuse::moe_combine_backward`: the ops declare them as `Helper`s, autofuse/library registers them):
opaque nodes with static shapes, so torch.compile traces the backward graph while the real work
(host-read counts, all-to-alls, grouped GEMMs) runs on real tensors. Bulk-synchronous, like the ops'
`bsp` variant; not dispatched or tuned.

- dispatch's backward is combine-shaped: from dh, d pre-activation (SwiGLU recomputed from the kept
  rows), dw1 = rows^T d pre per expert, d rows = d pre w1^T, returned to the tokens' ranks and summed
  over each token's slots: dx.
- combine's backward is dispatch-shaped: each slot's row dy_t * w_tj goes to its expert's rank, then
  dh = d h2 w2^T, dw2 = h^T d h2 per expert; d w_tj = dy_t . (h w2)[row of slot (t, j)], the rows
  returned as in the forward.
"""
from __future__ import annotations

import torch

from autofuse.core.custom import Helper
from autofuse.ops import moe


def _per_expert_outer(a: torch.Tensor, g: torch.Tensor, counts: list[int], shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """[a_l^T @ g_l for each expert l] (rows grouped by expert), float32 accumulation."""
    out = torch.zeros(len(counts), a.shape[1], g.shape[1], dtype=torch.float32, device=a.device)
    start = 0
    for l, c in enumerate(counts):
        if c:
            out[l] = a[start:start + c].float().t() @ g[start:start + c].float()
        start += c
    return out.to(dtype).reshape(shape)


def dispatch_backward(dh: torch.Tensor, rows: torch.Tensor, w1: torch.Tensor, counts: torch.Tensor,
                      sent: torch.Tensor, order: torch.Tensor, index: torch.Tensor, tokens: int,
                      group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    world = moe.world_of_group(group_name)
    local, hidden = w1.shape[0], w1.shape[1]
    act = "swiglu" if w1.dim() == 4 else "none"
    per = counts.sum(0).tolist()
    n = sum(per)
    w1f = w1.reshape(local, hidden, -1)
    pre = moe.grouped_mm(rows, w1f, per)
    dpre = moe.act_backward(pre, dh[:n], act).to(rows.dtype)
    dw1 = _per_expert_outer(rows[:n], dpre, per, tuple(w1.shape), w1.dtype)
    drows = rows.new_zeros(rows.shape)
    drows[:n] = moe.grouped_mm(dpre, w1f.transpose(1, 2), per)
    back = moe.to_tokens(world, drows, sent, counts, index, "moe_dispatch backward")
    k = order.numel() // tokens
    dx = torch.zeros(tokens, hidden, dtype=torch.float32, device=rows.device)
    dx.index_add_(0, order // k, back.float())
    return dx.to(rows.dtype), dw1


def _dispatch_backward_fake(dh, rows, w1, counts, sent, order, index, tokens, group_name):
    return rows.new_empty(tokens, rows.shape[1]), torch.empty_like(w1)


def combine_backward(dy: torch.Tensor, h: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor, sent: torch.Tensor,
                     order: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                     group_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    world = moe.world_of_group(group_name)
    k = weights.shape[1]
    per = counts.sum(0).tolist()
    n = sum(per)
    slot_w = weights.reshape(-1)[order].float().unsqueeze(1)
    dback = (dy[order // k].float() * slot_w).to(h.dtype)
    dh2 = moe.to_experts(world, dback, sent, counts, index, h.shape[0], "moe_combine backward")
    dh = torch.zeros_like(h)
    dh[:n] = moe.grouped_mm(dh2, w2.transpose(1, 2), per)
    dw2 = _per_expert_outer(h[:n], dh2[:n], per, tuple(w2.shape), w2.dtype)
    h2 = h.new_zeros(h.shape[0], w2.shape[2])
    h2[:n] = moe.grouped_mm(h, w2, per)
    back = moe.to_tokens(world, h2, sent, counts, index, "moe_combine backward")
    dweights = torch.zeros(weights.numel(), dtype=torch.float32, device=h.device)
    dweights[order] = (dy[order // k].float() * back.float()).sum(1)
    return dh, dw2, dweights.view(weights.shape).to(weights.dtype)


def _combine_backward_fake(dy, h, w2, counts, sent, order, index, weights, group_name):
    return torch.empty_like(h), torch.empty_like(w2), torch.empty_like(weights)


DISPATCH_BACKWARD = Helper("moe_dispatch_backward", dispatch_backward, _dispatch_backward_fake)
COMBINE_BACKWARD = Helper("moe_combine_backward", combine_backward, _combine_backward_fake)


def dispatch_grads(dh, rows, w1, counts, sent, order, index, tokens, group_name):
    """(dx, dw1) through `autofuse::moe_dispatch_backward`."""
    return torch.ops.autofuse.moe_dispatch_backward(dh, rows, w1, counts, sent, order, index, tokens, group_name)


def combine_grads(dy, h, w2, counts, sent, order, index, weights, group_name):
    """(dh, dw2, dweights) through `autofuse::moe_combine_backward`."""
    return torch.ops.autofuse.moe_combine_backward(dy, h, w2, counts, sent, order, index, weights, group_name)
