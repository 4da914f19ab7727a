"""Problem keys ('op|K=8192,M=1024,N=3584,gather=rows|bfloat16|w2'): the one parser, torch-free so the
command line can read keys without importing torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KeyParts:
    """A problem key read once, typed: op, dims (ints where numeric), dtype, world (None where the key
    has no world part, as strong scaling's global-size keys 'op|dims|dtype')."""

    op: str
    dims: dict[str, Any]
    dtype: str
    world: int | None


def parse_key(key: str) -> KeyParts:
    """Read 'op|K=8192,M=1024,...|dtype[|wN]' (the one parser of problem keys); ValueError if malformed."""
    parts = key.split("|")
    if len(parts) == 4 and not parts[3]:  # 'op|dims|dtype|': a global-size key written with its separator
        parts = parts[:3]
    if len(parts) not in (3, 4) or not parts[0]:
        raise ValueError(f"not a problem key: {key!r} (expected 'op|dims|dtype|wN')")
    dims: dict[str, Any] = {}
    for item in filter(None, parts[1].split(",")):
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ValueError(f"not a problem key: {key!r} (dimension {item!r} is not name=value)")
        dims[k] = int(v) if v.lstrip("-").isdigit() else v
    world = None
    if len(parts) == 4:
        if not (parts[3].startswith("w") and parts[3][1:].isdigit()):
            raise ValueError(f"not a problem key: {key!r} (world part {parts[3]!r} is not 'w<N>')")
        world = int(parts[3][1:])
    return KeyParts(parts[0], dims, parts[2], world)


