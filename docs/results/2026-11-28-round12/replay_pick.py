"""Replay confirmation's decision on recorded held-out evaluations, offline: each confirmed call's confirmation
timings and the policy's prediction (both from its `reason`), decided by `autofuse.dispatch.confirm.pick`
("no hold") and by a rule tried and rejected this round ("hold": the policy's own pick stays unless another
candidate beats it by 5%, provided it too beat BSP), each scored on the evaluation's own timings of the same
variants. A replay of recorded numbers, not a measurement.

    python3 docs/results/2026-11-28-round12/replay_pick.py [EVAL.json ...]   # default: call 2's
"""
import json
import math
import os
import re
import sys

from autofuse.dispatch.confirm import MARGIN, pick

HOLD = 0.05


def pick_holding(timed: list, incumbent: str | None) -> str:
    """The rejected rule: BSP unless the fastest other beats it by MARGIN; then the policy's pick if no other
    beats it by HOLD and it too beat BSP, else the fastest other."""
    bsp = next(t for t in timed if t[0] == "bsp")
    others = [t for t in timed if t[0] != "bsp"]
    if not others or min(t[2] for t in others) > bsp[2] * (1 - MARGIN):
        return "bsp"
    fastest = min(others, key=lambda t: t[2])
    inc = next((t for t in others if t[0] == incumbent), None)
    if inc is not None and fastest[2] > inc[2] * (1 - HOLD) and inc[2] < bsp[2]:
        return inc[0]
    return fastest[0]


paths = sys.argv[1:] or [os.path.join(os.path.dirname(os.path.abspath(__file__)), "call2-eval-graph.json")]
rows = []
for path in paths:
    with open(path) as f:
        rows += [r for r in json.load(f)["rows"] if r["basis"] == "confirmed"]
scores = {"no hold": [], "hold": []}
for r in rows:
    measured = r["reason"].split("): ", 1)[1].split(";")[0]
    timed = [(v, {}, float(t)) for v, t in re.findall(r"(\w+) ([\d.]+) us", measured)]
    seen, unique = set(), []
    for t in timed:  # one entry per variant (two configs of one variant: the faster)
        if t[0] not in seen:
            seen.add(t[0])
            unique.append(t)
    predicted = re.search(r"predicts (\w+) [\d.]+x over bsp", r["reason"])
    held = predicted.group(1) if predicted and predicted.group(1) != "bsp" else None
    best = min(r["us"].values())
    line = []
    for name, v in (("no hold", pick(unique)[0]), ("hold", pick_holding(unique, held))):
        ratio = r["us"][v] / best
        scores[name].append(ratio)
        line.append(f"{name}: {v} {ratio:.3f}")
    print(f"{r['problem']:55s} policy {held or 'bsp':16s} " + ", ".join(line))
for name, xs in scores.items():
    within = sum(x <= 1.05 for x in xs) / len(xs)
    print(f"{name}: {within:.0%} within 5%, geomean {math.exp(sum(map(math.log, xs)) / len(xs)):.3f}x of the best")
