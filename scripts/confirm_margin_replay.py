"""Replay first-use confirmation's BSP margin over stored held-out evaluations (no GPU needed).

For every call a held-out evaluation (`scripts/eval_dispatch_gpu.py`) confirmed on first use, pick again from
confirmation's own timings with another rule (a candidate replaces BSP only when it is `margin` faster, relative,
and `band` us faster besides) and score that pick on the evaluation's own timings of the same configs: share within
5% of the evaluation's fastest, geomean over it, the worst over BSP. Round 21 ran it over every graph-mode
evaluation stored since round 7 to ask whether a wider margin would have avoided the misses (it would not).

    python3 scripts/confirm_margin_replay.py
    python3 scripts/confirm_margin_replay.py --files 'docs/results/2026-11-29-round21/call5-eval-*.json'
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import sys

FILES = ("docs/results/2026-11-2[789]*/*eval*graph*.json", "docs/results/2026-11-29-round21/call5-eval-*.json")
RULES = ((0.02, 0.0), (0.0, 0.0), (0.03, 0.0), (0.05, 0.0), (0.02, 1.0), (0.02, 2.0))  # (margin, band us); first: today's


def load(patterns: list[str]) -> list[tuple[str, dict]]:
    """(file, row) for every confirmed call with its confirmation's and the evaluation's timings per config."""
    rows = []
    for path in sorted({p for pattern in patterns for p in glob.glob(pattern)}):
        with open(path) as f:
            data = json.load(f)
        for row in data.get("rows", []) if isinstance(data, dict) else []:
            if row.get("basis") == "confirmed" and row.get("confirm_us") and row.get("us_by_config"):
                rows.append((path, row))
    return rows


def replay(rows: list[tuple[str, dict]], margin: float, band_us: float) -> dict:
    """Score the rule (margin, band_us) on `rows`: n, within 5%, geomean over the fastest, worst over BSP, misses."""
    within, logs, worst, misses = 0, [], 0.0, []
    for path, row in rows:
        timed, evaluated = row["confirm_us"], row["us_by_config"]
        bsp = next((k for k in timed if k.startswith("bsp")), None)
        if bsp is None or bsp not in evaluated:
            continue
        pick = min(timed, key=lambda k: (timed[k], not k.startswith("bsp")))
        if pick != bsp and timed[pick] > timed[bsp] * (1.0 - margin) - band_us:
            pick = bsp
        if pick not in evaluated:
            continue
        fastest = min(evaluated.values())
        us = evaluated[pick]
        within += us <= 1.05 * fastest
        logs.append(math.log(us / fastest))
        worst = max(worst, us / evaluated[bsp])
        if us > 1.05 * fastest:
            misses.append((round(us / fastest, 3), round(us / evaluated[bsp], 3), row["problem"], path))
    n = len(logs)
    return {"n": n, "within": within / n if n else math.nan, "geomean": math.exp(sum(logs) / n) if n else math.nan,
            "worst_vs_bsp": worst, "misses": sorted(misses)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", action="append", help="evaluation JSON glob(s) (default: every stored graph-mode one)")
    a = ap.parse_args()
    rows = load(a.files or list(FILES))
    print(f"{len(rows)} confirmed calls from {len({p for p, _ in rows})} evaluations")
    for margin, band in RULES:
        s = replay(rows, margin, band)
        print(f"margin {margin:.2f} + {band:.0f} us: within 5% {s['within']:.1%}, x fastest {s['geomean']:.4f}, "
              f"worst x BSP {s['worst_vs_bsp']:.3f}, misses {len(s['misses'])}")
    for miss in replay(rows, *RULES[0])["misses"]:
        print("  miss (x fastest, x BSP, problem, file):", *miss)
    return 0


if __name__ == "__main__":
    sys.exit(main())
