"""autofuse: per-call choice between bulk-synchronous and fused multi-GPU Triton kernels.

`autofuse.<op>(...)` for every op in `autofuse.core.registry` (ag_gemm, gemm_rs, gemm_ar, flash_decode),
`explain`, `call`, `rebuild` and `set_policy` are the runtime entry points (`autofuse.dispatch`);
`warmup` and `warmup_problems` make first calls ahead of serving (`autofuse.nn.warmup`, `autofuse.dispatch.warmup`);
`autofuse.parallelize` and `autofuse.nn` make models tensor-parallel on them. They are made on first
use, so `import autofuse` stays cheap: no torch import, no process group, no GPU work, no file or
database I/O.

Without a GPU the kernels run under Triton's interpreter, which Triton reads from TRITON_INTERPRET
when it is first imported: `import autofuse` sets TRITON_INTERPRET=1 when no NVIDIA device is
present and Triton is not imported yet (set TRITON_INTERPRET yourself to decide otherwise).
"""
import os
import sys

from autofuse.core import registry

__version__ = "0.1.0"

_DISPATCH = ("call", "explain", "rebuild", "set_policy")
_WARMUP = ("warmup", "warmup_problems")
__all__ = ["__version__", *registry.MODULES, *_DISPATCH, *_WARMUP, "Policy", "nn", "parallelize"]


def _no_gpu() -> bool:
    return not os.path.exists("/dev/nvidiactl") and not os.path.exists("/dev/kfd")


if "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules and _no_gpu():
    os.environ["TRITON_INTERPRET"] = "1"


def __getattr__(name: str):
    import importlib

    if name in registry.MODULES:
        registry.library()  # the custom ops (autograd, torch.compile) exist before any call is traced
        value = importlib.import_module("autofuse.dispatch").entry_point(name)
    elif name in _DISPATCH:
        value = getattr(importlib.import_module("autofuse.dispatch"), name)
    elif name in _WARMUP:
        module = "autofuse.nn.warmup" if name == "warmup" else "autofuse.dispatch.warmup"  # models: a floor up
        value = getattr(importlib.import_module(module), name)
    elif name == "Policy":
        value = importlib.import_module("autofuse.dispatch.policy").Policy
    elif name == "nn":
        value = importlib.import_module("autofuse.nn")
    elif name == "parallelize":
        value = importlib.import_module("autofuse.nn").parallelize
    else:
        raise AttributeError(f"module 'autofuse' has no attribute {name!r}")
    globals()[name] = value  # later lookups are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
