"""`autofuse tune` end to end on CPU ranks: the loop, resume after kill -9 and Ctrl-C, two workers on PostgreSQL.

The real ag_gemm runs at 2 ranks with one deliberately wrong variant added; the resume and worker
tests use FAKE_OP below (an all-reduce, fast under any config), since they are about the tuner.
Every subprocess has a timeout; a hung run fails the test instead of stalling CI.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
import torch.distributed as dist

from autofuse import environment
from autofuse.measure import Measurement
from autofuse.op import InvalidConfig, Op, Problem, Variant
from autofuse.store import ALL, Store
from autofuse.tune import default_storage, storage_url

import pg

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# -- a fake op: out = sum over ranks of x_r ------------------------------------------------------------


def _delay() -> None:
    ms = float(os.environ.get("AUTOFUSE_FAKE_DELAY_MS", "0"))
    if ms:
        time.sleep(ms / 1000)


def _inputs(world, problem: Problem, seed: int) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + world.rank)
    return (torch.randn(problem["N"], generator=g).to(world.device),)


def _reference(world, problem: Problem, seed: int) -> torch.Tensor:
    gens = [torch.Generator().manual_seed(seed * 1000 + r) for r in range(world.size)]
    return sum(torch.randn(problem["N"], generator=g).double() for g in gens)


def _build_bsp(world, problem: Problem, config: dict):
    def run(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(x) if out is None else out
        out.copy_(x)
        dist.all_reduce(out, group=world.group)
        _delay()
        return out
    return run


def _check(problem: Problem, config: dict) -> str | None:
    return f"chunk {config['chunk']} does not divide N={problem['N']}" if problem["N"] % config["chunk"] else None


def _build_chunked(world, problem: Problem, config: dict):
    """All-reduce in chunks; bias=1 is deliberately wrong (adds 0.01), so its configs fail the check."""
    why = _check(problem, config)
    if why:
        raise InvalidConfig(why)
    chunk, bias = config["chunk"], config["bias"]

    def run(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(x) if out is None else out
        out.copy_(x)
        for i in range(0, x.numel(), chunk):
            part = out[i:i + chunk].clone()
            dist.all_reduce(part, group=world.group)
            out[i:i + chunk] = part + 0.01 * bias
        _delay()
        return out
    return run


FAKE_OP = Op(
    name="fake_sum",
    variants={
        "bsp": Variant("bsp", _build_bsp, fused=False),
        "chunked": Variant(
            "chunked", _build_chunked, check=_check,
            space=lambda t, p: {"chunk": t.suggest_categorical("chunk", [4, 8, 16, 24, 32]),
                                "bias": t.suggest_categorical("bias", [0, 1])},
            defaults=lambda p: [{"chunk": 16, "bias": 0}, {"chunk": 32, "bias": 1}]),
    },
    problem_of=lambda world, x: Problem.make("fake_sum", x.dtype, world.size, N=x.numel()),
    inputs=_inputs, reference=_reference, tolerance=lambda p: 1e-5, features=lambda p: {},
    sweep=lambda kind, world: [Problem.make("fake_sum", "float32", world, N=n) for n in (64, 96)],
)


# -- ag_gemm with a deliberately wrong variant -----------------------------------------------------------

def _ag_gemm_with_wrong() -> Op:
    from autofuse import registry

    real = registry.get("ag_gemm")
    bsp = real.variants["bsp"]

    def build_wrong(world, problem, config):
        run = bsp.build(world, problem, {})

        def wrong(*inputs, out=None):
            res = run(*inputs, out=out)
            res.mul_(1.0 + config["scale"] / 100)
            return res
        return wrong

    wrong = Variant("wrong", build_wrong, space=lambda t, p: {"scale": t.suggest_categorical("scale", [5, 10])},
                    defaults=lambda p: [{"scale": 5}])
    return dataclasses.replace(real, variants={"bsp": bsp, "wrong": wrong,
                                               **{k: v for k, v in real.variants.items() if k != "bsp"}})


def __getattr__(name: str):
    if name == "AG_GEMM_WITH_WRONG":  # built on first use, so importing this module needs no ag_gemm
        return _ag_gemm_with_wrong()
    raise AttributeError(name)


# -- helpers ---------------------------------------------------------------------------------------------

def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT), env.get("PYTHONPATH", "")])
    env["COLUMNS"] = "200"
    env.update(extra)
    return env


def _tune_cmd(db: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "autofuse", "tune", "--db", str(db), *args]


def _run(cmd: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(**env), cwd=str(ROOT))
    assert proc.returncode == 0, (f"{' '.join(cmd)} exited {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _tune_rows(db: Path) -> list[dict]:
    con = sqlite3.connect(str(db), timeout=30)
    con.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in con.execute("SELECT * FROM measurements WHERE source = 'tune' ORDER BY id")]
    except sqlite3.OperationalError:  # not created yet
        return []
    finally:
        con.close()


def _wait_for(pred, timeout: float, proc: subprocess.Popen, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        if proc.poll() is not None:
            out, err = proc.communicate(timeout=10)
            raise AssertionError(f"tune exited ({proc.returncode}) before {what}:\n{out[-2000:]}\n{err[-2000:]}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    raise AssertionError(f"timed out waiting for {what}")


def _studies(url: str) -> dict[str, list[optuna.trial.FrozenTrial]]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return {s.study_name: optuna.load_study(study_name=s.study_name, storage=url).get_trials(deepcopy=False)
            for s in optuna.get_all_study_summaries(url)}


def _measured(trials) -> list[optuna.trial.FrozenTrial]:
    return [t for t in trials if t.user_attrs.get("measured") and t.state != optuna.trial.TrialState.FAIL]


def _check_consistent(db: Path, url: str, trials_per_study: int, workers: int = 1) -> dict:
    """Store rows vs Optuna trials: none lost, none duplicated, none left RUNNING; returns the studies."""
    rows = _tune_rows(db)
    keys = [(r["study"], r["trial"], r["mode"]) for r in rows]
    assert len(keys) == len(set(keys))
    per_config = [(r["study"], r["config_id"], r["mode"]) for r in rows]
    assert len(per_config) == len(set(per_config)), "a config was measured twice in one study"
    studies = _studies(url)
    for name, trials in studies.items():
        assert not [t.number for t in trials if t.state == optuna.trial.TrialState.RUNNING], name
        measured = _measured(trials)
        assert trials_per_study <= len(measured) <= trials_per_study + workers - 1, (name, len(measured))
        written = {r["trial"] for r in rows if r["study"] == name}
        assert {t.number for t in measured} == written, name
        for t in measured:
            (row,) = [r for r in rows if r["study"] == name and r["trial"] == t.number]
            assert json.loads(row["config"]) == t.user_attrs["config"]
            if t.state == optuna.trial.TrialState.COMPLETE:
                assert row["ok"] == 1 and row["median_us"] == pytest.approx(t.value)
            else:
                assert row["ok"] == 0 and t.state == optuna.trial.TrialState.PRUNED
    return studies


# -- tests -----------------------------------------------------------------------------------------------

def test_tune_ag_gemm_two_ranks_writes_db_and_skips_failed_and_stale(tmp_path):
    """The whole loop on the real ag_gemm (2 CPU ranks): baselines, enqueued defaults, a wrong variant
    that is stored but never a candidate, rows of another environment kept but unused and reported."""
    from autofuse import registry

    db = tmp_path / "tuning_db" / "ag.db"
    problem = registry.get("ag_gemm").sweep("cpu", 2)[0]
    here = environment.fingerprint()
    other = dict(here, gpu_name="Imaginary GPU", driver="0.1")
    other["id"] = environment.fingerprint_id(other)
    store = Store(db)
    store.add([Measurement(problem, "pull", {"BLOCK_M": 1}, "eager", True, "", 0.0, 0.001, 0.001, 0.001, 0.001, 3)],
              other, study="old", trial=0)
    store.close()

    proc = _run(_tune_cmd(db, "--op", "test_tune:AG_GEMM_WITH_WRONG", "--world", "2", "--trials", "3",
                          "--shapes", problem.key), timeout=600)
    out = proc.stdout
    assert "kept but not used" in out and "Imaginary GPU" in out
    assert "best per problem" in out and "x BSP" in out

    store = Store(db)
    try:
        rows = store.measurements(op="ag_gemm", mode="eager")
        variants = {r["variant"] for r in rows}
        assert {"bsp", "wrong"} <= variants and len(variants) >= 3, variants
        assert [r["source"] for r in rows if r["variant"] == "bsp"] == ["baseline"]
        wrong = [r for r in rows if r["variant"] == "wrong"]
        assert wrong and not any(r["ok"] for r in wrong) and "wrong result" in wrong[0]["error"]
        tune = [r for r in rows if r["source"] == "tune"]
        assert len(tune) == 3 and all(r["study"] and r["trial"] is not None for r in tune)
        good = [r for r in rows if r["ok"]]
        assert good and all(r["rel_error"] <= registry.get("ag_gemm").tolerance(problem) for r in good)
        best = store.best(op="ag_gemm", mode="eager")
        assert {r["problem"] for r in best} == {problem.key}
        assert "wrong" not in {r["variant"] for r in best} and "bsp" in {r["variant"] for r in best}
        assert all(r["fingerprint"] == here["id"] for r in best)
        assert store.stale()["rows"] == 1 and len(store.measurements(fingerprint_id=ALL)) == len(rows) + 1
    finally:
        store.close()
    _check_consistent(db, default_storage(db), 3)


def test_resume_after_ctrl_c_and_kill_9(tmp_path):
    """Ctrl-C stops after the current trial; kill -9 mid-study loses nothing; reruns continue the study."""
    db = tmp_path / "r.db"
    url = default_storage(db)
    cmd = _tune_cmd(db, "--op", "test_tune:FAKE_OP", "--world", "2", "--trials", "5", "--shapes", "N=64")
    env = _env(AUTOFUSE_FAKE_DELAY_MS="30")

    # 1. Ctrl-C (SIGINT to the whole process group, as a terminal sends it): a clean stop, exit 0.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT),
                         start_new_session=True)
    _wait_for(lambda: len(_tune_rows(db)) >= 1, 180, p, "the first trial")
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, f"{out[-2000:]}\n{err[-2000:]}"
    assert "stopped early" in out
    first = _tune_rows(db)
    assert 1 <= len(first) < 5
    (trials,) = _studies(url).values()
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]

    # 2. kill -9 of every process while a trial runs (after one trial of this run was written).
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=str(ROOT),
                         start_new_session=True)
    _wait_for(lambda: len(_tune_rows(db)) >= len(first) + 1, 180, p, "a trial of the second run")
    written = {r["trial"] for r in _tune_rows(db)}

    def running() -> bool:
        (ts,) = _studies(url).values()
        return any(t.state == optuna.trial.TrialState.RUNNING and t.user_attrs.get("measured")
                   and t.number not in written for t in ts)
    _wait_for(running, 180, p, "a running trial")
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    second = _tune_rows(db)
    assert [r["id"] for r in second[:len(first)]] == [r["id"] for r in first]
    before = max(t.number for t in next(iter(_studies(url).values())))

    # 3. Rerun: settles the killed trial, measures the rest, writes every row once.
    _run(cmd, timeout=300, AUTOFUSE_FAKE_DELAY_MS="30")
    final = _tune_rows(db)
    assert {r["id"] for r in second} <= {r["id"] for r in final}, "a measurement was lost"
    studies = _check_consistent(db, url, 5)
    (trials,) = studies.values()
    assert max(t.number for t in _measured(trials)) > before, "the study did not continue"
    # The killed trial (unless it ended in the few ms between the check and the kill) was failed on
    # resume and its config measured again in a new trial.
    for killed in [t for t in trials if t.state == optuna.trial.TrialState.FAIL]:
        assert killed.user_attrs["abandoned"] == "process died during the trial"
        (retry,) = [t for t in trials if t.user_attrs.get("retry_of") == killed.number]
        assert retry in _measured(trials) and retry.user_attrs["config"] == killed.user_attrs["config"]
    # Known-bad configs stay in the store and out of best().
    store = Store(db)
    try:
        assert any(not r["ok"] for r in store.measurements(op="fake_sum"))
        assert all(r["variant"] == "bsp" or r["config"]["bias"] == 0 for r in store.best(op="fake_sum", mode="eager"))
    finally:
        store.close()


@pytest.mark.postgres
def test_two_workers_share_one_study_on_postgres(tmp_path):
    """Two tuning processes (as two hosts: separate measurement DBs) fill one PostgreSQL study together."""
    url = pg.pg_url()
    here = environment.fingerprint()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for s in optuna.get_all_study_summaries(storage_url(url)):  # the test database is ours: start clean
        if s.study_name.startswith("fake_sum|") and s.study_name.endswith(here["id"]):
            optuna.delete_study(study_name=s.study_name, storage=storage_url(url))
    dbs = [tmp_path / "host0.db", tmp_path / "host1.db"]
    procs = [subprocess.Popen(_tune_cmd(db, "--op", "test_tune:FAKE_OP", "--world", "1", "--trials", "6",
                                        "--shapes", "N=96", "--storage", url),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT),
                              env=_env(AUTOFUSE_FAKE_DELAY_MS="40"), start_new_session=True) for db in dbs]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"{out[-2000:]}\n{err[-2000:]}"
    name = f"fake_sum|N=96|float32|w1|eager|{here['id']}"
    trials = _studies(storage_url(url))[name]
    measured = _measured(trials)
    assert 6 <= len(measured) <= 7
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    assert len({t.number for t in trials}) == len(trials)
    pids = {t.user_attrs["worker"]["pid"] for t in measured}
    assert len(pids) == 2, f"only one worker measured trials: {pids}"
    rows = [r for db in dbs for r in _tune_rows(db)]
    assert sorted(r["trial"] for r in rows) == sorted(t.number for t in measured)
    for db in dbs:
        assert {r["study"] for r in _tune_rows(db)} == {name}


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_recovery_of_a_dead_workers_running_trials(tmp_path):
    """On resume, a RUNNING trial of a dead process is told its stored result if its rows were written
    (killed between the write and the tell), else failed and its parameters enqueued again."""
    from autofuse.tune import Settings, StudyDriver, open_storage, study_name

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    fp = environment.fingerprint()
    problem = FAKE_OP.sweep("cpu", 2)[0]
    store = Store(tmp_path / "x.db")
    storage = open_storage(default_storage(tmp_path / "x.db"))
    name = study_name(problem, "eager", fp["id"])
    study = optuna.create_study(study_name=name, storage=storage)
    worker = {"host": __import__("socket").gethostname(), "pid": dead.pid, "start": ""}
    for number, config in enumerate(({"chunk": 8, "bias": 0}, {"chunk": 4, "bias": 0})):
        t = study.ask({"variant": optuna.distributions.CategoricalDistribution(["chunked"])})
        for k, v in (("worker", worker), ("measured", True), ("variant", "chunked"), ("config", config)):
            t.set_user_attr(k, v)
        assert t.number == number
    store.add([Measurement(problem, "chunked", {"chunk": 8, "bias": 0}, "eager", True, "", 0.0, 42.0, 40.0, 44.0,
                           39.0, 3)], fp, study=name, trial=0)
    settings = Settings(db=str(tmp_path / "x.db"), trials=3)
    driver = StudyDriver(storage, store, fp, FAKE_OP, problem, "eager", ["chunked"], settings, "cpu")
    trials = driver.study.get_trials(deepcopy=False)
    assert trials[0].state == optuna.trial.TrialState.COMPLETE and trials[0].value == 42.0
    assert trials[1].state == optuna.trial.TrialState.FAIL and trials[1].user_attrs["abandoned"]
    waiting = [t for t in trials if t.state == optuna.trial.TrialState.WAITING]
    assert [t.user_attrs.get("retry_of") for t in waiting][0] == 1
    assert waiting[0].user_attrs["config"] == {"chunk": 4, "bias": 0}
    # The known-good configs follow (enqueued once: a rerun does not queue them again).
    assert [t.user_attrs["config"] for t in waiting[1:]] == [{"chunk": 16, "bias": 0}, {"chunk": 32, "bias": 1}]
    assert driver.measured() == 1
    again = StudyDriver(storage, store, fp, FAKE_OP, problem, "eager", ["chunked"], settings, "cpu")
    assert len(again.study.get_trials(deepcopy=False)) == len(trials)
    store.close()
