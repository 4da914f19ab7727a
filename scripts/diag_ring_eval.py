"""Why mm_ring timed 499 us at confirmation and 665 us in the held-out evaluation (round 26, call 3).

Rebuilds the evaluation's conditions for one gemm_rs problem in one process of 2 GPU ranks and times
mm_ring's config in turns (autofuse.measure.timing.time_in_turns, graph mode) beside different sets of
candidates, before and after the dispatch entry built its own mm_ring runner on the same workspace, and
alone (time_fn). Candidates and configs come from an evaluation's JSON (`us_by_config` of the problem).

    python3 scripts/diag_ring_eval.py EVAL.json 'gemm_rs|K=14336,M=6144,N=4096|bfloat16|w2' --out diag.json
"""
from __future__ import annotations

import argparse
import json
import sys


def run(world, problem_key: str, cands: list[tuple[str, dict]], reps: int) -> list[dict]:
    import autofuse
    from autofuse.core import registry
    from autofuse.core.op import Problem
    from autofuse.measure.timing import build_checked, time_fn, time_in_turns, timing_steps

    op = registry.get("gemm_rs")
    problem = Problem.from_key(problem_key)
    rows = []
    runners = {}
    for v, c in cands:
        r, why, _ = build_checked(world, op, problem, v, c)
        if r is not None:
            runners[v] = (r, timing_steps(world, op, problem, r, seed=1)[0])
    ring = [v for v in runners if v == "mm_ring"]

    def turns(label: str, names: list[str]) -> None:
        t, _ = time_in_turns(world, [runners[n][1] for n in names], "graph", reps=reps, warmup=3, rounds=reps)
        rows.append({"label": label, "us": {n: x.median_us for n, x in zip(names, t)}})

    def alone(label: str) -> None:
        for n in ring:
            rows.append({"label": label, "us": {n: time_fn(world, runners[n][1], "graph", reps=20).median_us}})

    alone("mm_ring alone (time_fn), first")
    turns("in turns: bsp, mm_ring", ["bsp", *ring])
    turns("in turns: every candidate (as the evaluation)", list(runners))
    turns("in turns: every candidate but push_reducer", [n for n in runners if n != "push_reducer"])
    turns("in turns: bsp, torch_symm, push_last, mm_ring", [n for n in ("bsp", "torch_symm", "push_last", *ring)
                                                           if n in runners])
    inputs = op.inputs(world, problem, 3)
    autofuse.gemm_rs(*inputs, group=world, variant="mm_ring", config=dict(cands[[v for v, _ in cands].index("mm_ring")][1]))
    world.sync()
    alone("mm_ring alone, after the dispatch entry built its own runner")
    turns("in turns: every candidate, after the dispatch entry's runner", list(runners))
    alone("mm_ring alone (time_fn), last")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("eval_json")
    ap.add_argument("problem")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="diag-ring-eval.json")
    args = ap.parse_args()
    rows = json.load(open(args.eval_json))["rows"]
    row = next(r for r in rows if r["problem"] == args.problem)
    cands = []
    for key in row["us_by_config"]:
        v, _, c = key.partition(" ")
        cands.append((v, json.loads(c)))
    from autofuse.comm.world import spawn

    result = spawn(run, 2, args.problem, cands, args.reps, device_kind="cuda", timeout_s=400)[0]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in result:
        print(f"{r['label']:62} " + ", ".join(f"{n} {us:.1f}" for n, us in r["us"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
