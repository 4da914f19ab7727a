"""What MoE's dispatch/combine pair shares: problems, routings, inputs, the float64 references, the
routing plan, the grouped GEMM, the handle's layout and the bulk-synchronous all-to-alls.

Expert parallelism: E experts split evenly over the W ranks of the group, rank r holding experts
[r * L, (r + 1) * L), L = E / W. Every rank has T tokens (the same T on every rank), each routed to
its top-k experts (`topk_ids` T x k, `topk_weights` T x k). A *slot* is one (token, j) pair, slot
s = t * k + j; every slot becomes one row sent to the rank owning its expert.

Row orders (the same in every variant, so outputs compare exactly):
- sent: this rank's slots sorted by expert, stable (`order`): by owner rank, then local expert, then slot;
- received (`h`, the handle's `rows`): grouped by local expert, then by source rank, then by the
  source's slot order. Rows beyond the used count are zero.

Capacity: a rank receives at most W * T * k rows (every slot of every rank routed here), so `h` is
C x F with C = W * T * k: static shapes from the call's shapes alone, which a CUDA graph of a
decode step can capture. Nothing is ever dropped.

The handle (`Handle`, key: the dispatch problem's key) carries what combine and the backward need:
`counts` W x L (rows received from each source rank for each local expert), `sent` E (rows this rank
sent to each expert), `order` T*k (the slot of each sent row), `index` C (for each row of `h`, its
position in the received, source-major order; -1 beyond the used count), `weights` T x k (the
call's topk_weights, applied by combine) and `rows` C x H (the received token rows, grouped as `h`).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as fn

from autofuse.core.op import InvalidInput, Problem, default_tolerance

if TYPE_CHECKING:
    from autofuse.comm.world import World

DISPATCH, COMBINE = "moe_dispatch", "moe_combine"
ACTS = ("swiglu", "none")  # w1 is [L, H, 2F] (gate | up) or [L, H, F]
HANDLE = ("counts", "sent", "order", "index", "weights", "rows")  # the handle's tensors, in this order
ID_DTYPES = (torch.int32, torch.int64)


def capacity(world: int, tokens: int, topk: int) -> int:
    """Rows a rank may receive: every slot of every rank (W * T * k), so nothing is ever dropped."""
    return world * tokens * topk


EVEN = 0  # the skew dim of an even routing (what every call is keyed with)


def busiest_share(problem: Problem) -> float:
    """The share of routed rows on the busiest rank: skew / 100, or 1 / W for an even routing (skew 0)."""
    return problem["skew"] / 100 if problem["skew"] else 1 / problem.world


def make_problem(op: str, dtype: Any, world: int, tokens: int, hidden: int, ffn: int, experts: int, topk: int,
                 act: str, skew: int | None = None) -> Problem:
    """A dispatch or combine problem (the pair shares its dims; C is the capacity, derived). `skew`: the
    percent of routed rows on the busiest rank, 0 (`EVEN`) for an even routing: calls are keyed by shapes
    alone, hence with 0; the sweeps also measure skewed routings, which the tables and the policy see."""
    return Problem.make(op, dtype, world, T=tokens, H=hidden, F=ffn, E=experts, k=topk, act=act,
                        C=capacity(world, tokens, topk), skew=EVEN if skew is None else int(skew))


def partner_key(problem: Problem) -> str:
    """The key of the dispatch problem of `problem` (either op's): what the pair's handle carries."""
    dims = {k: v for k, v in problem.dims if k != "C"}
    return make_problem(DISPATCH, problem.dtype, problem.world, dims["T"], dims["H"], dims["F"], dims["E"],
                        dims["k"], dims["act"], dims["skew"]).key


def local_experts(problem: Problem) -> int:
    return problem["E"] // problem.world


def check_routing(world_size: int, x: Any, ids: Any, weights: Any, w1: Any) -> tuple[int, int, int, int, str]:
    """(T, H, F, E, act) of a dispatch call's arguments, or InvalidInput saying what is wrong. w1 is
    L x H x F (act `none`) or L x H x 2 x F (`swiglu`: a view of the L x H x 2F matrix [gate | up])."""
    if not all(isinstance(t, torch.Tensor) for t in (x, ids, weights, w1)):
        raise InvalidInput(f"{DISPATCH}: x, topk_ids, topk_weights and w1 must be tensors")
    if x.dim() != 2 or ids.dim() != 2 or weights.shape != ids.shape or w1.dim() not in (3, 4) \
            or (w1.dim() == 4 and w1.shape[2] != 2):
        raise InvalidInput(f"{DISPATCH}: x (T x H), topk_ids and topk_weights (T x k), w1 (E/W x H x F, or "
                           f"E/W x H x 2 x F for SwiGLU); got {tuple(x.shape)}, {tuple(ids.shape)}, "
                           f"{tuple(weights.shape)}, {tuple(w1.shape)}")
    t, h = x.shape
    if ids.shape[0] != t or w1.shape[1] != h or ids.dtype not in ID_DTYPES or not weights.is_floating_point():
        raise InvalidInput(f"{DISPATCH}: topk_ids ({tuple(ids.shape)} {ids.dtype}: int32 or int64) and topk_weights "
                           f"({weights.dtype}: floating) need one row per token of x {tuple(x.shape)}; w1 "
                           f"{tuple(w1.shape)} needs H={h} rows")
    if w1.dtype != x.dtype or not all(v.device == x.device for v in (ids, weights, w1)):
        raise InvalidInput(f"{DISPATCH}: x and w1 share a dtype and all tensors a device")
    if t == 0 or ids.shape[1] == 0:
        raise InvalidInput(f"{DISPATCH}: needs at least one token and top-k >= 1")
    if not (x.is_contiguous() and ids.is_contiguous() and weights.is_contiguous() and w1.is_contiguous()):
        raise InvalidInput(f"{DISPATCH}: x, topk_ids, topk_weights and w1 must be contiguous")
    return t, h, w1.shape[-1], w1.shape[0] * world_size, "swiglu" if w1.dim() == 4 else "none"


def check_expert_ids(ids: torch.Tensor, experts: int) -> None:
    """InvalidInput unless every id is an expert of the group, in [0, experts). Reads two numbers on the host
    (a device sync), so dispatch runs it where a call is validated (the first call of a shape, autofuse.warmup);
    skipped for tensors without data (torch.compile's fake tensors) and inside a CUDA-graph capture."""
    from torch._subclasses.fake_tensor import FakeTensor

    if ids.is_meta or isinstance(ids, FakeTensor) or (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    lo, hi = torch.stack([ids.min(), ids.max()]).tolist()
    if lo < 0 or hi >= experts:
        raise InvalidInput(f"{DISPATCH}: topk_ids must be expert ids in [0, {experts}) (the group's E experts), got "
                           f"ids from {lo} to {hi}")


def w1_shape(problem: Problem) -> tuple[int, ...]:
    """This rank's w1: L x H x 2 x F (swiglu) or L x H x F."""
    local, h, f = local_experts(problem), problem["H"], problem["F"]
    return (local, h, 2, f) if problem["act"] == "swiglu" else (local, h, f)


def act_forward(pre: torch.Tensor, act: str) -> torch.Tensor:
    """SwiGLU (silu(gate) * up; gate the first half of the columns) or identity, in float32."""
    pre = pre.float()
    if act == "none":
        return pre
    f = pre.shape[-1] // 2
    return fn.silu(pre[..., :f]) * pre[..., f:]


def act_backward(pre: torch.Tensor, grad: torch.Tensor, act: str) -> torch.Tensor:
    """d pre from d act(pre) (float32)."""
    pre, grad = pre.float(), grad.float()
    if act == "none":
        return grad
    f = pre.shape[-1] // 2
    g, u = pre[..., :f], pre[..., f:]
    s = torch.sigmoid(g)
    return torch.cat([grad * u * s * (1 + g * (1 - s)), grad * g * s], dim=-1)


# -- inputs and references ----------------------------------------------------------------------------
# Everything is drawn on the caller's device (the World's) from seeded generators, so a rank makes only
# what it needs: its tokens and routing, its own experts' weights; expert e's weights come from their own
# seed, so any rank rebuilds any expert alike (the float64 references rebuild the experts they need).
CPU = torch.device("cpu")
REF_CHUNK = 4096  # rows per float64 matmul of the references (bounded memory at 8192 tokens)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def routing(problem: Problem, rank: int, seed: int, device: torch.device = CPU) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s topk_ids (int64) and topk_weights (float32, rows summing to 1) for `problem`'s skew,
    on `device`: each token goes wholly to rank 0's experts with the probability that makes rank 0's
    expected share of the rows `skew` percent (100: every row; 100/W: none beyond an even share), else to
    k distinct experts drawn uniformly (the top-k of uniform scores; no host sync)."""
    t, e, k, w = problem["T"], problem["E"], problem["k"], problem.world
    local = e // w
    g = _generator(device, seed * 7919 + rank * 104729 + 17)
    share = min(1.0, busiest_share(problem))
    q = 0.0 if w == 1 else max(0.0, (share - 1 / w) / (1 - 1 / w))
    ids = torch.topk(torch.rand(t, e, generator=g, device=device), k, dim=1).indices
    skewed = torch.rand(t, generator=g, device=device) < q
    if q > 0 and k <= local:
        on_rank0 = torch.topk(torch.rand(t, local, generator=g, device=device), k, dim=1).indices
        ids = torch.where(skewed.unsqueeze(1), on_rank0, ids)
    weights = torch.rand(t, k, generator=g, device=device) + 0.1
    return ids, weights / weights.sum(1, keepdim=True)


def _expert(problem: Problem, expert: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert `expert`'s w1 (H x 2F or F) and w2 (F x H), float32, from the expert's own seed."""
    h, f = problem["H"], problem["F"]
    cols = 2 * f if problem["act"] == "swiglu" else f
    g = _generator(device, seed * 31 + 5 + expert * 1_000_003)
    w1 = torch.randn(h, cols, generator=g, device=device) / math.sqrt(h)
    return w1, torch.randn(f, h, generator=g, device=device) / math.sqrt(f)


def expert_weights(problem: Problem, seed: int, experts: Sequence[int] | None = None, device: torch.device = CPU,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """w1 (n x H x 2F or F) and w2 (n x F x H) of `experts` (default: all E) in `dtype`, the same on
    every rank; made one expert at a time (peak: one expert in float32 beyond the result)."""
    h, f = problem["H"], problem["F"]
    which = range(problem["E"]) if experts is None else list(experts)
    cols = 2 * f if problem["act"] == "swiglu" else f
    w1 = torch.empty(len(which), h, cols, dtype=dtype, device=device)
    w2 = torch.empty(len(which), f, h, dtype=dtype, device=device)
    for i, e in enumerate(which):
        a, b = _expert(problem, e, seed, device)
        w1[i], w2[i] = a, b
    return w1, w2


def tokens(problem: Problem, rank: int, seed: int, device: torch.device = CPU) -> torch.Tensor:
    """Rank `rank`'s x (T x H), float32, on `device`."""
    g = _generator(device, seed * 1009 + rank * 13 + 3)
    return torch.randn(problem["T"], problem["H"], generator=g, device=device)


def rank_inputs(problem: Problem, rank: int, seed: int, device: torch.device = CPU) -> tuple[torch.Tensor, ...]:
    """(x, topk_ids, topk_weights, w1 shard, w2 shard) of `rank`, on `device`, in the problem's dtype
    (routing: int64 ids, float32 weights); only the rank's own E/W experts are made."""
    dt, local = problem.torch_dtype, local_experts(problem)
    ids, weights = routing(problem, rank, seed, device)
    w1, w2 = expert_weights(problem, seed, range(rank * local, (rank + 1) * local), device, dt)
    return tokens(problem, rank, seed, device).to(dt), ids, weights, w1.reshape(w1_shape(problem)), w2


def _expert64(problem: Problem, expert: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert `expert`'s weights as the op gets them (rounded to the problem's dtype), in float64."""
    return tuple(w.to(problem.torch_dtype).double() for w in _expert(problem, expert, seed, device))


def _expert_rows64(problem: Problem, rows: torch.Tensor, expert: int, seed: int, second: bool) -> torch.Tensor:
    """act(rows @ w1[expert]) (with `second`: @ w2[expert] too) in float64, REF_CHUNK rows at a time."""
    w1, w2 = _expert64(problem, expert, seed, rows.device)
    out = rows.new_empty(rows.shape[0], problem["H"] if second else problem["F"])
    for s in range(0, rows.shape[0], REF_CHUNK):
        v = _act64(rows[s:s + REF_CHUNK] @ w1, problem["act"])
        out[s:s + REF_CHUNK] = v @ w2 if second else v
    return out


def expert_rows_reference(problem: Problem, rank: int, seed: int, second: bool,
                          device: torch.device = CPU) -> torch.Tensor:
    """In float64 on `device`: the rows `rank` computes for its experts, in the received order (C rows,
    zero beyond the used ones): act(x @ w1) for dispatch's `h`; with `second`, times w2 as well. Every
    source's tokens and routing are rebuilt (small), and only this rank's experts, one at a time."""
    w, local, k = problem.world, local_experts(problem), problem["k"]
    flat = torch.stack([routing(problem, src, seed, device)[0].reshape(-1) for src in range(w)])  # W x T*k
    x = torch.stack([tokens(problem, src, seed, device).to(problem.torch_dtype).double() for src in range(w)])
    src, slot = (flat // local == rank).nonzero(as_tuple=True)  # source-major, slots ascending
    expert = flat[src, slot] % local
    order = torch.sort(expert, stable=True).indices  # grouped by local expert, then source, then slot
    rows = x[src[order], slot[order] // k]
    out = torch.zeros(problem["C"], problem["H"] if second else problem["F"], dtype=torch.float64, device=device)
    start = 0
    for l, n in enumerate(torch.bincount(expert, minlength=local).tolist()):
        if n:
            out[start:start + n] = _expert_rows64(problem, rows[start:start + n], rank * local + l, seed, second)
        start += n
    return out


def _act64(pre: torch.Tensor, act: str) -> torch.Tensor:
    if act == "none":
        return pre
    f = pre.shape[-1] // 2
    return fn.silu(pre[..., :f]) * pre[..., f:]


def moe_reference(problem: Problem, rank: int, seed: int, device: torch.device = CPU) -> torch.Tensor:
    """The unsharded MoE block in float64 on `rank`'s tokens, on `device`: y_t = sum_j w_tj *
    expert_{id_tj}(x_t), each expert's slots in one batch, only the experts the rank's tokens use."""
    k = problem["k"]
    x = tokens(problem, rank, seed, device).to(problem.torch_dtype).double()
    ids, weights = routing(problem, rank, seed, device)
    flat, slot_w = ids.reshape(-1), weights.reshape(-1).double()
    order = torch.sort(flat, stable=True).indices
    y = torch.zeros(problem["T"], problem["H"], dtype=torch.float64, device=device)
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=problem["E"]).tolist()):
        if n:
            slots = order[start:start + n]
            rows = _expert_rows64(problem, x[slots // k], e, seed, second=True)
            y.index_add_(0, slots // k, rows * slot_w[slots].unsqueeze(1))
        start += n
    return y


def unsharded(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              act: str) -> torch.Tensor:
    """sum_j weights[t, j] * (act(x_t @ w1[ids[t, j]]) @ w2[ids[t, j]]): the MoE block on one device,
    differentiable (tests take float64 gradients of it)."""
    pre = torch.einsum("th,tjhc->tjc", x, w1[ids])
    v = _act64(pre, act)
    return torch.einsum("tj,tjh->th", weights, torch.einsum("tjf,tjfh->tjh", v, w2[ids]))


def tolerance(problem: Problem) -> float:
    return 2 * default_tolerance(problem.dtype, max(problem["H"], problem["F"]))


def features(problem: Problem) -> dict[str, float]:
    """Rows moved per rank (log2), bytes per row, the work per expert and the experts per rank."""
    t, k, h, f, w = problem["T"], problem["k"], problem["H"], problem["F"], problem.world
    rows = t * k
    return {"log2_rows": math.log2(max(rows, 1)), "log2_row_bytes": math.log2(h * problem.torch_dtype.itemsize),
            "log2_rows_per_expert": math.log2(max(rows * w / problem["E"], 1e-3)),
            "local_experts": float(problem["E"] // w), "log2_flops": math.log2(2.0 * rows * h * f),
            "busiest_share": busiest_share(problem)}


def sweep(op: str, kind: str, world: int) -> list[Problem]:
    """Kinds: `cpu` (two tiny problems for the CPU emulation), `moe` and `gpu` (GPUs): Mixtral-8x7B
    (H 4096, F 14336, E 8, top-2), Qwen3-30B-A3B (2048, 768, 128, top-8) and a DeepSeek-V3-like shape
    (7168, 2048, 256, top-8) at 1..8192 tokens per rank, even routing, the shapes whose experts divide
    over the ranks; `skew` (tiny, every row on rank 0's experts); `scaling` (64 tokens over the ranks,
    8 experts). Unknown kinds raise ValueError, `default` among them: on GPUs the MoE ops are tuned with
    `autofuse tune --sweep moe`, not in the default tune (2026-11-27, 4x H200: two Mixtral T=1 baselines
    spent 130 s of a 3.5-minute tune and failed, with the references then on the host and bsp, which
    cannot be captured, without a graph-mode row; both fixed since, not yet re-measured on GPUs)."""
    if kind == "cpu":
        return [make_problem(op, "float32", world, t, 32, 16, 2 * world, 2, "swiglu") for t in (4, 16)]
    if kind == "skew":
        return [make_problem(op, "float32", world, 8, 32, 16, 2 * world, 2, "swiglu", 100)]
    if kind == "scaling":
        return [make_problem(op, "float32", world, 64 // world, 32, 16, 8, 2, "swiglu")] if world <= 8 else []
    if kind not in ("gpu", "moe"):  # not in `default`: a plain `autofuse tune` on GPUs leaves MoE out (see above)
        raise ValueError(f"{op}: unknown sweep {kind!r}: cpu, moe (or gpu), skew or scaling")
    shapes = [(4096, 14336, 8, 2), (2048, 768, 128, 8), (7168, 2048, 256, 8)]  # H, F, E, k
    return [make_problem(op, "bfloat16", world, t, h, f, e, k, "swiglu")
            for h, f, e, k in shapes if e % world == 0 for t in (1, 8, 64, 256, 1024, 4096, 8192)]


def problem_dims(problem: Problem) -> tuple[int, int, int, int, int, int, int]:
    """(W, T, H, F, L, k, C) of a problem."""
    return (problem.world, problem["T"], problem["H"], problem["F"], local_experts(problem), problem["k"],
            problem["C"])


def handle_specs(problem: Problem, id_dtype: torch.dtype = torch.int64,
                 weight_dtype: torch.dtype = torch.float32) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each handle tensor (`HANDLE` order)."""
    w, t, h, _, local, k, c = problem_dims(problem)
    i64 = torch.int64
    return {"counts": ((w, local), i64), "sent": ((problem["E"],), i64), "order": ((t * k,), i64),
            "index": ((c,), i64), "weights": ((t, k), weight_dtype), "rows": ((c, h), problem.torch_dtype)}


# -- the plan and the grouped GEMM ------------------------------------------------------------------
def send_plan(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, sent): this rank's slots sorted by expert (stable), and rows per expert (E)."""
    flat = ids.reshape(-1).long()
    return torch.sort(flat, stable=True).indices, torch.bincount(flat, minlength=experts)


def group_index(counts: torch.Tensor) -> torch.Tensor:
    """For rows received source-major (counts W x L: per source, per local expert), the permutation
    that groups them by local expert, then source: row p of the grouped rows is received row index[p]."""
    w, local = counts.shape
    block = torch.repeat_interleave(torch.arange(w * local, device=counts.device), counts.reshape(-1))
    src, l = block // local, block % local
    return torch.sort(l * w + src, stable=True).indices


def grouped_mm(a: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows `a` grouped by expert (`counts[l]` rows for expert l) times their expert's w[l]: torch's
    grouped GEMM where it runs (CUDA, 16-byte aligned rows), else one matmul per expert."""
    n = sum(counts)
    out = a.new_empty(n, w.shape[2])
    if n == 0:
        return out
    if a.is_cuda and hasattr(torch, "_grouped_mm") and a.dtype == torch.bfloat16 \
            and (a.shape[1] * 2) % 16 == 0 and (w.shape[2] * 2) % 16 == 0:
        offs = torch.tensor(counts, device=a.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(a[:n], w, offs=offs)
    start = 0
    for l, c in enumerate(counts):
        if c:
            torch.matmul(a[start:start + c], w[l], out=out[start:start + c])
        start += c
    return out


# -- bulk-synchronous data movement -----------------------------------------------------------------
def a2a(world: World, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
        what: str) -> None:
    """torch.distributed's all_to_all_single with these splits (bounded on gloo: World.collective)."""
    world.collective(dist.all_to_all_single, out, inp, out_splits, in_splits, what=what)


def exchange_counts(world: World, sent: torch.Tensor, what: str) -> torch.Tensor:
    """counts W x L: rows each source rank sends to each of this rank's local experts (from every
    rank's `sent`, rows per expert)."""
    local = sent.numel() // world.size
    counts = torch.empty_like(sent)
    a2a(world, counts, sent, [local] * world.size, [local] * world.size, what)
    return counts.view(world.size, local)


def to_experts(world: World, send_rows: torch.Tensor, sent: torch.Tensor, counts: torch.Tensor,
               index: torch.Tensor, capacity_rows: int, what: str) -> torch.Tensor:
    """Rows in sent order (this rank's, sorted by expert) -> this rank's received rows, grouped by local
    expert (`index`), C rows, zero beyond the used ones."""
    w = world.size
    in_splits = sent.view(w, -1).sum(1).tolist()
    out_splits = counts.sum(1).tolist()
    recv = send_rows.new_empty(sum(out_splits), send_rows.shape[1])
    a2a(world, recv, send_rows.contiguous(), out_splits, in_splits, what)
    out = send_rows.new_zeros(capacity_rows, send_rows.shape[1])
    n = recv.shape[0]
    out[:n] = recv[index[:n]]
    return out


def to_tokens(world: World, rows: torch.Tensor, sent: torch.Tensor, counts: torch.Tensor, index: torch.Tensor,
              what: str) -> torch.Tensor:
    """Grouped rows of this rank's experts (C, the used ones first) -> the rows of this rank's slots, in
    sent order (T*k): `to_experts` backwards."""
    w = world.size
    in_splits = counts.sum(1).tolist()
    out_splits = sent.view(w, -1).sum(1).tolist()
    n = sum(in_splits)
    ret = rows.new_empty(n, rows.shape[1])
    ret[index[:n]] = rows[:n]
    back = rows.new_empty(sum(out_splits), rows.shape[1])
    a2a(world, back, ret, out_splits, in_splits, what)
    return back


def weighted_sum(back: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
    """out[t] = sum_j weights[t, j] * back[row of slot (t, j)], accumulated in float32."""
    k = weights.shape[1]
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    acc.index_add_(0, order // k, back.float() * weights.reshape(-1)[order].float().unsqueeze(1))
    out.copy_(acc)


def dispatch_problem(world_size: int, x: Any, ids: Any, weights: Any, w1: Any) -> Problem:
    """The dispatch Problem of a call (shapes only: the skew is the even routing's, never read from the ids)."""
    t, h, f, e, act = check_routing(world_size, x, ids, weights, w1)
    return make_problem(DISPATCH, x.dtype, world_size, t, h, f, e, ids.shape[1], act)


def dispatch_key(world_size: int, x: Any, ids: Any, w1: Any) -> str:
    """The dispatch problem's key from the shapes alone (no checks: what a trace computes)."""
    return make_problem(DISPATCH, x.dtype, world_size, x.shape[0], x.shape[1], w1.shape[-1], w1.shape[0] * world_size,
                        ids.shape[1], "swiglu" if w1.dim() == 4 else "none").key


def world_of_group(group_name: str) -> "World":
    """The World of the process group named `group_name` (the backward's custom ops take groups by name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    from autofuse.comm.world import World

    return World.from_group(_resolve_process_group(group_name))
