"""Tuning: an Optuna search per problem over the fused variants and their configs (DESIGN.md, Tuning).

- **Study**: one per (op, problem, timing mode, environment fingerprint); the bucket is the problem
  itself (its key holds op, sizes, dtype and world size): the best tile shape depends on M, N and K
  together, and the dispatch policy interpolates between the problems measured. The study is named
  `<problem key>|<mode>|<fingerprint id>`, so a change of GPU, driver or kernel code starts fresh
  studies while the old rows stay in the store, unused.
- **Ranks**: rank 0 owns the study (ask/tell) and the store; it broadcasts each trial's (variant,
  config) and every rank builds, checks and times it with `measure.measure` (identical verdicts and
  rank-max timings on every rank). Rank 0 writes the rows first, then tells Optuna the median
  latency of the study's mode, or PRUNED (with the error as a user attribute) for a wrong,
  crashing, hanging or too slow config, never a made-up number: TPE ranks pruned trials below
  every complete one, so it learns to avoid them, which it would not from FAIL. FAIL is kept for
  trials that did not finish (process died, abandoned). Every timing mode the World has is
  recorded per trial (eager and graph on CUDA), since the policy may serve either; the study
  optimises one of them (`mode`).
- **Space**: a trial first picks the variant (categorical over the fused variants available), then
  the variant's own `space(trial, problem)`, its parameters namespaced `<variant>.<name>` so
  variants may share names with different ranges. `variant.check` runs on rank 0 before anything
  is launched; an invalid config is told PRUNED with its reason (attribute `invalid`). A config
  the store already holds for this problem and environment is not measured again: the trial is
  told the stored verdict.
- **Seeds**: every variant's `defaults(problem)` is enqueued first, round-robin over variants.
  BSP and torch_symm (the non-fused variants) are measured once per problem as baselines
  (source 'baseline').
- **Resume**: studies live in Optuna's RDB storage (SQLite beside the database by default, any
  Optuna RDB URL, e.g. PostgreSQL for several tuning hosts on one study) and are loaded if they
  exist. A trial left RUNNING by a dead process of this host is settled on resume: told its
  result if its rows reached the store, else marked FAIL and its parameters enqueued again.
  Trials of dead processes on other hosts are failed and retried by Optuna's heartbeat.
- **Budget**: `trials` counts measured trials per study (pruned and already-known configs are
  free), across runs and workers; a run also stops after many asks in a row found nothing new
  (small spaces), at its time limit, or on Ctrl-C (the current trial is finished and written).
- **Compile time**: Triton compiles a config's kernels on its first call, inside `measure`'s
  build + check, which every rank does at the same time; the timed reps run after it, so compile
  time never enters a latency. It is recorded per row (`extra.build_check_s`) and reported per
  problem. Kernels are not compiled ahead on a thread: a variant's build allocates on the
  symmetric heap, which must happen in the same order on every rank, and Triton's own cache makes
  a resumed or repeated study skip the compiles it already did.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import signal
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import optuna
import torch
import torch.distributed as dist
from optuna.trial import TrialState

from autofuse import environment, registry
from autofuse.measure import Measurement, measure, modes_for
from autofuse.op import Config, Op, Problem, config_key
from autofuse.store import Store, config_id

BASELINES = ("bsp", "torch_symm")
DEFAULTS = {  # per device type: trials per study, timed reps, warm-up calls, seconds per trial
    "cpu": {"trials": 2, "reps": 3, "warmup": 0, "budget_s": 120.0},  # the interpreter: slow, nothing to warm
    "cuda": {"trials": 16, "reps": 15, "warmup": 3, "budget_s": 20.0},  # ~10 min for ag_gemm's 12 problems
}
HEARTBEAT_S = 20
GRACE_S = 120


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

    def value(self, name: str, device_type: str) -> Any:
        given = getattr(self, name)
        return DEFAULTS[device_type][name] if given is None else given


def default_storage(db: str | Path) -> str:
    """Optuna's SQLite file beside the database: `tuning_db/autofuse.db` -> `tuning_db/autofuse.optuna.db`."""
    db = Path(db).absolute()
    return f"sqlite:///{db.with_name(db.stem + '.optuna.db')}"


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


def study_name(problem: Problem, mode: str, fingerprint_id: str) -> str:
    return f"{problem.key}|{mode}|{fingerprint_id}"


def fused_variants(op: Op, world) -> list[str]:
    return [n for n, v in op.variants.items() if v.fused and n not in BASELINES and v.available(world)]


def baseline_variants(op: Op, world) -> list[str]:
    return [n for n, v in op.variants.items() if (not v.fused or n in BASELINES) and v.available(world)]


# -- Ctrl-C: the first press finishes the current trial, the second abandons it -----------------------

class _Stop:
    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            self.uninstall()
            raise KeyboardInterrupt
        self.requested = True


STOP = _Stop()


# -- collectives -------------------------------------------------------------------------------------

def _bcast(world, obj: Any) -> Any:
    box = [obj if world.rank == 0 else None]
    dist.broadcast_object_list(box, src=world.global_ranks[0], group=world.group)
    return box[0]


def _any(world, flag: bool) -> bool:
    t = torch.tensor([1.0 if flag else 0.0], device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world.group)
    return bool(t.item() > 0)


# -- Optuna plumbing (rank 0) ------------------------------------------------------------------------

def storage_url(url: str) -> str:
    """'postgresql://' names SQLAlchemy's default driver (psycopg 3 in SQLAlchemy 2.1, psycopg2
    before): pick whichever of the two is installed, psycopg2 being the 'postgres' extra."""
    if not url.startswith(("postgresql://", "postgres://")):
        return url
    rest = url.split("://", 1)[1]
    for module, driver in (("psycopg2", "psycopg2"), ("psycopg", "psycopg")):
        if importlib.util.find_spec(module) is not None:
            return f"postgresql+{driver}://{rest}"
    raise RuntimeError(f"storage {url} needs a PostgreSQL driver: pip install psycopg2-binary (autofuse[postgres])")


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """An Optuna RDB storage with heartbeats (stale trials of dead hosts are failed and retried)."""
    url = storage_url(url)
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    retry = (getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)  # Optuna >= 4.x
             or optuna.storages.RetryFailedTrialCallback)
    key = ("heartbeat_stale_trial_callback"
           if "heartbeat_stale_trial_callback" in inspect.signature(optuna.storages.RDBStorage.__init__).parameters
           else "failed_trial_callback")
    last: Exception | None = None
    for attempt in range(5):  # several workers creating the schema at once may collide
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                callback = {key: retry(max_retry=2)}
                return optuna.storages.RDBStorage(
                    url, engine_kwargs=engine_kwargs, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                    **callback)
        except Exception as exc:  # noqa: BLE001 - retried, then re-raised
            last = exc
            time.sleep(0.5 + attempt)
    raise RuntimeError(f"cannot open Optuna storage {url}: {last}") from last


def _process_start(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _alive(worker: dict) -> bool:
    """Whether the process that ran a trial is still running (only answerable on its own host)."""
    pid = int(worker.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    start = worker.get("start", "")
    return not start or _process_start(pid) in ("", start)


class _Space:
    """The trial as a variant's space sees it: parameter names prefixed with the variant."""

    def __init__(self, trial: optuna.Trial, prefix: str):
        self.trial, self.prefix = trial, prefix

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        return self.trial.suggest_categorical(self.prefix + name, list(choices))

    def suggest_int(self, name: str, low: int, high: int, step: int = 1, log: bool = False) -> int:
        return self.trial.suggest_int(self.prefix + name, low, high, step=step, log=log)

    def suggest_float(self, name: str, low: float, high: float, step: float | None = None, log: bool = False) -> float:
        return self.trial.suggest_float(self.prefix + name, low, high, step=step, log=log)


class _Heartbeat:
    """Records a trial's heartbeat while it runs, so other hosts can tell a dead worker's trials."""

    def __init__(self, storage: optuna.storages.RDBStorage, trial_id: int):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(storage, trial_id), daemon=True)
        self._thread.start()

    def _beat(self, storage: optuna.storages.RDBStorage, trial_id: int) -> None:
        while True:
            try:
                storage.record_heartbeat(trial_id)
            except Exception:  # noqa: BLE001 - a missed beat only delays failure detection
                pass
            if self._stop.wait(HEARTBEAT_S):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@dataclass
class Job:
    """One trial to measure, as broadcast to every rank."""

    trial: int
    variant: str
    config: Config


class StudyDriver:
    """Rank 0's side of one study: asks trials, filters invalid and known configs, tells results."""

    def __init__(self, storage: optuna.storages.RDBStorage, store: Store, fingerprint: dict, op: Op,
                 problem: Problem, mode: str, variants: list[str], settings: Settings, device_type: str):
        self.storage, self.store, self.fp = storage, store, fingerprint
        self.op, self.problem, self.mode = op, problem, mode
        self.variants = variants
        self.trials = int(settings.value("trials", device_type))
        self.name = study_name(problem, mode, fingerprint["id"])
        self.worker = {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid())}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self.study = optuna.create_study(study_name=self.name, storage=storage, direction="minimize",
                                             load_if_exists=True)
            # Seeded by the study's length, so a resumed run does not replay the first run's draws.
            self.study.sampler = optuna.samplers.TPESampler(
                seed=settings.seed + len(self._trials()), n_startup_trials=max(3, min(10, self.trials // 3)),
                constant_liar=True)
        self.heartbeat: _Heartbeat | None = None
        self.current: optuna.Trial | None = None
        self.idle_asks = 0
        self.measured_here = 0
        self.compile_s = 0.0
        self.recover()
        self.enqueue_defaults()
        self.initially_measured = self.measured()

    def _trials(self, states: Sequence[TrialState] | None = None) -> list[optuna.trial.FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=states)

    def recover(self) -> None:
        """Settle trials left RUNNING by dead processes of this host; let heartbeats fail the rest."""
        host = socket.gethostname()
        for t in self._trials((TrialState.RUNNING,)):
            w = t.user_attrs.get("worker") or {}
            if w.get("host") != host or _alive(w):
                continue
            rows = [r for r in self.store.trial_rows(self.name, t.number) if r["mode"] == self.mode]
            try:
                if rows:
                    self._tell_row(t.number, rows[0])
                else:
                    self.storage.set_trial_user_attr(t._trial_id, "abandoned", "process died during the trial")
                    self.study.tell(t.number, state=TrialState.FAIL)
                    self._retry(t)
            except (optuna.exceptions.UpdateFinishedTrialError, RuntimeError, ValueError):
                continue  # another worker settled it first
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(self.study)

    def _retry(self, t: optuna.trial.FrozenTrial) -> None:
        attrs = {"retry_of": t.number}
        for key in ("variant", "config"):
            if key in t.user_attrs:
                attrs[key] = t.user_attrs[key]
        self.study.enqueue_trial(dict(t.params), user_attrs=attrs)

    def enqueue_defaults(self) -> None:
        """The fused variants' known-good configs first, round-robin over variants (the first default
        of every variant, then the second, ...) so that a small budget still sees every variant;
        configs the study already has are not queued again."""
        seen = {(t.user_attrs.get("variant", t.params.get("variant")), config_key(t.user_attrs["config"]))
                for t in self._trials() if "config" in t.user_attrs}
        lists = {v: list(self.op.variants[v].defaults(self.problem)) for v in self.variants}
        for i in range(max((len(c) for c in lists.values()), default=0)):
            for v, configs in lists.items():
                if i >= len(configs) or (v, config_key(configs[i])) in seen:
                    continue
                cfg = configs[i]
                params = {"variant": v, **{f"{v}.{k}": val for k, val in cfg.items()}}
                self.study.enqueue_trial(params, user_attrs={"variant": v, "config": dict(cfg), "default": True})
                seen.add((v, config_key(cfg)))

    def measured(self) -> int:
        """Trials measured in this study (any worker, any run), counting those in flight."""
        n = 0
        for t in self._trials((TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)):
            if t.user_attrs.get("measured") and "abandoned" not in t.user_attrs:
                n += 1
        return n

    def best(self) -> tuple[float, str]:
        rows = [r for r in self.store.best(self.op.name, self.mode, self.fp["id"]) if r["problem"] == self.problem.key]
        if not rows:
            return math.nan, "-"
        r = min(rows, key=lambda r: r["median_us"])
        return r["median_us"], r["variant"]

    def next(self, deadline: float | None) -> Job | None:
        """The next trial to measure, or None when the study is done for this run."""
        idle_limit = max(30, 3 * self.trials)
        measured = self.measured()
        if (self.study.user_attrs.get("exhausted_at") == measured
                and not self._trials((TrialState.WAITING,))):
            return None  # an earlier run found nothing new to measure, and nothing changed since
        while measured < self.trials:
            if deadline is not None and time.monotonic() > deadline:
                return None
            if self.idle_asks >= idle_limit:
                self.study.set_user_attr("exhausted_at", measured)
                return None
            self.idle_asks += 1
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Heartbeat of storage")  # ask/tell beats on its own
                trial = self.study.ask()
            trial.set_user_attr("worker", self.worker)
            trial.set_user_attr("measured", False)  # a retried trial carries its original's attributes
            job = self._config(trial)
            if job is not None:
                self.idle_asks = 0
                self.current = trial
                trial.set_user_attr("measured", True)
                self.heartbeat = _Heartbeat(self.storage, trial._trial_id)
                return job
            measured = self.measured()
        return None

    def _config(self, trial: optuna.Trial) -> Job | None:
        """Draw the trial's config; settle it at once (and return None) if it need not be measured."""
        try:
            variant = trial.suggest_categorical("variant", self.variants)
        except ValueError as exc:  # an enqueued variant no longer available here
            trial.set_user_attr("invalid", str(exc))
            self.study.tell(trial, state=TrialState.PRUNED)
            return None
        v = self.op.variants[variant]
        fixed = trial.user_attrs.get("config")
        try:
            config = v.space(_Space(trial, f"{variant}."), self.problem)
        except ValueError:
            if fixed is None:
                raise
            config = {}  # an enqueued config outside the declared space: measured as given
        if fixed is not None:
            config = dict(fixed)
        trial.set_user_attr("variant", variant)
        trial.set_user_attr("config", config)
        reason = v.check(self.problem, config)
        if reason:
            trial.set_user_attr("invalid", reason)
            self.study.tell(trial, state=TrialState.PRUNED)
            return None
        prior = self.store.lookup(self.problem.key, config_id(self.op.name, variant, config), self.mode, self.fp["id"])
        if prior is not None:
            trial.set_user_attr("known", prior["id"])
            self._tell_row(trial, prior)
            return None
        return Job(trial.number, variant, config)

    def _tell_row(self, trial: optuna.Trial | int, row: dict) -> None:
        if row["ok"] and row["median_us"] is not None:
            self.study.tell(trial, row["median_us"])
        else:
            if isinstance(trial, optuna.Trial):
                trial.set_user_attr("error", (row["error"] or "failed")[:500])
            self.study.tell(trial, state=TrialState.PRUNED)

    def finish(self, job: Job, results: list[Measurement]) -> Measurement | None:
        """Write the trial's rows, then tell Optuna its latency (or FAIL). Returns the study's-mode row."""
        self.store.add(results, self.fp, study=self.name, trial=job.trial, source="tune")
        self.measured_here += 1
        self.compile_s += max((m.extra.get("build_check_s", 0.0) for m in results), default=0.0)
        mine = next((m for m in results if m.mode == self.mode), None)
        trial = self.current
        assert trial is not None and trial.number == job.trial
        if mine is not None and mine.ok:
            self.study.tell(trial, mine.median_us)
        else:
            trial.set_user_attr("error", ((mine.error if mine else "mode not measured") or "failed")[:500])
            self.study.tell(trial, state=TrialState.PRUNED)
        self._end()
        return mine

    def abandon(self) -> None:
        """Give the current trial up (second Ctrl-C): FAIL it and queue its parameters again."""
        trial = self.current
        if trial is None:
            return
        try:
            frozen = self.study._storage.get_trial(trial._trial_id)
            trial.set_user_attr("abandoned", "interrupted")
            self.study.tell(trial, state=TrialState.FAIL)
            self._retry(frozen)
        except Exception:  # noqa: BLE001 - left RUNNING: the next run's recovery settles it
            pass
        self._end()

    def _end(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.heartbeat, self.current = None, None


# -- progress (rank 0) -------------------------------------------------------------------------------

class Progress:
    """A rich progress display on a terminal (trial, best so far, ETA); one line per trial otherwise."""

    def __init__(self, total: int, verbose: bool):
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self.console = Console()
        self.verbose = verbose
        self.live = self.console.is_terminal and verbose
        self.bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("best {task.fields[best]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                TimeRemainingColumn(), console=self.console, disable=not self.live)
        self.task = self.bar.add_task("tuning", total=max(total, 1), best="-")
        self.total, self.done = total, 0
        if self.live:
            self.bar.start()

    def log(self, text: str) -> None:
        if self.verbose:
            (self.bar.console if self.live else self.console).print(text, highlight=False, soft_wrap=True)

    def trial(self, problem: Problem, job: Job, m: Measurement | None, best: tuple[float, str]) -> None:
        self.done += 1
        best_text = "-" if math.isnan(best[0]) else f"{best[0]:.1f} us ({best[1]})"
        self.bar.update(self.task, advance=1, description=f"{problem.key} #{job.trial}", best=best_text)
        if not self.live and self.verbose:
            what = (f"{m.median_us:.1f} us" if m is not None and m.ok
                    else f"failed: {(m.error if m else 'not measured').splitlines()[0][:100]}")
            self.console.print(f"[{self.done}] {problem.key} trial {job.trial} {job.variant} {config_key(job.config)}: "
                               f"{what}; best {best_text}", highlight=False, soft_wrap=True)

    def expect(self, change: int) -> None:
        """Adjust the total: trials a resumed study already had, or trials a study did not need."""
        self.total = max(self.done, self.total + change)
        self.bar.update(self.task, total=max(self.total, 1))

    def close(self) -> None:
        if self.live:
            self.bar.stop()


# -- the loop, on every rank ------------------------------------------------------------------------

def _measure_baselines(world, op: Op, problem: Problem, mode: str, modes: tuple[str, ...], settings: Settings,
                       store: Store | None, fp: dict, progress: Progress | None) -> None:
    dev = world.device.type
    jobs = None
    if world.rank == 0:
        jobs = [(v, cfg) for v in baseline_variants(op, world) for cfg in op.variants[v].defaults(problem)
                if store.lookup(problem.key, config_id(op.name, v, cfg), mode, fp["id"]) is None]
    for variant, cfg in _bcast(world, jobs):
        results = measure(world, op, problem, variant, cfg, modes=modes, seed=settings.seed,
                          reps=settings.value("reps", dev), warmup=settings.value("warmup", dev),
                          budget_s=settings.value("budget_s", dev))
        if world.rank == 0:
            store.add(results, fp, source="baseline")
            mine = next(m for m in results if m.mode == mode)
            progress.log(f"  baseline {problem.key} {variant}: "
                         + (f"{mine.median_us:.1f} us" if mine.ok else f"failed: {mine.error.splitlines()[0][:100]}"))


def _summary_row(store: Store, op: Op, problem: Problem, mode: str, fp: dict, driver: StudyDriver | None,
                 seconds: float) -> dict:
    rows = {r["variant"]: r for r in store.best(op.name, mode, fp["id"]) if r["problem"] == problem.key}
    best = min(rows.values(), key=lambda r: r["median_us"]) if rows else None
    bsp = rows.get("bsp")
    out = {"problem": problem.key, "op": op.name, "mode": mode, "best_variant": best["variant"] if best else None,
           "config": best["config"] if best else None, "latency_us": best["median_us"] if best else None,
           "bsp_us": bsp["median_us"] if bsp else None, "speedup_vs_bsp": None,
           "trials_this_run": driver.measured_here if driver else 0,
           "compile_s": round(driver.compile_s, 2) if driver else 0.0, "seconds": round(seconds, 1),
           "study": driver.name if driver else study_name(problem, mode, fp["id"])}
    if best and bsp:
        out["speedup_vs_bsp"] = bsp["median_us"] / best["median_us"]
    return out


def _should_stop(world, ctx: dict) -> bool:
    """Ctrl-C on any rank, or rank 0's time limit: agreed by every rank (a collective)."""
    late = world.rank == 0 and ctx["deadline"] is not None and time.monotonic() > ctx["deadline"]
    if _any(world, STOP.requested or late):
        ctx["stopped"] = True
    return ctx["stopped"]


def _tune_problem(world, op: Op, problem: Problem, mode: str, settings: Settings, ctx: dict) -> dict | None:
    dev = world.device.type
    modes = modes_for(world)
    store, fp, progress, storage = ctx.get("store"), ctx["fp"], ctx.get("progress"), ctx.get("storage")
    t0 = time.monotonic()
    if _should_stop(world, ctx):
        return None
    _measure_baselines(world, op, problem, mode, modes, settings, store, fp, progress)
    variants = fused_variants(op, world)
    driver = None
    if world.rank == 0 and variants:
        driver = StudyDriver(storage, store, fp, op, problem, mode, variants, settings, dev)
        progress.expect(-min(driver.initially_measured, driver.trials))
    while not _should_stop(world, ctx):
        job = driver.next(ctx["deadline"]) if driver is not None else None
        job = _bcast(world, job)
        if job is None:
            break
        try:
            results = measure(world, op, problem, job.variant, job.config, modes=modes, seed=settings.seed,
                              reps=settings.value("reps", dev), warmup=settings.value("warmup", dev),
                              budget_s=settings.value("budget_s", dev))
        except KeyboardInterrupt:
            if driver is not None:
                driver.abandon()
            raise
        if driver is not None:
            mine = driver.finish(job, results)
            progress.trial(problem, job, mine, driver.best())
    if world.rank != 0:
        return None
    if driver is not None:
        progress.expect(-max(0, driver.trials - min(driver.initially_measured, driver.trials) - driver.measured_here))
    return _summary_row(store, op, problem, mode, fp, driver, time.monotonic() - t0)


def tune_rank(world, settings: Settings) -> list[dict]:
    """Run on every rank of `world` (spawned or torchrun); rank 0 returns the summary rows.

    CPU ranks need TRITON_INTERPRET=1 before Triton is imported (spawn and the CLI set it)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    STOP.install()
    try:
        return _tune(world, settings)
    finally:
        STOP.uninstall()


def _tune(world, settings: Settings) -> list[dict]:
    dev = world.device.type
    mode = settings.mode or ("graph" if dev == "cuda" else "eager")
    if mode not in modes_for(world):
        raise ValueError(f"mode {mode!r} is not available on {dev}: use one of {modes_for(world)}")
    sweep = settings.sweep or ("gpu" if dev == "cuda" else "cpu")
    worlds = sorted(set(settings.worlds or [world.size]))
    if worlds[-1] > world.size or worlds[0] < 1:
        raise ValueError(f"world sizes {worlds} must be within 1..{world.size}")
    ops = [resolve_op(n) for n in (settings.ops or registry.names())]
    plan = [(w, op, problems_for(op, sweep, w, settings.shapes)) for w in worlds for op in ops]
    ctx: dict[str, Any] = {"fp": environment.fingerprint(dev), "stopped": False,
                           "deadline": time.monotonic() + settings.time_limit_s if settings.time_limit_s else None}
    summary: list[dict] = []
    if world.rank == 0:
        store = Store(settings.db)
        ctx["store"] = store
        ctx["storage"] = open_storage(settings.storage or default_storage(settings.db))
        trials = int(settings.value("trials", dev))
        total = sum(len(ps) for _, _, ps in plan) * trials
        ctx["progress"] = progress = Progress(total, settings.verbose)
        stale = store.stale(ctx["fp"]["id"])
        from autofuse.store import describe_stale

        if stale["rows"]:
            progress.log(f"[yellow]{describe_stale(stale)}[/]")
        progress.log(f"tuning {', '.join(op.name for op in ops)} on sweep {sweep!r}, world {worlds}, "
                     f"{mode} mode, {trials} trials per problem; database {settings.db}")
    try:
        for w, op, problems in plan:
            sub = world.sub(w)
            if sub is not None and not ctx["stopped"]:
                for problem in problems:
                    row = _tune_problem(sub, op, problem, mode, settings, ctx)
                    if row is not None:
                        summary.append(row)
                    if ctx["stopped"]:
                        break
            ctx["stopped"] = _any(world, ctx["stopped"])
    finally:
        if world.rank == 0:
            ctx["progress"].close()
            ctx["store"].close()
    if world.rank == 0 and ctx["stopped"]:
        ctx["progress"].log("[yellow]stopped early: what was measured is stored; rerun the same command to resume[/]")
    return summary
