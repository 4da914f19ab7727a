"""Environment fingerprint: what a measurement is only valid for (DESIGN.md, Tuning and store).

GPU name and count, link topology, driver, CUDA, torch, Triton and NCCL versions, and a hash of the
kernel sources. Rows and policies whose fingerprint differs from the machine at hand are not used.
"""
from __future__ import annotations

import functools
import hashlib
import json
import platform
import shutil
import subprocess
from pathlib import Path

import torch
import triton

# The fields whose change invalidates a measurement (others are informative only).
KEY_FIELDS = ("device_kind", "gpu_name", "gpu_count", "topology", "driver", "cuda", "torch", "triton",
              "nccl", "kernel_hash")


def kernel_hash() -> str:
    """sha256 (16 hex) over the device code and the op modules that launch it."""
    import autofuse
    import autofuse.kernels

    h = hashlib.sha256()
    roots = [Path(autofuse.kernels.__file__).parent, Path(autofuse.__file__).parent / "ops"]
    for root in roots:
        for f in sorted(root.glob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _nvidia_smi(*args: str) -> str:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return ""
    try:
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def topology_matrix() -> str:
    """`nvidia-smi topo -m` (links between GPUs: NV18, PIX, SYS, ...) or '' where unavailable."""
    return _nvidia_smi("topo", "-m")


def _topology_summary(text: str, count: int) -> str:
    """The GPU x GPU link cells of `nvidia-smi topo -m` as 'NV18,NV18;...' (stable across runs)."""
    rows = []
    for line in text.splitlines():
        cells = line.split()
        if cells and cells[0].startswith("GPU") and cells[0][3:].isdigit():
            rows.append(",".join(cells[1:1 + count]))
    return ";".join(rows)


@functools.lru_cache(maxsize=None)
def fingerprint(device_kind: str | None = None) -> dict:
    """The environment of this process's devices; `id` is a short hash of KEY_FIELDS."""
    if device_kind is None:
        device_kind = "cuda" if torch.cuda.is_available() else "cpu"
    fp: dict = {
        "device_kind": device_kind,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "kernel_hash": kernel_hash(),
    }
    if device_kind == "cuda":
        count = torch.cuda.device_count()
        fp.update(
            gpu_name=torch.cuda.get_device_name(0),
            gpu_count=count,
            topology=_topology_summary(topology_matrix(), count),
            driver=(_nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader").splitlines() or [""])[0],
            cuda=torch.version.cuda or torch.version.hip or "",
            nccl=".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "",
        )
    else:
        fp.update(gpu_name=f"cpu-emulation ({platform.machine()})", gpu_count=0, topology="shm",
                  driver="", cuda="", nccl="")
    fp["id"] = fingerprint_id(fp)
    return fp


def fingerprint_id(fp: dict) -> str:
    """Short stable hash of the fields that must match for a measurement to be reused."""
    key = json.dumps({k: fp.get(k) for k in KEY_FIELDS}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def differences(a: dict, b: dict) -> dict[str, tuple]:
    """{field: (a's value, b's value)} over KEY_FIELDS where two fingerprints disagree."""
    return {k: (a.get(k), b.get(k)) for k in KEY_FIELDS if a.get(k) != b.get(k)}
