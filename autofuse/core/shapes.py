"""Tensor-parallel shapes of real models: where the tuning sweeps' N and K come from.

A decoder layer with tensor parallelism over W ranks has four communicating GEMMs:
- column-parallel (all-gather + GEMM in the sequence-parallel form: ag_gemm): QKV projection,
  N = (Hq + 2 Hkv) * D / W, K = hidden; gate+up projection, N = 2 * ffn / W, K = hidden;
- row-parallel (GEMM + reduce-scatter: gemm_rs, or + all-reduce: gemm_ar): output projection,
  N = hidden, K = Hq * D (K / W per rank); down projection, N = hidden, K = ffn.
Decode attention over a sequence-split KV cache (flash_decode) sees (Hq, Hkv, D).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    """The sizes of one decoder layer."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int


MODELS = {m.name: m for m in (
    Model("llama3-8b", 4096, 32, 8, 128, 14336),
    Model("llama3-70b", 8192, 64, 8, 128, 28672),
    Model("llama3-405b", 16384, 128, 8, 128, 53248),
    Model("qwen2.5-72b", 8192, 64, 8, 128, 29568),
    Model("mixtral-8x7b", 4096, 32, 8, 128, 14336),
)}

PREFILL_M = (512, 2048, 8192)   # tokens of a prefill chunk (global rows)
DECODE_M = (1, 8, 32, 128)      # sequences in a decode batch


@dataclass(frozen=True)
class Gemm:
    """One communicating GEMM of a layer at world size W: `kind` column (ag_gemm) or row (gemm_rs/ar);
    N is per rank for column-parallel, K is global (the op splits it) for row-parallel."""

    model: str
    name: str
    kind: str
    N: int
    K: int


def layer_gemms(model: Model, world: int) -> list[Gemm]:
    """The layer's communicating GEMMs at world size `world` (shapes that do not split evenly are left out)."""
    qkv = (model.heads + 2 * model.kv_heads) * model.head_dim
    out = []
    for name, kind, n, k in (("qkv", "column", qkv, model.hidden), ("gate_up", "column", 2 * model.ffn, model.hidden),
                             ("o_proj", "row", model.hidden, model.heads * model.head_dim),
                             ("down", "row", model.hidden, model.ffn)):
        if kind == "column":
            if n % world == 0:
                out.append(Gemm(model.name, name, kind, n // world, k))
        elif k % world == 0:
            out.append(Gemm(model.name, name, kind, n, k))
    return out


def gemms(kind: str, world: int, models: tuple[str, ...] | None = None) -> list[Gemm]:
    """Distinct (N, K) of `kind` ("column" or "row") over the models (default: all), first model first."""
    seen: dict[tuple[int, int], Gemm] = {}
    for name in models or tuple(MODELS):
        for g in layer_gemms(MODELS[name], world):
            if g.kind == kind:
                seen.setdefault((g.N, g.K), g)
    return list(seen.values())


# -- training ----------------------------------------------------------------------------------------

TRAIN_TOKENS = (2048, 4096, 8192)  # tokens of one sequence-parallel training step (global rows)
TRAIN_MODELS = ("llama3-70b", "llama3-8b")  # the default sweep's models


@dataclass(frozen=True)
class TrainGemm:
    """One communicating GEMM a sequence-parallel training step of a layer calls: `op` (ag_gemm or
    gemm_rs), `role` (the projection and which product: forward, dA or dB) and the op's dims."""

    op: str
    role: str
    dims: tuple[tuple[str, object], ...]


def train_gemms(model: Model, world: int, tokens: int, save_gathered: bool = True) -> list[TrainGemm]:
    """Every ag_gemm / gemm_rs call of one layer's forward + backward with sequence parallelism over
    `world` ranks and `tokens` global rows (the backward formulas in autofuse/ops/ag_gemm.py and gemm_rs.py
    say which product each is):

    - column-parallel (qkv, gate_up; B_r is hidden x N/W): forward ag_gemm(M=T, N/W, K=hidden); dA =
      gemm_rs(M=T, N=hidden, K=N); dB from the gathered input the forward kept (a local GEMM), or with
      `save_gathered` off an ag_gemm in the k form (M=hidden, N/W, K=T).
    - row-parallel (o_proj, down; B_r is K/W x hidden): forward gemm_rs(M=T, N=hidden, K); dA and dB from
      one ag_gemm of dC (M=T, N=K/W, K=hidden) that keeps the gathered dC for dB (a local GEMM).
    Shapes that do not split over `world` are left out, as in `layer_gemms`."""
    def dims(**d: object) -> tuple[tuple[str, object], ...]:
        return tuple(sorted(d.items()))

    out: list[TrainGemm] = []
    for g in layer_gemms(model, world):
        if g.kind == "column":  # g.N is per rank, g.K = hidden
            out.append(TrainGemm("ag_gemm", f"{g.name} forward", dims(M=tokens, N=g.N, K=g.K, gather="rows")))
            out.append(TrainGemm("gemm_rs", f"{g.name} dA", dims(M=tokens, N=g.K, K=g.N * world)))
            if not save_gathered:
                out.append(TrainGemm("ag_gemm", f"{g.name} dB", dims(M=g.K, N=g.N, K=tokens, gather="k")))
        else:  # g.N = hidden, g.K global
            out.append(TrainGemm("gemm_rs", f"{g.name} forward", dims(M=tokens, N=g.N, K=g.K)))
            out.append(TrainGemm("ag_gemm", f"{g.name} dA and dB", dims(M=tokens, N=g.K // world, K=g.N,
                                                                         gather="rows")))
    return out


def train_sweep(op: str, world: int, models: tuple[str, ...] = TRAIN_MODELS,
                tokens: tuple[int, ...] = TRAIN_TOKENS) -> list[dict]:
    """The `train` sweep of `op`: the dims of every `train_gemms` call of `op` (the gathered input kept
    and gathered again, so both ag_gemm forms), each once, for `models` at `tokens`."""
    seen: list[dict] = []
    for name in models:
        for t in tokens:
            for save in (True, False):
                for g in train_gemms(MODELS[name], world, t, save_gathered=save):
                    if g.op == op and dict(g.dims) not in seen:
                        seen.append(dict(g.dims))
    return seen
