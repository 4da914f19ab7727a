"""The test session never reads the user's autofuse folders nor takes their AUTOFUSE_* settings
(conftest.isolate), in the pytest process and in every rank process it spawns: a policy that
`autofuse fit` wrote into $XDG_DATA_HOME, the online store under ~/.cache/autofuse or an exported
AUTOFUSE_VARIANT must not change what a test sees (README order: tune, fit, then the tests)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from autofuse.comm.world import spawn

ROOT = Path(__file__).resolve().parents[1]
# What a user may have exported: each would change dispatch's decisions in a test that does not set it.
USER_SETTINGS = {"AUTOFUSE_VARIANT": "*:push", "AUTOFUSE_MODE": "graph", "AUTOFUSE_ONLINE": "1",
                 "AUTOFUSE_WAIT_TIMEOUT": "1", "AUTOFUSE_CONFIRM_K": "1", "AUTOFUSE_SAVE_GATHERED": "0"}


def _seen(_world=None) -> dict:
    """Where this process's autofuse looks for policies and keeps its online store, and its settings."""
    from autofuse.core import settings
    from autofuse.dispatch import policy_files

    return {"models": [str(d) for d in policy_files.models_dirs()], "online": str(settings.online_db("x")),
            "settings": sorted(k for k in os.environ if k.startswith("AUTOFUSE_"))}


def _outside_user_folders(seen: dict, user: Path) -> list[str]:
    """The paths of `seen` under the user's folders, and the user's settings it still has."""
    bad = [p for p in [*seen["models"], seen["online"]] if Path(p).is_relative_to(user)]
    return bad + [k for k in seen["settings"] if k in USER_SETTINGS or k in ("AUTOFUSE_POLICY", "AUTOFUSE_MODELS_DIR",
                                                                            "AUTOFUSE_ONLINE_DB")]


def test_session_and_its_ranks_see_no_user_folders_or_settings():
    user = Path(os.environ.get("ISOLATION_TEST_USER", Path.home()))
    here = _seen()
    (rank,) = spawn(_seen, 1, device_kind="cpu", timeout_s=120)
    for seen in (here, rank):
        assert not _outside_user_folders(seen, user), seen
        assert not _outside_user_folders(seen, Path.home() / ".cache" / "autofuse"), seen
        assert not _outside_user_folders(seen, Path.home() / ".local" / "share" / "autofuse"), seen


def test_user_policy_folders_and_settings_do_not_reach_the_tests(tmp_path):
    """The test above, run by a user who fitted a policy and exported settings."""
    user = tmp_path / "user"
    (user / "data" / "autofuse" / "models").mkdir(parents=True)
    (user / "data" / "autofuse" / "models" / "mine.json").write_text("{}")
    env = {**os.environ, **USER_SETTINGS, "XDG_DATA_HOME": str(user / "data"), "XDG_CACHE_HOME": str(user / "cache"),
           "AUTOFUSE_POLICY": str(user / "policy.json"), "AUTOFUSE_MODELS_DIR": str(user / "models"),
           "AUTOFUSE_ONLINE_DB": str(user / "online.db"), "ISOLATION_TEST_USER": str(user)}
    test = f"{Path(__file__).name}::test_session_and_its_ranks_see_no_user_folders_or_settings"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=ROOT / "tests",
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_t36_skips_name_the_setting_not_a_developers_path():
    """The compile checks with the GPU machines' Triton 3.6 are skipped, without a side venv, naming the
    setting that enables them (not a developer's /tmp path), and every test takes that one reason."""
    from conftest import t36_python

    path, reason = t36_python({})
    assert "AUTOFUSE_T36_PYTHON" in reason and str(path) not in reason and "/tmp" not in reason, reason
    assert t36_python({"AUTOFUSE_T36_PYTHON": "/nowhere/python"}) == \
        (Path("/nowhere/python"), "AUTOFUSE_T36_PYTHON=/nowhere/python does not exist")
    own = [p.name for p in (ROOT / "tests").glob("test_*.py")
           if p.name != Path(__file__).name and "T36.exists()" in p.read_text()]
    assert own == [], f"skip with conftest.needs_t36: {own}"


def test_readme_lists_the_settings_a_test_run_takes():
    """The README's environment table names every setting the tests take from their caller (conftest keeps
    only those), and says how long the suite runs."""
    from conftest import TEST_SETTINGS

    readme = (ROOT / "README.md").read_text()
    table = [line for line in readme.splitlines() if line.startswith("| `AUTOFUSE_")]
    missing = [name for name in TEST_SETTINGS if not any(line.startswith(f"| `{name}`") for line in table)]
    assert not missing, missing
    assert re.search(r"The whole suite \(`pytest -q`\) takes about \d+-\d+ minutes", readme), "no time for the tests"


def test_workers_only_where_no_gpu_test_can_run(monkeypatch):
    """`-n auto` runs CPU tests in conftest.CPU_WORKERS processes, and a GPU run (`-m gpu`, or CUDA present)
    in this one, since a GPU test's ranks take every GPU."""
    import conftest
    import torch

    class Config:
        def __init__(self, marks: str) -> None:
            self.marks = marks

        def getoption(self, name: str) -> str:
            assert name == "markexpr"
            return self.marks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    auto = conftest.pytest_xdist_auto_num_workers
    assert auto(Config("not sweep")) == auto(Config("not gpu")) == conftest.CPU_WORKERS == 2
    assert auto(Config("gpu")) == auto(Config("gpu and not sweep")) == 0
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert auto(Config("not sweep")) == 0
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert auto(Config("not sweep")) == 0
