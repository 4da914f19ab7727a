"""Dispatch quality on problems NOT used in fitting (run on the GPU machine after `autofuse fit`).

For each held-out problem (M, N, K or batch/KV values between and beyond the tuned ones), every
variant is measured at the config the policy would give it (`Policy.config_for`: the config tuned on
the nearest problem), and the policy's own pick is measured too. The oracle is the fastest measured
candidate. Reports, per op and overall: the share of calls within 5% of the oracle, the geomean of
pick / oracle and of pick / BSP, the worst pick / BSP, and the decision kinds. Prints a table and
writes JSON. Usage:

    python3 scripts/eval_dispatch_gpu.py --policy models/X.json --mode graph --out eval.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

from autofuse import registry
from autofuse.measure import measure
from autofuse.op import Problem, config_key
from autofuse.policy import Policy
from autofuse.world import spawn


def held_out(op: str, world: int) -> list[Problem]:
    """Problems between and beyond the tuned sweep (the gpu sweeps of each op)."""
    bf = "bfloat16"
    if op == "ag_gemm":
        ms = [24, 96, 384, 768, 1536, 3072, 6144, 12288, 24576]
        ps = [Problem.make(op, bf, world, M=m, N=3584, K=8192, gather="rows") for m in ms]
        ps += [Problem.make(op, bf, world, M=m, N=5120, K=8192, gather="rows") for m in (64, 512, 2048)]
        return ps + [Problem.make(op, bf, world, M=m, N=2048, K=4096, gather="rows") for m in (256, 4096)]
    if op in ("gemm_rs", "gemm_ar"):
        ps = [Problem.make(op, bf, world, M=m, N=8192, K=14336) for m in (192, 768, 3072, 12288)]
        return ps + [Problem.make(op, bf, world, M=m, N=4096, K=8192) for m in (384, 1536, 6144)]
    if op == "flash_decode":
        return [Problem.make(op, bf, world, B=b, Hq=64, Hkv=8, D=128, S=s)
                for b, s in ((2, 2048), (12, 8192), (24, 32768), (2, 131072), (12, 512))]
    return []


def job(world, policy_path: str, ops: list[str], mode: str, reps: int, dry_run: bool) -> dict:
    policy = Policy.load(policy_path)
    out = []
    for name in ops:
        op = registry.get(name)
        avail = [v for v in op.variants if op.variants[v].available(world)]
        problems = op.sweep("cpu", world.size)[:2] if dry_run else held_out(name, world.size)
        for problem in problems:
            t0 = time.perf_counter()
            us: dict[str, float] = {}
            configs: dict[str, str] = {}
            for v in avail:
                config, _ = policy.config_for(problem, v, op)
                if config is None:
                    continue
                m = [x for x in measure(world, op, problem, v, config, modes=(mode,), reps=reps) if x.mode == mode][0]
                if m.ok:
                    us[v] = m.median_us
                    configs[v] = config_key(config)
            d = policy.decide(problem, op, avail)
            pick_us = us.get(d.variant) if configs.get(d.variant) == config_key(d.config) else None
            if pick_us is None:
                m = [x for x in measure(world, op, problem, d.variant, d.config, modes=(mode,), reps=reps)
                     if x.mode == mode][0]
                pick_us = m.median_us if m.ok else math.inf
            out.append({"problem": problem.key, "op": name, "us": us, "pick": d.variant, "kind": d.kind,
                        "reason": d.reason, "pick_us": pick_us, "seconds": time.perf_counter() - t0})
            if world.rank == 0:
                print(f"{problem.key}: pick {d.variant} ({d.kind}) {pick_us:.1f} us; "
                      + ", ".join(f"{v} {t:.1f}" for v, t in sorted(us.items())), flush=True)
    return {"rows": out, "policy": policy_path, "mode": mode, "refused": policy.refused}


def summarize(rows: list[dict]) -> dict:
    ratios, vs_bsp, within = [], [], 0
    for r in rows:
        oracle = min(list(r["us"].values()) + [r["pick_us"]])
        ratios.append(r["pick_us"] / oracle)
        within += r["pick_us"] <= 1.05 * oracle
        if "bsp" in r["us"]:
            vs_bsp.append(r["pick_us"] / r["us"]["bsp"])
    g = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan  # noqa: E731
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    return {"calls": len(rows), "within_5pct": within / max(1, len(rows)), "geomean_vs_oracle": g(ratios),
            "geomean_vs_bsp": g(vs_bsp), "worst_vs_bsp": max(vs_bsp) if vs_bsp else math.nan, "kinds": kinds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", required=True)
    ap.add_argument("--ops", default="ag_gemm,gemm_rs,gemm_ar,flash_decode")
    ap.add_argument("--mode", default="graph")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--out", default="eval_dispatch.json")
    ap.add_argument("--cpu", action="store_true", help="dry run of the code path on CPU ranks (tuned problems)")
    a = ap.parse_args()
    ops = [o for o in a.ops.split(",") if o]
    res = spawn(job, a.ranks, a.policy, ops, a.mode, a.reps, a.cpu, device_kind="cpu" if a.cpu else "cuda",
                timeout_s=1200)[0]
    res["summary"] = {"all": summarize(res["rows"])}
    for o in ops:
        rows = [r for r in res["rows"] if r["op"] == o]
        if rows:
            res["summary"][o] = summarize(rows)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nheld-out dispatch quality, {a.mode} mode, policy {a.policy}")
    print(f"{'op':14s} {'calls':>5s} {'within5%':>9s} {'geo/oracle':>10s} {'geo/bsp':>8s} {'worst/bsp':>9s}  kinds")
    for k, s in res["summary"].items():
        print(f"{k:14s} {s['calls']:5d} {s['within_5pct']:9.0%} {s['geomean_vs_oracle']:10.3f} "
              f"{s['geomean_vs_bsp']:8.3f} {s['worst_vs_bsp']:9.3f}  {s['kinds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
