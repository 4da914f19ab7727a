"""Process groups by name: how the custom ops take their group, as torch's symm_mem ops do.

A torch custom op's schema holds tensors and plain values, not process groups, so the ops take
`group_name: str` (the `ProcessGroup.group_name` torch gives every group) and resolve it back.
`name_of` accepts whatever the public API accepts as `group=` (None: the default group, a
ProcessGroup, an autofuse World, or a name already) and remembers the group, so `group_of`
returns the very object the caller used (dispatch caches Worlds per group object).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_groups: dict[str, Any] = {}  # group name -> the ProcessGroup (holding it keeps its id unique)


def name_of(group: Any) -> str:
    """The name of `group` (None: the default group; a ProcessGroup; an autofuse World; a name)."""
    if isinstance(group, str):
        return group
    pg = getattr(group, "group", group) if group is not None and not isinstance(group, dist.ProcessGroup) else group
    if pg is None:
        pg = dist.group.WORLD
        if pg is None:
            raise RuntimeError("torch.distributed is not initialised: autofuse's ops need a process group")
    name = pg.group_name
    if not torch.compiler.is_compiling() and _groups.get(name) is not pg:
        _groups[name] = pg  # never while Dynamo traces: a traced write of a group is a side effect it cannot replay
    return name


def group_of(name: str) -> Any:
    """The ProcessGroup named `name` (the one `name_of` saw, else torch's registry of groups)."""
    pg = _groups.get(name)
    if pg is None:
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _groups[name] = _resolve_process_group(name)
    return pg


def world_size(name: str) -> int:
    """Ranks of the group named `name` (host-side only: safe while tracing with fake tensors)."""
    return dist.get_world_size(group_of(name))
