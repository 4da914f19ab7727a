"""gemm_rs mm_ring timed alone (the tuner's timer) and in turns with BSP and torch's op (confirmation's timer).

Round 25's held-out evaluation timed mm_ring 1.3-2x slower than the tuned table's neighbours predicted;
this times the same candidates both ways on the same problems, graph and eager, to find which
condition makes it slow. GPU machine, 2 ranks; prints a table and writes JSON:

    python3 scripts/diag_ring_gpu.py --out diag-ring.json
"""
from __future__ import annotations

import argparse
import json
import sys

PROBLEMS = [("bfloat16", 8192, 4096, 14336), ("bfloat16", 6144, 4096, 14336), ("float16", 768, 4096, 4096),
            ("bfloat16", 768, 4096, 4096), ("bfloat16", 2048, 8192, 8192)]
CANDIDATES = [("bsp", {}), ("torch_symm", {}), ("mm_ring", {"CHUNKS": 1}), ("mm_ring", {"CHUNKS": 2}),
              ("mm_ring", {"CHUNKS": 4})]


def run(world, modes: list[str]) -> list[dict]:
    from autofuse.core import registry
    from autofuse.core.op import Problem
    from autofuse.measure.timing import build_checked, time_fn, time_in_turns

    op = registry.get("gemm_rs")
    rows = []
    for dtype, m, n, k in PROBLEMS:
        problem = Problem.make("gemm_rs", dtype, world.size, M=m, N=n, K=k)
        inputs = op.inputs(world, problem, 0)
        built = []
        for variant, config in CANDIDATES:
            runner, why, err = build_checked(world, op, problem, variant, config)
            if runner is None:
                rows.append({"problem": problem.key, "variant": variant, "config": config, "error": why})
                continue
            out = runner(*inputs)
            built.append((variant, config, lambda r=runner, o=out: r(*inputs, out=o)))
        for mode in modes:
            alone = [time_fn(world, fn, mode, reps=20).median_us for _, _, fn in built]
            turns, _ = time_in_turns(world, [fn for _, _, fn in built], mode, reps=12, rounds=3)
            for (variant, config, _), a, t in zip(built, alone, turns):
                rows.append({"problem": problem.key, "variant": variant, "config": config, "mode": mode,
                             "alone_us": a, "turns_us": t.median_us})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="diag-ring.json")
    ap.add_argument("--modes", default="graph,eager")
    args = ap.parse_args()
    from autofuse.comm.world import spawn

    rows = spawn(run, 2, args.modes.split(","), device_kind="cuda", timeout_s=500)[0]
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{'problem':44} {'variant':10} {'config':14} {'mode':5} {'alone us':>9} {'turns us':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['problem']:44} {r['variant']:10} {json.dumps(r['config']):14} {r['error'][:60]}")
        else:
            print(f"{r['problem']:44} {r['variant']:10} {json.dumps(r['config']):14} {r['mode']:5} "
                  f"{r['alone_us']:9.1f} {r['turns_us']:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
