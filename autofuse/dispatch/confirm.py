"""Confirm on first use: time a policy's top candidates on the caller's own inputs before trusting it.

A policy predicts; on a problem it never measured (another N, another M, another dtype) the
prediction can be far off. So the first call of such a problem, on every rank in lockstep (after
dispatch's agreement), runs `confirm`:
1. BSP runs first, into a scratch output: its result is the yardstick.
2. Each candidate (variant, config) is built (collective, as any build) and run once on the same
   inputs into its own scratch output; one that raises, or whose output differs from BSP's by more
   than twice the op's tolerance, is dropped on every rank (one all-reduce of the verdicts). With
   `keep`, only the first `keep` candidates are built at first, and each one dropped gives its place
   to the next of the list (another wave, another all-reduce), so that a candidate that cannot run
   here (an alternative refusing the dtype, say) does not leave fewer to choose from.
3. The survivors are timed with the tuner's timer (`autofuse.measure.timing.Batches`, what `time_fn`
   uses): warm-up, batches of `inner` calls lasting about 2 ms each (agreed from the slowest
   rank's probe), input sets rotated against L2 on GPUs (copies of the caller's inputs), CUDA
   events; in graph mode each candidate's batch is captured once and replayed, as inference
   servers run (a variant that cannot be captured, `Variant.capturable` False, runs eagerly there, as
   it would in the caller's graph: `timing.timed_mode`; listed in `Confirmation.timed_eager`). The candidates take turns (`autofuse.measure.timing.time_in_turns`) over `rounds` rounds
   (default 3), the order reversed every other round, so that a drift of clocks or temperature
   during confirmation is shared by every candidate rather than charged to whichever ran last;
   each turn starts with a barrier and one untimed step, so that no turn's first batch pays for
   waking the host or for a peer still in the last turn. Each candidate's median over all its
   batches is made rank-max (one all-reduce per statistic), so every rank picks the same winner;
   a tie goes to BSP.
4. Candidates that the first pass cannot tell apart, those within `CLOSE` (5%) or `NOISE_US` (2.5 us) of
   the fastest when there are two or more (BSP among them when it is), are timed again in a second pass of twice the batches
   over twice the rounds, and decided on it (`contenders`). A first pass of 6 batches at 20-30 us moves
   by 10% from run to run (2x H200, 2026-11-28, scripts/confirm_noise_gpu.py): round 11's held-out
   evaluation lost 6.6% on a call whose confirmation had BSP 24.0 us and heap_mm 24.1, while four
   repeats of it put heap_mm 11% ahead every time.
Bounded cost: `reps` batches per candidate (default 6, about 50 ms for BSP and 3 candidates of
GEMM size), fewer when the projected timed batches of all candidates would exceed `budget_s`
(default 0.25 s), but at least one each. Beyond the batches: `warmup` steps, the probe, one
untimed step per turn and (graph mode) one capture per candidate. Copies for rotation are bounded
by `measure.rotation_count` (about twice the L2 size in all) and freed on return; a rank that
cannot allocate them rotates fewer, and all ranks agree on the smallest count.
The caller's inputs are only read; nothing is written outside scratch buffers. It never runs
inside CUDA-graph capture (dispatch refuses a new problem there). The cost is reported per problem:
`Confirmation.build_seconds` (building the candidates and their first, checked call: on a cold
process this includes Triton's compile of each config and the allocation of heap workspaces),
`timing_seconds` (the timing alone) and the total `seconds`.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from autofuse.measure.timing import Timing, nan_like, nbytes, rotation_count, time_in_turns, timed_mode
from autofuse.core.op import Config, Op, Problem, rel_error

if TYPE_CHECKING:
    from autofuse.comm.world import World

BSP = "bsp"
REPS = 6
ROUNDS = 3
BUDGET_S = 0.25
CLOSE = 0.05  # candidates within this of the fastest after the first pass get a second, longer one
NOISE_US = 2.5  # ... or within this many us: at 20-30 us a first pass moves about 10% from run to run
ROTATE_ON_CPU = False  # tests: rotate input sets on CPU ranks too, the path GPUs take
MARGIN = 0.02  # a candidate replaces BSP only when it is this much faster: within it, the timings' noise decides


def pick(timed: Sequence[tuple[str, Config, float]], margin: float = MARGIN) -> tuple[str, Config]:
    """The winner among (variant, config, us) timed in turns: the fastest, unless it is not BSP and beats
    BSP by less than `margin` (relative), in which case BSP. A first-use confirmation is a few batches
    at about 50 us: a 1-2% lead there is noise, and keeping BSP on it never makes a call slower than
    what the user would otherwise run."""
    best = min(timed, key=lambda x: (x[2], x[0] != BSP))
    bsp = next((t for t in timed if t[0] == BSP), None)
    if bsp is not None and best[0] != BSP and best[2] > bsp[2] * (1.0 - margin):
        best = bsp
    return best[0], dict(best[1])


def contenders(timed: Sequence[tuple[str, Config, float]], close: float = CLOSE,
               noise_us: float = NOISE_US) -> list[int]:
    """Indices into `timed` of the candidates a second pass times again: every one within `close`
    (relative) or `noise_us` (absolute) of the fastest, where there are at least two; else none. The
    absolute band is the first pass's noise on small problems: on 2x H200 a 6-batch pass at 20-30 us
    moves about 10% from run to run (scripts/confirm_noise_gpu.py), so 18.7 vs 20.2 us is no verdict."""
    best = min((t for _, _, t in timed), default=float("nan"))
    close_ones = [i for i, (_, _, t) in enumerate(timed) if t <= max(best * (1.0 + close), best + noise_us)]
    return close_ones if len(close_ones) > 1 else []


@dataclass
class Confirmation:
    """What `confirm` measured: the winner, every (variant, config, rank-max median us) timed, and
    (variant, config, why) for every candidate dropped.

    `timings[i]` holds the full rank-max statistics of `timed[i]`; `reps` is the number of timed
    batches per candidate, spread over `rounds` rounds, each batch rotating over `sets` input sets.
    Seconds are this rank's wall time: `build_seconds` (building, first call and the check of every
    candidate), `timing_seconds` (the timing alone), `seconds` (everything, both included).
    `timed_eager`: the variants timed eagerly in graph mode (not capturable: `timing.timed_mode`).
    `again`: the variants a second pass timed (`contenders`), `again_reps` its batches per candidate;
    their entries in `timed` and `timings` are the second pass's.
    """

    variant: str
    config: Config
    timed: list[tuple[str, Config, float]] = field(default_factory=list)
    dropped: list[tuple[str, Config, str]] = field(default_factory=list)
    mode: str = "eager"
    seconds: float = 0.0
    build_seconds: float = 0.0
    timing_seconds: float = 0.0
    reps: int = 0
    rounds: int = 0
    sets: int = 1
    timings: list[Timing] = field(default_factory=list)
    timed_eager: list[str] = field(default_factory=list)
    again: list[str] = field(default_factory=list)
    again_reps: int = 0

    def describe(self) -> str:
        """One line for `explain`: the cost split and every candidate's time, fastest first."""
        timed = ", ".join(f"{v} {t:.1f} us" for v, _, t in sorted(self.timed, key=lambda x: x[2]))
        gone = "".join(f"; dropped {v}: {why}" for v, _, why in self.dropped)
        if self.again:
            gone += f"; within {CLOSE:.0%} or {NOISE_US} us after the first pass, timed again ({self.again_reps} batches each): " \
                    f"{', '.join(self.again)}"
        if self.timed_eager:
            gone += f"; timed eagerly (not capturable): {', '.join(self.timed_eager)}"
        return (f"confirmed on first use ({self.mode}, {self.seconds * 1e3:.0f} ms: build "
                f"{self.build_seconds * 1e3:.0f} ms, timing {self.timing_seconds * 1e3:.0f} ms for "
                f"{self.reps} batches each in {self.rounds} rounds): {timed}{gone}")


def _reduce_all(world: World, values: list[float], op: dist.ReduceOp) -> list[float]:
    """`values` reduced elementwise over the ranks with `op` (one all-reduce)."""
    if world.size == 1 or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=op, group=world.group)
    return t.tolist()


def _build_all(world: World, op: Op, problem: Problem, args: Sequence[torch.Tensor],
               cands: list[tuple[str, Config]]) -> tuple[list[Any], list[torch.Tensor | None], list[str]]:
    """Build each candidate and run it once on `args`: (runners, outputs, errors), '' where it worked."""
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
    return runners, outs, errors


def _compare(op: Op, problem: Problem, outs: list[torch.Tensor | None], errors: list[str]) -> None:
    """Mark (in `errors`) every candidate whose output differs from BSP's (`outs[0]`) beyond twice
    the op's tolerance."""
    tol = 2 * op.tolerance(problem)
    ref = outs[0]
    if isinstance(ref, (tuple, list)):  # a handle beside the outputs (MoE dispatch) is its partner's to check
        ref = tuple(r if isinstance(r, torch.Tensor) else None for r in ref)
    for i in range(1, len(outs)):
        if not errors[i]:
            e = rel_error(outs[i], ref)
            if not e <= tol:
                errors[i] = f"output differs from bsp's by {e:.3g} (> {tol:.3g})"


def _input_sets(world: World, args: Sequence[Any]) -> list[tuple]:
    """The caller's `args` and copies of them to rotate through against L2, as `measure` rotates
    (GPUs only). The count is the smallest any rank could allocate, since every rank must make the
    same calls."""
    sets = [tuple(args)]
    if world.device.type != "cuda" and not ROTATE_ON_CPU:
        return sets
    try:
        for _ in range(rotation_count(nbytes(args)) - 1):
            sets.append(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
    except torch.cuda.OutOfMemoryError as exc:
        traceback.clear_frames(exc.__traceback__)
    keep = int(_reduce_all(world, [float(len(sets))], dist.ReduceOp.MIN)[0])
    return sets[:keep]


def confirm(world: World, op: Op, problem: Problem, args: Sequence[torch.Tensor],
            candidates: Sequence[tuple[str, Config]], mode: str, reps: int = REPS, warmup: int = 2,
            bsp_config: Config | None = None, budget_s: float = BUDGET_S, rounds: int = ROUNDS,
            keep: int | None = None, close: float | None = CLOSE) -> Confirmation:
    """Measure BSP and `candidates` on `args` (this rank's inputs) in lockstep; see the module docstring.

    Every rank must call it with the same problem, candidates and counts (dispatch's agreement
    ensures it). `bsp_config`: BSP's config where the op's BSP takes one (default: its first
    default). `keep`: how many candidates to time (default: all), the later ones of the list standing
    in for those that fail. `reps`: timed batches per candidate, cut so that the timed batches stay
    within `budget_s` seconds; `rounds`: how many turns they are spread over. `close`: the band of
    the second pass (`contenders`; None: no second pass).
    Returns the fastest correct candidate (BSP unless one beats it by `MARGIN`: `pick`) with the measurements.
    """
    t0 = time.perf_counter()
    if bsp_config is None:
        bsp_config = op.variant(BSP).defaults(problem)[0]
    queue = [(v, dict(c)) for v, c in candidates if v != BSP]
    want = len(queue) if keep is None else max(0, keep)
    cands = [(BSP, dict(bsp_config))] + queue[:want]
    runners, outs, errors = _build_all(world, op, problem, args, cands)
    if not errors[0]:
        _compare(op, problem, outs, errors)
    failed = _reduce_all(world, [1.0 if e else 0.0 for e in errors], dist.ReduceOp.MAX)
    if failed[0]:  # raised on every rank alike, after the verdicts' all-reduce
        why = errors[0] or "failed on another rank"
        raise RuntimeError(f"{op.name}: bsp failed on {problem.key} while confirming: {why}")
    live_count = lambda: len(cands) - 1 - int(sum(failed[1:]))  # noqa: E731 - candidates built and right
    while live_count() < want and len(cands) - 1 < len(queue):  # the next ones take the dropped ones' places
        wave = queue[len(cands) - 1:len(cands) - 1 + want - live_count()]
        r2, o2, e2 = _build_all(world, op, problem, args, wave)
        verdicts = ["", *e2]
        _compare(op, problem, [outs[0], *o2], verdicts)
        cands, runners, outs, errors = cands + wave, runners + r2, outs + o2, errors + verdicts[1:]
        failed = failed + _reduce_all(world, [1.0 if e else 0.0 for e in verdicts[1:]], dist.ReduceOp.MAX)
    result = Confirmation(BSP, dict(bsp_config), mode=mode, build_seconds=time.perf_counter() - t0)
    live = [i for i in range(len(cands)) if not failed[i]]
    result.dropped = [(v, c, errors[i] or "failed on another rank")
                      for i, (v, c) in enumerate(cands) if failed[i]]
    t1 = time.perf_counter()
    sets = _input_sets(world, args)
    scratch = [outs[0]] + [nan_like(outs[0]) for _ in sets[1:]]  # a tensor, or Outputs beside a handle
    del outs  # the other candidates' first outputs: every candidate writes `scratch` from here on
    steps = [[lambda r=runners[i], x=x, o=o: r(*x, out=o) for x, o in zip(sets, scratch)] for i in live]
    modes = [timed_mode(op.variant(cands[i][0]), mode) for i in live]
    timings, plan = time_in_turns(world, steps, modes, reps, warmup, rounds, budget_s)
    result.timed_eager = [cands[i][0] for i, m in zip(live, modes) if m != mode]
    result.reps, result.rounds, result.sets = sum(plan), len(plan), len(sets)
    result.timed = [(cands[i][0], cands[i][1], t.median_us) for i, t in zip(live, timings)]
    result.timings = timings
    again = contenders(result.timed, close) if close is not None else []
    if again:  # rank-max medians: every rank finds the same contenders
        timings2, plan2 = time_in_turns(world, [steps[j] for j in again], [modes[j] for j in again],
                                        2 * reps, warmup, 2 * rounds, budget_s)
        for j, t in zip(again, timings2):
            result.timed[j] = (*result.timed[j][:2], t.median_us)
            result.timings[j] = t
        result.again, result.again_reps = [result.timed[j][0] for j in again], sum(plan2)
    result.timing_seconds = time.perf_counter() - t1  # both passes
    result.variant, result.config = pick(result.timed)
    result.seconds = time.perf_counter() - t0
    return result
