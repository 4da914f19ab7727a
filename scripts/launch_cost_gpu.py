"""Host time of one Triton launch through the JIT (`kernel[grid](...)`, what every runner does; `prepared`: the
GEMM core's own launch closure) beside torch.matmul's (cuBLAS) launch of the same GEMM: how much of a fused
runner's host cost is Triton's launch path.

Issued behind a sleep kernel so the host never waits on the device; medians over samples, the launch kinds
in turns. One GPU, one process:

    python3 scripts/launch_cost_gpu.py --out launch_cost.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch

from autofuse.core import gemm
from autofuse.kernels import gemm_core


def _host_us(fns: dict[str, Callable[[], Any]], calls: int, samples: int) -> dict[str, float]:
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(samples):
        for k, fn in fns.items():
            torch.cuda.synchronize()
            torch.cuda._sleep(int(5e8))
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out[k].append((time.perf_counter() - t0) * 1e6 / calls)
    torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for m, n, k in ((16, 8192, 8192), (2048, 5120, 8192)):
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        cfg = gemm.defaults(m, n, k, torch.bfloat16)[0]
        launch = gemm.prepare(a, b, cfg, out)
        launch()
        ref = a.float() @ b.float()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        cfg_obj = cfg if isinstance(cfg, gemm.GemmConfig) else gemm.GemmConfig.from_dict(cfg)
        grid = cfg_obj.grid(m, n, gemm.programs(dev))
        kwargs = {**cfg_obj.kernel_kwargs(), "B_T": gemm.b_transposed(b), "SCALE": 0}
        jit_args = (a, b, out, out, out, out, out, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                    out.stride(0), out.stride(1))
        row: dict[str, Any] = {"shape": f"{m}x{n}x{k}", "config": cfg_obj.to_dict(), "rel_err": err}
        fns: dict[str, Callable[[], Any]] = {
            "jit": lambda: gemm_core.gemm_kernel[grid](*jit_args, **kwargs),
            "prepared": launch,
            "cublas": lambda: torch.matmul(a, b, out=out),
        }
        row["host_us"] = _host_us(fns, args.calls, args.samples)
        rows.append(row)
    meta = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
            "triton": __import__("triton").__version__}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(meta)
    print(f"{'shape':>16} {'jit':>8} {'prepared':>9} {'cublas':>8}  rel. error")
    for r in rows:
        h = r["host_us"]
        print(f"{r['shape']:>16} {h['jit']:8.1f} {h['prepared']:9.1f} {h['cublas']:8.1f}  {r['rel_err']:.1e}")


if __name__ == "__main__":
    main()
