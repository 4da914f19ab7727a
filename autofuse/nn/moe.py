"""`ExpertParallelMoE`: a sparse MoE block (router, top-k experts with SwiGLU, optional shared expert)
whose experts are split over a process group, on autofuse's `moe_dispatch` / `moe_combine`.

Rank r of the W ranks holds experts [r L, (r + 1) L), L = E / W: `w1` (L, H, 2F: [gate | up], the
layout `moe_dispatch` reads as L x H x 2 x F, no copy per call) and `w2` (L, F, H). The router
(`gate`) is replicated. Forward on hidden states (..., H), the same on every rank (the layout of
tensor-parallel attention, where every rank holds every token):
1. the router runs on every token on every rank: logits, top-k weights and ids are the same
   everywhere (what transformers' router gives, so recorded router logits and an auxiliary loss are
   the unsharded model's);
2. the T token rows are padded to a multiple of W (padding rows: zero, weight 0, routed to the
   experts of the rank that holds them, so they never cross the network) and rank r takes
   row block r (`autofuse.nn.functional.scatter_rows`, as sequence parallelism does): every rank
   sends T/W tokens, each token is sent by exactly one rank (no expert sees a token twice);
3. `moe_dispatch` / `moe_combine` over the group (expert parallel group = the given group);
4. the row blocks are all-gathered back (`gather_rows`): the output is whole on every rank.
Gradients: the router's weights and the routing weights are replicated before the scatter, whose
backward all-gathers the blocks' gradients, so every rank gets the whole (replicated) gradient of
the router and of the input, as in Megatron's tensor-parallel regions; expert gradients are this
rank's experts' (every rank's tokens reach them). With `sequence_parallel=True` the input is this
rank's rows instead (the same count on every rank) and steps 2 and 4 are skipped; the router then
sees this rank's rows only and its gradient is summed over the group (`all_reduce_grad`). Every row
given is routed and sent: padding rows a caller adds (Llama sequence parallelism's) are zero rows,
whose expert output is zero, and the caller drops them.

Shared expert (Qwen2-MoE): tensor-parallel over the same group through the existing linears, on the
rows the block was given: gate/up column-parallel, down row-parallel, with `gemm_ar` on the whole
hidden states, or with sequence parallelism gate/up one `fuse_columns` layer (`ag_gemm`: every rank's
rows) and down `gemm_rs` (this rank's rows back). Its sigmoid gate (H -> 1) is replicated (under
sequence parallelism its gradient summed over the group, as the router's). Its output is added to
the routed experts'.

`from_module(block, group)` copies (never aliases) a transformers MoE block: Mixtral's and
Qwen2-MoE's / Qwen3-MoE's SparseMoeBlock, experts as fused 3-D parameters (transformers 5:
`experts.gate_up_proj` E x 2F x H, `experts.down_proj` E x H x F) or as a list of experts with
gate_proj/up_proj/down_proj or w1/w3/w2 nn.Linear layers (transformers 4); the router is a copy of
the block's own (5: a router module whose forward gives (logits, weights, ids)) or, for an
nn.Linear gate (4), `TopKRouter` with the block's normalisation. `unshard` gives the experts back
in the layout they came from (autofuse.nn.full_state_dict uses it). Before anything is made,
`from_module` runs the block on a few random rows and compares its output with what this module
computes from what was read (the router's weights and ids, SwiGLU experts, the shared expert): a
block that routes, scales or activates otherwise (a router post-processed in the block's forward, a
routed scaling factor, another activation) is refused, not silently misread.
"""
from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autofuse.nn import functional as tpf
from autofuse.nn import public
from autofuse.nn.linear import RowParallelLinear, fuse_columns
from autofuse.nn.swiglu import fuse_gated_mlp, silu_like
from autofuse.nn.plan import apply_plan

SHARED_PLAN = {"gate_proj": "column", "up_proj": "column", "down_proj": "row"}
LAYOUTS = ("fused", "gate_up_down", "w1_w3_w2", "own")  # where the experts came from (what `unshard` gives back)


class TopKRouter(nn.Module):
    """transformers' MoE routing: logits = rows @ weightᵀ, softmax over every expert in float32, the
    top-k, renormalised to sum 1 if `norm_topk_prob` (Mixtral always; Qwen-MoE per its config), the
    weights cast to the logits' dtype if `cast_weights` (transformers 4, and Qwen-MoE in 5) else kept
    float32. forward(rows (T, H)) -> (logits (T, E), weights (T, k), ids (T, k) int64)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool = True,
                 cast_weights: bool = False, device: Any = None, dtype: torch.dtype | None = None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"TopKRouter: top_k={top_k} must be in 1..num_experts={num_experts}")
        self.top_k, self.num_experts, self.hidden_dim = top_k, num_experts, hidden_size
        self.norm_topk_prob, self.cast_weights = bool(norm_topk_prob), bool(cast_weights)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        if not self.weight.is_meta:
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(rows.reshape(-1, self.hidden_dim), self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype) if self.cast_weights else weights, ids

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_dim}, experts={self.num_experts}, top_k={self.top_k}, "
                f"norm_topk_prob={self.norm_topk_prob}, cast_weights={self.cast_weights}")


def router_of(block: nn.Module) -> nn.Module | None:
    """A transformers MoE block's router: `gate` (Mixtral, Qwen-MoE) or `router` (GPT-OSS)."""
    for name in ("gate", "router"):
        m = getattr(block, name, None)
        if isinstance(m, nn.Module):
            return m
    return None


def jitter(block: nn.Module) -> float:
    """The router jitter noise a block (or its router) applies in training: random per rank, so refused."""
    return max(float(getattr(m, n, 0) or 0) for m in (block, router_of(block)) for n in ("jitter_noise", "router_jitter_noise"))


def is_moe_block(module: nn.Module) -> bool:
    """Whether `module` looks like a transformers sparse MoE block (a router, `gate` or `router`, and `experts`)."""
    return router_of(module) is not None and isinstance(getattr(module, "experts", None), nn.Module)


class ExpertParallelMoE(nn.Module):
    """A sparse MoE block with its experts split over `group` (module doc). Fresh: `w1`, `w2` and the
    router are drawn whole (every rank alike when seeded alike) and this rank keeps its experts; or
    made from a transformers block with `from_module`."""

    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, group: Any = None, *,
                 norm_topk_prob: bool = True, sequence_parallel: bool = False, device: Any = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.group = tpf.process_group(group)
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if num_experts % self.world:
            raise ValueError(f"ExpertParallelMoE: num_experts={num_experts} is not divisible by the group size "
                             f"{self.world}")
        self.hidden_size, self.ffn_size, self.num_experts, self.top_k = hidden_size, ffn_size, num_experts, top_k
        self.local_experts = num_experts // self.world
        self.sequence_parallel = bool(sequence_parallel)
        self.layout = "own"
        self.gate: nn.Module = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob, device=device, dtype=dtype)
        local = self.local_experts
        self.w1 = nn.Parameter(torch.empty(local, hidden_size, 2 * ffn_size, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(local, ffn_size, hidden_size, device=device, dtype=dtype))
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Module | None = None
        if not self.w1.is_meta:
            self.reset_parameters()

    def __deepcopy__(self, memo: dict) -> "ExpertParallelMoE":
        """A copy sharing the process group (a group cannot be copied; the copy's tensors are its own)."""
        return tpf.deepcopy_sharing_group(self, memo)

    def reset_parameters(self) -> None:
        """Every expert drawn whole (normal, 1/sqrt(fan-in)), this rank's kept: ranks seeded alike hold
        the experts one process seeded the same way would."""
        e, h, f = self.num_experts, self.hidden_size, self.ffn_size
        mine = slice(self.rank * self.local_experts, (self.rank + 1) * self.local_experts)
        with torch.no_grad():
            w1 = torch.randn(e, h, 2 * f, device=self.w1.device, dtype=self.w1.dtype) / math.sqrt(h)
            w2 = torch.randn(e, f, h, device=self.w2.device, dtype=self.w2.dtype) / math.sqrt(f)
            self.w1.copy_(w1[mine])
            self.w2.copy_(w2[mine])

    # -- from transformers ------------------------------------------------------------------------------
    @classmethod
    def from_module(cls, block: nn.Module, group: Any = None, sequence_parallel: bool = False) -> "ExpertParallelMoE":
        """This rank's experts of a transformers sparse MoE block (module doc), copied: the block is
        left as it was and never shares storage with the new one. ValueError naming what is not
        understood (another activation, expert biases, router noise: `read`)."""
        w1, w2, layout, gate, top_k = cls.read(block)
        e, h, f2 = w1.shape
        group = tpf.process_group(group)
        m = cls(h, f2 // 2, e, top_k, group, sequence_parallel=sequence_parallel, device="meta", dtype=w1.dtype)
        m.gate, m.layout = gate, layout
        mine = slice(m.rank * m.local_experts, (m.rank + 1) * m.local_experts)
        grad = w1.requires_grad
        m.w1, m.w2 = tpf.copied_parameter(w1[mine], grad), tpf.copied_parameter(w2[mine], grad)
        plural = getattr(block, "shared_expert", None) is None and getattr(block, "shared_experts", None) is not None
        shared = block.shared_experts if plural else getattr(block, "shared_expert", None)
        if shared is not None:  # kept under the block's own name (Ernie 4.5's is plural), so its keys stay transformers'
            setattr(m, "shared_experts" if plural else "shared_expert", _shared_expert(shared, group, sequence_parallel))
            sg = getattr(block, "shared_expert_gate", None)
            m.shared_expert_gate = copy.deepcopy(sg) if sg is not None else None
        return m

    @staticmethod
    def read(block: nn.Module) -> tuple[torch.Tensor, torch.Tensor, str, nn.Module, int]:
        """(w1 E x H x 2F, w2 E x F x H, layout, router, top_k) of a transformers sparse MoE block (views
        of its experts, a copy of its router), after every check `from_module` makes: its parts, its
        experts' form and activation, its router, its shared expert's projections, and its own forward on a
        few random rows against what was read (`_check_reads_like`). ValueError naming what is not
        understood; nothing of the block changes, so a model can be checked whole before any layer is."""
        name = type(block).__name__
        if not is_moe_block(block):
            raise ValueError(f"ExpertParallelMoE.from_module: {name} has no router (`gate` or `router`) and `experts`")
        if not isinstance(getattr(block, "gate", None), nn.Module):
            raise ValueError(f"{name}: its router is not named `gate` (expert-parallel blocks keep transformers' "
                             "`gate` keys)")
        if jitter(block):
            raise ValueError(f"{name}: router jitter noise is not supported (set router_jitter_noise=0)")
        known = {"gate", "experts", "shared_expert", "shared_experts", "shared_expert_gate"}
        extra = [n for n, _ in block.named_parameters() if n.split(".")[0] not in known]
        if extra:
            raise ValueError(f"{name}: parameters outside the router and experts ({', '.join(extra)}) are not supported")
        shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
        if shared is not None and not all(isinstance(getattr(shared, n, None), nn.Linear) for n in SHARED_PLAN):
            raise ValueError(f"{name}: its shared expert has no gate_proj / up_proj / down_proj nn.Linear layers")
        w1, w2, layout = _experts_of(block.experts, name)
        e, h, _ = w1.shape
        router = block.gate
        if isinstance(router, nn.Linear):  # transformers 4: the block routes itself
            top_k = int(getattr(block, "top_k", None) or getattr(block, "num_experts_per_tok"))
            gate: nn.Module = TopKRouter(h, e, top_k, getattr(block, "norm_topk_prob", True), cast_weights=True,
                                         device="meta")
            gate.weight = tpf.copied_parameter(router.weight, router.weight.requires_grad)
        elif isinstance(getattr(router, "weight", None), torch.Tensor) and isinstance(getattr(router, "top_k", None), int):
            top_k, gate = router.top_k, copy.deepcopy(router)  # transformers 5: its own router module
        else:
            raise ValueError(f"{name}: its gate ({type(router).__name__}) is neither an nn.Linear nor a router with "
                             "`weight` and `top_k`")
        _check_reads_like(block, gate, w1, w2, name)
        return w1, w2, layout, gate, top_k

    # -- forward ----------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        rows = hidden_states.reshape(-1, self.hidden_size)
        if self.sequence_parallel:
            x_r = rows.contiguous()
            _, weights_r, ids_r = self._summed(self.gate, x_r)
            return self._with_shared(self._experts(x_r, ids_r, weights_r), x_r).view(shape)
        n, w = rows.shape[0], self.world
        _, weights, ids = self.gate(rows)
        pad = -n % w
        per = (n + pad) // w
        if pad:
            rows = F.pad(rows, (0, 0, 0, pad))
            weights = F.pad(weights, (0, 0, 0, pad))  # weight 0: padding rows add nothing and get no gradient
            owner = torch.arange(n, n + pad, device=ids.device) // per  # the rank that sends the padding row
            local = torch.arange(self.top_k, device=ids.device) % self.local_experts
            ids = torch.cat([ids, owner[:, None] * self.local_experts + local])  # to its own experts: never sent away
        x_r = tpf.scatter_rows(rows.contiguous(), self.group)
        weights_r = tpf.scatter_rows(weights.contiguous(), self.group)
        ids_r = ids[self.rank * per:(self.rank + 1) * per].contiguous()
        y = tpf.gather_rows(self._experts(x_r, ids_r, weights_r), self.group)[:n]
        return self._with_shared(y, hidden_states.reshape(-1, self.hidden_size)).view(shape)

    def _with_shared(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y plus the shared expert's output on the same rows x (sigmoid-gated if the block has a gate)."""
        expert = self.shared_expert if self.shared_expert is not None else self._modules.get("shared_experts")
        if expert is None:
            return y
        shared = expert(x)
        if self.shared_expert_gate is not None:
            gate = self._summed(self.shared_expert_gate, x) if self.sequence_parallel else self.shared_expert_gate(x)
            shared = torch.sigmoid(gate) * shared
        return y + shared

    def _summed(self, module: nn.Module, rows: torch.Tensor) -> Any:
        """module(rows) with its (replicated) parameters' gradients summed over the group: under sequence
        parallelism the router and the shared expert's gate see only this rank's rows."""
        params = {name: tpf.all_reduce_grad(p, self.group) for name, p in module.named_parameters()}
        return torch.func.functional_call(module, params, (rows,))

    def _experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The experts on rows x: under torch.autocast in its dtype (x and the expert weights cast as
        autocast casts the unsharded block's F.linear operands; the ops are not on autocast's lists)."""
        w1, w2 = self.w1, self.w2
        dtype = tpf.autocast_dtype(x)
        if dtype is not None and x.is_floating_point():
            x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
        w1 = w1.view(self.local_experts, self.hidden_size, 2, self.ffn_size)
        h, handle = public.moe_dispatch(x, ids, weights.contiguous(), w1, group=self.group)
        return public.moe_combine(h, w2, handle, group=self.group)

    # -- checkpoints ------------------------------------------------------------------------------------
    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's experts of a `w1`- or `w2`-shaped tensor (a weight, its gradient), concatenated
        in expert order; a new tensor on every rank (collective)."""
        t = t.detach().contiguous()
        shards = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(shards, t, group=self.group)
        return torch.cat(shards)

    def unshard(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """`t` (this rank's `w1` or `w2`, or a tensor shaped like it) as the unsharded block's entries,
        keyed relative to the block in the layout it came from (collective)."""
        whole = self.gather(t)
        f = self.ffn_size
        if self.layout == "own":
            return {name: whole}
        if self.layout == "fused":
            key = "experts.gate_up_proj" if name == "w1" else "experts.down_proj"
            return {key: whole.transpose(1, 2).contiguous()}
        gate, up, down = ("gate_proj", "up_proj", "down_proj") if self.layout == "gate_up_down" else ("w1", "w3", "w2")
        out = {}
        for i, e in enumerate(whole):
            if name == "w1":
                out[f"experts.{i}.{gate}.weight"] = e[:, :f].t().contiguous()
                out[f"experts.{i}.{up}.weight"] = e[:, f:].t().contiguous()
            else:
                out[f"experts.{i}.{down}.weight"] = e.t().contiguous()
        return out

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, ffn={self.ffn_size}, experts={self.num_experts}, top_k={self.top_k}, "
                f"sequence_parallel={self.sequence_parallel}, rank={self.rank}/{self.world}, "
                f"local_experts={self.local_experts}")


def _gate_up_in(module: nn.Module, args: tuple) -> tuple:
    """A sequence-parallel shared expert's input (this rank's rows) -> its fused gate/up output for every row."""
    return (module.gate_up_proj(args[0]), *args[1:])


def _shared_expert(shared: nn.Module, group: Any, sequence_parallel: bool) -> nn.Module:
    """A copy of a block's shared expert (an MLP of gate_proj / up_proj / down_proj nn.Linear layers)
    made tensor-parallel (module doc)."""
    shared = copy.deepcopy(shared)
    if not sequence_parallel:
        apply_plan(shared, SHARED_PLAN, group)
        return shared
    fuse_columns(shared, ("gate_proj", "up_proj"), "gate_up_proj", group, sequence_parallel=True)
    shared.down_proj = RowParallelLinear.from_linear(shared.down_proj, group, sequence_parallel=True)
    shared.register_forward_pre_hook(_gate_up_in)
    fuse_gated_mlp(shared)  # a SiLU-gated shared expert: one SwiGLU kernel each way, eagerly
    return shared


def _check_reads_like(block: nn.Module, gate: nn.Module, w1: torch.Tensor, w2: torch.Tensor, name: str) -> None:
    """ValueError unless `block`'s forward on 5 random rows (eval mode, no grad) equals, within its dtype's
    rounding, what ExpertParallelMoE computes from `gate` (the router it will run: (logits, weights, ids)),
    the SwiGLU experts `w1` (E x H x 2F, [gate | up]) / `w2` (E x F x H) and the block's shared expert.
    Skipped for weights on the meta device (nothing to run)."""
    if w1.is_meta:
        return
    h, f = w1.shape[1], w1.shape[2] // 2
    x = torch.randn(1, 5, h, generator=torch.Generator().manual_seed(0)).to(w1.device, w1.dtype)
    rows = x.reshape(-1, h)
    was = block.training
    block.eval()
    try:
        with torch.no_grad():
            out = block(x)
            out = (out[0] if isinstance(out, tuple) else out).reshape(-1, h).float()
            routed = gate(rows)
            if not (isinstance(routed, tuple) and len(routed) == 3):
                raise ValueError(f"{name}: its router gives {type(routed).__name__}, not (logits, weights, ids); "
                                 "autofuse does not know how this block routes")
            _, weights, ids = routed
            want = torch.zeros_like(out)
            for e in ids.unique().tolist():  # one expert's weights at a time, as views (no copy of the experts)
                for k in range(ids.shape[1]):
                    hit = ids[:, k] == e
                    if bool(hit.any()):
                        a = (rows[hit] @ w1[e]).float()
                        y = ((F.silu(a[:, :f]) * a[:, f:]).to(w2.dtype) @ w2[e]).float()
                        want[hit] += weights[hit, k:k + 1].float() * y
            shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
            if shared is not None:
                extra = shared(rows).float()
                sg = getattr(block, "shared_expert_gate", None)
                want += extra if sg is None else torch.sigmoid(sg(rows).float()) * extra
    finally:
        block.train(was)
    tol = 1e-4 if w1.dtype in (torch.float32, torch.float64) else 3e-2
    err = float((out - want).norm() / want.norm().clamp_min(1e-30))
    if not err <= tol:
        raise ValueError(f"{name}: its forward differs from top-k routed SwiGLU experts (plus its shared expert) "
                         f"by {err:.2g} on random rows; autofuse does not know how this block routes, scales or "
                         "activates (a routed scaling factor, a router post-processed in the block, another "
                         "activation), so it is not split")


def _experts_of(experts: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(w1 E x H x 2F [gate | up], w2 E x F x H, layout) of a transformers experts module (views or new
    tensors of its weights, detached by the caller's copy)."""
    gate_up = getattr(experts, "gate_up_proj", None)
    if isinstance(gate_up, torch.Tensor):
        flags = {"has_bias": False, "has_gate": True, "has_post_expert_norm": False, "is_concatenated": True}
        bad = [k for k, v in flags.items() if getattr(experts, k, v) != v]
        if bad or not silu_like(getattr(experts, "act_fn", None)):
            raise ValueError(f"{name}: experts with {', '.join(bad) or 'an activation other than SiLU'} are not "
                             "supported (SwiGLU experts only)")
        down = experts.down_proj
        if getattr(experts, "is_transposed", False):  # stored E x H x 2F and E x F x H already
            return gate_up, down, "fused"
        return gate_up.transpose(1, 2), down.transpose(1, 2), "fused"
    if isinstance(experts, nn.ModuleList) and len(experts):
        names = next((n for n in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
                      if all(isinstance(getattr(experts[0], a, None), nn.Linear) for a in n)), None)
        if names is None:
            raise ValueError(f"{name}: experts are neither gate_proj/up_proj/down_proj nor w1/w3/w2 nn.Linear layers")
        gates, ups, downs = [], [], []
        for i, ex in enumerate(experts):
            lins = [getattr(ex, a) for a in names]
            if any(lin.bias is not None for lin in lins) or not silu_like(getattr(ex, "act_fn", None)):
                raise ValueError(f"{name}: expert {i} has biases or an activation other than SiLU (SwiGLU only)")
            gates.append(lins[0].weight.t())
            ups.append(lins[1].weight.t())
            downs.append(lins[2].weight.t())
        w1 = torch.cat([torch.stack(gates), torch.stack(ups)], dim=2)
        return w1, torch.stack(downs), "gate_up_down" if names[0] == "gate_proj" else "w1_w3_w2"
    raise ValueError(f"{name}: its experts ({type(experts).__name__}) are neither fused 3-D parameters "
                     "(gate_up_proj, down_proj) nor a list of expert MLPs")
