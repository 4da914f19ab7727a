"""Measurement: check a (problem, variant, config) against the reference, then time it.

Two timing modes (DESIGN.md, Measurement): `eager` (back-to-back calls, launch cost included) and
`graph` (the calls captured in a CUDA graph and replayed: launch tax removed; a variant that cannot be
captured, `Variant.capturable` False, is timed eagerly there and marked `extra["timed_eager"]`:
`timed_mode`). Warm-up first, then
the median of many timed batches with device events (`Batches`: confirm-on-first-use times with it
too); input sets rotate when they fit in L2; every rank uses the same counts (agreed by
collectives, since mismatched counts deadlock) and the group keeps the rank-max. A config is timed
only after it matched the float64 reference; a wrong, failing or hanging config is returned as a
failed measurement and never timed.
"""
from __future__ import annotations

import math
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from autofuse.core.modes import supported as supported_modes
from autofuse.comm import status
from autofuse.core.op import Config, InvalidConfig, Op, Problem, Variant, rel_error
from autofuse.core.runner import Handle, Outputs

L2_BYTES = 50 << 20


@dataclass
class Timing:
    """Rank-max statistics of one timing run, microseconds per call."""

    mode: str
    median_us: float
    p10_us: float
    p90_us: float
    min_us: float
    reps: int
    inner: int


@dataclass
class Measurement:
    """(problem, variant, config, mode) -> verdict and latency; identical on every rank."""

    problem: Problem
    variant: str
    config: Config
    mode: str
    ok: bool
    error: str = ""
    rel_error: float = math.nan
    median_us: float = math.nan
    p10_us: float = math.nan
    p90_us: float = math.nan
    min_us: float = math.nan
    reps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d["problem"] = self.problem.key
        return d


def check_faults(world, runner: Callable) -> None:
    """Wait for the device, then raise the fault a runner's workspaces recorded (FlagTimeout), if any.
    Plain callables (no `check`) have nothing to check."""
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)
    check = getattr(runner, "check", None)
    if callable(check):
        check()


def rebuild_workspaces(world) -> None:
    """Clear every workspace fault of `world` (collective, as dispatch.rebuild): after a failed config,
    so that the next config does not find its workspace aborted."""
    from autofuse.comm.workspace import workspaces

    for ws in workspaces(world):
        ws.rebuild()
    world.sync()


def check_correct(world, op: Op, problem: Problem, runner: Callable, seed: int) -> tuple[bool, float, str]:
    """Run twice (the second call into a NaN-poisoned output) and compare to the float64 reference.

    Returns (ok, rel_error, error) agreed by every rank: ok only if every rank is within tolerance.
    """
    err_text = ""
    err = math.inf
    try:
        inputs = op.inputs(world, problem, seed)
        first = runner(*inputs)
        out = nan_like(first)
        runner(*inputs, out=out)
        check_faults(world, runner)
        err = rel_error(out, op.reference(world, problem, seed))
    except (status.FlagTimeout, status.WorkspaceAborted) as exc:
        err_text = str(exc)
    except Exception as exc:  # a config that crashes is a failed measurement, not a failed run
        err_text = f"{type(exc).__name__}: {exc}"
    tol = op.tolerance(problem)
    worst = world.rank_max(err if math.isfinite(err) else 1e300)
    failed_somewhere = world.rank_max(1.0 if err_text else 0.0) > 0
    ok = not failed_somewhere and worst <= tol
    if not ok and not err_text:
        err_text = ("error on another rank" if failed_somewhere
                    else f"wrong result: rel error {worst:.3g} > tolerance {tol:.3g}")
    return ok, worst, err_text


def events_us(fn: Callable[[], Any], inner: int = 1) -> float:
    """Microseconds per call of `fn`, `inner` calls between two CUDA events on the current stream."""
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(inner):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / inner


def _cpu_time(fn: Callable[[], Any], inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) * 1e6 / inner


def _stats(world, mode: str, samples: Sequence[float], inner: int) -> Timing:
    s = sorted(samples)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    mx = lambda v: world.rank_max(v)  # noqa: E731
    return Timing(mode, mx(s[len(s) // 2]), mx(q(0.1)), mx(q(0.9)), mx(s[0]), len(s), inner)


def timed_mode(variant: Variant, mode: str) -> str:
    """The mode `variant` is timed in when `mode` is asked: `eager` for `graph` where the variant cannot be
    captured in a CUDA graph (`Variant.capturable`), since a user's graph cannot contain it and it runs
    eagerly there; else `mode` itself. The measurement keeps the asked mode, marked `timed_eager`."""
    return "eager" if mode == "graph" and not variant.capturable else mode


def eager_mark(variant: Variant, mode: str) -> dict[str, Any]:
    """`{"timed_eager": True}` where `timed_mode` times `variant` eagerly for `mode`, else {}: a Measurement's extra."""
    return {"timed_eager": True} if timed_mode(variant, mode) != mode else {}


class TooSlow(RuntimeError):
    """The projected timing run would exceed its budget (agreed by every rank)."""


class TimingRefused(RuntimeError):
    """Timing was asked for where it means nothing: on ranks that share a GPU."""


NO_SHARED_TIMING = ("timing needs one GPU per rank: ranks that share a GPU (AUTOFUSE_RANKS_PER_GPU, for tests and "
                    "diagnostics) time-slice it, so their timings mean nothing")


def refuse_timing(world) -> None:
    """Raise TimingRefused where `world`'s ranks share a GPU (autofuse.comm.world: several ranks per GPU)."""
    if world.shares_gpu:
        raise TimingRefused(f"refused to time on {world.size} ranks that share a GPU: {NO_SHARED_TIMING}. This "
                            "mode checks correctness and faults only")


def capture(world, fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph on `world`'s device (collective: every rank calls it alike), or
    on the current device with no peers when `world` is None (a single-GPU benchmark).

    `fn` runs once on a side stream first, as torch's graph docs ask, so that lazily made state
    (library handles, workspaces, compiled kernels) exists before capture; the ranks sync around the
    capture so that no rank captures while a peer still runs the warm-up's collectives.
    """
    device = world.device if world is not None else torch.device("cuda", torch.cuda.current_device())
    fence = world.sync if world is not None else (lambda: torch.cuda.synchronize(device))
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    fence()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    fence()
    return graph


class Batches:
    """Timed batches of one step (one call of each of `fns`, rotating input sets): the one timer of
    `time_fn` (tuning, benchmarks) and of `confirm` (first use), so both measure alike.

    Making it warms up `warmup` steps and times one probe step; `inner` (steps per batch, so that a
    batch lasts about `target_batch_us`) comes from the slowest rank's probe, so every rank makes
    the same calls. `start()` readies the timed form (graph mode: captures `inner` steps and replays
    them once); `sample()` times one batch on this rank (device events on GPUs, the host clock on
    CPU) and returns microseconds per call; `stats()` turns samples into rank-max statistics;
    `close()` frees the graph. Every method except `sample` is collective.
    """

    def __init__(self, world, fns: Sequence[Callable[[], Any]] | Callable[[], Any], mode: str = "eager",
                 warmup: int = 3, target_batch_us: float = 2000.0, max_inner: int = 50):
        if mode == "graph" and world.device.type != "cuda":
            raise ValueError("graph mode needs CUDA graphs; on CPU only eager mode exists")
        refuse_timing(world)
        self.world, self.mode = world, mode
        self.fns = [fns] if callable(fns) else list(fns)
        self.timer = events_us if world.device.type == "cuda" else _cpu_time
        self.graph: torch.cuda.CUDAGraph | None = None
        world.sync()
        for _ in range(warmup):
            self.step()
        world.sync()
        self.probe_us = world.rank_max(self.timer(self.step, 1))
        inner = int(max(1, min(max_inner, target_batch_us // max(self.probe_us, 1e-3))))
        self.inner = inner if world.device.type == "cuda" else 1

    def step(self) -> None:
        """One call of each fn (one pass over the input sets)."""
        for f in self.fns:
            f()

    def batch(self) -> None:
        """`inner` steps: what one timed sample runs."""
        for _ in range(self.inner):
            self.step()

    @property
    def batch_s(self) -> float:
        """Projected seconds of one timed batch (from the agreed probe: the same on every rank)."""
        return self.probe_us * 1e-6 * self.inner

    def start(self) -> None:
        """Ready the timed form: in graph mode capture one batch and replay it once."""
        if self.mode == "graph":
            self.graph = capture(self.world, self.batch)
            self.graph.replay()
        self.world.sync()

    def sample(self) -> float:
        """Time one batch on this rank: microseconds per call."""
        per = len(self.fns)
        if self.graph is not None:
            return events_us(self.graph.replay, 1) / (self.inner * per)
        return self.timer(self.step, self.inner) / per

    def stats(self, samples: Sequence[float]) -> Timing:
        """Rank-max statistics of `samples` (collective)."""
        return _stats(self.world, self.mode, samples, self.inner)

    def close(self) -> None:
        """Free the captured graph (collective: the ranks sync after)."""
        self.graph = None
        self.world.sync()


def time_fn(world, fns: Sequence[Callable[[], Any]] | Callable[[], Any], mode: str = "eager",
            warmup: int = 3, reps: int = 20, target_batch_us: float = 2000.0, max_inner: int = 50,
            budget_s: float = math.inf) -> Timing:
    """Time `fns` (one call each per step, rotating input sets) in `mode`; rank-max stats in us/call.

    A batch repeats the rotation `inner` times so that one timed batch lasts about
    `target_batch_us`; `inner` is agreed across ranks from the slowest rank's probe (`Batches`).
    Raises TooSlow (on every rank alike) when the run would take longer than `budget_s`: the ranks
    agree on the smallest rank's budget first (each passes what its own clock left of a measurement's
    budget, and a verdict that differs by rank would leave the others in the timing's collectives).
    """
    if math.isfinite(budget_s):
        budget_s = -world.rank_max(-budget_s)
        if budget_s <= 0:
            raise TooSlow(f"no time left for {mode} timing: building and checking took the measurement's "
                          f"budget ({-budget_s:.1f} s over it)")
    b = Batches(world, fns, mode, warmup, target_batch_us, max_inner)
    if b.probe_us * 1e-6 * (b.inner * reps + warmup) > budget_s:
        raise TooSlow(f"{mode} timing would take {b.batch_s * reps:.1f} s > budget {budget_s:.0f} s")
    b.start()
    samples = [b.sample() for _ in range(reps)]
    b.close()
    return b.stats(samples)


def reps_within(budget_s: float, round_s: float, reps: int) -> int:
    """Timed batches per timer: `reps`, fewer when `reps` rounds of every timer's batch
    (`round_s` seconds for one batch of each) would exceed `budget_s`, but at least one."""
    if budget_s == math.inf:
        return max(1, reps)
    return max(1, min(reps, int(budget_s / max(round_s, 1e-9))))


def split_rounds(reps: int, rounds: int) -> list[int]:
    """Batches per round for `reps` batches over at most `rounds` rounds (never an empty round)."""
    rounds = max(1, min(rounds, reps))
    base, extra = divmod(reps, rounds)
    return [base + (1 if i < extra else 0) for i in range(rounds)]


def time_in_turns(world, steps: Sequence[Sequence[Callable[[], Any]] | Callable[[], Any]],
                  mode: str | Sequence[str] = "eager",
                  reps: int = 20, warmup: int = 3, rounds: int = 3,
                  budget_s: float = math.inf) -> tuple[list[Timing], list[int]]:
    """Rank-max timings of several things to compare (`steps[i]`: what `time_fn` takes), taken in turns.

    `mode`: one for all, or one per step (e.g. `timed_mode` of each candidate's variant: graph for
    some, eager for those that cannot be captured). Each gets a `Batches` timer; their `reps` batches (fewer when the projected timed batches of all
    would exceed `budget_s`, at least one each) are spread over `rounds` rounds, the order reversed
    every other round, so that a drift of clocks, temperature or host load during the run is shared
    by all of them rather than charged to whichever ran last. Each turn starts with a barrier and
    one untimed step, so that no turn's first batch pays for waking the host or for a peer still in
    the last turn. Returns the timings and the batches per round. Collective: every rank passes the
    same counts.
    """
    modes = [mode] * len(steps) if isinstance(mode, str) else list(mode)
    if len(modes) != len(steps):
        raise ValueError(f"time_in_turns: {len(modes)} modes for {len(steps)} steps")
    batches = [Batches(world, fns, m, warmup) for fns, m in zip(steps, modes)]
    plan = split_rounds(reps_within(budget_s, sum(b.batch_s for b in batches), reps), rounds)
    for b in batches:
        b.start()
    samples: list[list[float]] = [[] for _ in batches]
    for r, count in enumerate(plan):
        order = range(len(batches)) if r % 2 == 0 else range(len(batches) - 1, -1, -1)
        for i in order:
            world.sync()
            batches[i].step()
            samples[i].extend(batches[i].sample() for _ in range(count))
    for b in batches:
        b.close()
    return [b.stats(s) for b, s in zip(batches, samples)], plan


def rotation_count(input_bytes: int, l2_bytes: int = L2_BYTES) -> int:
    """How many input sets to rotate through so repeated calls do not run from L2."""
    return 1 if input_bytes >= 2 * l2_bytes else min(8, max(2, math.ceil(2 * l2_bytes / max(input_bytes, 1))))


def nan_like(out: Any) -> Any:
    """A fresh output like `out` (a tensor, or `Outputs`: a handle becomes a new empty Handle of its key)
    holding NaN (integers: -1): what a check writes into to see that a call wrote every element."""
    if isinstance(out, Outputs):
        return Outputs(out.names, [Handle(v.key) if isinstance(v, Handle) else nan_like(v) for v in out])
    return torch.full_like(out, math.nan if out.is_floating_point() else -1)


def poison(out: Any) -> None:
    """NaN into `out`'s floating tensors (a tensor or `Outputs`), -1 into integer ones."""
    for t in (out if isinstance(out, Outputs) else (out,)):
        if isinstance(t, torch.Tensor):
            t.fill_(math.nan if t.is_floating_point() else -1)


def nbytes(tensors: Sequence[Any]) -> int:
    """Bytes of the tensors among `tensors` (other arguments count nothing): what rotation sizes by."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def build_checked(world, op: Op, problem: Problem, variant: str, config: Config,
                  seed: int = 0) -> tuple[Any, str, float]:
    """Build `variant` at `config` for `problem` and check it against the float64 reference (collective).

    Returns (runner, "", rel_error) where it is valid, builds and is right on every rank, else
    (None, why, rel_error) on every rank alike; after a wrong or failing call the workspaces are
    rebuilt, so the next config does not find them aborted. What `measure` times and what any
    comparison of candidates should time: nothing unchecked.
    """
    v = op.variant(variant)
    why_not = v.unavailable(world)
    reason = v.check(problem, config) if why_not is None else f"{variant} is not available: {why_not}"
    if reason:
        return None, f"invalid config: {reason}", math.nan
    try:
        runner = v.build(world, problem, config)
        build_error = ""
    except InvalidConfig as exc:
        runner, build_error = None, f"invalid config: {exc}"
    except Exception as exc:
        runner, build_error = None, f"build failed: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
    if world.rank_max(1.0 if build_error else 0.0) > 0:
        return None, build_error or "build failed on another rank", math.nan
    ok, err, why = check_correct(world, op, problem, runner, seed)
    if not ok:
        rebuild_workspaces(world)
        return None, why, err
    return runner, "", err


def timing_steps(world, op: Op, problem: Problem, runner: Callable,
                 seed: int) -> tuple[list[Callable[[], Any]], list[torch.Tensor]]:
    """(the calls a timing run makes, their outputs): one call per input set (seeds `seed`, `seed` + 1,
    ...), each writing its own output; on GPUs as many sets as `rotation_count` asks so that repeated
    calls do not run from L2 (the CPU emulation has no such cache effect worth 8x the calls)."""
    sets = rotation_count(nbytes(op.inputs(world, problem, seed))) if world.device.type == "cuda" else 1
    inputs = [op.inputs(world, problem, seed + i) for i in range(sets)]
    outs = [runner(*x) for x in inputs]
    return [lambda x=x, o=o: runner(*x, out=o) for x, o in zip(inputs, outs)], outs


def measure(world, op: Op, problem: Problem, variant: str, config: Config, modes: Sequence[str] | None = None,
            seed: int = 0, reps: int = 20, warmup: int = 3, budget_s: float = 60.0) -> list[Measurement]:
    """Build, check, then time one (problem, variant, config) in each mode; never raises for a bad config.

    The output of the timed calls (in graph mode: of the graph's replays) is checked against the
    reference too, so a config that is right once but wrong when replayed never gets a time.

    Returns one Measurement per mode (ok=False with the reason when the config is invalid, crashes,
    times out on a flag, is wrong, or would exceed `budget_s`). Every rank must call it with the same
    arguments; every rank returns the same verdicts and the rank-max timings. Raises TimingRefused
    on ranks that share a GPU.
    """
    refuse_timing(world)  # before anything: a refusal is not a failed config
    modes = tuple(modes or supported_modes(world.device.type))
    fail = lambda why, err=math.nan: [Measurement(problem, variant, dict(config), m, False, why, err)  # noqa: E731
                                      for m in modes]
    t0 = time.perf_counter()
    runner, why, err = build_checked(world, op, problem, variant, config, seed)
    if runner is None:
        return fail(why, err)
    first_call_s = world.rank_max(time.perf_counter() - t0)
    fns, outs = timing_steps(world, op, problem, runner, seed + 1)
    return [_time_mode(world, op, problem, variant, config, runner, fns, outs, mode, reps, warmup,
                       budget_s - (time.perf_counter() - t0), err, seed, {"build_check_s": first_call_s})
            for mode in modes]


# -- staged measurement and re-measurement in turns (the tuner's; `measure` above times each mode with `_time_mode` too)

@dataclass
class Screen:
    """A first, short timing in one mode (`reps` batches): a config slower than `keep_below_us` there is
    rejected on it (successive halving); one at or below it is timed again with full reps in every mode."""

    mode: str
    reps: int
    keep_below_us: float


def _time_mode(world, op: Op, problem: Problem, variant: str, config: Config, runner: Callable,
               fns: Sequence[Callable[[], Any]], outs: Sequence[torch.Tensor], mode: str, reps: int, warmup: int,
               budget_s: float, err: float, seed: int, extra: dict[str, Any]) -> Measurement:
    """One mode's timing of a built, checked runner, as `measure` times it (the output of the timed calls
    checked again); `extra` gains `timing_s`, the seconds this rank spent timing, and `timed_eager` where
    the variant cannot be captured and `mode` is graph (`timed_mode`: timed eagerly, stored as graph)."""
    why = ""
    t0 = time.perf_counter()
    v = op.variant(variant)
    try:
        poison(outs[0])
        t = time_fn(world, fns, timed_mode(v, mode), warmup=warmup, reps=reps, budget_s=budget_s)
        check_faults(world, runner)
        replayed = rel_error(outs[0], op.reference(world, problem, seed + 1))
        if not replayed <= op.tolerance(problem):
            why = (f"wrong result after {mode} timing: rel error {replayed:.3g} > tolerance "
                   f"{op.tolerance(problem):.3g}")
    except (status.FlagTimeout, status.WorkspaceAborted, TooSlow) as exc:
        why = str(exc)
    except Exception as exc:
        why = f"{mode} timing failed: {type(exc).__name__}: {exc}"
    if world.rank_max(1.0 if why else 0.0) > 0:
        rebuild_workspaces(world)
        return Measurement(problem, variant, dict(config), mode, False, why or "failed on another rank", err)
    return Measurement(problem, variant, dict(config), mode, True, "", err, t.median_us, t.p10_us, t.p90_us,
                       t.min_us, t.reps, {**extra, "inner": t.inner, "sets": len(fns), **eager_mark(v, mode),
                                          "timing_s": round(time.perf_counter() - t0, 4)})


def measure_staged(world, op: Op, problem: Problem, variant: str, config: Config, modes: Sequence[str] | None = None,
                   seed: int = 0, reps: int = 20, warmup: int = 3, budget_s: float = 60.0,
                   screen: Screen | None = None) -> list[Measurement]:
    """`measure` with an optional screen (successive halving): build and check once; with `screen`,
    time its mode with its few reps first and return that one row (extra `screen`: True) where the
    config is slower than `screen.keep_below_us` or fails; otherwise (and without a screen) time every
    mode with `reps`, as `measure` does. The verdict compares rank-max medians with a threshold every
    rank was given, so every rank takes the same branch. Collective; never raises for a bad config."""
    refuse_timing(world)
    modes = tuple(modes or supported_modes(world.device.type))
    t0 = time.perf_counter()
    runner, why, err = build_checked(world, op, problem, variant, config, seed)
    if runner is None:
        return [Measurement(problem, variant, dict(config), m, False, why, err) for m in modes]
    extra: dict[str, Any] = {"build_check_s": world.rank_max(time.perf_counter() - t0)}
    fns, outs = timing_steps(world, op, problem, runner, seed + 1)
    left = lambda: budget_s - (time.perf_counter() - t0)  # noqa: E731
    if screen is not None:
        first = _time_mode(world, op, problem, variant, config, runner, fns, outs, screen.mode, screen.reps,
                           min(warmup, 1), left(), err, seed, {**extra, "screen": True})
        if not first.ok or first.median_us > screen.keep_below_us:
            return [first]
        extra["screened_us"] = first.median_us
    return [_time_mode(world, op, problem, variant, config, runner, fns, outs, m, reps, warmup, left(), err, seed,
                       extra) for m in modes]


def measure_in_turns(world, op: Op, problem: Problem, candidates: Sequence[tuple[str, Config]],
                     modes: Sequence[str] | None = None, seed: int = 0, reps: int = 20, warmup: int = 3,
                     rounds: int = 3) -> list[list[Measurement]]:
    """Re-measure `candidates` ((variant, config) pairs, e.g. a problem's BSP and its best) in turns
    (`time_in_turns`, in each mode), so a drift during the run is shared by all of them: per candidate,
    one Measurement per mode with extra `confirmed`: True (the store then prefers it to the config's
    earlier rows; `timed_eager` as `_time_mode` marks it). A candidate that no longer builds or checks gets failed rows; where the timing
    itself fails, nothing is returned ([]). Collective."""
    refuse_timing(world)
    modes = tuple(modes or supported_modes(world.device.type))
    built = [build_checked(world, op, problem, v, c, seed) for v, c in candidates]
    if any(r is None for r, _, _ in built):
        return [[Measurement(problem, v, dict(c), m, False, why, err) for m in modes] if r is None else []
                for (v, c), (r, why, err) in zip(candidates, built)]
    steps = [timing_steps(world, op, problem, r, seed + 1)[0] for r, _, _ in built]
    variants = [op.variant(v) for v, _ in candidates]
    out: list[list[Measurement]] = [[] for _ in candidates]
    for mode in modes:
        why = ""
        try:
            timings, plan = time_in_turns(world, steps, [timed_mode(v, mode) for v in variants], reps=reps,
                                          warmup=warmup, rounds=rounds)
            for r, _, _ in built:
                check_faults(world, r)
        except Exception as exc:  # noqa: BLE001 - agreed below; nothing is stored
            why = f"{type(exc).__name__}: {exc}"
        if world.rank_max(1.0 if why else 0.0) > 0:
            rebuild_workspaces(world)
            return []
        for i, ((v, c), (_, _, err), t) in enumerate(zip(candidates, built, timings)):
            out[i].append(Measurement(problem, v, dict(c), mode, True, "", err, t.median_us, t.p10_us, t.p90_us,
                                      t.min_us, t.reps, {"confirmed": True, "turns": plan, "inner": t.inner,
                                                         "sets": len(steps[i]), **eager_mark(variants[i], mode)}))
    return out
