"""One definition of the numbers every command reports about a problem (tune, show, export, bench, bench layer).

- **best**: the fastest correct variant measured on the problem, of any family, BSP included: what
  dispatch could at best run (it chooses among the same variants). `x BSP` (`speedup_vs_bsp`) =
  BSP's latency / best's latency, so it is never below 1.00; 1.00 means BSP is the best.
- **alternatives**: what a user would otherwise run instead of autofuse: an op's variants of the
  families in `ALTERNATIVE_FAMILIES` (`peer`: torch's symmetric-memory ops such as `torch_symm`,
  and any peer variant added later, e.g. torch's symmetric-memory all-reduce or NCCL on
  registered buffers). `x alt` (`speedup_vs_alternative`) = the fastest alternative's latency /
  best's latency (>= 1.00; absent where the op has no alternative measured).
- **autofuse's own**: the variants of the families in `OWN_FAMILIES` (hybrid, fused);
  `own_vs_bsp` = BSP / the fastest of them, below 1.00 where they lose: what the per-family
  geomeans of `bench` report; `own_vs_alternative` (`own/alt`) = the fastest alternative's latency /
  the fastest own variant's, below 1.00 where torch's ops beat every kernel of autofuse's own.
- **bound**: the slowest of the op's pieces (communication alone, computation alone) timed in the
  same run: the latency perfect overlap would reach. **ceiling** = BSP / bound: the most any
  overlap can give over BSP; **captured** = (x BSP - 1) / (ceiling - 1). A bound above BSP means the
  pieces' timings are not consistent with BSP's (noise): the ceiling is then left out.
- Timings of the CPU emulation (Triton's interpreter, gloo) say nothing about GPUs: where a
  comparison is `interpreted`, every ratio above is None and tables print latencies only, never
  a speedup (`INTERPRETED_NOTE` says why).
- **Outliers**: a problem's x BSP is compared with its `neighbours` (the same op, dtype, world
  size and categorical dims, the nearest sizes); one more than `NOISE` times off each of theirs
  (`deviates`) rests on a sample that may be an outlier (a BSP timed during a hiccup, a lucky
  winner). The tuner re-measures such a problem's BSP and best in turns and stores the result
  marked `confirmed` (superseding the first rows); `withhold` keeps every table (tune, show,
  export) from printing a ratio of a deviating problem whose BSP and best rows are not both
  confirmed: it is shown `unconfirmed`, with latencies only. The same rule holds for `x alt`: a
  problem whose x alt deviates from its neighbours' (torch's op timed during a hiccup: 3.5 ms where
  its neighbours took 0.4) gets its alternative and best re-measured in turns, and until both are
  confirmed its x alt and own/alt are withheld (`unconfirmed_alt`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping

ALTERNATIVE_FAMILIES = ("peer",)
OWN_FAMILIES = ("hybrid", "fused")
NOISE = 1.5  # a ratio this many times off each of its neighbours' is more than timing noise
NEIGHBOURS = 2  # how many of the nearest problems a ratio is compared with
MAX_OCTAVES = 4.0  # problems further apart than this (sum of |log2| size differences) are no neighbours
UNCONFIRMED_NOTE = ("unconfirmed: the problem's x BSP deviates from its neighbouring problems' by more than noise "
                    "and its BSP and best were not re-measured in turns, so no speedup is shown for it (rerun "
                    "`autofuse tune` with the same options to confirm it)")
UNCONFIRMED_ALT_NOTE = ("alt unconfirmed: the problem's x alt deviates from its neighbouring problems' by more than "
                        "noise and torch's op and the best were not re-measured in turns, so x alt and own/alt are "
                        "not shown for it")
TIMED_EAGER_NOTE = ("*: timed eagerly in graph mode: the variant cannot be captured in a CUDA graph (it reads device "
                    "data on the host), so a captured model runs it eagerly; its time is what a user who picks it gets")
INTERPRETED_NOTE = ("CPU emulation: latencies are Triton-interpreter and gloo timings on CPU ranks, not GPU "
                    "timings; no speedup is shown (they show that every variant runs, not which is faster on a GPU)")


def interpreted(device_kind: str | None) -> bool:
    """Whether timings of this device kind come from the CPU emulation (never shown as speedups)."""
    return device_kind == "cpu"


def families(op: Any) -> dict[str, str]:
    """{variant: family} of an op (an Op or a registered op's name; {} for an op this install lacks)."""
    if isinstance(op, str):
        from autofuse.core import registry

        try:
            op = registry.get(op)
        except (KeyError, ImportError):
            return {}
    return {name: getattr(v, "family", "") for name, v in op.variants.items()}


def alternatives(op: Any) -> list[str]:
    """The op's variants users would otherwise run (families in ALTERNATIVE_FAMILIES), in registry order."""
    return [v for v, f in families(op).items() if f in ALTERNATIVE_FAMILIES]


def own(op: Any) -> list[str]:
    """autofuse's own variants of the op (families in OWN_FAMILIES), in registry order."""
    return [v for v, f in families(op).items() if f in OWN_FAMILIES]


def ratio(slow: float | None, fast: float | None) -> float | None:
    """slow / fast where both are finite positive latencies, else None."""
    if slow is None or fast is None or not (math.isfinite(slow) and math.isfinite(fast)) or slow <= 0 or fast <= 0:
        return None
    return slow / fast


def ceiling(bsp_us: float | None, bound_us: float | None) -> float | None:
    """BSP / bound, the most perfect overlap can give over BSP; None where the bound is above BSP."""
    r = ratio(bsp_us, bound_us)
    return r if r is not None and r >= 1.0 else None


def captured(speedup: float | None, top: float | None) -> float | None:
    """The share of the ceiling a speedup reaches: (x - 1) / (ceiling - 1); None without a ceiling above 1."""
    if speedup is None or top is None or top <= 1.0:
        return None
    return (speedup - 1.0) / (top - 1.0)


def _fastest(us: Mapping[str, float], among: Iterable[str]) -> tuple[str | None, float | None]:
    cands = [(t, v) for v, t in us.items() if v in set(among) and t is not None and math.isfinite(t)]
    if not cands:
        return None, None
    t, v = min(cands)
    return v, t


@dataclass
class Comparison:
    """The numbers of one problem in one timing mode (see the module docstring)."""

    best: str | None
    best_us: float | None
    bsp_us: float | None
    speedup_vs_bsp: float | None
    alternative: str | None
    alternative_us: float | None
    speedup_vs_alternative: float | None
    own: str | None
    own_us: float | None
    own_vs_bsp: float | None
    own_vs_alternative: float | None
    bound_us: float | None
    ceiling: float | None
    ceiling_captured: float | None
    interpreted: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(op: Any, us: Mapping[str, float], bound_us: float | None = None,
            is_interpreted: bool = False) -> Comparison:
    """The comparison of one problem: `us` = {variant: its best correct latency}, `bound_us` = the
    slowest piece timed alone (None if not timed). With `is_interpreted` every ratio is None."""
    fam = families(op)
    finite = {v: t for v, t in us.items() if t is not None and math.isfinite(t) and t > 0}
    best, best_us = _fastest(finite, finite)
    alt, alt_us = _fastest(finite, [v for v in finite if fam.get(v) in ALTERNATIVE_FAMILIES])
    mine, mine_us = _fastest(finite, [v for v in finite if fam.get(v, "bsp" if v == "bsp" else "fused")
                                      in OWN_FAMILIES])
    bsp_us = finite.get("bsp")
    bound = bound_us if bound_us is not None and math.isfinite(bound_us) else None
    if is_interpreted:
        x_bsp = x_alt = x_own = own_alt = top = None
    else:
        x_bsp, x_alt, x_own = ratio(bsp_us, best_us), ratio(alt_us, best_us), ratio(bsp_us, mine_us)
        own_alt = ratio(alt_us, mine_us)
        top = ceiling(bsp_us, bound)
    return Comparison(best, best_us, bsp_us, x_bsp, alt, alt_us, x_alt, mine, mine_us, x_own, own_alt, bound, top,
                      captured(x_bsp, top), is_interpreted)


def geomean(xs: Iterable[float | None]) -> float | None:
    """Geometric mean of the finite positive values; None if there are none."""
    vals = [x for x in xs if x is not None and math.isfinite(x) and x > 0]
    return math.exp(sum(math.log(x) for x in vals) / len(vals)) if vals else None


def _shape(key: str) -> tuple[tuple, dict[str, float]]:
    """(what must match for two problems to be neighbours, their numeric sizes) of a problem key."""
    from autofuse.core.keys import parse_key

    p = parse_key(key)
    numeric = {k: float(v) for k, v in p.dims.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    fixed = tuple(sorted((k, str(v)) for k, v in p.dims.items() if k not in numeric))
    return (p.op, p.dtype, p.world, tuple(sorted(numeric)), fixed), numeric


def neighbours(key: str, keys: Iterable[str], k: int = NEIGHBOURS) -> list[str]:
    """The `k` problems of `keys` nearest to `key` (same op, dtype, world size and categorical dims;
    distance: the sum over sizes of |log2| of their ratio, at most MAX_OCTAVES), nearest first."""
    group, sizes = _shape(key)
    near = []
    for other in keys:
        if other == key:
            continue
        g, s = _shape(other)
        if g != group:
            continue
        d = sum(abs(math.log2(max(sizes[n], 1e-9) / max(s[n], 1e-9))) for n in sizes)
        if d <= MAX_OCTAVES:
            near.append((d, other))
    return [o for _, o in sorted(near)[:k]]


def deviates(x: float | None, around: Iterable[float | None]) -> bool:
    """Whether ratio `x` is more than NOISE times off every one of its neighbours' ratios `around` (False
    where either is missing): a neighbour that is itself an outlier does not make its neighbours ones."""
    vals = [v for v in around if v is not None and math.isfinite(v) and v > 0]
    if x is None or not math.isfinite(x) or x <= 0 or not vals:
        return False
    return all(x > v * NOISE or x < v / NOISE for v in vals)


def bsp_ratio(us: Mapping[str, float]) -> float | None:
    """BSP's latency / the fastest of `us` (every variant's best): x BSP without the interpreter rule."""
    finite = [t for t in us.values() if t is not None and math.isfinite(t) and t > 0]
    return ratio(us.get("bsp"), min(finite)) if finite else None


def alternative_ratio(op: Any, us: Mapping[str, float]) -> tuple[str | None, float | None]:
    """(the fastest alternative, its latency / the fastest of `us`): x alt without the interpreter rule."""
    fam = families(op)
    finite = {v: t for v, t in us.items() if t is not None and math.isfinite(t) and t > 0}
    alt, alt_us = _fastest(finite, [v for v in finite if fam.get(v) in ALTERNATIVE_FAMILIES])
    return alt, (ratio(alt_us, min(finite.values())) if alt is not None else None)


def outliers(us_by_problem: Mapping[str, Mapping[str, float]]) -> list[str]:
    """The problems whose x BSP `deviates` from their neighbours' ({problem: {variant: us}})."""
    x = {k: bsp_ratio(us) for k, us in us_by_problem.items()}
    return _deviating(x)


def alternative_outliers(op_of: Mapping[str, Any], us_by_problem: Mapping[str, Mapping[str, float]]) -> list[str]:
    """The problems whose x alt `deviates` from their neighbours' ({problem: {variant: us}}; `op_of`:
    {problem: its op}, whose families say which variants are alternatives)."""
    return _deviating({k: alternative_ratio(op_of[k], us)[1] for k, us in us_by_problem.items()})


def _deviating(x: Mapping[str, float | None]) -> list[str]:
    have = [k for k, v in x.items() if v is not None]
    return [k for k in have if deviates(x[k], [x[n] for n in neighbours(k, have)])]


WITHHELD = ("speedup_vs_bsp", "speedup_vs_alternative", "own_vs_bsp", "own_vs_alternative", "ceiling_captured")
WITHHELD_ALT = ("speedup_vs_alternative", "own_vs_alternative")


def withhold(table: list[dict]) -> list[dict]:
    """Mark `unconfirmed` (and clear every ratio of) the entries of a problem table (one dict per
    problem: `op`, `problem`, `us` {variant: latency}, `best`, `confirmed` {variant: bool}, the fields of
    `Comparison`) whose x BSP deviates from their neighbours' unless their BSP and best rows are
    both confirmed, and `unconfirmed_alt` (x alt and own/alt cleared) those whose x alt deviates unless
    their alternative's and best rows are both confirmed; returns the table."""
    us = {e["problem"]: e["us"] for e in table if not e.get("interpreted")}
    by_key = {e["problem"]: e for e in table}
    for key in outliers(us):
        e = by_key[key]
        confirmed = e.get("confirmed") or {}
        if confirmed.get("bsp") and confirmed.get(e.get("best")):
            continue
        e["unconfirmed"] = True
        for name in WITHHELD:
            e[name] = None
    for key in alternative_outliers({k: by_key[k]["op"] for k in us}, us):
        e = by_key[key]
        confirmed = e.get("confirmed") or {}
        if confirmed.get(e.get("alternative")) and confirmed.get(e.get("best")):
            continue
        e["unconfirmed_alt"] = True
        for name in WITHHELD_ALT:
            e[name] = None
    return table
