"""MoE's heap all-to-all alone (kernels/moe.py, the `hybrid` variants' exchange) against NCCL's
all_to_all_single of the same rows, per model and token count, the best of a grid of configs
(autofuse/bench/moe_a2a.py, which `autofuse bench moe` runs at the configs dispatch picks), and where
the hybrid block's time goes (a kernel table of one dispatch + combine). Issue 41: the >= 150 GB/s per GPU target is for the
all-to-all alone (DeepSeek-V3-like: 4096 tokens, hidden 7168, top-8).

GB/s per GPU = the bytes of the token rows a rank receives from other ranks (dispatch; what it gets
back, combine) over the time of the all-to-all, rank-max of the time and of the bytes (DeepEP's
"NVLink receive bytes" convention; rows a rank routes to its own experts are not counted). NCCL is
timed with the splits known (the counts exchange the hybrid kernel also does is not in its time).
Graph mode by default (CUDA-graph replay), one rank per GPU, bf16, median per call.

    python3 scripts/moe_a2a_gpu.py --world 2 --out autofuse-out/moe-a2a.json
    python3 scripts/moe_a2a_gpu.py --cpu --models tiny --tokens 4     # a smoke run under the interpreter
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from autofuse.comm.world import spawn

MODELS = {"mixtral": (4096, 14336, 8, 2), "qwen3": (2048, 768, 128, 8), "deepseek": (7168, 2048, 256, 8),
          "tiny": (32, 16, 0, 2)}


def _configs(cuda: bool) -> list[dict]:
    if not cuda:
        return [{"COMM_SMS": 2, "BLOCK": 1024, "num_warps": 4}]
    return [{"COMM_SMS": s, "BLOCK": b, "num_warps": w} for s in (16, 32, 64, 128)
            for b, w in ((4096, 8), (8192, 8), (16384, 16))]


def _case(world, model: str, t: int, mode: str, reps: int, profile: bool) -> dict:
    from autofuse.bench import moe_a2a
    from autofuse.bench.bench_moe import routing

    cuda = world.device.type == "cuda"
    dev, dt = world.device, (torch.bfloat16 if cuda else torch.float32)
    h, f, e, k = MODELS[model]
    e = e or 2 * world.size
    gen = torch.Generator().manual_seed(world.rank * 104729 + t)
    ids, weights = routing(t, e, k, world.size, 0, gen)
    x = torch.randn(t, h, generator=gen).to(dev, dt)
    ids, weights = ids.to(dev), weights.to(dev)
    w1 = torch.zeros(e // world.size, h, 2, f, dtype=dt, device=dev)  # only its shape is read
    row = {"model": model, "tokens": t, "H": h, "E": e, "k": k, "mode": mode,
           **moe_a2a.measure(world, x, ids, weights, w1, _configs(cuda), mode, reps)}
    if world.rank == 0:
        for cfg in row["wrong"]:
            print(f"{model} T={t} {cfg}: dispatch rows differ from NCCL's", flush=True)
    if profile and cuda:
        row["profile"] = _profile(world, x, ids, weights, model, t)
    return row


def _profile(world, x, ids, weights, model: str, t: int) -> str:
    """The kernels of 5 eager hybrid dispatch + combine calls (rank 0's view), by CUDA time, and the host's ops."""
    import autofuse

    h, f, e, _ = MODELS[model]
    local = e // world.size
    g = torch.Generator(device=world.device).manual_seed(3)
    w1 = torch.randn(local, h, 2, f, generator=g, device=world.device, dtype=x.dtype) / math.sqrt(h)
    w2 = torch.randn(local, f, h, generator=g, device=world.device, dtype=x.dtype) / math.sqrt(f)

    def block():
        hh, handle = autofuse.moe_dispatch(x, ids, weights, w1, group=world.group, variant="hybrid")
        return autofuse.moe_combine(hh, w2, handle, group=world.group, variant="hybrid")

    for _ in range(3):
        block()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            block()
        torch.cuda.synchronize()
    avg = prof.key_averages()
    return (avg.table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
            + avg.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


def _job(world, models: list[str], tokens: list[int], mode: str, reps: int, profile: list[str]) -> list[dict]:
    out = []
    for model in models:
        for t in tokens:
            row = _case(world, model, t, mode, reps, f"{model}:{t}" in profile)
            out.append(row)
            if world.rank == 0:
                text = row.pop("profile", None)
                print(json.dumps(row), flush=True)
                if text:
                    print(f"--- hybrid block kernels, {model} T={t}, 5 eager calls, rank 0\n{text}", flush=True)
            if world.device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mode", default="graph", choices=("graph", "eager"))
    ap.add_argument("--models", default="mixtral,qwen3,deepseek")
    ap.add_argument("--tokens", default="256,4096")
    ap.add_argument("--profile", default="mixtral:4096,deepseek:4096", help="model:tokens cases to profile")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cpu", action="store_true", help="CPU ranks under the Triton interpreter (a smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kind = "cpu" if args.cpu else "cuda"
    mode = "eager" if args.cpu else args.mode
    models = [m for m in args.models.split(",") if m]
    tokens = [int(t) for t in args.tokens.split(",") if t]
    rows = spawn(_job, args.world, models, tokens, mode, args.reps, args.profile.split(","), device_kind=kind,
                 timeout_s=1500)[0]
    print(f"\n{'model':>9} {'T':>5} {'recv MB':>8} {'nccl us':>9} {'heap us':>9} {'nccl GB/s':>9} {'heap GB/s':>9}"
          f" {'comb us':>9} {'comb GB/s':>9}")
    for r in rows:
        us, gb = r["us"], r.get("GBps", {})
        print(f"{r['model']:>9} {r['tokens']:>5} {r['recv_bytes'] / 1e6:>8.1f} {us.get('nccl', math.nan):>9.1f} "
              f"{us.get('dispatch', math.nan):>9.1f} {gb.get('nccl', math.nan):>9.1f} {gb.get('dispatch', math.nan):>9.1f}"
              f" {us.get('combine', math.nan):>9.1f} {gb.get('combine', math.nan):>9.1f}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"world": args.world, "mode": mode, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
