"""How much first-use confirmation's timing moves from run to run, against the evaluation's timing (GPU machine).

Round 11's held-out evaluation (scripts/eval_dispatch_gpu.py) found confirmation's timings 20-25% off the
evaluation's on two 20-30 us problems (gemm_ar M=4 fp16: one_shot 18.4 us in confirmation, 23.2 in the
evaluation; bsp 21.9 / 22.0). For each problem here, on every rank in lockstep: `confirm` (dispatch's own,
autofuse/dispatch/confirm.py) `--runs` times at its defaults (6 batches in 3 rounds) and as many times with
`--reps` batches in as many rounds, then the evaluation's timing (each candidate on its own inputs and outputs,
in turns, one batch per round) as many times; prints each candidate's median per run and the spread. With
`--policy`, each problem is first called through the public entry point (dispatch with that policy,
confirmation on, a fresh online store): that first-use confirmation's timings are the row's `first_use`, and
the runs after it time the candidates it timed, at its configs. Usage:

    python3 scripts/confirm_noise_gpu.py --world 2 --mode graph --out autofuse-out/confirm-noise.json
    python3 scripts/confirm_noise_gpu.py --world 2 --policy models/POLICY-graph.json --out autofuse-out/first-use.json
    python3 scripts/confirm_noise_gpu.py --cpu --mode eager --runs 1 --reps 2   # a smoke run: tiny problems, CPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from autofuse.comm.world import spawn
from autofuse.core import registry
from autofuse.core.op import Problem

PROBLEMS = [  # (op, dtype, dims, candidates other than bsp): round 11's two misses
    ("gemm_ar", "float16", {"M": 4, "N": 4096, "K": 4096}, ["one_shot", "two_shot", "mm_heap"]),
    ("ag_gemm", "float16", {"M": 96, "N": 3072, "K": 4096, "gather": "rows"}, ["heap_mm", "push", "push_ws"]),
    ("gemm_ar", "bfloat16", {"M": 8, "N": 8192, "K": 8192}, ["one_shot", "mm_heap", "torch_symm_one_shot"]),
    ("gemm_ar", "float16", {"M": 192, "N": 8192, "K": 8192}, ["one_shot", "two_shot", "mm_heap"]),  # round 12's miss
]


SMALL = [  # --cpu: the same ops and candidates at sizes the interpreter runs in seconds
    ("gemm_ar", "float16", {"M": 4, "N": 32, "K": 64}, ["one_shot", "two_shot", "mm_heap"]),
    ("ag_gemm", "float16", {"M": 8, "N": 32, "K": 32, "gather": "rows"}, ["heap_mm", "push", "push_ws"]),
]


def _first_use(world, name: str, args: tuple) -> list[tuple[str, dict, float]]:
    """The confirmation the first call of `args` through `autofuse.<name>` made: [(variant, config, us)]."""
    import autofuse

    getattr(autofuse, name)(*args, group=world)
    conf = autofuse.explain(name, *args, group=world).confirmation
    return [] if conf is None else [(v, dict(c), t) for v, c, t in conf.timed]


def job(world, mode: str, runs: int, reps: int, small: bool, policy: str | None = None) -> list[dict]:
    from autofuse.dispatch.confirm import confirm
    from autofuse.measure.timing import build_checked, time_in_turns, timing_steps

    out = []
    for name, dtype, dims, variants in (SMALL if small else PROBLEMS):
        op = registry.get(name)
        problem = Problem.make(name, dtype, world.size, **dims)
        cands = [(v, op.variant(v).defaults(problem)[0]) for v in variants
                 if op.variant(v).available(world) and op.variant(v).defaults(problem)]
        args = op.inputs(world, problem, 3)
        row: dict = {"problem": problem.key, "confirm_default": [], "confirm_long": [], "eval": []}
        bsp_config: dict = {}
        if policy:
            first = _first_use(world, name, args)
            if first:
                row["first_use"] = [{v: t for v, _, t in first}]
                cands = [(v, c) for v, c, _ in first if v != "bsp"]
                bsp_config = next((c for v, c, _ in first if v == "bsp"), {})
        for _ in range(runs):
            c = confirm(world, op, problem, args, cands, mode, bsp_config=bsp_config, close=None)
            row["confirm_default"].append({v: t for v, _, t in c.timed})
        for _ in range(runs):
            c = confirm(world, op, problem, args, cands, mode, reps=reps, rounds=reps, budget_s=2.0,
                        bsp_config=bsp_config, close=None)
            row["confirm_long"].append({v: t for v, _, t in c.timed})
        runners = [build_checked(world, op, problem, v, cfg)[0] for v, cfg in [("bsp", bsp_config)] + cands]
        steps = [timing_steps(world, op, problem, r, seed=1)[0] for r in runners]
        for _ in range(runs):
            timings, _ = time_in_turns(world, steps, mode, reps=15, warmup=3, rounds=15)
            row["eval"].append({v: t.median_us for (v, _), t in zip([("bsp", bsp_config)] + cands, timings)})
        out.append(row)
        del runners, steps
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mode", default="graph")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--reps", type=int, default=24)
    ap.add_argument("--out", default="autofuse-out/confirm-noise.json")
    ap.add_argument("--cpu", action="store_true", help="CPU ranks (interpreter), tiny problems: a smoke run")
    ap.add_argument("--policy", default=None, help="a policy file: first call each problem through dispatch with it")
    a = ap.parse_args()
    if a.policy:
        import tempfile

        os.environ.update(AUTOFUSE_POLICY=os.path.abspath(a.policy), AUTOFUSE_ONLINE="1",
                          AUTOFUSE_ONLINE_DB=os.path.join(tempfile.mkdtemp(), "online.db"))
    os.environ.setdefault("AUTOFUSE_ONLINE", "0")
    rows = spawn(job, a.world, a.mode, a.runs, a.reps, a.cpu, a.policy, device_kind="cpu" if a.cpu else "cuda",
                 timeout_s=900)[0]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    for row in rows:
        print(row["problem"])
        for kind in [k for k in ("first_use", "confirm_default", "confirm_long", "eval") if row.get(k)]:
            names = list(row[kind][0])
            cells = []
            for v in names:
                xs = [r[v] for r in row[kind]]
                cells.append(f"{v} {statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]")
            wins = [min(r, key=r.get) for r in row[kind]]
            print(f"  {kind:16s} " + ", ".join(cells) + f"; fastest per run: {', '.join(wins)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
