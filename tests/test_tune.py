"""`autofuse tune` end to end on CPU ranks: the loop, signals, resume after kill -9, two workers on PostgreSQL.

The real ag_gemm runs at 2 ranks with one deliberately wrong variant added; the resume, signal and
worker tests use FAKE_OP below (an all-reduce, fast under any config), since they are about the
tuner. Every subprocess has a timeout; a hung run fails the test instead of stalling CI.
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

from autofuse.measure import environment
from autofuse.measure.timing import Measurement
from autofuse.core.op import Op, Problem, Variant
from autofuse.measure.store import ALL, Store
from autofuse.tuning.storage import default_storage, storage_url

import pg

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# -- a fake op: out = sum over ranks of x_r ------------------------------------------------------------


def _delay() -> None:
    _join()
    ms = float(os.environ.get("AUTOFUSE_FAKE_DELAY_MS", "0"))
    if ms:
        time.sleep(ms / 1000)


_JOINED = [False]


def _join() -> None:
    """AUTOFUSE_FAKE_JOIN='DIR:N': this rank process's first call waits (at most 120 s) until N rank processes
    have made theirs, so that tuning workers started together also measure together however slowly each
    one starts (on a loaded machine one worker could otherwise take every trial before the other began)."""
    spec = os.environ.get("AUTOFUSE_FAKE_JOIN")
    if not spec or _JOINED[0]:
        return
    _JOINED[0] = True
    folder, n = spec.rsplit(":", 1)
    Path(folder, str(os.getpid())).touch()
    deadline = time.monotonic() + 120
    while len(os.listdir(folder)) < int(n) and time.monotonic() < deadline:
        time.sleep(0.05)


_SLOW_CALLS = [0]


def _slow_start(problem: Problem) -> None:
    """AUTOFUSE_FAKE_SLOW='N:calls:ms': bsp on the problem of size N sleeps ms in this process's first
    `calls` calls of it (one timing run caught in a hiccup: an outlier the tuner must not keep)."""
    spec = os.environ.get("AUTOFUSE_FAKE_SLOW")
    if not spec:
        return
    n, calls, ms = (float(v) for v in spec.split(":"))
    if problem["N"] == int(n):
        _SLOW_CALLS[0] += 1
        if _SLOW_CALLS[0] <= calls:
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
        _slow_start(problem)
        return out
    return run


def _check(problem: Problem, config: dict) -> str | None:
    return f"chunk {config['chunk']} does not divide N={problem['N']}" if problem["N"] % config["chunk"] else None


def _build_chunked(world, problem: Problem, config: dict):
    """All-reduce in chunks; bias=1 is deliberately wrong (adds 0.01), so its configs fail the check."""
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


class FakeBsp(Variant):
    name, family = "bsp", "bsp"

    def runner(self, world, problem, config):
        return _build_bsp(world, problem, config)


class Chunked(Variant):
    name, family = "chunked", "fused"

    def space(self, trial, problem):
        return {"chunk": trial.suggest_categorical("chunk", [4, 8, 16, 24, 32]),
                "bias": trial.suggest_categorical("bias", [0, 1])}

    def defaults(self, problem):
        return [{"chunk": 16, "bias": 0}, {"chunk": 32, "bias": 1}]

    def check(self, problem, config):
        return _check(problem, config)

    def runner(self, world, problem, config):
        return _build_chunked(world, problem, config)


FAKE_OP = Op(
    name="fake_sum",
    args=("x",),
    variants=[FakeBsp(), Chunked()],
    problem_of=lambda world, x: Problem.make("fake_sum", x.dtype, world.size, N=x.numel()),
    inputs=_inputs, reference=_reference, tolerance=lambda p: 1e-5, features=lambda p: {},
    sweep=lambda kind, world: [Problem.make("fake_sum", "float32", world, N=n) for n in (64, 96)],
)


# -- ag_gemm with a deliberately wrong variant -----------------------------------------------------------

class Wrong(Variant):
    """BSP's result scaled by 1 + scale/100: always wrong, so stored as failed and never a candidate."""

    name, family = "wrong", "fused"

    def __init__(self, bsp: Variant):
        super().__init__()
        self.bsp = bsp

    def space(self, trial, problem):
        return {"scale": trial.suggest_categorical("scale", [5, 10])}

    def defaults(self, problem):
        return [{"scale": 5}]

    def check(self, problem, config):
        return None if set(config) == {"scale"} else f"wrong takes scale only, got {sorted(config)}"

    def runner(self, world, problem, config):
        run = self.bsp.build(world, problem, {})

        def wrong(*inputs, out=None):
            res = run(*inputs, out=out)
            res.mul_(1.0 + config["scale"] / 100)
            return res
        return wrong


def _ag_gemm_with_wrong() -> Op:
    from autofuse.core import registry

    real = registry.get("ag_gemm")
    bsp = real.variants["bsp"]
    return dataclasses.replace(real, variants={"bsp": bsp, "wrong": Wrong(bsp),
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
    """The rows of tuning trials (a confirmation in turns of an outlier's best is a 'tune' row of no trial)."""
    con = sqlite3.connect(str(db), timeout=30)
    con.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in con.execute("SELECT * FROM measurements WHERE source = 'tune' AND study IS NOT NULL "
                                             "ORDER BY id")]
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
            raise AssertionError(f"tune exited ({proc.returncode}) before {what}:\n{(out or '')[-2000:]}\n"
                                 f"{(err or '')[-2000:]}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    raise AssertionError(f"timed out waiting for {what}")


def _start(cmd: list[str], env: dict, capture: bool = True) -> subprocess.Popen:
    """Start `cmd` from the repository root in a session of its own (so os.killpg reaches every process
    it starts, as a terminal's Ctrl-C does); its output captured as text, or discarded."""
    out = subprocess.PIPE if capture else subprocess.DEVNULL
    return subprocess.Popen(cmd, stdout=out, stderr=out, text=True, env=env, cwd=str(ROOT), start_new_session=True)


def _tune_until(cmd: list[str], env: dict, db: Path, rows: int, timeout: float, what: str,
                capture: bool = True) -> subprocess.Popen:
    """Start the tune command `cmd` (`_start`) and wait until `db` holds `rows` tune rows (`what`: those
    rows, for the message if it exits or times out first)."""
    proc = _start(cmd, env, capture)
    _wait_for(lambda: len(_tune_rows(db)) >= rows, timeout, proc, what)
    return proc


def _stop(proc: subprocess.Popen, sig: int, returncode: int, timeout: float, group: bool = False) -> str:
    """Send `sig` to `proc` alone (or to its whole process group), wait for it to exit and check its exit
    status; returns its captured stdout."""
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == returncode, f"{out[-2000:]}\n{err[-2000:]}"
    return out


def _kill_parent_alone(proc: subprocess.Popen, ranks: dict[int, str]) -> list[int]:
    """kill -9 of `proc` alone, then up to 10 s for its `ranks` (_ranks_of) to exit. Returns the ranks
    still alive, after killing them so that a failing test leaves none running."""
    proc.kill()
    proc.wait(timeout=30)
    end = time.monotonic() + 10
    while _alive(ranks) and time.monotonic() < end:
        time.sleep(0.1)
    left = _alive(ranks)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _ranks_of(parent: int) -> dict[int, str]:
    """The rank processes (multiprocessing spawn children) of `parent`: {pid: start time}."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat[1]) == parent and "spawn_main" in cmd:
            out[int(d.name)] = stat[19]
    return out


def _alive(ranks: dict[int, str]) -> list[int]:
    return [pid for pid, start in ranks.items() if _start_time(pid) == start]


def _unfinished(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """The trials still running or waiting (none may be left once a tuning run has stopped)."""
    return [t for t in trials if t.state in (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)]


def _studies(url: str) -> dict[str, list[optuna.trial.FrozenTrial]]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return {s.study_name: optuna.load_study(study_name=s.study_name, storage=url).get_trials(deepcopy=False)
            for s in optuna.get_all_study_summaries(url)}


def _measured(trials) -> list[optuna.trial.FrozenTrial]:
    return [t for t in trials if t.user_attrs.get("measured") and t.state != optuna.trial.TrialState.FAIL]


def _params_match_config(t: optuna.trial.FrozenTrial) -> None:
    """Optuna's recorded parameters are exactly (a subset of) the measured config, never another value."""
    variant, config = t.user_attrs["variant"], t.user_attrs["config"]
    assert t.params.get("variant") == variant, (t.number, t.params)
    for name, value in t.params.items():
        if name == "variant":
            continue
        prefix, _, key = name.partition(".")
        assert prefix == variant and key in config and config[key] == value, (t.number, name, value, config)


def _check_consistent(db: Path, url: str, trials_per_study: int, workers: int = 1) -> dict:
    """Store rows vs Optuna trials: none lost, none duplicated, none left RUNNING or WAITING, recorded
    parameters equal to the measured configs; returns the studies."""
    rows = _tune_rows(db)
    keys = [(r["study"], r["trial"], r["mode"]) for r in rows]
    assert len(keys) == len(set(keys))
    per_config = [(r["study"], r["config_id"], r["mode"]) for r in rows]
    assert len(per_config) == len(set(per_config)), "a config was measured twice in one study"
    studies = _studies(url)
    for name, trials in studies.items():
        states = [t.state for t in trials]
        assert optuna.trial.TrialState.RUNNING not in states, name
        assert optuna.trial.TrialState.WAITING not in states, f"{name}: enqueued trials left waiting"
        measured = _measured(trials)
        assert trials_per_study <= len(measured) <= trials_per_study + workers - 1, (name, len(measured))
        written = {r["trial"] for r in rows if r["study"] == name}
        assert {t.number for t in measured} == written, name
        for t in measured:
            (row,) = [r for r in rows if r["study"] == name and r["trial"] == t.number]
            assert json.loads(row["config"]) == t.user_attrs["config"]
            _params_match_config(t)
            if t.state == optuna.trial.TrialState.COMPLETE:
                assert row["ok"] == 1 and row["median_us"] == pytest.approx(t.value)
            else:
                assert row["ok"] == 0 and t.state == optuna.trial.TrialState.PRUNED
    return studies


# -- tests -----------------------------------------------------------------------------------------------

def test_tune_ag_gemm_two_ranks_writes_db_and_skips_failed_and_stale(tmp_path):
    """The whole loop on the real ag_gemm (2 CPU ranks): baselines, enqueued defaults, a wrong variant
    that is stored but never a candidate, rows of other hardware kept but unused and reported."""
    from autofuse.core import registry

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
    assert out.startswith("autofuse tune: test_tune:AG_GEMM_WITH_WRONG into ")  # said before anything starts
    assert "tuning 1 problems (ag_gemm 1) at world 2 on 2 CPU ranks" in out and "CPU emulation" in out
    assert "kept but not used" in out and "Imaginary GPU" in out
    assert "eager mode, us per call" in out and "no speedup is shown" in out and "x BSP" not in out  # CPU timings
    assert f"Next: `autofuse show --db {db}`" in out and f"`autofuse fit --db {db} --mode eager`" in out
    assert "FutureWarning" not in proc.stderr and "is deprecated" not in proc.stderr

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
        assert {r["op_digest"] for r in rows} == {environment.op_digest("ag_gemm")}
        best = store.best(op="ag_gemm", mode="eager")
        assert {r["problem"] for r in best} == {problem.key}
        assert "wrong" not in {r["variant"] for r in best} and "bsp" in {r["variant"] for r in best}
        assert all(r["fingerprint"] == here["id"] and r["hardware_id"] == here["hardware_id"] for r in best)
        assert store.stale()["rows"] == 1 and len(store.measurements(fingerprint_id=ALL)) == len(rows) + 1
    finally:
        store.close()
    studies = _check_consistent(db, default_storage(db), 3)
    assert all(name.endswith(f"|eager|{here['hardware_id']}|{environment.op_digest('ag_gemm')}") for name in studies)


def test_ctrl_c_stops_after_the_trial_exits_130_and_resume_after_kill_9(tmp_path):
    """Ctrl-C (SIGINT to the whole group) stops after the current trial and exits 130; kill -9 of
    every process mid-study loses nothing; reruns continue the study."""
    db = tmp_path / "r.db"
    url = default_storage(db)
    cmd = _tune_cmd(db, "--op", "test_tune:FAKE_OP", "--world", "2", "--trials", "5", "--shapes", "N=64")

    # 1. Ctrl-C, as a terminal sends it (every process of the group): a clean stop, exit 130. Slower calls
    # here, so that the stop lands within the first trials however late the poll sees the first row, and
    # the second run still has trials to be killed in (a run that stopped after 4 of 5 left it one).
    p = _tune_until(cmd, _env(AUTOFUSE_FAKE_DELAY_MS="150"), db, 1, 180, "the first trial")
    out = _stop(p, signal.SIGINT, 130, timeout=120, group=True)
    assert "stopped early" in out and "interrupted" in out
    first = _tune_rows(db)
    assert 1 <= len(first) < 5
    (trials,) = _studies(url).values()
    assert not _unfinished(trials)

    # 2. kill -9 of every process while a trial runs (after one trial of this run was written). Slow calls
    # again: a run left one or two trials by step 1 must still be inside one when a poll, late on a busy
    # machine, looks (at 30 ms a call the last trial could end between two polls: the run exited 0 first).
    p = _tune_until(cmd, _env(AUTOFUSE_FAKE_DELAY_MS="150"), db, len(first) + 1, 180, "a trial of the second run",
                    capture=False)
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
    # The killed trial was failed on resume and its config measured again in a new trial; or, if its
    # rows were written in the few ms between the check and the kill, it was told their result.
    killed = next(t for t in trials if t.number == before)
    if killed.state == optuna.trial.TrialState.FAIL:
        assert killed.user_attrs["abandoned"] == "process died during the trial"
        (retry,) = [t for t in trials if t.user_attrs.get("retry_of") == killed.number]
        assert retry in _measured(trials) and retry.user_attrs["config"] == killed.user_attrs["config"]
        assert retry.number > before, "the study did not continue"
    else:
        assert killed in _measured(trials) and killed.number in {r["trial"] for r in final}
    # Known-bad configs stay in the store and out of best().
    store = Store(db)
    try:
        assert any(not r["ok"] for r in store.measurements(op="fake_sum"))
        assert all(r["variant"] == "bsp" or r["config"]["bias"] == 0 for r in store.best(op="fake_sum", mode="eager"))
    finally:
        store.close()


def test_signals_to_the_parent_alone_sigterm_exits_143_and_kill_9_leaves_no_rank(tmp_path):
    """What `timeout`, systemd and container runtimes do: SIGTERM to the parent alone finishes the
    trial, keeps every row and exits 143; kill -9 of the parent alone leaves no rank running."""
    db = tmp_path / "s.db"
    url = default_storage(db)
    cmd = _tune_cmd(db, "--op", "test_tune:FAKE_OP", "--world", "2", "--trials", "6", "--shapes", "N=64")
    env = _env(AUTOFUSE_FAKE_DELAY_MS="30")

    p = _tune_until(cmd, env, db, 1, 180, "the first trial")
    ranks = _ranks_of(p.pid)
    assert len(ranks) == 2, ranks
    out = _stop(p, signal.SIGTERM, 143, timeout=120)
    assert "SIGTERM: stopping after the current trial" in out and "interrupted" in out
    assert not _alive(ranks)
    kept = _tune_rows(db)
    assert 1 <= len(kept) < 6
    (trials,) = _studies(url).values()
    assert not _unfinished(trials)

    p = _tune_until(cmd, env, db, len(kept) + 1, 180, "a trial of the second run", capture=False)
    ranks = _ranks_of(p.pid)
    assert len(ranks) == 2, ranks
    left = _kill_parent_alone(p, ranks)
    assert not left, f"ranks {left} outlived their parent"
    assert {r["id"] for r in kept} <= {r["id"] for r in _tune_rows(db)}  # resuming from here: the test above


@pytest.mark.postgres
def test_two_workers_share_one_study_on_postgres(tmp_path):
    """Two tuning processes (as two hosts: separate measurement DBs) fill one PostgreSQL study together;
    `autofuse merge` then gives fit one database with every host's rows."""
    from autofuse.tuning.study import study_name

    url = pg.pg_url()
    here = environment.fingerprint()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for s in optuna.get_all_study_summaries(storage_url(url)):  # the test database is ours: start clean
        if s.study_name.startswith("fake_sum|"):
            optuna.delete_study(study_name=s.study_name, storage=storage_url(url))
    dbs = [tmp_path / "host0.db", tmp_path / "host1.db"]
    gate = tmp_path / "joined"  # every rank of both workers reaches its first call before any measures on
    gate.mkdir()
    procs = [_start(_tune_cmd(db, "--op", "test_tune:FAKE_OP", "--world", "2", "--trials", "6", "--shapes", "N=96",
                              "--storage", url), _env(AUTOFUSE_FAKE_DELAY_MS="40", AUTOFUSE_FAKE_JOIN=f"{gate}:4"))
             for db in dbs]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"{out[-2000:]}\n{err[-2000:]}"
    problem = Problem.make("fake_sum", "float32", 2, N=96)
    name = study_name(problem, "eager", here["hardware_id"], environment.op_digest(FAKE_OP))
    trials = _studies(storage_url(url))[name]
    measured = _measured(trials)
    assert 6 <= len(measured) <= 7
    assert not _unfinished(trials)
    assert len({t.number for t in trials}) == len(trials)
    pids = {t.user_attrs["worker"]["pid"] for t in measured}
    assert len(pids) == 2, f"only one worker measured trials: {pids}"
    for t in measured:
        _params_match_config(t)
    rows = [r for db in dbs for r in _tune_rows(db)]
    assert sorted(r["trial"] for r in rows) == sorted(t.number for t in measured)
    for db in dbs:
        assert {r["study"] for r in _tune_rows(db)} == {name}
    merged = tmp_path / "all.db"
    _run([sys.executable, "-m", "autofuse", "merge", str(merged), *map(str, dbs)], timeout=120)
    _run([sys.executable, "-m", "autofuse", "merge", str(merged), *map(str, dbs)], timeout=120)  # idempotent
    assert sorted(r["trial"] for r in _tune_rows(merged)) == sorted(t.number for t in measured)


# -- coverage under any budget, outliers, compiling ahead -----------------------------------------------------

def test_a_tune_cut_short_covers_every_op_and_fit_has_an_entry_for_each(tmp_path):
    """`--time-limit` far too short for the CPU emulation's sweep: coverage round 0 still measures one
    problem of every op (its baselines and every tunable variant's first default), nothing after it
    starts, and `autofuse fit` gives every op an entry with a tuned variant (issue 43: a cut run left
    later ops with nothing, so dispatch ran BSP on them)."""
    from autofuse.core import registry

    db = tmp_path / "cut.db"
    proc = _run(_tune_cmd(db, "--time-limit", "0.01"), timeout=900)
    assert "time limit reached" in proc.stdout, proc.stdout[-3000:]
    ops = registry.names()
    tunable = {op for op in ops if any(v.tunable for v in registry.get(op).variants.values())}
    assert "covered: " + ", ".join(f"{op} 1/2 problems" for op in ops) in proc.stdout
    assert "trials/s; timing" in proc.stdout
    with Store.open(db, readonly=True) as store:
        for op in ops:
            best = store.best(op, "eager")
            assert len({r["problem"] for r in best}) == 1, (op, best)
            variants = {r["variant"] for r in best}
            assert "bsp" in variants and (variants - {"bsp"} or op not in tunable), (op, variants)
    policy = tmp_path / "policy.json"
    fit = _run([sys.executable, "-m", "autofuse", "fit", "--db", str(db), "--mode", "eager", "--out", str(policy),
                "--json"], timeout=300)
    report = json.loads(fit.stdout)
    assert set(report["ops"]) == set(ops)
    assert all(len(report["ops"][op]["variants"]) > 1 for op in tunable), report["ops"]
    assert set(json.loads(policy.read_text())["ops"]) == set(ops)


def test_an_outlier_baseline_is_re_measured_in_turns_before_it_counts(tmp_path):
    """BSP of the middle problem is timed while the host hiccups (150 ms a call, its first calls only), so
    its x BSP is far off its neighbours': its BSP and best are re-measured in turns, stored confirmed, and
    that confirmed BSP is what the store reads; the neighbours are left alone. (The hiccup is several times
    the interpreter's chunked time, which varies 2x on a busy CI machine: at 30 ms the x BSP was once 1.48,
    inside the noise band, and nothing was re-measured.) `--limit 0`: all three problems, so the middle one
    has a neighbour on each side."""
    db = tmp_path / "o.db"
    proc = _run(_tune_cmd(db, "--op", "test_tune:FAKE_OP", "--world", "2", "--trials", "1", "--limit", "0",
                          "--shapes", "N=64", "--shapes", "N=96", "--shapes", "N=128"), timeout=300,
                AUTOFUSE_FAKE_SLOW="96:12:150")
    assert "re-measured in turns fake_sum|N=96|float32|w2" in proc.stdout, proc.stdout[-3000:]
    with Store.open(db, readonly=True) as store:
        rows = store.measurements(op="fake_sum", mode="eager")
        slow = [r for r in rows if r["problem"].startswith("fake_sum|N=96|") and r["variant"] == "bsp"]
        first = min(slow, key=lambda r: r["id"])
        assert first["median_us"] > 100_000 and not first["extra"].get("confirmed")
        confirmed = {r["variant"]: r for r in rows if r["extra"].get("confirmed")
                     and r["problem"].startswith("fake_sum|N=96|")}
        assert set(confirmed) == {"bsp", "chunked"} and confirmed["bsp"]["median_us"] < 100_000
        (bsp,) = [r for r in store.best("fake_sum", "eager") if r["problem"].startswith("fake_sum|N=96|")
                  and r["variant"] == "bsp"]
        assert bsp["median_us"] == confirmed["bsp"]["median_us"] and bsp["extra"]["confirmed"]
        assert {r["problem"].split("|")[1] for r in rows} == {"N=64", "N=96", "N=128"}
        assert not [r for r in rows if r["extra"].get("confirmed") and not r["problem"].startswith("fake_sum|N=96|")]


def record_compile(op_ref: str, problem_key: str, variant: str, config: dict, device_kind: str) -> None:
    """A compile function for the compile-ahead workers: logs what it was fed; fails for bias=1 configs."""
    with open(os.environ["AUTOFUSE_TEST_COMPILE_LOG"], "a") as f:
        f.write(json.dumps([op_ref, problem_key, variant, config]) + "\n")
    if config.get("bias"):
        raise RuntimeError("this config cannot be compiled ahead")


def test_compile_ahead_workers_take_the_configs_in_order_skip_what_was_reached_and_count_failures(
        tmp_path, monkeypatch):
    from autofuse.tuning.compile_ahead import CompileAhead, default_workers
    from autofuse.tuning.schedule import Scheduler, Slot

    log = tmp_path / "fed.jsonl"
    monkeypatch.setenv("AUTOFUSE_TEST_COMPILE_LOG", str(log))
    slots = [Slot(2, FAKE_OP, Problem.make("fake_sum", "float32", 2, N=n), ["chunked"], ["bsp"], r)
             for r, n in enumerate((64, 96, 40))]
    upcoming = Scheduler(slots, "eager", lambda s: None, lambda *a: True).upcoming()
    # first defaults of every problem (in coverage order) before any second default; N=40 takes neither
    assert [(s.problem["N"], c["chunk"]) for s, _, c in upcoming] == [(64, 16), (96, 16), (64, 32), (96, 32)]
    ahead = CompileAhead(1, device_kind="cpu", compile_fn="test_tune:record_compile",
                         op_refs={"fake_sum": "test_tune:FAKE_OP"}, start=False)
    assert ahead.submit([(s.op, s.problem, v, c) for s, v, c in upcoming]) == 4
    assert ahead.submit([(s.op, s.problem, v, c) for s, v, c in upcoming[:2]]) == 0  # each config once
    ahead.reached("fake_sum", slots[0].key, "chunked", {"chunk": 16, "bias": 0})  # the ranks are on it
    ahead.start()
    assert ahead.wait(120)
    counts = ahead.close()
    fed = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(k, c["chunk"]) for _, k, _, c in fed] == [(slots[1].key, 16), (slots[0].key, 32), (slots[1].key, 32)]
    assert {ref for ref, _, _, _ in fed} == {"test_tune:FAKE_OP"}
    assert (counts["compiled"], counts["compile_failed"], counts["compile_skipped"]) == (1, 2, 1)
    assert "cannot be compiled ahead" in counts["compile_errors"][0]
    assert default_workers(2, cores=2) == 0 and default_workers(2, cores=64) == 8 and default_workers(8, 12) == 3


def test_compile_ahead_compiles_sampled_configs_whatever_the_ranks_reached(tmp_path, monkeypatch):
    """Configs asked ahead in the search (ordered=False) come after the known-good list and are reached in the
    search's own order: reaching one skips nothing, reaching a later known-good one does not skip them."""
    from autofuse.tuning.compile_ahead import CompileAhead

    log = tmp_path / "fed.jsonl"
    monkeypatch.setenv("AUTOFUSE_TEST_COMPILE_LOG", str(log))
    p64, p96 = (Problem.make("fake_sum", "float32", 2, N=n) for n in (64, 96))
    ahead = CompileAhead(1, device_kind="cpu", compile_fn="test_tune:record_compile",
                         op_refs={"fake_sum": "test_tune:FAKE_OP"}, start=False)
    assert ahead.submit([(FAKE_OP, p64, "chunked", {"chunk": 16, "bias": 0})]) == 1
    assert ahead.submit([(FAKE_OP, p96, "chunked", {"chunk": 8, "bias": 0}),
                         (FAKE_OP, p64, "chunked", {"chunk": 4, "bias": 0})], ordered=False) == 2
    ahead.reached("fake_sum", p64.key, "chunked", {"chunk": 4, "bias": 0})  # a sampled one: skips nothing
    ahead.start()
    assert ahead.wait(120)
    counts = ahead.close()
    fed = [(k, c["chunk"]) for _, k, _, c in (json.loads(line) for line in log.read_text().splitlines())]
    assert fed == [(p64.key, 16), (p96.key, 8), (p64.key, 4)]
    assert (counts["compile_submitted"], counts["compile_sampled"], counts["compiled"]) == (3, 2, 3)


def test_a_trial_asked_ahead_is_handed_out_next_and_failed_if_never_measured(tmp_path):
    """`ask_ahead` samples the study's next trial while the current one is measured (none while a known-good
    config is queued, one at a time, none the budget has no room for); `next` hands it out first; `release`
    fails one never handed out, which is not queued again and never counted as measured."""
    driver, store = _driver(tmp_path, SPACE_OP, trials=7)
    for i in range(3):  # the three known-good configs: none asked ahead while another is still queued
        job = driver.next(None)
        assert job is not None and (i == 2 or driver.ask_ahead(None) is None)
        _finish(driver, job)
    assert driver.stage() == "search"
    job = driver.next(None)
    ahead = next(filter(None, (driver.ask_ahead(None) for _ in range(5))), None)
    assert ahead is not None and ahead.trial != job.trial and ahead.config != job.config
    assert driver.ask_ahead(None) is None  # one at a time
    assert driver.measured() == 4  # the trial asked ahead counts once handed out
    _finish(driver, job, 12.0)
    handed = driver.next(None)
    assert (handed.trial, handed.config) == (ahead.trial, ahead.config) and driver.measured() == 5
    _finish(driver, handed, 11.0)
    job = driver.next(None)
    assert driver.ask_ahead(None) is None  # 6 measured with this one: the budget of 7 has no room past the next
    _finish(driver, job, 13.0)
    job = driver.next(None)
    assert job is not None and driver.measured() == 7
    _finish(driver, job, 14.0)
    assert driver.next(None) is None

    driver2, store2 = _driver(tmp_path, SPACE_OP, trials=20, name="y")
    for _ in range(4):
        job = driver2.next(None)
        _finish(driver2, job)
    left = next(filter(None, (driver2.ask_ahead(None) for _ in range(5))), None)
    assert left is not None
    driver2.release()
    trial = driver2.study.get_trials(deepcopy=False)[left.trial]
    assert trial.state == optuna.trial.TrialState.FAIL and trial.user_attrs["abandoned"]
    assert not trial.user_attrs["measured"] and driver2.measured() == 4
    assert left.config not in [c for _, c, _ in driver2.pending()]  # a sampled config is not queued again
    nxt = driver2.next(None)
    assert nxt is not None and nxt.trial != left.trial
    _finish(driver2, nxt)
    store.close()
    store2.close()


def test_a_tune_compiles_its_sampled_trials_ahead_and_leaves_no_trial_running(tmp_path, monkeypatch):
    """In the search each sampled trial's successor is asked ahead and fed to the compile-ahead workers (what
    they compile before the run ends is their race: not asserted); at the end every trial asked ahead was
    measured, settled at its ask or failed as not measured: none is left RUNNING."""
    from autofuse.comm.world import spawn
    from autofuse.tuning.storage import open_storage
    from autofuse.tuning.tune import TuneOptions, tune_rank

    log = tmp_path / "fed.jsonl"
    monkeypatch.setenv("AUTOFUSE_TEST_COMPILE_LOG", str(log))
    db = tmp_path / "s.db"
    settings = TuneOptions(db=str(db), ops=["test_tune:FAKE_OP"], worlds=[2], trials=6, shapes=["N=64"],
                           compile_workers=1, compile_fn="test_tune:record_compile", verbose=False)
    stats = spawn(tune_rank, 2, settings, device_kind="cpu", timeout_s=300)[0]["stats"]
    assert stats["compile_sampled"] >= 1 and stats["compile_submitted"] == 2 + stats["compile_sampled"], stats
    storage = open_storage(default_storage(db))
    (summary,) = optuna.get_all_study_summaries(storage)
    trials = optuna.load_study(study_name=summary.study_name, storage=storage).get_trials(deepcopy=False)
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    asked = [t for t in trials if t.user_attrs.get("asked_ahead")]
    assert len(asked) >= stats["compile_sampled"]
    settled_at_ask = ("known", "invalid", "duplicate_of", "out_of_the_race")  # told at once, never measured
    for t in asked:
        a = t.user_attrs
        assert (a.get("measured") or any(k in a for k in settled_at_ask)
                or (t.state == optuna.trial.TrialState.FAIL and a.get("abandoned"))), t
    assert any(t.user_attrs.get("measured") for t in asked)  # handed out and measured: the search went on with it


def stubborn_compile(op_ref: str, problem_key: str, variant: str, config: dict, device_kind: str) -> None:
    """A compile function that ignores SIGTERM, as a worker started by a supervised rank did (it inherited
    the rank's ignored SIGTERM), and then takes long."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(os.environ["AUTOFUSE_TEST_COMPILE_LOG"], "a") as f:
        f.write("started\n")
    time.sleep(600)


def test_compile_ahead_close_ends_workers_that_ignore_sigterm(tmp_path, monkeypatch):
    """close() must not wait on a worker deaf to SIGTERM (a supervised rank's workers used to be: 10 s of
    join each, 80 s at the end of every GPU tune): every worker is gone when close() returns."""
    from autofuse.tuning.compile_ahead import CompileAhead

    log = tmp_path / "fed.jsonl"
    monkeypatch.setenv("AUTOFUSE_TEST_COMPILE_LOG", str(log))
    ahead = CompileAhead(2, device_kind="cpu", compile_fn="test_tune:stubborn_compile",
                         op_refs={"fake_sum": "test_tune:FAKE_OP"})
    ahead.submit([(FAKE_OP, Problem.make("fake_sum", "float32", 2, N=n), "chunked", {"chunk": 16, "bias": 0})
                  for n in (64, 96)])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not log.exists() or log.read_text().count("started") < 2):
        time.sleep(0.1)
    assert log.read_text().count("started") == 2
    ahead.close()
    assert not any(p.is_alive() for p in ahead.procs)


def _interpreted_last_line(code: str) -> list[str]:
    """Run `code` in a fresh Python under Triton's interpreter (the stand-in world builds in one process);
    its last printed line, split once at the first space."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**_env(), "TRITON_INTERPRET": "1"}, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1].split(" ", 1)


def test_every_tunable_variant_builds_against_the_compile_ahead_stand_in_world():
    """The default compile function builds each config against a one-process stand-in World (no peers, a
    heap of plain tensors): every registered op's tunable variants must build there as every rank, at
    their known-good configs, or compiling ahead would silently do nothing for them. (Launching in
    Triton's compile-only mode needs a GPU: the interpreter compiles nothing.)"""
    code = ("from autofuse.tuning.compile_ahead import stand_in_world\n"
            "from autofuse.core import registry\n"
            "built, failed = 0, []\n"
            "for name in registry.names():\n"
            "    op = registry.get(name)\n"
            "    for p in op.sweep('cpu', 2)[:2]:\n"
            "        for v, var in op.variants.items():\n"
            "            for c in (var.defaults(p)[:2] if var.tunable else []):\n"
            "                for r in range(2):\n"
            "                    if var.check(p, c) is None:\n"
            "                        try:\n"
            "                            heap = stand_in_world(2, r, 'cpu').heap\n"
            "                            var.build(stand_in_world(2, r, 'cpu'), p, c)\n"
            "                            built += 1\n"
            "                            assert heap.offset_of(heap.status) == 0\n"
            "                        except Exception as exc:\n"
            "                            failed.append(f'{name}.{v} rank {r}: {type(exc).__name__}: {exc}')\n"
            "print(built, failed)\n")
    built, failed = _interpreted_last_line(code)
    assert int(built) >= 40 and failed == "[]", (built, failed)


def test_every_op_gets_inputs_its_runners_take_on_the_compile_ahead_stand_in_world():
    """Compiling ahead calls each runner once on inputs made in one process: moe_combine's (the partner
    dispatch's outputs) are made collectively, so on the stand-in they come from the runner's specs, the
    handle from dispatch's layout; every op's must fit its runner's specs, and quickly (op.inputs waited
    out the 120 s collective timeout there, and every combine config failed to compile ahead: round 14's
    MoE tune on 2x H200 compiled 0 of 83 ahead)."""
    code = ("import os\n"
            "os.environ['AUTOFUSE_WAIT_TIMEOUT'] = '5'\n"
            "from autofuse.tuning.compile_ahead import stand_in_world, stand_in_inputs\n"
            "from autofuse.core import registry\n"
            "checked, bad = 0, []\n"
            "for name in registry.names():\n"
            "    op = registry.get(name)\n"
            "    p = op.sweep('cpu', 2)[0]\n"
            "    for v, var in op.variants.items():\n"
            "        if var.tunable and var.check(p, var.defaults(p)[0]) is None:\n"
            "            w = stand_in_world(2, 1, 'cpu')\n"
            "            runner = var.build(w, p, var.defaults(p)[0])\n"
            "            args = stand_in_inputs(op, runner, w, p)\n"
            "            errs = [s.problem_with(a, w.device) for s, a in zip(runner.in_specs, args)]\n"
            "            if len(args) != len(runner.in_specs) or any(errs):\n"
            "                bad.append((name, v, errs))\n"
            "            checked += 1\n"
            "print(checked, bad)\n")
    checked, bad = _interpreted_last_line(code)
    assert int(checked) >= 15 and bad == "[]", (checked, bad)


def test_a_tune_whose_compile_ahead_fails_measures_everything_as_without_it(tmp_path, monkeypatch):
    """Compile-ahead workers that fail (here: every bias=1 config, and a worker killed mid-run would be
    the same) never fail a tune: every config is measured and stored as without them."""
    from autofuse.comm.world import spawn
    from autofuse.tuning.tune import TuneOptions, tune_rank

    monkeypatch.setenv("AUTOFUSE_TEST_COMPILE_LOG", str(tmp_path / "fed.jsonl"))
    db = tmp_path / "c.db"
    settings = TuneOptions(db=str(db), ops=["test_tune:FAKE_OP"], worlds=[2], trials=2, shapes=["N=64", "N=96"],
                        compile_workers=1, compile_fn="test_tune:record_compile", verbose=False)
    result = spawn(tune_rank, 2, settings, device_kind="cpu", timeout_s=300)[0]
    stats = result["stats"]
    assert stats["compile_submitted"] == 4 and stats["trials"] == 4 and stats["baselines"] == 2, stats
    assert stats["coverage"] == {"fake_sum": (2, 2)}, stats
    assert len(_tune_rows(db)) == 4


# -- the study driver without ranks ------------------------------------------------------------------------

class Tiled(Variant):
    """A space that draws `split`, which the first default leaves out, and `tile` from choices the second
    default's value is not among."""

    name, family = "tiled", "fused"

    def space(self, trial, problem):
        return {"tile": trial.suggest_categorical("tile", [8, 16, 32]), "split": trial.suggest_int("split", 1, 4)}

    def defaults(self, problem):
        return [{"tile": 16}, {"tile": 12, "split": 2}, {"tile": 8, "split": 3}]

    def check(self, problem, config):
        return None


SPACE_OP = Op(
    name="fake_space", args=("x",), variants=[FakeBsp(), Tiled()],
    problem_of=FAKE_OP.problem_of, inputs=_inputs, reference=_reference, tolerance=lambda p: 1e-5,
    features=lambda p: {}, sweep=lambda kind, world: [Problem.make("fake_space", "float32", world, N=64)],
)


def _driver(tmp_path, op, trials: int, name: str = "x"):
    from autofuse.tuning.storage import open_storage
    from autofuse.tuning.study import StudyDriver

    fp = environment.fingerprint()
    store = Store(tmp_path / f"{name}.db")
    storage = open_storage(default_storage(tmp_path / f"{name}.db"))
    problem = op.sweep("cpu", 2)[0]
    variants = [v for v, var in op.variants.items() if var.tunable]
    return StudyDriver(storage, store, fp, op, problem, "eager", variants, trials, environment.op_digest(op)), store


def _finish(driver, job, us: float = 10.0) -> None:
    driver.finish(job, [Measurement(driver.problem, job.variant, job.config, "eager", True, "", 0.0, us, us, us,
                                    us, 3)])


RACE_OP = Op(
    name="fake_race", args=("x",), variants=[FakeBsp(), Tiled(), Tiled("slow")],
    problem_of=FAKE_OP.problem_of, inputs=_inputs, reference=_reference, tolerance=lambda p: 1e-5,
    features=lambda p: {}, sweep=lambda kind, world: [Problem.make("fake_race", "float32", world, N=64)],
)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_the_search_samples_no_variant_out_of_the_race(tmp_path):
    """Every variant's defaults are measured; then a variant whose best is over RACE_FACTOR x the problem's
    best is never measured again: its sampled trials are pruned unmeasured (`out_of_the_race`)."""
    from autofuse.tuning.study import RACE_FACTOR

    driver, store = _driver(tmp_path, RACE_OP, trials=16)
    asked: list = []  # the problems each ask of the store names: this one's alone, never the whole op's
    whole = store.best
    store.best = lambda *a, **k: asked.append(k.get("problem")) or whole(*a, **k)
    try:
        jobs = []
        while (job := driver.next(None)) is not None:
            jobs.append(job)
            _finish(driver, job, us=10.0 if job.variant == "tiled" else 10.0 * RACE_FACTOR * 1.5)
        defaults = 2 * len(Tiled().defaults(None))
        assert sorted(j.variant for j in jobs[:defaults]) == ["slow"] * 3 + ["tiled"] * 3
        assert len(jobs) > defaults and {j.variant for j in jobs[defaults:]} == {"tiled"}
        out = [t for t in driver.study.get_trials(deepcopy=False) if "out_of_the_race" in t.user_attrs]
        assert out and all(t.state == optuna.trial.TrialState.PRUNED and t.params["variant"] == "slow" for t in out)
        assert asked and set(asked) == {driver.problem.key}
    finally:
        store.close()
    # Where BSP is over 2x ahead of every tunable variant, no variant is in the race: none is held back.
    lone, lone_store = _driver(tmp_path, SPACE_OP, trials=6, name="lone")
    try:
        lone_store.add([Measurement(lone.problem, "bsp", {}, "eager", True, "", 0.0, 1.0, 1.0, 1.0, 1.0, 3)],
                       environment.fingerprint(), source="baseline", op_digest=lone.digest)
        n = 0
        while (job := lone.next(None)) is not None:
            n += 1
            _finish(lone, job, us=10.0)
        assert n == 6 and not [t for t in lone.study.get_trials(deepcopy=False) if "out_of_the_race" in t.user_attrs]
    finally:
        lone_store.close()


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_enqueued_configs_record_exactly_what_is_measured_and_none_is_left_waiting(tmp_path):
    """A default without `split` records no split (the space draws one, Optuna must not invent it); a
    value outside the declared choices is measured as given and not recorded; defaults beyond the
    budget are never enqueued, so nothing stays WAITING."""
    driver, store = _driver(tmp_path, SPACE_OP, trials=2)
    try:
        seen = []
        while (job := driver.next(None)) is not None:
            seen.append(job.config)
            _finish(driver, job)
        assert seen == [{"tile": 16}, {"tile": 12, "split": 2}]
        trials = driver.study.get_trials(deepcopy=False)
        assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
        assert trials[0].params == {"variant": "tiled", "tiled.tile": 16}
        assert trials[0].user_attrs["unrecorded"] == ["split"]
        assert trials[1].params == {"variant": "tiled", "tiled.split": 2}
        assert trials[1].user_attrs["unrecorded"] == ["tile"] and trials[1].user_attrs["config"] == seen[1]
        for t in trials:
            _params_match_config(t)
        # A larger budget later: the third default first, then sampled configs, all recorded as measured.
        more, more_store = _driver(tmp_path, SPACE_OP, trials=5)
        while (job := more.next(None)) is not None:
            _finish(more, job)
        more_store.close()
        trials = more.study.get_trials(deepcopy=False)
        assert trials[2].user_attrs["config"] == {"tile": 8, "split": 3} and trials[2].params["tiled.split"] == 3
        assert not [t for t in trials if t.state == optuna.trial.TrialState.WAITING]
        for t in _measured(trials):
            _params_match_config(t)
            if "default" not in t.user_attrs:
                assert {f"tiled.{k}" for k in t.user_attrs["config"]} | {"variant"} == set(t.params)
    finally:
        store.close()


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_recovery_of_a_dead_workers_running_trials(tmp_path):
    """On resume, a RUNNING trial of a dead process is told its stored result if its rows were written
    (killed between the write and the tell), else failed, and its config is the first queued again."""
    from autofuse.tuning.storage import open_storage
    from autofuse.tuning.study import StudyDriver, study_name

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    fp = environment.fingerprint()
    digest = environment.op_digest(FAKE_OP)
    problem = FAKE_OP.sweep("cpu", 2)[0]
    store = Store(tmp_path / "x.db")
    storage = open_storage(default_storage(tmp_path / "x.db"))
    name = study_name(problem, "eager", fp["hardware_id"], digest)
    study = optuna.create_study(study_name=name, storage=storage)
    worker = {"host": __import__("socket").gethostname(), "pid": dead.pid, "start": ""}
    for number, config in enumerate(({"chunk": 8, "bias": 0}, {"chunk": 4, "bias": 0})):
        t = study.ask({"variant": optuna.distributions.CategoricalDistribution(["chunked"])})
        for k, v in (("worker", worker), ("measured", True), ("variant", "chunked"), ("config", config)):
            t.set_user_attr(k, v)
        assert t.number == number
    store.add([Measurement(problem, "chunked", {"chunk": 8, "bias": 0}, "eager", True, "", 0.0, 42.0, 40.0, 44.0,
                           39.0, 3)], fp, study=name, trial=0, op_digest=digest)
    driver = StudyDriver(storage, store, fp, FAKE_OP, problem, "eager", ["chunked"], 3, digest)
    trials = driver.study.get_trials(deepcopy=False)
    assert trials[0].state == optuna.trial.TrialState.COMPLETE and trials[0].value == 42.0
    assert trials[1].state == optuna.trial.TrialState.FAIL and trials[1].user_attrs["abandoned"]
    assert not [t for t in trials if t.state == optuna.trial.TrialState.WAITING]  # queued only when asked for
    queue = driver.pending()
    assert queue[0] == ("chunked", {"chunk": 4, "bias": 0}, {"retry_of": 1})
    # The known-good configs follow.
    assert [c for _, c, _ in queue[1:]] == [{"chunk": 16, "bias": 0}, {"chunk": 32, "bias": 1}]
    assert driver.measured() == 1
    job = driver.next(None)
    assert job is not None and job.config == {"chunk": 4, "bias": 0}
    assert driver.study.get_trials(deepcopy=False)[-1].user_attrs["retry_of"] == 1
    driver.abandon()
    again = StudyDriver(storage, store, fp, FAKE_OP, problem, "eager", ["chunked"], 3, digest)
    assert [c for _, c, _ in again.pending()][0] == {"chunk": 16, "bias": 0}, "a config is retried once only"
    store.close()


# -- the command line without ranks ------------------------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["--trials", "-1"], "--trials must be at least 1, not -1"),
    (["--limit", "-1"], "--limit must be 0 (every problem) or more, not -1"),
    (["--world", "0"], "--world sizes must be at least 1, not 0"),
    (["--world", "x"], "--world takes integers"),
    (["--mode", "graph"], "--mode graph needs CUDA graphs"),
    (["--mode", "fast"], "--mode must be one of eager, graph"),
    (["--op", "no_such_op"], "unknown op 'no_such_op'"),
])
def test_bad_arguments_are_one_line_before_anything_starts(tmp_path, args, says):
    from typer.testing import CliRunner

    from autofuse.cli import app

    if "graph" in args and torch.cuda.is_available():
        pytest.skip("graph mode exists here")
    db = tmp_path / "a.db"
    result = CliRunner().invoke(app, ["tune", "--db", str(db), "--quiet", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("autofuse tune: ") and says in lines[0], result.output
    assert "Traceback" not in result.output and not db.exists()


def test_tune_refuses_a_database_it_cannot_use_before_measuring(tmp_path):
    """An unrelated SQLite file, a folder, a path under /proc: one line naming the path, nothing changed."""
    from typer.testing import CliRunner

    from autofuse.cli import app

    other = tmp_path / "app.db"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    con.execute("INSERT INTO users (name) VALUES ('ada')")
    con.commit()
    con.close()
    before = other.read_bytes()
    for db, why in ((other, "another application"), (tmp_path, "is a directory"),
                    (Path("/proc/autofuse/x.db"), "cannot create its folder")):
        result = CliRunner().invoke(app, ["tune", "--db", str(db), "--quiet", "--op", "test_tune:FAKE_OP"])
        assert result.exit_code == 1, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and str(db) in lines[0] and why in lines[0], result.output
    assert other.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]


def test_runtime_never_imports_optuna_or_sklearn():
    """The runtime (ops, kernels, policy walk, dispatch, store, measure) runs without the training side:
    in a fresh interpreter where importing optuna or sklearn fails, every runtime module imports and
    neither is loaded. (A module that fails to import for another reason is another test's business.)"""
    import importlib.util

    modules = ["autofuse", "autofuse.core.op", "autofuse.core.registry", "autofuse.comm.world", "autofuse.comm.heap", "autofuse.comm.status",
               "autofuse.core.features", "autofuse.measure.environment", "autofuse.dispatch.policy", "autofuse.dispatch", "autofuse.dispatch.confirm",
               "autofuse.measure.timing", "autofuse.measure.store", "autofuse.comm.workspace", "autofuse.core.runner", "autofuse.core.gemm",
               "autofuse.comm.collectives", "autofuse.ops.hybrid", "autofuse.core.shapes", "autofuse.core.sizes"]
    modules += [f"autofuse.ops.{p.stem}" for p in (ROOT / "autofuse" / "ops").glob("*.py") if p.stem != "__init__"]
    modules += [f"autofuse.kernels.{p.stem}" for p in (ROOT / "kernels").glob("*.py") if p.stem != "__init__"]
    modules += ["autofuse.nn"] + [f"autofuse.nn.{p.stem}" for p in (ROOT / "autofuse" / "nn").glob("*.py") if p.stem != "__init__"]
    present = [m for m in modules if importlib.util.find_spec(m) is not None]
    code = ("import importlib, importlib.abc, sys\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('optuna', 'sklearn'):\n"
            "            raise ImportError(f'training-only module {name} imported by the runtime')\n"
            "sys.meta_path.insert(0, Block())\n"
            "bad = []\n"
            f"for m in {present!r}:\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except Exception as exc:\n"
            "        if 'training-only' in str(exc): bad.append(f'{m}: {exc}')\n"
            "        else: print(f'(not importable for another reason: {m}: {type(exc).__name__})', file=sys.stderr)\n"
            "from autofuse.measure import environment\n"
            "environment.fingerprint('cpu')\n"
            "print(bad + sorted(m for m in ('optuna', 'sklearn') if m in sys.modules))\n")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


# -- on GPUs (the lead runs these with `pytest -m gpu tests/test_tune.py` on the GPU machine) -------------

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tune_on_two_gpus_records_both_modes_and_resumes(tmp_path):
    """A short ag_gemm study on 2 GPUs: baselines and trials in eager and graph mode, every OK row within
    tolerance, BSP and a fused variant among the candidates, no failed config among them, recorded
    parameters equal to the measured configs, nothing left RUNNING or WAITING; a rerun measures nothing."""
    from autofuse.core import registry

    db = tmp_path / "gpu.db"
    cmd = _tune_cmd(db, "--op", "ag_gemm", "--shapes", "1024", "--world", "2", "--trials", "3")
    first = _run(cmd, timeout=600)
    assert "finding GPUs" in first.stdout.splitlines()[0] and "FutureWarning" not in first.stderr
    with Store.open(db, readonly=True) as store:
        rows = store.measurements(op="ag_gemm")
        assert {r["mode"] for r in rows} == {"eager", "graph"}
        here = environment.fingerprint("cuda")
        assert {r["hardware_id"] for r in rows} == {here["hardware_id"]}
        tol = registry.get("ag_gemm").tolerance
        assert all(r["rel_error"] <= tol(Problem.from_key(r["problem"])) for r in rows if r["ok"])
        failed = {(r["problem"], r["config_id"]) for r in rows if not r["ok"]}
        for mode in ("eager", "graph"):
            best = store.best(op="ag_gemm", mode=mode)
            variants = {r["variant"] for r in best}
            assert "bsp" in variants and variants - {"bsp", "torch_symm"}, (mode, variants)
            assert not [r for r in best if (r["problem"], r["config_id"]) in failed]
        n = len(rows)
    _check_consistent(db, default_storage(db), 3)
    _run(cmd, timeout=600)
    with Store.open(db, readonly=True) as store:
        assert len(store.measurements(op="ag_gemm")) == n, "the rerun measured again"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_sigterm_and_kill_9_on_gpus(tmp_path):
    """On GPUs too: SIGTERM to the parent exits 143 with rows kept; kill -9 of the parent leaves no rank."""
    db = tmp_path / "sig.db"
    cmd = _tune_cmd(db, "--op", "ag_gemm", "--world", "2", "--trials", "40", "--shapes", "1024,2048")
    p = _tune_until(cmd, _env(), db, 2, 300, "two trials")
    _stop(p, signal.SIGTERM, 143, timeout=300)
    kept = len(_tune_rows(db))
    p = _tune_until(cmd, _env(), db, kept + 1, 300, "a trial of the second run", capture=False)
    ranks = _ranks_of(p.pid)
    left = _kill_parent_alone(p, ranks)
    assert ranks and not left, f"ranks {left} outlived their parent"


# -- what a World can run, and what one GPU tunes --------------------------------------------------------

@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_configs_the_heap_refuses_are_pruned_before_launch(tmp_path):
    """On a heap without peer-mapped tensors (torch's symm heap), copy-engine configs of a hybrid are
    never handed out to measure: they are told PRUNED with the heap's reason and cost no trial."""
    from types import SimpleNamespace

    from autofuse.core import registry
    from autofuse.tuning.storage import open_storage
    from autofuse.tuning.study import StudyDriver

    op = registry.get("ag_gemm")
    world = SimpleNamespace(size=2, rank=0, device=torch.device("cuda"), heap=SimpleNamespace(provider="symm"))
    problem = Problem.make("ag_gemm", "bfloat16", 2, M=4096, N=3584, K=8192, gather="rows")
    store = Store(tmp_path / "h.db")
    storage = open_storage(default_storage(tmp_path / "h.db"))
    driver = StudyDriver(storage, store, environment.fingerprint(), op, problem, "eager", ["heap_mm"], 6,
                         environment.op_digest(op), world=world)
    try:
        jobs = []
        while (job := driver.next(None)) is not None:
            jobs.append(job)
            _finish(driver, job)
        assert len(jobs) == 6 and all(j.config.get("ENGINE", "sm") != "ce" for j in jobs), jobs
        refused = [t for t in driver.study.get_trials(deepcopy=False) if "peer-mapped" in t.user_attrs.get("invalid", "")]
        assert refused and all(t.state == optuna.trial.TrialState.PRUNED for t in refused)
    finally:
        store.close()


def test_world_one_measures_baselines_only_and_cpu_scaling_keeps_global_sizes():
    """World size 1 has nothing to communicate: its plan tunes no variant (only baselines, the base of strong
    scaling). `--sweep scaling` on CPU takes the cpu sweep's problems at the same global sizes at every world."""
    from autofuse.core.op import global_sizes
    from autofuse.tuning.tune import TuneOptions, describe_plan, make_plan

    settings = TuneOptions(db="x.db", sweep="scaling", worlds=[1, 2], limit=0)
    plan = make_plan(settings, "cpu", 2)
    tunes = lambda op: any(v.tunable for v in op.variants.values())  # noqa: E731 - ops with a search space
    assert all((vs == []) == (w == 1 or not tunes(op)) and all(p.world == w for p in ps) for w, op, ps, vs in plan.items)
    sizes = {w: {global_sizes(p, op.per_rank) for ww, op, ps, _ in plan.items if ww == w for p in ps} for w in (1, 2)}
    assert sizes[1] and sizes[1] == sizes[2]
    assert max(p.get("M", p.get("B", 0)) for _, _, ps, _ in plan.items for p in ps) <= 64  # CPU-sized
    assert plan.trials(settings) == sum(len(ps) * len(vs) for _, _, ps, vs in plan.items)
    assert "world 1: baselines only" in describe_plan(plan, settings, 2)
    short = make_plan(TuneOptions(db="x.db"), "cpu", 2)
    assert all(len(ps) <= 2 for _, _, ps, _ in short.items)  # the README's CPU tune: 2 problems per op


def test_a_sweep_some_ops_lack_plans_the_ops_that_have_it():
    """`autofuse tune --sweep train` (or fp8) tunes the ops that have that sweep; naming an op that lacks it
    with --op is an error, as is a sweep no op has."""
    from autofuse.tuning.tune import TuneOptions, make_plan

    plan = make_plan(TuneOptions(db="x.db", sweep="train"), "cuda", 2)
    assert {op.name for _, op, _, _ in plan.items} == {"ag_gemm", "gemm_rs", "gemm_ar"}
    assert all(ps for _, op, ps, _ in plan.items if op.name != "gemm_ar")
    with pytest.raises(ValueError, match="unknown sweep"):
        make_plan(TuneOptions(db="x.db", sweep="train", ops=["flash_decode"]), "cuda", 2)
    with pytest.raises(ValueError, match="no op has a sweep"):
        make_plan(TuneOptions(db="x.db", sweep="nope"), "cuda", 2)
