"""`parallelize`: a model's linears swapped for tensor-parallel ones, by a plan or, for Hugging Face
Llama-family models, by itself.

A plan maps module paths to styles: {"layers.*.self_attn.q_proj": "column", "layers.*.self_attn.o_proj":
"row", ...}; `*` stands for one path component (as in transformers' and torch's plans). "column"
becomes ColumnParallelLinear.from_linear, "row" RowParallelLinear.from_linear, both with the
call's `sequence_parallel`. A plan only swaps modules: with sequence_parallel=True the code around
them must hand each column-parallel layer this rank's rows (`autofuse.nn.functional.scatter_rows`)
and gather the rows where the region ends (`gather_rows`); replicated parameters used inside the
region (norms) need their gradients summed over the group (`all_reduce_grad`). For Llama-family
models `parallelize` does all of that itself (autofuse/nn/llama.py).
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from autofuse.nn.functional import process_group
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


def parallelize(model: nn.Module, group: Any = None, plan: dict[str, str] | None = None,
                sequence_parallel: bool = False) -> nn.Module:
    """Make `model` tensor-parallel over `group` (None: the default group; a ProcessGroup or 1-D
    DeviceMesh), in place, and return it. Every rank of the group calls it with the same model (same
    weights: seed alike or load the same checkpoint); each keeps its shards.

    plan=None: a Hugging Face Llama-family model (Llama, Mistral, Qwen2: q/k/v/o and gate/up/down
    projections), parallelized as autofuse/nn/llama.py describes. Otherwise a plan (module doc).
    """
    group = process_group(group)
    if plan is None:
        from autofuse.nn import llama

        llama.parallelize(model, group, sequence_parallel)
    else:
        apply_plan(model, plan, group, sequence_parallel)
    return model
