"""Problem: the key of measurements, policies and dispatch caches (op + named sizes + dtype + world
size), the dtypes it names, the two errors every layer raises (InvalidInput, InvalidConfig) and the
canonical text of a config. Runners (autofuse/core/runner.py) and ops (autofuse/core/op.py) both stand
on it; it stands on nothing of theirs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from autofuse.core.keys import parse_key

FP8 = "float8_e4m3fn"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, FP8: torch.float8_e4m3fn}
OUTPUT_DTYPES = {FP8: "bfloat16"}  # FP8 GEMM problems write bfloat16 (the scaled product); others their dtype
SCALINGS = ("tensorwise", "rowwise")  # an FP8 problem's `scaling` dim (torch._scaled_mm's two kinds)
Config = dict[str, Any]


class InvalidConfig(ValueError):
    """A config that cannot run on a problem; the message says why (rejected before launch)."""


class InvalidInput(ValueError):
    """Arguments an op cannot take (shape, dtype, device, layout, world size): says which and why."""


@dataclass(frozen=True)
class Problem:
    """op + sizes + dtype + world size: the key of measurements, policies and dispatch caches.

    FP8 problems (dtype float8_e4m3fn) also carry a `scaling` dim (tensorwise or rowwise): the same
    shapes in bf16 and in each FP8 scaling are different problems to the tuner and the policy."""

    op: str
    dims: tuple[tuple[str, Any], ...]
    dtype: str
    world: int

    @classmethod
    def make(cls, op: str, dtype: str | torch.dtype, world: int, **dims: Any) -> "Problem":
        if isinstance(dtype, torch.dtype):
            dtype = dtype_name(dtype)
        if dtype not in DTYPES:
            raise InvalidInput(f"dtype {dtype!r} not supported: use one of {sorted(DTYPES)}")
        return cls(op, tuple(sorted(dims.items())), dtype, int(world))

    def __getitem__(self, name: str) -> Any:
        for k, v in self.dims:
            if k == name:
                return v
        raise KeyError(f"{self.op} problem has no dimension {name!r}")

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def out_dtype(self) -> torch.dtype:
        """The output's dtype: bfloat16 for FP8 problems, else the input dtype."""
        return DTYPES[OUTPUT_DTYPES.get(self.dtype, self.dtype)]

    @property
    def key(self) -> str:
        """Canonical text form, e.g. 'ag_gemm|K=8192,M=1024,N=3584,gather=rows|bfloat16|w2'."""
        dims = ",".join(f"{k}={v}" for k, v in self.dims)
        return f"{self.op}|{dims}|{self.dtype}|w{self.world}"

    @classmethod
    def from_key(cls, key: str) -> "Problem":
        """The Problem of a full key (`key`'s inverse); InvalidInput for a malformed one."""
        parts = parse_key(key)
        if parts.world is None:
            raise InvalidInput(f"problem key {key!r} has no world part ('|w<N>')")
        return cls.make(parts.op, parts.dtype, parts.world, **parts.dims)

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "dtype": self.dtype, "world": self.world, **dict(self.dims)}

    def __str__(self) -> str:
        return self.key


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise InvalidInput(f"dtype {dtype} not supported: use one of {sorted(DTYPES)}")


def config_key(config: Mapping[str, Any]) -> str:
    """Canonical JSON of a config (sorted keys), the form stored in the database."""
    return json.dumps(dict(config), sort_keys=True, separators=(",", ":"))
