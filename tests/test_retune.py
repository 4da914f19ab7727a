"""A re-tune after a change to an op's code: the previous winners (rows of other op code) are measured first,
and `autofuse tune --sweep stored` re-measures the problems a database holds (`tuning.study`'s
`previous_winners` / `known_good`, `tuning.schedule`'s priors pass, `tuning.tune.stored_problems`).

RETUNE_OP is an all-reduce, fast under any config; the old code's rows are fabricated in the store with
another op digest (and, for keys an op no longer reads, copied with sqlite3). Every rank run has a timeout.
"""
from __future__ import annotations

import sqlite3
from types import SimpleNamespace

import optuna
import pytest
import torch
import torch.distributed as dist

from autofuse.core.op import Op, Problem, Variant
from autofuse.measure import environment
from autofuse.measure.store import Store
from autofuse.measure.timing import Measurement
from autofuse.tuning.storage import default_storage, open_storage

from test_tune import _build_chunked, _inputs, _reference  # test_tune's toy op: its chunked all-reduce, inputs, float64 reference

OLD = "0ld0ld0ld0ld0ld0"  # the op digest of the code before the change


# -- the op: out = sum over ranks of x_r, in chunks ------------------------------------------------------

class Bsp(Variant):
    name, family = "bsp", "bsp"

    def runner(self, world, problem, config):
        def run(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            out = torch.empty_like(x) if out is None else out
            out.copy_(x)
            dist.all_reduce(out, group=world.group)
            return out
        return run


class Chunked(Variant):
    """An all-reduce chunk by chunk; a chunk of 24 is refused (the check of the new code)."""

    name, family = "chunked", "fused"

    def space(self, trial, problem):
        return {"chunk": trial.suggest_categorical("chunk", [4, 8, 16, 32])}

    def defaults(self, problem):
        return [{"chunk": 16}, {"chunk": 32}]

    def check(self, problem, config):
        if config["chunk"] == 24 or problem["N"] % config["chunk"]:
            return f"chunk {config['chunk']} is refused for N={problem['N']}"
        return None

    def runner(self, world, problem, config):
        return _build_chunked(world, problem, {"chunk": config["chunk"], "bias": 0})


def _op(name: str, variants: list[Variant]) -> Op:
    return Op(name=name, args=("x",), variants=variants,
              problem_of=lambda world, x: Problem.make(name, x.dtype, world.size, N=x.numel()),
              inputs=_inputs, reference=_reference, tolerance=lambda p: 1e-5,
              features=lambda p: {"N": float(p["N"])},  # reads N: a key without it is no problem of this op
              sweep=lambda kind, world: [Problem.make(name, "float32", world, N=n) for n in (64, 96)])


RETUNE_OP = _op("retune_sum", [Bsp(), Chunked()])
TWO_OP = _op("retune_two", [Bsp(), Chunked(), Chunked("slow")])


def _row(problem: Problem, variant: str, config: dict, us: float, ok: bool = True) -> Measurement:
    return Measurement(problem, variant, config, "eager", ok, "" if ok else "wrong result", 0.0, us, us, us, us, 3)


# -- the study: what it enqueues ------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_the_previous_winner_of_each_variant_is_measured_first_and_never_held_back(tmp_path):
    """Rows of older code: the overall winner (a config no default holds) is the study's coverage, then the
    winner's runner-up and every other variant's best (the priors), then the defaults; configs of a variant
    not available now, refused by the check, failed with that code, of other hardware or another mode are
    not taken. A previous best far behind (out of the race for sampled trials) is measured all the same."""
    from autofuse.tuning.study import StudyDriver, study_name

    fp = environment.fingerprint()
    other_hw = dict(fp, gpu_name="Imaginary GPU")
    other_hw["hardware_id"] = environment.hardware_id(other_hw)
    other_hw["id"] = environment.fingerprint_id(other_hw)
    problem = TWO_OP.sweep("cpu", 2)[0]
    digest = environment.op_digest(TWO_OP)
    store = Store(tmp_path / "s.db")
    store.add([_row(problem, "chunked", {"chunk": 8}, 5.0), _row(problem, "chunked", {"chunk": 4}, 6.0),
               _row(problem, "chunked", {"chunk": 32}, 9.0),  # third of the winner's: not taken
               _row(problem, "chunked", {"chunk": 24}, 1.0),  # refused by today's check
               _row(problem, "gone", {"x": 1}, 0.5),  # a variant removed since
               _row(problem, "slow", {"chunk": 4}, 60.0), _row(problem, "slow", {"chunk": 8}, 50.0),
               _row(problem, "slow", {"chunk": 16}, 0.1, ok=False)], fp, op_digest=OLD)  # failed then
    store.add([_row(problem, "slow", {"chunk": 32}, 0.2)], other_hw, op_digest=OLD)  # other hardware
    store.add([Measurement(problem, "slow", {"chunk": 64}, "graph", True, "", 0.0, .3, .3, .3, .3, 3)], fp,
              op_digest=OLD)  # another mode
    storage = open_storage(default_storage(tmp_path / "s.db"))
    driver = StudyDriver(storage, store, fp, TWO_OP, problem, "eager", ["chunked", "slow"], 6, digest)
    try:
        assert [(v, c) for v, c, _ in driver.previous] == [("chunked", {"chunk": 8}), ("chunked", {"chunk": 4}),
                                                            ("slow", {"chunk": 8})]
        stages = []
        jobs = []
        while (stage := driver.stage()) != "done":
            job = driver.next(None)
            if job is None:
                break
            stages.append(stage)
            jobs.append((job.variant, job.config))
            us = {"chunked": 10.0, "slow": 40.0}[job.variant]  # slow: 4x behind, out of the race
            driver.finish(job, [_row(problem, job.variant, job.config, us)])
        assert jobs[:3] == [("chunked", {"chunk": 8}), ("chunked", {"chunk": 4}), ("slow", {"chunk": 8})]
        assert stages[:3] == ["coverage", "priors", "priors"] and stages[3] == "defaults"
        assert ("slow", {"chunk": 16}) in jobs[3:5] and ("chunked", {"chunk": 16}) in jobs[3:5]  # first defaults
        trials = driver.study.get_trials(deepcopy=False)
        first = [t for t in trials if t.user_attrs.get("measured")][:3]
        assert [t.user_attrs["prior_index"] for t in first] == [0, 1, 2]
        assert all(t.user_attrs["prior"] and t.user_attrs["prior_digest"] == OLD for t in first)
        assert first[0].user_attrs["prior_us"] == 5.0
        assert driver.study.study_name == study_name(problem, "eager", fp["hardware_id"], digest)
        rows = store.measurements(op="retune_two", mode="eager", op_digest=digest)
        assert [(r["variant"], r["config"]) for r in rows[:3]] == jobs[:3]  # stored as measured, new code
    finally:
        store.close()


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_a_previous_winner_that_is_a_default_is_enqueued_once_with_both_marks(tmp_path):
    """Without rows of older code nothing changes (first defaults are the coverage); a previous winner that
    is also a default is measured once, in the coverage, marked both prior and default."""
    from autofuse.tuning.study import StudyDriver, known_good

    problem = RETUNE_OP.sweep("cpu", 2)[0]
    plain = known_good(RETUNE_OP, problem, ["chunked"])
    assert [(s, c) for s, _, c, _ in plain] == [("coverage", {"chunk": 16}), ("defaults", {"chunk": 32})]
    fp = environment.fingerprint()
    store = Store(tmp_path / "d.db")
    store.add([_row(problem, "chunked", {"chunk": 16}, 5.0)], fp, op_digest=OLD)
    driver = StudyDriver(open_storage(default_storage(tmp_path / "d.db")), store, fp, RETUNE_OP, problem, "eager",
                         ["chunked"], 1, environment.op_digest(RETUNE_OP))
    try:
        (stage, variant, config, attrs), (later, *_) = driver._queue()
        assert (stage, config, later) == ("coverage", {"chunk": 16}, "defaults")
        assert attrs["prior"] and attrs["prior_index"] == 0 and attrs["default"] and attrs["default_index"] == 0
    finally:
        store.close()


# -- the scheduler: priors of every problem before any other default ----------------------------------

class PriorDriver:
    """A study with one coverage trial, `priors` previous winners, two defaults, then sampled trials."""

    def __init__(self, slot, priors: int):
        self.slot, self.n = slot, 0
        self.plan = ["coverage"] + ["priors"] * priors + ["defaults"] * 2 + ["search"] * 2

    def stage(self) -> str:
        return self.plan[self.n] if self.n < len(self.plan) else "done"

    def next(self, deadline):
        if self.n >= len(self.plan):
            return None
        self.n += 1
        return SimpleNamespace(trial=self.n - 1, variant="fast", config={"i": self.n})


def test_every_problems_previous_winners_come_before_any_other_default():
    from autofuse.tuning.schedule import Scheduler, Slot

    variant = SimpleNamespace(defaults=lambda p: [{}], check=lambda p, c: None)
    op = SimpleNamespace(name="a_op", variants={"bsp": variant, "fast": variant})
    slots = [Slot(2, op, Problem.make("a_op", "float32", 2, M=64 * 2 ** i), ["fast"], ["bsp"], i) for i in range(3)]
    priors = {slots[0].key: 3, slots[1].key: 1, slots[2].key: 0}
    sched = Scheduler(slots, "eager", lambda s: PriorDriver(s, priors[s.key]), lambda *a: False)
    phases = []
    while (step := sched.next()) is not None:
        phases.append((step.phase, step.slot.key))
        us = 12.0 if step.variant == "bsp" else 10.0
        sched.record(step, [Measurement(step.slot.problem, step.variant, step.config, "eager", True, "", 0.0, us,
                                        us, us, us, 3)])
    order = [p for p, _ in phases]
    assert order == sorted(order, key=["coverage", "priors", "defaults", "search"].index)
    assert order.count("priors") == 4 and order.count("defaults") == 6


# -- `--sweep stored` ------------------------------------------------------------------------------------

def _stored_db(tmp_path) -> tuple[str, dict]:
    """A database holding RETUNE_OP's problems: N=64 and N=96 at world 2 with rows of older code, N=128 at
    world 4, N=32 on other hardware, and a copy of N=64's rows under a key the op no longer reads."""
    fp = environment.fingerprint()
    other = dict(fp, gpu_name="Imaginary GPU")
    other["hardware_id"] = environment.hardware_id(other)
    other["id"] = environment.fingerprint_id(other)
    db = tmp_path / "stored.db"
    p64, p96 = (Problem.make("retune_sum", "float32", 2, N=n) for n in (64, 96))
    with Store(db) as store:
        for p in (p64, p96):
            store.add([_row(p, "bsp", {}, 20.0)], fp, source="baseline", op_digest=OLD)
            store.add([_row(p, "chunked", {"chunk": 8}, 5.0), _row(p, "chunked", {"chunk": 4}, 6.0)], fp,
                      op_digest=OLD)
        store.add([_row(Problem.make("retune_sum", "float32", 4, N=128), "bsp", {}, 9.0)], fp, op_digest=OLD)
        store.add([_row(Problem.make("retune_sum", "float32", 2, N=32), "bsp", {}, 9.0)], other, op_digest=OLD)
    bad = "retune_sum|M=64|float32|w2"
    con = sqlite3.connect(db)
    with con:
        con.execute("INSERT INTO problems (key, op, dtype, world, dims) VALUES (?, 'retune_sum', 'float32', 2, "
                    "'{\"M\": 64}')", [bad])
        cols = [r[1] for r in con.execute("PRAGMA table_info(measurements)") if r[1] not in ("id", "problem")]
        con.execute(f"INSERT INTO measurements (problem, {', '.join(cols)}) SELECT ?, {', '.join(cols)} "
                    "FROM measurements WHERE problem = ? AND variant = 'bsp'", [bad, p64.key])
    con.close()
    return str(db), {"p64": p64, "p96": p96, "bad": bad, "fp": fp}


def test_sweep_stored_takes_the_stored_problems_of_this_hardware_and_world(tmp_path):
    from autofuse.tuning.tune import TuneOptions, describe_plan, make_plan

    db, held = _stored_db(tmp_path)
    options = TuneOptions(db=db, ops=["test_retune:RETUNE_OP"], sweep="stored", worlds=[2])
    plan = make_plan(options, "cpu", 2)
    ((world, op, problems, tunable),) = plan.items
    assert world == 2 and op.name == "retune_sum" and tunable == ["chunked"]
    assert problems == [held["p64"], held["p96"]]  # not world 4's N=128, nor the other hardware's N=32
    (line,) = plan.skipped
    assert line.startswith(f"skipped stored problem {held['bad']}: retune_sum no longer reads it")
    text = describe_plan(plan, options, 2)
    assert "tuning 2 problems (retune_sum 2)" in text and "sweep stored (2 problems from the database" in text
    assert "previous winners re-measured first" in text and text.splitlines()[1] == line
    one = make_plan(TuneOptions(db=db, ops=["test_retune:RETUNE_OP"], sweep="stored", worlds=[2], limit=1), "cpu", 2)
    assert one.items[0][2] == [held["p64"]]
    four = make_plan(TuneOptions(db=db, ops=["test_retune:RETUNE_OP"], sweep="stored", worlds=[4]), "cpu", 4)
    assert [p.key for p in four.items[0][2]] == ["retune_sum|N=128|float32|w4"]
    with pytest.raises(ValueError, match="no problem of any registered op") as exc:
        make_plan(TuneOptions(db=db, sweep="stored", worlds=[2]), "cpu", 2)  # retune_sum is not registered
    assert "no op retune_sum is registered" in str(exc.value)
    with pytest.raises(ValueError, match="--sweep stored reads the problems of the database"):
        make_plan(TuneOptions(db=str(tmp_path / "missing.db"), sweep="stored"), "cpu", 2)


def test_a_stored_re_tune_on_cpu_ranks_measures_each_problems_previous_winners_first(tmp_path):
    """`tune --sweep stored` after a code change: every stored problem of the world is re-measured, its
    baseline and previous winner first (full reps, the coverage), then the winner's runner-up; with two trials
    per problem neither default (chunk 16, 32) is reached: without the previous winners they would be."""
    from autofuse.comm.world import spawn
    from autofuse.tuning.tune import TuneOptions, tune_rank

    db, held = _stored_db(tmp_path)
    options = TuneOptions(db=db, ops=["test_retune:RETUNE_OP"], sweep="stored", worlds=[2], trials=2, verbose=False)
    result = spawn(tune_rank, 2, options, device_kind="cpu", timeout_s=300)[0]
    digest = environment.op_digest(RETUNE_OP)
    assert result["stats"]["coverage"] == {"retune_sum": (2, 2)} and result["stats"]["trials"] == 4
    assert {r["problem"] for r in result["rows"]} == {held["p64"].key, held["p96"].key}
    with Store(db, readonly=True) as store:
        new = store.measurements(op="retune_sum", mode="eager", op_digest=digest)
    for p in (held["p64"], held["p96"]):
        rows = [r for r in new if r["problem"] == p.key]
        assert [(r["source"], r["variant"], r["config"]) for r in rows] == [
            ("baseline", "bsp", {}), ("tune", "chunked", {"chunk": 8}), ("tune", "chunked", {"chunk": 4})]
        assert "screen" not in rows[1]["extra"]  # the coverage: full reps
    storage = open_storage(default_storage(db))
    for s in optuna.get_all_study_summaries(storage):
        trials = optuna.load_study(study_name=s.study_name, storage=storage).get_trials(deepcopy=False)
        assert [(t.user_attrs["config"], t.user_attrs.get("prior_index")) for t in trials] == [
            ({"chunk": 8}, 0), ({"chunk": 4}, 1)]
