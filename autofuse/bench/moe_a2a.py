"""MoE's heap all-to-all alone (kernels/moe.py, the `hybrid` variants' exchange) against NCCL's
all_to_all_single of the same rows: what `autofuse bench moe` reports as the all-to-all's bandwidth.

GB/s per GPU = bytes of the token rows a rank receives from other ranks (dispatch; combine: what it gets
back) over the call's time, rank-max of both (DeepEP's receive-bytes convention; rows a rank routes to its
own experts are not counted). NCCL runs with the splits known (the counts exchange the heap kernel also
does is not in its time). The heap kernel's received rows are checked equal to NCCL's before timing;
a config whose rows differ is reported as `wrong` and not timed.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from autofuse.comm.world import World


def measure(world: World, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
            configs: list[dict], mode: str, reps: int) -> dict[str, Any]:
    """Time NCCL and, per config, the heap dispatch and combine exchanges; the best of the configs.

    x (T x H), ids / weights (T x k), w1 (this rank's experts' first weights: only their shape is used).
    Returns {"recv_bytes", "back_bytes", "us": {nccl, dispatch, combine}, "config": {dispatch, combine},
    "GBps": {...}, "wrong": [configs whose rows differ from NCCL's]} (identical on every rank)."""
    from autofuse.core.op import Problem
    from autofuse.kernels import moe as kernels
    from autofuse.measure.timing import time_fn
    from autofuse.ops import moe, moe_hybrid

    dev = x.device
    d = moe.dispatch_problem(world.size, x, ids, weights, w1)
    c_problem = Problem.make(moe.COMBINE, d.dtype, d.world, **dict(d.dims))
    t, k, e, hid, cap, local = d["T"], d["k"], d["E"], d["H"], d["C"], moe.local_experts(d)
    order = torch.empty(t * k, dtype=torch.int64, device=dev)
    sent = torch.empty(e, dtype=torch.int64, device=dev)
    counts = torch.empty(world.size, local, dtype=torch.int64, device=dev)
    moe_hybrid.send_plan(ids, e, order, sent)

    per_owner = sent.view(world.size, local).sum(1)
    table = [torch.zeros_like(per_owner) for _ in range(world.size)]
    dist.all_gather(table, per_owner, group=world.group)
    in_splits = per_owner.tolist()
    out_splits = [int(table[s][world.rank]) for s in range(world.size)]
    send_rows = x[order // k].contiguous()
    recv = torch.empty(sum(out_splits), hid, dtype=x.dtype, device=dev)

    def nccl() -> None:
        dist.all_to_all_single(recv, send_rows, out_splits, in_splits, group=world.group)

    nccl()
    ref = recv.clone()
    row_bytes = hid * x.element_size()
    remote_in = sum(n for s, n in enumerate(out_splits) if s != world.rank) * row_bytes
    remote_back = sum(n for s, n in enumerate(in_splits) if s != world.rank) * row_bytes
    out: dict[str, Any] = {"recv_bytes": world.rank_max(float(remote_in)),
                           "back_bytes": world.rank_max(float(remote_back)),
                           "us": {"nccl": time_fn(world, nccl, mode, reps=reps).median_us}, "config": {}, "wrong": []}
    best: dict[str, tuple[float, dict]] = {}
    for cfg in configs:
        disp = moe_hybrid.Exchange(world, d, cfg, "bench.a2a.dispatch")
        comb = moe_hybrid.Exchange(world, c_problem, cfg, "bench.a2a.combine")

        def go_d(disp: Any = disp) -> None:
            disp(kernels.DISPATCH.value, x, sent, ids=ids, order=order, counts_out=counts)

        go_d()
        used = int(counts.sum())
        inv = moe_hybrid.inverse_index(moe_hybrid.group_index(counts, cap))
        if world.rank_max(0.0 if torch.equal(disp.dst[inv[:used]], ref) else 1.0):
            out["wrong"].append(dict(cfg))
            continue
        src = torch.randn(cap, hid, device=dev).to(x.dtype)

        def go_c(comb: Any = comb, src: torch.Tensor = src, inv: torch.Tensor = inv) -> None:
            comb(kernels.COMBINE.value, src, sent, inv=inv)

        for name, fn in (("dispatch", go_d), ("combine", go_c)):
            us = time_fn(world, fn, mode, reps=reps).median_us
            if not math.isnan(us) and (name not in best or us < best[name][0]):
                best[name] = (us, dict(cfg))
    for name, (us, cfg) in best.items():
        out["us"][name], out["config"][name] = us, cfg
    out["GBps"] = {n: (out["back_bytes"] if n == "combine" else out["recv_bytes"]) / us / 1e3
                   for n, us in out["us"].items() if us and not math.isnan(us)}
    return out
