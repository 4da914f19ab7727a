"""The tuning store: every measurement, with the environment it was taken in (DESIGN.md, Tuning and store).

One SQLite file, schema version 2 (table `meta`), five tables with foreign keys:
- `environments`: one row per environment (`autofuse.measure.environment.fingerprint`): id (hardware +
  software), `hardware_id`, `software_id` and every hardware and software field.
- `problems`: problem key -> op, dtype, world size, dims (JSON).
- `configs`: id (hash of op|variant|config) -> op, variant, config (JSON).
- `measurements`: one row per (problem, variant, config, mode) measured, referencing its problem,
  config and environment, with its verdict, latency statistics, `hardware_id`, `software_id`,
  `op_digest` (the op's code, `environment.op_digest`) and where it came from (`source`: tune,
  baseline or online; `study`/`trial` for tuning rows). A UNIQUE index on (study, trial, mode)
  makes writing a trial idempotent, so a resumed study never duplicates a row.

Reads (`best`, `lookup`, `measurements`) select by hardware id and op digest: rows of other hardware,
or of an op whose code changed since, are kept but not used; rows of other software (driver, CUDA,
torch, Triton, NCCL) are used, and `stale` reports both. A failed config (ok = 0) is stored so that it
is not retried, and is never returned by `best` (not even its OK rows in another mode or run). Rows of
older code of an op are read in one place: `earlier_best`, the configs that won with it, which a tune
measures first (`tuning.study`); `problem_keys` lists the problems of one hardware (`--sweep stored`).

`Store.open(path, readonly=True)` (show, export, fit) never writes: the file is opened with SQLite's
read-only URI mode, nothing is created or converted, and a missing, foreign, corrupt or truncated
file raises `StoreError` naming the path and the cause. A writable open checks an existing file the
same way, read-only, before it writes anything, so a damaged or foreign database is refused untouched;
either open refuses anything but a regular file (a device, a FIFO, a link to one). A row whose values
are not what autofuse writes (a problem key that does not parse or is another op's, a config that is
not a JSON object, text or a negative or infinite number in a latency column) raises `StoreError`
naming it when read. Schema-1 databases (before layered
fingerprints) are migrated in place by a writable open and read through a migrated in-memory copy by
a read-only one; their rows keep the current op digests when the code is the one they were measured
with (`environment.legacy_kernel_hash`), else a `legacy-...` digest that no current op matches.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import sqlite3
import stat
import urllib.parse
from pathlib import Path
from typing import Any, Iterable, Mapping

from autofuse.measure import environment
from autofuse.core.op import Problem, config_key

SCHEMA_VERSION = 2
SOURCES = ("tune", "baseline", "online")
ALL = "*"  # as hardware_id / op_digest / fingerprint_id: no filter on that layer
TABLES = ("environments", "problems", "configs", "measurements")
_QUICK_CHECK_MAX_BYTES = 256 << 20  # larger files are checked as they are read
_NUMBERS = ("rel_error", "median_us", "p10_us", "p90_us", "min_us", "reps", "trial")

_ENV_COLUMNS = ("id", "hardware_id", "software_id", *environment.HARDWARE_FIELDS, *environment.SOFTWARE_FIELDS,
                "python", "kernel_hash", "created_at")
_MEASUREMENT_COLUMNS = ("id", "problem", "op", "variant", "config_id", "config", "fingerprint", "hardware_id",
                        "software_id", "op_digest", "mode", "ok", "error", "rel_error", "median_us", "p10_us",
                        "p90_us", "min_us", "reps", "study", "trial", "source", "extra", "created_at")
_SCHEMA = f"""
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE environments (
  id TEXT PRIMARY KEY, hardware_id TEXT NOT NULL, software_id TEXT NOT NULL,
  device_kind TEXT, gpu_name TEXT, gpu_count INTEGER, topology TEXT,
  driver TEXT, cuda TEXT, torch TEXT, triton TEXT, nccl TEXT,
  python TEXT, kernel_hash TEXT, created_at TEXT);
CREATE TABLE problems (key TEXT PRIMARY KEY, op TEXT NOT NULL, dtype TEXT, world INTEGER, dims TEXT);
CREATE TABLE configs (id TEXT PRIMARY KEY, op TEXT NOT NULL, variant TEXT NOT NULL, config TEXT NOT NULL);
CREATE TABLE measurements (
  id INTEGER PRIMARY KEY,
  problem TEXT NOT NULL REFERENCES problems(key),
  op TEXT NOT NULL, variant TEXT NOT NULL,
  config_id TEXT NOT NULL REFERENCES configs(id),
  config TEXT NOT NULL,
  fingerprint TEXT NOT NULL REFERENCES environments(id),
  hardware_id TEXT NOT NULL, software_id TEXT NOT NULL, op_digest TEXT NOT NULL,
  mode TEXT NOT NULL, ok INTEGER NOT NULL, error TEXT, rel_error REAL,
  median_us REAL, p10_us REAL, p90_us REAL, min_us REAL, reps INTEGER,
  study TEXT, trial INTEGER, source TEXT NOT NULL, extra TEXT, created_at TEXT);
CREATE UNIQUE INDEX measurements_trial ON measurements (study, trial, mode);
CREATE INDEX measurements_select ON measurements (hardware_id, op, op_digest, mode, ok);
CREATE INDEX measurements_config ON measurements (problem, config_id, hardware_id, op_digest, mode);
CREATE INDEX measurements_env ON measurements (fingerprint);
INSERT INTO meta VALUES ('schema_version', '{SCHEMA_VERSION}'), ('application', 'autofuse');
"""


class StoreError(Exception):
    """The database cannot be used: one line naming the path and the cause."""


def config_id(op: str, variant: str, config: Mapping[str, Any]) -> str:
    """Stable id of a config: sha256 (16 hex) of 'op|variant|canonical config JSON'."""
    return hashlib.sha256(f"{op}|{variant}|{config_key(config)}".encode()).hexdigest()[:16]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _num(x: Any) -> float | None:
    """SQLite has no NaN: store missing or non-finite statistics as NULL."""
    return float(x) if x is not None and math.isfinite(float(x)) else None


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}


_schema_columns: dict[str, set[str]] = {}


def _expected_columns() -> dict[str, set[str]]:
    """{table: its columns} of the current schema (read from an in-memory database made with it)."""
    if not _schema_columns:
        mem = sqlite3.connect(":memory:")
        try:
            _script(mem, _SCHEMA)
            _schema_columns.update({t: _columns(mem, t) for t in ("meta", *TABLES)})
        finally:
            mem.close()
    return _schema_columns


def _version(conn: sqlite3.Connection) -> int | None:
    """2+ (meta table), 1 (autofuse before layered fingerprints), 0 (empty), None (not autofuse: tables
    of another application, even where some share autofuse's names)."""
    tables = _tables(conn)
    if not tables:
        return 0
    if "meta" in tables and "measurements" in tables:
        try:
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        except sqlite3.OperationalError:  # a table named meta without autofuse's columns
            return None
        if row is not None and str(row[0]).isdigit():
            version = int(row[0])
            if version == SCHEMA_VERSION and not all(t in tables and cols <= _columns(conn, t)
                                                      for t, cols in _expected_columns().items()):
                return None
            return version
    if set(TABLES) <= tables and {"problem", "variant", "config_id", "fingerprint", "mode", "ok",
                                  "median_us"} <= _columns(conn, "measurements") and {
            "key", "op"} <= _columns(conn, "problems") and {"id", "op", "variant", "config"} <= _columns(conn, "configs"):
        return 1
    return None


def _env_row(fp: Mapping[str, Any]) -> dict:
    row = {k: fp.get(k) for k in _ENV_COLUMNS}
    row["id"] = str(fp.get("id") or environment.fingerprint_id(fp))
    row["hardware_id"] = environment.hardware_id(fp)
    row["software_id"] = environment.software_id(fp)
    row["created_at"] = row.get("created_at") or _now()
    for k, v in row.items():
        if v is not None and not isinstance(v, (int, float, str)):
            row[k] = json.dumps(v) if isinstance(v, (dict, list)) else str(v)
    return row


def _insert(conn: sqlite3.Connection, table: str, rows: Iterable[Mapping[str, Any]], verb: str = "INSERT OR IGNORE") -> int:
    rows = list(rows)
    if not rows:
        return 0
    cols = list(rows[0])
    sql = f"{verb} INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})"
    before = conn.total_changes
    conn.executemany(sql, [[r[c] for c in cols] for r in rows])
    return conn.total_changes - before


def _script(conn: sqlite3.Connection, sql: str) -> None:
    for statement in sql.split(";\n"):
        if statement.strip():
            conn.execute(statement)


def _migrate_v1(conn: sqlite3.Connection) -> None:
    """Schema 1 -> 2 in one transaction: ids per layer, op digests, foreign keys (tables rebuilt)."""
    legacy = environment.legacy_kernel_hash()
    current: dict[str, str] = {}  # op -> digest of today's code, computed once per op
    saved = conn.isolation_level
    conn.isolation_level = None  # explicit BEGIN/COMMIT: SQLite's DDL is transactional
    conn.row_factory = sqlite3.Row
    conn.execute("BEGIN IMMEDIATE")
    try:
        for index in ("measurements_trial", "measurements_select", "measurements_config"):
            conn.execute(f"DROP INDEX IF EXISTS {index}")
        for t in TABLES:
            conn.execute(f"ALTER TABLE {t} RENAME TO {t}_v1")
        _script(conn, _SCHEMA)
        conn.execute("INSERT INTO meta VALUES ('migrated_from', '1')")
        envs = {r["id"]: dict(r) for r in conn.execute("SELECT * FROM environments_v1")}
        for r in conn.execute("SELECT DISTINCT fingerprint FROM measurements_v1"):
            envs.setdefault(r[0] or "unknown", {"id": r[0] or "unknown"})
        _insert(conn, "environments", [_env_row(e) for e in envs.values()])
        conn.execute("INSERT OR IGNORE INTO problems SELECT key, op, dtype, world, dims FROM problems_v1")
        conn.execute("INSERT OR IGNORE INTO configs SELECT id, op, variant, config FROM configs_v1")
        rows = [dict(r) for r in conn.execute("SELECT * FROM measurements_v1 ORDER BY id")]
        problems, configs = {}, {}
        for r in rows:
            if r["problem"] not in problems:
                try:
                    p = Problem.from_key(r["problem"])
                    problems[r["problem"]] = {"key": r["problem"], "op": p.op, "dtype": p.dtype, "world": p.world,
                                              "dims": json.dumps(dict(p.dims), sort_keys=True)}
                except Exception:  # noqa: BLE001 - a key this version cannot parse keeps its op only
                    problems[r["problem"]] = {"key": r["problem"], "op": r["op"], "dtype": None, "world": None,
                                              "dims": None}
            cfg = json.loads(r["config"] or "{}")
            r["config"] = config_key(cfg)
            r["config_id"] = r["config_id"] or config_id(r["op"], r["variant"], cfg)
            configs[r["config_id"]] = {"id": r["config_id"], "op": r["op"], "variant": r["variant"],
                                       "config": r["config"]}
            env = envs[r["fingerprint"] or "unknown"]
            r["fingerprint"] = env["id"]
            r["hardware_id"] = environment.hardware_id(env)
            r["software_id"] = environment.software_id(env)
            kh = env.get("kernel_hash") or "unknown"
            if kh == legacy and r["op"] not in current:
                current[r["op"]] = _digest(r["op"]) if r["op"] in _registered_ops() else f"legacy-{kh}"
            r["op_digest"] = current[r["op"]] if kh == legacy else f"legacy-{kh}"
            r["source"] = r["source"] or "tune"
        _insert(conn, "problems", problems.values())
        _insert(conn, "configs", configs.values())
        _insert(conn, "measurements", [{c: r.get(c) for c in _MEASUREMENT_COLUMNS} for r in rows], "INSERT")
        for t in TABLES:
            conn.execute(f"DROP TABLE {t}_v1")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    finally:
        conn.isolation_level = saved
        conn.row_factory = None


def _registered_ops() -> list[str]:
    from autofuse.core import registry

    return registry.names()


def _digest(op: str) -> str:
    return environment.op_digest(op)


class Store:
    """The tuning database at `path`.

    `Store(path)` / `Store.open(path)` open it for writing (created with its folder if missing; a
    schema-1 file is migrated; an SQLite file of another application is refused). `Store.open(path,
    readonly=True)` only reads (see the module docstring). `fingerprint` is the environment that
    reads default to (hardware id, op digests); default: this machine's.
    """

    def __init__(self, path: str | Path, readonly: bool = False, fingerprint: Mapping[str, Any] | None = None):
        self.path = Path(path)
        self.readonly = readonly
        self._fingerprint = dict(fingerprint) if fingerprint is not None else None
        self.migrated = False
        self.conn = self._open_readonly() if readonly else self._open_writable()
        self.conn.row_factory = sqlite3.Row

    @classmethod
    def open(cls, path: str | Path, readonly: bool = False, fingerprint: Mapping[str, Any] | None = None) -> "Store":
        """Open the store at `path` (see the class docstring); raises StoreError with one line."""
        return cls(path, readonly=readonly, fingerprint=fingerprint)

    # -- opening -----------------------------------------------------------------------------

    def _error(self, cause: str) -> StoreError:
        return StoreError(f"{self.path}: {cause}")

    def _regular(self) -> bool:
        """Whether the file exists; StoreError if it is anything but a regular file (SQLite would write a
        journal beside a device a symbolic link names, e.g. /dev/null-journal, or block on a FIFO)."""
        try:
            mode = os.stat(self.path).st_mode
        except FileNotFoundError:
            if os.path.islink(self.path):  # SQLite would create the missing target through the link
                raise self._error(f"is a symbolic link to {os.readlink(self.path)}, which does not exist: name the "
                                  "database file itself") from None
            return False
        except OSError as exc:
            raise self._error(f"cannot be read: {exc.strerror or exc}") from None
        if stat.S_ISDIR(mode):
            raise self._error("is a directory, not a database file")
        if not stat.S_ISREG(mode):
            raise self._error("is not a regular file (a device, FIFO or socket): name a database file")
        return True

    def _open_readonly(self) -> sqlite3.Connection:
        conn, version = self._checked()
        if version == 1:
            mem = sqlite3.connect(":memory:")
            conn.backup(mem)
            conn.close()
            _migrate_v1(mem)
            self.migrated = True
            return mem
        return conn

    def _checked(self) -> tuple[sqlite3.Connection, int]:
        """A read-only connection to the existing file and its schema version, once it is known to be a
        readable, uncorrupted autofuse database this version can read (StoreError otherwise)."""
        p = self.path
        if not self._regular():
            raise self._error("no such file")
        size = p.stat().st_size
        if size == 0:
            raise self._error("is an empty file, not an autofuse database")
        try:
            with open(p, "rb") as f:
                header = f.read(100)
        except OSError as exc:
            raise self._error(f"cannot read: {exc.strerror or exc}") from None
        if not header.startswith(b"SQLite format 3\x00"):
            raise self._error("is not an SQLite database (no SQLite header)")
        # A WAL-mode file with no -wal beside it has no writer now: read it as immutable, so that
        # SQLite does not leave -wal/-shm files next to it; with a -wal (a tune running), share it.
        wal = len(header) > 19 and header[18] == 2 and not Path(f"{p}-wal").exists()
        uri = f"file:{urllib.parse.quote(str(p.absolute()))}?mode=ro" + ("&immutable=1" if wal else "")
        conn = None
        try:
            conn = sqlite3.connect(uri, uri=True, timeout=60)
            version = _version(conn)
            check = conn.execute("PRAGMA quick_check(1)").fetchone()[0] if size <= _QUICK_CHECK_MAX_BYTES else "ok"
            if check != "ok":
                raise self._error(f"is corrupt ({' '.join(check.replace('*** in database main ***', '').split())})")
            if version is None or (version == 0 and self.readonly):  # an empty database may be written into
                tables = sorted(_tables(conn))
                held = f"its tables: {', '.join(tables[:6])}" if tables else "it has no tables"
                raise self._error(f"is not an autofuse database ({held})" if self.readonly else
                                  f"is an SQLite database of another application ({held}): refusing to write into it")
            if version > SCHEMA_VERSION:
                raise self._error(f"was written by a newer autofuse (schema {version} > {SCHEMA_VERSION}): "
                                  "upgrade autofuse")
        except (sqlite3.DatabaseError, StoreError) as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, StoreError):
                raise
            raise self._error(f"cannot be read as an SQLite database: {exc}") from None
        return conn, version

    def _open_writable(self) -> sqlite3.Connection:
        p = self.path
        if self._regular() and p.stat().st_size > 0:
            # an existing database is checked read-only first (autofuse's, readable, not corrupt), so a
            # damaged or foreign file is refused before anything is written into it
            self._checked()[0].close()
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._error(f"cannot create its folder: {exc.strerror or exc}") from None
        try:
            conn = sqlite3.connect(str(p), timeout=60)
            version = _version(conn)
        except sqlite3.DatabaseError as exc:
            raise self._error(f"cannot be opened as an SQLite database: {exc}") from None
        if version is None:
            conn.close()
            raise self._error("is an SQLite database of another application (no autofuse tables): "
                              "refusing to write into it")
        if version > SCHEMA_VERSION:
            conn.close()
            raise self._error(f"was written by a newer autofuse (schema {version} > {SCHEMA_VERSION}): upgrade autofuse")
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            if version == 0:
                conn.executescript("BEGIN;\n" + _SCHEMA + "COMMIT;")
            elif version == 1:
                _migrate_v1(conn)
                self.migrated = True
            conn.execute("PRAGMA foreign_keys = ON")
            with conn:  # can we write? (a read-only file or folder fails here, before anything is measured)
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("INSERT OR REPLACE INTO meta VALUES ('opened_for_writing', ?)", [_now()])
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise self._error(f"cannot write: {exc}") from None
        return conn

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the environment reads default to --------------------------------------------------------

    @property
    def fingerprint(self) -> dict:
        if self._fingerprint is None:
            self._fingerprint = environment.fingerprint()
        return self._fingerprint

    @property
    def digests(self) -> dict[str, str]:
        """Current op digests: rows of these ops with another digest are not read by default."""
        ops = self.fingerprint.get("ops")
        return dict(ops) if isinstance(ops, Mapping) else environment.op_digests()

    # -- writing ---------------------------------------------------------------------------------

    def _writable(self) -> None:
        if self.readonly:
            raise self._error("opened read-only")

    def add(self, measurements: Iterable[Any], fingerprint: Mapping[str, Any] | str, study: str | None = None,
            trial: int | None = None, source: str = "tune", op_digest: str | None = None) -> int:
        """Write measurements (autofuse.measure.timing.Measurement) taken in `fingerprint`; returns rows added.

        `fingerprint` is the environment dict (recorded in `environments`) or the id of one already
        recorded. `op_digest` is the code of the measured op (default: the fingerprint's `ops`
        entry, else `environment.op_digest` of a registered op, else ''). A trial written again
        (the same study, trial and config: a resumed run) adds nothing. A trial whose (study, trial)
        is taken by another config (a new Optuna storage numbers trials from 0 again) is kept under
        the study name `<study>#<tag>`, as `merge_from` does, never dropped. A baseline row whose config
        is already measured as a baseline on this problem, hardware, op code and mode is not added (two
        tunes sharing one database each measured it: the first row stands), unless it is a re-measurement
        confirmed in turns (`extra.confirmed`), which `best` prefers to the first row. All rows are written in
        one transaction, which holds the database's write lock from before that check.
        """
        self._writable()
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, not {source!r}")
        if isinstance(fingerprint, Mapping):
            env = _env_row(fingerprint)
            ops = fingerprint.get("ops") if isinstance(fingerprint.get("ops"), Mapping) else {}
        else:
            env = self.environment(str(fingerprint))
            if env is None:
                raise ValueError(f"environment {fingerprint} is not recorded: pass the fingerprint dict")
            ops = {}
        problems, configs, rows = {}, {}, []
        created = _now()
        digests: dict[str, str] = {}
        registered: list[str] | None = None
        for m in measurements:
            p: Problem = m.problem
            if p.op not in digests:
                if op_digest is not None or p.op in ops:
                    digests[p.op] = op_digest if op_digest is not None else ops[p.op]
                else:
                    registered = _registered_ops() if registered is None else registered
                    digests[p.op] = _digest(p.op) if p.op in registered else ""
            cid = config_id(p.op, m.variant, m.config)
            problems[p.key] = {"key": p.key, "op": p.op, "dtype": p.dtype, "world": p.world,
                               "dims": json.dumps(dict(p.dims), sort_keys=True)}
            configs[cid] = {"id": cid, "op": p.op, "variant": m.variant, "config": config_key(m.config)}
            rows.append({
                "problem": p.key, "op": p.op, "variant": m.variant, "config_id": cid, "config": config_key(m.config),
                "fingerprint": env["id"], "hardware_id": env["hardware_id"], "software_id": env["software_id"],
                "op_digest": digests[p.op], "mode": m.mode, "ok": int(bool(m.ok)), "error": m.error or "",
                "rel_error": _num(m.rel_error), "median_us": _num(m.median_us), "p10_us": _num(m.p10_us),
                "p90_us": _num(m.p90_us), "min_us": _num(m.min_us), "reps": int(m.reps), "study": study,
                "trial": trial, "source": source, "extra": json.dumps(getattr(m, "extra", {}) or {}, sort_keys=True),
                "created_at": created,
            })
        if not rows:
            return 0
        if study is not None and trial is not None:
            held = {r["config_id"] for r in self._query(
                "SELECT config_id FROM measurements WHERE study = ? AND trial = ?", [study, trial])}
            if held and not held & {r["config_id"] for r in rows}:
                content = json.dumps(sorted((r["config_id"], r["mode"], r["created_at"]) for r in rows))
                name = f"{study}#{hashlib.sha256(content.encode()).hexdigest()[:8]}"
                while self._query("SELECT 1 FROM measurements WHERE study = ? AND trial = ? LIMIT 1", [name, trial]):
                    name += "+"
                for r in rows:
                    r["study"] = name
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")  # one writer from here: the baseline check below stays true
            if source == "baseline":  # a re-measurement confirmed in turns (extra.confirmed) is a new row
                rows = [r for r in rows if '"confirmed": true' in r["extra"] or not self._query(
                    "SELECT 1 FROM measurements WHERE source = 'baseline' AND problem = ? AND config_id = ? "
                    "AND hardware_id = ? AND op_digest = ? AND mode = ? LIMIT 1",
                    [r["problem"], r["config_id"], r["hardware_id"], r["op_digest"], r["mode"]])]
            if isinstance(fingerprint, Mapping):
                _insert(self.conn, "environments", [env])
            _insert(self.conn, "problems", problems.values())
            _insert(self.conn, "configs", configs.values())
            return _insert(self.conn, "measurements", rows)

    # -- reading ---------------------------------------------------------------------------------

    def _query(self, sql: str, params: Mapping[str, Any] | list | tuple = ()) -> list[dict]:
        try:
            return [dict(r) for r in self.conn.execute(sql, params)]
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) and "no such column" in str(exc):
                raise
            raise self._error(f"cannot be read: {exc}") from None

    def _decode(self, row: Mapping[str, Any]) -> dict:
        """A measurement row as Python values (config and extra as dicts, ok as bool); StoreError naming
        the row where a value is not what autofuse writes (a database modified outside autofuse)."""
        d = dict(row)
        where = (f"measurement {d['id']}" if "id" in d else "a measurement") + f" ({d.get('problem')}, {d.get('variant')})"
        for key in ("config", "extra"):
            if key in d:
                try:
                    d[key] = json.loads(d[key]) if d[key] else {}
                except (TypeError, ValueError):
                    d[key] = None
                if not isinstance(d[key], dict):
                    raise self._error(f"{where}: {key} is not a JSON object ({str(row[key])[:60]!r}); "
                                      "the database was modified outside autofuse")
        for key in _NUMBERS:
            if key in d and d[key] is not None and (isinstance(d[key], bool) or not isinstance(d[key], (int, float))):
                raise self._error(f"{where}: {key} is not a number ({str(d[key])[:60]!r}); "
                                  "the database was modified outside autofuse")
            if key in d and d[key] is not None and not (math.isfinite(d[key]) and d[key] >= 0):
                raise self._error(f"{where}: {key} is {d[key]!r}, not a finite number >= 0 as autofuse writes; "
                                  "the database was modified outside autofuse")
        if "problem" in d:
            try:
                problem = Problem.from_key(d["problem"])
            except Exception:  # noqa: BLE001 - any malformed key: the message names it
                raise self._error(f"{where}: {str(d['problem'])[:80]!r} is not a problem key; "
                                  "the database was modified outside autofuse") from None
            if "op" in d and problem.op != d["op"]:
                raise self._error(f"{where}: a row of {d['op']} holds a problem key of {problem.op} "
                                  f"({str(d['problem'])[:80]!r}); the database was modified outside autofuse")
        if "ok" in d:
            d["ok"] = bool(d["ok"])
        return d

    def _where(self, op: str | None, mode: str | None, hardware_id: str | None, op_digest: str | None,
               fingerprint_id: str | None, prefix: str = "") -> tuple[str, dict]:
        """SQL conditions selecting rows by op, mode and environment (see `measurements`)."""
        clauses, params = [], {}
        if fingerprint_id is not None and fingerprint_id != ALL:
            clauses.append(f"{prefix}fingerprint = :fp")
            params["fp"] = fingerprint_id
        elif fingerprint_id is None:
            hw = self.fingerprint["hardware_id"] if hardware_id is None else hardware_id
            if hw != ALL:
                clauses.append(f"{prefix}hardware_id = :hw")
                params["hw"] = hw
        if op_digest is None:
            digests = self.digests
            if op is not None:
                digests = {op: digests[op]} if op in digests else {}
            if digests:
                pairs = []
                for i, (name, d) in enumerate(sorted(digests.items())):
                    pairs.append(f"(:dop{i}, :dd{i})")
                    params[f"dop{i}"], params[f"dd{i}"] = name, d
                names = ", ".join(f":dop{i}" for i in range(len(pairs)))
                clauses.append(f"({prefix}op NOT IN ({names}) OR ({prefix}op, {prefix}op_digest) IN "
                               f"(VALUES {', '.join(pairs)}))")
        elif op_digest != ALL:
            clauses.append(f"{prefix}op_digest = :digest")
            params["digest"] = op_digest
        if op is not None:
            clauses.append(f"{prefix}op = :op")
            params["op"] = op
        if mode is not None:
            clauses.append(f"{prefix}mode = :mode")
            params["mode"] = mode
        return " AND ".join(clauses) or "1", params

    def measurements(self, op: str | None = None, mode: str | None = None, hardware_id: str | None = None,
                     op_digest: str | None = None, fingerprint_id: str | None = None, ok: bool | None = None,
                     **match: Any) -> list[dict]:
        """Rows (config and extra decoded), oldest first.

        Environment selection, the same in `best` and `lookup`: `hardware_id` None = this machine's
        hardware (the store's fingerprint), ALL = any; `op_digest` None = the current code of each
        registered op (rows of unregistered ops are not filtered), ALL = any code, or one digest;
        `fingerprint_id` = exactly one environment (hardware + software) instead of `hardware_id`,
        ALL = every environment. `match` filters further on columns (problem=, variant=, study=, ...).
        """
        where, params = self._where(op, mode, hardware_id, op_digest, fingerprint_id)
        if ok is not None:
            where += " AND ok = :ok"
            params["ok"] = int(ok)
        for col, value in match.items():
            if col not in _MEASUREMENT_COLUMNS:
                raise ValueError(f"measurements has no column {col!r}")
            where += f" AND {col} = :m_{col}"
            params[f"m_{col}"] = value
        return [self._decode(r) for r in self._query(f"SELECT * FROM measurements WHERE {where} ORDER BY id", params)]

    def best(self, op: str | None = None, mode: str = "graph", hardware_id: str | None = None,
             op_digest: str | None = None, fingerprint_id: str | None = None,
             problem: str | None = None) -> list[dict]:
        """Per (problem, variant), the fastest OK row in `mode` of configs that never failed there
        (`problem`: of that problem key alone, read through the index that leads with it: the tuner asks
        per trial, and the cost of an ask must not grow with the rest of the database).

        Keys: problem, op, variant, config (dict), config_id, median_us, p10_us, p90_us, mode,
        fingerprint, hardware_id, software_id, op_digest, source, extra (dict). A config with any
        failed row for the same problem, hardware and op code (wrong result, flag timeout, crash, in
        any mode) is never a candidate. A row re-measured in turns later (a newer row of the same
        config and mode with `extra.confirmed`, written by the tuner's outlier check) is superseded
        by it, whichever is faster. Environment selection as in `measurements`.
        """
        where, params = self._where(op, mode, hardware_id, op_digest, fingerprint_id, prefix="m.")
        rows = "measurements m"
        if problem is not None:  # that problem's rows by the index that leads with it: without statistics,
            where += " AND m.problem = :problem"  # SQLite would scan every row of the op (measurements_select)
            params["problem"] = problem
            rows += " INDEXED BY measurements_config"
        sql = f"""
            WITH good AS (
              SELECT m.*, ROW_NUMBER() OVER (PARTITION BY m.problem, m.variant ORDER BY m.median_us, m.id) AS rk
              FROM {rows}
              WHERE {where} AND m.ok = 1 AND m.median_us IS NOT NULL
                AND NOT EXISTS (SELECT 1 FROM measurements b WHERE b.problem = m.problem
                                AND b.config_id = m.config_id AND b.hardware_id = m.hardware_id
                                AND b.op_digest = m.op_digest AND b.ok = 0)
                AND NOT EXISTS (SELECT 1 FROM measurements c WHERE c.problem = m.problem
                                AND c.config_id = m.config_id AND c.hardware_id = m.hardware_id
                                AND c.op_digest = m.op_digest AND c.mode = m.mode AND c.ok = 1 AND c.id > m.id
                                AND json_valid(c.extra) AND json_extract(c.extra, '$.confirmed') = 1)
            )
            SELECT problem, op, variant, config, config_id, median_us, p10_us, p90_us, mode, fingerprint,
                   hardware_id, software_id, op_digest, source, extra
            FROM good WHERE rk = 1 ORDER BY problem, median_us"""
        return [self._decode(r) for r in self._query(sql, params)]

    def lookup(self, problem: str, config_id: str, mode: str, hardware_id: str | None = None,
               op_digest: str | None = None, fingerprint_id: str | None = None) -> dict | None:
        """The verdict already stored for a config on a problem in one mode, or None.

        A failure in any mode wins (returned with ok False); otherwise the fastest OK row.
        """
        op = problem.split("|", 1)[0]
        where, params = self._where(op, None, hardware_id, op_digest, fingerprint_id)
        params.update({"p": problem, "c": config_id, "lmode": mode})
        sql = (f"SELECT * FROM measurements WHERE {where} AND problem = :p AND config_id = :c "
               "AND (ok = 0 OR mode = :lmode) ORDER BY ok, median_us LIMIT 1")
        rows = self._query(sql, params)
        return self._decode(rows[0]) if rows else None

    def earlier_best(self, problem: str, mode: str, hardware_id: str, op_digest: str) -> list[dict]:
        """Per (variant, config, op code), the fastest OK row of `problem` in `mode` on `hardware_id` measured
        with other code of its op (any op_digest but `op_digest`), configs that failed with that code left out;
        fastest first, each with `code_last` (when that code last measured this problem: which code is the
        newest). What a re-tune after a change to the op's code measures first (`tuning.study`: the previous
        winners); rows of the current code are `best`'s. Keys as in `best`, plus code_last."""
        sql = """
            WITH code AS (
              SELECT op_digest, MAX(created_at) AS code_last FROM measurements INDEXED BY measurements_config
              WHERE problem = :p AND hardware_id = :hw AND op_digest != :digest GROUP BY op_digest
            ), good AS (
              SELECT m.*, ROW_NUMBER() OVER (PARTITION BY m.variant, m.config_id, m.op_digest
                                             ORDER BY m.median_us, m.id) AS rk
              FROM measurements m INDEXED BY measurements_config
              WHERE m.problem = :p AND m.hardware_id = :hw AND m.op_digest != :digest AND m.mode = :mode
                AND m.ok = 1 AND m.median_us IS NOT NULL
                AND NOT EXISTS (SELECT 1 FROM measurements b WHERE b.problem = m.problem
                                AND b.config_id = m.config_id AND b.hardware_id = m.hardware_id
                                AND b.op_digest = m.op_digest AND b.ok = 0)
            )
            SELECT problem, op, variant, config, config_id, median_us, p10_us, p90_us, mode, fingerprint,
                   hardware_id, software_id, op_digest, source, extra, code.code_last AS code_last
            FROM good JOIN code USING (op_digest) WHERE rk = 1 ORDER BY median_us, variant, config_id"""
        return [self._decode(r) for r in self._query(sql, {"p": problem, "hw": hardware_id, "digest": op_digest,
                                                            "mode": mode})]

    def earlier_problems(self, hardware_id: str, mode: str, digests: Mapping[str, str]) -> set[str]:
        """Keys of the problems of the ops in `digests` ({op: its current digest}) with OK rows in `mode` on
        `hardware_id` measured with other code of the op: those whose previous winners a tune re-measures first."""
        out: set[str] = set()
        for op, digest in digests.items():
            out.update(r["problem"] for r in self._query(
                "SELECT DISTINCT problem FROM measurements WHERE hardware_id = ? AND op = ? AND op_digest != ? "
                "AND mode = ? AND ok = 1", [hardware_id, op, digest, mode]))
        return out

    def problem_keys(self, hardware_id: str) -> list[dict]:
        """Every problem with a measurement on `hardware_id` (any op code, mode or verdict): {key, op, world}
        as written, keys not parsed (one an op no longer reads is the caller's to skip); by op, then key.
        What `autofuse tune --sweep stored` re-measures."""
        return self._query(
            "SELECT p.key AS key, p.op AS op, p.world AS world FROM problems p WHERE EXISTS (SELECT 1 FROM "
            "measurements m WHERE m.problem = p.key AND m.hardware_id = ?) ORDER BY p.op, p.key", [hardware_id])

    def code_versions(self, op: str | None = None, mode: str | None = None,
                      fingerprint_id: str | None = None) -> list[dict]:
        """Each (op, op_digest) with successful rows (of one environment if `fingerprint_id`, in one mode
        if `mode`): {op, op_digest, rows, last (newest created_at)}, newest first."""
        clauses, params = ["ok = 1"], {}
        for col, value in (("op", op), ("mode", mode), ("fingerprint", fingerprint_id)):
            if value is not None:
                clauses.append(f"{col} = :{col}")
                params[col] = value
        return self._query(f"SELECT op, op_digest, COUNT(*) AS rows, MAX(created_at) AS last FROM measurements "
                           f"WHERE {' AND '.join(clauses)} GROUP BY op, op_digest ORDER BY last DESC, op_digest",
                           params)

    def trial_rows(self, study: str, trial: int) -> list[dict]:
        """The rows written for one trial of one study."""
        return [self._decode(r) for r in self._query(
            "SELECT * FROM measurements WHERE study = ? AND trial = ? ORDER BY mode", [study, trial])]

    def modes(self, op: str | None = None) -> list[str]:
        """The timing modes with at least one successful measurement (any environment), sorted."""
        where, params = ("op = :op", {"op": op}) if op is not None else ("1", {})
        return [r["mode"] for r in self._query(
            f"SELECT DISTINCT mode FROM measurements WHERE {where} AND ok = 1 ORDER BY mode", params)]

    def environments(self) -> list[dict]:
        """Every environment recorded, with `rows` (its measurements), `modes`, and how it relates to
        the store's fingerprint: `current` (same hardware and software), `same_hardware`."""
        here = self.fingerprint
        counts = {r["fingerprint"]: r for r in self._query(
            "SELECT fingerprint, COUNT(*) AS n, GROUP_CONCAT(DISTINCT mode) AS modes FROM measurements "
            "GROUP BY fingerprint")}
        out = []
        for d in self._query("SELECT * FROM environments ORDER BY created_at, id"):
            c = counts.get(d["id"])
            d["rows"] = c["n"] if c else 0
            d["modes"] = sorted(c["modes"].split(",")) if c and c["modes"] else []
            d["same_hardware"] = d["hardware_id"] == here["hardware_id"]
            d["current"] = d["same_hardware"] and d["software_id"] == here["software_id"]
            out.append(d)
        return out

    def environment(self, fingerprint_id: str) -> dict | None:
        """One recorded environment by id, or None."""
        rows = self._query("SELECT * FROM environments WHERE id = ?", [fingerprint_id])
        return rows[0] if rows else None

    def stale(self, fingerprint: Mapping[str, Any] | str | None = None) -> dict:
        """What the current environment (default: the store's fingerprint) cannot use, and what it
        uses although the software differs.

        Returns {"current": id, "rows": rows not used, "by_fingerprint": [{"fingerprint", "rows",
        "differences": {field: (theirs, current)}}] for rows of other hardware, "by_field": {field:
        rows}, "ops": {op: rows measured with other code of that op (same hardware)},
        "software": [{"fingerprint", "rows", "differences"}] for rows used although their software
        differs}.
        """
        here = self.fingerprint
        if isinstance(fingerprint, str):
            here = self.environment(fingerprint) or {"id": fingerprint, "hardware_id": fingerprint}
        elif fingerprint is not None:
            here = dict(fingerprint)
            here.setdefault("hardware_id", environment.hardware_id(here))
        hw = here.get("hardware_id") or environment.hardware_id(here)
        digests = here.get("ops") if isinstance(here.get("ops"), Mapping) else self.digests
        by_fp, by_field, total = [], {}, 0
        for r in self._query("SELECT fingerprint, COUNT(*) AS n FROM measurements WHERE hardware_id != ? "
                             "GROUP BY fingerprint ORDER BY fingerprint", [hw]):
            other = self.environment(r["fingerprint"]) or {"id": r["fingerprint"]}
            diff = environment.differences(other, here)
            by_fp.append({"fingerprint": r["fingerprint"], "rows": r["n"], "differences": diff})
            for k in diff:
                by_field[k] = by_field.get(k, 0) + r["n"]
            total += r["n"]
        ops: dict[str, int] = {}
        for r in self._query("SELECT op, op_digest, COUNT(*) AS n FROM measurements WHERE hardware_id = ? "
                             "GROUP BY op, op_digest", [hw]):
            if r["op"] in digests and r["op_digest"] != digests[r["op"]]:
                ops[r["op"]] = ops.get(r["op"], 0) + r["n"]
                total += r["n"]
        software = []
        for r in self._query("SELECT fingerprint, COUNT(*) AS n FROM measurements WHERE hardware_id = ? "
                             "AND software_id != ? GROUP BY fingerprint ORDER BY fingerprint",
                             [hw, here.get("software_id") or environment.software_id(here)]):
            other = self.environment(r["fingerprint"]) or {"id": r["fingerprint"]}
            software.append({"fingerprint": r["fingerprint"], "rows": r["n"],
                             "differences": environment.differences(other, here, "software")})
        return {"current": here.get("id"), "rows": total, "by_fingerprint": by_fp, "by_field": by_field,
                "ops": ops, "software": software}

    # -- merging ---------------------------------------------------------------------------------

    def check_rows(self) -> None:
        """StoreError naming the first measurement whose values autofuse would not write (what reads would
        refuse): `merge` checks its inputs with it before writing anything."""
        for r in self._query("SELECT * FROM measurements ORDER BY id"):
            self._decode(r)

    def merge_from(self, other: "Store") -> dict[str, int]:
        """Copy another store's rows into this one without duplicates; returns counts.

        Environments, problems and configs are keyed by id and copied once. A measurement already
        here (same problem, config, environment, mode, source, verdict, latency, time and trial number: the
        same measurement copied twice; two workers of one study that measured one config in the same
        second, at the same latency, are two trials) is skipped (`identical`). Every other measurement is added: two
        real measurements of one config (two hosts, two runs) are both kept, `best` takes the faster
        and `lookup` sees a failure in either. Independent runs name their studies alike (problem,
        mode, hardware, op code) and number trials from 0, so a trial whose (study, trial, mode) is
        taken here by another measurement is added under the study name `<study>#<tag>` (`renamed`;
        tag: a hash of that trial's rows, so merging the same file again adds nothing).
        """
        self._writable()
        other.check_rows()  # rows modified outside autofuse are never copied
        src = other.conn
        envs = [dict(r) for r in src.execute("SELECT * FROM environments")]
        problems = [dict(r) for r in src.execute("SELECT * FROM problems")]
        configs = [dict(r) for r in src.execute("SELECT * FROM configs")]
        rows = [dict(r) for r in src.execute("SELECT * FROM measurements ORDER BY id")]
        ident = ("problem", "config_id", "fingerprint", "mode", "source", "created_at", "median_us", "ok", "trial")
        have = {tuple(r[k] for k in ident) for r in self._query(f"SELECT {', '.join(ident)} FROM measurements")}
        taken = {(r["study"], r["trial"], r["mode"]) for r in self._query(
            "SELECT study, trial, mode FROM measurements WHERE study IS NOT NULL")}
        counts = {"rows": len(rows), "added": 0, "renamed": 0, "identical": 0}
        new, trials = [], {}
        for r in rows:
            key = tuple(r[k] for k in ident)
            if key in have:
                counts["identical"] += 1
                continue
            have.add(key)
            r.pop("id")
            new.append(r)
            if r["study"] is not None:
                trials.setdefault((r["study"], r["trial"]), []).append(r)
        for (study, trial), group in trials.items():
            if not any((study, trial, r["mode"]) in taken for r in group):
                taken.update((study, trial, r["mode"]) for r in group)
                continue
            content = json.dumps(sorted([r[k] for k in ident] for r in group), default=str)
            tag = hashlib.sha256(content.encode()).hexdigest()[:8]
            name = f"{study}#{tag}"
            while any((name, trial, r["mode"]) in taken for r in group):
                name += "+"
            for r in group:
                r["study"] = name
                taken.add((name, trial, r["mode"]))
            counts["renamed"] += len(group)
        with self.conn:
            _insert(self.conn, "environments", envs)
            _insert(self.conn, "problems", problems)
            _insert(self.conn, "configs", configs)
            counts["added"] = _insert(self.conn, "measurements", new, "INSERT")
        return counts


def describe_stale(stale: Mapping[str, Any]) -> str:
    """A few lines for the CLI: rows kept but not used (other hardware, changed op code), and rows
    used although their software differs."""
    lines = []
    if stale["rows"]:
        parts = []
        for fp in stale["by_fingerprint"]:
            diffs = ", ".join(f"{k}: {a!s:.40} -> {b!s:.40}" for k, (a, b) in fp["differences"].items())
            parts.append(f"{fp['rows']} from environment {fp['fingerprint']} ({diffs or 'unknown environment'})")
        for op, n in sorted(stale.get("ops", {}).items()):
            parts.append(f"{n} of {op} measured with older code of {op}")
        lines.append(f"{stale['rows']} measurements were taken on other hardware or with other op code and are "
                     "kept but not used: " + "; ".join(parts))
    for fp in stale.get("software", []):
        diffs = ", ".join(f"{k}: {a!s:.40} -> {b!s:.40}" for k, (a, b) in fp["differences"].items())
        lines.append(f"{fp['rows']} measurements of environment {fp['fingerprint']} were taken with other software "
                     f"({diffs}); they are used, and dispatch confirms its decisions on first use")
    return "\n".join(lines)
