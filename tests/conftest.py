"""Shared test helpers: the session's isolation from the user's folders and settings; ahead-of-time
compilation for Hopper without a GPU."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from divergence import divergent_barriers

ROOT = Path(__file__).resolve().parents[1]

# -- isolation: tests never read the user's folders nor take the user's AUTOFUSE_* settings -------------
# The settings a test run is meant to take from its caller (README: the test section, scripts/gpu_session.sh).
TEST_SETTINGS = ("AUTOFUSE_TEST_WORLD", "AUTOFUSE_TEST_PG_URL", "AUTOFUSE_TEST_PROGRESS", "AUTOFUSE_T36_PYTHON",
                 "AUTOFUSE_RANKS_PER_GPU", "AUTOFUSE_HEAP_SIZE")
# Where the session's user folders live (XDG_DATA_HOME: policies `autofuse fit` wrote; XDG_CACHE_HOME:
# the online store): a fresh folder per session, removed at its end.
SESSION_HOME = Path(tempfile.mkdtemp(prefix="autofuse-tests-"))


def isolate(environ: dict) -> None:
    """Point `environ`'s user data and cache folders into SESSION_HOME and drop every AUTOFUSE_* setting
    but TEST_SETTINGS, so a policy the user fitted, their online store or an exported AUTOFUSE_VARIANT
    cannot change what a test sees (set in os.environ at import: every process the session spawns
    inherits it)."""
    for name in [k for k in environ if k.startswith("AUTOFUSE_") and k not in TEST_SETTINGS]:
        del environ[name]
    for name, sub in (("XDG_DATA_HOME", "data"), ("XDG_CACHE_HOME", "cache")):
        (SESSION_HOME / sub).mkdir(exist_ok=True)
        environ[name] = str(SESSION_HOME / sub)
    environ["AUTOFUSE_RING_MIN_GFLOP"] = "0"  # mm_ring's size floor is a speed rule (its own test): run it small


isolate(os.environ)


def pytest_unconfigure(config) -> None:
    shutil.rmtree(SESSION_HOME, ignore_errors=True)


# -- how many processes run the tests (pyproject's `--numprocesses=auto`; a given `-n N` overrides) -------
CPU_WORKERS = 2  # each test's ranks are processes of their own and a serial run waits on them a third of its
# wall time: 2 workers, a file each at a time (--dist loadfile: a module's shared job runs once), took a
# 2-core host's suite from about 25 to 19 minutes (round 22); more were not tried


def pytest_addoption(parser, pluginmanager) -> None:
    """Where pytest-xdist is missing or disabled (`-p no:xdist`; a GPU machine with only the project's own
    dependencies), pyproject's xdist options are accepted and ignored: the tests run in this process."""
    if not pluginmanager.has_plugin("xdist"):
        parser.addoption("--numprocesses", default=None, help="ignored: pytest-xdist is not installed")
        parser.addoption("--dist", default="no", help="ignored: pytest-xdist is not installed")


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown where xdist is not installed
def pytest_xdist_auto_num_workers(config) -> int:
    """Worker processes for `-n auto`: CPU_WORKERS on a host with that many CPUs, none (this process runs
    every test) where a GPU test may run, since its ranks take every GPU: `-m gpu` or CUDA present."""
    marks = config.getoption("markexpr") or ""
    if re.search(r"(?<!not )\bgpu\b", marks):
        return 0
    import torch

    if torch.cuda.is_available():
        return 0
    return CPU_WORKERS if (os.cpu_count() or 1) >= CPU_WORKERS else 0


def t36_python(environ: dict) -> tuple[Path, str]:
    """The python of a side venv with the GPU machines' Triton (3.6), where a developer has one
    (AUTOFUSE_T36_PYTHON, else /tmp/t36/bin/python), and the reason its checks are skipped without it:
    the setting to give, not a developer's path (CI has only the current Triton)."""
    given = environ.get("AUTOFUSE_T36_PYTHON", "").strip()
    if given:
        return Path(given), f"AUTOFUSE_T36_PYTHON={given} does not exist"
    return Path("/tmp/t36/bin/python"), ("optional: set AUTOFUSE_T36_PYTHON to a python with Triton 3.6 (the GPU "
                                         "machines') to check these kernels with it too")


T36, NO_T36 = t36_python(os.environ)
needs_t36 = pytest.mark.skipif(not T36.exists(), reason=NO_T36)

_COMPILE = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
out = {}
for req in json.loads(sys.argv[1]):
    fn = getattr(importlib.import_module(req["module"]), req["kernel"])
    def typ(v):
        if isinstance(v, dict):  # a named tuple argument, e.g. shmem.DeviceContext
            module, name = v["namedtuple"].split(":")
            return getattr(importlib.import_module(module), name)(*v["types"])
        return tuple(v) if isinstance(v, list) else v
    sig = {k: typ(v) for k, v in req["signature"].items()}
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in req["divisible"]}
    src = ASTSource(fn=fn, signature=sig, constexprs=req["constexprs"], attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": req["num_warps"], "num_stages": req["num_stages"]})
    out[req["name"]] = {"ptx": k.asm["ptx"], "llir": k.asm["llir"], "shared": k.metadata.shared}
sys.stdout.write(json.dumps(out))
"""


# The Triton type of a shmem.DeviceContext argument (rank, world, heap_bases, status, counter, budget, mirror).
CTX = {"namedtuple": "autofuse.kernels.shmem:DeviceContext", "types": ["i32", "i32", "*i64", "*i32", "*i32", "i64", "*i32"]}


def compile_request(module: str, kernel: str, signature: dict[str, str], constexprs: dict | None = None,
                    num_warps: int = 4, num_stages: int = 3, divisible: tuple[str, ...] | list[str] = (),
                    name: str | None = None) -> dict:
    """One kernel to compile: `signature` maps every argument to its Triton type ('*bf16', 'i32',
    'constexpr', ...; a list of types for a tuple argument such as shmem.DeviceContext); `divisible` names the arguments to compile as multiples of 16 (what Triton
    specialises on at a real launch with aligned pointers and sizes; without it, no pipelining)."""
    return {"name": name or kernel, "module": module, "kernel": kernel, "signature": signature,
            "constexprs": constexprs or {}, "num_warps": num_warps, "num_stages": num_stages,
            "divisible": list(divisible)}


# Another Python (Triton 3.6's venv) has no autofuse installed: map the package onto this checkout.
_SHIM = """
import os, sys, types
for _name, _sub in (("autofuse", "autofuse"), ("autofuse.kernels", "kernels")):
    _m = types.ModuleType(_name)
    _m.__path__ = [os.path.join(os.environ["AUTOFUSE_SRC"], _sub)]
    sys.modules[_name] = _m
"""


def start_compile(requests: list[dict], python: str | os.PathLike | None = None) -> subprocess.Popen:
    """Start compiling `requests` for sm_90 in a child process (`python`: another interpreter, e.g. T36)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = _COMPILE
    if python is not None and str(python) != sys.executable:
        env["AUTOFUSE_SRC"] = str(ROOT)
        script = _SHIM + script
    return subprocess.Popen([str(python or sys.executable), "-c", script, json.dumps(requests)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))


def _collect(proc: subprocess.Popen, requests: list[dict], python: str | os.PathLike | None) -> dict[str, dict]:
    """Wait (bounded) for a start_compile child; {name: {'ptx', 'shared'}} or an error naming the kernels."""
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if proc.returncode != 0:
        names = ", ".join(f"{r['module']}.{r['kernel']}" for r in requests)
        raise AssertionError(f"sm_90 compile with {python or sys.executable} failed ({names}):\n{stderr[-4000:]}")
    return json.loads(stdout)


def compile_sm90_many(requests: list[dict], python: str | os.PathLike | None = None) -> dict[str, dict]:
    """Compile every request for sm_90 (Hopper) in one child process; {name: {'ptx', 'shared'}}.

    Catches what the interpreter cannot (pointer-cast types, unsupported ops, shared-memory size).
    The child runs without TRITON_INTERPRET, since @triton.jit reads it at import. `python` runs the
    compile under another interpreter (T36: the GPU machines' Triton 3.6).
    """
    return _collect(start_compile(requests, python), requests, python)


# Parametrize a compile check over this venv's Triton and, where a developer has it, the GPU machines' 3.6.
VERSIONS = ["current", pytest.param("3.6", marks=needs_t36)]


def compile_sm90_versions(requests: list[dict]) -> dict[str, dict[str, dict]]:
    """{version: {name: {'ptx', 'shared'}}} for every entry of VERSIONS that exists here, compiled in
    parallel child processes."""
    pythons = {"current": None, **({"3.6": T36} if T36.exists() else {})}
    procs = {version: start_compile(requests, python) for version, python in pythons.items()}
    return {version: _collect(proc, requests, pythons[version]) for version, proc in procs.items()}


def compile_table(module: str, kernel: str, base: dict, signature: dict[str, str], table: dict,
                  divisible: tuple[str, ...] | list[str]) -> dict[str, dict[str, dict]]:
    """Compile each row of `table` ({name: (constexpr changes over `base`, inbox dtype, num_warps)}) for
    sm_90, one child process per Triton of VERSIONS found here; the `inbox` argument takes the row's
    dtype. A row whose changes set B_T (FP8: float8_e4m3fn a and b, b stored N x K, bf16 out) gets
    that signature: a and b '*fp8e4nv', stride_bk the constexpr 1 and stride_bn a (divisible) i32.
    {version: {name: {'ptx', 'llir', 'shared'}}}."""
    reqs = []
    for name, (changes, inbox, warps) in table.items():
        consts = {**base, **changes}
        sig, div = dict(signature), list(divisible)
        if consts.get("B_T"):
            sig.update(a="*fp8e4nv", b="*fp8e4nv", stride_bk="i32", stride_bn="i32")
            consts.pop("stride_bn", None)
            consts["stride_bk"] = 1
            div = [d for d in div if d != "stride_bk"] + ["stride_bn"]
        sig.update({"inbox": f"*{inbox}", **{k: "constexpr" for k in consts}})
        reqs.append(compile_request(module, kernel, sig, consts, warps, consts["NUM_STAGES"], div, name))
    return compile_sm90_versions(reqs)


def assert_pipelined_gemm(ptx: str, shared: int, consts: dict, smem_limit: int) -> None:
    """What every GEMM-core kernel must compile to on sm_90: wgmma, TMA (or cp.async) loads pipelined in
    NUM_STAGES shared buffers that fit, no register spills, waits polled and bounded, abort on timeout."""
    assert "wgmma.mma_async" in ptx, "the GEMM does not use Hopper's wgmma"
    if consts["USE_TMA"]:
        assert "cp.async.bulk.tensor.2d" in ptx and "mbarrier.try_wait" in ptx, "no TMA loads"
    else:
        assert "cp.async.commit_group" in ptx and "cp.async.bulk.tensor" not in ptx
    elem = 1 if consts.get("B_T") else 2  # B_T rows are FP8 (compile_table)
    stages = consts["NUM_STAGES"] * (consts["BLOCK_M"] + consts["BLOCK_N"]) * consts["BLOCK_K"] * elem
    assert stages <= shared <= smem_limit, "the K loop is not pipelined in NUM_STAGES buffers"
    assert "ld.local" not in ptx and "st.local" not in ptx, "registers spill"
    assert "ld.volatile.global" in ptx and "%globaltimer" in ptx, "waits must poll and be bounded in time"
    assert "atom.global.release.sys.cas.b32" in ptx, "a timed-out wait must abort the peers"


def assert_uniform(kernel: dict, name: str = "") -> None:
    """No barrier of a compiled kernel ({'llir', ...}) lies where a per-thread branch lets some threads of a
    program skip or repeat it (tests/divergence.py): fault decisions are the program's, not a thread's."""
    bad = divergent_barriers(kernel["llir"])
    assert not bad, f"{name}: barriers inside per-thread branches (a program can split and hang): {bad[:4]}"


def compile_sm90(module: str, kernel: str, signature: dict[str, str], constexprs: dict | None = None,
                 num_warps: int = 4, num_stages: int = 3, divisible: tuple[str, ...] = ()) -> dict:
    """Compile one kernel for sm_90; returns {'ptx', 'shared'} (see compile_request)."""
    req = compile_request(module, kernel, signature, constexprs, num_warps, num_stages, divisible)
    return compile_sm90_many([req])[req["name"]]


def ptxas_spills(python: str | os.PathLike, ptx: str, workdir: Path) -> str:
    """Assemble `ptx` for sm_90a with the ptxas of `python`'s Triton; returns ptxas's -v report
    (raises AssertionError if it fails). The GPU machines' Triton is 3.6: pass T36."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter needs numpy there
    out = subprocess.run([str(python), "-c", "import triton, pathlib; print(pathlib.Path(triton.__file__).parent)"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, f"{python} cannot import triton: {out.stderr[-1000:]}"
    ptxas = Path(out.stdout.strip()) / "backends" / "nvidia" / "bin" / "ptxas"
    (workdir / "k.ptx").write_text(ptx)
    proc = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(workdir / "k.ptx"), "-o", str(workdir / "k.cubin")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


def assert_spills_within(kernels: dict[str, dict], known: dict[str, int], workdir: Path) -> None:
    """Triton 3.6's ptxas (T36) assembles each of `kernels` ({name: {'ptx', ...}}, as the compile
    helpers return them) with no more spill-store bytes than `known` records for it, and a kernel
    `known` does not name with no spill stores and no stack frame at all."""
    for name, k in kernels.items():
        report = ptxas_spills(T36, k["ptx"], workdir)
        stores = int(re.search(r"(\d+) bytes spill stores", report).group(1))
        assert stores <= known.get(name, 0), (name, report)
        if name not in known:
            assert "0 bytes stack frame" in report, (name, report)
