"""Collectives on the symmetric heap, built to sit beside vendor kernels (torch.matmul) in the hybrids.

Three builders, each returning a collective object bound to one shape, dtype and config:

    all_gather(world, rows, cols, dtype, config=None, dim=0, name="collectives") -> AllGather
        every rank passes its `rows x cols` shard; dim=0 returns the W*rows x cols concatenation
        (rank order), dim=1 the rows x W*cols one (the K-gather form of ag_gemm).
    reduce_scatter(world, rows, cols, dtype, config=None, name="collectives") -> ReduceScatter
        every rank passes a `rows x cols` partial (rows % W == 0); rank r gets rows
        [r*rows/W, (r+1)*rows/W) of the sum, summed in float32 in rank order.
    all_reduce(world, rows, cols, dtype, config=None, name="collectives") -> AllReduce
        every rank passes a `rows x cols` partial and gets the sum, bitwise the same on every rank.

A collective object is called as `coll(x, out=None) -> out`: one launch on the current stream (the
copy-engine path: two flag kernels around the copies), nothing allocated, CUDA-graph capturable.
`x` must be contiguous, of the built shape, dtype and device. It exposes `workspaces` (for the
Runner's fault checks: `Runner(..., workspaces=coll.workspaces)`), `check()` (raise a recorded
fault; synchronises) and what overlap needs:

- AllGather.buffer: the fixed gathered buffer on the heap. `coll(x)` with out=None returns it;
  it stays valid until the next call of a collective built with the same `name` (like NCCL's
  output, reuse it at once, e.g. as torch.matmul's input). With `out`, ALGO inbox/pull write
  straight into it; push and the copy engine write the buffer and copy it into `out`.
- AllGather.start(x) + AllGather.wait(i) for i in range(len(chunks)): the gather in `chunks`
  (Chunk(owner, index, start, stop): rows [start, stop) of `owner`'s shard), each awaited by a
  tiny device kernel on the stream that calls `wait` (e.g. the matmul's), so the matmul of
  chunk i starts as soon as it arrived. Every chunk must be awaited, in order, exactly once per
  `start` (the last wait closes the call).
- ReduceScatter.chunks / push(x, i) / reduce(x, out): the reduce-scatter in launches: `push`
  sends chunk i (owner's rows [start, stop) of x) once the caller's matmul has written them
  (chunks of other owners come first; pushing one of my own chunks launches nothing), `reduce`
  sums my rows. Launch them all on one stream, in order, one `reduce` per call.

Configs (plain dicts; `space`, `defaults` and `check` take the kind "all_gather" |
"reduce_scatter" | "all_reduce", the world size, rows, cols, dtype and dim):
    ENGINE    "sm" (Triton programs move the data) | "ce" (copy engine: copies of peer-mapped heap
              tensors between two flag kernels; all_gather dim=0, reduce_scatter, one-shot all_reduce)
    ALGO      all_gather: "push" | "inbox" | "pull"; all_reduce: "one_shot" | "two_shot"
              (kernels/collectives.py explains each and its estimated cost)
    COMM_SMS  programs of the launch (1..128): few for latency, many for bandwidth
    BLOCK     elements one program moves per step (1024..16384); num_warps 4 | 8 | 16
    CHUNKS    row chunks per shard (1..8; absent: 1): flags per chunk, so a program pipelines its
              chunks (sends chunk j while it copies or sums chunk j - 1), and overlap waits per chunk
Missing keys take the first default for the shape, so `config=None` is a sensible choice.

Workspaces (autofuse.comm.workspace): `name` for the parity inboxes and flags (shared by every
collective built with that name: one epoch, exact flags, so calls of different collectives may
interleave), `name + ".fixed"` for the fixed buffers (all_gather's gathered buffer, the copy
engine's inboxes). Every rank must build and call collectives in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from autofuse.core.op import FP8, Config, InvalidConfig, InvalidInput, SearchSpace, dtype_name
from autofuse.core.sizes import cdiv, next_pow2
from autofuse.comm.workspace import Workspace, workspace

if TYPE_CHECKING:
    from autofuse.comm.world import World

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
ENGINES = ("sm", "ce")
AG_ALGOS = ("push", "inbox", "pull")
AR_ALGOS = ("one_shot", "two_shot")
COMM_SMS = (1, 2, 4, 8, 16, 32, 64, 128)
BLOCKS = (1024, 2048, 4096, 8192, 16384)
WARPS = (4, 8, 16)
MAX_CHUNKS = 8
CHUNK_SPACE = (1, 2, 4)  # CHUNKS the plain collectives' space offers (pipelining inside one launch)
MAX_WORLD = 8
MIN_WIDTH = 256  # elements: a contiguous row is split into rows no narrower than this
KEYS = {"all_gather": ("ENGINE", "ALGO", "COMM_SMS", "BLOCK", "num_warps", "CHUNKS"),
        "reduce_scatter": ("ENGINE", "COMM_SMS", "BLOCK", "num_warps", "CHUNKS"),
        "all_reduce": ("ENGINE", "ALGO", "COMM_SMS", "BLOCK", "num_warps", "CHUNKS")}
_AG_ALGO = {"push": 0, "inbox": 1, "pull": 2}
_CE_READY, _CE_DONE = 3, 4
_RS, _AR_ONE, _AR_TWO = 0, 1, 2
_SEND_NONE, _SEND_DATA, _SEND_FLAGS = 0, 1, 2
_FLAG_KINDS, _FLAG_BASE = 4, 16


@dataclass(frozen=True)
class Chunk:
    """Rows [start, stop) of rank `owner`'s rows, the `index`-th chunk of them. all_gather: `owner`'s
    shard, which it sends (the chunk comes from `owner`); reduce_scatter: the rows of the partial that
    `owner` sums (the chunk goes to `owner`)."""

    owner: int
    index: int
    start: int
    stop: int


# ---------------------------------------------------------------------------------------------
# configs
def _size(world: World) -> int:
    return world if isinstance(world, int) else world.size


def message_bytes(kind: str, rows: int, cols: int, dtype: torch.dtype) -> int:
    """Bytes each rank contributes: its shard (all_gather) or its partial (reduce_scatter, all_reduce)."""
    return rows * cols * dtype.itemsize


def _ce_allowed(kind: str, dim: int, config: Config) -> bool:
    if kind == "all_gather":
        return dim == 0
    if kind == "all_reduce":
        return config.get("ALGO", "one_shot") == "one_shot"
    return True


def space(kind: str, trial: SearchSpace, world: World, rows: int, cols: int, dtype: torch.dtype,
          dim: int = 0, engines: Sequence[str] = ENGINES, chunks: bool = True) -> Config:
    """Draw a config of collective `kind` from its search space (Optuna define-by-run).

    The copy engine is offered where it can run and `engines` has it; ALGO only with the SM engine
    (all_gather) and before ENGINE (all_reduce: the copy engine only for one_shot). Sizes:
    COMM_SMS (COMM_SMS_CE, 1-4 flag programs, for the copy engine), BLOCK, num_warps, and CHUNKS
    (1, 2, 4) unless `chunks` is False (the overlap variants draw their own).
    """
    cfg: Config = {}
    if kind == "all_reduce":
        cfg["ALGO"] = trial.suggest_categorical("ALGO", list(AR_ALGOS))
    if "ce" in engines and _ce_allowed(kind, dim, cfg):
        cfg["ENGINE"] = trial.suggest_categorical("ENGINE", list(ENGINES))
    else:
        cfg["ENGINE"] = "sm"
    if kind == "all_gather" and cfg["ENGINE"] == "sm":
        cfg["ALGO"] = trial.suggest_categorical("ALGO", list(AG_ALGOS))
    if cfg["ENGINE"] == "ce":
        cfg["COMM_SMS"] = trial.suggest_categorical("COMM_SMS_CE", [1, 2, 4])
    else:
        cfg["COMM_SMS"] = trial.suggest_categorical("COMM_SMS", list(COMM_SMS))
    cfg["BLOCK"] = trial.suggest_categorical("BLOCK", list(BLOCKS))
    cfg["num_warps"] = trial.suggest_categorical("num_warps", list(WARPS))
    if chunks and cfg["ENGINE"] == "sm":
        cfg["CHUNKS"] = trial.suggest_categorical("CHUNKS", list(CHUNK_SPACE))
    return cfg


def defaults(kind: str, world: World, rows: int, cols: int, dtype: torch.dtype, dim: int = 0) -> list[Config]:
    """Known-good configs, best guess first, chosen by the message size per rank and the world size.

    Small messages (<= 256 KB): few programs, latency-bound (inbox / one-shot: one flag hop).
    Medium (<= 4 MB): 16-32 programs. Large: 64 programs, direct pushes, and the copy engine.
    """
    w = _size(world)
    nbytes = message_bytes(kind, rows, cols, dtype)
    small, large = nbytes <= 256 << 10, nbytes > 4 << 20
    sms = 4 if nbytes <= 32 << 10 else 8 if small else 32 if not large else 64
    block = 2048 if nbytes <= 32 << 10 else 4096 if small else 8192
    warps = 4 if nbytes <= 32 << 10 else 8
    base = {"COMM_SMS": sms, "BLOCK": block, "num_warps": warps, **({"CHUNKS": 4} if large else {})}
    ce = {"ENGINE": "ce", "COMM_SMS": 1, "BLOCK": 4096, "num_warps": 4}
    if kind == "all_gather":
        order = ("push", "inbox", "pull") if large else ("inbox", "push", "pull")
        out = [{"ENGINE": "sm", "ALGO": a, **base} for a in order]
        if large and dim == 0:
            out.insert(1, dict(ce, ALGO="push"))
        return [_complete(kind, c) for c in out]
    if kind == "reduce_scatter":
        out = [{"ENGINE": "sm", **base}, {"ENGINE": "sm", **base, "COMM_SMS": max(1, sms // 2)}]
        if large:
            out.append(ce)
        return [_complete(kind, c) for c in out]
    two_first = large and w > 2
    order = ("two_shot", "one_shot") if two_first else ("one_shot", "two_shot")
    out = [{"ENGINE": "sm", "ALGO": a, **base} for a in order]
    if large:
        out.append(dict(ce, ALGO="one_shot"))
    return [_complete(kind, c) for c in out]


def _complete(kind: str, config: Config) -> Config:
    cfg = {k: v for k, v in config.items() if k in KEYS[kind]}
    if cfg.get("ENGINE") == "ce":
        cfg.pop("CHUNKS", None)  # the copy engine moves each shard in one copy
        if kind == "all_gather":
            cfg["ALGO"] = "push"  # the copy engine pushes into the peers' fixed buffers
    return cfg


def check(kind: str, world: World, rows: int, cols: int, dtype: torch.dtype, config: Config, dim: int = 0) -> str | None:
    """None, or why `config` cannot run collective `kind` on this shape (config keys and values,
    world size, divisibility, the copy engine's limits, the heap provider for a World)."""
    if kind not in KINDS:
        return f"unknown collective {kind!r}: use one of {KINDS}"
    w = _size(world)
    if not 1 <= w <= MAX_WORLD:
        return f"world size {w} outside 1..{MAX_WORLD}"
    if rows < 1 or cols < 1:
        return f"shape {rows} x {cols} must be positive"
    if kind == "reduce_scatter" and rows % w:
        return f"reduce_scatter needs rows ({rows}) divisible by the world size ({w})"
    if kind == "all_gather" and dim not in (0, 1):
        return f"all_gather dim must be 0 or 1, got {dim}"
    unknown = sorted(set(config) - set(KEYS[kind]))
    if unknown:
        return f"unknown config keys {unknown} for {kind} (it takes {', '.join(KEYS[kind])})"
    engine = config.get("ENGINE", "sm")
    if engine not in ENGINES:
        return f"ENGINE must be one of {ENGINES}, got {engine!r}"
    algo = config.get("ALGO")
    if kind == "all_gather" and algo is not None and algo not in AG_ALGOS:
        return f"ALGO must be one of {AG_ALGOS}, got {algo!r}"
    if kind == "all_gather" and engine == "ce" and algo not in (None, "push"):
        return f"the copy engine pushes: ALGO must be push with ENGINE=ce, got {algo!r}"
    if kind == "all_reduce" and algo is not None and algo not in AR_ALGOS:
        return f"ALGO must be one of {AR_ALGOS}, got {algo!r}"
    if engine == "ce" and not _ce_allowed(kind, dim, config):
        what = "all_gather along columns (its copies would be strided)" if kind == "all_gather" else "two_shot"
        return f"the copy engine does not run {what}"
    for key, allowed in (("COMM_SMS", COMM_SMS), ("BLOCK", BLOCKS), ("num_warps", WARPS)):
        if key in config and config[key] not in allowed:
            return f"{key} must be one of {allowed}, got {config[key]!r}"
    chunks = config.get("CHUNKS", 1)
    if not isinstance(chunks, int) or not 1 <= chunks <= MAX_CHUNKS:
        return f"CHUNKS must be an integer in 1..{MAX_CHUNKS}, got {chunks!r}"
    if engine == "ce" and not isinstance(world, int):
        provider = getattr(world.heap, "provider", "?")
        if provider not in ("torch", "shm"):
            return f"the copy engine needs peer-mapped heap tensors, which the {provider} heap does not provide"
    return None


def resolve(kind: str, world: World, rows: int, cols: int, dtype: torch.dtype, config: Config | None,
            dim: int = 0) -> Config:
    """`config` with every missing key taken from the first default; InvalidConfig if it cannot run."""
    given = dict(config or {})
    why = check(kind, world, rows, cols, dtype, given, dim)
    if why:
        raise InvalidConfig(f"{kind}: {why}")
    first = defaults(kind, world, rows, cols, dtype, dim)[0]
    if given.get("ENGINE") == "ce" and first.get("ENGINE") != "ce":
        first = {**first, "COMM_SMS": 1}
    cfg = {**first, "CHUNKS": 1, **given} if "CHUNKS" in KEYS[kind] else {**first, **given}
    if kind == "all_gather" and cfg["ENGINE"] == "ce":
        cfg["ALGO"] = "push"
    why = check(kind, world, rows, cols, dtype, cfg, dim)
    if why:
        raise InvalidConfig(f"{kind}: {why}")
    return cfg


# ---------------------------------------------------------------------------------------------
# shared machinery
def _check_dtype(kind: str, dtype: torch.dtype) -> None:
    """InvalidInput for a dtype autofuse does not take, and for FP8 in a reduction (FP8 values move, as
    bytes, in an all-gather only; sums of FP8 products are reduced in their bf16 output dtype)."""
    if dtype_name(dtype) == FP8 and kind != "all_gather":
        raise InvalidInput(f"{kind} does not sum {FP8}: reduce the bf16 result of the scaled product instead")


def _split(cols: int, rows_per_chunk: int, programs: int, itemsize: int) -> int:
    """How many rows to cut each contiguous row into (a power of two), so every program gets rows:
    keeps rows a multiple of 16 bytes when they are, and no narrower than MIN_WIDTH elements."""
    vec = 16 // itemsize if cols % (16 // itemsize) == 0 else 1
    s = 1
    while (cols % (2 * s) == 0 and (cols // (2 * s)) % vec == 0 and cols // (2 * s) >= MIN_WIDTH
           and rows_per_chunk * s < programs):
        s *= 2
    return s


def _tile(width: int, block: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of a tile of about `block` elements over rows `width` wide."""
    bc = min(next_pow2(width), block)
    return max(1, block // bc), bc


def _kernels():
    from autofuse.kernels import collectives as k

    return k


class _Base:
    """What every collective object shares: workspaces, input checks, flag geometry."""

    kind = ""

    def __init__(self, world: World, rows: int, cols: int, dtype: torch.dtype, config: Config | None, dim: int,
                 name: str):
        _check_dtype(self.kind, dtype)
        self.world, self.rows, self.cols, self.dtype, self.dim, self.name = world, rows, cols, dtype, dim, name
        self.config = resolve(self.kind, world, rows, cols, dtype, config, dim)
        self.engine = self.config["ENGINE"]
        self.num_warps = self.config["num_warps"]
        self.in_shape = (rows, cols)
        self.device = world.device

    def _flag_words(self, chunks: int, programs: int) -> int:
        return _FLAG_BASE + _FLAG_KINDS * self.world.size * chunks * programs

    def _workspaces(self, data_bytes: int, fixed_bytes: int, chunks: int, programs: int) -> None:
        self.ws = workspace(self.world, self.name, data_bytes, self._flag_words(chunks, programs))
        self.fixed_ws = workspace(self.world, self.name + ".fixed", cdiv(fixed_bytes, 2)) if fixed_bytes else None
        self.workspaces: tuple[Workspace, ...] = (self.ws,) + ((self.fixed_ws,) if self.fixed_ws else ())
        self.data, self.data_half = self.ws.data_view(self.dtype)

    def _fixed(self, numel: int, offset: int = 0) -> torch.Tensor:
        assert self.fixed_ws is not None
        return self.fixed_ws.data.view(torch.uint8)[:].view(self.dtype)[offset:offset + numel]

    def _check_x(self, x: torch.Tensor, what: str = "x", shape: tuple[int, int] | None = None) -> None:
        shape = shape or self.in_shape
        if (not isinstance(x, torch.Tensor) or x.shape != shape or x.dtype != self.dtype or x.device != self.device
                or not x.is_contiguous()):
            got = (f"{tuple(x.shape)} {x.dtype} on {x.device}{'' if x.is_contiguous() else ' (not contiguous)'}"
                   if isinstance(x, torch.Tensor) else type(x).__name__)
            raise InvalidInput(f"{self.kind}: {what} must be a contiguous {shape} {self.dtype} tensor on "
                               f"{self.device}, got {got}")

    def _refuse(self, out: torch.Tensor | None = None) -> None:
        """Raise WorkspaceAborted after a fault, leaving NaN in `out` (never the previous call's values)."""
        for ws in self.workspaces:
            if ws.faulty():
                if out is not None:
                    out.fill_(float("nan"))
                ws.refuse_if_faulty()

    def check(self, out: torch.Tensor | None = None) -> None:
        """Raise the fault any of this collective's workspaces recorded (synchronises with the device);
        `out` (the call's output) is filled with NaN first, as Runner.check does."""
        try:
            for ws in self.workspaces:
                ws.check()
        except Exception:
            if out is not None:
                out.fill_(float("nan"))
            raise

    def _peer_views(self, local: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """(peer q's copy of heap tensor `local`, q) for every peer, for copy-engine copies."""
        w, r = self.world.size, self.world.rank
        return [(self.world.heap.peer_tensor(local, q), q) for q in ((r + i) % w for i in range(1, w))]


# ---------------------------------------------------------------------------------------------
# all-gather
class AllGather(_Base):
    """All-gather of `rows x cols` shards along `dim` (see the module docstring)."""

    kind = "all_gather"

    def __init__(self, world: World, rows: int, cols: int, dtype: torch.dtype, config: Config | None = None,
                 dim: int = 0, name: str = "collectives"):
        super().__init__(world, rows, cols, dtype, config, dim, name)
        w, r, size = world.size, world.rank, dtype.itemsize
        cfg = self.config
        self.algo = "push" if self.engine == "ce" else cfg["ALGO"]
        chunks = min(cfg["CHUNKS"], rows)
        chunk_rows = cdiv(rows, chunks)
        chunks = cdiv(rows, chunk_rows)
        programs = max(1, min(cfg["COMM_SMS"], chunk_rows * (cols if dim == 0 else 1)))
        split = _split(cols, chunk_rows, programs, size) if dim == 0 else 1
        programs = max(1, min(programs, chunk_rows * split))
        self.split, self.programs, self.nchunks = split, programs, chunks
        irows, width = rows * split, cols // split
        self.out_shape = (w * rows, cols) if dim == 0 else (rows, w * cols)
        dst_ld, src_step = (width, irows * width) if dim == 0 else (w * cols, cols)
        data = {"inbox": w * rows * cols, "pull": rows * cols}.get(self.algo, 0) if self.engine == "sm" else 0
        self._workspaces(data * size, w * rows * cols * size, chunks, programs)
        self.buffer = self._fixed(w * rows * cols).view(self.out_shape)
        self.block_r, self.block_c = _tile(width, cfg["BLOCK"])
        self._geom = (irows, width, dst_ld, src_step, chunks, chunk_rows * split, cdiv(chunk_rows * split, programs))
        self.chunks = [Chunk((r - i) % w, j, j * chunk_rows, min(rows, (j + 1) * chunk_rows))
                       for j in range(chunks) for i in range(1, w)]
        self._code = _CE_DONE if self.engine == "ce" else _AG_ALGO[self.algo]
        if self.engine == "ce":
            mine = self.buffer[r * rows:(r + 1) * rows]
            self._own = mine
            self._peers = self._peer_views(mine)
        self._direct_out = self.engine == "sm" and self.algo in ("inbox", "pull")

    def _launch(self, x: torch.Tensor, out: torch.Tensor, waited: bool) -> None:
        k = _kernels()
        ws = self.ws
        grid = (self.programs,)
        meta = dict(BLOCK_R=self.block_r, BLOCK_C=self.block_c, num_warps=self.num_warps, num_stages=1)
        if self.engine == "ce":
            k.all_gather_kernel[grid](x, out, self.data, ws.ctx, ws.flags, ws.half_flags, self.data_half, *self._geom,
                                      ALGO=_CE_READY, WAITED=False, **meta)
            for peer, _ in self._peers:
                peer.copy_(x)
            self._own.copy_(x)
        k.all_gather_kernel[grid](x, out, self.data, ws.ctx, ws.flags, ws.half_flags, self.data_half, *self._geom,
                                  ALGO=self._code, WAITED=waited, **meta)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather every rank's `x` into `out` (default: `self.buffer`); one launch on the current stream."""
        self._check_x(x)
        if out is not None:
            self._check_x(out, "out", self.out_shape)
        self._refuse(out)
        target = out if out is not None and self._direct_out else self.buffer
        self._launch(x, target, waited=False)
        if out is not None and target is not out:
            out.copy_(target)
            return out
        return target

    def start(self, x: torch.Tensor) -> torch.Tensor:
        """Launch the gather into `self.buffer` on the current stream; the consumer then calls
        `wait(i)` for every i in range(len(self.chunks)), in order. Returns the buffer."""
        self._check_x(x)
        self._refuse()
        self._launch(x, self.buffer, waited=bool(self.chunks))
        return self.buffer

    def wait(self, i: int) -> None:
        """Hold the current stream until chunk i is in `self.buffer` (a one-program device wait)."""
        c = self.chunks[i]
        irows, width, dst_ld, src_step, chunks, _, _ = self._geom
        ws = self.ws
        _kernels().chunk_wait_kernel[(1,)](
            ws.ctx, ws.flags, ws.half_flags, self.buffer, c.owner, c.index, c.start * self.split,
            c.stop * self.split, width, dst_ld, src_step, chunks, self.programs, LAST=i == len(self.chunks) - 1,
            WAIT_BLOCK=next_pow2(self.programs), BLOCK_R=self.block_r, BLOCK_C=self.block_c, num_warps=4, num_stages=1)

    def rows_of(self, c: Chunk) -> tuple[slice, slice]:
        """(row slice, column slice) of `self.buffer` that chunk `c` fills."""
        if self.dim == 0:
            base = c.owner * self.rows
            return slice(base + c.start, base + c.stop), slice(0, self.cols)
        return slice(c.start, c.stop), slice(c.owner * self.cols, (c.owner + 1) * self.cols)


def all_gather(world: World, rows: int, cols: int, dtype: torch.dtype, config: Config | None = None, dim: int = 0,
               name: str = "collectives") -> AllGather:
    """An all-gather of `rows x cols` shards along `dim` on `world` (collective: every rank builds it)."""
    return AllGather(world, rows, cols, dtype, config, dim, name)


# ---------------------------------------------------------------------------------------------
# reduce-scatter and all-reduce
class _Reduce(_Base):
    """Shared by ReduceScatter and AllReduce: geometry of owners' rows, inboxes, launches."""

    mode = _RS

    def _setup(self, owner_rows: int, total_rows: int, chunks_wanted: int, data_elems: int, fixed_elems: int,
               box2: int) -> None:
        size, cfg = self.dtype.itemsize, self.config
        chunks = max(1, min(chunks_wanted, owner_rows))
        chunk_rows = cdiv(max(owner_rows, 1), chunks)
        chunks = cdiv(max(owner_rows, 1), chunk_rows)
        programs = max(1, min(cfg["COMM_SMS"], chunk_rows * self.cols))
        split = _split(self.cols, chunk_rows, programs, size)
        programs = max(1, min(programs, chunk_rows * split))
        width = self.cols // split
        self.split, self.programs, self.nchunks, self.chunk_rows = split, programs, chunks, chunk_rows
        self._workspaces(data_elems * size, fixed_elems * size, chunks, programs)
        self.block_r, self.block_c = _tile(width, cfg["BLOCK"])
        self._geom = (owner_rows * split, total_rows * split, width, chunks, chunk_rows * split,
                      cdiv(chunk_rows * split, programs))
        self._box2 = box2
        self._fixed_inbox = self._fixed(fixed_elems) if fixed_elems else None

    def _setup_slots(self, owner_rows: int, total_rows: int) -> None:
        """`_setup` with one `owner_rows x cols` inbox slot per rank, in the parity inboxes (ENGINE=sm) or in
        the fixed workspace (ENGINE=ce, whose copies go into every peer's copy of my slot)."""
        w, r = self.world.size, self.world.rank
        slot = owner_rows * self.cols
        self._setup(owner_rows, total_rows, self.config["CHUNKS"], w * slot if self.engine == "sm" else 0,
                    w * slot if self.engine == "ce" else 0, 0)
        if self.engine == "ce":
            assert self._fixed_inbox is not None
            self._peers = self._peer_views(self._fixed_inbox[r * slot:(r + 1) * slot].view(owner_rows, self.cols))

    def _run(self, x: torch.Tensor, out: torch.Tensor, send: int, reduce: bool, publish: bool, fixed: bool,
             owner: int = -1, chunk: int = -1) -> None:
        ws = self.ws
        buf = self._fixed_inbox if fixed else self.data
        _kernels().reduce_kernel[(self.programs,)](
            x, out, buf, ws.ctx, ws.flags, ws.half_flags, self.data_half, *self._geom, owner, chunk, self._box2,
            MODE=self.mode, SEND=send, REDUCE=reduce, FIXED=fixed, PUBLISH=publish, BLOCK_R=self.block_r,
            BLOCK_C=self.block_c, num_warps=self.num_warps, num_stages=1)

    def _ce_ready(self, x: torch.Tensor) -> None:
        ws = self.ws
        _kernels().all_gather_kernel[(self.programs,)](
            x, x, self.data, ws.ctx, ws.flags, ws.half_flags, self.data_half, 0, 0, 0, 0, self._geom[3], 1, 1,
            ALGO=_CE_READY, WAITED=False, BLOCK_R=1, BLOCK_C=16, num_warps=1, num_stages=1)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum every rank's `x` into `out` (a new tensor if None) and return it; one launch. `out` is
        my rows (reduce_scatter) or all of them (all_reduce, where `out` may be `x`)."""
        self._check_x(x)
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        else:
            self._check_x(out, "out", self.out_shape)
        self._refuse(out)
        self._call(x, out)
        return out

    def _call(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.engine == "ce":
            self._ce_ready(x)
            for peer, q in self._peers:
                peer.copy_(self._slice(x, q))
            self._run(x, out, _SEND_FLAGS, True, True, True)
        else:
            self._run(x, out, _SEND_DATA, True, True, False)

    def _slice(self, x: torch.Tensor, owner: int) -> torch.Tensor:
        return x


class ReduceScatter(_Reduce):
    """Reduce-scatter of `rows x cols` partials by rows (see the module docstring)."""

    kind = "reduce_scatter"
    mode = _RS

    def __init__(self, world: World, rows: int, cols: int, dtype: torch.dtype, config: Config | None = None,
                 name: str = "collectives"):
        super().__init__(world, rows, cols, dtype, config, 0, name)
        w, r = world.size, world.rank
        mine = rows // w
        self.out_shape = (mine, cols)
        self._setup_slots(mine, rows)
        order = [(r + i) % w for i in range(1, w)] + [r]
        cr = self.chunk_rows
        self.chunks = [Chunk(q, j, j * cr, min(mine, (j + 1) * cr)) for q in order for j in range(self.nchunks)]

    def _slice(self, x: torch.Tensor, owner: int) -> torch.Tensor:
        mine = self.out_shape[0]
        return x[owner * mine:(owner + 1) * mine]

    def push(self, x: torch.Tensor, i: int) -> None:
        """Send chunk i of the partial `x` to its owner (nothing for my own chunks); SM engine only."""
        if self.engine != "sm":
            raise InvalidConfig("reduce_scatter: chunked pushes need ENGINE=sm")
        c = self.chunks[i]
        if c.owner == self.world.rank:
            return
        self._run(x, x, _SEND_DATA, False, False, False, owner=c.owner, chunk=c.index)

    def reduce(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Sum my rows once every peer pushed them (the last launch of a chunked call)."""
        self._run(x, out, _SEND_NONE, True, True, False)
        return out


class AllReduce(_Reduce):
    """All-reduce of `rows x cols` partials, bitwise the same on every rank (see the module docstring)."""

    kind = "all_reduce"

    def __init__(self, world: World, rows: int, cols: int, dtype: torch.dtype, config: Config | None = None,
                 name: str = "collectives"):
        super().__init__(world, rows, cols, dtype, config, 0, name)
        w = world.size
        self.out_shape = (rows, cols)
        self.algo = self.config["ALGO"]
        if self.algo == "one_shot":
            self.mode = _AR_ONE
            self._setup_slots(rows, rows)
        else:
            self.mode = _AR_TWO
            owner = cdiv(rows, w)
            slot = owner * cols
            self._setup(owner, rows, self.config["CHUNKS"], 2 * w * slot, 0, w * slot)


def reduce_scatter(world: World, rows: int, cols: int, dtype: torch.dtype, config: Config | None = None,
                   name: str = "collectives") -> ReduceScatter:
    """A reduce-scatter of `rows x cols` partials on `world` (collective: every rank builds it)."""
    return ReduceScatter(world, rows, cols, dtype, config, name)


def all_reduce(world: World, rows: int, cols: int, dtype: torch.dtype, config: Config | None = None,
               name: str = "collectives") -> AllReduce:
    """An all-reduce of `rows x cols` partials on `world` (collective: every rank builds it)."""
    return AllReduce(world, rows, cols, dtype, config, name)


def build(kind: str, world: World, rows: int, cols: int, dtype: torch.dtype, config: Config | None = None,
          dim: int = 0, name: str = "collectives") -> AllGather | ReduceScatter | AllReduce:
    """Any of the three by kind (benches and tests)."""
    if kind == "all_gather":
        return AllGather(world, rows, cols, dtype, config, dim, name)
    if kind == "reduce_scatter":
        return ReduceScatter(world, rows, cols, dtype, config, name)
    if kind == "all_reduce":
        return AllReduce(world, rows, cols, dtype, config, name)
    raise InvalidConfig(f"unknown collective {kind!r}: use one of {KINDS}")


def reference(kind: str, shards: Sequence[torch.Tensor], rank: int, dim: int = 0) -> torch.Tensor:
    """float64 result of collective `kind` on rank `rank`, given every rank's input (tests, benches)."""
    xs = [s.to(torch.float64) for s in shards]
    if kind == "all_gather":
        return torch.cat(xs, dim=dim)
    total = xs[0].clone()
    for s in xs[1:]:
        total += s
    if kind == "reduce_scatter":
        mine = total.shape[0] // len(xs)
        return total[rank * mine:(rank + 1) * mine]
    return total
