"""Read-only access to the tuning store for `show`, `export` and `fit`.

Uses the store's own API, `Store.open(path, readonly=True)`, `Store.modes()` and `StoreError`
(autofuse/store.py). Until that API is part of this tree, `_ReadOnlyStore` stands in for it with the
same behaviour: it never creates or converts anything, and anything that is not an autofuse
database is a `StoreError` of one line naming the path and the cause.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path
from urllib.parse import quote

import autofuse.store as _store

Store = _store.Store
StoreError: type[Exception] = getattr(_store, "StoreError", None) or type(
    "StoreError", (RuntimeError,), {"__doc__": "The tuning database cannot be used (one line: path and cause)."})
_NATIVE = hasattr(Store, "open") and hasattr(Store, "modes") and hasattr(_store, "StoreError")


class _ReadOnlyStore(Store):
    """Stand-in for Store.open(path, readonly=True) (remove once autofuse.store provides it)."""

    def __init__(self, path: str | Path):  # noqa: D107 - deliberately skips Store.__init__ (it writes)
        import sqlite_utils

        self.path = Path(path)
        if not self.path.exists():
            raise StoreError(f"{self.path}: no such file")
        if self.path.is_dir():
            raise StoreError(f"{self.path}: is a directory, not a database file")
        try:
            conn = sqlite3.connect(readonly_uri(self.path), uri=True, timeout=10)
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot be read as SQLite ({exc})") from None
        missing = sorted({"measurements", "environments"} - tables)
        if missing:
            conn.close()
            raise StoreError(f"{self.path}: not an autofuse tuning database (no {' or '.join(missing)} table)")
        self.db = sqlite_utils.Database(conn)

    def modes(self) -> list[str]:
        return [r["mode"] for r in self.db.query("SELECT DISTINCT mode FROM measurements ORDER BY mode")]


def readonly_uri(path: Path) -> str:
    """SQLite URI that reads `path` without writing anything beside it.

    A WAL-mode database read with mode=ro still creates (and leaves) empty -wal and -shm files; when
    no -wal file exists (nobody is writing, everything is in the main file) it is opened immutable,
    which needs neither.
    """
    uri = f"file:{quote(str(path.absolute()))}?mode=ro"
    try:
        with open(path, "rb") as f:
            header = f.read(20)
    except OSError:
        return uri
    wal = len(header) == 20 and header[:16] == b"SQLite format 3\x00" and header[18] == 2
    if wal and not Path(f"{path}-wal").exists():
        uri += "&immutable=1"
    return uri


def open_readonly(path: str | Path) -> Store:
    """The database at `path`, read-only; StoreError (one line) if it cannot be used."""
    if _NATIVE:
        return Store.open(path, readonly=True)
    return _ReadOnlyStore(path)


def query_errors() -> tuple[type[Exception], ...]:
    """Errors a read on an opened store may raise for a damaged file (caught and shown as one line)."""
    return (StoreError, sqlite3.Error)
