"""The op registry: op name -> the module that defines it (its `OP`).

Adding an op = a kernels module, an op module defining `OP` (with its variants and `args`), its
tests, and one line here; the public entry point `autofuse.<op>`, the tuner, the store, the policy,
the CLI and the benchmarks are generic over this table. Importing this module imports no torch.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autofuse.core.op import Op

MODULES = {
    "ag_gemm": "autofuse.ops.ag_gemm",
    "gemm_rs": "autofuse.ops.gemm_rs",
    "gemm_ar": "autofuse.ops.gemm_ar",
    "flash_decode": "autofuse.ops.flash_decode",
}


def get(name: str) -> "Op":
    """The Op called `name` (its module defines OP)."""
    if name not in MODULES:
        raise KeyError(f"unknown op {name!r}: known ops are {', '.join(names())}")
    return importlib.import_module(MODULES[name]).OP


def names() -> list[str]:
    """Ops whose module is present in this installation, in registry order."""
    return [name for name, mod in MODULES.items() if importlib.util.find_spec(mod) is not None]
