"""The order of a tuning run: which measurement comes next (rank 0's side; DESIGN.md, Tuning and store).

The whole run is planned first (every world size, op and problem: a `Slot` each), then measured in
four passes, so that a run cut short at any moment (`--time-limit`, Ctrl-C, a kill) has spent its
time where it matters most and leaves every op something to fit:

1. **coverage**, in rounds: round r takes, for each (world size, op) in turn, its r-th problem (an
   op's problems in `spread` order: the ends of its size range first, then the middles) and measures
   its baselines (bsp, peer) and its study's coverage (`StudyDriver.stage`): the previous winner where
   the store holds rows of the problem measured with other code of the op (a re-tune after a code
   change: one config re-confirms the winner), else the first known-good default of each tunable
   variant; full reps in every mode. After round r every op has r + 1 problems covered; round 0 is
   always completed (a time limit is checked after it, a signal is not), so even a tiny `--time-limit`
   gives every op a problem with BSP and its best variants measured.
2. **priors**: every study's other previous winners (each variant's best with the earlier code, and the
   first default of a variant without one), one per problem in turn: a re-tune measures every
   problem's previous winners before any other default or sampled config.
3. **defaults**: every study's other known-good configs, one per problem in turn.
4. **search**: the next sampled trial goes to the problem of highest `priority`: the closer its best
   and runner-up variants (the decision the search can still change) and the fewer trials it has had
   this run, the higher.

Trials after the coverage pass are screened (`measure.timing.Screen`, successive halving): timed
with few reps in the study's mode and rejected there when slower than the problem's best by more
than `SCREEN_MARGIN`; only the others are timed with full reps, in every mode.

**Outliers**: after a baseline or a new best, and for every problem once the coverage pass is
done, a problem whose x BSP deviates from its neighbours' (`measure.compare.deviates`) gets a
`confirm` step: its BSP and its best are re-measured in turns and stored marked `confirmed`, which
the store prefers to their first rows. Each (problem, best config) is confirmed at most once a run.
Likewise a problem whose x alt deviates: its fastest alternative (torch's op) and its best.

**Compiling ahead**: the known-good configs of passes 1-3 are known before the run (`upcoming`); in the
search, each sampled trial handed out is followed by the next one of the same study asked ahead
(`StudyDriver.ask_ahead`), whose config `on_ahead` passes on (the run's compile-ahead workers compile it
while the current trial is measured); `release` fails the trials asked ahead and never handed out.

Nothing here measures: `Scheduler.next()` returns a `Step`, the rank loop (`tuning.tune`)
measures it on every rank and hands the results to `Scheduler.record()`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from autofuse.core.op import Config, Op, Problem, config_key
from autofuse.measure.compare import alternative_ratio, bsp_ratio, deviates, neighbours
from autofuse.measure.timing import Measurement

SCREEN_MARGIN = 0.05  # a screened trial slower than the problem's best by more than this is rejected
GAP_FLOOR = 0.02  # log-gap added to every priority's denominator, so a tie cannot take every trial


def spread(n: int) -> list[int]:
    """Indices 0..n-1 in an order that covers the range early: both ends, then repeated midpoints
    (0, n-1, (n-1)/2, (n-1)/4, 3(n-1)/4, ...), each index once."""
    if n <= 0:
        return []
    order: list[int] = []
    seen: set[int] = set()
    parts = 1
    while len(order) < n:
        for j in range(parts + 1):
            i = round(j * (n - 1) / parts)
            if i not in seen:
                seen.add(i)
                order.append(i)
        parts *= 2
    return order


@dataclass
class Slot:
    """One problem of the run: where it runs, its op, its variants, its study (on rank 0, made lazily)."""

    world: int
    op: Op
    problem: Problem
    tunable: list[str]
    baselines: list[str]
    round: int
    driver: Any = None
    searched: int = 0
    done: bool = False

    @property
    def key(self) -> str:
        return self.problem.key


@dataclass
class Step:
    """One thing to measure: `kind` baseline (`variant` at `config`), trial (`job` from the study,
    screened where `screen_below` is set) or confirm (`candidates` re-measured in turns)."""

    kind: str
    slot: Slot
    variant: str = ""
    config: Config = field(default_factory=dict)
    job: Any = None
    screen_below: float | None = None
    candidates: list[tuple[str, Config]] = field(default_factory=list)
    phase: str = ""


class Board:
    """The run's view of each problem's best latency per variant (the study's mode), with its config and
    whether it was confirmed in turns: what priorities and outlier checks read."""

    def __init__(self) -> None:
        self.us: dict[str, dict[str, float]] = {}
        self.configs: dict[str, dict[str, Config]] = {}
        self.confirmed: dict[str, dict[str, bool]] = {}

    def offer(self, key: str, variant: str, us: float, config: Config, confirmed: bool = False,
              replace: bool = False) -> bool:
        """Record a latency; `replace` (a confirmation of the variant's best config) overwrites it.
        Returns whether the problem's best latency changed."""
        if not (us is not None and math.isfinite(us) and us > 0):
            return False
        per = self.us.setdefault(key, {})
        before = min(per.values()) if per else math.inf
        same = config_key(self.configs.get(key, {}).get(variant, {})) == config_key(config)
        if variant not in per or us < per[variant] or (replace and same):
            per[variant] = us
            self.configs.setdefault(key, {})[variant] = dict(config)
            self.confirmed.setdefault(key, {})[variant] = confirmed
        return min(per.values()) != before

    def best(self, key: str) -> tuple[float, str | None]:
        per = self.us.get(key) or {}
        if not per:
            return math.nan, None
        v = min(per, key=per.get)
        return per[v], v


STAGES = ("coverage", "priors", "defaults", "search", "done")  # a study's stages, in the order a run takes them


def known_good(op: Op, problem: Problem, variants: Sequence[str],
               previous: Sequence[tuple[str, Config, dict]] = ()) -> list[tuple[str, str, Config, dict]]:
    """A study's known-good configs in the order it measures them: (stage, variant, config, attrs), by stage
    (STAGES). With previous winners (`tuning.study.previous_winners`): the winner is the coverage, the other previous
    winners and the first default of each variant without one are the priors; else every variant's first
    default is the coverage. The defaults go round-robin over variants (every first default, then every
    second, ...); a config listed twice is measured once, in the earlier stage, with both attributes."""
    entries: dict[tuple[str, str], list] = {}

    def add(stage: str, variant: str, config: Config, attrs: dict) -> None:
        key = (variant, config_key(config))
        if key in entries:
            held = entries[key]
            held[0] = min(held[0], stage, key=STAGES.index)
            held[3] = {**attrs, **held[3]}
        else:
            entries[key] = [stage, variant, dict(config), dict(attrs)]

    for i, (v, config, attrs) in enumerate(previous):
        add("coverage" if i == 0 else "priors", v, config, attrs)
    with_prior = {v for v, _, _ in previous}
    lists = {v: list(op.variants[v].defaults(problem)) for v in variants}
    for i in range(max((len(c) for c in lists.values()), default=0)):
        for v, configs in lists.items():
            if i < len(configs):
                first = "coverage" if not previous else "priors" if v not in with_prior else "defaults"
                add(first if i == 0 else "defaults", v, configs[i], {"default": True, "default_index": i})
    return [tuple(e) for e in sorted(entries.values(), key=lambda e: STAGES.index(e[0]))]


def _defaults(slot: Slot) -> list[tuple[str, str, Config]]:
    """A study's known-good configs without previous winners: (stage, variant, config) (`known_good`)."""
    return [(stage, v, c) for stage, v, c, _ in known_good(slot.op, slot.problem, slot.tunable)]


class Scheduler:
    """Rank 0's plan and order of a run (see the module docstring).

    `make_driver(slot)` opens the slot's study (a `tuning.study.StudyDriver`); `known(slot, variant,
    config)` says whether the store already holds that baseline; `deadline` is a `time.monotonic()`
    time after which nothing new starts (None: no limit) except the rest of coverage round 0;
    `known_good(slot)` lists the study's known-good configs as (stage, variant, config), in its order
    (`known_good` with the previous winners; default: each variant's defaults, the first ones the coverage), for
    `upcoming`.
    """

    def __init__(self, slots: Sequence[Slot], mode: str, make_driver: Callable[[Slot], Any],
                 known: Callable[[Slot, str, Config], bool], deadline: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 known_good: Callable[[Slot], list[tuple[str, str, Config]]] | None = None):
        self.slots = list(slots)
        self.mode = mode
        self.make_driver, self.known = make_driver, known
        self.known_good = known_good or _defaults
        self.deadline, self.clock = deadline, clock
        self.board = Board()
        self.urgent: list[Step] = []
        self.checked: dict[str, str] = {}  # problem -> the best config already confirmed (or found fine)
        self.checked_alt: dict[str, str] = {}  # problem -> the (alternative, best) already confirmed (or found fine)
        self.covered: set[str] = set()
        self.phase = "coverage"
        self.on_ahead: Callable[[Slot, str, Config], None] | None = None  # a sampled config asked ahead
        self._steps = self._plan()

    # -- what the rank loop asks ---------------------------------------------------------------------

    @property
    def forced(self) -> bool:
        """True while coverage round 0 runs: the time limit waits for it (signals do not)."""
        return self.phase == "coverage" and self._round == 0

    def out_of_time(self) -> bool:
        return self.deadline is not None and self.clock() > self.deadline and not self.forced

    def time_left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - self.clock())

    def next(self) -> Step | None:
        """The next step, or None when the run is done (every pass finished, or out of time)."""
        if self.urgent:
            return self.urgent.pop(0)
        if self.out_of_time():
            return None
        return next(self._steps, None)

    def record(self, step: Step, results: Sequence[Measurement]) -> None:
        """Take a step's results (rank 0, after they were stored): update the board, queue a confirmation
        where a baseline or a new best makes the problem's x BSP deviate from its neighbours'."""
        changed = False
        for m in results:
            if m.mode == self.mode and m.ok:
                confirmed = step.kind == "confirm"
                changed |= self.board.offer(step.slot.key, m.variant, m.median_us, m.config, confirmed,
                                            replace=confirmed)
        if step.kind == "trial" and step.phase == "search":
            step.slot.searched += 1
        if step.kind != "confirm" and (changed or step.kind == "baseline"):
            self._check(step.slot)

    def coverage(self) -> dict[str, tuple[int, int]]:
        """Per op: (problems covered, problems planned)."""
        out: dict[str, tuple[int, int]] = {}
        for s in self.slots:
            done, total = out.get(s.op.name, (0, 0))
            out[s.op.name] = (done + (s.key in self.covered), total + 1)
        return out

    def load(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Seed the board with stored best rows (`Store.best` of the study's mode): a resumed run."""
        keys = {s.key for s in self.slots}
        for r in rows:
            if r["problem"] in keys:
                self.board.offer(r["problem"], r["variant"], r["median_us"], r["config"],
                                 bool((r.get("extra") or {}).get("confirmed")))

    def audit(self) -> None:
        """Queue a confirmation for every planned problem whose x BSP deviates from its neighbours'."""
        for s in self.slots:
            self._check(s)

    def release(self) -> None:
        """The run ends: every study fails the trial it asked ahead and never handed out."""
        for s in self.slots:
            if s.driver is not None:
                s.driver.release()

    def upcoming(self) -> list[tuple[Slot, str, Config]]:
        """Every known-good config the coverage, priors and defaults passes will measure, in their order (what
        the compile-ahead workers are given): per pass, per round, per slot, as its study lists them."""
        passes: dict[str, list[tuple[Slot, str, Config]]] = {"coverage": [], "priors": [], "defaults": []}
        for s in sorted(self.slots, key=lambda s: s.round):
            if not s.tunable:
                continue
            for stage, v, c in self.known_good(s):
                if stage in passes and s.op.variants[v].check(s.problem, c) is None:
                    passes[stage].append((s, v, dict(c)))
        return [item for items in passes.values() for item in items]

    # -- the passes ----------------------------------------------------------------------------------

    _round = 0

    def _driver(self, slot: Slot) -> Any:
        if slot.driver is None and slot.tunable:
            slot.driver = self.make_driver(slot)
        return slot.driver

    def _trial(self, slot: Slot, phase: str, screen: bool) -> Step | None:
        driver = self._driver(slot)
        if driver is None or slot.done:
            return None
        job = driver.next(None if self.forced else self.deadline)
        if job is None:
            slot.done = True
            return None
        best, _ = self.board.best(slot.key)
        below = best * (1 + SCREEN_MARGIN) if screen and math.isfinite(best) else None
        if phase == "search" and self.on_ahead is not None:
            ahead = driver.ask_ahead(None if self.forced else self.deadline)
            if ahead is not None:
                self.on_ahead(slot, ahead.variant, ahead.config)
        return Step("trial", slot, job.variant, job.config, job=job, screen_below=below, phase=phase)

    def _cover(self, slot: Slot) -> Iterator[Step]:
        for v in slot.baselines:
            for c in slot.op.variants[v].defaults(slot.problem):
                if not self.known(slot, v, c):
                    yield Step("baseline", slot, v, dict(c), phase="coverage")
        driver = self._driver(slot)
        while driver is not None and not slot.done and driver.stage() == "coverage":
            step = self._trial(slot, "coverage", screen=False)
            if step is None:
                break
            yield step
        self.covered.add(slot.key)

    def _plan(self) -> Iterator[Step]:
        rounds = max((s.round for s in self.slots), default=-1) + 1
        for r in range(rounds):
            self._round = r
            if self.out_of_time():  # round 0 is done: the time limit applies from here on
                return
            for s in self.slots:
                if s.round == r:
                    yield from self._cover(s)
        self._round = rounds
        self.phase = "priors"
        if self.out_of_time():
            return
        self.audit()
        yield from self._known_good_pass("priors", ("coverage", "priors"))
        self.phase = "defaults"
        yield from self._known_good_pass("defaults", ("coverage", "priors", "defaults"))
        self.phase = "search"
        self.audit()
        while True:
            open_slots = [s for s in self.slots if s.tunable and not s.done]
            if not open_slots:
                return
            slot = max(open_slots, key=lambda s: (self.priority(s), -s.round))
            step = self._trial(slot, "search", screen=True)
            if step is not None:
                yield step

    def _known_good_pass(self, phase: str, stages: tuple[str, ...]) -> Iterator[Step]:
        """One known-good config per study in turn (by round) while its stage is among `stages`, screened."""
        waiting = [s for s in sorted(self.slots, key=lambda s: s.round) if s.tunable]
        while waiting:
            for s in list(waiting):
                step = None
                if not s.done and self._driver(s).stage() in stages:
                    step = self._trial(s, phase, screen=True)
                if step is None:
                    waiting.remove(s)
                else:
                    yield step

    def priority(self, slot: Slot) -> float:
        """How much the next sampled trial of `slot` may change what is decided: 1 / ((log gap between its
        best and runner-up variant + GAP_FLOOR) x (1 + trials it had in this run's search))."""
        per = sorted((self.board.us.get(slot.key) or {}).values())
        gap = math.log(per[1] / per[0]) if len(per) >= 2 else 1.0
        return 1.0 / ((gap + GAP_FLOOR) * (1 + slot.searched))

    # -- outliers ------------------------------------------------------------------------------------

    def _check(self, slot: Slot) -> None:
        """Queue the confirmations `slot` needs: its x BSP's (`_check_bsp`) and its x alt's (`_check_alt`)."""
        self._check_bsp(slot)
        self._check_alt(slot)

    def _check_alt(self, slot: Slot) -> None:
        """Queue a confirmation of `slot`'s fastest alternative (torch's op) and its best variant where its
        x alt deviates from its neighbours' (a torch op timed during a hiccup makes autofuse look 10x
        ahead), once per problem, alternative and best config a run, and not where both are confirmed."""
        key = slot.key
        alt, _ = alternative_ratio(slot.op, self.board.us.get(key) or {})
        _, best = self.board.best(key)
        if alt is None or best is None or best == alt:
            return
        tag = f"{alt}|{best}:{config_key(self.board.configs[key][best])}"
        if self.checked_alt.get(key) != tag and self._deviating(slot, lambda us: alternative_ratio(slot.op, us)[1]):
            self.checked_alt[key] = tag
            self._confirm(slot, (alt, best))

    def _deviating(self, slot: Slot, ratio: Callable[[Mapping[str, float]], float | None]) -> bool:
        """Whether `ratio` of `slot`'s latencies deviates from that of the nearest planned problems of its op."""
        ratios = {s.key: ratio(self.board.us.get(s.key) or {}) for s in self.slots if s.op.name == slot.op.name}
        have = [k for k, r in ratios.items() if r is not None]
        return deviates(ratios[slot.key], [ratios[k] for k in neighbours(slot.key, have)])

    def _confirm(self, slot: Slot, variants: tuple[str, str]) -> None:
        """Queue `variants` of `slot`, at their board configs, to be re-measured in turns, unless both are
        confirmed already."""
        confirmed = self.board.confirmed.get(slot.key, {})
        if all(confirmed.get(v) for v in variants):
            return
        configs = self.board.configs[slot.key]
        self.urgent.append(Step("confirm", slot, candidates=[(v, dict(configs[v])) for v in variants], phase="confirm"))

    def _check_bsp(self, slot: Slot) -> None:
        """Queue a confirmation of `slot`'s BSP and best non-BSP variant where its x BSP deviates from its
        neighbours' (once per problem and best config a run, and not where both are confirmed already)."""
        key = slot.key
        us = self.board.us.get(key) or {}
        others = {v: t for v, t in us.items() if v != "bsp"}
        if "bsp" not in us or not others:
            return
        rival = min(others, key=others.get)
        tag = f"{rival}:{config_key(self.board.configs[key][rival])}"
        if self.checked.get(key) != tag and self._deviating(slot, bsp_ratio):
            self.checked[key] = tag
            self._confirm(slot, ("bsp", rival))
