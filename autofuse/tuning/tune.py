"""Tuning on every rank: the whole run planned first, then measured in the order `tuning.schedule` picks
(DESIGN.md, Tuning and store).

- **Plan**: the ops (every registered one by default), their problems (the device's sweep, `--shapes`, or
  `--sweep stored`: the problems the database holds for this hardware and world size, any code of their
  op, `stored_problems`) and world sizes; `describe_plan` says what will run, on what, and roughly how
  long, and rank 0 how many problems hold rows of older code of their op (`describe_previous`).
- **Order** (`tuning.schedule.Scheduler`, rank 0): coverage rounds interleaving the ops (each
  problem's baselines and its previous winner, where older code of the op measured it, else every
  tunable variant's first default), then every problem's other previous winners, then the other
  defaults, then a sampled search where the gap between a problem's best and runner-up is smallest; trials after
  coverage are screened with few reps and re-timed with full reps in every mode only if within a few
  % of the problem's best. A run cut short at any moment has covered the ops evenly.
- **Ranks**: rank 0 owns the studies (`tuning.study.StudyDriver`, one per problem), the store and the
  scheduler; it broadcasts each step, every rank builds, checks and times it
  (`measure.timing.measure_staged`: identical verdicts and rank-max timings on every rank). World sizes
  below the job's run on the sub-worlds of its first ranks (made once, in order, on every rank).
- **Variants**: the tunable ones (families `hybrid` and `fused`: they have a search space) are
  searched; the others (`bsp`, `peer` such as torch_symm) are baselines, measured once per problem
  at their default configs (source 'baseline'). At world size 1 an op has nothing to communicate:
  only its baselines are measured (the base of strong scaling), so one GPU tunes nothing. A config
  the World's heap refuses (`Variant.refuses`) is pruned before launch, never measured.
- **Budget**: on GPUs a run is budgeted by default (`DEFAULTS['cuda']['time_limit_s']`, `--time-limit`;
  0: none), with at most `trials` measured trials per study; `--trials` without `--time-limit` runs
  exactly that many per study (pruned and already-known configs are free), across runs and workers. On
  CPU it defaults to one per tunable variant, so every variant's first known-good config is measured
  on every problem. Coverage round 0 is always completed, whatever the time limit, so every op gets an
  entry `autofuse fit` can use; a signal stops after the current step (`tuning.lifecycle`).
- **Outliers**: a problem whose x BSP deviates from its neighbours' gets its BSP and best re-measured
  in turns (`measure.timing.measure_in_turns`), stored marked `confirmed` (the store prefers them).
- **Throughput**: on GPUs the known-good configs of the coverage and defaults passes, and in the search
  each study's next sampled trial (asked ahead while the current one is measured: `tuning.schedule`),
  are compiled ahead in child processes (`tuning.compile_ahead`) into Triton's on-disk cache, so a rank's
  first call of a config loads its kernels instead of compiling them while the GPUs wait (builds themselves stay on
  the ranks: they allocate on the symmetric heap, in the same order on every rank). References are
  computed once per problem and seed on each rank. The summary reports trials per second and the
  share of wall time the ranks spent timing (`extra.timing_s` per row) and compiling and checking
  (`extra.build_check_s`).
- **Setup errors** (database or Optuna storage not writable) are found by rank 0 before anything is
  measured and raised on every rank alike (`SetupError`), so no rank waits alone in a collective.
"""
from __future__ import annotations

import dataclasses
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
from autofuse.measure.timing import NO_SHARED_TIMING, Screen, measure_in_turns, measure_staged
from autofuse.core.op import Op, Problem
from autofuse.measure.store import Store, StoreError, config_id, describe_stale
from autofuse.tuning.lifecycle import STOP, ParentLink
from autofuse.tuning.progress import Progress, first_line
from autofuse.tuning.schedule import Scheduler, Slot, Step, known_good, spread
from autofuse.tuning.storage import check_writable, default_storage, open_storage
from autofuse.tuning.study import StudyDriver, previous_winners, study_name

if TYPE_CHECKING:
    from autofuse.comm.world import World

DEFAULTS = {  # per device type: trials per study (None: one per tunable variant), timed reps, warm-up calls,
    # s per trial, problems per op and world size (None: the whole sweep), the run's time limit (None: none),
    # reps of a screening timing, compile-ahead worker processes (None: as many as idle cores allow, up to 8)
    "cpu": {"trials": None, "reps": 5, "warmup": 0, "budget_s": 120.0, "limit": 2, "time_limit_s": None,
            "screen_reps": 2, "compile_workers": 0},  # the interpreter: slow, and it compiles nothing
    "cuda": {"trials": 32, "reps": 10, "warmup": 3, "budget_s": 20.0, "limit": None, "time_limit_s": 240.0,
             "screen_reps": 3, "compile_workers": None},  # default sweep: ~10 per op, 4 min of tuning
}
# Rough seconds per measured trial and per baseline, and to start the ranks: for `describe_plan` only.
ESTIMATE_S = {"cpu": (2.0, 1.0, 15.0), "cuda": (1.0, 0.5, 30.0)}
STORED = "stored"  # `--sweep stored`: the problems the database holds for this hardware, instead of a named sweep
DEPRECATIONS = (  # torch deprecations the ops trigger on every rank: said once by the lead's ops, not 7x here
    r".*`enable_symm_mem_for_group` is deprecated",
)


class SetupError(RuntimeError):
    """The run cannot start (database, Optuna storage): raised on every rank before any measuring."""


@dataclass
class TuneOptions:
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
    time_limit_s: float | None = None  # None: the device's default (none where --trials is given); 0: none
    verbose: bool = True
    limit: int | None = None
    compile_workers: int | None = None
    screen_reps: int | None = None
    compile_fn: str | None = None  # 'module:function' compiling one config ahead (tests); None: the default

    def time_limit_for(self, device_type: str) -> float | None:
        """Seconds after which no new step starts (None: no limit): --time-limit (0: none), else none where
        --trials was given, else the device's default (GPUs: budgeted)."""
        if self.time_limit_s is not None:
            return self.time_limit_s or None
        return None if self.trials is not None else DEFAULTS[device_type]["time_limit_s"]

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
        """Raise ValueError (one line, naming the option) for options no run can take."""
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
        if self.time_limit_s is not None and not self.time_limit_s >= 0:
            raise ValueError(f"--time-limit must be 0 (no limit) or a positive number of minutes, "
                             f"not {self.time_limit_s / 60:g}")
        if self.compile_workers is not None and self.compile_workers < 0:
            raise ValueError(f"--compile-workers must be 0 (off) or more, not {self.compile_workers}")


def resolve_op(name: str) -> Op:
    """A registered op by name, or any Op object given as 'module:attribute'."""
    if ":" in name:
        module, attr = name.split(":", 1)
        return getattr(importlib.import_module(module), attr)
    return registry.get(name)


def problems_for(op: Op, sweep: str, world: int, shapes: Sequence[str] = (),
                 base: Sequence[Problem] | None = None) -> list[Problem]:
    """The problems to tune: the sweep (or `base`: the problems a database holds, `--sweep stored`), or `shapes`.

    Each shape is a full problem key ('ag_gemm|K=64,M=64,N=64|float32|w2'), sizes that override
    the sweep's first problem ('M=64,N=64,K=64'), or M (or batch) values that filter the sweep
    ('64,128', as `autofuse bench --shapes`).
    """
    base = op.sweep(sweep, world) if base is None else list(base)
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
    skipped: list[str] = field(default_factory=list)  # `--sweep stored`: one line per problem or op left out

    @property
    def problems(self) -> int:
        return sum(len(ps) for _, _, ps, _ in self.items)

    def trials(self, options: TuneOptions) -> int:
        return sum(len(ps) * options.trials_for(self.device_type, vs) for _, _, ps, vs in self.items if vs)


def make_plan(options: TuneOptions, device_type: str, ranks: int, hardware_id: str | None = None) -> Plan:
    """The run's plan on `ranks` local ranks (raises ValueError / KeyError for unknown ops, sweeps, shapes).
    Without --op, the ops that have no such sweep are left out (e.g. `--sweep train` or `fp8` runs the GEMM
    ops only); an op named with --op that lacks it is an error. `--sweep stored` takes the problems the
    database holds for `hardware_id` (default: this machine's) instead (`stored_problems`)."""
    mode = options.mode_for(device_type)
    sweep = options.sweep or ("default" if device_type == "cuda" else "cpu")
    worlds = sorted(set(options.worlds or [ranks]))
    if worlds[-1] > ranks or worlds[0] < 1:
        raise ValueError(f"world sizes {worlds} must be within 1..{ranks}")
    ops = [resolve_op(n) for n in (options.ops or registry.names())]
    stored, skipped = None, []
    if sweep == STORED:
        if hardware_id is None:
            hardware_id = environment.fingerprint(device_type)["hardware_id"]
        stored, skipped = stored_problems(options.db, hardware_id, ops, worlds, every_op=not options.ops)
        limit = options.limit or None  # every stored problem unless --limit says otherwise
    else:
        limit = options.value("limit", device_type) or None  # 0: every problem
    items, missing = [], []
    for w in worlds:
        stand_in = SimpleNamespace(device=torch.device(device_type), size=w, rank=0)
        for op in ops:
            try:
                if stored is not None:
                    if not stored.get((w, op.name)):
                        continue
                    problems = problems_for(op, sweep, w, options.shapes, base=stored[(w, op.name)])
                elif sweep == "scaling" and device_type == "cpu":
                    problems = cpu_scaling(op, w, worlds[-1], options.shapes)
                else:
                    problems = problems_for(op, sweep, w, options.shapes)
            except ValueError as exc:
                if options.ops or "unknown sweep" not in str(exc):
                    raise  # an op named with --op must have the sweep
                missing.append(exc)  # every op by default: the ops without this sweep (flash_decode has no
                continue  # train sweep) sit out
            items.append((w, op, problems[:limit], tunable_variants(op, stand_in)))
    if not items:
        if stored is not None:
            raise ValueError(f"--sweep stored: {options.db} holds no problem of "
                             f"{', '.join(op.name for op in ops) if options.ops else 'any registered op'} "
                             f"measured on this hardware at world {', '.join(map(str, worlds))}"
                             + (f" ({len(skipped)} left out: {skipped[0]})" if skipped else ""))
        raise ValueError(f"no op has a sweep {sweep!r} ({missing[0]})" if missing else f"nothing to tune in {sweep!r}")
    return Plan(device_type, mode, sweep, worlds, items, skipped)


def stored_problems(db: str, hardware_id: str, ops: Sequence[Op], worlds: Sequence[int],
                    every_op: bool = True) -> tuple[dict[tuple[int, str], list[Problem]], list[str]]:
    """`--sweep stored`: the problems `db` holds measurements of on `hardware_id` (any op code: a re-tune after
    a code change re-measures every problem of a shipped table), per (world, op name), each op's smallest
    first; and one line per problem left out (its key does not parse, or `op.features` cannot read it: the
    op's problem changed) or, with `every_op`, per op the database holds that is not registered. Problems of
    other ops, world sizes or hardware are not taken. ValueError where the database cannot be read."""
    try:
        store = Store.open(db, readonly=True, fingerprint={})
    except StoreError as exc:
        raise ValueError(f"--sweep stored reads the problems of the database: {exc}") from None
    try:
        rows = store.problem_keys(hardware_id)
    finally:
        store.close()
    by_name = {op.name: op for op in ops}
    out: dict[tuple[int, str], list[Problem]] = {}
    skipped: list[str] = []
    unknown: dict[str, int] = {}
    for r in rows:
        if r["world"] not in worlds:
            continue
        op = by_name.get(r["op"])
        if op is None:
            if every_op and r["op"] not in registry.names():
                unknown[r["op"]] = unknown.get(r["op"], 0) + 1
            continue
        try:
            problem = Problem.from_key(r["key"])
            if problem.op != op.name or problem.world != r["world"]:
                raise ValueError(f"it is not a problem of {op.name} at world {r['world']}")
            op.features(problem)
        except Exception as exc:  # noqa: BLE001 - any key the op no longer reads: said, and left out
            skipped.append(f"skipped stored problem {r['key']}: {op.name} no longer reads it "
                           f"({first_line(f'{type(exc).__name__}: {exc}', 120)})")
            continue
        out.setdefault((problem.world, op.name), []).append(problem)
    skipped += [f"skipped {n} stored problem{'s' if n > 1 else ''} of {name}: no op {name} is registered"
                for name, n in sorted(unknown.items())]
    return {k: sorted(ps, key=_size_order) for k, ps in out.items()}, skipped


def _size_order(problem: Problem) -> tuple:
    """A stored problem's place in its op's list: by dtype and categorical dims, then by size (the product of
    its integer dims), so that `spread` takes the ends of the size range first as it does a sweep's."""
    ints = [v for _, v in problem.dims if isinstance(v, int)]
    named = tuple((k, str(v)) for k, v in problem.dims if not isinstance(v, int))
    return problem.dtype, named, math.prod(ints), problem.key


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


def describe_plan(plan: Plan, options: TuneOptions, ranks: int) -> str:
    """One line: what will be tuned, on what, in which mode, into which database, and roughly how long; then
    (`--sweep stored`) one line per stored problem or op left out."""
    per_op: dict[str, int] = {}
    for _, op, ps, _ in plan.items:
        per_op[op.name] = per_op.get(op.name, 0) + len(ps)
    trials = plan.trials(options)
    per_trial, per_baseline, start = ESTIMATE_S[plan.device_type]
    tunes = {op.name for _, op, _, _ in plan.items if any(v.tunable for v in op.variants.values())}
    only_base = sorted({w for w, op, ps, vs in plan.items if ps and not vs and op.name in tunes})
    untunable = sorted({op.name for _, op, ps, _ in plan.items if ps and op.name not in tunes})
    seconds = start + trials * per_trial + plan.problems * 1.5 * per_baseline
    limit_s = options.time_limit_for(plan.device_type)
    if limit_s is not None:
        seconds = min(seconds, start + limit_s + 30)
    rough = "under a minute" if seconds < 60 else f"about {math.ceil(seconds / 60)} min"
    where = (f"{ranks} CPU ranks (Triton interpreter, gloo, shared-memory heap)" if plan.device_type == "cpu"
             else f"{ranks} GPU{'s' if ranks > 1 else ''}")
    per = options.value("trials", plan.device_type)
    trials_text = ("one trial per tunable variant per problem" if per is None
                   else f"up to {per} trials per problem" if limit_s is not None else f"{per} trials per problem")
    budget = (f"; time limit {limit_s / 60:g} min (--time-limit; 0: none): every op covered first, then the "
              "search goes where the gap between a problem's best variants is smallest" if limit_s is not None else "")
    if plan.sweep == STORED:
        limit = options.limit
        sweep = (f"sweep stored ({plan.problems} problems from the database, measured on this hardware with any "
                 "code of their op" + (f"; at most {limit} per op" if limit else "")
                 + (f"; {len(plan.skipped)} left out, below" if plan.skipped else "")
                 + "; where older code measured one, its previous winners re-measured first)")
    else:
        limit = options.value("limit", plan.device_type)
        sweep = f"sweep {plan.sweep}" + (f" (its first {limit} problems per op; --limit 0: all)" if limit else "")
    base = (f"; world {', '.join(map(str, only_base))}: baselines only (nothing to communicate)" if only_base else "")
    base += (f"; {', '.join(untunable)}: baselines only (no tunable variant)" if untunable else "")
    return (f"tuning {plan.problems} problems ({', '.join(f'{k} {v}' for k, v in per_op.items())}) at world "
            f"{', '.join(map(str, plan.worlds))} on {where}, {sweep}: baselines, then {trials_text} ({trials} in all"
            f"{base}){budget}, {plan.mode} mode, {rough} if nothing is stored yet; database {options.db}"
            + "".join(f"\n{line}" for line in plan.skipped))


def describe_previous(plan: Plan, store: Store, hardware_id: str, digests: dict[str, str]) -> str:
    """One line where planned problems hold rows of other code of their op on this hardware: how many, and that
    their previous winners are re-measured first ('' where none do)."""
    held = store.earlier_problems(hardware_id, plan.mode, digests)
    n = sum(p.key in held for _, _, ps, _ in plan.items for p in ps)
    if not n:
        return ""
    return (f"{n} of the {plan.problems} problems hold measurements of older code of their op: each one's previous "
            "winner is re-measured first (with its baselines), then every variant's previous best, before the "
            "other defaults and the search")


# -- collectives -------------------------------------------------------------------------------------

def _bcast(world: World, obj: Any) -> Any:
    box = [obj if world.rank == 0 else None]
    dist.broadcast_object_list(box, src=world.global_ranks[0], group=world.group)
    return box[0]


# -- what every rank measures --------------------------------------------------------------------------

@dataclass
class Task:
    """One step as broadcast to every rank: baseline / trial (`variant` at `config`, screened when
    `screen` is set) or confirm (`candidates` in turns), on the first `world` ranks."""

    kind: str
    world: int
    op: str
    problem: Problem
    variant: str = ""
    config: dict = field(default_factory=dict)
    screen: Screen | None = None
    candidates: list = field(default_factory=list)


class CachedReference:
    """An op's float64 reference, remembered for the last few (problem, seed) on this rank: every config
    of a problem is checked against the same one, which need not be computed again per trial."""

    def __init__(self, fn: Any, size: int = 4):
        self.fn, self.size = fn, size
        self.memo: dict[tuple, Any] = {}

    def __call__(self, world: Any, problem: Problem, seed: int) -> Any:
        key = (problem.key, seed, world.rank, world.size)
        if key not in self.memo:
            if len(self.memo) >= self.size:
                self.memo.pop(next(iter(self.memo)))
            self.memo[key] = self.fn(world, problem, seed)
        return self.memo[key]


def measuring_op(op: Op) -> Op:
    """`op` with its reference cached (`CachedReference`): what the tuner builds, checks and times."""
    return dataclasses.replace(op, reference=CachedReference(op.reference))


def _run_task(world: World, op: Op, task: Task, options: TuneOptions) -> list:
    dev = world.device.type
    kw = dict(modes=modes.supported(dev), seed=options.seed, reps=options.value("reps", dev),
              warmup=options.value("warmup", dev))
    if task.kind == "confirm":
        per = measure_in_turns(world, op, task.problem, task.candidates, **kw)
        return [m for ms in per for m in ms]
    return measure_staged(world, op, task.problem, task.variant, task.config, budget_s=options.value("budget_s", dev),
                          screen=task.screen, **kw)


# -- the loop, on every rank ------------------------------------------------------------------------

@dataclass
class RunState:
    """What one rank's run carries from step to step (the store, storage, progress and scheduler on rank 0)."""

    fingerprint: dict
    digests: dict[str, str]
    deadline: float | None
    supervised: bool
    stopped: bool = False
    store: Store | None = None
    storage: optuna.storages.RDBStorage | None = None
    progress: Progress | None = None
    scheduler: Scheduler | None = None
    stats: dict[str, float] = field(default_factory=lambda: {"trials": 0, "screened_out": 0, "baselines": 0,
                                                             "confirmed": 0, "timing_s": 0.0, "build_check_s": 0.0})
    per_slot: dict[str, dict[str, float]] = field(default_factory=dict)


def _slots(plan: Plan, world: World) -> list[Slot]:
    """The plan's problems as the scheduler's slots: each op's problems numbered in `spread` order."""
    slots = []
    for w, op, problems, tunable in plan.items:
        stand_in = SimpleNamespace(device=world.device, size=w, rank=0)
        base = baseline_variants(op, stand_in)
        rounds = {i: r for r, i in enumerate(spread(len(problems)))}
        slots += [Slot(w, op, p, list(tunable), base, rounds[i]) for i, p in enumerate(problems)]
    return slots


def _scheduler(world: World, plan: Plan, options: TuneOptions, state: RunState, subs: dict[int, World | None]) -> Scheduler:
    """Rank 0's scheduler over the plan, its board seeded with what the store holds already."""
    assert state.store is not None and state.storage is not None
    store, storage, fp, dev = state.store, state.storage, state.fingerprint, world.device.type
    hw = fp["hardware_id"]

    def make_driver(slot: Slot) -> StudyDriver:
        return StudyDriver(storage, store, fp, slot.op, slot.problem, plan.mode, slot.tunable,
                           options.trials_for(dev, slot.tunable), state.digests[slot.op.name], options.seed,
                           world=subs.get(slot.world))

    def known(slot: Slot, variant: str, config: dict) -> bool:
        return store.lookup(slot.key, config_id(slot.op.name, variant, config), plan.mode, hardware_id=hw,
                            op_digest=state.digests[slot.op.name]) is not None

    def known_configs(slot: Slot) -> list[tuple[str, str, dict]]:
        previous = previous_winners(store.earlier_best(slot.key, plan.mode, hw, state.digests[slot.op.name]),
                                    slot.op, slot.problem, slot.tunable)
        return [(stage, v, c) for stage, v, c, _ in known_good(slot.op, slot.problem, slot.tunable, previous)]

    sched = Scheduler(_slots(plan, world), plan.mode, make_driver, known, state.deadline, known_good=known_configs)
    for name in {s.op.name for s in sched.slots}:
        sched.load(store.best(name, plan.mode, hardware_id=hw, op_digest=state.digests[name]))
    return sched


def _should_stop(world: World, state: RunState) -> bool:
    """A signal on any rank: agreed by every rank (a collective). The time limit is the scheduler's."""
    if world.rank_max(1.0 if STOP.requested else 0.0) > 0:
        state.stopped = True
    return state.stopped


def _record(state: RunState, step: Step, results: list, mode: str) -> None:
    """Rank 0: store a step's results (a trial through its study), report it, hand it to the scheduler."""
    assert state.store is not None and state.progress is not None and state.scheduler is not None
    slot, digest = step.slot, state.digests[step.slot.op.name]
    mine = next((m for m in results if m.mode == mode), None)
    stats = state.stats
    per = state.per_slot.setdefault(slot.key, {"trials": 0, "build_check_s": 0.0})
    bc = max((m.extra.get("build_check_s", 0.0) for m in results), default=0.0)
    stats["build_check_s"] += bc
    per["build_check_s"] += bc
    stats["timing_s"] += sum(m.extra.get("timing_s", 0.0) for m in results)
    if step.kind == "baseline":
        state.store.add(results, state.fingerprint, source="baseline", op_digest=digest)
        stats["baselines"] += 1
        if mine is not None:
            state.progress.baseline(slot.problem, step.variant, mine)
    elif step.kind == "trial":
        slot.driver.finish(step.job, results)
        stats["trials"] += 1
        per["trials"] += 1
        screened_out = mine is not None and mine.ok and mine.extra.get("screen")
        stats["screened_out"] += bool(screened_out)
        state.progress.trial(slot.problem, step.job, mine, slot.driver.best(), screened_out=bool(screened_out))
    else:
        for variant in dict.fromkeys(m.variant for m in results):
            rows = [m for m in results if m.variant == variant]
            source = "baseline" if variant in slot.baselines else "tune"
            state.store.add(rows, state.fingerprint, source=source, op_digest=digest)
        stats["confirmed"] += 1
        state.progress.confirmed(slot.problem, step.candidates, [m for m in results if m.mode == mode],
                                 dict(state.scheduler.board.us.get(slot.key) or {}))
    state.scheduler.record(step, results)


def _loop(world: World, plan: Plan, options: TuneOptions, state: RunState, subs: dict[int, World | None],
          ops: dict[str, Op], ahead: Any) -> None:
    """Every rank: take rank 0's next step, measure it on its world's ranks, let rank 0 record it."""
    step: Step | None = None
    try:
        while not _should_stop(world, state):
            task = None
            if world.rank == 0:
                assert state.scheduler is not None
                covered = len(state.scheduler.covered)
                step = state.scheduler.next()
                if len(state.scheduler.covered) != covered and state.progress is not None:
                    state.progress.coverage(state.scheduler.coverage(), state.scheduler.time_left())
                if step is not None:
                    task = _task_of(step, plan.mode, options.value("screen_reps", world.device.type))
                    if ahead is not None:
                        ahead.reached(step.slot.op.name, step.slot.key, step.variant, step.config)
            task = _bcast(world, task)
            if task is None:
                if world.rank == 0 and state.scheduler is not None and state.scheduler.out_of_time():
                    state.stopped = True
                break
            sub = subs[task.world]
            results = _run_task(sub, ops[task.op], task, options) if sub is not None else []
            if world.rank == 0:
                assert step is not None
                _record(state, step, results, plan.mode)
                step = None
    except KeyboardInterrupt:
        if step is not None and step.kind == "trial" and step.slot.driver is not None:
            step.slot.driver.abandon()
        raise


def _task_of(step: Step, mode: str, screen_reps: int) -> Task:
    screen = Screen(mode, int(screen_reps), step.screen_below) if step.screen_below is not None else None
    return Task(step.kind, step.slot.world, step.slot.op.name, step.slot.problem, step.variant, dict(step.config),
                screen, list(step.candidates))


def _summary_rows(state: RunState, mode: str, device_kind: str) -> list[dict]:
    """Per problem measured (now or before) of the plan: each variant's best latency and config, and the
    numbers of autofuse.measure.compare (no ratio for interpreter timings)."""
    from autofuse.measure.compare import compare, interpreted

    assert state.store is not None and state.scheduler is not None
    hw = state.fingerprint["hardware_id"]
    out = []
    by_op: dict[str, list[dict]] = {}
    for slot in state.scheduler.slots:
        name = slot.op.name
        if name not in by_op:
            by_op[name] = state.store.best(name, mode, hardware_id=hw, op_digest=state.digests[name])
        rows = sorted((r for r in by_op[name] if r["problem"] == slot.key), key=lambda r: r["median_us"])
        if not rows:
            continue
        us = {r["variant"]: r["median_us"] for r in rows}
        per = state.per_slot.get(slot.key, {})
        out.append({"problem": slot.key, "op": name, "mode": mode, "device_kind": device_kind, "variants_us": us,
                    "configs": {r["variant"]: r["config"] for r in rows},
                    "confirmed": {r["variant"]: bool((r.get("extra") or {}).get("confirmed")) for r in rows},
                    **compare(slot.op, us, is_interpreted=interpreted(device_kind)).as_dict(),
                    "trials_this_run": int(per.get("trials", 0)), "compile_s": round(per.get("build_check_s", 0.0), 2),
                    "study": study_name(slot.problem, mode, hw, state.digests[name])})
    return out


def quiet_warnings() -> None:
    """Optuna's experimental notes and the torch deprecations the ops trigger, once per rank and
    location, add nothing to a tuning log."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    for message in DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message)


def tune_rank(world: World, options: TuneOptions, link: ParentLink | None = None) -> dict:
    """Run on every rank of `world` (spawned or torchrun); rank 0 returns {"rows": the summary rows,
    "stats": the run's counts and seconds}, the other ranks {}.

    `link` is given by `autofuse tune` when it spawned the ranks: signals then go to the parent,
    which relays its stop level (tuning.lifecycle). Without it (torchrun), this process handles
    SIGINT and SIGTERM itself. CPU ranks need TRITON_INTERPRET=1 before Triton is imported (spawn
    and the CLI set it).
    """
    quiet_warnings()
    if link is None:
        STOP.reset()
    STOP.install(supervised=link is not None)
    try:
        return _tune(world, options, supervised=link is not None)
    except KeyboardInterrupt:
        if link is None:
            raise
        raise SystemExit(STOP.exit_code() or 130) from None  # abandoned on the parent's word: no traceback
    finally:
        STOP.uninstall()


def _open_rank0(options: TuneOptions, fp: dict) -> tuple[Store | None, Any, str | None]:
    """Rank 0 opens the store and Optuna's storage and checks both can be written."""
    store = None
    try:
        store = Store.open(options.db, fingerprint=fp)
        storage = open_storage(options.storage_url())
        check_writable(storage)
        return store, storage, None
    except StoreError as exc:
        return None, None, str(exc)
    except Exception as exc:  # noqa: BLE001 - Optuna / SQLAlchemy errors: one line, every rank raises it
        if store is not None:
            store.close()
        return None, None, f"cannot write the Optuna storage {options.storage_url()}: {first_line(str(exc), 300)}"


def _compile_ahead(world: World, options: TuneOptions, sched: Scheduler) -> Any:
    """Rank 0: the compile-ahead workers, given every known-good config the run will measure in order
    (None where off: the CPU emulation, --compile-workers 0, or nothing to compile)."""
    from autofuse.tuning.compile_ahead import CompileAhead, default_workers

    dev = world.device.type
    workers = options.value("compile_workers", dev)
    if workers is None:
        workers = default_workers(world.size)
    if not workers:
        return None
    refs = {resolve_op(name).name: name for name in options.ops}  # 'module:attr' ops, for the workers
    ahead = CompileAhead(int(workers), device_kind=dev, compile_fn=options.compile_fn, op_refs=refs)
    ahead.submit([(s.op, s.problem, v, c) for s, v, c in sched.upcoming()])
    sched.on_ahead = lambda slot, variant, config: ahead.submit([(slot.op, slot.problem, variant, config)],
                                                                  ordered=False)
    return ahead


def _tune(world: World, options: TuneOptions, supervised: bool) -> dict:
    dev = world.device.type
    options.validate(dev, world.size)
    fp = environment.fingerprint(dev)
    plan = make_plan(options, dev, world.size, hardware_id=fp["hardware_id"])
    ops = {op.name: op for _, op, _, _ in plan.items}
    limit_s = options.time_limit_for(dev)
    t0 = time.monotonic()
    state = RunState(fingerprint=fp, digests={name: environment.op_digest(op) for name, op in ops.items()},
                     deadline=t0 + limit_s if limit_s else None, supervised=supervised)
    error = None
    if world.rank == 0:
        state.store, state.storage, error = _open_rank0(options, fp)
    error = _bcast(world, error)
    if error:
        raise SetupError(error)
    subs = {w: world.sub(w) for w in plan.worlds}  # every rank, in the same order: groups are made collectively
    measuring = {name: measuring_op(op) for name, op in ops.items()}
    ahead = None
    if world.rank == 0:
        assert state.store is not None
        state.progress = progress = Progress(plan.trials(options), options.verbose)
        if not supervised:
            progress.log(describe_plan(plan, options, world.size))
        note = describe_stale(state.store.stale())
        if note:
            progress.log(note, style="yellow")
        note = describe_previous(plan, state.store, fp["hardware_id"], state.digests)
        if note:
            progress.log(note)
        state.scheduler = _scheduler(world, plan, options, state, subs)
        try:
            ahead = _compile_ahead(world, options, state.scheduler)
        except Exception as exc:  # noqa: BLE001 - compiling ahead only saves time: without it, builds compile
            progress.log(f"compiling ahead is off: {first_line(str(exc))}", style="yellow")
    rows: list[dict] = []
    try:
        _loop(world, plan, options, state, subs, measuring, ahead)
        state.stopped = world.rank_max(1.0 if state.stopped else 0.0) > 0
    finally:
        if world.rank == 0:
            if state.scheduler is not None:
                state.scheduler.release()
            if ahead is not None:
                state.stats.update(ahead.close())
            if state.progress is not None:
                state.progress.close()
            if state.store is not None:
                if state.scheduler is not None:
                    rows = _summary_rows(state, plan.mode, dev)
                state.store.close()
    if world.rank != 0:
        return {}
    state.stats["wall_s"] = time.monotonic() - t0
    if state.scheduler is not None:
        state.stats["coverage"] = state.scheduler.coverage()
    if state.stopped and state.progress is not None:
        why = ("time limit reached" if state.scheduler is not None and state.scheduler.out_of_time()
               else "stopped early")
        state.progress.log(f"{why}: what was measured is stored; rerun the same command to resume", style="yellow")
    return {"rows": rows, "stats": state.stats}
