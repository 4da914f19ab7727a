"""The tuning store: idempotent writes, failed configs never candidates, stale fingerprints kept but unused."""
from __future__ import annotations

import math

import pytest

from autofuse import environment
from autofuse.measure import Measurement
from autofuse.op import Problem
from autofuse.store import ALL, Store, config_id, describe_stale

P = Problem.make("fake_sum", "float32", 2, N=64)
Q = Problem.make("fake_sum", "float32", 2, N=96)


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


def test_schema_wal_and_idempotent_trials(store, tmp_path):
    fp = environment.fingerprint()
    assert (tmp_path / "sub" / "t.db").exists()
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    rows = [ok(P, "push", {"BLOCK": 16}, 10.0), ok(P, "push", {"BLOCK": 16}, 12.0, mode="graph")]
    assert store.add(rows, fp, study="s", trial=0) == 2
    assert store.add(rows, fp, study="s", trial=0) == 0  # a resumed study rewriting its trial adds nothing
    assert store.add(rows, fp, study="s", trial=1) == 2
    assert store.add([ok(P, "bsp", {}, 20.0)], fp, source="baseline") == 1
    assert store.add([ok(P, "bsp", {}, 21.0)], fp, source="baseline") == 1  # no study: never collides
    with pytest.raises(ValueError):
        store.add([ok(P, "bsp", {}, 20.0)], fp, source="nonsense")
    got = store.measurements(op="fake_sum", mode="eager")
    assert len(got) == 4 and all(r["fingerprint"] == fp["id"] for r in got)
    r0 = got[0]
    assert r0["config"] == {"BLOCK": 16} and r0["ok"] is True and r0["extra"] == {"build_check_s": 0.5}
    assert r0["config_id"] == config_id("fake_sum", "push", {"BLOCK": 16})
    assert store.db["problems"].get(P.key)["world"] == 2
    assert store.db["configs"].count == 2
    assert store.db["environments"].get(fp["id"])["triton"] == fp["triton"]
    # Missing statistics are stored as NULL, not NaN.
    store.add([bad(P, "push", {"BLOCK": 8})], fp, study="s", trial=2)
    row = store.measurements(ok=False)[0]
    assert row["median_us"] is None and row["error"] == "wrong result" and not math.isnan(row["rel_error"])
    assert store.trial_rows("s", 2)[0]["ok"] is False


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
                                          "mode", "fingerprint"}
    assert store.best(op="other", mode="eager") == []
    assert store.best(mode="graph") == []
    # lookup: a failure in any mode is the verdict, so the tuner never retries that config.
    assert store.lookup(P.key, config_id("fake_sum", "push", {"BLOCK": 64}), "eager")["ok"] is False
    assert store.lookup(P.key, config_id("fake_sum", "push", {"BLOCK": 16}), "eager")["median_us"] == 8.0
    assert store.lookup(P.key, config_id("fake_sum", "push", {"BLOCK": 128}), "eager") is None


def test_stale_fingerprint_kept_not_used_and_reported(store):
    here = environment.fingerprint()
    other = dict(here, gpu_name="Some Other GPU", kernel_hash="0123456789abcdef")
    other["id"] = environment.fingerprint_id(other)
    assert other["id"] != here["id"]
    store.add([ok(P, "push", {"BLOCK": 16}, 1.0)], other, study="old", trial=0)
    store.add([ok(P, "bsp", {}, 2.0)], other, source="baseline")
    store.add([ok(P, "push", {"BLOCK": 32}, 5.0)], here, study="new", trial=0)
    assert len(store.measurements(fingerprint_id=ALL)) == 3  # kept
    assert [r["config"] for r in store.measurements()] == [{"BLOCK": 32}]  # not used
    assert [r["median_us"] for r in store.best(mode="eager")] == [5.0]
    assert [r["median_us"] for r in store.best(mode="eager", fingerprint_id=other["id"])] == [1.0, 2.0]
    assert store.lookup(P.key, config_id("fake_sum", "push", {"BLOCK": 16}), "eager") is None
    stale = store.stale(here["id"])
    assert stale["rows"] == 2 and stale["current"] == here["id"]
    (entry,) = stale["by_fingerprint"]
    assert entry["fingerprint"] == other["id"] and entry["rows"] == 2
    assert set(entry["differences"]) == {"gpu_name", "kernel_hash"}
    assert entry["differences"]["gpu_name"] == ("Some Other GPU", here["gpu_name"])
    assert stale["by_field"] == {"gpu_name": 2, "kernel_hash": 2}
    text = describe_stale(stale)
    assert "2 measurements" in text and "kept but not used" in text and "Some Other GPU" in text
    assert describe_stale(store.stale(other["id"])).startswith("1 measurements")
    fps = {f["id"]: f for f in store.fingerprints()}
    assert fps[here["id"]]["current"] and not fps[other["id"]]["current"]
    assert fps[other["id"]]["rows"] == 2 and fps[other["id"]]["gpu_name"] == "Some Other GPU"


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
