"""Features of a problem: the numbers the dispatch policy learns from (DESIGN.md, Policy).

Generic ones come from the problem alone: log2 of every numeric dimension, the world size and the
dtype's bytes; a text dimension (e.g. gather=rows) becomes an indicator `gather=rows` = 1. The op
adds its own through `op.features(problem)` (bytes communicated per FLOP, tiles per rank, ...), and
a dim it declares an extra feature (`Op.extra_features`: not a size, e.g. a routing skew) is its value.
A policy stores its feature names; a name the problem lacks reads as 0.
"""
from __future__ import annotations

import math
from typing import Sequence

from autofuse.core.op import DTYPES, Op, Problem


def generic(problem: Problem) -> dict[str, float]:
    """Features every op shares: log2 of numeric dims, world size, dtype bytes, text-dim indicators."""
    out = {"world": float(problem.world), "dtype_bytes": float(DTYPES[problem.dtype].itemsize)}
    for name, value in problem.dims:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"log2_{name}"] = math.log2(max(float(value), 1.0))
        else:
            out[f"{name}={value}"] = 1.0
    return out


def problem_features(problem: Problem, op: Op | None = None) -> dict[str, float]:
    """Generic features plus the op's own (the op's win on a name clash); extra-feature dims as their values."""
    out = generic(problem)
    if op is not None:
        for name in op.extra_features:
            value = problem.get(name)
            if value is not None:
                out.pop(f"log2_{name}", None)
                out.pop(f"{name}={value}", None)
                out[name] = float(value)
        out.update({k: float(v) for k, v in op.features(problem).items()})
    return out


def vector(features: dict[str, float], names: Sequence[str]) -> list[float]:
    """The features in `names` order, 0.0 for a name the problem does not have."""
    return [float(features.get(n, 0.0)) for n in names]
