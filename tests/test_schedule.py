"""The tuner's order and its outlier rule without ranks: `tuning.schedule`, `measure.compare`'s outlier
functions, the store preferring confirmed rows, and `show`/`export` withholding an unconfirmed outlier's
speedups. The end-to-end runs (a cut-short tune covers every op; an outlier re-measured in turns) are in
test_tune.py."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from autofuse.core.op import Problem
from autofuse.measure import compare, environment
from autofuse.measure.store import Store
from autofuse.measure.timing import Measurement
from autofuse.tuning.schedule import SCREEN_MARGIN, Scheduler, Slot, spread


def test_spread_covers_the_ends_first_then_the_middles():
    assert spread(0) == [] and spread(1) == [0] and spread(2) == [0, 1]
    assert spread(5) == [0, 4, 2, 1, 3]
    for n in range(1, 40):
        assert sorted(spread(n)) == list(range(n))


# -- a scheduler over stand-in studies -------------------------------------------------------------------

class FakeDriver:
    """A study with `firsts` coverage trials (first defaults), `others` more defaults, then sampled ones,
    `trials` measured in all."""

    def __init__(self, slot, firsts: int, others: int, trials: int):
        self.slot, self.firsts, self.others, self.trials = slot, firsts, others, trials
        self.n = 0

    def stage(self) -> str:
        if self.n >= self.trials:
            return "done"
        return "coverage" if self.n < self.firsts else "defaults" if self.n < self.firsts + self.others else "search"

    def next(self, deadline):
        if self.n >= self.trials:
            return None
        self.n += 1
        v = self.slot.tunable[(self.n - 1) % len(self.slot.tunable)]
        return SimpleNamespace(trial=self.n - 1, variant=v, config={"i": self.n})


def _op(name: str):
    variant = SimpleNamespace(defaults=lambda p: [{}], check=lambda p, c: None)
    return SimpleNamespace(name=name, variants={"bsp": variant, "fast": variant, "slow": variant})


def _slots(ops=("a_op", "b_op", "c_op"), problems: int = 3) -> list[Slot]:
    slots = []
    for name in ops:
        op = _op(name)
        rounds = {i: r for r, i in enumerate(spread(problems))}
        slots += [Slot(2, op, Problem.make(name, "float32", 2, M=64 * 2 ** i), ["fast", "slow"], ["bsp"], rounds[i])
                  for i in range(problems)]
    return slots


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _scheduler(slots, deadline=None, clock=None, trials: int = 6, known=lambda *a: False) -> Scheduler:
    return Scheduler(slots, "eager", lambda s: FakeDriver(s, 2, 1, trials), known, deadline, clock or Clock())


def _result(step, us: float) -> list[Measurement]:
    return [Measurement(step.slot.problem, step.variant, step.config, "eager", True, "", 0.0, us, us, us, us, 3)]


def test_coverage_interleaves_the_ops_round_by_round_then_defaults_then_search():
    sched = _scheduler(_slots())
    steps = []
    while (step := sched.next()) is not None:
        steps.append(step)
        sched.record(step, _result(step, 10.0 if step.variant != "bsp" else 12.0))
    coverage = [s for s in steps if s.phase == "coverage"]
    assert len(coverage) == 9 * 3  # per problem: bsp + the first default of fast and slow
    order = [(s.slot.op.name, s.slot.round) for s in coverage]
    assert order[:3] == [("a_op", 0)] * 3 and order[3:6] == [("b_op", 0)] * 3 and order[6:9] == [("c_op", 0)] * 3
    assert [r for _, r in order] == sorted(r for _, r in order), "a round starts only after the last one"
    assert [s.slot.problem["M"] for s in coverage[::3][:3]] == [64, 64, 64]
    assert [s.slot.problem["M"] for s in coverage[9::3][:3]] == [256, 256, 256]  # round 1: the other end
    phases = [s.phase for s in steps]
    assert phases == sorted(phases, key=["coverage", "defaults", "search"].index)
    assert all(s.screen_below == pytest.approx(10.0 * (1 + SCREEN_MARGIN)) for s in steps if s.phase != "coverage")
    assert all(s.screen_below is None for s in coverage)
    assert sched.coverage() == {"a_op": (3, 3), "b_op": (3, 3), "c_op": (3, 3)}
    assert len([s for s in steps if s.kind == "trial"]) == 9 * 6  # every study's budget spent


def test_a_time_limit_waits_for_round_zero_only():
    """Past the deadline from the start: round 0 (one problem of every op) is still measured whole, and
    nothing after it starts; a run with baselines already stored starts with the trials."""
    clock = Clock()
    clock.t = 100.0
    sched = _scheduler(_slots(), deadline=1.0, clock=clock)
    steps = []
    while (step := sched.next()) is not None:
        steps.append(step)
        sched.record(step, _result(step, 10.0))
    assert {(s.slot.op.name, s.slot.round) for s in steps} == {("a_op", 0), ("b_op", 0), ("c_op", 0)}
    assert len(steps) == 9 and sched.out_of_time()
    assert sched.coverage() == {"a_op": (1, 3), "b_op": (1, 3), "c_op": (1, 3)}
    again = _scheduler(_slots(), known=lambda *a: True)
    assert again.next().kind == "trial"


def test_search_goes_to_the_closest_contest_first():
    slots = _slots(ops=("a_op",), problems=2)
    sched = _scheduler(slots, trials=4)
    for s, (bsp, fast) in zip(slots, ((10.0, 9.9), (10.0, 5.0))):  # problem 0: a close call; problem 1: settled
        sched.board.offer(s.key, "bsp", bsp, {})
        sched.board.offer(s.key, "fast", fast, {})
    assert sched.priority(slots[0]) > sched.priority(slots[1])
    slots[0].searched = 100
    assert sched.priority(slots[0]) < sched.priority(slots[1])  # many trials there already: spread them


def _board_row(key, variant, us, confirmed=False):
    return {"problem": key, "variant": variant, "median_us": us, "config": {}, "extra": {"confirmed": confirmed}}


def test_a_deviating_baseline_is_queued_for_confirmation_once():
    slots = _slots(ops=("a_op",), problems=3)
    sched = _scheduler(slots)
    keys = [s.key for s in slots]
    # neighbours: BSP 1.2x the best; the middle problem's BSP 5x (the 1977.6 vs 366.2 us)
    sched.load([_board_row(keys[0], "bsp", 12.0), _board_row(keys[0], "fast", 10.0),
                _board_row(keys[2], "bsp", 48.0), _board_row(keys[2], "fast", 40.0),
                _board_row(keys[1], "fast", 20.0)])
    step = SimpleNamespace(kind="baseline", slot=slots[1], variant="bsp", config={}, phase="coverage")
    sched.record(step, _result(step, 100.0))
    confirm = sched.next()
    assert confirm.kind == "confirm" and confirm.slot is slots[1]
    assert [v for v, _ in confirm.candidates] == ["bsp", "fast"]
    sched.record(confirm, _result(SimpleNamespace(slot=slots[1], variant="bsp", config={}), 24.0))
    assert sched.board.us[keys[1]]["bsp"] == 24.0  # the confirmed value replaces the outlier
    sched.record(step, _result(step, 100.0))
    assert sched.next().kind != "confirm", "a problem's best is confirmed once a run"
    sched.audit()
    assert not sched.urgent


def test_a_deviating_alternative_is_queued_for_confirmation_once():
    """torch's op timed during a hiccup (round 25: torch_symm 3508 us where its neighbours took about 1.1x the
    best) makes x alt deviate: the alternative and the best are re-measured in turns, once."""
    slots = _slots(ops=("a_op",), problems=3)
    for s in slots:
        s.op.variants["torch"] = SimpleNamespace(family="peer", defaults=lambda p: [{}], check=lambda p, c: None)
    sched = _scheduler(slots)
    keys = [s.key for s in slots]
    sched.load([_board_row(k, v, us) for k, rows in ((keys[0], (("bsp", 12.0), ("fast", 10.0), ("torch", 11.0))),
                                                     (keys[2], (("bsp", 48.0), ("fast", 40.0), ("torch", 44.0))),
                                                     (keys[1], (("bsp", 24.0), ("fast", 20.0))))
                for v, us in rows])
    step = SimpleNamespace(kind="baseline", slot=slots[1], variant="torch", config={}, phase="coverage")
    sched.record(step, _result(step, 200.0))  # x alt 10 where the neighbours' are 1.1
    confirm = sched.next()
    assert confirm.kind == "confirm" and confirm.slot is slots[1]
    assert [v for v, _ in confirm.candidates] == ["torch", "fast"]
    sched.record(confirm, _result(SimpleNamespace(slot=slots[1], variant="torch", config={}), 22.0))
    assert sched.board.us[keys[1]]["torch"] == 22.0
    sched.record(step, _result(step, 200.0))
    assert sched.next().kind != "confirm", "an alternative is confirmed once a run"
    sched.audit()
    assert not sched.urgent


# -- the rule itself, in measure.compare ----------------------------------------------------------------

def test_neighbours_and_deviation():
    key = lambda m, dt="bfloat16": f"ag_gemm|K=8192,M={m},N=3584,gather=rows|{dt}|w2"  # noqa: E731
    keys = [key(m) for m in (1024, 2048, 4096, 8192, 16384)] + [key(4096, "float16"),
                                                                "ag_gemm|K=8192,M=4096,N=3584,gather=k|bfloat16|w2"]
    assert compare.neighbours(key(4096), keys) == [key(2048), key(8192)]  # same dtype and gather form only
    assert compare.neighbours(key(1024), keys, k=5) == [key(2048), key(4096), key(8192), key(16384)]
    assert compare.deviates(5.4, [1.2, 1.3]) and compare.deviates(0.5, [1.2, 1.3])
    assert not compare.deviates(1.5, [1.2, 1.3]) and not compare.deviates(5.4, []) and not compare.deviates(None, [1.2])


def _table(confirmed: bool) -> list[dict]:
    from autofuse.bench.tables import problem_table

    rows = []
    for m, bsp, best in ((2048, 200.0, 180.0), (4096, 1977.6, 366.2), (8192, 800.0, 700.0)):
        key = f"ag_gemm|K=8192,M={m},N=3584,gather=rows|bfloat16|w2"
        sure = confirmed and m == 4096
        rows += [{"problem": key, "op": "ag_gemm", "variant": "bsp", "median_us": bsp, "config": {},
                  "extra": {"confirmed": sure}},
                 {"problem": key, "op": "ag_gemm", "variant": "push_ws", "median_us": best, "config": {"a": 1},
                  "extra": {"confirmed": sure}}]
    return problem_table(rows)


def test_show_prints_no_speedup_resting_on_an_unconfirmed_outlier():
    table = _table(confirmed=False)
    outlier = table[1]
    assert outlier["unconfirmed"] and outlier["speedup_vs_bsp"] is None and outlier["own_vs_bsp"] is None
    assert outlier["best"] == "push_ws" and outlier["us"]["bsp"] == 1977.6  # latencies stay
    assert table[0]["speedup_vs_bsp"] == pytest.approx(200 / 180) and not table[0].get("unconfirmed")
    sure = _table(confirmed=True)[1]
    assert sure["speedup_vs_bsp"] == pytest.approx(1977.6 / 366.2) and not sure.get("unconfirmed")


def test_show_prints_no_x_alt_resting_on_an_unconfirmed_alternative():
    from autofuse.bench.tables import problem_table

    def table(confirmed: bool) -> list[dict]:
        rows = []
        for m, bsp, best, alt in ((2048, 210.0, 190.0, 200.0), (4096, 400.0, 323.0, 3508.4), (8192, 800.0, 650.0, 720.0)):
            key = f"gemm_rs|K=14336,M={m},N=4096|bfloat16|w2"
            sure = confirmed and m == 4096
            rows += [{"problem": key, "op": "gemm_rs", "variant": v, "median_us": us, "config": {},
                      "extra": {"confirmed": sure and v != "bsp"}}
                     for v, us in (("bsp", bsp), ("mm_ring", best), ("torch_symm", alt))]
        return problem_table(rows)

    outlier = table(confirmed=False)[1]
    assert outlier["unconfirmed_alt"] and not outlier.get("unconfirmed")
    assert outlier["speedup_vs_alternative"] is None and outlier["own_vs_alternative"] is None
    assert outlier["speedup_vs_bsp"] == pytest.approx(400.0 / 323.0)  # x BSP does not rest on torch's op
    others = table(confirmed=False)[::2]
    assert all(not e.get("unconfirmed_alt") and e["speedup_vs_alternative"] for e in others)
    sure = table(confirmed=True)[1]
    assert not sure.get("unconfirmed_alt") and sure["speedup_vs_alternative"] == pytest.approx(3508.4 / 323.0)


def test_show_and_export_say_unconfirmed(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from autofuse.cli import app

    gpu = dict(environment.fingerprint(), device_kind="cuda", gpu_name="Imaginary GPU", gpu_count=2)
    gpu["id"] = environment.fingerprint_id(gpu)
    db = tmp_path / "o.db"
    with Store(db) as store:
        for m, bsp, best in ((2048, 200.0, 180.0), (4096, 1977.6, 366.2), (8192, 800.0, 700.0)):
            p = Problem.make("ag_gemm", "bfloat16", 2, M=m, N=3584, K=8192, gather="rows")
            for v, us in (("bsp", bsp), ("heap_mm", best)):
                store.add([Measurement(p, v, {}, "graph", True, "", 0.0, us, us, us, us, 10)], gpu, source="baseline")
    monkeypatch.chdir(tmp_path)
    show = CliRunner().invoke(app, ["show", "--db", str(db), "--json"])
    assert show.exit_code == 0, show.output
    problems = json.loads(show.stdout)["graph"]["problems"]
    assert [p["speedup_vs_bsp"] is None for p in problems] == [False, True, False]
    assert [bool(p.get("unconfirmed")) for p in problems] == [False, True, False]
    table = CliRunner().invoke(app, ["show", "--db", str(db)])
    assert "unconfirmed" in table.stdout and "5.40" not in table.stdout
    export = CliRunner().invoke(app, ["export", "--db", str(db), "--format", "json"])
    assert export.exit_code == 0, export.output
    records = json.loads((tmp_path / "autofuse-out" / "tuning-graph.json").read_text())
    (outlier,) = [r for r in records if r["M"] == 4096]
    assert outlier["unconfirmed"] and outlier["speedup_vs_bsp"] is None


def test_the_store_prefers_a_confirmed_row_to_the_configs_earlier_ones(tmp_path):
    """A winner timed low by chance, then re-measured in turns: best() reads the confirmed latency, though
    it is slower; an unrelated config's rows are untouched."""
    p = Problem.make("ag_gemm", "bfloat16", 2, M=64, N=64, K=64, gather="rows")
    fp = environment.fingerprint()

    def row(variant, config, us, **extra):
        return Measurement(p, variant, config, "eager", True, "", 0.0, us, us, us, us, 5, extra)

    with Store(tmp_path / "c.db") as store:
        store.add([row("pull", {"BLOCK_M": 16}, 5.0), row("pull", {"BLOCK_M": 32}, 9.0)], fp)
        store.add([row("bsp", {}, 20.0)], fp, source="baseline")
        store.add([row("pull", {"BLOCK_M": 16}, 8.0, confirmed=True)], fp)
        best = {r["variant"]: r for r in store.best("ag_gemm", "eager")}
        assert best["pull"]["median_us"] == 8.0 and best["pull"]["extra"]["confirmed"] is True
        assert best["bsp"]["median_us"] == 20.0 and not best["bsp"]["extra"].get("confirmed")
        assert math.isclose(min(r["median_us"] for r in store.measurements(op="ag_gemm")), 5.0)  # nothing deleted
