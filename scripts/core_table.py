"""Summarise `autofuse bench gemm_core` JSONs (--search defaults or wide): per shape the vendor's time, the best of the
defaults (what the ops try first), the best of the wide grid and its config; then the geomeans and the
configs that win most often. Usage: python3 scripts/core_table.py core-wide-bf16.json [core-wide-fp8.json ...]"""
from __future__ import annotations

import collections
import json
import math
import sys

from autofuse.bench import bench_gemm_core as bench


def main(paths: list[str]) -> None:
    for path in paths:
        doc = json.load(open(path))
        result = doc.get("result", doc)
        mode = "graph" if any(r["mode"] == "graph" for r in result["rows"]) else "eager"
        rows = [r for r in result["rows"] if r["mode"] == mode and r["core_us"]]
        print(f"\n{path}: {result.get('device', '')}, {result.get('dtype')}, {mode} mode, us")
        print(f"{'M':>6} {'N':>6} {'K':>6} {'vendor':>8} {'defaults':>9} {'wide':>8} {'x def':>6} {'x wide':>6}  best")
        wins: collections.Counter = collections.Counter()
        ratios = {"defaults": [], "wide": []}
        for r in rows:
            dtype = bench.DTYPES[result.get("dtype", "bf16")]
            base = {bench.config_text(c) for c in bench.candidates(r["M"], r["N"], r["K"], dtype)}
            times = [c["us"] for c in r["configs"] if c["us"] and c["config"] in base]
            best_def = min(times) if times else math.nan
            ratios["defaults"].append(best_def / r["cublas_us"])
            ratios["wide"].append(r["core_us"] / r["cublas_us"])
            wins[r["best_text"]] += 1
            print(f"{r['M']:>6} {r['N']:>6} {r['K']:>6} {r['cublas_us']:>8.1f} {best_def:>9.1f} {r['core_us']:>8.1f} "
                  f"{best_def / r['cublas_us']:>6.2f} {r['core_us'] / r['cublas_us']:>6.2f}  {r['best_text']}")
        for name, xs in ratios.items():
            for label, keep in (("M<=256", lambda r: r["M"] <= 256), ("M>=512", lambda r: r["M"] >= 512)):
                sel = [x for x, r in zip(xs, rows) if keep(r) and math.isfinite(x)]
                if sel:
                    within = sum(x <= bench.SHAPE_TARGETS[result.get("dtype", "bf16")] for x in sel)
                    print(f"  {name:8} {label}: geomean {math.exp(sum(map(math.log, sel)) / len(sel)):.3f} "
                          f"over {len(sel)} shapes, worst {max(sel):.2f}, {within} within "
                          f"{bench.SHAPE_TARGETS[result.get('dtype', 'bf16')]}x")
        print("  most frequent best configs: " + "; ".join(f"{t} x{n}" for t, n in wins.most_common(8)))


if __name__ == "__main__":
    main(sys.argv[1:])
