"""All-reduce latency by message size: NCCL, torch's symmetric-memory one-shot / two-shot, autofuse's flag
protocol (collectives.all_reduce one_shot / two_shot) and its low-latency data-as-flag form (comm/lowlatency),
each heap form at several configs (the best is kept). Graph mode (CUDA-graph replay) by default, one rank per
GPU, bf16, median per call, rank-max (autofuse.measure.timing.time_fn). Every heap result is checked against
NCCL's before it is timed. Issue 40: where the all-reduce of gemm_ar's decode sizes loses to torch's.

    python3 scripts/ar_latency_gpu.py --world 2 --out autofuse-out/ar-latency.json
    python3 scripts/ar_latency_gpu.py --cpu --sizes 4K        # a smoke run under the interpreter
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.distributed as dist

from autofuse.comm.world import spawn

SIZES = ("4K", "16K", "48K", "128K", "512K", "2M", "4M")


def _bytes(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1].upper(), 1)
    return int(text.rstrip("KkMm")) * mult


def _configs(cuda: bool) -> dict[str, list[dict]]:
    if not cuda:
        return {"one_shot": [{"ALGO": "one_shot", "COMM_SMS": 2, "BLOCK": 1024}],
                "ll": [{"COMM_SMS": 2, "BLOCK": 256}]}
    return {"one_shot": [{"ALGO": "one_shot", "COMM_SMS": s, "BLOCK": b, "num_warps": w}
                         for s in (4, 8, 16, 32) for b, w in ((2048, 4), (4096, 8))],
            "two_shot": [{"ALGO": "two_shot", "COMM_SMS": s, "BLOCK": 4096, "num_warps": 8} for s in (8, 32)],
            "ll": [{"COMM_SMS": s, "BLOCK": b, "num_warps": w} for s in (4, 8, 16, 32, 64)
                   for b in (256, 512, 1024, 2048) for w in (4, 8)]}


def _job(world, sizes: list[int], mode: str, reps: int) -> list[dict]:
    from autofuse.comm import collectives, lowlatency
    from autofuse.measure.timing import time_fn

    cuda = world.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    rows_out = []
    for nbytes in sizes:
        cols = min(8192, nbytes // dtype.itemsize)
        rows = max(1, nbytes // dtype.itemsize // cols)
        g = torch.Generator().manual_seed(7 + world.rank)
        x = torch.randn(rows, cols, generator=g).to(dtype).to(world.device)
        ref = x.clone()
        dist.all_reduce(ref, group=world.group)
        out = torch.empty_like(x)
        best: dict[str, tuple[float, dict]] = {}

        def keep(name, us, cfg, best=best):
            if not math.isnan(us) and (name not in best or us < best[name][0]):
                best[name] = (us, cfg)

        def nccl(x=x, out=out):
            out.copy_(x)
            dist.all_reduce(out, group=world.group)
        keep("nccl", time_fn(world, nccl, mode, reps=reps).median_us, {})
        if cuda:
            import torch.distributed._symmetric_memory as symm

            from autofuse.comm.heap import torch_symm_group

            name = torch_symm_group(world)
            buf = symm.empty(x.shape, dtype=dtype, device=world.device)
            symm.rendezvous(buf, name)
            buf.copy_(x)

            def one(buf=buf, name=name, out=out):
                torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", name, out)

            def two(buf=buf, name=name):
                torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name)
            keep("torch_one_shot", time_fn(world, one, mode, reps=reps).median_us, {})
            keep("torch_two_shot", time_fn(world, two, mode, reps=reps).median_us, {})
        for impl, configs in _configs(cuda).items():
            for cfg in configs:
                if impl == "ll":
                    if lowlatency.check(world, rows, cols, dtype, cfg):
                        continue
                    coll = lowlatency.all_reduce(world, rows, cols, dtype, cfg, name="bench.ll")
                else:
                    if collectives.check("all_reduce", world, rows, cols, dtype, cfg):
                        continue
                    coll = collectives.all_reduce(world, rows, cols, dtype, cfg, name="bench.flag")
                y = coll(x, out=out)
                coll.check()
                err = float((y.double() - ref.double()).abs().max())
                bad = world.rank_max(0.0 if err <= 0.05 * max(1.0, float(ref.abs().max())) else 1.0)
                if bad:
                    if world.rank == 0:
                        print(f"{impl} {cfg}: wrong (max error {err:.3g})", flush=True)
                    continue
                keep(impl, time_fn(world, lambda c=coll, x=x, out=out: c(x, out=out), mode, reps=reps).median_us, cfg)
        row = {"bytes": rows * cols * dtype.itemsize, "rows": rows, "cols": cols, "mode": mode,
               "us": {k: v[0] for k, v in best.items()}, "config": {k: v[1] for k, v in best.items()}}
        rows_out.append(row)
        if world.rank == 0:
            print(json.dumps(row), flush=True)
    return rows_out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mode", default="graph", choices=("graph", "eager"))
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cpu", action="store_true", help="CPU ranks under the Triton interpreter (a smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = [_bytes(s) for s in args.sizes.split(",") if s]
    kind = "cpu" if args.cpu else "cuda"
    mode = "eager" if args.cpu else args.mode
    rows = spawn(_job, args.world, sizes, mode, args.reps, device_kind=kind, timeout_s=1200)[0]
    names = ["nccl", "torch_one_shot", "torch_two_shot", "one_shot", "two_shot", "ll"]
    print(f"\n{'bytes':>8} " + " ".join(f"{n:>14}" for n in names) + f" {'ll/torch1':>10}")
    for r in rows:
        us = r["us"]
        ratio = us.get("torch_one_shot", math.nan) / us["ll"] if "ll" in us else math.nan
        print(f"{r['bytes']:>8} " + " ".join(f"{us.get(n, math.nan):>14.2f}" for n in names) + f" {ratio:>10.3f}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"world": args.world, "mode": mode, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
