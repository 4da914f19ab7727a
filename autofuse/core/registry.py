"""The op registry: op name -> the module that defines it (its `OP`).

Adding an op = a kernels module, an op module defining `OP` (with its variants, `args` and `custom`),
its tests, and one line here; the public entry point `autofuse.<op>`, its torch custom op (autograd,
torch.compile: autofuse/library), the tuner, the store, the policy, the CLI and the benchmarks are
generic over this table. `register` adds an op at run time (tests, plug-ins); what listens to the
table (`on_register`: the custom-op layer) hears of it. Importing this module imports no torch.

`LIBRARY` names the custom-op layer, which stands above dispatch: dispatch loads it by this name
(`library()`) where a call needs it before anything imported it, as it loads op modules by theirs.
"""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from autofuse.core.op import Op

MODULES = {
    "ag_gemm": "autofuse.ops.ag_gemm",
    "gemm_rs": "autofuse.ops.gemm_rs",
    "gemm_ar": "autofuse.ops.gemm_ar",
    "flash_decode": "autofuse.ops.flash_decode",
    "moe_dispatch": "autofuse.ops.moe_dispatch",
    "moe_combine": "autofuse.ops.moe_combine",
}
LIBRARY = "autofuse.library"
_listeners: list[Callable[[str], None]] = []


def get(name: str) -> "Op":
    """The Op called `name` (its module defines OP)."""
    if name not in MODULES:
        raise KeyError(f"unknown op {name!r}: known ops are {', '.join(names())}")
    return importlib.import_module(MODULES[name]).OP


def names() -> list[str]:
    """Ops whose module is present in this installation, in registry order."""
    return [name for name, mod in MODULES.items() if importlib.util.find_spec(mod) is not None]


def register(name: str, module: str) -> None:
    """Add op `name`, defined (its `OP`) by `module`, to the table; every `on_register` listener hears of it."""
    if MODULES.get(name, module) != module:
        raise ValueError(f"op {name!r} is already registered to {MODULES[name]}, not {module}")
    MODULES[name] = module
    for listener in list(_listeners):
        listener(name)


def registered(name: str, module: str) -> "Op":
    """The op `module` defines as `name` (how a registered op arrives in a process that unpickles it,
    `Op.__reduce_ex__`), registering it first where this process has not (an op registered at run time)."""
    if name not in MODULES:
        register(name, module)
    if MODULES[name] != module:
        raise ValueError(f"op {name!r} was sent as defined by {module}, but is registered to {MODULES[name]} here")
    return get(name)


def unregister(name: str) -> None:
    """Take op `name` out of the table (tests undo a `register`)."""
    MODULES.pop(name, None)


def on_register(listener: Callable[[str], None]) -> None:
    """Call `listener(name)` for every op registered from now on."""
    _listeners.append(listener)


def library() -> ModuleType:
    """The custom-op layer (`LIBRARY`), imported on first use: its import defines every op's custom op."""
    return importlib.import_module(LIBRARY)
