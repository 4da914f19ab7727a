"""autofuse: per-call choice between bulk-synchronous and fused multi-GPU Triton kernels.

`autofuse.<op>(...)` for every op in `autofuse.core.registry` (ag_gemm, gemm_rs, gemm_ar, flash_decode),
`explain`, `call`, `rebuild` and `set_policy` are the runtime entry points (`autofuse.dispatch`);
`warmup` and `warmup_problems` make first calls ahead of serving (`autofuse.nn.warmup`, `autofuse.dispatch.warmup`);
`autofuse.parallelize` and `autofuse.nn` make models tensor-parallel on them. They are made on first
use, so `import autofuse` stays cheap: no torch import, no process group, no GPU work, no file or
database I/O. This module stands above dispatch and nn (it hands their names out); neither imports it
(autofuse.nn calls the same functions through autofuse/nn/public.py).

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
    # Plain imports, each where its name is first asked for; never `from autofuse import X` here (its
    # fromlist asks this function for X again).
    if name in registry.MODULES:
        from autofuse.dispatch import public

        value = public(name)  # the very functions autofuse.nn calls
    elif name in _DISPATCH:
        import autofuse.dispatch

        value = getattr(autofuse.dispatch, name)
    elif name == "warmup_problems":
        from autofuse.dispatch.warmup import warmup_problems as value
    elif name == "Policy":
        from autofuse.dispatch.policy import Policy as value
    elif name == "nn":
        import autofuse.nn

        value = autofuse.nn
    elif name == "parallelize":
        from autofuse.nn import parallelize as value
    elif name == "warmup":
        from autofuse.nn.warmup import warmup as value
    else:
        raise AttributeError(f"module 'autofuse' has no attribute {name!r}")
    globals()[name] = value  # later lookups are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
