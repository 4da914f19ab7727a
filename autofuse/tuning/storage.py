"""Optuna's storage for the tuner: URLs, opening with heartbeats, a write check, and worker liveness.

Studies live in an Optuna RDB storage: by default an SQLite file beside the measurement database
(`autofuse-out/autofuse.db` -> `autofuse-out/autofuse.optuna.db`), or any Optuna RDB URL (PostgreSQL for
several tuning hosts on one study). Each trial records the worker that runs it (host, pid, process
start time) and a heartbeat, so a resumed run can tell a dead worker's trial on its own host at once,
and Optuna fails the trials of dead workers on other hosts after the grace period.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import threading
import time
import warnings
from pathlib import Path

import optuna

HEARTBEAT_S = 20
GRACE_S = 120


def default_storage(db: str | Path) -> str:
    """Optuna's SQLite file beside the database: `autofuse-out/autofuse.db` -> `autofuse-out/autofuse.optuna.db`."""
    db = Path(db).absolute()
    return f"sqlite:///{db.with_name(db.stem + '.optuna.db')}"


def storage_url(url: str) -> str:
    """'postgresql://' names SQLAlchemy's default driver (psycopg 3 in SQLAlchemy 2.1, psycopg2
    before): pick whichever of the two is installed, psycopg2 being the 'postgres' extra."""
    if not url.startswith(("postgresql://", "postgres://")):
        return url
    rest = url.split("://", 1)[1]
    for module, driver in (("psycopg2", "psycopg2"), ("psycopg", "psycopg")):
        if importlib.util.find_spec(module) is not None:
            return f"postgresql+{driver}://{rest}"
    raise RuntimeError(f"storage {url} needs a PostgreSQL driver: pip install psycopg2-binary (autofuse[postgres])")


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """An Optuna RDB storage with heartbeats: trials of dead workers on other hosts are failed after
    GRACE_S, and the study driver queues their configs again (no retry callback: Optuna's would
    leave WAITING copies behind when the budget is already spent)."""
    url = storage_url(url)
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    last: Exception | None = None
    for attempt in range(5):  # several workers creating the schema at once may collide
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=HEARTBEAT_S,
                                                  grace_period=GRACE_S)
        except Exception as exc:  # noqa: BLE001 - retried, then re-raised
            last = exc
            time.sleep(0.5 + attempt)
    raise RuntimeError(f"cannot open Optuna storage {url}: {last}") from last


def check_writable(storage: optuna.storages.RDBStorage) -> None:
    """Create and delete a scratch study: raises if the storage cannot be written (before any measuring)."""
    name = f"autofuse-write-check-{socket.gethostname()}-{os.getpid()}"
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not "A new study created" for a scratch study
    try:
        study_id = storage.create_new_study(directions=[optuna.study.StudyDirection.MINIMIZE], study_name=name)
        storage.delete_study(study_id)
    finally:
        optuna.logging.set_verbosity(verbosity)


def process_start(pid: int) -> str:
    """The kernel's start time of a process (ticks since boot), '' where unknown: tells a reused pid apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def this_worker() -> dict:
    """Who runs a trial: host, pid and process start time (recorded on each trial)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid())}


def alive(worker: dict) -> bool:
    """Whether the process that ran a trial is still running (only answerable on its own host)."""
    pid = int(worker.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    start = worker.get("start", "")
    return not start or process_start(pid) in ("", start)


class Heartbeat:
    """Records a trial's heartbeat while it runs, so other hosts can tell a dead worker's trials."""

    def __init__(self, storage: optuna.storages.RDBStorage, trial_id: int):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(storage, trial_id), daemon=True,
                                        name="autofuse-heartbeat")
        self._thread.start()

    def _beat(self, storage: optuna.storages.RDBStorage, trial_id: int) -> None:
        while True:
            try:
                storage.record_heartbeat(trial_id)
            except Exception:  # noqa: BLE001 - a missed beat only delays failure detection
                pass
            if self._stop.wait(HEARTBEAT_S):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
