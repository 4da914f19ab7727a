"""A plain (non-editable) install carries every subpackage, the kernels, the console script and models."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_plain_install_has_kernels_ops_and_commands(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(ROOT)],
                   check=True, cwd=tmp_path, timeout=240)
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = ("import autofuse, autofuse.kernels.shmem, autofuse.ops, autofuse.commands, autofuse.nn, autofuse.core.registry as r;"
            "import pathlib; p = pathlib.Path(autofuse.kernels.shmem.__file__);"
            f"assert str(p).startswith({str(target)!r}), p; print(r.names())")
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, env=env)
    assert "ag_gemm" in out.stdout and "flash_decode" in out.stdout
    help_out = subprocess.run([str(target / "bin" / "autofuse"), "--help"], check=True, capture_output=True,
                              text=True, timeout=60, cwd=tmp_path, env=env)
    for cmd in ("doctor", "tune", "bench", "fit"):
        assert cmd in help_out.stdout
