"""The tuning store and the environment fingerprint: idempotent writes, failed configs never candidates,
reads by hardware and op code, read-only opens that never write, old databases, merging, op digests."""
from __future__ import annotations

import json
import math
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest

from autofuse.measure import environment
from autofuse.measure.timing import Measurement
from autofuse.core.op import Problem
from autofuse.measure.store import ALL, SCHEMA_VERSION, Store, StoreError, config_id, describe_stale

ROOT = Path(__file__).resolve().parents[1]
P = Problem.make("fake_sum", "float32", 2, N=64)
Q = Problem.make("fake_sum", "float32", 2, N=96)
G = Problem.make("ag_gemm", "bfloat16", 2, M=64, N=64, K=64, gather="rows")
F = Problem.make("flash_decode", "bfloat16", 2, B=1, D=16, Hkv=2, Hq=4, S=32)


def ok(problem: Problem, variant: str, config: dict, us: float, mode: str = "eager") -> Measurement:
    return Measurement(problem, variant, config, mode, True, "", 1e-7, us, us * 0.9, us * 1.1, us * 0.8, 3,
                       {"build_check_s": 0.5})


def bad(problem: Problem, variant: str, config: dict, mode: str = "eager", why: str = "wrong result") -> Measurement:
    return Measurement(problem, variant, config, mode, False, why, 0.5)


@pytest.fixture()
def store(tmp_path):
    s = Store(tmp_path / "sub" / "t.db")
    yield s
    s.close()


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_schema_wal_foreign_keys_and_idempotent_trials(store, tmp_path):
    fp = environment.fingerprint()
    assert (tmp_path / "sub" / "t.db").exists()
    assert store.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    rows = [ok(P, "push", {"BLOCK": 16}, 10.0), ok(P, "push", {"BLOCK": 16}, 12.0, mode="graph")]
    assert store.add(rows, fp, study="s", trial=0) == 2
    assert store.add(rows, fp, study="s", trial=0) == 0  # a resumed study rewriting its trial adds nothing
    assert store.add(rows, fp, study="s", trial=1) == 2
    # a new Optuna storage numbers trials from 0 again: another config at a taken (study, trial) is kept
    other = [ok(P, "push", {"BLOCK": 32}, 9.0)]
    assert store.add(other, fp, study="s", trial=0) == 1
    kept = store.conn.execute("SELECT study FROM measurements WHERE config LIKE '%32%'").fetchall()
    assert len(kept) == 1 and kept[0][0].startswith("s#"), kept
    assert store.add([ok(P, "bsp", {}, 20.0)], fp, source="baseline") == 1
    assert store.add([ok(P, "bsp", {}, 21.0)], fp, source="baseline") == 0  # measured already: the first row stands
    for source in ("nonsense", "bench"):  # nothing writes bench rows: not a source any more
        with pytest.raises(ValueError):
            store.add([ok(P, "bsp", {}, 20.0)], fp, source=source)
    got = store.measurements(op="fake_sum", mode="eager")
    assert len(got) == 4 and all(r["fingerprint"] == fp["id"] for r in got)
    r0 = got[0]
    assert r0["config"] == {"BLOCK": 16} and r0["ok"] is True and r0["extra"] == {"build_check_s": 0.5}
    assert r0["config_id"] == config_id("fake_sum", "push", {"BLOCK": 16})
    assert (r0["hardware_id"], r0["software_id"]) == (fp["hardware_id"], fp["software_id"])
    assert r0["op_digest"] == ""  # an op the registry does not know: no code to hash
    assert store.conn.execute("SELECT world FROM problems WHERE key = ?", [P.key]).fetchone()[0] == 2
    assert store.conn.execute("SELECT COUNT(*) FROM configs").fetchone()[0] == 3  # push BLOCK 16 and 32, bsp
    env = store.environment(fp["id"])
    assert env["triton"] == fp["triton"] and env["hardware_id"] == fp["hardware_id"]
    # Missing statistics are stored as NULL, not NaN.
    store.add([bad(P, "push", {"BLOCK": 8})], fp, study="s", trial=2)
    row = store.measurements(ok=False)[0]
    assert row["median_us"] is None and row["error"] == "wrong result" and not math.isnan(row["rel_error"])
    assert store.trial_rows("s", 2)[0]["ok"] is False
    # Foreign keys: a measurement must name a known problem, config and environment.
    with pytest.raises(sqlite3.IntegrityError):
        with store.conn:
            store.conn.execute("INSERT INTO measurements (problem, op, variant, config_id, config, fingerprint, "
                               "hardware_id, software_id, op_digest, mode, ok, source) VALUES "
                               "('nope|x|float32|w2', 'nope', 'v', 'c', '{}', 'e', 'h', 's', 'd', 'eager', 1, 'tune')")
    assert store.conn.execute("PRAGMA foreign_key_check").fetchall() == []
    assert store.modes() == ["eager", "graph"] and store.modes(op="other") == []


def test_failed_config_never_a_candidate(store):
    fp = environment.fingerprint()
    store.add([ok(P, "bsp", {}, 30.0), ok(Q, "bsp", {}, 40.0)], fp, source="baseline")
    # The fastest push config is wrong: never returned, although it "timed" fastest in eager mode.
    store.add([ok(P, "push", {"BLOCK": 64}, 1.0)], fp, study="s", trial=0)
    store.add([bad(P, "push", {"BLOCK": 64}, mode="graph")], fp, study="s", trial=1)
    store.add([bad(P, "push", {"BLOCK": 32})], fp, study="s", trial=2)
    store.add([ok(P, "push", {"BLOCK": 16}, 9.0)], fp, study="s", trial=3)
    store.add([ok(P, "push", {"BLOCK": 16}, 8.0)], fp, study="s", trial=4)
    store.add([bad(Q, "push", {"BLOCK": 16}, why="flag timeout")], fp, study="q", trial=0)
    best = {(r["problem"], r["variant"]): r for r in store.best(op="fake_sum", mode="eager")}
    assert set(best) == {(P.key, "bsp"), (Q.key, "bsp"), (P.key, "push")}
    assert best[(P.key, "push")]["config"] == {"BLOCK": 16} and best[(P.key, "push")]["median_us"] == 8.0
    assert set(best[(P.key, "push")]) >= {"problem", "op", "variant", "config", "median_us", "p10_us", "p90_us",
                                          "mode", "fingerprint", "hardware_id", "software_id", "op_digest"}
    assert store.best(op="other", mode="eager") == []
    assert store.best(mode="graph") == []
    # lookup: a failure in any mode is the verdict, so the tuner never retries that config.
    assert store.lookup(P.key, config_id("fake_sum", "push", {"BLOCK": 64}), "eager")["ok"] is False
    assert store.lookup(P.key, config_id("fake_sum", "push", {"BLOCK": 16}), "eager")["median_us"] == 8.0
    assert store.lookup(P.key, config_id("fake_sum", "push", {"BLOCK": 128}), "eager") is None


def test_best_of_one_problem_reads_that_problem_alone(store):
    """The tuner asks for one problem's best at every trial (the race, the progress line): `problem=` gives
    what the op's whole answer holds for that problem, read through the index that leads with problem, so
    an ask costs the same however many other problems the database holds."""
    fp = environment.fingerprint()
    store.add([ok(P, "bsp", {}, 30.0), ok(Q, "bsp", {}, 40.0)], fp, source="baseline")
    store.add([ok(P, "push", {"BLOCK": 16}, 9.0)], fp, study="s", trial=0)
    store.add([ok(Q, "push", {"BLOCK": 16}, 50.0)], fp, study="q", trial=0)
    store.add([ok(Q, "push", {"BLOCK": 32}, 1.0)], fp, study="q", trial=1)
    store.add([bad(Q, "push", {"BLOCK": 32}, mode="graph")], fp, study="q", trial=2)
    whole = store.best(op="fake_sum", mode="eager")
    assert {r["problem"] for r in whole} == {P.key, Q.key}
    for key in (P.key, Q.key):
        assert store.best(op="fake_sum", mode="eager", problem=key) == [r for r in whole if r["problem"] == key]
    assert [r["median_us"] for r in store.best(op="fake_sum", mode="eager", problem=Q.key)] == [40.0, 50.0]
    assert store.best(op="fake_sum", mode="eager", problem="fake_sum|N=128|float32|w2") == []
    statements: list[str] = []
    store.conn.set_trace_callback(statements.append)
    try:
        store.best(op="fake_sum", mode="eager", problem=P.key)
    finally:
        store.conn.set_trace_callback(None)
    (sql,) = [s for s in statements if "WITH good" in s]
    plan = [row[3] for row in store.conn.execute("EXPLAIN QUERY PLAN " + sql)]
    assert "SEARCH m USING INDEX measurements_config (problem=?)" in plan, plan


def test_reads_select_by_hardware_and_op_code_and_report_the_rest(store):
    """Other hardware: kept, not used, reported. Other software: used and reported. A changed op:
    only that op's rows are left out."""
    here = environment.fingerprint()
    other_hw = dict(here, gpu_name="Some Other GPU", gpu_count=8)
    other_hw.update(id=environment.fingerprint_id(other_hw), hardware_id=environment.hardware_id(other_hw))
    other_sw = dict(here, torch="2.11.0+cu130", triton="3.6.0")
    other_sw.update(id=environment.fingerprint_id(other_sw), software_id=environment.software_id(other_sw))
    assert environment.hardware_id(other_sw) == here["hardware_id"] != environment.hardware_id(other_hw)
    store.add([ok(P, "push", {"BLOCK": 16}, 1.0)], other_hw, study="old", trial=0)
    store.add([ok(P, "bsp", {}, 2.0)], other_hw, source="baseline")
    store.add([ok(P, "push", {"BLOCK": 32}, 5.0)], here, study="new", trial=0)
    store.add([ok(P, "push", {"BLOCK": 8}, 6.0)], other_sw, study="older torch", trial=0)
    digest_g, digest_f = here["ops"]["ag_gemm"], here["ops"]["flash_decode"]
    store.add([ok(G, "bsp", {}, 3.0)], here, source="baseline")  # ag_gemm at today's code
    store.add([ok(F, "bsp", {}, 4.0)], here, source="baseline")
    store.add([ok(F, "push", {"HEADS": 1}, 3.5)], here, study="f-old", trial=0, op_digest="0" * 16)  # older code

    assert len(store.measurements(fingerprint_id=ALL, op_digest=ALL)) == 7  # kept
    assert [r["config"] for r in store.measurements(op="fake_sum")] == [{"BLOCK": 32}, {"BLOCK": 8}]
    assert [r["median_us"] for r in store.best(op="fake_sum", mode="eager")] == [5.0]
    assert [r["median_us"] for r in store.best(op="fake_sum", mode="eager", fingerprint_id=other_hw["id"])] == [1.0, 2.0]
    assert [r["median_us"] for r in store.best(op="fake_sum", mode="eager",
                                               hardware_id=other_hw["hardware_id"])] == [1.0, 2.0]
    assert store.lookup(P.key, config_id("fake_sum", "push", {"BLOCK": 16}), "eager") is None
    assert store.lookup(P.key, config_id("fake_sum", "push", {"BLOCK": 8}), "eager")["median_us"] == 6.0
    assert [r["variant"] for r in store.best(op="flash_decode", mode="eager")] == ["bsp"]
    assert [r["variant"] for r in store.best(op="flash_decode", mode="eager", op_digest=ALL)] == ["push", "bsp"]
    assert {r["op_digest"] for r in store.best(op="ag_gemm", mode="eager")} == {digest_g}
    assert {r["op"] for r in store.best(mode="eager")} == {"fake_sum", "ag_gemm", "flash_decode"}
    assert digest_g != digest_f

    stale = store.stale()
    assert stale["rows"] == 3 and stale["current"] == here["id"] and stale["ops"] == {"flash_decode": 1}
    (entry,) = stale["by_fingerprint"]
    assert entry["fingerprint"] == other_hw["id"] and entry["rows"] == 2
    assert set(entry["differences"]) == {"gpu_name", "gpu_count"}
    assert entry["differences"]["gpu_name"] == ("Some Other GPU", here["gpu_name"])
    assert stale["by_field"] == {"gpu_name": 2, "gpu_count": 2}
    (soft,) = stale["software"]
    assert soft["rows"] == 1 and soft["differences"] == {"torch": ("2.11.0+cu130", here["torch"]),
                                                          "triton": ("3.6.0", here["triton"])}
    text = describe_stale(stale)
    assert "3 measurements" in text and "kept but not used" in text and "Some Other GPU" in text
    assert "older code of flash_decode" in text and "other software" in text and "confirms" in text
    envs = {e["id"]: e for e in store.environments()}
    assert envs[here["id"]]["current"] and not envs[other_hw["id"]]["current"]
    assert envs[other_sw["id"]]["same_hardware"] and not envs[other_sw["id"]]["current"]
    assert envs[other_hw["id"]]["rows"] == 2 and envs[other_hw["id"]]["gpu_name"] == "Some Other GPU"
    assert envs[here["id"]]["modes"] == ["eager"]


def test_two_connections_share_the_database(tmp_path):
    """Two processes' stores on one file (WAL): both see every row; the unique index holds across them."""
    fp = environment.fingerprint()
    a, b = Store(tmp_path / "t.db"), Store(tmp_path / "t.db")
    try:
        assert a.add([ok(P, "push", {"BLOCK": 16}, 1.0)], fp, study="s", trial=0) == 1
        assert b.add([ok(P, "push", {"BLOCK": 16}, 1.0)], fp, study="s", trial=0) == 0
        assert b.add([ok(P, "push", {"BLOCK": 32}, 2.0)], fp, study="s", trial=1) == 1
        assert len(a.measurements()) == 2
    finally:
        a.close()
        b.close()


# -- read-only opens ---------------------------------------------------------------------------------

def _unrelated(path: Path, wal: bool = False) -> None:
    con = sqlite3.connect(path)
    if wal:
        con.execute("PRAGMA journal_mode = WAL")
    con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    con.execute("INSERT INTO users (name) VALUES ('ada'), ('grace')")
    con.commit()
    con.close()


@pytest.mark.parametrize("wal", [False, True])
def test_readonly_open_never_writes_an_unrelated_database(tmp_path, wal):
    """Another application's database (rollback journal or WAL) stays byte-identical, with no file
    created beside it, whether opened read-only (refused: not autofuse's) or for writing (refused)."""
    folder = tmp_path / "app"
    folder.mkdir()
    db = folder / "app.db"
    _unrelated(db, wal)
    before = _files(folder)
    with pytest.raises(StoreError, match=r"app\.db: is not an autofuse database \(its tables: users\)"):
        Store.open(db, readonly=True)
    with pytest.raises(StoreError, match=r"app\.db: is an SQLite database of another application"):
        Store.open(db)
    assert _files(folder) == before


def test_readonly_open_errors_are_one_line_naming_the_path(tmp_path):
    good = tmp_path / "good.db"
    s = Store(good)
    s.add([ok(P, "bsp", {}, 1.0)], environment.fingerprint(), source="baseline")
    s.close()
    text = tmp_path / "notes.txt"
    text.write_text("hello\n" * 100)
    empty = tmp_path / "empty.db"
    empty.touch()
    truncated = tmp_path / "truncated.db"
    truncated.write_bytes(good.read_bytes()[:1500])
    corrupt = tmp_path / "corrupt.db"
    data = bytearray(good.read_bytes())
    data[4096:8192] = b"\xff" * 4096  # a page of garbage
    corrupt.write_bytes(bytes(data))
    cases = {tmp_path / "missing.db": "no such file", tmp_path: "is a directory", empty: "empty file",
             text: "not an SQLite database", truncated: "", corrupt: ""}
    for path, why in cases.items():
        before = path.read_bytes() if path.is_file() else None
        with pytest.raises(StoreError) as info:
            Store.open(path, readonly=True).measurements(hardware_id=ALL)
        message = str(info.value)
        assert "\n" not in message and message.startswith(str(path)) and why in message, message
        assert (path.read_bytes() if path.is_file() else None) == before
    assert not (tmp_path / "missing.db").exists() and empty.stat().st_size == 0


def test_readonly_store_reads_a_wal_database_without_litter_and_refuses_writes(tmp_path):
    db = tmp_path / "t.db"
    fp = environment.fingerprint()
    s = Store(db)
    s.add([ok(P, "bsp", {}, 1.0)], fp, source="baseline")
    s.close()
    before = _files(tmp_path)
    assert sorted(before) == ["t.db"] and before["t.db"][18] == 2  # WAL mode, checkpointed on close
    r = Store.open(db, readonly=True)
    try:
        assert [x["median_us"] for x in r.best(mode="eager")] == [1.0] and r.modes() == ["eager"]
        with pytest.raises(StoreError, match="read-only"):
            r.add([ok(P, "bsp", {}, 1.0)], fp, source="baseline")
    finally:
        r.close()
    assert _files(tmp_path) == before


# -- old databases -----------------------------------------------------------------------------------

_V1_SCHEMA = """
CREATE TABLE environments (id TEXT PRIMARY KEY, device_kind TEXT, gpu_name TEXT, gpu_count INTEGER, topology TEXT,
  driver TEXT, cuda TEXT, torch TEXT, triton TEXT, nccl TEXT, kernel_hash TEXT, python TEXT, created_at TEXT);
CREATE TABLE problems (key TEXT PRIMARY KEY, op TEXT, dtype TEXT, world INTEGER, dims TEXT);
CREATE TABLE configs (id TEXT PRIMARY KEY, op TEXT, variant TEXT, config TEXT);
CREATE TABLE measurements (id INTEGER PRIMARY KEY, problem TEXT NOT NULL, op TEXT NOT NULL, variant TEXT NOT NULL,
  config_id TEXT, config TEXT, fingerprint TEXT, mode TEXT NOT NULL, ok INTEGER NOT NULL, error TEXT,
  rel_error REAL, median_us REAL, p10_us REAL, p90_us REAL, min_us REAL, reps INTEGER, study TEXT, trial INTEGER,
  source TEXT, extra TEXT, created_at TEXT);
CREATE UNIQUE INDEX measurements_trial ON measurements (study, trial, mode);
CREATE INDEX measurements_select ON measurements (fingerprint, op, mode, ok);
CREATE INDEX measurements_config ON measurements (problem, config_id, fingerprint, mode);
"""


def _v1(path: Path, kernel_hash: str) -> dict:
    """A schema-1 database (as autofuse wrote before layered fingerprints) with two ag_gemm rows."""
    env = dict(environment.fingerprint(), kernel_hash=kernel_hash, id="0123456789abcdef")
    con = sqlite3.connect(path)
    con.executescript(_V1_SCHEMA)
    con.execute("PRAGMA journal_mode = WAL")
    con.execute("INSERT INTO environments VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                [env[k] if k in env else None for k in ("id", "device_kind", "gpu_name", "gpu_count", "topology",
                                                         "driver", "cuda", "torch", "triton", "nccl", "kernel_hash",
                                                         "python")] + ["2026-01-01T00:00:00+00:00"])
    con.execute("INSERT INTO problems VALUES (?, 'ag_gemm', 'bfloat16', 2, '{}')", [G.key])
    for i, (variant, cfg, us, source) in enumerate((("bsp", {}, 30.0, "baseline"), ("push", {"B": 16}, 20.0, "tune"))):
        cid = config_id("ag_gemm", variant, cfg)
        con.execute("INSERT INTO configs VALUES (?, 'ag_gemm', ?, ?)", [cid, variant, json.dumps(cfg)])
        con.execute("INSERT INTO measurements (problem, op, variant, config_id, config, fingerprint, mode, ok, "
                    "median_us, study, trial, source, extra) VALUES (?, 'ag_gemm', ?, ?, ?, ?, 'eager', 1, ?, ?, ?, ?, '{}')",
                    [G.key, variant, cid, json.dumps(cfg), env["id"], us, "s" if i else None, i if i else None, source])
    con.commit()
    con.close()
    return env


def test_schema_1_databases_read_through_memory_and_migrated_for_writing(tmp_path):
    """Readable without writing (migrated in memory); rows keep today's op digest when the code is the
    one they were measured with, else none matches; a writable open migrates in place."""
    same, older = tmp_path / "same.db", tmp_path / "older.db"
    _v1(same, environment.legacy_kernel_hash())
    _v1(older, "feedfacefeedface")
    for path, usable in ((same, True), (older, False)):
        before = _files(tmp_path)
        s = Store.open(path, readonly=True)
        try:
            assert s.migrated
            rows = s.measurements(hardware_id=ALL, op_digest=ALL)
            assert [r["variant"] for r in rows] == ["bsp", "push"]
            assert rows[0]["hardware_id"] == environment.fingerprint()["hardware_id"]
            assert [r["variant"] for r in s.best(op="ag_gemm", mode="eager")] == (["push", "bsp"] if usable else [])
            if not usable:
                assert {r["op_digest"] for r in rows} == {"legacy-feedfacefeedface"}
                assert s.stale()["ops"] == {"ag_gemm": 2}
        finally:
            s.close()
        assert _files(tmp_path) == before
    w = Store(same)
    try:
        assert w.migrated and w.conn.execute("PRAGMA foreign_key_check").fetchall() == []
        assert len(w.best(op="ag_gemm", mode="eager")) == 2
    finally:
        w.close()
    r = Store.open(same, readonly=True)
    assert not r.migrated and r.conn.execute("SELECT value FROM meta WHERE key = 'migrated_from'").fetchone()[0] == "1"
    r.close()


def shipped_databases() -> list[Path]:
    """The databases shipped in tuning_db/: those git tracks there (in a checkout, where a user may keep
    files of their own beside them), else every *.db there (an unpacked release)."""
    found = sorted((ROOT / "tuning_db").glob("*.db"))
    if shutil.which("git") and (ROOT / ".git").exists():
        res = subprocess.run(["git", "ls-files", "--", "tuning_db"], cwd=ROOT, capture_output=True, text=True,
                             timeout=30)
        if res.returncode == 0:
            tracked = {ROOT / line for line in res.stdout.split()}
            found = [p for p in found if p in tracked]
    return found


def test_shipped_databases_open_read_only(tmp_path):
    """Every database shipped in tuning_db/ is readable (schema 1 via the in-memory migration) and untouched."""
    shipped = shipped_databases()
    if not shipped:
        pytest.skip("no shipped database")
    for path in shipped:
        copy = tmp_path / path.name
        shutil.copy(path, copy)
        before = _files(tmp_path)
        s = Store.open(copy, readonly=True)
        try:
            assert s.measurements(hardware_id=ALL, op_digest=ALL) and {"eager", "graph"} & set(s.modes())
            assert s.environments()
        finally:
            s.close()
        assert _files(tmp_path) == before


# -- merging -----------------------------------------------------------------------------------------

def test_merge_keeps_every_real_measurement_once(tmp_path):
    from typer.testing import CliRunner

    from autofuse.cli import app

    fp = environment.fingerprint()
    a, b = tmp_path / "host0.db", tmp_path / "host1.db"
    with Store(a) as s:
        s.add([ok(P, "bsp", {}, 20.0)], fp, source="baseline")
        s.add([ok(P, "push", {"BLOCK": 16}, 10.0)], fp, study="shared", trial=0)
        s.add([ok(P, "push", {"BLOCK": 32}, 11.0)], fp, study="shared", trial=1)
    shutil.copy(a, b)  # host 1 started from a copy of host 0's database...
    own = tmp_path / "own.db"  # host 1's own measurement of the baseline (a store keeps one per config: its run's)
    with Store(own) as s:
        s.add([ok(P, "bsp", {}, 19.0)], fp, source="baseline")
    with Store(b) as s, Store.open(own, readonly=True) as theirs:  # ...then measured more: a trial, its baseline
        s.add([ok(P, "push", {"BLOCK": 8}, 9.0)], fp, study="shared", trial=2)
        s.merge_from(theirs)
    out = tmp_path / "all.db"
    before = {p: p.read_bytes() for p in (a, b)}
    result = CliRunner().invoke(app, ["merge", str(out), str(a), str(b)])
    assert result.exit_code == 0, result.output
    assert "host0.db: 3 of 3 measurements added, 0 already there" in result.output
    assert "host1.db: 2 of 5 measurements added, 3 already there (identical)" in result.output
    assert {p: p.read_bytes() for p in (a, b)} == before
    again = CliRunner().invoke(app, ["merge", str(out), str(b), str(out), "--json"])
    report = json.loads(again.output)
    assert report["inputs"][0]["added"] == 0 and report["inputs"][1]["skipped"] == "it is the output"
    with Store.open(out, readonly=True) as s:
        rows = s.measurements()
        assert sorted(r["median_us"] for r in rows) == [9.0, 10.0, 11.0, 19.0, 20.0]  # both baselines are real
        assert [r["median_us"] for r in s.best(mode="eager") if r["variant"] == "bsp"] == [19.0]
        assert s.conn.execute("PRAGMA foreign_key_check").fetchall() == []
    bad_input = CliRunner().invoke(app, ["merge", str(out), str(tmp_path / "nope.db")])
    assert bad_input.exit_code == 1 and "nope.db: no such file" in bad_input.output
    fresh = tmp_path / "fresh.db"
    bad_input = CliRunner().invoke(app, ["merge", str(fresh), str(a), str(tmp_path / "nope.db")])
    assert bad_input.exit_code == 1 and "nope.db: no such file" in bad_input.output
    assert not list(tmp_path.glob("fresh.db*")), "a failed merge left its output behind"


def test_merge_keeps_two_workers_trials_of_one_config_in_the_same_second(tmp_path, monkeypatch):
    """Two workers of one shared study may both measure one config (a race between their asks) within the
    same second at the same latency (the fake op's fixed delay): two trials, two rows, both kept. (Seen
    as a flaky test_two_workers_share_one_study_on_postgres: the merge took the second for a copy.)"""
    import autofuse.measure.store as store_module

    monkeypatch.setattr(store_module, "_now", lambda: "2026-11-27T21:00:00+00:00")
    fp = environment.fingerprint()
    a, b, out = tmp_path / "w0.db", tmp_path / "w1.db", tmp_path / "all.db"
    with Store(a) as s:
        s.add([ok(P, "push", {"BLOCK": 16}, 10.0)], fp, study="shared", trial=0)
    with Store(b) as s:
        s.add([ok(P, "push", {"BLOCK": 16}, 10.0)], fp, study="shared", trial=1)
    with Store(out) as s:
        for src in (a, b):
            with Store.open(src, readonly=True) as theirs:
                s.merge_from(theirs)
        with Store.open(a, readonly=True) as theirs:
            assert s.merge_from(theirs)["identical"] == 1  # a copy of a row already here is still one
        assert sorted(r["trial"] for r in s.measurements()) == [0, 1]


def test_merge_keeps_independent_runs_whose_trial_numbers_collide(tmp_path):
    """Two runs on one machine, each with its own Optuna storage, name their studies alike and number
    their trials from 0: merging keeps every measurement (the second run's under a tagged study name),
    and merging again adds nothing."""
    from typer.testing import CliRunner

    from autofuse.cli import app

    fp = environment.fingerprint()
    a, b = tmp_path / "run0.db", tmp_path / "run1.db"
    with Store(a) as s:
        s.add([ok(P, "push", {"BLOCK": 16}, 10.0)], fp, study="same", trial=0)
        s.add([ok(P, "push", {"BLOCK": 32}, 11.0)], fp, study="same", trial=1)
    with Store(b) as s:
        s.add([ok(P, "push", {"BLOCK": 16}, 12.0), ok(P, "push", {"BLOCK": 16}, 13.0, mode="graph")], fp,
              study="same", trial=0)
        s.add([ok(P, "push", {"BLOCK": 8}, 9.0)], fp, study="same", trial=1)
    out = tmp_path / "all.db"
    first = CliRunner().invoke(app, ["merge", str(out), str(a), str(b), "--json"])
    assert first.exit_code == 0, first.output
    counts = json.loads(first.output)["inputs"]
    assert [(c["added"], c["renamed"], c["identical"]) for c in counts] == [(2, 0, 0), (3, 3, 0)]
    again = CliRunner().invoke(app, ["merge", str(out), str(b), str(a), "--json"])
    assert [c["added"] for c in json.loads(again.output)["inputs"]] == [0, 0]
    with Store.open(out, readonly=True) as s:
        rows = s.measurements(hardware_id=ALL, op_digest=ALL)
        assert sorted(r["median_us"] for r in rows) == [9.0, 10.0, 11.0, 12.0, 13.0]
        studies = {(r["median_us"], r["study"], r["trial"]) for r in rows}
        renamed = {st for us, st, _ in studies if us in (12.0, 13.0)}
        assert len(renamed) == 1 and next(iter(renamed)).startswith("same#")  # one trial, one name in both modes
        assert len(s.trial_rows(next(iter(renamed)), 0)) == 2


# -- op digests --------------------------------------------------------------------------------------

def _sources(tmp_path: Path) -> dict[str, Path]:
    """A copy of the package's sources (host modules, op modules, kernels) to edit."""
    roots = {"autofuse": tmp_path / "autofuse", "autofuse.kernels": tmp_path / "kernels",
             "autofuse.ops": tmp_path / "autofuse" / "ops"}
    shutil.copytree(ROOT / "autofuse", roots["autofuse"], ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "kernels", roots["autofuse.kernels"], ignore=shutil.ignore_patterns("__pycache__"))
    return roots


def _digests(roots: dict[str, Path]) -> dict[str, str]:
    return {op: environment.op_digest(op, roots) for op in ("ag_gemm", "gemm_rs", "gemm_ar", "flash_decode")}


def test_op_digest_counts_code_not_docstrings_or_comments(tmp_path):
    roots = _sources(tmp_path)
    base = _digests(roots)
    assert base == {op: environment.op_digest(op) for op in base}  # the copy hashes like the package
    assert len(set(base.values())) == 4
    files = environment.digest_modules("autofuse.ops.gemm_ar", roots)
    assert {"autofuse.ops.gemm_ar", "autofuse.ops.row_parallel", "autofuse.kernels.gemm_ar",
            "autofuse.kernels.shmem"} <= set(files)

    def edit(path: Path, old: str, new: str) -> None:
        text = path.read_text()
        assert old in text, (path, old)
        path.write_text(text.replace(old, new, 1))

    op_file = roots["autofuse.ops"] / "ag_gemm.py"
    first = op_file.read_text().split('"""')[1]
    edit(op_file, first, first + " Edited docstring.")
    edit(op_file, "\nimport math\n", "\n# a new comment\nimport math  # and another\n\n")
    assert _digests(roots) == base, "docstrings, comments and blank lines count"

    edit(roots["autofuse.kernels"] / "flash_decode.py", "\nimport triton\n", "\nimport triton\nUNUSED = 1\n")
    after = _digests(roots)
    assert {op for op in base if after[op] != base[op]} == {"flash_decode"}

    edit(roots["autofuse.ops"] / "row_parallel.py", "\nimport math\n", "\nimport math\nUNUSED = 2\n")
    later = _digests(roots)
    assert {op for op in base if later[op] != after[op]} == {"gemm_rs", "gemm_ar"}  # both build on row_parallel

    edit(roots["autofuse.ops"] / "hybrid.py", "\nimport torch\n", "\nimport torch\nUNUSED = 5\n")
    shared = _digests(roots)  # the hybrids' shared base: the three GEMM ops import it, flash_decode does not
    assert {op for op in base if shared[op] != later[op]} == {"ag_gemm", "gemm_rs", "gemm_ar"}
    later = shared

    edit(roots["autofuse.kernels"] / "shmem.py", "\nimport triton\n", "\nimport triton\nUNUSED = 3\n")
    last = _digests(roots)
    assert all(last[op] != later[op] for op in base), "the device API is part of every op"

    # An op may declare modules it depends on without importing them (DIGEST_EXTRA).
    edit(roots["autofuse.ops"] / "flash_decode.py", "\nimport math\n",
         "\nimport math\nDIGEST_EXTRA = ('autofuse.kernels.selftest',)\n")
    declared = _digests(roots)
    edit(roots["autofuse.kernels"] / "selftest.py", "\nimport triton\n", "\nimport triton\nUNUSED = 4\n")
    assert _digests(roots)["flash_decode"] != declared["flash_decode"]


def test_code_cache_gives_what_parsing_gives_and_outlives_damage(tmp_path, monkeypatch):
    """op digests from `<user cache>/autofuse/code-*.json` (what a new process reads instead of parsing
    every op's sources) equal the parsed ones; a damaged cache file is parsed around and replaced; a
    cache folder that cannot be made costs nothing but the parsing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(environment, "_CODE", environment._CodeCache())
    parsed = environment.op_digests()
    (cache,) = (tmp_path / "cache" / "autofuse").glob("code-*.json")

    def no_parsing(raw, path):
        raise AssertionError(f"{path} parsed although the cache holds it")

    monkeypatch.setattr(environment, "_CODE", environment._CodeCache())  # a new process: nothing in memory
    with monkeypatch.context() as m:
        m.setattr(environment, "_read_code", no_parsing)
        assert environment.op_digests() == parsed

    cache.write_text('{"damaged": ')
    monkeypatch.setattr(environment, "_CODE", environment._CodeCache())
    assert environment.op_digests() == parsed
    assert len(json.loads(cache.read_text())) >= len(parsed)  # rewritten whole

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file" / "cache"))  # under a file: mkdir fails
    monkeypatch.setattr(environment, "_CODE", environment._CodeCache())
    assert environment.op_digests() == parsed


def test_fingerprint_layers_and_ids():
    fp = environment.fingerprint()
    assert set(environment.layer(fp, "hardware")) == set(environment.HARDWARE_FIELDS)
    assert set(environment.layer(fp, "software")) == set(environment.SOFTWARE_FIELDS)
    assert environment.layer(fp, "ops") == fp["ops"] and set(fp["ops"]) >= {"ag_gemm", "flash_decode"}
    assert fp["id"] == environment.fingerprint_id(fp) and fp["hardware_id"] == environment.hardware_id(fp)
    newer = dict(fp, torch="9.9", ops=dict(fp["ops"], ag_gemm="x"))
    assert environment.hardware_id(newer) == fp["hardware_id"] and environment.software_id(newer) != fp["software_id"]
    assert environment.differences(fp, newer, "software") == {"torch": (fp["torch"], "9.9")}
    assert environment.differences(fp, newer, "hardware") == {}
    assert environment.differences(fp, newer, "ops") == {"ag_gemm": (fp["ops"]["ag_gemm"], "x")}
    assert environment.differences(fp, newer) == {"torch": (fp["torch"], "9.9")}
    with pytest.raises(ValueError):
        environment.differences(fp, newer, "firmware")


# -- files a user names: damaged, foreign, not regular, modified rows (issue 31) ---------------------------
def _good(path: Path) -> Path:
    s = Store(path)
    s.add([ok(P, "bsp", {}, 1.0), ok(Q, "bsp", {}, 2.0)], environment.fingerprint(), source="baseline")
    s.close()
    return path


def _damaged(tmp_path: Path) -> Path:
    """A store whose last two pages are garbage while the others (page 1: header and schema; meta) are intact."""
    path = _good(tmp_path / "damaged.db")
    con = sqlite3.connect(path)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the WAL into the file, so the damage hits real pages
    con.close()
    data = bytearray(path.read_bytes())
    assert len(data) >= 4 * 4096
    data[-2 * 4096:] = b"\xa5" * (2 * 4096)
    path.write_bytes(bytes(data))
    return path


def _foreign_lookalike(path: Path) -> Path:
    """Another application's database that has tables named meta and measurements (schema_version 2)."""
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
    con.execute("INSERT INTO meta VALUES ('schema_version', '2')")
    con.execute("CREATE TABLE measurements (id INTEGER PRIMARY KEY, sensor TEXT, reading REAL)")
    con.execute("INSERT INTO measurements (sensor, reading) VALUES ('t1', 21.5)")
    con.commit()
    con.close()
    return path


@pytest.mark.parametrize("kind", ["damaged", "foreign"])
def test_damaged_or_foreign_databases_are_refused_untouched_by_writable_opens(tmp_path, kind):
    """A writable open (tune --db, merge OUT) checks an existing file read-only first: a damaged or foreign
    database raises one line naming it, and the file and its folder stay byte-identical."""
    folder = tmp_path / "f"
    folder.mkdir()
    path = _damaged(folder) if kind == "damaged" else _foreign_lookalike(folder / "lookalike.db")
    before = _files(folder)
    for readonly in (False, True):
        with pytest.raises(StoreError) as info:
            Store.open(path, readonly=readonly)
        message = str(info.value)
        assert "\n" not in message and message.startswith(str(path)), message
        assert ("corrupt" in message or "malformed" in message) if kind == "damaged" else "tables" in message
    assert _files(folder) == before


def test_only_regular_files_are_opened(tmp_path):
    """A FIFO or a link to a device (e.g. /dev/null) is refused by both opens, before SQLite touches it (it
    would block on the FIFO, or write its journal beside the device: /dev/null-journal)."""
    import os

    fifo = tmp_path / "fifo.db"
    os.mkfifo(fifo)
    null = tmp_path / "null.db"
    null.symlink_to(os.devnull)
    journal_before = Path(os.devnull + "-journal").exists()
    for path in (fifo, null):
        for readonly in (False, True):
            with pytest.raises(StoreError, match="not a regular file"):
                Store.open(path, readonly=readonly)
    assert Path(os.devnull + "-journal").exists() == journal_before
    assert null.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["fifo.db", "null.db"]


@pytest.mark.parametrize("column, value, needle", [
    ("problem", "not a problem", "is not a problem key"),
    ("config", "{broken", "config is not a JSON object"),
    ("median_us", "fast", "median_us is not a number"),
    ("median_us", -5.0, "median_us is -5.0, not a finite number >= 0"),
    ("p90_us", float("inf"), "p90_us is inf, not a finite number >= 0"),
    ("problem", Problem.make("gemm_ar", "float32", 2, M=4, N=16, K=32).key, "a row of fake_sum holds a problem key of "
                                                                          "gemm_ar"),
])
def test_rows_modified_outside_autofuse_are_one_line_errors(tmp_path, column, value, needle):
    path = _good(tmp_path / "rows.db")
    with sqlite3.connect(path) as con:
        con.execute(f"UPDATE measurements SET {column} = ? WHERE id = 1", [value])
    store = Store.open(path, readonly=True)
    try:
        for read, names in ((lambda: store.measurements(hardware_id=ALL), "measurement 1"),
                            (lambda: store.best(mode="eager", hardware_id=ALL), "a measurement")):
            with pytest.raises(StoreError) as info:
                read()
            message = str(info.value)
            assert "\n" not in message and message.startswith(str(path)) and needle in message, message
            assert names in message, message
    finally:
        store.close()


def test_two_tunes_on_one_database_store_one_baseline_row(tmp_path):
    """Two writers (two tunes) that each found a baseline unmeasured, then measured it: the second row is not
    added; other modes, configs and problems still are."""
    path = tmp_path / "shared.db"
    fp = environment.fingerprint()
    first, second = Store(path), Store(path)
    try:
        assert first.lookup(P.key, config_id(P.op, "bsp", {}), "eager", hardware_id=ALL) is None
        assert second.lookup(P.key, config_id(P.op, "bsp", {}), "eager", hardware_id=ALL) is None
        assert first.add([ok(P, "bsp", {}, 20.0)], fp, source="baseline") == 1
        assert second.add([ok(P, "bsp", {}, 21.0), ok(P, "bsp", {}, 22.0, mode="graph"), ok(Q, "bsp", {}, 23.0)], fp,
                          source="baseline") == 2
        rows = second.measurements(op="fake_sum", hardware_id=ALL)
        assert sorted((r["problem"], r["mode"], r["median_us"]) for r in rows) == sorted(
            [(P.key, "eager", 20.0), (P.key, "graph", 22.0), (Q.key, "eager", 23.0)])
    finally:
        first.close()
        second.close()


def test_a_dangling_link_is_never_written_through(tmp_path):
    target = tmp_path / "missing" / "target.db"
    link = tmp_path / "link.db"
    link.symlink_to(target)
    for readonly in (False, True):
        with pytest.raises(StoreError, match="symbolic link .* does not exist"):
            Store.open(link, readonly=readonly)
    assert not target.parent.exists() and link.is_symlink()
