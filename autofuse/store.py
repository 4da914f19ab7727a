"""The tuning store: every measurement, with the environment it was taken in (DESIGN.md, Tuning and store).

A SQLite database (sqlite-utils, WAL mode) with four tables:
- `environments`: one row per environment fingerprint (`autofuse.environment.fingerprint`).
- `problems`: problem key -> op, dtype, world size, dims (JSON).
- `configs`: id (hash of op|variant|config) -> op, variant, config (JSON).
- `measurements`: one row per (problem, variant, config, mode) measured, with its verdict,
  latency statistics, fingerprint, and where it came from (`source`: tune, bench or baseline;
  `study`/`trial` for tuning rows). A UNIQUE index on (study, trial, mode) makes writing a trial
  idempotent, so a resumed study never duplicates a row.

Rows whose fingerprint differs from the current environment are kept but not used: `best` and
`measurements` read the current fingerprint's rows unless told otherwise, and `stale` says how
many rows were left out and what changed. A failed config (ok = 0) is stored so that it is not
retried, and is never returned by `best` (not even its OK rows in another mode or run).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import math
import sqlite3
from pathlib import Path
from typing import Any, Iterable, Mapping

import sqlite_utils

from autofuse import environment
from autofuse.op import Problem, config_key

SOURCES = ("tune", "bench", "baseline")
ALL = "*"  # pass as fingerprint_id to read the rows of every environment

_MEASUREMENT_COLUMNS = {
    "id": int, "problem": str, "op": str, "variant": str, "config_id": str, "config": str,
    "fingerprint": str, "mode": str, "ok": int, "error": str, "rel_error": float, "median_us": float,
    "p10_us": float, "p90_us": float, "min_us": float, "reps": int, "study": str, "trial": int,
    "source": str, "extra": str, "created_at": str,
}


def config_id(op: str, variant: str, config: Mapping[str, Any]) -> str:
    """Stable id of a config: sha256 (16 hex) of 'op|variant|canonical config JSON'."""
    return hashlib.sha256(f"{op}|{variant}|{config_key(config)}".encode()).hexdigest()[:16]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _num(x: Any) -> float | None:
    """SQLite has no NaN: store missing or non-finite statistics as NULL."""
    return float(x) if x is not None and math.isfinite(float(x)) else None


class Store:
    """The tuning database at `path` (created with its folder if missing)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite_utils.Database(sqlite3.connect(str(self.path), timeout=60))
        self.db.enable_wal()
        self._create_schema()

    def _create_schema(self) -> None:
        db = self.db
        env_cols = {"id": str, **{k: (int if k == "gpu_count" else str) for k in environment.KEY_FIELDS},
                    "python": str, "created_at": str}
        db["environments"].create(env_cols, pk="id", if_not_exists=True)
        db["problems"].create({"key": str, "op": str, "dtype": str, "world": int, "dims": str},
                              pk="key", if_not_exists=True)
        db["configs"].create({"id": str, "op": str, "variant": str, "config": str}, pk="id", if_not_exists=True)
        db["measurements"].create(_MEASUREMENT_COLUMNS, pk="id", not_null=["problem", "op", "variant", "mode", "ok"],
                                  if_not_exists=True)
        m = db["measurements"]
        m.create_index(["study", "trial", "mode"], index_name="measurements_trial", unique=True, if_not_exists=True)
        m.create_index(["fingerprint", "op", "mode", "ok"], index_name="measurements_select", if_not_exists=True)
        m.create_index(["problem", "config_id", "fingerprint", "mode"], index_name="measurements_config",
                       if_not_exists=True)

    def close(self) -> None:
        self.db.conn.close()

    # -- writing ---------------------------------------------------------------------------------

    def add_fingerprint(self, fingerprint: Mapping[str, Any]) -> str:
        """Record an environment (all its fields) once; returns its id."""
        row = {k: (v if isinstance(v, (int, float)) or v is None else
                   json.dumps(v) if isinstance(v, (dict, list)) else str(v)) for k, v in fingerprint.items()}
        row.setdefault("id", environment.fingerprint_id(dict(fingerprint)))
        row["created_at"] = _now()
        self.db["environments"].insert(row, pk="id", ignore=True, alter=True)
        return str(row["id"])

    def add(self, measurements: Iterable[Any], fingerprint: Mapping[str, Any] | str, study: str | None = None,
            trial: int | None = None, source: str = "tune") -> int:
        """Write measurements (autofuse.measure.Measurement) taken in `fingerprint`; returns rows added.

        `fingerprint` is the environment dict (recorded in `environments`) or an id already
        recorded. Rows of one (study, trial, mode) already present are left as they are.
        """
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, not {source!r}")
        fp_id = self.add_fingerprint(fingerprint) if isinstance(fingerprint, Mapping) else str(fingerprint)
        problems, configs, rows = {}, {}, []
        created = _now()
        for m in measurements:
            p: Problem = m.problem
            cid = config_id(p.op, m.variant, m.config)
            problems[p.key] = {"key": p.key, "op": p.op, "dtype": p.dtype, "world": p.world,
                               "dims": json.dumps(dict(p.dims), sort_keys=True)}
            configs[cid] = {"id": cid, "op": p.op, "variant": m.variant, "config": config_key(m.config)}
            rows.append({
                "problem": p.key, "op": p.op, "variant": m.variant, "config_id": cid, "config": config_key(m.config),
                "fingerprint": fp_id, "mode": m.mode, "ok": int(bool(m.ok)), "error": m.error or "",
                "rel_error": _num(m.rel_error), "median_us": _num(m.median_us), "p10_us": _num(m.p10_us),
                "p90_us": _num(m.p90_us), "min_us": _num(m.min_us), "reps": int(m.reps), "study": study,
                "trial": trial, "source": source, "extra": json.dumps(getattr(m, "extra", {}) or {}, sort_keys=True),
                "created_at": created,
            })
        if not rows:
            return 0
        self.db["problems"].insert_all(problems.values(), pk="key", ignore=True)
        self.db["configs"].insert_all(configs.values(), pk="id", ignore=True)
        before = self.db.conn.total_changes
        self.db["measurements"].insert_all(rows, ignore=True)  # one transaction: all modes or none
        return self.db.conn.total_changes - before

    # -- reading ---------------------------------------------------------------------------------

    @staticmethod
    def _current(fingerprint_id: str | None) -> str:
        return environment.fingerprint()["id"] if fingerprint_id is None else fingerprint_id

    @staticmethod
    def _decode(row: Mapping[str, Any]) -> dict:
        d = dict(row)
        for key in ("config", "extra"):
            if key in d and isinstance(d[key], str):
                d[key] = json.loads(d[key]) if d[key] else {}
        if "ok" in d:
            d["ok"] = bool(d["ok"])
        return d

    def _where(self, op: str | None, mode: str | None, fingerprint_id: str | None,
               prefix: str = "") -> tuple[str, dict]:
        clauses, params = [], {}
        fp = self._current(fingerprint_id)
        if fp != ALL:
            clauses.append(f"{prefix}fingerprint = :fp")
            params["fp"] = fp
        if op is not None:
            clauses.append(f"{prefix}op = :op")
            params["op"] = op
        if mode is not None:
            clauses.append(f"{prefix}mode = :mode")
            params["mode"] = mode
        return " AND ".join(clauses) or "1", params

    def measurements(self, op: str | None = None, mode: str | None = None, fingerprint_id: str | None = None,
                     ok: bool | None = None, **match: Any) -> list[dict]:
        """Rows (config and extra decoded) of the current fingerprint unless `fingerprint_id` is given
        (`ALL` for every environment); `match` filters further on columns (problem=, variant=, study=, ...)."""
        where, params = self._where(op, mode, fingerprint_id)
        if ok is not None:
            where += " AND ok = :ok"
            params["ok"] = int(ok)
        for col, value in match.items():
            if col not in _MEASUREMENT_COLUMNS:
                raise ValueError(f"measurements has no column {col!r}")
            where += f" AND {col} = :m_{col}"
            params[f"m_{col}"] = value
        sql = f"SELECT * FROM measurements WHERE {where} ORDER BY id"
        return [self._decode(r) for r in self.db.query(sql, params)]

    def best(self, op: str | None = None, mode: str = "graph", fingerprint_id: str | None = None) -> list[dict]:
        """Per (problem, variant), the fastest OK row in `mode` of configs that never failed there.

        Keys: problem, op, variant, config (dict), config_id, median_us, p10_us, p90_us, mode,
        fingerprint, source. A config with any failed row for the same problem and fingerprint
        (wrong result, flag timeout, crash, in any mode) is never a candidate.
        """
        where, params = self._where(op, mode, fingerprint_id, prefix="m.")
        sql = f"""
            WITH good AS (
              SELECT m.*, ROW_NUMBER() OVER (PARTITION BY m.problem, m.variant ORDER BY m.median_us, m.id) AS rk
              FROM measurements m
              WHERE {where} AND m.ok = 1 AND m.median_us IS NOT NULL
                AND NOT EXISTS (SELECT 1 FROM measurements b WHERE b.problem = m.problem
                                AND b.config_id = m.config_id AND b.fingerprint = m.fingerprint AND b.ok = 0)
            )
            SELECT problem, op, variant, config, config_id, median_us, p10_us, p90_us, mode, fingerprint, source
            FROM good WHERE rk = 1 ORDER BY problem, median_us"""
        return [self._decode(r) for r in self.db.query(sql, params)]

    def lookup(self, problem: str, config_id: str, mode: str, fingerprint_id: str | None = None) -> dict | None:
        """The verdict already stored for a config on a problem in one mode, or None.

        A failure in any mode wins (returned with ok False); otherwise the fastest OK row.
        """
        params = {"p": problem, "c": config_id, "fp": self._current(fingerprint_id), "mode": mode}
        sql = """SELECT * FROM measurements WHERE problem = :p AND config_id = :c AND fingerprint = :fp
                 AND (ok = 0 OR mode = :mode) ORDER BY ok, median_us LIMIT 1"""
        rows = list(self.db.query(sql, params))
        return self._decode(rows[0]) if rows else None

    def trial_rows(self, study: str, trial: int) -> list[dict]:
        """The rows written for one trial of one study."""
        return [self._decode(r) for r in self.db.query(
            "SELECT * FROM measurements WHERE study = ? AND trial = ? ORDER BY mode", [study, trial])]

    def fingerprints(self) -> list[dict]:
        """Every environment recorded, with its row count and whether it is the current one."""
        current = environment.fingerprint()["id"]
        counts = {r["fingerprint"]: r["n"] for r in self.db.query(
            "SELECT fingerprint, COUNT(*) AS n FROM measurements GROUP BY fingerprint")}
        out = []
        for row in self.db.query("SELECT * FROM environments ORDER BY created_at, id"):
            d = dict(row)
            d["rows"] = counts.get(d["id"], 0)
            d["current"] = d["id"] == current
            out.append(d)
        return out

    def environment(self, fingerprint_id: str) -> dict | None:
        rows = list(self.db.query("SELECT * FROM environments WHERE id = ?", [fingerprint_id]))
        return dict(rows[0]) if rows else None

    def stale(self, fingerprint_id: str | None = None) -> dict:
        """Rows measured in another environment than `fingerprint_id` (default: this machine's).

        Returns {"current": id, "rows": total stale rows, "by_fingerprint": [{"fingerprint", "rows",
        "differences": {field: (theirs, current)}}], "by_field": {field: rows}}.
        """
        current_id = self._current(fingerprint_id)
        here = environment.fingerprint()
        current = here if here["id"] == current_id else (self.environment(current_id) or {"id": current_id})
        by_fp, by_field, total = [], {}, 0
        for r in self.db.query("SELECT fingerprint, COUNT(*) AS n FROM measurements WHERE fingerprint != ? "
                               "GROUP BY fingerprint ORDER BY fingerprint", [current_id]):
            other = self.environment(r["fingerprint"]) or {"id": r["fingerprint"]}
            diff = environment.differences(other, current)
            by_fp.append({"fingerprint": r["fingerprint"], "rows": r["n"], "differences": diff})
            for k in diff:
                by_field[k] = by_field.get(k, 0) + r["n"]
            total += r["n"]
        return {"current": current_id, "rows": total, "by_fingerprint": by_fp, "by_field": by_field}


def describe_stale(stale: Mapping[str, Any]) -> str:
    """One paragraph for the CLI: how many rows are kept but not used, and what changed."""
    if not stale["rows"]:
        return ""
    parts = []
    for fp in stale["by_fingerprint"]:
        diffs = ", ".join(f"{k}: {a!s:.40} -> {b!s:.40}" for k, (a, b) in fp["differences"].items())
        parts.append(f"{fp['rows']} from environment {fp['fingerprint']} ({diffs or 'unknown environment'})")
    return (f"{stale['rows']} measurements were taken in another environment and are kept but not used: "
            + "; ".join(parts))
