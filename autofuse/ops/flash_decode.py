"""`flash_decode`: one decode step of attention over a KV cache split along the sequence.

Inputs on rank r (device code and layouts: `autofuse/kernels/flash_decode.py`):
- q (B, Hq, D), contiguous, bf16 or fp16, the same on every rank (not checked: that needs a
  collective);
- k_r, v_r (B, Hkv, S, D), q's dtype, unit stride along D only (TensorSpec layout "rows"), so a slice
  [:, :, :S] of a bigger cache or a (B, S, Hkv, D) cache seen as (B, Hkv, S, D) works; GQA:
  Hq = G * Hkv, query head h reads KV head h // G;
- lengths_r (B,) int32: the valid slots of this rank per sequence, ragged, 0 allowed (clamped to
  [0, S] on the device: host syncs would break CUDA graphs).
Every rank returns O (B, Hq, D) in q's dtype = softmax(q K^T / sqrt(D)) V over all ranks' valid
tokens, bit-identical on every rank (rank partials are merged in rank order); a sequence with no
tokens on any rank gets O = 0.

Variants. All run the same split-KV kernel (`split_kernel`, grid units x NUM_SPLITS; a unit is HEADS
query heads of one KV head of one sequence, so K/V are read once when HEADS = G) at the same default
configs, so only the combine differs. Launches and flag hops per call, and the expected cost at KV
<= 16K tokens per rank on two H200 in graph mode, from last round's pieces (docs/results/
flash_decode.md, GPU-NOTES.md): a graph-replayed kernel costs ~1-2 us beyond its work, NCCL's
all-gather of the partials 10-23 us, a cross-GPU flag 1-3 us one way; split = the split kernel alone
(~4 us at B=1 S=1K, ~40 us at B=8 S=4K, ~520 us at B=32 S=16K, where it streams at ~4 TB/s):
- `bsp` (family bsp): split kernel; `merge_splits_kernel` (this rank's (O_r, LSE_r), fp32, local);
  NCCL all-gather of the W slots; `merge_ranks_kernel`. 4 launches, no flags.
  Cost = split + ~2 us + all-gather (10-23 us) + ~2 us: split + 14-27 us.
- `split_heap` (family hybrid): split kernel, then ONE `heap_combine_kernel`: each program merges
  the splits of its rows x BLOCK_D columns (from L2), stores the rank partial into its slot of every
  rank's inbox, raises one flag on each peer, waits for each peer's same flag and merges the W
  partials in rank order. 2 launches; each rank raises and polls programs x (W - 1) flags, programs
  = groups x D / BLOCK_D, a group per FLAG: tile = a unit (HEADS rows), row_block = a sequence (Hq
  rows), shard = every row (one program per column block: for tiny batches only). One one-way flag
  hop on the critical path. Cost = split + ~1-2 us (launch) + ~1 us (merge of splits: NUM_SPLITS x
  rows x BLOCK_D floats per program, one L2 round trip when NUM_SPLITS <= SPLIT_BLOCK) + ~1-2 us
  (push: rows x (BLOCK_D + 1) floats per peer, then a system-scope release) + 1-3 us (flag) + ~1 us
  (merge of ranks): split + 5-9 us. Expected x BSP: ~1.5-1.8 at B=1 S=1K (~10-12 us vs 18), ~1.2-1.3
  at B=8 S=4K (~46 us vs 57), and the bound BSP / split (1.04-1.10) where the split dominates
  (B >= 8 at S = 16K).
- `push_fused` (family fused): one `fused_kernel` on the split kernel's grid; the last split program
  of a unit to finish (a local arrival counter) runs the heap combine for that unit alone (all D
  columns, flag = unit). 1 launch; units x NUM_SPLITS arrival atomics; units x (W - 1) flags. Cost =
  split + the serial tail of one program per unit (merge HEADS x NUM_SPLITS x D floats in
  NUM_SPLITS / SPLIT_BLOCK round trips, push, one flag hop, merge): best at few splits (large B).
The heap inbox and flags are parity double-buffered on the device epoch and read only by these
kernels, which compute the parity themselves, so CUDA-graph replays need nothing from the host.
Config keys: NUM_SPLITS (splits per unit), BLOCK_N (tokens per step), HEADS (query heads per unit, a
divisor of G), num_warps and num_stages (of the split kernel), BLOCK_D (columns per merge program:
bsp and split_heap), FLAG (split_heap: tile | row_block | shard).

Faults: split_heap and push_fused share the heap workspace "flash_decode" (one epoch sequence);
a wait that runs out aborts every rank's workspace, the programs concerned write NaN and the host
raises FlagTimeout on every rank (autofuse.comm.status). BSP has no workspace (NCCL waits as NCCL does).

Measurement inputs: random q/K/V; on GPUs lengths full and K/V contiguous (bytes / time is the
achieved bandwidth of the whole cache, see `OP.bytes_read`); on CPU ragged: see `make_inputs`.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from autofuse.kernels import flash_decode as kern
from autofuse.core.op import Config, InvalidInput, Op, Problem, SearchSpace, Variant, default_tolerance
from autofuse.core.custom import CustomOp
from autofuse.core.runner import Runner, TensorSpec
from autofuse.core.shapes import DECODE_M, MODELS
from autofuse.core.sizes import cdiv, next_pow2
from autofuse.comm.workspace import workspace
from autofuse.comm.world import all_gather_single

if TYPE_CHECKING:
    from autofuse.comm.world import World

NAME = "flash_decode"
HEAD_DIMS = (16, 32, 64, 128, 256)
BLOCK_NS = (16, 32, 64, 128, 256)
BLOCK_DS = (16, 32, 64, 128, 256)
SPLITS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_SPLITS = 1024
WARPS = (1, 2, 4, 8)
STAGES = (1, 2, 3, 4)
FLAGS = ("tile", "row_block", "shard")
SMEM_LIMIT = 227 * 1024          # H100/H200 shared memory per block
GPU_SMS = 132                     # H100/H200 SXM: what the defaults aim to fill
MERGE_WARPS = 4                   # merge and combine kernels
MERGE_ELEMS = 8192                # floats of split partials one merge program loads per round trip
FUSED_MERGE_ELEMS = 4096          # the same in the fused kernel: 168 registers on sm_90 (8192: 221), so it
                                  # keeps the split kernel's 3 blocks per SM (shared memory allows 3)
LOG2E = 1.4426950408889634
LOCAL_KEYS = ("NUM_SPLITS", "BLOCK_N", "HEADS", "num_warps", "num_stages")


# ------------------------------------------------------------------------------------- problems
def _fail(msg: str) -> None:
    raise InvalidInput(f"{NAME}: {msg}")


def problem_of(world: World, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> Problem:
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
    if lengths.dtype != torch.int32 or lengths.shape != (B,) or not lengths.is_contiguous():
        _fail(f"lengths must be contiguous int32 of shape ({B},), got {lengths.dtype} {tuple(lengths.shape)}")
    return Problem.make(NAME, q.dtype, world.size, B=B, Hq=Hq, Hkv=Hkv, D=D, S=S)


def _dims(p: Problem) -> tuple[int, int, int, int, int]:
    return p["B"], p["Hq"], p["Hkv"], p["D"], p["S"]


def make_problem(world_size: int, B: int, S: int, Hq: int = 64, Hkv: int = 8, D: int = 128,
                 dtype: str = "bfloat16") -> Problem:
    return Problem.make(NAME, dtype, world_size, B=B, Hq=Hq, Hkv=Hkv, D=D, S=S)


# --------------------------------------------------------------------------- inputs, reference
def make_inputs(world: World, problem: Problem, seed: int, rank: int | None = None,
                ragged: bool | None = None) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s (q, k, v, lengths): deterministic in (seed, rank), on the World's device.

    q depends on the seed only (the same on every rank). ragged=None: ragged on CPU, full on GPU.
    Full: lengths S, contiguous K/V. Ragged (what the tests exercise; seeds 0 and 1 cover it all):
    - lengths random in [1, S] (every rank contributes to every sequence unless said here);
      sequence rank % B full and, for B >= 3, sequence (rank + 1) % B empty on this rank;
    - seed % 3 == 1: rank z = (seed // 3) % W holds no tokens at all, and for B >= 2 sequence
      z % B is empty on every rank (its output must be exactly 0);
    - K/V are views, never contiguous: seed % 3 == 0 slices [:, :, :S] of a cache 5 slots longer,
      the others view a (B, S, Hkv, D) cache as (B, Hkv, S, D).
    """
    B, Hq, Hkv, D, S = _dims(problem)
    rank = world.rank if rank is None else rank
    ragged = world.device.type == "cpu" if ragged is None else ragged
    dev, dt = world.device, problem.torch_dtype
    gq = torch.Generator(device=dev).manual_seed(seed * 7919 + 17)
    q = torch.randn((B, Hq, D), generator=gq, device=dev, dtype=dt)
    g = torch.Generator(device=dev).manual_seed(seed * 7919 + 1000 + rank)
    if not ragged:
        k = torch.randn((B, Hkv, S, D), generator=g, device=dev, dtype=dt)
        v = torch.randn((B, Hkv, S, D), generator=g, device=dev, dtype=dt)
        return q, k, v, torch.full((B,), S, dtype=torch.int32, device=dev)
    if seed % 3 == 0:
        k = torch.randn((B, Hkv, S + 5, D), generator=g, device=dev, dtype=dt)[:, :, :S]
        v = torch.randn((B, Hkv, S + 5, D), generator=g, device=dev, dtype=dt)[:, :, :S]
    else:
        k = torch.randn((B, S, Hkv, D), generator=g, device=dev, dtype=dt).transpose(1, 2)
        v = torch.randn((B, S, Hkv, D), generator=g, device=dev, dtype=dt).transpose(1, 2)
    gl = torch.Generator().manual_seed(seed * 7919 + 5000 + rank)
    lengths = torch.randint(1, S + 1, (B,), generator=gl, dtype=torch.int32)
    lengths[rank % B] = S
    if B >= 3:
        lengths[(rank + 1) % B] = 0
    if seed % 3 == 1:
        empty_rank = (seed // 3) % world.size
        if B >= 2:
            lengths[empty_rank % B] = 0
        if rank == empty_rank:
            lengths.zero_()
    return q, k, v, lengths.to(dev)


def partial_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def attention_reference(q: torch.Tensor, ks: list, vs: list, lengths: list) -> torch.Tensor:
    """float64 attention of q over every rank's valid tokens (lists over ranks)."""
    return merge_reference([partial_reference(q, k, v, n) for k, v, n in zip(ks, vs, lengths)])


def reference(world: World, problem: Problem, seed: int, ragged: bool | None = None) -> torch.Tensor:
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
    """The op's own features (the generic log2 of each dim, world and dtype bytes come from autofuse.core.features)."""
    B, Hq, Hkv, D, S = _dims(problem)
    kv = kv_bytes(problem)
    part = partial_bytes(problem)
    return {"log2_G": math.log2(Hq // Hkv), "log2_units": math.log2(B * Hkv), "log2_kv_bytes": math.log2(kv),
            "log2_partial_bytes": math.log2(part), "comm_over_kv": part * (problem.world - 1) / kv}


# The papers' sweep (Llama-3-70B attention: Hq=64, Hkv=8, D=128): B x S per rank, 256K at three B.
# Short KV first: the first 15 problems are the KV <= 16K regime of the 1.2x target (`--limit 15`).
GPU_GRID = [(b, s) for s in (1 << 10, 4 << 10, 16 << 10, 64 << 10) for b in (1, 4, 8, 16, 32)] + \
           [(b, 256 << 10) for b in (1, 8, 32)]
MODEL_S = (4 << 10, 8 << 10, 16 << 10, 32 << 10)


def _model_heads() -> list[tuple[int, int, int]]:
    """Distinct (Hq, Hkv, D) of the models in autofuse.core.shapes, first model first."""
    seen: dict[tuple[int, int, int], None] = {}
    for m in MODELS.values():
        seen.setdefault((m.heads, m.kv_heads, m.head_dim), None)
    return list(seen)


def sweep(kind: str, world: int) -> list[Problem]:
    """Problem sets (bf16):
    - "gpu" / "llama70b": Hq=64, Hkv=8, D=128; B in 1..32 x S in 1K..64K per rank, 256K at B=1, 8, 32
      (S-major: the first 15 have S <= 16K);
    - "models": every model's (Hq, Hkv, D) in autofuse.core.shapes (the whole cache's heads on every rank:
      the sequence is split, not the heads) x decode batches 1/8/32/128 x S 4K..32K per rank;
    - "default" (what `autofuse tune` runs): 10 problems from "gpu" and "models", short KV first;
    - "scaling": three Llama-3-70B problems of one global KV length at every world size (S = global
      / world), for strong-scaling tables (`autofuse tune --world 1,2 --sweep scaling`);
    - "cpu": tiny problems for the interpreter.
    """
    if kind in ("gpu", "llama70b"):
        return [make_problem(world, b, s) for b, s in GPU_GRID]
    if kind == "models":
        return [make_problem(world, b, s, Hq=hq, Hkv=hkv, D=d)
                for hq, hkv, d in _model_heads() for b in DECODE_M for s in MODEL_S]
    if kind == "default":
        picks = [(1, 1 << 10, 64), (1, 16 << 10, 64), (8, 4 << 10, 64), (32, 1 << 10, 64), (4, 64 << 10, 64),
                 (1, 32 << 10, 32), (8, 8 << 10, 32), (32, 4 << 10, 128), (128, 4 << 10, 64), (128, 16 << 10, 128)]
        return [make_problem(world, b, s, Hq=hq) for b, s, hq in picks]
    if kind == "scaling":
        return [make_problem(world, b, s // world) for b, s in ((1, 16 << 10), (8, 32 << 10), (32, 8 << 10))]
    if kind == "cpu":
        return [make_problem(world, b, s, Hq=4, Hkv=2, D=d) for b, s, d in ((1, 32, 16), (2, 48, 32), (2, 64, 16))]
    raise ValueError(f"{NAME}: unknown sweep kind {kind!r}: use cpu, gpu, llama70b, models, default or scaling")


# ------------------------------------------------------------------------------------- configs
def _block_h(heads: int) -> int:
    """Rows of the split kernel's tiles: >= 16 so both products run on tensor cores."""
    return max(16, next_pow2(heads))


def smem_bytes(problem: Problem, config: Config) -> int:
    """Upper estimate of the split kernel's shared memory: K and V tiles in num_stages - 1
    pipeline buffers, q, and the scores' layout conversion (checked against sm_90 builds)."""
    bn, bh, D, e = config["BLOCK_N"], _block_h(config["HEADS"]), problem["D"], problem.torch_dtype.itemsize
    return 2 * bn * D * e * max(1, config["num_stages"] - 1) + bh * D * e + bh * bn * 4


def _check_local(problem: Problem, config: Config) -> str | None:
    """Why the split kernel's part of `config` cannot run `problem` (None if it can)."""
    B, Hq, Hkv, D, S = _dims(problem)
    G = Hq // Hkv
    ns, bn, heads, warps, stages = (config[k] for k in LOCAL_KEYS)
    if bn not in BLOCK_NS:
        return f"BLOCK_N {bn} not in {BLOCK_NS}"
    if not isinstance(ns, int) or not 1 <= ns <= MAX_SPLITS:
        return f"NUM_SPLITS {ns} must be an int in 1..{MAX_SPLITS}"
    if not isinstance(heads, int) or heads < 1 or G % heads:
        return f"HEADS {heads} must divide the GQA group size {G}"
    if warps not in WARPS:
        return f"num_warps {warps} not in {WARPS}"
    if stages not in STAGES:
        return f"num_stages {stages} not in {STAGES}"
    smem = smem_bytes(problem, config)
    if smem > SMEM_LIMIT:
        return f"shared memory ~{smem} B > {SMEM_LIMIT} B (BLOCK_N={bn}, D={D}, stages={stages})"
    bh = _block_h(heads)
    live = (bh * D + bh * bn + bn * D) / (32 * warps)
    if live > 512:
        return f"~{live:.0f} live values per thread (BLOCK_H={bh}, BLOCK_N={bn}, D={D}, warps={warps}): use more warps"
    return None


def _splits_for(problem: Problem, block_n: int, heads: int, programs_per_sm: int, min_blocks: int) -> int:
    """The smallest power-of-two NUM_SPLITS giving units * NUM_SPLITS >= programs_per_sm * SMs,
    keeping at least `min_blocks` BLOCK_N blocks per split."""
    B, Hq, _, _, S = _dims(problem)
    units = B * Hq // heads
    limit = min(MAX_SPLITS // 4, max(1, cdiv(S, block_n) // min_blocks))
    ns = 1
    while units * ns < programs_per_sm * GPU_SMS and ns * 2 <= limit:
        ns *= 2
    return ns


def _block_d_for(problem: Problem, heads: int) -> int:
    """Columns per merge program: split D until units x D / BLOCK_D reaches the SMs (>= 32 columns)."""
    B, Hq, _, D, _ = _dims(problem)
    units = B * Hq // heads
    per = 1
    while units * per * 2 <= GPU_SMS and D // (per * 2) >= 32:
        per *= 2
    return D // per


def _tiny(problem: Problem) -> bool:
    return problem["S"] <= 256 and problem["B"] * problem["Hq"] <= 64


def local_defaults(problem: Problem) -> list[Config]:
    """Known-good split-kernel configs: tiny blocks for CPU problems; for GPU ones, BLOCK_N 64 (D >= 128)
    or 128, HEADS = G (K/V read once), and two split counts: >= 2 programs per SM with >= 4 blocks per
    split, and >= 4 programs per SM with >= 1 block per split (short KV: more, shorter programs)."""
    G = problem["Hq"] // problem["Hkv"]
    if _tiny(problem):
        return [{"NUM_SPLITS": 2, "BLOCK_N": 16, "HEADS": G, "num_warps": 1, "num_stages": 1}]
    bn = 64 if problem["D"] >= 128 else 128
    out = []
    for per_sm, min_blocks in ((2, 4), (4, 1)):
        cfg = {"NUM_SPLITS": _splits_for(problem, bn, G, per_sm, min_blocks), "BLOCK_N": bn, "HEADS": G,
               "num_warps": 4, "num_stages": 3}
        if cfg not in out:
            out.append(cfg)
    return out


def local_space(trial: SearchSpace, problem: Problem) -> Config:
    """The split kernel's part of the Optuna space; choices depend on the problem only (fixed within a study)."""
    G = problem["Hq"] // problem["Hkv"]
    return {
        "NUM_SPLITS": trial.suggest_categorical("NUM_SPLITS", [s for s in SPLITS if s <= max(1, problem["S"] // 16)]),
        "BLOCK_N": trial.suggest_categorical("BLOCK_N", [b for b in BLOCK_NS if b <= max(16, next_pow2(problem["S"]))]),
        "HEADS": trial.suggest_categorical("HEADS", [h for h in range(1, G + 1) if G % h == 0]),
        "num_warps": trial.suggest_categorical("num_warps", list(WARPS)),
        "num_stages": trial.suggest_categorical("num_stages", list(STAGES)),
    }


class _FlashDecodeVariant(Variant):
    """What the three variants share: the split kernel's keys, checks, defaults and space, plus `extra` keys."""

    extra: tuple[str, ...] = ()

    def check(self, problem: Problem, config: Config) -> str | None:
        keys = set(LOCAL_KEYS) | set(self.extra)
        if set(config) != keys:
            return f"config keys {sorted(config)} != {sorted(keys)}"
        reason = _check_local(problem, config)
        if reason:
            return reason
        if "BLOCK_D" in config:
            bd, D = config["BLOCK_D"], problem["D"]
            if bd not in BLOCK_DS or bd > D:
                return f"BLOCK_D {bd} must be one of {tuple(b for b in BLOCK_DS if b <= D)} (<= D={D})"
        if "FLAG" in config and config["FLAG"] not in FLAGS:
            return f"FLAG {config['FLAG']!r} not in {FLAGS}"
        return None

    def defaults(self, problem: Problem) -> list[Config]:
        out = []
        for base in local_defaults(problem):
            cfg = dict(base)
            if "BLOCK_D" in self.extra:
                cfg["BLOCK_D"] = problem["D"] if _tiny(problem) else _block_d_for(problem, base["HEADS"])
            if "FLAG" in self.extra:
                cfg["FLAG"] = "tile"
            out.append(cfg)
        return out

    def space(self, trial: SearchSpace, problem: Problem) -> Config:
        cfg = local_space(trial, problem)
        if "BLOCK_D" in self.extra:
            cfg["BLOCK_D"] = trial.suggest_categorical("BLOCK_D", [b for b in BLOCK_DS if b <= problem["D"]])
        if "FLAG" in self.extra:
            cfg["FLAG"] = trial.suggest_categorical("FLAG", list(FLAGS))
        return cfg


class Bsp(_FlashDecodeVariant):
    """Split kernel, merge of splits, NCCL (gloo on CPU) all-gather of (O_r, LSE_r), merge of ranks."""

    name, family, extra = "bsp", "bsp", ("BLOCK_D",)

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return BspRunner(world, problem, config)


class SplitHeap(_FlashDecodeVariant):
    """Split kernel, then one heap combine kernel (merge splits, push, flag, wait, merge ranks)."""

    name, family, extra = "split_heap", "hybrid", ("BLOCK_D", "FLAG")

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return SplitHeapRunner(world, problem, config)


class PushFused(_FlashDecodeVariant):
    """One kernel: split attention; each unit's last split merges, pushes, waits and writes O."""

    name, family = "push_fused", "fused"

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return PushFusedRunner(world, problem, config)


# --------------------------------------------------------------------------------------- runners
class _Plan:
    """Sizes one runner derives from (problem, config), in the kernels' terms."""

    def __init__(self, problem: Problem, config: Config):
        B, Hq, Hkv, D, S = _dims(problem)
        self.B, self.Hq, self.Hkv, self.D, self.S = B, Hq, Hkv, D, S
        self.heads, self.ns, self.block_n = config["HEADS"], config["NUM_SPLITS"], config["BLOCK_N"]
        self.warps, self.stages = config["num_warps"], config["num_stages"]
        self.block_d = config.get("BLOCK_D", D)
        self.block_h = _block_h(self.heads)
        self.rows = B * Hq
        self.units = self.rows // self.heads
        self.scale = LOG2E / math.sqrt(D)
        self.slot_stride = cdiv(self.rows * (D + 1), 16) * 16  # 64-byte aligned slots
        group_rows = {"tile": self.heads, "row_block": Hq, "shard": self.rows}[config.get("FLAG", "tile")]
        self.group_rows = group_rows if "FLAG" in config else self.heads
        self.block_r = min(next_pow2(self.group_rows), max(1, 2048 // self.block_d))
        self.split_block = self.split_block_for(self.block_r, self.block_d)
        self.col_blocks = D // self.block_d
        self.programs = cdiv(self.rows, self.group_rows) * self.col_blocks

    def split_block_for(self, block_r: int, block_d: int, elems: int = MERGE_ELEMS) -> int:
        """Splits per merge round trip: `elems` floats of (split, row, column) at most."""
        return max(1, min(next_pow2(self.ns), elems // (block_r * block_d)))


class _Base(Runner):
    """Every variant's runner: specs, the split partials' scratch and the split kernel's launch."""

    def __init__(self, world: World, problem: Problem, config: Config, plan: _Plan | None = None,
                 workspaces: tuple = ()):
        plan = plan or _Plan(problem, config)
        B, Hq, Hkv, D, S = _dims(problem)
        dt = problem.torch_dtype
        super().__init__(world, problem,
                         [TensorSpec("q", (B, Hq, D), dt), TensorSpec("k", (B, Hkv, S, D), dt, "rows"),
                          TensorSpec("v", (B, Hkv, S, D), dt, "rows"), TensorSpec("lengths", (B,), torch.int32)],
                         TensorSpec("out", (B, Hq, D), dt), workspaces)
        self.plan, self.config = plan, config
        self.o_split = torch.empty(plan.rows * plan.ns * D, dtype=torch.float32, device=world.device)
        self.lse_split = torch.empty(plan.rows * plan.ns, dtype=torch.float32, device=world.device)

    def split(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> None:
        p = self.plan
        kern.split_kernel[(p.units * p.ns,)](
            q, k, v, lengths, self.o_split, self.lse_split, p.S, p.Hq, p.Hkv, p.heads, p.ns,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), p.scale,
            D=p.D, BLOCK_N=p.block_n, BLOCK_H=p.block_h, num_warps=p.warps, num_stages=p.stages)

    def merge_splits(self, slot: torch.Tensor) -> None:
        """The rank partial (O_r, LSE_r) of this rank's splits into the local `slot` (BSP; the bound's `local`)."""
        p = self.plan
        kern.merge_splits_kernel[(p.units * p.col_blocks,)](
            self.o_split, self.lse_split, slot, p.rows, p.heads, p.ns,
            D=p.D, BLOCK_R=next_pow2(p.heads), BLOCK_D=p.block_d,
            SPLIT_BLOCK=p.split_block_for(next_pow2(p.heads), p.block_d), num_warps=MERGE_WARPS, num_stages=1)


def all_gather(world: World, recv: torch.Tensor, send: torch.Tensor) -> None:
    """The collective library's all-gather of flat slots: NCCL's single-tensor form, gloo's list form."""
    if world.device.type == "cuda":
        world.collective(all_gather_single, recv, send, what="flash_decode.bsp")
    else:
        world.collective(dist.all_gather, list(recv.view(world.size, -1).unbind(0)), send, what="flash_decode.bsp")


class BspRunner(_Base):
    """split_kernel; merge_splits_kernel into `send`; all-gather into `recv`; merge_ranks_kernel. 4 launches."""

    def __init__(self, world: World, problem: Problem, config: Config):
        super().__init__(world, problem, config)
        self.send = torch.empty(self.plan.slot_stride, dtype=torch.float32, device=world.device)
        self.recv = torch.empty(world.size * self.plan.slot_stride, dtype=torch.float32, device=world.device)

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
               out: torch.Tensor) -> None:
        p = self.plan
        self.split(q, k, v, lengths)
        self.merge_splits(self.send)
        all_gather(self.world, self.recv, self.send)
        kern.merge_ranks_kernel[(p.units * p.col_blocks,)](
            self.recv, out, p.slot_stride, p.rows, p.heads, self.world.size,
            D=p.D, BLOCK_R=next_pow2(p.heads), BLOCK_D=p.block_d, num_warps=MERGE_WARPS, num_stages=1)


class _HeapRunner(_Base):
    """A runner on the op's heap workspace ("flash_decode", shared by split_heap and push_fused: one
    epoch sequence): W float32 slots (the inbox) and W * `flags_per_rank(plan)` flags per parity."""

    def __init__(self, world: World, problem: Problem, config: Config):
        plan = _Plan(problem, config)
        ws = workspace(world, NAME, world.size * plan.slot_stride * 4, world.size * self.flags_per_rank(plan))
        super().__init__(world, problem, config, plan, (ws,))
        self.ws = ws
        self.inbox, self.inbox_half = ws.data_view(torch.float32)

    def flags_per_rank(self, plan: _Plan) -> int:
        """The flags one rank raises per call (a set per rank in the workspace)."""
        raise NotImplementedError


class SplitHeapRunner(_HeapRunner):
    """split_kernel, then heap_combine_kernel (grid plan.programs): 2 launches, no collective."""

    def flags_per_rank(self, plan: _Plan) -> int:
        return plan.programs

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
               out: torch.Tensor) -> None:
        p, ws = self.plan, self.ws
        self.split(q, k, v, lengths)
        kern.heap_combine_kernel[(p.programs,)](
            self.o_split, self.lse_split, self.inbox, ws.flags, out, ws.ctx, p.rows, p.group_rows, p.ns,
            p.slot_stride, self.inbox_half, ws.half_flags,
            D=p.D, BLOCK_R=p.block_r, BLOCK_D=p.block_d, SPLIT_BLOCK=p.split_block, num_warps=MERGE_WARPS,
            num_stages=1)


class PushFusedRunner(_HeapRunner):
    """fused_kernel (grid units x NUM_SPLITS): 1 launch."""

    def __init__(self, world: World, problem: Problem, config: Config):
        super().__init__(world, problem, config)
        self.arrivals = torch.zeros(self.plan.units, dtype=torch.int32, device=world.device)
        self.block_r = next_pow2(self.plan.heads)

    def flags_per_rank(self, plan: _Plan) -> int:
        return plan.units

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
               out: torch.Tensor) -> None:
        p, ws = self.plan, self.ws
        kern.fused_kernel[(p.units * p.ns,)](
            q, k, v, lengths, self.o_split, self.lse_split, self.arrivals, self.inbox, ws.flags, out, ws.ctx, p.S,
            p.Hq, p.Hkv,
            p.heads, p.ns, p.slot_stride, self.inbox_half, ws.half_flags,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), p.scale,
            D=p.D, BLOCK_N=p.block_n, BLOCK_H=p.block_h, BLOCK_R=self.block_r,
            SPLIT_BLOCK=p.split_block_for(self.block_r, p.D, FUSED_MERGE_ELEMS), num_warps=p.warps,
            num_stages=p.stages)


# ------------------------------------------------------------------------------- bound, extras
def bound(world: World, problem: Problem, seed: int) -> dict[str, Callable[[], Any]]:
    """The pieces the bench times beside the variants (bound = max of them): `local` = split kernel +
    merge of splits (BSP's local part), `split` = the split kernel alone (so local - split is the
    merge), `allgather` = NCCL's all-gather of the rank partials alone."""
    q, k, v, lengths = make_inputs(world, problem, seed)
    config = Bsp().defaults(problem)[0]
    loc = BspRunner(world, problem, config)

    def local() -> None:
        loc.split(q, k, v, lengths)
        loc.merge_splits(loc.send)

    return {"local": local, "split": lambda: loc.split(q, k, v, lengths),
            "allgather": lambda: all_gather(world, loc.recv, loc.send)}


def copy_rate(world: World, problem: Problem) -> Callable[[], Any]:
    """A device-to-device copy of `kv_bytes(problem)` bytes, the memory rate to compare the local
    kernel's kv_bytes / time with (the copy reads and writes: its HBM traffic is twice that)."""
    n = kv_bytes(problem)
    src = torch.empty(n, dtype=torch.uint8, device=world.device)
    src.fill_(1)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


OP = Op(
    name=NAME,
    args=("q", "k", "v", "lengths"),
    variants=[Bsp(), SplitHeap(), PushFused()],
    problem_of=problem_of,
    inputs=lambda world, problem, seed: make_inputs(world, problem, seed),
    reference=reference,
    tolerance=tolerance,
    features=features,
    sweep=sweep,
    per_rank=("S",),
    description="decode attention over a sequence-split KV cache (GQA): split-KV kernel + cross-rank LSE merge",
    bound=bound,
    bytes_read=kv_bytes,
    copy_rate=copy_rate,
    custom=CustomOp(out_shape=lambda inputs, w: tuple(inputs[0].shape)),  # no backward: inference only
)
