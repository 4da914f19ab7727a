"""The low-latency (data-as-flag) heap all-reduce: kernels/lowlatency.py, one launch, no flag round trip.

    all_reduce(world, rows, cols, dtype, config=None, name="lowlatency") -> AllReduce

Every rank passes a contiguous `rows x cols` partial and gets the sum, summed in float32 in rank
order, bitwise the same on every rank (and the same bits as autofuse.comm.collectives' one-shot
all-reduce). Called as `coll(x, out=None) -> out` (`out` may be `x`): one launch on the current
stream, nothing allocated, CUDA-graph capturable. It moves twice the bytes of the flag protocol
(each 32-bit payload word travels with its epoch), so it is for small messages: at most MAX_BYTES
per rank. The partial's bytes must be a whole number of 32-bit words (an even number of 16-bit
elements).

Configs (plain dicts): COMM_SMS programs (1..64: more programs send and poll in parallel), BLOCK
32-bit words a program moves per step (256..2048), num_warps (4 | 8). Missing keys take the first
default for the size.

Workspace (autofuse.comm.workspace): `name`, its own (the kernel keeps its inbox words' epochs
apart from any flag protocol's data); `workspaces`, `check()` and fault handling as the other
collectives: an unhealthy call leaves NaN in `out` and the host raises on every rank.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from autofuse.comm.workspace import workspace
from autofuse.core.op import Config, InvalidConfig, InvalidInput, SearchSpace
from autofuse.core.sizes import cdiv

if TYPE_CHECKING:
    from autofuse.comm.world import World

KEYS = ("COMM_SMS", "BLOCK", "num_warps")
COMM_SMS = (1, 2, 4, 8, 16, 32, 64)
BLOCKS = (256, 512, 1024, 2048)
WARPS = (4, 8)
MAX_BYTES = 4 << 20
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NAN_WORDS = {torch.bfloat16: 0x7FC07FC0, torch.float16: 0x7E007E00, torch.float32: 0x7FC00000}


def _size(world: World | int) -> int:
    return world if isinstance(world, int) else world.size


def words(rows: int, cols: int, dtype: torch.dtype) -> int:
    """32-bit words of one rank's partial."""
    return rows * cols * dtype.itemsize // 4


def check(world: World | int, rows: int, cols: int, dtype: torch.dtype, config: Config) -> str | None:
    """None, or why `config` cannot run this all-reduce (dtype, size, keys and values)."""
    if dtype not in DTYPES:
        return f"the low-latency all-reduce sums {', '.join(str(d) for d in DTYPES)}, not {dtype}"
    if rows < 1 or cols < 1:
        return f"shape {rows} x {cols} must be positive"
    nbytes = rows * cols * dtype.itemsize
    if nbytes % 4:
        return f"{rows} x {cols} {dtype} is {nbytes} bytes, not a whole number of 32-bit words"
    if nbytes > MAX_BYTES:
        return f"{nbytes} bytes per rank is more than the low-latency all-reduce's {MAX_BYTES} (it moves twice the bytes)"
    if not 1 <= _size(world) <= 8:
        return f"world size {_size(world)} outside 1..8"
    unknown = sorted(set(config) - set(KEYS))
    if unknown:
        return f"unknown config keys {unknown} (takes {', '.join(KEYS)})"
    for key, allowed in (("COMM_SMS", COMM_SMS), ("BLOCK", BLOCKS), ("num_warps", WARPS)):
        if key in config and config[key] not in allowed:
            return f"{key} must be one of {allowed}, got {config[key]!r}"
    return None


def defaults(world: World | int, rows: int, cols: int, dtype: torch.dtype) -> list[Config]:
    """Known-good configs, best guess first: about 1024 words per program, 8 to 32 programs."""
    n = words(rows, cols, dtype)
    sms = min(64, max(1, 1 << max(0, (cdiv(n, 1024) - 1).bit_length())))
    first = {"COMM_SMS": min(max(sms, 8), 32) if n >= 8 * 256 else sms, "BLOCK": 1024 if n > 4096 else 256,
             "num_warps": 4}
    out = [first, {**first, "COMM_SMS": min(64, first["COMM_SMS"] * 2)}, {**first, "COMM_SMS": max(1, first["COMM_SMS"] // 2)}]
    seen: list[Config] = []
    for c in out:
        if c not in seen:
            seen.append(c)
    return seen


def space(trial: SearchSpace, world: World | int, rows: int, cols: int, dtype: torch.dtype) -> Config:
    """A config drawn from the search space (Optuna define-by-run)."""
    return {"COMM_SMS": trial.suggest_categorical("COMM_SMS", list(COMM_SMS)),
            "BLOCK": trial.suggest_categorical("BLOCK", list(BLOCKS)),
            "num_warps": trial.suggest_categorical("num_warps", list(WARPS))}


def resolve(world: World | int, rows: int, cols: int, dtype: torch.dtype, config: Config | None) -> Config:
    """`config` with missing keys from the first default; InvalidConfig if it cannot run."""
    given = dict(config or {})
    why = check(world, rows, cols, dtype, given)
    if why:
        raise InvalidConfig(f"low-latency all_reduce: {why}")
    return {**defaults(world, rows, cols, dtype)[0], **given}


class AllReduce:
    """The low-latency all-reduce of `rows x cols` partials (see the module docstring)."""

    def __init__(self, world: World, rows: int, cols: int, dtype: torch.dtype, config: Config | None = None,
                 name: str = "lowlatency"):
        self.world, self.rows, self.cols, self.dtype, self.name = world, rows, cols, dtype, name
        self.config = resolve(world, rows, cols, dtype, config)
        self.shape = (rows, cols)
        self.device = world.device
        self.words = words(rows, cols, dtype)
        self.programs = max(1, min(self.config["COMM_SMS"], cdiv(self.words, 32)))
        self.piece = cdiv(self.words, self.programs)
        w = world.size
        self.ws = workspace(world, name, w * self.words * 8, w * self.programs)
        self.workspaces = (self.ws,)
        self.inbox = self.ws.data.view(torch.int64)
        self.inbox_half = self.ws.half_bytes // 8

    def _check_x(self, x: torch.Tensor, what: str) -> None:
        if (not isinstance(x, torch.Tensor) or tuple(x.shape) != self.shape or x.dtype != self.dtype
                or x.device != self.device or not x.is_contiguous() or x.data_ptr() % 4):
            got = (f"{tuple(x.shape)} {x.dtype} on {x.device}{'' if x.is_contiguous() else ' (not contiguous)'}"
                   if isinstance(x, torch.Tensor) else type(x).__name__)
            raise InvalidInput(f"low-latency all_reduce: {what} must be a contiguous, 4-byte aligned {self.shape} "
                               f"{self.dtype} tensor on {self.device}, got {got}")

    def _refuse(self, out: torch.Tensor) -> None:
        """Raise WorkspaceAborted after a fault, leaving NaN in `out`."""
        if self.ws.faulty():
            out.fill_(float("nan"))
            self.ws.refuse_if_faulty()

    def check(self, out: torch.Tensor | None = None) -> None:
        """Raise a recorded fault (synchronises), filling `out` with NaN first."""
        try:
            self.ws.check()
        except Exception:
            if out is not None:
                out.fill_(float("nan"))
            raise

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum every rank's `x` into `out` (a new tensor if None; may be `x`) and return it; one launch."""
        self._check_x(x, "x")
        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        else:
            self._check_x(out, "out")
        self._refuse(out)
        self._call(x, out)
        return out

    def _call(self, x: torch.Tensor, out: torch.Tensor) -> None:
        from autofuse.kernels import lowlatency as k

        ws = self.ws
        pairs = self.dtype.itemsize == 2
        k.ll_all_reduce_kernel[(self.programs,)](
            x.view(-1).view(torch.int32), out.view(-1).view(torch.int32), self.inbox, ws.ctx, ws.flags,
            ws.half_flags, self.inbox_half, self.inbox_half, self.words, self.piece, NAN_WORDS[self.dtype],
            PAIRS=pairs, FP16=self.dtype == torch.float16, BLOCK=self.config["BLOCK"],
            num_warps=self.config["num_warps"], num_stages=1)


def all_reduce(world: World, rows: int, cols: int, dtype: torch.dtype, config: Config | None = None,
               name: str = "lowlatency") -> AllReduce:
    """A low-latency all-reduce of `rows x cols` partials on `world` (collective: every rank builds it)."""
    return AllReduce(world, rows, cols, dtype, config, name)
