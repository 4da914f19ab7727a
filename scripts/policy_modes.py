"""What a policy's picks cost when the calls are run rather than replayed, read from a shipped table (no GPU).

For each problem of a sweep (default `train`: the GEMMs of a sequence-parallel training step), the graph-mode
and the eager-mode policy's picks, and each pick's eager-mode time in the table beside BSP's: the time of the
pick's own config where the table holds it in eager mode, else the variant's fastest eager config (marked *).
It shows what deciding training calls on graph timings would cost a step whose calls run back to back, as
read from the measurements; it is not a run of the step.

    python scripts/policy_modes.py --db tuning_db/h200x2.db --graph models/...-graph.json \
        --eager models/...-eager.json --world 2 [--sweep train] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autofuse.core import registry, shapes  # noqa: E402
from autofuse.core.op import Problem, config_key  # noqa: E402
from autofuse.dispatch.policy import Policy  # noqa: E402
from autofuse.measure.store import Store  # noqa: E402

OPS = ("ag_gemm", "gemm_rs")


def eager_rows(store: Store, op: str, problem: str, hardware_id: str) -> dict:
    """{(variant, config key): us} of the table's fastest OK eager rows of `problem`."""
    out: dict = {}
    for r in store.best(op, "eager", hardware_id=hardware_id, problem=problem):
        k = (r["variant"], config_key(r["config"]))
        out[k] = min(out.get(k, math.inf), r["median_us"])
    return out


def eager_us(rows: dict, variant: str, config: dict) -> tuple[float, bool]:
    """(the pick's eager us, whether it is the variant's fastest config rather than the pick's own)."""
    own = rows.get((variant, config_key(config or {})))
    if own is not None:
        return own, False
    best = [us for (v, _), us in rows.items() if v == variant]
    return (min(best), True) if best else (math.nan, True)


def step_sums(rows: list[dict], world: int) -> list[dict]:
    """Per model and token count of the `train` sweep, one layer step's calls (`shapes.train_gemms`, the
    gathered input kept): the sums of BSP's and each policy's picks' eager times (NaN where one is missing)."""
    by_key = {r["problem"]: r for r in rows}
    out = []
    for model in shapes.TRAIN_MODELS:
        for t in shapes.TRAIN_TOKENS:
            calls = [Problem.make(g.op, "bfloat16", world, **dict(g.dims)).key
                     for g in shapes.train_gemms(shapes.MODELS[model], world, t)]
            got = [by_key.get(k) for k in calls]
            total = {m: sum(r[m]["eager_us"] if r else math.nan for r in got) for m in ("graph", "eager")}
            out.append({"model": model, "tokens": t, "calls": len(calls),
                        "bsp": sum(r["bsp_us"] if r else math.nan for r in got), **total})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--graph", required=True, help="the graph-mode policy JSON")
    ap.add_argument("--eager", required=True, help="the eager-mode policy JSON")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sweep", default="train")
    ap.add_argument("--json", help="also write the rows and totals here")
    a = ap.parse_args()
    policies = {m: Policy(json.loads(Path(p).read_text()), p) for m, p in (("graph", a.graph), ("eager", a.eager))}
    store = Store.open(a.db, readonly=True)
    hardware = [r[0] for r in store.conn.execute("select distinct hardware_id from measurements")]
    if len(hardware) != 1:
        raise SystemExit(f"{a.db}: rows of {len(hardware)} hardware ids; this reads one machine's table")
    rows_out, ratios = [], {"graph": [], "eager": []}
    print(f"{'problem':52s} {'bsp us':>8s} | {'graph pick':24s} {'us':>8s} {'x bsp':>6s} | {'eager pick':24s} "
          f"{'us':>8s} {'x bsp':>6s}")
    for name in OPS:
        op = registry.get(name)
        for p in op.sweep(a.sweep, a.world):
            rows = eager_rows(store, name, p.key, hardware[0])
            bsp = min((us for (v, _), us in rows.items() if v == "bsp"), default=math.nan)
            row: dict = {"problem": p.key, "bsp_us": bsp}
            cells = []
            for mode, pol in policies.items():
                c = pol.decide(p, op, list(op.variants))
                us, other = eager_us(rows, c.variant, c.config)
                row[mode] = {"variant": c.variant, "config": c.config, "eager_us": us, "variant_best": other,
                             "basis": c.basis}
                if math.isfinite(us) and math.isfinite(bsp):
                    ratios[mode].append(us / bsp)
                label = c.variant + (f" C={c.config['CHUNKS']}" if c.config and "CHUNKS" in c.config else "")
                cells.append(f"{label + ('*' if other else ''):24s} {us:8.1f} {us / bsp:6.2f}")
            rows_out.append(row)
            print(f"{p.key:52s} {bsp:8.1f} | " + " | ".join(cells))
    steps = step_sums(rows_out, a.world)
    print(f"\none layer's forward + backward (the gathered input kept), sum of its calls' eager times, us:")
    print(f"{'model':8s} {'T':>6s} {'calls':>5s} {'bsp':>9s} {'graph picks':>12s} {'eager picks':>12s}")
    for st in steps:
        print(f"{st['model']:8s} {st['tokens']:6d} {st['calls']:5d} {st['bsp']:9.0f} {st['graph']:12.0f} {st['eager']:12.0f}")
    totals = {m: {"problems": len(r), "geomean_x_bsp": math.exp(sum(map(math.log, r)) / len(r)) if r else None,
                  "max_x_bsp": max(r, default=None), "above_bsp": sum(x > 1.0 for x in r)} for m, r in ratios.items()}
    for m, t in totals.items():
        print(f"{m} policy's picks, eager time / BSP's: geomean {t['geomean_x_bsp']:.3f}, max {t['max_x_bsp']:.2f}, "
              f"{t['above_bsp']} of {t['problems']} above 1")
    print("*: the pick's own config has no eager row in the table; the variant's fastest eager config instead")
    if a.json:
        Path(a.json).write_text(json.dumps({"db": a.db, "sweep": a.sweep, "world": a.world, "rows": rows_out,
                                            "totals": totals, "steps": steps}, indent=1))


if __name__ == "__main__":
    main()
