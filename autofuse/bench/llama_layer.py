"""A tensor-parallel Llama-3 decoder layer, written once on the raw ops, run on autofuse or on NCCL + cuBLAS.

The layer (RMSNorm, QKV projection, RoPE, attention, output projection, SwiGLU MLP, residuals) is
plain PyTorch. Its four communicating steps go through a tiny interface, `TPOps`:

    ag_gemm(a, b)       all_gather_rows(a) @ b           (column-parallel linear, sequence-parallel input)
    gemm_rs(a, b)       reduce_scatter_rows(a @ b)       (row-parallel linear, sequence-parallel output)
    gemm_ar(a, b)       all_reduce(a @ b)                (row-parallel linear, replicated output)
    flash_decode(q, k, v, lengths)                       (decode attention over a sequence-split KV cache)

`AutofuseOps` implements it with autofuse's public API (each call goes to the variant autofuse's
policy picks: NCCL + cuBLAS, or a fused / heap kernel); `TorchOps` is the baseline: torch.distributed
collectives + torch.matmul, and for decode attention the same split-KV kernel with an NCCL
all-gather of the partials (`autofuse.flash_decode(..., variant="bsp")`). Everything else (norms,
RoPE, the prefill attention kernel, SwiGLU) is the same code in both.

Tensor parallelism over every rank of a process group, W ranks:
- Prefill (sequence-parallel form): the hidden state of T tokens is split by rows, rank r holds
  tokens [r*T/W, (r+1)*T/W). QKV and gate+up are all-gather + column-parallel GEMMs (`ag_gemm`:
  every rank gets all T tokens for its T/W share of heads / MLP columns); attention runs on this
  rank's query heads and KV heads with a standard causal kernel
  (`torch.nn.functional.scaled_dot_product_attention(is_causal=True)`, KV heads repeated for GQA);
  o_proj and down_proj are row-parallel GEMMs + reduce-scatter (`gemm_rs`), which return this
  rank's rows, so norms, residuals and SwiGLU run on T/W tokens only.
- Decode (all-reduce form): the hidden state of B sequences (one new token each) is replicated.
  The KV cache is split along the SEQUENCE: every rank holds all KV heads for the positions it
  owns (blocks of `block` positions dealt round-robin over the ranks; see `KVCache`), so
  `autofuse.flash_decode` needs every query head on every rank. Chosen: the QKV projection is
  row-parallel with an all-reduce (`gemm_ar(h[:, K_r], Wqkv[K_r, :])`). Each rank reads 1/W of
  Wqkv, as a column-parallel QKV would, and gets q, k and v of every head, which is what both the
  attention (all query heads) and the cache (the new token's k/v go to the rank owning its
  position, with all heads) need. The all-reduce moves B x (Hq + 2 Hkv) x D elements (2.6 MB at
  B=128 for Llama-3-70B) and goes through autofuse like the other GEMMs, so it can be fused too.
  Rejected: a column-parallel QKV then an all-gather of heads (a third collective kind that
  autofuse has no op for), and a replicated QKV (W times the weight bytes, in a phase that is
  weight-bandwidth bound). The price: decode keeps its own row shard of Wqkv beside prefill's
  column shard (1/W of Wqkv per rank, about 10% of a Llama-3-70B layer's weights at W=2).
  o_proj and down_proj are row-parallel GEMMs + all-reduce (`gemm_ar`); gate+up is a local
  column-parallel GEMM (torch.matmul in both layers).
Prefill does not write the decode cache: its K/V are split by heads, the cache by positions, and
moving one to the other is an all-to-all outside this example.

Weights are random (seeded, generated locally on every rank, so no files), stored as (in, out)
matrices (x @ W, the transpose of Hugging Face's layout); configs: Llama-3-70B, Llama-3-8B and a
tiny one for CPU tests. `examples/llama_layer.py` runs it (checks autofuse's layer against the
baseline layer, times both on GPUs); `autofuse bench layer` benchmarks it
(autofuse/bench/bench_layer.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autofuse
from autofuse.comm.world import all_gather_single, reduce_scatter_single

if TYPE_CHECKING:
    from autofuse.comm.world import World


# ------------------------------------------------------------------------------------------ configs
@dataclass(frozen=True)
class LlamaConfig:
    """The sizes of one Llama-3 decoder layer."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    rope_theta: float = 500000.0
    eps: float = 1e-5


CONFIGS = {
    "70b": LlamaConfig(hidden=8192, heads=64, kv_heads=8, head_dim=128, mlp=28672),
    "8b": LlamaConfig(hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336),
    "tiny": LlamaConfig(hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=128),
}


def check_tp(cfg: LlamaConfig, world: int) -> None:
    """Raise ValueError unless `cfg` splits evenly over `world` ranks (heads, KV heads, hidden, MLP)."""
    for name, n in (("heads", cfg.heads), ("kv_heads", cfg.kv_heads), ("hidden", cfg.hidden), ("mlp", cfg.mlp)):
        if n % world:
            raise ValueError(f"{name}={n} is not divisible by the tensor-parallel size {world}")


# ------------------------------------------------------------------------- the communicating steps
class TPOps(Protocol):
    """The four communicating steps of the layer (see the module docstring)."""

    def ag_gemm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor: ...
    def gemm_rs(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor: ...
    def gemm_ar(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor: ...
    def flash_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor: ...


class AutofuseOps:
    """autofuse's public API: each call runs the variant autofuse picks for its shapes, or the one
    `variants` forces for its op (e.g. {"ag_gemm": "push"}; autofuse's `variant=` argument)."""

    def __init__(self, group: Any = None, variants: dict[str, str] | None = None):
        self.group = group
        self.variants = dict(variants or {})

    def ag_gemm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return autofuse.ag_gemm(a, b, group=self.group, variant=self.variants.get("ag_gemm"))

    def gemm_rs(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return autofuse.gemm_rs(a, b, group=self.group, variant=self.variants.get("gemm_rs"))

    def gemm_ar(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return autofuse.gemm_ar(a, b, group=self.group, variant=self.variants.get("gemm_ar"))

    def flash_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return autofuse.flash_decode(q, k, v, lengths, group=self.group, variant=self.variants.get("flash_decode"))




class TorchOps:
    """The baseline: torch.distributed collectives + torch.matmul, one after the other (NCCL on GPUs,
    gloo on CPU); decode attention is autofuse's split-KV kernel + an NCCL all-gather (variant bsp)."""

    def __init__(self, group: Any = None):
        self.group = group
        self.world = dist.get_world_size(group)

    def all_gather_rows(self, a: torch.Tensor) -> torch.Tensor:
        out = a.new_empty((a.shape[0] * self.world, *a.shape[1:]))
        all_gather_single(out, a.contiguous(), group=self.group)
        return out

    def reduce_scatter_rows(self, c: torch.Tensor) -> torch.Tensor:
        out = c.new_empty((c.shape[0] // self.world, *c.shape[1:]))
        reduce_scatter_single(out, c, group=self.group)
        return out

    def all_reduce(self, c: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(c, group=self.group)
        return c

    def ag_gemm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.all_gather_rows(a), b)

    def gemm_rs(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.reduce_scatter_rows(torch.matmul(a, b))

    def gemm_ar(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(torch.matmul(a, b))

    def flash_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return autofuse.flash_decode(q, k, v, lengths, group=self.group, variant="bsp")


# ---------------------------------------------------------------------------------------- weights
@dataclass
class TPWeights:
    """One rank's shards of a layer's weights, (in, out) matrices.

    qkv: (hidden, (Hq/W + 2 Hkv/W) D), this rank's query heads, then its KV heads' k, then v (prefill).
    qkv_rows: (hidden/W, (Hq + 2 Hkv) D), rows r of [Wq | Wk | Wv] (decode, see the module docstring).
    o: (Hq/W D, hidden); gate_up: (hidden, 2 mlp/W), this rank's gate columns then its up columns;
    down: (mlp/W, hidden); attn_norm, mlp_norm: (hidden,), replicated.
    """

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_rows: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def full_weights(cfg: LlamaConfig, seed: int = 0, device: Any = "cpu",
                 dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every weight of the layer, unsharded, deterministic in (seed, device type).

    Matrices are N(0, 1/fan_in) so activations keep unit scale through the layer; norm weights are
    1 + N(0, 0.1^2). Values are rounded to `dtype` once (a float64 reference casts these back).
    """
    g = torch.Generator(device=device).manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g, device=device).mul_(rows ** -0.5).to(dtype)

    def norm() -> torch.Tensor:
        return torch.randn(cfg.hidden, generator=g, device=device).mul_(0.1).add_(1.0).to(dtype)

    h, d = cfg.hidden, cfg.head_dim
    return {"attn_norm": norm(), "mlp_norm": norm(),
            "wq": mat(h, cfg.heads * d), "wk": mat(h, cfg.kv_heads * d), "wv": mat(h, cfg.kv_heads * d),
            "wo": mat(cfg.heads * d, h), "wg": mat(h, cfg.mlp), "wu": mat(h, cfg.mlp), "wd": mat(cfg.mlp, h)}


def shard_weights(full: dict[str, torch.Tensor], cfg: LlamaConfig, rank: int, world: int) -> TPWeights:
    """Rank `rank`'s shards of `full` (see TPWeights), as new contiguous tensors."""
    check_tp(cfg, world)
    d = cfg.head_dim
    hq, hkv, m, kr = cfg.heads // world, cfg.kv_heads // world, cfg.mlp // world, cfg.hidden // world
    qs, ks, ms = (slice(rank * n, (rank + 1) * n) for n in (hq * d, hkv * d, m))
    wq, wk, wv = full["wq"], full["wk"], full["wv"]
    return TPWeights(
        attn_norm=full["attn_norm"].clone(), mlp_norm=full["mlp_norm"].clone(),
        qkv=torch.cat([wq[:, qs], wk[:, ks], wv[:, ks]], dim=1).contiguous(),
        qkv_rows=torch.cat([wq[rank * kr:(rank + 1) * kr], wk[rank * kr:(rank + 1) * kr],
                            wv[rank * kr:(rank + 1) * kr]], dim=1).contiguous(),
        o=full["wo"][qs].contiguous(),
        gate_up=torch.cat([full["wg"][:, ms], full["wu"][:, ms]], dim=1).contiguous(),
        down=full["wd"][ms].contiguous())


def random_weights(cfg: LlamaConfig, rank: int, world: int, seed: int = 0, device: Any = "cpu",
                   dtype: torch.dtype = torch.bfloat16) -> TPWeights:
    """This rank's shards of `full_weights(cfg, seed)` (the full weights are made, sliced, freed)."""
    full = full_weights(cfg, seed, device, dtype)
    w = shard_weights(full, cfg, rank, world)
    del full
    return w


# ------------------------------------------------------------------------------------------ KV cache
class KVCache:
    """This rank's part of a KV cache split along the sequence: all KV heads, the positions it owns.

    Position p belongs to rank (p // block) % W, at slot (p // (block W)) block + p % block, so every
    rank's slots fill from 0 upwards as the sequence grows and the ranks' shares differ by at most
    one block. k, v: (B, Hkv, capacity + 1, D); the last slot is scratch, written (never read) for
    sequences whose new token another rank owns, which keeps `append` free of host syncs (CUDA
    graphs). `keys` / `values` are the (B, Hkv, capacity, D) views given to the attention kernel.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, rank: int, world: int, block: int):
        self.k, self.v, self.rank, self.world, self.block = k, v, rank, world, block
        self.capacity = k.shape[2] - 1
        self.keys, self.values = k[:, :, :self.capacity], v[:, :, :self.capacity]
        self._batch = torch.arange(k.shape[0], device=k.device)

    @staticmethod
    def slots_for(max_tokens: int, world: int, block: int) -> int:
        """Slots one rank needs for sequences of up to `max_tokens` positions."""
        return -(-max_tokens // (block * world)) * block

    @classmethod
    def empty(cls, cfg: LlamaConfig, batch: int, max_tokens: int, rank: int, world: int, block: int = 64,
              device: Any = "cpu", dtype: torch.dtype = torch.bfloat16) -> "KVCache":
        """An empty cache for `batch` sequences of up to `max_tokens` positions (fill it with `append`)."""
        shape = (batch, cfg.kv_heads, cls.slots_for(max_tokens, world, block) + 1, cfg.head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype),
                   rank, world, block)

    @classmethod
    def random(cls, cfg: LlamaConfig, batch: int, max_tokens: int, rank: int, world: int, block: int = 64,
               seed: int = 0, device: Any = "cpu", dtype: torch.dtype = torch.bfloat16) -> "KVCache":
        """A cache whose every slot holds random (post-RoPE) keys and values, seeded per rank."""
        shape = (batch, cfg.kv_heads, cls.slots_for(max_tokens, world, block) + 1, cfg.head_dim)
        g = torch.Generator(device=device).manual_seed(seed * 1009 + rank)
        k = torch.randn(shape, generator=g, device=device, dtype=dtype)
        return cls(k, torch.randn(shape, generator=g, device=device, dtype=dtype), rank, world, block)

    @classmethod
    def from_full(cls, k: torch.Tensor, v: torch.Tensor, max_tokens: int, rank: int, world: int,
                  block: int = 64) -> "KVCache":
        """This rank's part of a full cache k, v (B, Hkv, S, D) holding positions 0..S-1."""
        B, H, S, D = k.shape
        shape = (B, H, cls.slots_for(max(max_tokens, S), world, block) + 1, D)
        cache = cls(k.new_zeros(shape), v.new_zeros(shape), rank, world, block)
        pos = torch.arange(S, device=k.device)
        mine = ((pos // block) % world) == rank
        slots = (pos // (block * world)) * block + pos % block
        cache.k[:, :, slots[mine]] = k[:, :, mine]
        cache.v[:, :, slots[mine]] = v[:, :, mine]
        return cache

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Store the new token's k, v (B, Hkv, D) at positions `pos` (B,) where this rank owns them."""
        owner = (pos // self.block) % self.world
        slot = (pos // (self.block * self.world)) * self.block + pos % self.block
        slot = torch.where(owner == self.rank, slot, self.capacity)
        self.k[self._batch, :, slot] = k
        self.v[self._batch, :, slot] = v

    def lengths(self, tokens: torch.Tensor) -> torch.Tensor:
        """int32 (B,): how many of positions [0, tokens) this rank holds (they are slots 0..n-1)."""
        per_round = self.block * self.world
        rest = tokens % per_round - self.rank * self.block
        return ((tokens // per_round) * self.block + rest.clamp(0, self.block)).to(torch.int32)


# ------------------------------------------------------------------------------- the local math
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalised in float32 (float64 stays float64), scaled in x's dtype."""
    xf = x.float() if x.dtype != torch.float64 else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of x (N, H, D) at positions pos (N,); contiguous result.

    Angles in float64 (positions up to 32K make float32 angles off by ~1e-3 rad), the rotation in
    float32 (float64 inputs stay float64).
    """
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None, None] * inv
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = ang.cos().to(work), ang.sin().to(work)
    x1, x2 = x[..., :d // 2].to(work), x[..., d // 2:].to(work)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of T tokens: q (T, Hq, D), k, v (T, Hkv, D) -> (T, Hq D).

    KV heads are repeated for GQA (query head h reads KV head h // (Hq / Hkv)) so that the fused
    flash kernel of scaled_dot_product_attention runs on GPUs.
    """
    t, hq, d = q.shape
    g = hq // k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)
    kh = k.transpose(0, 1).repeat_interleave(g, dim=0).unsqueeze(0)
    vh = v.transpose(0, 1).repeat_interleave(g, dim=0).unsqueeze(0)
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    return o[0].transpose(0, 1).reshape(t, hq * d)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a [gate | up] matrix."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --------------------------------------------------------------------------------------- the layer
class TPLlamaLayer:
    """One Llama-3 decoder layer over the ranks of `group`; `ops` decides how it communicates."""

    def __init__(self, cfg: LlamaConfig, weights: TPWeights, ops: TPOps, group: Any = None):
        self.cfg, self.w, self.ops, self.group = cfg, weights, ops, group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        check_tp(cfg, self.world)
        self.hq, self.hkv = cfg.heads // self.world, cfg.kv_heads // self.world
        self.k_rows = slice(self.rank * cfg.hidden // self.world, (self.rank + 1) * cfg.hidden // self.world)
        self.q_heads = slice(self.rank * self.hq, (self.rank + 1) * self.hq)

    def prefill(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """One sequence of T tokens at positions start.. ; x: this rank's T/W rows (T/W, hidden) -> same."""
        cfg, w, ops = self.cfg, self.w, self.ops
        d, hq, hkv = cfg.head_dim, self.hq, self.hkv
        t = x.shape[0] * self.world
        pos = torch.arange(start, start + t, device=x.device)
        qkv = ops.ag_gemm(rms_norm(x, w.attn_norm, cfg.eps), w.qkv)        # (T, (hq + 2 hkv) D): all tokens
        q = rope(qkv[:, :hq * d].view(t, hq, d), pos, cfg.rope_theta)
        k = rope(qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d), pos, cfg.rope_theta)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        x = x + ops.gemm_rs(causal_attention(q, k, v), w.o)               # back to this rank's T/W rows
        gate_up = ops.ag_gemm(rms_norm(x, w.mlp_norm, cfg.eps), w.gate_up)  # (T, 2 mlp/W)
        return x + ops.gemm_rs(swiglu(gate_up), w.down)

    def decode(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One new token per sequence: x (B, hidden) on every rank, pos (B,) its positions -> (B, hidden).

        Writes the new k, v into `cache` (on the rank owning each position) and attends over
        positions 0..pos. No host syncs: it can be captured in a CUDA graph.
        """
        cfg, w, ops = self.cfg, self.w, self.ops
        d, b, nq, nkv = cfg.head_dim, x.shape[0], cfg.heads, cfg.kv_heads
        h = rms_norm(x, w.attn_norm, cfg.eps)
        qkv = ops.gemm_ar(h[:, self.k_rows].contiguous(), w.qkv_rows)     # (B, (Hq + 2 Hkv) D): every head
        q = rope(qkv[:, :nq * d].view(b, nq, d), pos, cfg.rope_theta)
        k = rope(qkv[:, nq * d:(nq + nkv) * d].view(b, nkv, d), pos, cfg.rope_theta)
        cache.append(k, qkv[:, (nq + nkv) * d:].view(b, nkv, d), pos)
        o = ops.flash_decode(q, cache.keys, cache.values, cache.lengths(pos + 1))  # (B, Hq, D) on every rank
        x = x + ops.gemm_ar(o[:, self.q_heads].reshape(b, self.hq * d).contiguous(), w.o)
        gate_up = torch.matmul(rms_norm(x, w.mlp_norm, cfg.eps), w.gate_up)
        return x + ops.gemm_ar(swiglu(gate_up), w.down)


def make_layers(cfg: LlamaConfig, group: Any = None, seed: int = 0, device: Any = "cpu",
                dtype: torch.dtype = torch.bfloat16) -> tuple[TPLlamaLayer, TPLlamaLayer]:
    """(autofuse layer, baseline layer) sharing one set of random weights."""
    w = random_weights(cfg, dist.get_rank(group), dist.get_world_size(group), seed, device, dtype)
    return (TPLlamaLayer(cfg, w, AutofuseOps(group), group), TPLlamaLayer(cfg, w, TorchOps(group), group))


# ------------------------------------------------------------------------------ run under torchrun
def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def capture(fn: Any) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, what the captured call returned): one call of fn on a side stream first (the warm-up
    torch asks for before a capture), then one call captured in a CUDA graph, to replay with
    `graph.replay()` into the same output tensors."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def time_us(fn: Any, graph: bool, reps: int = 20, group: Any = None) -> float:
    """Median us per call of fn (captured in a CUDA graph and replayed if `graph`), max over ranks."""
    fn()
    if graph:
        fn = capture(fn)[0].replay
    torch.cuda.synchronize()
    dist.barrier(group=group)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    t = torch.tensor([sorted(times)[reps // 2]], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def forced_sets(world: World) -> list[dict[str, str]]:
    """Configurations that force every non-bsp variant available here at least once: set i takes each
    op's i-th variant (cycling), e.g. [{"ag_gemm": "pull", "gemm_rs": "push_last", ...}, ...]."""
    from autofuse.core import registry

    per_op = {op: [n for n, v in registry.get(op).variants.items() if n != "bsp" and v.available(world)]
              for op in registry.names()}
    per_op = {op: vs for op, vs in per_op.items() if vs}
    runs = max((len(vs) for vs in per_op.values()), default=0)
    return [{op: vs[i % len(vs)] for op, vs in per_op.items()} for i in range(runs)]
