"""Find a PostgreSQL server for the multi-worker tuning test, or say clearly why there is none.

AUTOFUSE_TEST_PG_URL (set by CI from .ci/postgres.sh) wins; without it, `.ci/postgres.sh` is tried
with installs disabled (it starts a server only where PostgreSQL is already installed).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _libpq(url: str) -> str:
    """SQLAlchemy URL -> libpq URL ('postgresql+psycopg2://' -> 'postgresql://')."""
    scheme, rest = url.split("://", 1)
    return f"{scheme.split('+')[0]}://{rest}"


def _start_local() -> tuple[str | None, str]:
    script = ROOT / ".ci" / "postgres.sh"
    if not script.exists():
        return None, f"{script} is missing"
    try:
        proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "AUTOFUSE_PG_NO_INSTALL": "1"})
    except subprocess.TimeoutExpired:
        return None, ".ci/postgres.sh did not finish in 120 s"
    if proc.returncode != 0 or not proc.stdout.strip():
        return None, f".ci/postgres.sh failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}"
    return proc.stdout.strip().splitlines()[-1], ""


def pg_url() -> str:
    """A reachable PostgreSQL URL for Optuna, or pytest.skip with the reason."""
    url = os.environ.get("AUTOFUSE_TEST_PG_URL", "").strip()
    if not url:
        url, why = _start_local()
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
