"""A release install (the built wheel, not `-e`) carries every package and trains and compiles.

The wheel is built once from a copy of the source files (a stale `build/` of the checkout cannot
fill in a package the packaging leaves out) and checked against the source tree: every folder with
an __init__.py under autofuse/ and kernels/ (shipped as autofuse.kernels) and every module in them,
and the shipped models/*.json. It is then installed with --no-deps into a fresh virtualenv that
sees this test venv's site-packages through a .pth line (torch and the rest are not reinstalled;
the line adds the folder without running its .pth files, so an editable autofuse there stays out),
where a gradient and a torch.compile'd call run on one gloo rank and the console script answers.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_ROOTS = {"autofuse": "autofuse", "kernels": "autofuse/kernels"}  # source folder -> where it installs
# What a wheel build does not read: left out of the copy it is built from.
NOT_BUILD_INPUTS = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "autofuse-out", ".whl",
                    "docs", "tests", "tuning_db", "scripts", "examples")


def _setuptools_builds_wheels() -> bool:
    """Whether this venv's setuptools builds wheels itself (>= 70.1), so the build needs no download."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    import setuptools

    return tuple(int(p) for p in setuptools.__version__.split(".")[:2]) >= (70, 1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel .` builds from a clean copy of the sources."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, out = tmp / "src", tmp / "dist"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_BUILD_INPUTS))
    isolation = ["--no-build-isolation"] if _setuptools_builds_wheels() else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(out), str(src)],
                   check=True, cwd=tmp, timeout=240)
    (built,) = out.glob("autofuse-*.whl")
    return built


def _source_modules() -> set[str]:
    """Every .py file of every folder with an __init__.py under autofuse/ and kernels/, as the wheel names it."""
    names = set()
    for folder, installed in PACKAGE_ROOTS.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                names |= {f"{installed}/{m.relative_to(base).as_posix()}" for m in init.parent.glob("*.py")}
    return names


def test_wheel_holds_every_package_and_the_models(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = _source_modules()
    assert "autofuse/library/__init__.py" in expected and "autofuse/kernels/shmem.py" in expected
    missing = sorted(expected - names)
    assert not missing, f"{wheel.name} lacks {missing}"
    models = {p.name for p in (ROOT / "models").glob("*.json")}
    shipped = {Path(n).name for n in names if "/data/share/autofuse/models/" in n}
    assert models and models <= shipped, models - shipped
    assert not any(n.startswith(("kernels/", "tests/")) for n in names), "a top-level kernels or tests package"


_RUN = r"""
import os, pathlib, sys
import torch, torch.distributed as dist
import autofuse, autofuse.library, autofuse.kernels.shmem
for m in (autofuse, autofuse.library, autofuse.kernels.shmem):
    assert pathlib.Path(m.__file__).resolve().is_relative_to(pathlib.Path(sys.prefix).resolve()), m.__file__
dist.init_process_group("gloo", init_method=pathlib.Path(sys.argv[1]).as_uri(), rank=0, world_size=1)
torch.manual_seed(0)
a = torch.randn(16, 32, requires_grad=True)
b = torch.randn(32, 16, requires_grad=True)
autofuse.ag_gemm(a, b).square().sum().backward()
assert torch.allclose(a.grad, 2 * (a @ b) @ b.t(), atol=1e-4), "wrong gradient"
assert torch.allclose(b.grad, 2 * a.t() @ (a @ b), atol=1e-4), "wrong gradient"
fn = torch.compile(lambda x, w: autofuse.ag_gemm(x, w), fullgraph=True, backend="aot_eager")
x = torch.randn(16, 32)
assert torch.allclose(fn(x, b.detach()), x @ b.detach(), atol=1e-4), "wrong compiled result"
dist.destroy_process_group()
print("trained and compiled")
"""


def _site_dirs() -> list[str]:
    """This interpreter's site-packages folders (torch, triton, ... for the fresh venv to see)."""
    dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    dirs |= {p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")}
    return sorted(d for d in dirs if Path(d).is_dir())


@pytest.mark.timeout(420)
def test_wheel_install_trains_and_compiles(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    Path(purelib, "test-venv.pth").write_text("".join(f"{d}\n" for d in _site_dirs()))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, cwd=tmp_path, timeout=240)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    out = subprocess.run([str(python), "-c", _RUN, str(tmp_path / "store")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "trained and compiled" in out.stdout
    help_out = subprocess.run([str(venv / "bin" / "autofuse"), "--help"], check=True, capture_output=True,
                              text=True, timeout=60, cwd=tmp_path, env=env)
    for cmd in ("doctor", "tune", "bench", "fit"):
        assert cmd in help_out.stdout
