"""Confirm on first use: time a policy's top candidates on the caller's own inputs before trusting it.

A policy predicts; on a problem it never measured (another N, another M, another dtype) the
prediction can be far off. So the first call of such a problem, on every rank in lockstep (after
dispatch's agreement), runs `confirm`:
1. BSP runs first, into a scratch output: its result is the yardstick.
2. Each candidate (variant, config) is built (collective, as any build) and run once on the same
   inputs into its own scratch output; one that raises, or whose output differs from BSP's by more
   than twice the op's tolerance, is dropped on every rank (one all-reduce of the verdicts).
3. The survivors are timed with identical repetitions on every rank (CUDA events; in graph mode
   each candidate's calls are captured and replayed, as inference servers run), and one
   all-reduce gives every rank the same rank-max medians, so every rank picks the same winner.
The caller's inputs are only read; nothing is written outside scratch buffers. It never runs
inside CUDA-graph capture (dispatch refuses a new problem there). The cost is reported per
problem (`Confirmation.seconds`); building a candidate whose kernels are not compiled yet adds
Triton's compile time once per config.
"""
from __future__ import annotations

import math
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from autofuse.measure import events_us
from autofuse.op import Config, Op, Problem, rel_error

BSP = "bsp"


@dataclass
class Confirmation:
    """What `confirm` measured: the winner, every (variant, config, rank-max median us) timed, and
    (variant, config, why) for every candidate dropped."""

    variant: str
    config: Config
    timed: list[tuple[str, Config, float]] = field(default_factory=list)
    dropped: list[tuple[str, Config, str]] = field(default_factory=list)
    mode: str = "eager"
    seconds: float = 0.0
    reps: int = 0

    def describe(self) -> str:
        timed = ", ".join(f"{v} {t:.1f} us" for v, _, t in sorted(self.timed, key=lambda x: x[2]))
        gone = "".join(f"; dropped {v}: {why}" for v, _, why in self.dropped)
        return f"confirmed on first use ({self.mode}, {self.seconds * 1e3:.0f} ms): {timed}{gone}"


def _max_all(world: Any, values: list[float]) -> list[float]:
    if world.size == 1 or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world.group)
    return t.tolist()


def _time(world: Any, fn: Any, mode: str, reps: int, warmup: int) -> float:
    """Median microseconds per call of `fn` on this rank (events on GPUs, the host clock on CPU)."""
    for _ in range(warmup):
        fn()
    if world.device.type != "cuda":
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(samples)
    world.sync()
    if mode == "graph":
        side = torch.cuda.Stream(device=world.device)
        side.wait_stream(torch.cuda.current_stream(world.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(world.device).wait_stream(side)
        world.sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        world.sync()
        run = graph.replay
    else:
        run = fn
    samples = [events_us(run) for _ in range(reps)]
    world.sync()
    return statistics.median(samples)


def confirm(world: Any, op: Op, problem: Problem, args: Sequence[torch.Tensor],
            candidates: Sequence[tuple[str, Config]], mode: str, reps: int = 10, warmup: int = 2,
            bsp_config: Config | None = None) -> Confirmation:
    """Measure BSP and `candidates` on `args` (this rank's inputs) in lockstep; see the module docstring.

    Every rank must call it with the same problem and candidates (dispatch's agreement ensures it).
    `bsp_config`: BSP's config where the op's BSP takes one (default: its first default).
    Returns the fastest correct candidate (BSP if none beats it) with the measurements.
    """
    t0 = time.perf_counter()
    if bsp_config is None:
        bsp_config = op.variant(BSP).defaults(problem)[0]
    cands = [(BSP, dict(bsp_config))] + [(v, dict(c)) for v, c in candidates if v != BSP]
    runners: list[Any] = []
    outs: list[torch.Tensor | None] = []
    errors: list[str] = []
    for variant, config in cands:
        try:
            runner = op.variant(variant).build(world, problem, config)
            out = runner(*args)
            runner.check()
            err = ""
        except Exception as exc:  # noqa: BLE001 - a failing candidate is dropped, not fatal
            runner, out, err = None, None, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            traceback.clear_frames(exc.__traceback__)
        runners.append(runner)
        outs.append(out)
        errors.append(err)
    if errors[0]:
        raise RuntimeError(f"{op.name}: bsp failed on {problem.key} while confirming: {errors[0]}")
    tol = 2 * op.tolerance(problem)
    for i in range(1, len(cands)):
        if not errors[i]:
            e = rel_error(outs[i], outs[0])
            if not e <= tol:
                errors[i] = f"output differs from bsp's by {e:.3g} (> {tol:.3g})"
    failed = _max_all(world, [1.0 if e else 0.0 for e in errors])
    result = Confirmation(BSP, dict(bsp_config), mode=mode, reps=reps)
    times = []
    for i, (variant, config) in enumerate(cands):
        if failed[i]:
            result.dropped.append((variant, config, errors[i] or "failed on another rank"))
            times.append(math.inf)
            continue
        out = outs[i]
        runner = runners[i]
        times.append(_time(world, lambda r=runner, o=out: r(*args, out=o), mode, reps, warmup))
    times = _max_all(world, times)
    result.timed = [(v, c, t) for (v, c), t in zip(cands, times) if math.isfinite(t)]
    best = min(result.timed, key=lambda x: (x[2], x[0] != BSP))
    result.variant, result.config = best[0], best[1]
    result.seconds = time.perf_counter() - t0
    return result
