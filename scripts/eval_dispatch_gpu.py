"""Dispatch quality on problems no tuning run measured, as a user gets it (GPU machine, after `autofuse fit`).

Held-out problems come from autofuse/core/shapes.py at sizes no sweep uses: M (or batch, KV length)
between and beyond the tuned ones, other models' N and K, fp16 beside bf16, the K-gather form.
For each, on every rank:
1. the first call through the public entry point (`autofuse.<op>`, policy from --policy, mode
   from --mode, confirm-on-first-use on unless --no-confirm): what dispatch chose, on which basis,
   and what the first call cost (seconds, confirmation and compiles included), and of it, where the
   decision was confirmed, the confirmation's build (candidates built and run once: Triton compiles
   and workspace allocation on a cold process) and timing seconds apart;
2. every available variant at the config the policy would give it (its nearest tuned config), and
   the choice itself: each checked against the float64 reference, then all timed in turns, batch
   by batch (`autofuse.measure.timing.time_in_turns`: a drift of the host, large in eager mode, is shared
   by every candidate instead of charged to whichever ran last), in `--repeat` independent runs (new
   graphs each; default 3), a candidate's time the median over them: one run moved a candidate by
   20-77% between runs (round 24) and put mm_ring in a state 28% slower than its others (round 26).
The oracle is the fastest measured candidate. Reported per op and overall: the share of calls
within 5% of the oracle, the geomean of choice / oracle and of choice / BSP, the worst choice / BSP,
the bases, and the first-call cost (median; with confirmation's build and timing medians). Prints a
table and writes JSON (per call also each candidate's time keyed "variant config" and each run's, and, where the
decision was confirmed, what the confirmation timed, keyed alike, which candidates its second pass took, and the
pick's time here over its confirmation's: the two timings side by side; a pick more than 10% away from its
confirmation's time is flagged in the printed line). Usage:

    python3 scripts/eval_dispatch_gpu.py --policy POLICY.json --mode graph --out eval.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

from autofuse.core import registry, shapes
from autofuse.core.op import Problem, config_key
from autofuse.comm.world import spawn

OPS = ("ag_gemm", "gemm_rs", "gemm_ar", "flash_decode")
DISAGREE = 0.10  # a pick timed this much away from its confirmation's time is flagged


def held_out(op: str, world: int) -> list[Problem]:
    """Problems no sweep of the op uses (the sweeps take powers of two and the models' exact sizes)."""
    bf, fp = "bfloat16", "float16"
    if op == "ag_gemm":
        col = shapes.gemms("column", world, ("llama3-8b", "qwen2.5-72b", "llama3-405b"))
        ps = [Problem.make(op, bf if i % 3 else fp, world, M=m * world, N=g.N, K=g.K, gather="rows")
              for i, (g, m) in enumerate(zip(col, (48, 768, 3072)))]
        return ps + [Problem.make(op, bf, world, M=384, N=4096, K=4096 * world, gather="k")]
    if op == "gemm_rs":
        row = shapes.gemms("row", world, ("llama3-8b", "qwen2.5-72b"))
        return [Problem.make(op, bf if i % 2 else fp, world, M=m * world, N=g.N, K=g.K)
                for i, (g, m) in enumerate(zip(row + row, (384, 3072)))]
    if op == "gemm_ar":
        row = shapes.gemms("row", world, ("llama3-8b", "qwen2.5-72b", "llama3-405b"))
        return [Problem.make(op, bf if i % 2 else fp, world, M=m, N=g.N, K=g.K)
                for i, (g, m) in enumerate(zip(row + row, (4, 24, 192)))]
    if op == "flash_decode":
        return [Problem.make(op, bf, world, B=b, Hq=hq, Hkv=hkv, D=128, S=s)
                for b, s, hq, hkv in ((2, 3072, 64, 8), (24, 12288, 128, 8))]
    return []


def _time_together(world, op, problem, cands: list[tuple[str, dict]], mode: str, reps: int) -> list[float]:
    """us per call of each (variant, config) in `cands` (inf where it cannot run or is wrong): each is
    built and checked against the float64 reference (autofuse.measure.timing.build_checked), then the
    correct ones are timed in turns, batch by batch (autofuse.measure.timing.time_in_turns), so that a drift
    of the host (large in eager mode) is shared by every candidate instead of charged to whichever
    ran last."""
    from autofuse.measure.timing import build_checked, time_in_turns, timing_steps

    runners = [build_checked(world, op, problem, v, c)[0] for v, c in cands]
    live = [r for r in runners if r is not None]
    if not live:
        return [math.inf] * len(cands)
    steps = [timing_steps(world, op, problem, r, seed=1)[0] for r in live]
    timings, _ = time_in_turns(world, steps, mode, reps=reps, warmup=3, rounds=reps)
    it = iter(timings)
    return [next(it).median_us if r is not None else math.inf for r in runners]


def _confirm_us(conf) -> dict | None:
    """What a confirmation timed, keyed "variant config" (None where the decision was not confirmed)."""
    return {f"{v} {config_key(c)}": t for v, c, t in conf.timed} if conf else None


def job(world, policy_path: str, ops: list[str], mode: str, reps: int, confirm: bool, cpu: bool,
        repeat: int = 1) -> dict:
    import autofuse
    from autofuse import dispatch
    from autofuse.dispatch.policy import Policy

    os.environ.update(AUTOFUSE_POLICY=policy_path, AUTOFUSE_MODE=mode, AUTOFUSE_ONLINE="1" if confirm else "0",
                      AUTOFUSE_ONLINE_DB=os.path.join(tempfile.gettempdir(), f"eval-online-{os.getppid()}.db"))
    dispatch.reset()
    policy = Policy.load(policy_path)
    out = []
    for name in ops:
        op = registry.get(name)
        entry = getattr(autofuse, name)
        avail = [v for v, var in op.variants.items() if var.available(world)]
        problems = op.sweep("cpu", world.size)[:1] if cpu else held_out(name, world.size)
        for problem in problems:
            inputs = op.inputs(world, problem, 3)
            world.sync()
            t0 = time.perf_counter()
            entry(*inputs, group=world)
            world.sync()
            first_s = time.perf_counter() - t0
            choice = autofuse.explain(name, *inputs, group=world)
            conf = choice.confirmation
            cands = [(v, config) for v in avail
                     for config in policy.configs_for(problem, v, op, n=1) or ([{}] if v == "bsp" else [])]
            keys = [(v, config_key(c)) for v, c in cands]
            if (choice.variant, config_key(choice.config)) not in keys:
                cands.append((choice.variant, dict(choice.config)))
                keys.append((choice.variant, config_key(choice.config)))
            runs = [_time_together(world, op, problem, cands, mode, reps) for _ in range(repeat)]
            times = [statistics.median(ts) if all(map(math.isfinite, ts)) else math.inf for ts in zip(*runs)]
            pick = times[keys.index((choice.variant, config_key(choice.config)))]
            us: dict[str, float] = {}
            for (v, _), t in zip(cands, times):
                if math.isfinite(t):
                    us[v] = min(us.get(v, math.inf), t)
            by_config = {f"{v} {k}": t for (v, k), t in zip(keys, times) if math.isfinite(t)}
            runs_by_config = {f"{v} {k}": list(ts) for (v, k), ts in zip(keys, zip(*runs))
                              if all(map(math.isfinite, ts))}
            conf_us = _confirm_us(conf)
            confirmed_us = conf_us.get(f"{choice.variant} {config_key(choice.config)}") if conf_us else None
            row = {"problem": problem.key, "op": name, "us": us, "us_by_config": by_config, "pick": choice.variant,
                   "basis": choice.basis,
                   "config": choice.config, "reason": choice.reason, "pick_us": pick, "first_call_s": first_s,
                   "confirm_s": conf.seconds if conf else None,
                   "confirm_build_s": conf.build_seconds if conf else None,
                   "confirm_timing_s": conf.timing_seconds if conf else None,
                   "confirm_us": conf_us, "confirm_again": list(conf.again) if conf else None,
                   "us_runs_by_config": runs_by_config,
                   "pick_vs_confirmed": pick / confirmed_us if confirmed_us else None}
            out.append(row)
            if world.rank == 0:
                cost = f" (build {conf.build_seconds:.2f} s, timing {conf.timing_seconds * 1e3:.0f} ms)" if conf else ""
                moved = (f"; DISAGREES: confirmation timed it {confirmed_us:.1f} us" if confirmed_us
                         and abs(pick / confirmed_us - 1) > DISAGREE else "")
                print(f"{problem.key}: {choice.variant} [{choice.basis}] {pick:.1f} us, first call {first_s:.2f} s"
                      f"{cost}; " + ", ".join(f"{v} {t:.1f}" for v, t in sorted(us.items(), key=lambda x: x[1]))
                      + moved, flush=True)
    return {"rows": out, "policy": policy_path, "mode": mode, "refused": policy.refused, "confirm": confirm}


def _median(xs: list[float]) -> float:
    """The median of `xs` (the upper one of an even count, as the first-call column always took); NaN if empty."""
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else math.nan


def summarize(rows: list[dict]) -> dict:
    ratios, vs_bsp, within = [], [], 0
    for r in rows:
        oracle = min(list(r["us"].values()) + [r["pick_us"]])
        ratios.append(r["pick_us"] / oracle)
        within += r["pick_us"] <= 1.05 * oracle
        if "bsp" in r["us"]:
            vs_bsp.append(r["pick_us"] / r["us"]["bsp"])
    g = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan  # noqa: E731
    bases: dict[str, int] = {}
    for r in rows:
        bases[r["basis"]] = bases.get(r["basis"], 0) + 1
    confirmed = [r for r in rows if r.get("confirm_s") is not None]
    return {"calls": len(rows), "within_5pct": within / max(1, len(rows)), "geomean_vs_oracle": g(ratios),
            "geomean_vs_bsp": g(vs_bsp), "worst_vs_bsp": max(vs_bsp) if vs_bsp else math.nan, "bases": bases,
            "first_call_median_s": _median([r["first_call_s"] for r in rows]),
            "confirm_build_median_s": _median([r["confirm_build_s"] for r in confirmed]),
            "confirm_timing_median_s": _median([r["confirm_timing_s"] for r in confirmed])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", required=True)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--mode", default="graph")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--repeat", type=int, default=3,
                    help="independent timing runs of the candidates per problem (new captures each); a candidate's "
                         "time is the median over them")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--no-confirm", action="store_true", help="dispatch on the policy's prediction alone")
    ap.add_argument("--out", default=os.path.join("autofuse-out", "eval_dispatch.json"))
    ap.add_argument("--cpu", action="store_true", help="dry run of the code path on CPU ranks (tiny problems)")
    a = ap.parse_args()
    ops = [o for o in a.ops.split(",") if o]
    if a.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {a.repeat}")
    res = spawn(job, a.world, os.path.abspath(a.policy), ops, a.mode, a.reps, not a.no_confirm, a.cpu, a.repeat,
                device_kind="cpu" if a.cpu else "cuda", timeout_s=1200)[0]
    res["repeat"] = a.repeat
    res["summary"] = {"all": summarize(res["rows"])}
    for o in ops:
        rows = [r for r in res["rows"] if r["op"] == o]
        if rows:
            res["summary"][o] = summarize(rows)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nheld-out dispatch quality, {a.mode} mode, confirm on first use {'on' if res['confirm'] else 'off'}, "
          f"policy {a.policy}")
    print(f"{'op':13s} {'calls':>5s} {'within5%':>8s} {'/oracle':>8s} {'/bsp':>6s} {'worst':>6s} {'1st s':>6s} "
          f"{'build s':>7s} {'time ms':>7s}  bases")
    for k, s in res["summary"].items():
        print(f"{k:13s} {s['calls']:5d} {s['within_5pct']:8.0%} {s['geomean_vs_oracle']:8.3f} "
              f"{s['geomean_vs_bsp']:6.3f} {s['worst_vs_bsp']:6.3f} {s['first_call_median_s']:6.2f} "
              f"{s['confirm_build_median_s']:7.2f} {s['confirm_timing_median_s'] * 1e3:7.1f}  {s['bases']}")
    print("1st s: first call (median); build s / time ms: of it, confirmation's build (compiles, workspaces) and "
          "timing (medians over the confirmed calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
