"""Find a PostgreSQL server for the multi-worker tuning test, or say clearly why there is none.

AUTOFUSE_TEST_PG_URL (set by CI from .ci/postgres.sh, or by you) wins, and that server is left alone.
Without it, `.ci/postgres.sh` (installs disabled: only where PostgreSQL is already installed) starts a
private server for this test session, in a temporary folder on a free port, and it is stopped and
deleted when the session ends (atexit), so `pytest` never leaves a server running.
"""
from __future__ import annotations

import atexit
import os
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "postgres.sh"
_started: dict[str, str] = {}


def _libpq(url: str) -> str:
    """SQLAlchemy URL -> libpq URL ('postgresql+psycopg2://' -> 'postgresql://')."""
    scheme, rest = url.split("://", 1)
    return f"{scheme.split('+')[0]}://{rest}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(env: dict[str, str]) -> None:
    """Stop the session's private server and delete its folder (bounded; errors are only reported)."""
    try:
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, text=True, timeout=90,
                       env={**env, "AUTOFUSE_PG_REMOVE": "1"})
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"tests/pg.py: could not stop the test PostgreSQL in {env['AUTOFUSE_PG_DIR']}: {exc}")


def _start_private() -> tuple[str | None, str]:
    """A server of this session's own (the same one for every test that asks)."""
    if "url" in _started:
        return _started["url"], ""
    if not SCRIPT.exists():
        return None, f"{SCRIPT} is missing"
    folder = tempfile.mkdtemp(prefix="autofuse-pg-")
    state = Path(folder) / "state"
    env = {**os.environ, "AUTOFUSE_PG_NO_INSTALL": "1", "AUTOFUSE_PG_DIR": folder,
           "AUTOFUSE_PG_PORT": str(_free_port()), "AUTOFUSE_PG_STATE_FILE": str(state)}
    try:
        proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        proc = None
    if state.exists() and state.read_text().strip() == "started":
        atexit.register(_stop, env)
    elif proc is None or proc.returncode != 0:
        subprocess.run(["rm", "-rf", folder], check=False, timeout=60)
    if proc is None:
        return None, ".ci/postgres.sh did not finish in 120 s"
    if proc.returncode != 0 or not proc.stdout.strip():
        return None, f".ci/postgres.sh failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}"
    _started["url"] = proc.stdout.strip().splitlines()[-1]
    return _started["url"], ""


def pg_url() -> str:
    """A reachable PostgreSQL URL for Optuna, or pytest.skip with the reason."""
    url = os.environ.get("AUTOFUSE_TEST_PG_URL", "").strip()
    if not url:
        url, why = _start_private()
        if url is None:
            pytest.skip(f"no PostgreSQL: AUTOFUSE_TEST_PG_URL is unset and no local server could be started ({why}); "
                        "run `bash .ci/postgres.sh` as root and export the URL it prints")
    try:
        import psycopg2
    except ImportError:
        pytest.skip("PostgreSQL driver missing: pip install psycopg2-binary (the 'postgres' extra of autofuse)")
    try:
        psycopg2.connect(_libpq(url), connect_timeout=10).close()
    except psycopg2.OperationalError as exc:
        if os.environ.get("AUTOFUSE_TEST_PG_URL"):
            pytest.fail(f"AUTOFUSE_TEST_PG_URL={url} is set but the server does not answer: {exc}")
        pytest.skip(f"PostgreSQL at {url} does not answer: {exc}")
    return url
