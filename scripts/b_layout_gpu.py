"""What B's memory layout costs each training GEMM (GPU machine): every ag_gemm / gemm_rs call of a
sequence-parallel Llama-3 training step (`autofuse.core.shapes.train_gemms`), with the variant and config the
policy picks for it and BSP, timed with B row-major (as the tuner times it) and column-major (b = w.t(), as
the backward formulas pass the weight), in turns, in graph mode.

The tuner measures every problem with a row-major B; the backward of a column-parallel layer hands gemm_rs
B^T and that of a row-parallel layer hands ag_gemm B^T, views of the stored weight. If a fused kernel reads a
column-major B much slower than a row-major one, the policy's pick for those calls is measured on the wrong
layout. Each column-major output is checked against the row-major one of the same runner (same values).

    python3 scripts/b_layout_gpu.py --world 2 --policy models/POLICY-graph.json --tokens 8192 --out b-layout.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings

from autofuse.comm.world import spawn
from autofuse.core import registry, shapes
from autofuse.core.op import Problem


def _steps(world, op, problem, runner, column_major: bool) -> tuple[list, list]:
    """(calls, outputs) over rotated input sets, B relaid out column-major when asked."""
    from autofuse.measure.timing import nbytes, rotation_count

    sets = rotation_count(nbytes(op.inputs(world, problem, 1))) if world.device.type == "cuda" else 1
    inputs = []
    for i in range(sets):
        a, b, *rest = op.inputs(world, problem, 1 + i)
        if column_major:
            b = b.t().contiguous().t()
        inputs.append((a, b, *rest))
    outs = [runner(*x) for x in inputs]
    return [lambda x=x, o=o: runner(*x, out=o) for x, o in zip(inputs, outs)], outs


def job(world, policy_path: str, tokens: list[int], models: list[str], mode: str, reps: int) -> list[dict]:
    import torch

    from autofuse.dispatch.policy import Policy
    from autofuse.measure.timing import build_checked, time_in_turns

    warnings.simplefilter("ignore")
    policy = Policy.load(policy_path)
    rows = []
    for model in models:
        for t in tokens:
            for g in shapes.train_gemms(shapes.MODELS[model], world.size, t):
                op = registry.get(g.op)
                problem = Problem.make(g.op, "bfloat16", world.size, **dict(g.dims))
                choice = policy.decide(problem, op)
                cands = [("bsp", {})] + ([(choice.variant, dict(choice.config))] if choice.variant != "bsp" else [])
                labels, steps, err = [], [], {}
                for v, c in cands:
                    runner = build_checked(world, op, problem, v, c)[0]
                    if runner is None:
                        continue
                    row_steps, row_outs = _steps(world, op, problem, runner, False)
                    col_steps, col_outs = _steps(world, op, problem, runner, True)
                    torch.cuda.synchronize() if world.device.type == "cuda" else None
                    err[v] = max(float(((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-9)))
                                 for x, y in zip(col_outs, row_outs))
                    labels += [(v, "row"), (v, "col")]
                    steps += [row_steps, col_steps]
                timings, _ = time_in_turns(world, steps, mode, reps=reps, warmup=3, rounds=reps)
                us = {f"{v} {lay}": tm.median_us for (v, lay), tm in zip(labels, timings)}
                row = {"model": model, "tokens": t, "op": g.op, "role": g.role, "problem": problem.key,
                       "pick": choice.variant, "config": dict(choice.config), "us": us, "col_vs_row_error": err}
                rows.append(row)
                if world.rank == 0:
                    print(f"{model} T={t} {g.role:18s} {g.op:8s} {choice.variant:16s} "
                          + "  ".join(f"{k} {v:8.1f}" for k, v in us.items())
                          + "  err " + " ".join(f"{k} {v:.1e}" for k, v in err.items()), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", default="8192")
    ap.add_argument("--models", default="llama3-70b,llama3-8b")
    ap.add_argument("--mode", default="graph")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.path.join("autofuse-out", "b-layout.json"))
    a = ap.parse_args()
    rows = spawn(job, a.world, os.path.abspath(a.policy), [int(t) for t in a.tokens.split(",")],
                 a.models.split(","), a.mode, a.reps, device_kind="cuda", timeout_s=1200)[0]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'model':11s} {'T':>5s} {'role':18s} {'pick':16s} {'pick row':>9s} {'pick col':>9s} {'bsp row':>8s} "
          f"{'bsp col':>8s}  col/row of the pick")
    for r in rows:
        u, p = r["us"], r["pick"]
        pr, pc = u.get(f"{p} row", math.nan), u.get(f"{p} col", math.nan)
        print(f"{r['model']:11s} {r['tokens']:5d} {r['role']:18s} {p:16s} {pr:9.1f} {pc:9.1f} {u.get('bsp row', math.nan):8.1f} "
              f"{u.get('bsp col', math.nan):8.1f}  {pc / pr:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
