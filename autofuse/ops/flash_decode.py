"""`flash_decode`: one decode step of attention over a KV cache split along the sequence.

Inputs on rank r (layout fixed here, device code in `autofuse/kernels/flash_decode.py`):
- q (B, Hq, D), contiguous, bf16 or fp16, the same on every rank (not checked: that needs a
  collective);
- K_r, V_r (B, Hkv, S, D), q's dtype, unit stride along D (other strides free, so a slice
  [:, :, :S] of a bigger cache works); GQA: Hq = G * Hkv, query head h reads KV head h // G;
- lengths_r (B,) int32 on the same device: valid slots of this rank per sequence, ragged,
  0 allowed (clamped to [0, S] on the device: host syncs would break CUDA graphs).
Every rank returns O (B, Hq, D) in q's dtype = softmax(q K^T / sqrt(D)) V over all ranks' valid
tokens, bit-identical on every rank (rank partials are merged in rank order); a sequence with no
tokens on any rank gets O = 0.

Variants (all share the split-KV kernel and the merge of splits, so the comparison is fair):
- `bsp`: split kernel, local merge -> (O_r, LSE_r) fp32, collective all-gather, global merge.
- `push`: split kernel; the local merge stores (O_r, LSE_r) into every rank's inbox (parity
  double-buffered) and raises an epoch flag per group (`flags`: 'head' per unit, 'batch' per
  sequence, 'all' one per source rank); the global merge waits per flag, no collective.
- `push_fused`: one kernel; the last split program of a unit merges, pushes, waits for the
  peers' partials of that unit and writes O (flag per unit).
Config: NUM_SPLITS (splits per unit), BLOCK_N (tokens per step), HEADS (query heads per
program, a divisor of G; HEADS = G reads K/V once), num_warps, num_stages, `flags` for push.

Measurement inputs: random q/K/V; lengths full on GPUs (so bytes/time is the achieved bandwidth
of the whole cache, see `extra["bytes"]`), ragged on CPU (random in [0, S], one full sequence
per rank, one empty sequence per rank). `extra["inputs"]` makes either kind on any device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from autofuse import status
from autofuse.kernels import flash_decode as kern
from autofuse.op import (Config, InvalidConfig, InvalidInput, Op, Problem, SearchSpace, Variant,
                         default_tolerance)

NAME = "flash_decode"
HEAD_DIMS = (16, 32, 64, 128, 256)
BLOCK_NS = (16, 32, 64, 128, 256)
SPLITS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WARPS = (1, 2, 4, 8)
STAGES = (1, 2, 3, 4)
FLAGS = ("head", "batch", "all")
SMEM_LIMIT = 227 * 1024          # H100/H200 shared memory per block
GPU_SMS = 132                     # H100/H200 SXM: what NUM_SPLITS defaults aim to fill
COMBINE_WARPS = 4
LOG2E = 1.4426950408889634


# ------------------------------------------------------------------------------------- problems
def _fail(msg: str) -> None:
    raise InvalidInput(f"{NAME}: {msg}")


def problem_of(world, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> Problem:
    """Validate one rank's arguments (shapes, dtypes, devices, layout) -> Problem; no device sync."""
    for name, t in (("q", q), ("k", k), ("v", v), ("lengths", lengths)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a tensor, got {type(t).__name__}")
        if t.device != world.device:
            _fail(f"{name} is on {t.device}, this rank's device is {world.device}")
    if q.dim() != 3:
        _fail(f"q must be (B, Hq, D), got shape {tuple(q.shape)}")
    if k.dim() != 4 or v.shape != k.shape:
        _fail(f"k and v must both be (B, Hkv, S, D), got {tuple(k.shape)} and {tuple(v.shape)}")
    B, Hq, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    if q.dtype not in (torch.bfloat16, torch.float16):
        _fail(f"q dtype {q.dtype} not supported: use bfloat16 or float16")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        _fail(f"k ({k.dtype}) and v ({v.dtype}) must have q's dtype {q.dtype}")
    if Bk != B or Dk != D:
        _fail(f"k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)} (batch and head dim)")
    if D not in HEAD_DIMS:
        _fail(f"head dim {D} not supported: use one of {HEAD_DIMS}")
    if min(B, Hq, Hkv, S) < 1:
        _fail(f"empty dimension: B={B}, Hq={Hq}, Hkv={Hkv}, S={S}")
    if Hq % Hkv:
        _fail(f"query heads {Hq} must be a multiple of KV heads {Hkv} (GQA)")
    if not q.is_contiguous():
        _fail("q must be contiguous")
    if k.stride(3) != 1 or v.stride(3) != 1:
        _fail(f"k and v need unit stride along D, got strides {k.stride()} and {v.stride()}")
    if lengths.dtype != torch.int32 or lengths.shape != (B,):
        _fail(f"lengths must be int32 of shape ({B},), got {lengths.dtype} {tuple(lengths.shape)}")
    return Problem.make(NAME, q.dtype, world.size, B=B, Hq=Hq, Hkv=Hkv, D=D, S=S)


def _dims(p: Problem) -> tuple[int, int, int, int, int]:
    return p["B"], p["Hq"], p["Hkv"], p["D"], p["S"]


def make_problem(world_size: int, B: int, S: int, Hq: int = 64, Hkv: int = 8, D: int = 128,
                 dtype: str = "bfloat16") -> Problem:
    return Problem.make(NAME, dtype, world_size, B=B, Hq=Hq, Hkv=Hkv, D=D, S=S)


# --------------------------------------------------------------------------- inputs, reference
def make_inputs(world, problem: Problem, seed: int, rank: int | None = None, ragged: bool | None = None):
    """Rank `rank`'s (q, k, v, lengths): deterministic in (seed, rank), on the World's device.

    q depends on the seed only (the same on every rank). ragged=None: ragged on CPU, full on GPU.
    Ragged lengths are random in [0, S]; sequence rank % B is full and, for B > 1, sequence
    (rank + 1) % B is empty on this rank.
    """
    B, Hq, Hkv, D, S = _dims(problem)
    rank = world.rank if rank is None else rank
    ragged = world.device.type == "cpu" if ragged is None else ragged
    dev, dt = world.device, problem.torch_dtype
    gq = torch.Generator(device=dev).manual_seed(seed * 7919 + 17)
    q = torch.randn((B, Hq, D), generator=gq, device=dev, dtype=dt)
    g = torch.Generator(device=dev).manual_seed(seed * 7919 + 1000 + rank)
    k = torch.randn((B, Hkv, S, D), generator=g, device=dev, dtype=dt)
    v = torch.randn((B, Hkv, S, D), generator=g, device=dev, dtype=dt)
    if ragged:
        gl = torch.Generator().manual_seed(seed * 7919 + 5000 + rank)
        lengths = torch.randint(0, S + 1, (B,), generator=gl, dtype=torch.int32)
        lengths[rank % B] = S
        if B > 1:
            lengths[(rank + 1) % B] = 0
    else:
        lengths = torch.full((B,), S, dtype=torch.int32)
    return q, k, v, lengths.to(dev)


def partial_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor):
    """One rank's exact partial in float64: (O_r (B, Hq, D), natural LSE_r (B, Hq)); no tokens -> (0, -inf)."""
    B, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qd = q.to(torch.float64).view(B, Hkv, G, D) / math.sqrt(D)
    o = torch.zeros(B, Hkv, G, D, dtype=torch.float64, device=q.device)
    lse = torch.full((B, Hkv, G), float("-inf"), dtype=torch.float64, device=q.device)
    for b, n in enumerate(lengths.tolist()):
        n = min(max(int(n), 0), S)
        if n == 0:
            continue
        for h in range(Hkv):
            s = qd[b, h] @ k[b, h, :n].to(torch.float64).T           # (G, n)
            lse[b, h] = torch.logsumexp(s, dim=1)
            o[b, h] = torch.softmax(s, dim=1) @ v[b, h, :n].to(torch.float64)
    return o.view(B, Hq, D), lse.view(B, Hq)


def merge_reference(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Merge exact rank partials (O_r, LSE_r) -> O in float64; no tokens anywhere -> 0."""
    lse = torch.stack([p[1] for p in parts])                          # (W, B, Hq)
    m = lse.max(dim=0).values
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)                                       # 0 where a rank has no tokens
    total = w.sum(dim=0)
    acc = sum(wi[..., None] * p[0] for wi, p in zip(w, parts))
    return acc / torch.where(total > 0, total, torch.ones_like(total))[..., None]


def attention_reference(q: torch.Tensor, ks, vs, lengths) -> torch.Tensor:
    """float64 attention of q over every rank's valid tokens (lists over ranks)."""
    return merge_reference([partial_reference(q, k, v, n) for k, v, n in zip(ks, vs, lengths)])


def reference(world, problem: Problem, seed: int, ragged: bool | None = None) -> torch.Tensor:
    """This rank's expected output in float64 for `make_inputs(..., seed, ragged=ragged)`,
    rebuilding every rank's inputs one at a time."""
    parts = []
    for r in range(world.size):
        q, k, v, n = make_inputs(world, problem, seed, rank=r, ragged=ragged)
        parts.append(partial_reference(q, k, v, n))
        del k, v
    return merge_reference(parts)


def tolerance(problem: Problem) -> float:
    """The dot-product bound of the dtype over the whole sequence (probabilities are rounded to
    the dtype before P @ V, as in every flash kernel, which this bound covers)."""
    return default_tolerance(problem.dtype, problem["S"] * problem.world)


def kv_bytes(problem: Problem) -> int:
    """Bytes the local kernel must read with full lengths: K and V of every slot, plus q."""
    B, Hq, Hkv, D, S = _dims(problem)
    e = problem.torch_dtype.itemsize
    return 2 * B * Hkv * S * D * e + B * Hq * D * e


def partial_bytes(problem: Problem) -> int:
    """Bytes of one rank partial (O_r, LSE_r) in float32: what each rank sends to each peer."""
    B, Hq, _, D, _ = _dims(problem)
    return B * Hq * (D + 1) * 4


def features(problem: Problem) -> dict[str, float]:
    B, Hq, Hkv, D, S = _dims(problem)
    kv = kv_bytes(problem)
    part = partial_bytes(problem)
    return {
        "log2_B": math.log2(B), "log2_S": math.log2(S), "log2_Hq": math.log2(Hq), "log2_Hkv": math.log2(Hkv),
        "log2_G": math.log2(Hq // Hkv), "log2_D": math.log2(D), "world": float(problem.world),
        "dtype_bytes": float(problem.torch_dtype.itemsize), "log2_units": math.log2(B * Hkv),
        "log2_kv_bytes": math.log2(kv), "log2_partial_bytes": math.log2(part),
        "comm_over_kv": part * (problem.world - 1) / kv,
    }


def sweep(kind: str, world: int) -> list[Problem]:
    """'gpu' / 'llama70b': Hq=64, Hkv=8, D=128, bf16, B x S_r (256K only at B=1, 8, 32 for time);
    'cpu': tiny problems for the interpreter."""
    if kind in ("gpu", "llama70b"):
        grid = [(b, s) for b in (1, 4, 8, 16, 32) for s in (1 << 10, 4 << 10, 16 << 10, 64 << 10)]
        grid += [(b, 256 << 10) for b in (1, 8, 32)]
        return [make_problem(world, b, s) for b, s in grid]
    if kind == "cpu":
        return [make_problem(world, b, s, Hq=4, Hkv=2, D=d) for b, s, d in ((1, 32, 16), (2, 48, 32), (2, 64, 16))]
    raise ValueError(f"{NAME}: unknown sweep kind {kind!r}: use cpu, gpu or llama70b")


# ------------------------------------------------------------------------------------- configs
def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _block_h(heads: int) -> int:
    return max(16, _pow2(heads))


KEYS = ("NUM_SPLITS", "BLOCK_N", "HEADS", "num_warps", "num_stages")


def smem_bytes(problem: Problem, config: Config) -> int:
    """Upper estimate of the split kernel's shared memory: K and V tiles in num_stages - 1
    pipeline buffers, q, and the scores' layout conversion (checked against sm_90 builds)."""
    bn, bh, D, e = config["BLOCK_N"], _block_h(config["HEADS"]), problem["D"], problem.torch_dtype.itemsize
    return 2 * bn * D * e * max(1, config["num_stages"] - 1) + bh * D * e + bh * bn * 4


def check(problem: Problem, config: Config, push_flags: bool = False) -> str | None:
    """Why `config` cannot run `problem` (None if it can)."""
    keys = set(KEYS) | ({"flags"} if push_flags else set())
    if set(config) != keys:
        return f"config keys {sorted(config)} != {sorted(keys)}"
    B, Hq, Hkv, D, S = _dims(problem)
    G = Hq // Hkv
    ns, bn, heads, warps, stages = (config[k] for k in KEYS)
    if bn not in BLOCK_NS:
        return f"BLOCK_N {bn} not in {BLOCK_NS}"
    if not isinstance(ns, int) or not 1 <= ns <= 1024:
        return f"NUM_SPLITS {ns} must be an int in 1..1024"
    if not isinstance(heads, int) or heads < 1 or G % heads:
        return f"HEADS {heads} must divide the GQA group size {G}"
    if warps not in WARPS:
        return f"num_warps {warps} not in {WARPS}"
    if stages not in STAGES:
        return f"num_stages {stages} not in {STAGES}"
    if push_flags and config["flags"] not in FLAGS:
        return f"flags {config['flags']!r} not in {FLAGS}"
    bh = _block_h(heads)
    smem = smem_bytes(problem, config)
    if smem > SMEM_LIMIT:
        return f"shared memory ~{smem} B > {SMEM_LIMIT} B (BLOCK_N={bn}, D={D}, stages={stages})"
    live = (bh * D + bh * bn + bn * D) / (32 * warps)
    if live > 512:
        return f"~{live:.0f} live values per thread (BLOCK_H={bh}, BLOCK_N={bn}, D={D}, warps={warps}): use more warps"
    return None


def _splits_for(problem: Problem, block_n: int, heads: int) -> int:
    """Enough splits that units * splits reaches 2 programs per SM (4 from 16K tokens on, where
    more, shorter programs even out the last wave), keeping at least 2 blocks per split."""
    B, Hq, Hkv, D, S = _dims(problem)
    programs = (4 if S >= 16 << 10 else 2) * GPU_SMS
    units = B * Hkv * (Hq // Hkv // heads)
    blocks = -(-S // block_n)
    ns = 1
    while units * ns < programs and ns * 4 <= min(blocks, 2 * SPLITS[-1]):
        ns *= 2
    return ns


def _tiny(problem: Problem) -> bool:
    return problem["S"] <= 128 and problem["B"] * problem["Hq"] <= 64


def defaults(problem: Problem, flags: tuple[str, ...] = ()) -> list[Config]:
    """Known-good configs: tiny blocks for CPU problems, streaming blocks for GPU ones."""
    G = problem["Hq"] // problem["Hkv"]
    if _tiny(problem):
        base = {"NUM_SPLITS": 2, "BLOCK_N": 16, "HEADS": G, "num_warps": 1, "num_stages": 1}
    else:
        bn = 64 if problem["D"] >= 128 else 128
        base = {"NUM_SPLITS": _splits_for(problem, bn, G), "BLOCK_N": bn, "HEADS": G, "num_warps": 4,
                "num_stages": 3}
    return [dict(base, flags=f) for f in flags] if flags else [base]


def space(trial: SearchSpace, problem: Problem, push_flags: bool = False) -> Config:
    """Optuna define-by-run space; choices depend on the problem only (fixed within a study)."""
    G = problem["Hq"] // problem["Hkv"]
    cfg = {
        "NUM_SPLITS": trial.suggest_categorical("NUM_SPLITS", [s for s in SPLITS if s <= max(1, problem["S"] // 16)]),
        "BLOCK_N": trial.suggest_categorical("BLOCK_N", [b for b in BLOCK_NS if b <= max(16, _pow2(problem["S"]))]),
        "HEADS": trial.suggest_categorical("HEADS", [h for h in range(1, G + 1) if G % h == 0]),
        "num_warps": trial.suggest_categorical("num_warps", list(WARPS)),
        "num_stages": trial.suggest_categorical("num_stages", list(STAGES)),
    }
    if push_flags:
        cfg["flags"] = trial.suggest_categorical("flags", list(FLAGS))
    return cfg


# ------------------------------------------------------------------------------------ workspace
@dataclass
class Workspace:
    """Heap buffers of a pushing variant, shared by its runners on one World (never cleared).

    inbox: 2 parities x W sources x slot floats; flags: (W sources, groups) int32 epochs;
    arrive: local arrival counters (rows of a flag group, or splits of a unit; reset by the last);
    counter: the epoch [published, programs done] (`shmem.epoch_next/epoch_finish`).
    """

    inbox: torch.Tensor
    flags: torch.Tensor
    arrive: torch.Tensor
    counter: torch.Tensor
    slot_cap: int
    rows_cap: int


def workspace(world, variant: str, problem: Problem) -> Workspace:
    """The World's workspace of `variant` big enough for `problem` (allocated collectively)."""
    B, Hq, _, D, _ = _dims(problem)
    rows, slot = B * Hq, B * Hq * (D + 1)
    cache = getattr(world, "_flash_decode_ws", None)
    if cache is None:
        cache = {}
        world._flash_decode_ws = cache
    for ws in cache.get(variant, []):
        if ws.slot_cap >= slot and ws.rows_cap >= rows:
            return ws
    heap, w = world.heap, world.size
    slot_cap, rows_cap = _pow2(slot), _pow2(rows)
    prefix = f"{NAME}.{variant}.{len(cache.get(variant, []))}"
    ws = Workspace(
        inbox=heap.empty(2 * w * slot_cap, dtype=torch.float32, name=f"{prefix}.inbox"),
        flags=heap.zeros(w, rows_cap, dtype=torch.int32, name=f"{prefix}.flags"),
        arrive=heap.zeros(rows_cap, dtype=torch.int32, name=f"{prefix}.arrive"),
        counter=heap.zeros(2, dtype=torch.int32, name=f"{prefix}.epoch"),
        slot_cap=slot_cap, rows_cap=rows_cap,
    )
    cache.setdefault(variant, []).append(ws)
    return ws


# --------------------------------------------------------------------------------------- runners
class _Local:
    """The local part every variant shares: split kernel (+ BSP's merge of splits into a slot)."""

    def __init__(self, world, problem: Problem, config: Config):
        B, Hq, Hkv, D, S = _dims(problem)
        self.world, self.problem, self.config = world, problem, config
        self.B, self.Hq, self.Hkv, self.D, self.S, self.G = B, Hq, Hkv, D, S, Hq // Hkv
        self.heads = config["HEADS"]
        self.ns = config["NUM_SPLITS"]
        self.block_h = _block_h(self.heads)
        self.units = B * Hkv * (self.G // self.heads)
        self.split_block = min(_pow2(self.ns), max(2, 4096 // D))  # splits merged per round trip
        self.rows = B * Hq
        self.slot = self.rows * (D + 1)
        self.scale = LOG2E / math.sqrt(D)
        self.upcast = world.device.type == "cpu" and problem.dtype == "bfloat16"
        dev = world.device
        self.part_o = torch.empty(self.rows * self.ns * D, dtype=torch.float32, device=dev)
        self.part_lse = torch.empty(self.rows * self.ns, dtype=torch.float32, device=dev)
        self.dummy_i32 = torch.zeros(2, dtype=torch.int32, device=dev)
        self.dummy_i64 = torch.zeros(max(1, world.size), dtype=torch.int64, device=dev)

    def check_inputs(self, q, k, v, lengths) -> None:
        B, Hq, Hkv, D, S = self.B, self.Hq, self.Hkv, self.D, self.S
        if tuple(q.shape) != (B, Hq, D) or tuple(k.shape) != (B, Hkv, S, D) or tuple(v.shape) != (B, Hkv, S, D) \
                or tuple(lengths.shape) != (B,):
            _fail(f"inputs {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(lengths.shape)} do not "
                  f"match the built problem {self.problem}")
        if q.dtype != self.problem.torch_dtype or k.dtype != q.dtype or v.dtype != q.dtype \
                or lengths.dtype != torch.int32:
            _fail(f"input dtypes do not match the built problem {self.problem}")
        if not q.is_contiguous() or k.stride(3) != 1 or v.stride(3) != 1:
            _fail("q must be contiguous and k, v need unit stride along D")
        dev = self.world.device
        if q.device != dev or k.device != dev or v.device != dev or lengths.device != dev:
            _fail(f"inputs must be on this rank's device {dev}")

    def out_for(self, q, out):
        if out is None:
            return torch.empty_like(q)
        if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous() or out.device != q.device:
            _fail(f"out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)} on {q.device}")
        return out

    def split(self, q, k, v, lengths) -> None:
        c = self.config
        kern.split_kernel[(self.units * self.ns,)](
            q, k, v, lengths, self.part_o, self.part_lse, self.S, self.Hq, self.Hkv, self.G, self.heads, self.ns,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), self.scale,
            D=self.D, BLOCK_N=c["BLOCK_N"], BLOCK_H=self.block_h, UPCAST=self.upcast, num_warps=c["num_warps"],
            num_stages=c["num_stages"])

    def merge_into(self, slot: torch.Tensor) -> None:
        kern.local_combine_kernel[(self.rows,)](
            self.part_o, self.part_lse, slot, self.dummy_i32, self.dummy_i32, self.dummy_i32, self.rows, self.slot,
            self.ns, 1, 1, self.world.rank, self.world.size, self.dummy_i64,
            PUSH=False, D=self.D, SPLIT_BLOCK=self.split_block, num_warps=COMBINE_WARPS, num_stages=1)

    def __call__(self, q, k, v, lengths, slot: torch.Tensor) -> torch.Tensor:
        """The local bound: split kernel + merge of splits into `slot`."""
        self.split(q, k, v, lengths)
        self.merge_into(slot)
        return slot


def all_gather(world, recv: torch.Tensor, send: torch.Tensor) -> None:
    """The collective library's all-gather of flat slots: NCCL's into-tensor form, gloo's list form."""
    if world.device.type == "cuda":
        dist.all_gather_into_tensor(recv, send, group=world.group)
    else:
        dist.all_gather(list(recv.view(world.size, -1).unbind(0)), send, group=world.group)


class BspRunner:
    """Split kernel, merge of splits, all-gather of (O_r, LSE_r), merge of ranks."""

    def __init__(self, world, problem: Problem, config: Config):
        self.local = _Local(world, problem, config)
        dev = world.device
        self.send = torch.empty(self.local.slot, dtype=torch.float32, device=dev)
        self.recv = torch.empty(world.size * self.local.slot, dtype=torch.float32, device=dev)

    def __call__(self, q, k, v, lengths, out: torch.Tensor | None = None) -> torch.Tensor:
        loc = self.local
        loc.check_inputs(q, k, v, lengths)
        out = loc.out_for(q, out)
        loc(q, k, v, lengths, self.send)
        all_gather(loc.world, self.recv, self.send)
        kern.global_combine_kernel[(loc.units,)](
            self.recv, out, loc.dummy_i32, loc.dummy_i32, loc.dummy_i32, loc.rows, loc.slot, loc.Hq, loc.Hkv, loc.G,
            loc.heads, 1, 1, loc.world.rank, loc.world.size, loc.dummy_i64, 0,
            WAIT=False, D=loc.D, BLOCK_H=loc.block_h, num_warps=COMBINE_WARPS, num_stages=1)
        return out


def _rows_per_flag(loc: _Local, flags: str) -> int:
    """Rows per flag: 'head' a unit (HEADS query heads of one KV head), 'batch' a sequence, 'all' every row."""
    return {"head": loc.heads, "batch": loc.Hq, "all": loc.rows}[flags]


class PushRunner:
    """Split kernel, merge of splits pushed to every rank's inbox with epoch flags, merge of ranks."""

    def __init__(self, world, problem: Problem, config: Config):
        self.local = _Local(world, problem, config)
        self.ws = workspace(world, "push", problem)
        self.rows_per_flag = _rows_per_flag(self.local, config["flags"])
        self.spin = status.spin_limit(world.device.type)

    def __call__(self, q, k, v, lengths, out: torch.Tensor | None = None) -> torch.Tensor:
        loc, ws, w = self.local, self.ws, self.local.world
        loc.check_inputs(q, k, v, lengths)
        out = loc.out_for(q, out)
        heap = w.heap
        loc.split(q, k, v, lengths)
        kern.local_combine_kernel[(loc.rows,)](
            loc.part_o, loc.part_lse, ws.inbox, ws.flags, ws.arrive, ws.counter, loc.rows, ws.slot_cap, loc.ns,
            self.rows_per_flag, ws.rows_cap, w.rank, w.size, heap.bases,
            PUSH=True, D=loc.D, SPLIT_BLOCK=loc.split_block, num_warps=COMBINE_WARPS, num_stages=1)
        kern.global_combine_kernel[(loc.units,)](
            ws.inbox, out, ws.flags, ws.counter, heap.status, loc.rows, ws.slot_cap, loc.Hq, loc.Hkv, loc.G,
            loc.heads, self.rows_per_flag, ws.rows_cap, w.rank, w.size, heap.bases, self.spin,
            WAIT=True, D=loc.D, BLOCK_H=loc.block_h, num_warps=COMBINE_WARPS, num_stages=1)
        return out


class PushFusedRunner:
    """One kernel: split attention; each unit's last split merges, pushes, waits and writes O."""

    def __init__(self, world, problem: Problem, config: Config):
        self.local = _Local(world, problem, config)
        self.ws = workspace(world, "push_fused", problem)
        self.spin = status.spin_limit(world.device.type)

    def __call__(self, q, k, v, lengths, out: torch.Tensor | None = None) -> torch.Tensor:
        loc, ws, w, c = self.local, self.ws, self.local.world, self.local.config
        loc.check_inputs(q, k, v, lengths)
        out = loc.out_for(q, out)
        heap = w.heap
        kern.fused_kernel[(loc.units * loc.ns,)](
            q, k, v, lengths, loc.part_o, loc.part_lse, ws.inbox, out, ws.flags, ws.arrive, ws.counter, heap.status,
            loc.S, loc.Hq, loc.Hkv, loc.G, loc.heads, loc.ns, loc.rows, ws.slot_cap, ws.rows_cap, w.rank, w.size,
            heap.bases, self.spin,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), loc.scale,
            D=loc.D, BLOCK_N=c["BLOCK_N"], BLOCK_H=loc.block_h, SPLIT_BLOCK=loc.split_block, UPCAST=loc.upcast,
            num_warps=c["num_warps"], num_stages=c["num_stages"])
        return out


def _builder(cls, push_flags: bool) -> Callable[[Any, Problem, Config], Any]:
    def build(world, problem: Problem, config: Config):
        if problem.world != world.size:
            raise InvalidInput(f"{NAME}: problem is for {problem.world} ranks, this World has {world.size}")
        reason = check(problem, config, push_flags)
        if reason:
            raise InvalidConfig(f"{NAME}.{cls.__name__}: {reason}")
        return cls(world, problem, dict(config))
    return build


# ------------------------------------------------------------------------------- bound, extras
def bound(world, problem: Problem, seed: int) -> dict[str, Callable[[], Any]]:
    """The pieces of the BSP bound: the local part (split kernel + merge of splits) and the
    all-gather of (O_r, LSE_r); the bench reports the max of their times."""
    q, k, v, lengths = make_inputs(world, problem, seed)
    loc = _Local(world, problem, defaults(problem)[0])
    send = torch.empty(loc.slot, dtype=torch.float32, device=world.device)
    recv = torch.empty(world.size * loc.slot, dtype=torch.float32, device=world.device)
    return {"local": lambda: loc(q, k, v, lengths, send), "allgather": lambda: all_gather(world, recv, send)}


def copy_rate(world, problem: Problem) -> Callable[[], Any]:
    """A device-to-device copy of `kv_bytes(problem)` bytes, the memory rate to compare the local
    kernel's kv_bytes / time with (the copy reads and writes: its HBM traffic is twice that)."""
    n = kv_bytes(problem)
    src = torch.empty(n, dtype=torch.uint8, device=world.device)
    src.fill_(1)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _variant(name: str, cls, push_flags: bool, flags: tuple[str, ...], fused: bool) -> Variant:
    return Variant(
        name=name,
        build=_builder(cls, push_flags),
        space=lambda trial, problem: space(trial, problem, push_flags),
        defaults=lambda problem: defaults(problem, flags),
        check=lambda problem, config: check(problem, config, push_flags),
        fused=fused,
    )


OP = Op(
    name=NAME,
    variants={
        "bsp": _variant("bsp", BspRunner, False, (), fused=False),
        "push": _variant("push", PushRunner, True, ("head", "all"), fused=True),
        "push_fused": _variant("push_fused", PushFusedRunner, False, (), fused=True),
    },
    problem_of=problem_of,
    inputs=lambda world, problem, seed: make_inputs(world, problem, seed),
    reference=reference,
    tolerance=tolerance,
    features=features,
    sweep=sweep,
    description="decode attention over a sequence-split KV cache (GQA): split-KV kernel + cross-rank LSE merge",
    extra={"bound": bound, "bytes": kv_bytes, "copy_rate": copy_rate, "inputs": make_inputs,
           "attention_reference": attention_reference, "partial_bytes": partial_bytes},
)
