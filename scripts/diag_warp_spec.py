"""Map which warp-specialised GEMM core configs compute right on this GPU and Triton.

The wide searches of round 5 (one and two H100, Triton 3.6, docs/results/2026-11-26-round5) saw
128x64x64 and 128x128x64 at 4 warps and 5 stages with WARP_SPEC give non-finite outputs on every
shape (the bench's check caught them: "wrong result: rel error inf"), while the same tiles at 3-4
stages and 64x128x64 at 5 were right. This script runs each (tile, stages) with and without
WARP_SPEC on a few shapes against a float64 reference and reports, per row: the relative error,
the share of non-finite outputs, the share of output tiles with any wrong element, and which rows
inside a tile hold them (the second consumer warpgroup's rows, 64..127, point at the compiler's
partitioning). The same call twice tells whether it is deterministic. gemm.check's WARP_SPEC rule
comes from this table.

    python3 scripts/diag_warp_spec.py [--out FILE.json] [--shapes 256x3584x8192,128x128x4096]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from autofuse.core import gemm  # noqa: E402

TILES = [(128, 128, 64), (128, 64, 64), (64, 128, 64), (64, 64, 64), (128, 128, 32), (64, 128, 128),
         (128, 256, 64), (64, 256, 64)]
STAGES = [2, 3, 4, 5, 6]
SHAPES = [(256, 3584, 8192), (1024, 5120, 8192), (128, 128, 4096), (512, 512, 256)]


def parse(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]


def inspect(out: torch.Tensor, ref: torch.Tensor, bm: int, bn: int) -> dict:
    """Where `out` is wrong: relative error, non-finite share, wrong-tile share, wrong rows within a tile."""
    diff = (out.double() - ref).abs()
    tol = 2e-2 * ref.abs().max().item()
    bad = ~torch.isfinite(out) | (diff > tol)
    finite = torch.isfinite(out)
    err = (diff[finite].max().item() / ref.abs().max().item()) if finite.any() else math.inf
    if not bool(finite.all()):
        err = math.inf
    m, n = out.shape
    tiles = bad[: m // bm * bm, : n // bn * bn].reshape(m // bm, bm, n // bn, bn)
    bad_tiles = tiles.any(dim=3).any(dim=1).float().mean().item() if tiles.numel() else 0.0
    rows = bad.any(dim=1).nonzero().flatten()
    in_tile = sorted({int(r) % bm for r in rows.tolist()})
    span = f"{in_tile[0]}..{in_tile[-1]}" if in_tile else "-"
    return {"rel_err": err, "nonfinite": 1.0 - finite.float().mean().item(), "bad_tiles": bad_tiles,
            "rows_in_tile": span}


def configs() -> list[dict]:
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": 4, "num_stages": stages,
             "WARP_SPEC": ws} for bm, bn, bk in TILES for stages in STAGES for ws in (True, False)]


def precompile(shapes: list[tuple[int, int, int]], dev: torch.device, workers: int = 12) -> None:
    """Compile every config in parallel processes first (the bench's worker; Triton's disk cache)."""
    import concurrent.futures
    import multiprocessing

    from autofuse.bench.bench_gemm_core import _compile_some

    smallest = min(shapes, key=lambda s: s[0] * s[1] * s[2])
    items = [(c, smallest) for c in configs() if gemm.check(c, *smallest, "bfloat16", stream_k=True) is None]
    jobs = [("bf16", str(dev), items[i::workers]) for i in range(workers) if items[i::workers]]
    with concurrent.futures.ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = [line for lines in pool.map(_compile_some, jobs) for line in lines]
    print(f"compiled {len(items)} configs; {len(failed)} failed: {failed[:4]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "diag-warp-spec.json"))
    ap.add_argument("--shapes", default=None, help="MxNxK,... (default: %s)" % SHAPES)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (Triton's interpreter: a smoke test of the script)")
    args = ap.parse_args()
    shapes = parse(args.shapes) if args.shapes else SHAPES
    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device(args.device)
    precompile(shapes, dev)
    torch.manual_seed(0)
    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        ref = a.double() @ b.double()
        for cfg in configs():
            bm, bn, stages, ws = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"], cfg["WARP_SPEC"]
            row = {"M": m, "N": n, "K": k, "tile": f"{bm}x{bn}x{cfg['BLOCK_K']}", "stages": stages, "ws": ws}
            why = gemm.check(cfg, m, n, k, "bfloat16", stream_k=True)
            if why is not None:
                row["result"] = f"rejected: {why}"
                rows.append(row)
                continue
            try:
                runs = []
                for _ in range(2):
                    out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
                    gemm.matmul(a, b, cfg, out=out)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    runs.append(inspect(out, ref, bm, bn))
                row.update(runs[0])
                row["same_twice"] = runs[0] == runs[1]
                row["result"] = "ok" if runs[0]["rel_err"] < 2e-2 and runs[1]["rel_err"] < 2e-2 else "WRONG"
            except Exception as exc:  # a compile failure is a row of the table, not the end of the run
                row["result"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
                   "triton": __import__("triton").__version__, "rows": rows}, f, indent=1)
    print(f"\n{'tile':>11} {'stages':>6}  WARP_SPEC result per shape ({', '.join('x'.join(map(str, s)) for s in shapes)})")
    for bm, bn, bk in TILES:
        for stages in STAGES:
            for ws in (True, False):
                cells = []
                for m, n, k in shapes:
                    r = next(r for r in rows if (r["M"], r["N"], r["K"]) == (m, n, k) and r["tile"] == f"{bm}x{bn}x{bk}"
                             and r["stages"] == stages and r["ws"] == ws)
                    res = r["result"]
                    cells.append("ok" if res == "ok" else
                                 f"WRONG({r['bad_tiles']:.2f} tiles, rows {r['rows_in_tile']}, nf {r['nonfinite']:.2f})"
                                 if res == "WRONG" else res.split(":")[0])
                print(f"{bm}x{bn}x{bk:>3} {stages:>6}  {'ws ' if ws else 'off'} " + " | ".join(cells))
    wrong_ws = [r for r in rows if r["result"] == "WRONG" and r["ws"]]
    wrong_plain = [r for r in rows if r["result"] == "WRONG" and not r["ws"]]
    print(f"\nwrong: {len(wrong_ws)} warp-specialised rows, {len(wrong_plain)} rows without WARP_SPEC")
    return 0


if __name__ == "__main__":
    sys.exit(main())
