"""Plans: module paths mapped to styles, applied by swapping a model's linears (in place).

A plan maps module paths to styles: {"layers.*.self_attn.q_proj": "column", ...}; `*` stands for one
path component. "column" becomes ColumnParallelLinear.from_linear, "row" RowParallelLinear.from_linear.
Both `parallelize` (autofuse/nn/parallelize.py) and the Llama-family plan (autofuse/nn/llama.py) apply
plans through this module, so neither imports the other to do so.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from autofuse.nn.linear import ColumnParallelLinear, RowParallelLinear

STYLES = {"column": ColumnParallelLinear, "row": RowParallelLinear}


def matches(pattern: str, path: str) -> bool:
    """Whether module path `path` fits `pattern`, component by component (`*`: any one component)."""
    want, have = pattern.split("."), path.split(".")
    return len(want) == len(have) and all(fnmatchcase(h, w) for w, h in zip(want, have))


def set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    """Replace the submodule at `path` of `root` by `module`."""
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def apply_plan(model: nn.Module, plan: dict[str, str], group: Any = None, sequence_parallel: bool = False) -> None:
    """Swap every nn.Linear that a plan entry names for its style's module (in place)."""
    unknown = {style for style in plan.values() if style not in STYLES}
    if unknown:
        raise ValueError(f"plan styles must be one of {sorted(STYLES)}, got {sorted(map(str, unknown))}")
    paths = [path for path, _ in model.named_modules() if path]
    for pattern, style in plan.items():
        hits = [p for p in paths if matches(pattern, p)]
        if not hits:
            raise ValueError(f"plan entry {pattern!r} matches no module of {type(model).__name__}")
        for path in hits:
            module = model.get_submodule(path)
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                raise ValueError(f"{path} is already tensor-parallel ({type(module).__name__})")
            if not isinstance(module, nn.Linear):
                raise TypeError(f"plan entry {pattern!r}: {path} is a {type(module).__name__}, not an nn.Linear")
            set_submodule(model, path, STYLES[style].from_linear(module, group, sequence_parallel))
