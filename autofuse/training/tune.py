"""Tuning on every rank: an Optuna search per problem over the tunable variants' configs (DESIGN.md, Tuning).

- **Plan**: the ops (every registered one by default), their problems (the device's sweep, or
  `--shapes`) and world sizes; `describe_plan` says what will run, on what, and roughly how long.
- **Ranks**: rank 0 owns the studies (`training.study.StudyDriver`) and the store; it broadcasts each
  trial's (variant, config) and every rank builds, checks and times it with `measure.measure`
  (identical verdicts and rank-max timings on every rank). Every timing mode the World has is
  recorded per trial (eager and graph on CUDA); the study optimises one of them (`mode`).
- **Variants**: the tunable ones (families `hybrid` and `fused`: they have a search space) are
  searched; the others (`bsp`, `peer` such as torch_symm) are baselines, measured once per problem
  at their default configs (source 'baseline'). At world size 1 an op has nothing to communicate:
  only its baselines are measured (the base of strong scaling), so one GPU tunes nothing. A config
  the World's heap refuses (`Variant.refuses`) is pruned before launch, never measured.
- **Budget**: `trials` counts measured trials per study (pruned and already-known configs are free),
  across runs and workers; on CPU it defaults to one per tunable variant, so every variant's first
  known-good config is measured on every problem. A run also stops after many asks in a row found
  nothing new (small spaces), at its time limit, or on a signal (`training.lifecycle`).
- **Compile time**: Triton compiles a config's kernels on its first call, inside `measure`'s
  build + check, which every rank does at the same time; the timed reps run after it, so compile
  time never enters a latency. It is recorded per row (`extra.build_check_s`) and reported per
  problem. Kernels are not compiled ahead on a thread: a variant's build allocates on the
  symmetric heap, which must happen in the same order on every rank, and Triton's own cache makes
  a resumed or repeated study skip the compiles it already did.
- **Setup errors** (database or Optuna storage not writable) are found by rank 0 before anything is
  measured and raised on every rank alike (`SetupError`), so no rank waits alone in a collective.
"""
from __future__ import annotations

import importlib
import math
import time
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Sequence

import optuna
import torch
import torch.distributed as dist

from autofuse.measure import environment
from autofuse.core import registry
from autofuse.core import modes
from autofuse.measure.timing import NO_SHARED_TIMING, measure
from autofuse.core.op import Op, Problem
from autofuse.measure.store import Store, StoreError, config_id, describe_stale
from autofuse.training.lifecycle import STOP, ParentLink
from autofuse.training.progress import Progress, first_line
from autofuse.training.storage import check_writable, default_storage, open_storage
from autofuse.training.study import Job, StudyDriver, study_name

if TYPE_CHECKING:
    from autofuse.comm.world import World

DEFAULTS = {  # per device type: trials per study (None: one per tunable variant), timed reps, warm-up calls,
    # s per trial, problems per op and world size (None: the whole sweep)
    "cpu": {"trials": None, "reps": 5, "warmup": 0, "budget_s": 120.0, "limit": 2},  # the interpreter: slow
    "cuda": {"trials": 8, "reps": 10, "warmup": 3, "budget_s": 20.0, "limit": None},  # default sweep: ~10 per op
}
# Rough seconds per measured trial and per baseline, and to start the ranks: for `describe_plan` only.
ESTIMATE_S = {"cpu": (2.0, 1.0, 15.0), "cuda": (1.5, 0.5, 30.0)}
DEPRECATIONS = (  # torch deprecations the ops trigger on every rank: said once by the lead's ops, not 7x here
    r".*`torch\.distributed\.all_gather_into_tensor` is deprecated",
    r".*`enable_symm_mem_for_group` is deprecated",
)


class SetupError(RuntimeError):
    """The run cannot start (database, Optuna storage): raised on every rank before any measuring."""


@dataclass
class Settings:
    """What `autofuse tune` was asked to do; plain data, sent to every rank."""

    db: str
    ops: list[str] = field(default_factory=list)
    sweep: str = ""
    shapes: list[str] = field(default_factory=list)
    worlds: list[int] = field(default_factory=list)
    mode: str | None = None
    trials: int | None = None
    storage: str | None = None
    reps: int | None = None
    warmup: int | None = None
    budget_s: float | None = None
    seed: int = 0
    time_limit_s: float | None = None
    verbose: bool = True
    limit: int | None = None

    def value(self, name: str, device_type: str) -> Any:
        given = getattr(self, name)
        return DEFAULTS[device_type][name] if given is None else given

    def trials_for(self, device_type: str, variants: Sequence[str]) -> int:
        """Measured trials per study: --trials, else the device's default (CPU: one per tunable variant)."""
        n = self.value("trials", device_type)
        return len(variants) if n is None else int(n)

    def mode_for(self, device_type: str) -> str:
        return self.mode or modes.default(device_type)

    def storage_url(self) -> str:
        return self.storage or default_storage(self.db)

    def validate(self, device_type: str, ranks: int) -> None:
        """Raise ValueError (one line, naming the option) for settings no run can take."""
        supported = modes.supported(device_type)
        if self.mode is not None and self.mode not in modes.MODES:
            raise ValueError(f"--mode must be one of {', '.join(modes.MODES)}, not {self.mode!r}")
        if self.mode_for(device_type) not in supported:
            raise ValueError(f"--mode {self.mode_for(device_type)} needs CUDA graphs, and this machine has no GPU: "
                             f"the CPU emulation times {' and '.join(supported)} mode only (use --mode eager)")
        if self.trials is not None and self.trials < 1:
            raise ValueError(f"--trials must be at least 1, not {self.trials}")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"--limit must be 0 (every problem) or more, not {self.limit}")
        if any(w < 1 for w in self.worlds):
            raise ValueError(f"--world sizes must be at least 1, not {min(self.worlds)}")
        if device_type == "cuda" and self.worlds and max(self.worlds) > ranks:
            raise ValueError(f"--world {max(self.worlds)} needs {max(self.worlds)} GPUs; {ranks} are visible "
                             f"({NO_SHARED_TIMING})")
        if self.reps is not None and self.reps < 1:
            raise ValueError(f"--reps must be at least 1, not {self.reps}")
        if self.budget_s is not None and not self.budget_s > 0:
            raise ValueError(f"--budget must be a positive number of seconds, not {self.budget_s}")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ValueError(f"--time-limit must be a positive number of minutes, not {self.time_limit_s / 60:g}")


def resolve_op(name: str) -> Op:
    """A registered op by name, or any Op object given as 'module:attribute'."""
    if ":" in name:
        module, attr = name.split(":", 1)
        return getattr(importlib.import_module(module), attr)
    return registry.get(name)


def problems_for(op: Op, sweep: str, world: int, shapes: Sequence[str] = ()) -> list[Problem]:
    """The problems to tune: the sweep, or `shapes`.

    Each shape is a full problem key ('ag_gemm|K=64,M=64,N=64|float32|w2'), sizes that override
    the sweep's first problem ('M=64,N=64,K=64'), or M (or batch) values that filter the sweep
    ('64,128', as `autofuse bench --shapes`).
    """
    base = op.sweep(sweep, world)
    if not shapes:
        return base
    out: list[Problem] = []
    for shape in shapes:
        if "|" in shape:
            out.append(Problem.from_key(shape))
        elif "=" in shape:
            if not base:
                raise ValueError(f"{op.name}: sweep {sweep!r} has no problem to take the other sizes from")
            dims = dict(base[0].dims)
            for item in shape.split(","):
                k, v = item.split("=")
                dims[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
            out.append(Problem.make(op.name, base[0].dtype, world, **dims))
        else:
            keep = {int(s) for s in shape.split(",") if s.strip()}
            out.extend(p for p in base if p.get("M", p.get("B")) in keep)
    return list(dict.fromkeys(p for p in out if p.op == op.name and p.world == world))


def _available(v: Any, world: World) -> bool:
    try:
        return bool(v.available(world))
    except Exception:  # noqa: BLE001 - a stand-in world (the plan, in the parent) may lack what it checks
        return True


def tunable_variants(op: Op, world: World) -> list[str]:
    """The variants searched (hybrid and fused: they have a search space) that can run on `world`; none at
    world size 1, where an op has nothing to communicate (its baselines are the base of strong scaling)."""
    if world.size == 1:
        return []
    return [n for n, v in op.variants.items() if v.tunable and _available(v, world)]


def baseline_variants(op: Op, world: World) -> list[str]:
    """The variants measured once per problem at their defaults (bsp, peer)."""
    return [n for n, v in op.variants.items() if not v.tunable and _available(v, world)]


# -- the plan ----------------------------------------------------------------------------------------

@dataclass
class Plan:
    """What a run will tune: per world size and op, the problems and the tunable variants."""

    device_type: str
    mode: str
    sweep: str
    worlds: list[int]
    items: list[tuple[int, Op, list[Problem], list[str]]]

    @property
    def problems(self) -> int:
        return sum(len(ps) for _, _, ps, _ in self.items)

    def trials(self, settings: Settings) -> int:
        return sum(len(ps) * settings.trials_for(self.device_type, vs) for _, _, ps, vs in self.items if vs)


def make_plan(settings: Settings, device_type: str, ranks: int) -> Plan:
    """The run's plan on `ranks` local ranks (raises ValueError / KeyError for unknown ops, sweeps, shapes)."""
    mode = settings.mode_for(device_type)
    sweep = settings.sweep or ("default" if device_type == "cuda" else "cpu")
    worlds = sorted(set(settings.worlds or [ranks]))
    if worlds[-1] > ranks or worlds[0] < 1:
        raise ValueError(f"world sizes {worlds} must be within 1..{ranks}")
    ops = [resolve_op(n) for n in (settings.ops or registry.names())]
    limit = settings.value("limit", device_type) or None  # 0: every problem
    items = []
    for w in worlds:
        stand_in = SimpleNamespace(device=torch.device(device_type), size=w, rank=0)
        for op in ops:
            if sweep == "scaling" and device_type == "cpu":
                problems = cpu_scaling(op, w, worlds[-1], settings.shapes)
            else:
                problems = problems_for(op, sweep, w, settings.shapes)
            items.append((w, op, problems[:limit], tunable_variants(op, stand_in)))
    return Plan(device_type, mode, sweep, worlds, items)


def cpu_scaling(op: Op, world: int, largest: int, shapes: Sequence[str] = ()) -> list[Problem]:
    """Strong scaling on the CPU emulation: the `cpu` sweep's problems at the largest world size, each
    at `world` with the same global sizes (the op's `per_rank` dims times the world), where they divide.
    The `scaling` sweep itself holds GPU-sized problems the interpreter cannot run in reasonable time."""
    out = []
    for p in problems_for(op, "cpu", largest, shapes):
        dims = dict(p.dims)
        if all(isinstance(dims[k], int) and dims[k] * largest % world == 0 for k in op.per_rank if k in dims):
            dims.update({k: dims[k] * largest // world for k in op.per_rank if k in dims})
            out.append(Problem.make(op.name, p.dtype, world, **dims))
    return out


def describe_plan(plan: Plan, settings: Settings, ranks: int) -> str:
    """One line: what will be tuned, on what, in which mode, into which database, and roughly how long."""
    per_op: dict[str, int] = {}
    for _, op, ps, _ in plan.items:
        per_op[op.name] = per_op.get(op.name, 0) + len(ps)
    trials = plan.trials(settings)
    per_trial, per_baseline, start = ESTIMATE_S[plan.device_type]
    only_base = sorted({w for w, _, ps, vs in plan.items if ps and not vs})
    seconds = start + trials * per_trial + plan.problems * 1.5 * per_baseline
    rough = "under a minute" if seconds < 60 else f"about {math.ceil(seconds / 60)} min"
    where = (f"{ranks} CPU ranks (Triton interpreter, gloo, shared-memory heap)" if plan.device_type == "cpu"
             else f"{ranks} GPU{'s' if ranks > 1 else ''}")
    trials_text = (f"{settings.trials} trials per problem" if settings.trials is not None
                   else "one trial per tunable variant per problem" if plan.device_type == "cpu"
                   else f"{DEFAULTS['cuda']['trials']} trials per problem")
    limit = settings.value("limit", plan.device_type)
    sweep = f"sweep {plan.sweep}" + (f" (its first {limit} problems per op; --limit 0: all)" if limit else "")
    base = (f"; world {', '.join(map(str, only_base))}: baselines only (nothing to communicate)" if only_base else "")
    return (f"tuning {plan.problems} problems ({', '.join(f'{k} {v}' for k, v in per_op.items())}) at world "
            f"{', '.join(map(str, plan.worlds))} on {where}, {sweep}: baselines, then {trials_text} ({trials} in all"
            f"{base}), {plan.mode} mode, {rough} if nothing is stored yet; database {settings.db}")


# -- collectives -------------------------------------------------------------------------------------

def _bcast(world: World, obj: Any) -> Any:
    box = [obj if world.rank == 0 else None]
    dist.broadcast_object_list(box, src=world.global_ranks[0], group=world.group)
    return box[0]


# -- the loop, on every rank ------------------------------------------------------------------------

@dataclass
class RunState:
    """What one rank's run carries from problem to problem (the store, storage and progress on rank 0)."""

    fingerprint: dict
    digests: dict[str, str]
    deadline: float | None
    supervised: bool
    stopped: bool = False
    store: Store | None = None
    storage: optuna.storages.RDBStorage | None = None
    progress: Progress | None = None


def _measure_baselines(world: World, op: Op, problem: Problem, mode: str, settings: Settings, state: RunState) -> None:
    dev = world.device.type
    jobs = None
    if world.rank == 0:
        assert state.store is not None
        hw, digest = state.fingerprint["hardware_id"], state.digests[op.name]
        jobs = [(v, cfg) for v in baseline_variants(op, world) for cfg in op.variants[v].defaults(problem)
                if state.store.lookup(problem.key, config_id(op.name, v, cfg), mode, hardware_id=hw,
                                      op_digest=digest) is None]
    for variant, cfg in _bcast(world, jobs):
        results = measure(world, op, problem, variant, cfg, modes=modes.supported(dev), seed=settings.seed,
                          reps=settings.value("reps", dev), warmup=settings.value("warmup", dev),
                          budget_s=settings.value("budget_s", dev))
        if world.rank == 0:
            assert state.store is not None and state.progress is not None
            state.store.add(results, state.fingerprint, source="baseline", op_digest=state.digests[op.name])
            state.progress.baseline(problem, variant, next(m for m in results if m.mode == mode))


def _summary_row(state: RunState, op: Op, problem: Problem, mode: str, driver: StudyDriver | None,
                 seconds: float, device_kind: str) -> dict:
    """The problem's line of the run's summary: each variant's best latency and config so far, and the
    numbers of autofuse.measure.compare (no ratio for interpreter timings)."""
    from autofuse.measure.compare import compare, interpreted

    assert state.store is not None
    rows = sorted((r for r in state.store.best(op.name, mode, hardware_id=state.fingerprint["hardware_id"],
                                                op_digest=state.digests[op.name]) if r["problem"] == problem.key),
                  key=lambda r: r["median_us"])
    us = {r["variant"]: r["median_us"] for r in rows}
    return {"problem": problem.key, "op": op.name, "mode": mode, "device_kind": device_kind, "variants_us": us,
            "configs": {r["variant"]: r["config"] for r in rows},
            **compare(op, us, is_interpreted=interpreted(device_kind)).as_dict(),
            "trials_this_run": driver.measured_here if driver else 0,
            "compile_s": round(driver.compile_s, 2) if driver else 0.0, "seconds": round(seconds, 1),
            "study": driver.name if driver else study_name(problem, mode, state.fingerprint["hardware_id"],
                                                            state.digests[op.name])}


def _should_stop(world: World, state: RunState) -> bool:
    """A signal on any rank, or rank 0's time limit: agreed by every rank (a collective)."""
    late = world.rank == 0 and state.deadline is not None and time.monotonic() > state.deadline
    if world.rank_max(1.0 if STOP.requested or late else 0.0) > 0:
        state.stopped = True
    return state.stopped


def _tune_problem(world: World, op: Op, problem: Problem, mode: str, settings: Settings, state: RunState) -> dict | None:
    dev = world.device.type
    t0 = time.monotonic()
    if _should_stop(world, state):
        return None
    _measure_baselines(world, op, problem, mode, settings, state)
    variants = tunable_variants(op, world)
    driver = None
    if world.rank == 0 and variants:
        assert state.store is not None and state.storage is not None and state.progress is not None
        driver = StudyDriver(state.storage, state.store, state.fingerprint, op, problem, mode, variants,
                             settings.trials_for(dev, variants), state.digests[op.name], settings.seed, world=world)
        state.progress.expect(-min(driver.initially_measured, driver.trials))
    while not _should_stop(world, state):
        job: Job | None = driver.next(state.deadline) if driver is not None else None
        job = _bcast(world, job)
        if job is None:
            break
        try:
            results = measure(world, op, problem, job.variant, job.config, modes=modes.supported(dev), seed=settings.seed,
                              reps=settings.value("reps", dev), warmup=settings.value("warmup", dev),
                              budget_s=settings.value("budget_s", dev))
        except KeyboardInterrupt:
            if driver is not None:
                driver.abandon()
            raise
        if driver is not None:
            assert state.progress is not None
            state.progress.trial(problem, job, driver.finish(job, results), driver.best())
    if world.rank != 0:
        return None
    if driver is not None:
        assert state.progress is not None
        state.progress.expect(-max(0, driver.trials - min(driver.initially_measured, driver.trials)
                                   - driver.measured_here))
    return _summary_row(state, op, problem, mode, driver, time.monotonic() - t0, dev)


def quiet_warnings() -> None:
    """Optuna's experimental notes and the torch deprecations the ops trigger, once per rank and
    location, add nothing to a tuning log."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    for message in DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message)


def tune_rank(world: World, settings: Settings, link: ParentLink | None = None) -> list[dict]:
    """Run on every rank of `world` (spawned or torchrun); rank 0 returns the summary rows.

    `link` is given by `autofuse tune` when it spawned the ranks: signals then go to the parent,
    which relays its stop level (training.lifecycle). Without it (torchrun), this process handles
    SIGINT and SIGTERM itself. CPU ranks need TRITON_INTERPRET=1 before Triton is imported (spawn
    and the CLI set it).
    """
    quiet_warnings()
    if link is None:
        STOP.reset()
    STOP.install(supervised=link is not None)
    try:
        return _tune(world, settings, supervised=link is not None)
    except KeyboardInterrupt:
        if link is None:
            raise
        raise SystemExit(STOP.exit_code() or 130) from None  # abandoned on the parent's word: no traceback
    finally:
        STOP.uninstall()


def _open_rank0(settings: Settings, fp: dict) -> tuple[Store | None, Any, str | None]:
    """Rank 0 opens the store and Optuna's storage and checks both can be written."""
    store = None
    try:
        store = Store.open(settings.db, fingerprint=fp)
        storage = open_storage(settings.storage_url())
        check_writable(storage)
        return store, storage, None
    except StoreError as exc:
        return None, None, str(exc)
    except Exception as exc:  # noqa: BLE001 - Optuna / SQLAlchemy errors: one line, every rank raises it
        if store is not None:
            store.close()
        return None, None, f"cannot write the Optuna storage {settings.storage_url()}: {first_line(str(exc), 300)}"


def _tune(world: World, settings: Settings, supervised: bool) -> list[dict]:
    dev = world.device.type
    settings.validate(dev, world.size)
    plan = make_plan(settings, dev, world.size)
    fp = environment.fingerprint(dev)
    ops = {op.name: op for _, op, _, _ in plan.items}
    state = RunState(fingerprint=fp, digests={name: environment.op_digest(op) for name, op in ops.items()},
                     deadline=time.monotonic() + settings.time_limit_s if settings.time_limit_s else None,
                     supervised=supervised)
    error = None
    if world.rank == 0:
        state.store, state.storage, error = _open_rank0(settings, fp)
    error = _bcast(world, error)
    if error:
        raise SetupError(error)
    summary: list[dict] = []
    if world.rank == 0:
        assert state.store is not None
        state.progress = progress = Progress(plan.trials(settings), settings.verbose)
        if not supervised:
            progress.log(describe_plan(plan, settings, world.size))
        note = describe_stale(state.store.stale())
        if note:
            progress.log(note, style="yellow")
    try:
        for w, op, problems, _ in plan.items:
            sub = world.sub(w)
            if sub is not None and not state.stopped:
                for problem in problems:
                    row = _tune_problem(sub, op, problem, plan.mode, settings, state)
                    if row is not None:
                        summary.append(row)
                    if state.stopped:
                        break
            state.stopped = world.rank_max(1.0 if state.stopped else 0.0) > 0
    finally:
        if world.rank == 0:
            if state.progress is not None:
                state.progress.close()
            if state.store is not None:
                state.store.close()
    if world.rank == 0 and state.stopped and state.progress is not None:
        state.progress.log("stopped early: what was measured is stored; rerun the same command to resume",
                           style="yellow")
    return summary
