"""Time fused variants at their first default and with the GEMM core's deeper tiles swapped in.

The core's own defaults took 6-stage and FP8 pointer-path tiles from a wide search (round 6, run g2:
FP8 pointer-path 128x128x128 on 8 warps at 6 stages, 128x256x128 at 4; bf16 128x128x64 at 6); the
fused kernels' defaults did not, since nothing had run those tiles inside them on a GPU. This runs
each probe row through autofuse.measure.timing.measure (build, check against the reference, time in
graph mode, check the replays' output again; eager on CPU) on one rank per GPU and prints per row the time and
its ratio to the variant's first default, so a tile enters the fused defaults only where it is right
and faster. A row `check` refuses is printed with the reason; a config that fails is a row, not the end.

    python3 scripts/fused_tile_probe.py [--world 2] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

FP8 = "float8_e4m3fn"
# (op, variant, dtype, dims): prefill-sized problems where the fused kernels run 128-row tiles
PROBLEMS = [
    ("gemm_rs", "push_last", FP8, {"M": 2048, "N": 8192, "K": 14336, "scaling": "tensorwise"}),
    ("ag_gemm", "push", FP8, {"M": 1024, "N": 3584, "K": 8192, "gather": "rows", "scaling": "tensorwise"}),
    ("gemm_rs", "push_last", "bfloat16", {"M": 2048, "N": 8192, "K": 14336}),
    ("ag_gemm", "push", "bfloat16", {"M": 1024, "N": 3584, "K": 8192, "gather": "rows"}),
]
# GEMM tiles to swap into the first default: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, TMA)
TILES = {FP8: [(128, 128, 128, 8, 6, False), (128, 256, 128, 8, 4, False)],
         "bfloat16": [(128, 128, 64, 8, 6, True), (128, 128, 64, 8, 6, False)]}


def tile_text(c: dict) -> str:
    return (f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}"
            + ("" if c.get("TMA", True) else " ptr") + (f" sk{c['SPLIT_K']}" if c.get("SPLIT_K", 1) > 1 else ""))


def probe(world, problems: list, reps: int, mode: str) -> list[dict]:
    from autofuse.core import registry
    from autofuse.core.op import Problem
    from autofuse.measure.timing import measure

    rows = []
    for op_name, vname, dtype, dims in problems:
        op = registry.get(op_name)
        problem = Problem.make(op_name, dtype, world.size, **dims)
        variant = op.variant(vname)
        first = variant.defaults(problem)[0]
        configs = [("first default", first)]
        for bm, bn, bk, w, s, tma in TILES[dtype]:
            configs.append(("swapped in", {**first, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w,
                                           "num_stages": s, "TMA": tma, "SPLIT_K": 1}))
        base = None
        for what, config in configs:
            row = {"problem": problem.key, "variant": vname, "what": what, "tile": tile_text(config), "config": config}
            why = variant.check(problem, config)
            if why is not None:
                row.update(ok=False, error=f"refused: {why}")
            else:
                m = measure(world, op, problem, vname, config, modes=(mode,), reps=reps)[0]
                row.update(ok=m.ok, error=m.error, us=m.median_us, rel_error=m.rel_error)
                if what == "first default" and m.ok:
                    base = m.median_us
                if m.ok and base:
                    row["vs_first"] = m.median_us / base
            rows.append(row)
            if world.rank == 0:
                print(json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "fused-tile-probe.json"))
    ap.add_argument("--cpu", action="store_true", help="a smoke test of the script on CPU ranks (tiny problems)")
    args = ap.parse_args()
    from autofuse.comm.world import spawn

    problems = PROBLEMS
    if args.cpu:  # the interpreter: tiny problems, where check refuses the large tiles with its reason
        problems = [("gemm_rs", "push_last", "bfloat16", {"M": 32, "N": 32, "K": 64})]
    rows = spawn(probe, args.world, problems, args.reps, "eager" if args.cpu else "graph",
                 device_kind="cpu" if args.cpu else "cuda",
                 timeout_s=1800)[0]
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'problem':<70} {'variant':<10} {'tile':<22} {'us':>8} {'x first':>8}")
    for r in rows:
        cell = f"{r['us']:8.1f} {r.get('vs_first', float('nan')):8.2f}" if r.get("ok") else (r.get("error") or "")[:90]
        print(f"{r['problem']:<70} {r['variant']:<10} {r['tile']:<22} {cell}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
