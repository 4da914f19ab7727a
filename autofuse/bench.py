"""Benchmarks: every variant of an op at its best config from a quick sweep, against BSP and the bound.

For each problem of `op.sweep(kind, world)`: each available variant is measured at each of its
known-good configs (`variant.defaults(problem)`), correctness-checked first; the fastest correct
config per variant is reported. The pieces of the op's bound (`op.extra["bound"]`, e.g. the
all-gather alone and the matmul alone) are timed in the same run, and bound = max(pieces). Not a
test: it prints a table and writes JSON; run it on the GPU machine.
"""
from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from autofuse import environment, registry
from autofuse.measure import Measurement, measure, modes_for, time_fn
from autofuse.op import Problem


@dataclass
class BenchRow:
    """One problem in one mode: best latency per variant, the bound and its pieces."""

    problem: Problem
    mode: str
    best: dict[str, float] = field(default_factory=dict)
    config: dict[str, dict] = field(default_factory=dict)
    pieces: dict[str, float] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    pieces_bw: dict[str, float] = field(default_factory=dict)

    @property
    def bound(self) -> float:
        return max(self.pieces.values()) if self.pieces else math.nan

    def fused_best(self, fused: Sequence[str]) -> tuple[str, float]:
        cands = [(v, t) for v, t in self.best.items() if v in fused]
        return min(cands, key=lambda x: x[1]) if cands else ("-", math.nan)


def bench_rank(world, op_name: str, kind: str, variants: Sequence[str] | None, modes: Sequence[str] | None,
               reps: int, limit: int | None, shapes: Sequence[int] | None) -> dict[str, Any]:
    """Run on every rank; returns plain data (rank 0's is printed)."""
    op = registry.get(op_name)
    problems = op.sweep(kind, world.size)
    if shapes:
        problems = [p for p in problems if p.get("M", p.get("B")) in set(shapes)]
    if limit:
        problems = problems[:limit]
    modes = tuple(modes or modes_for(world))
    names = [v for v in op.variants if (variants is None or v in variants) and op.variants[v].available(world)]
    rows: list[BenchRow] = []
    raw: list[dict] = []
    for i, problem in enumerate(problems):
        per_mode = {m: BenchRow(problem, m) for m in modes}
        for vname in names:
            for config in op.variants[vname].defaults(problem):
                for ms in measure(world, op, problem, vname, config, modes=modes, reps=reps):
                    raw.append(ms.row())
                    _keep_best(per_mode[ms.mode], ms)
        bound = op.extra.get("bound")
        if bound is not None:
            pieces = bound(world, problem, 0)
            for mode in modes:
                for pname, fn in pieces.items():
                    per_mode[mode].pieces[pname] = time_fn(world, fn, mode, reps=reps).median_us
            del pieces
        if "bytes" in op.extra and "copy_rate" in op.extra:
            # HBM rate in the same run: a device copy of the same bytes (it reads and writes them).
            copy = op.extra["copy_rate"](world, problem)
            nbytes = op.extra["bytes"](problem)
            for mode in modes:
                t_copy = time_fn(world, copy, mode, reps=reps).median_us
                row = per_mode[mode]
                row.pieces_bw = {"bytes": nbytes, "copy_us": t_copy, "copy_GBps": 2 * nbytes / t_copy / 1e3}
                if "local" in row.pieces:
                    row.pieces_bw["local_GBps"] = nbytes / row.pieces["local"] / 1e3
                    row.pieces_bw["local_vs_copy"] = row.pieces_bw["local_GBps"] / row.pieces_bw["copy_GBps"]
            del copy
        rows.extend(per_mode.values())
        if world.rank == 0:
            print(f"[{i + 1}/{len(problems)}] {problem.key}", flush=True)
    return {"rows": [_row_dict(r, op) for r in rows], "raw": raw, "variants": names, "modes": list(modes)}


def _keep_best(row: BenchRow, ms: Measurement) -> None:
    if not ms.ok:
        row.failures.setdefault(ms.variant, ms.error.splitlines()[0][:160] if ms.error else "failed")
        return
    if ms.median_us < row.best.get(ms.variant, math.inf):
        row.best[ms.variant] = ms.median_us
        row.config[ms.variant] = ms.config
        row.failures.pop(ms.variant, None)


def _row_dict(row: BenchRow, op) -> dict[str, Any]:
    fused = [n for n, v in op.variants.items() if v.fused]
    fv, ft = row.fused_best(fused)
    bsp = row.best.get("bsp", math.nan)
    return {
        "problem": row.problem.key, **row.problem.as_dict(), "mode": row.mode,
        "best_us": row.best, "config": row.config, "pieces_us": row.pieces, "bound_us": row.bound,
        "best_fused": fv, "best_fused_us": ft, "speedup_vs_bsp": bsp / ft if ft and ft == ft else math.nan,
        "vs_bound": ft / row.bound if row.bound == row.bound and ft == ft else math.nan,
        "failures": row.failures, "bandwidth": row.pieces_bw,
    }


def geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x and x == x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def write_report(result: dict[str, Any], op_name: str, kind: str, out: Path) -> Path:
    """JSON with every measurement, the fingerprint and the date."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fp = environment.fingerprint()
    doc = {"op": op_name, "sweep": kind, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "fingerprint": fp, **result}
    out.write_text(json.dumps(doc, indent=1, default=str))
    return out
