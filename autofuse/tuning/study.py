"""One Optuna study per (problem, timing mode, hardware, op code): rank 0's side of tuning.

- **Name**: `<problem key>|<mode>|<hardware id>|<op digest>`: new hardware or a change to the op's
  own code starts a fresh study; other ops' studies and a software upgrade do not.
- **Space**: a trial first picks the variant (categorical over the tunable variants available), then
  the variant's own `space(trial, problem)`, its parameters namespaced `<variant>.<name>` so
  variants may share names with different ranges.
- **Queue**: known-good configs, and the configs of trials whose worker died, are enqueued one at a
  time, just before the ask that takes them, so no WAITING trial is left behind when the budget ends.
  Known-good configs (`known_good`) are every variant's `defaults(problem)` (round-robin over variants)
  and, where the store holds rows of this problem, hardware and mode measured with other code of the op
  (`Store.earlier_best`: the op's code changed since), the **previous winners** (`previous_winners`):
  each variant's best config with the newest earlier code, two of the fastest variant's, marked
  `prior` (`prior_index` 0: the previous winner), enqueued before the defaults; a variant not
  available now, or a config its `check` refuses, is left out, and a config the study has seen is not
  enqueued again. `stage()` tells the run's scheduler (`tuning.schedule`) what the study measures
  next: its **coverage** (a retry; the previous winner where there is one, else every variant's first
  default), the **priors** (the other previous winners, and the first default of a variant that has
  none), its other **defaults**, or its sampled **search**. A config is retried once
  after its worker died (a config that kills its process twice is not tried again).
- **Recorded parameters equal the measured config**: an enqueued config is given to the space as
  `fixed`; each draw returns the config's value, recorded in Optuna only where that value lies in
  the distribution the space declares. A parameter the config does not have (e.g. SPLIT_K in a
  config that leaves it at its default) is not recorded at all, so Optuna never holds a value that
  was not measured; the full measured config is the trial's `config` attribute, and parameters left
  unrecorded are listed in its `unrecorded` attribute.
- **Verdicts**: rank 0 writes the rows first, then tells Optuna the median latency of the study's
  mode, or PRUNED (with the error as a user attribute) for a wrong, crashing, hanging or too slow
  config, never a made-up number: TPE ranks pruned trials below every complete one, so it learns to
  avoid them, which it would not from FAIL. FAIL is kept for trials that did not finish (process
  died, abandoned) and for duplicates of a config another worker is measuring. An invalid config
  (the variant's `check`, or what this World's heap refuses: `refuses`) is told PRUNED with its
  reason (attribute `invalid`) before anything is launched, and never counts as a measured trial; a config the store
  or the study already holds is not measured again: the trial is told the known verdict.
- **The race**: a sampled (not enqueued: defaults, previous winners and retries are never held back) trial of a variant whose best measured config of the problem
  is over `RACE_FACTOR` (2x) the problem's best, while another tunable variant is within it, is told PRUNED (attribute `out_of_the_race`) without
  being measured: TPE then learns to draw that variant less, and the search spends its builds on
  variants that can still win.
- **Asked ahead**: in the sampled search, the run may ask a study's next trial while the current one is
  measured (`ask_ahead`: TPE's `constant_liar` lets it sample with a trial in flight), so that its config
  compiles ahead in the run's worker processes; `next` then hands it out first. Until then it is RUNNING
  but not measured (attribute `asked_ahead`); one never handed out is failed when the run ends (`release`,
  attribute `abandoned`) and is not queued again.
- **Resume**: a trial left RUNNING by a dead process of this host is settled on resume: told its
  result if its rows reached the store, else marked FAIL (attribute `abandoned`) and its config
  queued again; trials of dead processes on other hosts are failed by Optuna's heartbeat check.
"""
from __future__ import annotations

import math
import socket
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import optuna
from optuna.trial import TrialState

from autofuse.measure.timing import Measurement
from autofuse.core.op import Config, Op, Problem, config_key
from autofuse.measure.store import Store, config_id
from autofuse.tuning.schedule import known_good
from autofuse.tuning.storage import Heartbeat, alive, this_worker

if TYPE_CHECKING:
    from autofuse.comm.world import World

MAX_ATTEMPTS = 2  # a config whose worker died this often is not queued again
RACE_FACTOR = 2.0  # a variant whose best is over this many times the problem's best is not sampled again
AHEAD_ASKS = 3  # asks `ask_ahead` makes at most (a draw the store already holds, say, is settled at once)
PRIOR_TOP = 2  # configs of the previous winner's variant re-measured first (its best and runner-up)


def study_name(problem: Problem, mode: str, hardware_id: str, op_digest: str) -> str:
    """`<problem key>|<mode>|<hardware id>|<op digest>`."""
    return f"{problem.key}|{mode}|{hardware_id}|{op_digest}"


def _refused(variant: Any, problem: Problem, config: Config) -> bool:
    """Whether `variant` refuses `config` now (its `check` gives a reason, or cannot read the config)."""
    try:
        return variant.check(problem, config) is not None
    except Exception:  # noqa: BLE001 - a config of older code may lack what the check reads
        return True


def previous_winners(rows: Sequence[Mapping[str, Any]], op: Op, problem: Problem,
                     variants: Sequence[str]) -> list[tuple[str, Config, dict]]:
    """The configs a re-tune after a change to the op's code measures first, from `Store.earlier_best`'s
    rows (fastest first): per variant of `variants`, its best config with the newest earlier code that
    measured it here (PRIOR_TOP for the fastest variant's), fastest first, as (variant, config, attrs);
    attrs {"prior": True, "prior_index": i (0: the previous winner), "prior_us", "prior_digest"}. A variant
    not in `variants` (not available now) and a config its `check` refuses are left out."""
    valid = [r for r in rows if r["variant"] in variants and not _refused(op.variants[r["variant"]], problem,
                                                                          r["config"])]
    newest: dict[str, str] = {}
    for r in valid:
        newest[r["variant"]] = max(newest.get(r["variant"], ""), r["code_last"] or "")
    per: dict[str, list[Mapping[str, Any]]] = {}
    for r in valid:
        if (r["code_last"] or "") == newest[r["variant"]]:
            per.setdefault(r["variant"], []).append(r)
    if not per:
        return []
    winner = min(per, key=lambda v: per[v][0]["median_us"])
    chosen = sorted((r for v, rs in per.items() for r in rs[:PRIOR_TOP if v == winner else 1]),
                    key=lambda r: r["median_us"])
    return [(r["variant"], dict(r["config"]), {"prior": True, "prior_index": i, "prior_us": r["median_us"],
                                               "prior_digest": r["op_digest"]}) for i, r in enumerate(chosen)]


@dataclass
class Job:
    """One trial to measure, as broadcast to every rank."""

    trial: int
    variant: str
    config: Config


def _same(value: Any, choice: Any) -> bool:
    return type(value) is type(choice) and value == choice


class TrialSpace:
    """The trial as a variant's space sees it: parameter names prefixed with the variant.

    With `fixed` (an enqueued config), every draw returns the config's value; it is recorded in
    Optuna only if it lies in the declared distribution (then Optuna's enqueued value is exactly
    it), and a parameter the config lacks gets a stand-in value that is never recorded.
    """

    def __init__(self, trial: optuna.Trial, prefix: str, fixed: Mapping[str, Any] | None = None):
        self.trial, self.prefix = trial, prefix
        self.fixed = dict(fixed) if fixed is not None else None
        self.unrecorded: list[str] = []

    def _given(self, name: str, contains: Any, stand_in: Any) -> tuple[bool, Any]:
        """(record?, value) for a fixed config: record only values inside the distribution."""
        assert self.fixed is not None
        if name not in self.fixed:
            self.unrecorded.append(name)
            return False, stand_in
        value = self.fixed[name]
        if contains(value):
            return True, value
        self.unrecorded.append(name)
        return False, value

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        choices = list(choices)
        if self.fixed is not None:
            record, value = self._given(name, lambda v: any(_same(v, c) for c in choices), choices[0])
            if not record:
                return value
        return self.trial.suggest_categorical(self.prefix + name, choices)

    def suggest_int(self, name: str, low: int, high: int, step: int = 1, log: bool = False) -> int:
        if self.fixed is not None:
            record, value = self._given(
                name, lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= high
                and (v - low) % step == 0, low)
            if not record:
                return value
        return self.trial.suggest_int(self.prefix + name, low, high, step=step, log=log)

    def suggest_float(self, name: str, low: float, high: float, step: float | None = None, log: bool = False) -> float:
        if self.fixed is not None:
            record, value = self._given(
                name, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and low <= v <= high
                and (step is None or abs((v - low) / step - round((v - low) / step)) < 1e-9), low)
            if not record:
                return value
        return self.trial.suggest_float(self.prefix + name, low, high, step=step, log=log)


class StudyDriver:
    """Rank 0's side of one study: asks trials, filters invalid and known configs, tells results."""

    def __init__(self, storage: optuna.storages.RDBStorage, store: Store, fingerprint: Mapping[str, Any], op: Op,
                 problem: Problem, mode: str, variants: list[str], trials: int, op_digest: str, seed: int = 0,
                 world: World = None):
        self.storage, self.store, self.fp = storage, store, fingerprint
        self.world = world  # where given, configs its heap or devices refuse are pruned before launch
        self.op, self.problem, self.mode = op, problem, mode
        self.variants = variants
        self.trials = int(trials)
        self.digest = op_digest
        self.name = study_name(problem, mode, fingerprint["hardware_id"], op_digest)
        self.worker = this_worker()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self.study = optuna.create_study(study_name=self.name, storage=storage, direction="minimize",
                                             load_if_exists=True)
            # Seeded by the study's length, so a resumed run does not replay the first run's draws.
            self.study.sampler = optuna.samplers.TPESampler(
                seed=seed + len(self._trials()), n_startup_trials=max(3, min(10, self.trials // 3)),
                constant_liar=True)
        self.heartbeat: Heartbeat | None = None
        self.current: optuna.Trial | None = None
        self.ahead: tuple[optuna.Trial, Job, Heartbeat] | None = None  # asked ahead, not handed out yet
        self.idle_asks = 0
        self.measured_here = 0
        self.compile_s = 0.0
        # The previous winners: read once, since rows of other code are not written during the run.
        self.previous = previous_winners(
            store.earlier_best(problem.key, mode, fingerprint["hardware_id"], op_digest), op, problem, variants)
        self.recover()
        self.initially_measured = self.measured()

    def _trials(self, states: Sequence[TrialState] | None = None) -> list[optuna.trial.FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=states)

    # -- resume ----------------------------------------------------------------------------------

    def recover(self) -> None:
        """Settle trials left RUNNING by dead processes of this host; let heartbeats fail the rest."""
        host = socket.gethostname()
        for t in self._trials((TrialState.RUNNING,)):
            w = t.user_attrs.get("worker") or {}
            if w.get("host") != host or alive(w):
                continue
            rows = [r for r in self.store.trial_rows(self.name, t.number) if r["mode"] == self.mode]
            try:
                if rows:
                    self._tell_row(t.number, rows[0])
                else:
                    self.storage.set_trial_user_attr(t._trial_id, "abandoned", "process died during the trial")
                    self.study.tell(t.number, state=TrialState.FAIL)
            except (optuna.exceptions.UpdateFinishedTrialError, RuntimeError, ValueError):
                continue  # another worker settled it first
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(self.study)

    def _queue(self) -> list[tuple[str, str, Config, dict]]:
        """Configs to enqueue before sampling, in order: (stage, variant, config, user attributes).

        First the configs of trials whose worker died (FAIL while measured), unless measured since
        or tried MAX_ATTEMPTS times (coverage); then the known-good configs (`known_good`: previous
        winners, then defaults) the study has not seen.
        """
        seen: dict[tuple[str, str], list[optuna.trial.FrozenTrial]] = {}
        for t in self._trials():
            if "config" in t.user_attrs:
                key = (t.user_attrs.get("variant", t.params.get("variant")), config_key(t.user_attrs["config"]))
                seen.setdefault(key, []).append(t)
        out: list[tuple[str, str, Config, dict]] = []
        for (variant, _), ts in seen.items():
            died = [t for t in ts if t.state == TrialState.FAIL and t.user_attrs.get("measured")
                    and "duplicate_of" not in t.user_attrs]
            settled = [t for t in ts if t.state != TrialState.FAIL]
            if died and not settled and len(died) < MAX_ATTEMPTS and variant in self.variants:
                last = max(died, key=lambda t: t.number)
                out.append(("coverage", variant, dict(last.user_attrs["config"]), {"retry_of": last.number}))
        out += [e for e in known_good(self.op, self.problem, self.variants, self.previous)
                if (e[1], config_key(e[2])) not in seen]
        return out

    def pending(self) -> list[tuple[str, Config, dict]]:
        """Configs to enqueue before sampling, in order: (variant, config, user attributes) (`_queue`)."""
        return [(v, c, attrs) for _, v, c, attrs in self._queue()]

    def stage(self) -> str:
        """What this study measures next (`schedule.STAGES`): 'coverage' (a retry, the previous winner, or where there is
        none some variant's first default, not yet seen), 'priors' (the other previous winners, the first
        default of a variant without one), 'defaults' (later known-good configs), 'search' (sampled configs),
        or 'done' (its budget of measured trials is spent)."""
        if self.measured() >= self.trials:
            return "done"
        queue = self._queue()
        return queue[0][0] if queue else "search"

    def _enqueue(self, variant: str, config: Config, attrs: dict) -> None:
        params = {"variant": variant, **{f"{variant}.{k}": val for k, val in config.items()}}
        self.study.enqueue_trial(params, user_attrs={"variant": variant, "config": dict(config), **attrs},
                                 skip_if_exists=False)

    # -- the loop --------------------------------------------------------------------------------

    def measured(self) -> int:
        """Trials measured in this study (any worker, any run), counting those in flight."""
        n = 0
        for t in self._trials((TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)):
            if t.user_attrs.get("measured") and "abandoned" not in t.user_attrs:
                n += 1
        return n

    def _best_rows(self) -> list[dict]:
        """The store's best row per variant of this problem, in the study's mode, code and hardware."""
        return self.store.best(self.op.name, self.mode, hardware_id=self.fp["hardware_id"], op_digest=self.digest,
                               problem=self.problem.key)

    def best(self) -> tuple[float, str]:
        """(latency, variant) of the best stored row of this problem in the study's mode."""
        rows = self._best_rows()
        if not rows:
            return math.nan, "-"
        r = min(rows, key=lambda r: r["median_us"])
        return r["median_us"], r["variant"]

    def next(self, deadline: float | None) -> Job | None:
        """The next trial to measure (the one asked ahead first), or None when the study is done for this run."""
        if self.ahead is not None:
            if self.measured() < self.trials and (deadline is None or time.monotonic() <= deadline):
                trial, job, self.heartbeat = self.ahead
                self.ahead, self.current, self.idle_asks = None, trial, 0
                trial.set_user_attr("measured", True)
                return job
            self.release()
        idle_limit = max(30, 3 * self.trials)
        measured = self.measured()
        if (self.study.user_attrs.get("exhausted_at") == measured and not self._trials((TrialState.WAITING,))
                and not self.pending()):
            return None  # an earlier run found nothing new to measure, and nothing changed since
        while measured < self.trials:
            if deadline is not None and time.monotonic() > deadline:
                return None
            if self.idle_asks >= idle_limit:
                self.study.set_user_attr("exhausted_at", measured)
                return None
            self.idle_asks += 1
            if not self._trials((TrialState.WAITING,)):
                queue = self.pending()
                if queue:
                    self._enqueue(*queue[0])
            trial = self._ask()
            job = self._config(trial)
            if job is not None:
                self.idle_asks = 0
                self.current = trial
                trial.set_user_attr("measured", True)
                self.heartbeat = Heartbeat(self.storage, trial._trial_id)
                return job
            measured = self.measured()
        return None

    def ask_ahead(self, deadline: float | None) -> Job | None:
        """Sample the trial `next` will hand out, while the current one is measured, so that its config can
        compile meanwhile: its Job, or None (one is held already, the budget has no room for it past the
        current trial, a known-good config is still queued, the deadline passed, or no draw needs measuring)."""
        if (self.ahead is not None or self.measured() + 1 >= self.trials or self.pending()
                or self._trials((TrialState.WAITING,)) or (deadline is not None and time.monotonic() > deadline)):
            return None
        for _ in range(AHEAD_ASKS):
            trial = self._ask()
            trial.set_user_attr("asked_ahead", True)
            job = self._config(trial)
            if job is not None:
                self.ahead = (trial, job, Heartbeat(self.storage, trial._trial_id))
                return job
        return None

    def _ask(self) -> optuna.Trial:
        """A new trial of the study, marked with this worker and not (yet) measured."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Heartbeat of storage")  # ask/tell beats on its own
            trial = self.study.ask()
        trial.set_user_attr("worker", self.worker)
        trial.set_user_attr("measured", False)  # a retried trial carries its original's attributes
        return trial

    def release(self) -> None:
        """Fail the trial asked ahead and never handed out (the run ends, or the budget or deadline left no
        room for it): it was not measured, and its sampled config is not queued again."""
        if self.ahead is None:
            return
        trial, _, beat = self.ahead
        self.ahead = None
        beat.stop()
        try:
            trial.set_user_attr("abandoned", "asked ahead, not measured")
            self.study.tell(trial, state=TrialState.FAIL)
        except Exception:  # noqa: BLE001 - left RUNNING: the next run's recovery settles it
            pass

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
        space = TrialSpace(trial, f"{variant}.", fixed)
        try:
            config = v.space(space, self.problem)
        except Exception:  # noqa: BLE001 - a fixed config outside the declared space is measured as given
            if fixed is None:
                raise
        if fixed is not None:
            config = dict(fixed)
        elif (behind := self._out_of_the_race(variant)) is not None:
            trial.set_user_attr("out_of_the_race", behind)
            self.study.tell(trial, state=TrialState.PRUNED)
            return None
        trial.set_user_attr("variant", variant)
        trial.set_user_attr("config", config)
        if space.unrecorded:
            trial.set_user_attr("unrecorded", sorted(set(space.unrecorded)))
        reason = v.check(self.problem, config)
        if not reason and self.world is not None:
            reason = v.refuses(self.world, self.problem, config)
        if reason:
            trial.set_user_attr("invalid", reason)
            self.study.tell(trial, state=TrialState.PRUNED)
            return None
        prior = self.store.lookup(self.problem.key, config_id(self.op.name, variant, config), self.mode,
                                  hardware_id=self.fp["hardware_id"], op_digest=self.digest)
        if prior is not None:
            trial.set_user_attr("known", prior["id"])
            self._tell_row(trial, prior)
            return None
        if self._known_in_study(trial, variant, config):
            return None
        return Job(trial.number, variant, config)

    def _out_of_the_race(self, variant: str) -> str | None:
        """Why a sampled trial of `variant` is not worth measuring (None: it is): its best measured config
        of this problem is over RACE_FACTOR x the problem's best (any variant, baselines included) while
        another tunable variant is within it (where none is, the search goes on over all of them). Its
        known-good defaults are measured first (enqueued, never held back), so a variant is judged on
        them; a search that samples it again would spend builds and compiles on a variant that cannot win
        (on 2x H200, ag_gemm's pull at 3-5x the best took 13% of a tune)."""
        per: dict[str, float] = {}
        for r in self._best_rows():
            per[r["variant"]] = min(per.get(r["variant"], math.inf), r["median_us"])
        if variant not in per or len(per) < 2:
            return None
        best = min(per.values())
        racing = [v for v in self.variants if v in per and per[v] <= RACE_FACTOR * best]
        if per[variant] > RACE_FACTOR * best and racing:  # the trials go to `racing`, never nowhere
            return (f"{variant}'s best {per[variant]:.1f} us is over {RACE_FACTOR:g}x the problem's best "
                    f"{best:.1f} us, where {', '.join(racing)} {'is' if len(racing) == 1 else 'are'} within it")
        return None

    def _known_in_study(self, trial: optuna.Trial, variant: str, config: Config) -> bool:
        """Another trial of the study (another worker's) measured or measures the same config:
        take its verdict, or FAIL this one as a duplicate while the other runs."""
        key = config_key(config)
        for t in self._trials((TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)):
            if (t.number == trial.number or not t.user_attrs.get("measured") or "abandoned" in t.user_attrs
                    or t.user_attrs.get("variant") != variant or config_key(t.user_attrs.get("config", {})) != key):
                continue
            trial.set_user_attr("duplicate_of", t.number)
            if t.state == TrialState.COMPLETE:
                self.study.tell(trial, t.value)
            elif t.state == TrialState.PRUNED:
                self.study.tell(trial, state=TrialState.PRUNED)
            else:
                self.study.tell(trial, state=TrialState.FAIL)
            return True
        return False

    def _tell_row(self, trial: optuna.Trial | int, row: dict) -> None:
        if row["ok"] and row["median_us"] is not None:
            self.study.tell(trial, row["median_us"])
        else:
            if isinstance(trial, optuna.Trial):
                trial.set_user_attr("error", (row["error"] or "failed")[:500])
            self.study.tell(trial, state=TrialState.PRUNED)

    def finish(self, job: Job, results: list[Measurement]) -> Measurement | None:
        """Write the trial's rows, then tell Optuna its latency (or PRUNED). Returns the study's-mode row."""
        self.store.add(results, self.fp, study=self.name, trial=job.trial, source="tune", op_digest=self.digest)
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
        """Give the current trial up (second Ctrl-C): FAIL it; its config is queued again next run. The trial
        asked ahead, if any, is released."""
        self.release()
        trial = self.current
        if trial is None:
            return
        try:
            trial.set_user_attr("abandoned", "interrupted")
            self.study.tell(trial, state=TrialState.FAIL)
        except Exception:  # noqa: BLE001 - left RUNNING: the next run's recovery settles it
            pass
        self._end()

    def _end(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.heartbeat, self.current = None, None
