"""Where the GEMM core's stream-K time goes (issue 29's misses), on one GPU, graph mode.

For partial-last-wave shapes (M x 5120 x K, bf16) it times the core at a fixed tile with and without
STREAM_K while changing only the persistent program count (`num_programs`: 80 programs run 80 tiles
as one data-parallel wave, 132 leave the last wave to stream-K) and K (the per-step cost is the slope
over K; what is left at K -> 0 is the per-launch and fixup cost), with cuBLAS on the same shapes.
A table (us, TFLOP/s) on stdout and a JSON with --out.

    python3 scripts/diag_stream_k.py --out diag_stream_k.json
"""
from __future__ import annotations

import argparse
import json

import torch

from autofuse.core import gemm
from autofuse.core.gemm import GemmConfig
from autofuse.bench.bench_gemm_core import time_cuda

TILES = {"128x256x64 w8 s3": GemmConfig(128, 256, 64, 8, 8, 3), "128x128x64 w8 s4": GemmConfig(128, 128, 64, 8, 8, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    sms = gemm.programs(torch.device("cuda"))
    rows = []
    for m, n in ((512, 5120), (256, 5120), (1024, 5120)):
        for k in (4096, 8192, 16384):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = a.float() @ b.float()
            flop = 2 * m * n * k
            runs = [("cublas", None, sms, lambda: torch.matmul(a, b, out=c))]
            for name, cfg in TILES.items():
                tiles = cfg.tiles(m, n)
                for programs in sorted({min(tiles, sms), 100, 120, sms}):
                    for sk in (False, True):
                        launch = gemm.prepare(a, b, cfg.replace(STREAM_K=sk), c, num_programs=programs)
                        runs.append((name + (" streamk" if sk else ""), cfg, programs, launch))
            for name, cfg, programs, fn in runs:
                fn()
                torch.cuda.synchronize()
                err = float((c.float() - ref).norm() / ref.norm())
                us = time_cuda(fn, "graph", args.reps)
                rows.append({"M": m, "N": n, "K": k, "config": name, "programs": programs, "us": us,
                             "tflops": flop / us / 1e6, "rel_err": err})
                print(f"{m:5} {n:5} {k:6} {name:26} {programs:4} {us:9.1f} us {flop / us / 1e6:7.1f} TFLOP/s "
                      f"err {err:.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "sms": sms, "mode": "graph", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
