"""moe_combine: expert-parallel MoE's second half: the experts' second grouped GEMM, the rows back to
their tokens' ranks, and the top-k weighted sum in token order.

`y = autofuse.moe_combine(h, w2, handle, group=ep_group)`: `h` is C x F (moe_dispatch's `h`, or any
C x F rows in its order, e.g. after an elementwise op), `w2` this rank's L experts' L x F x H, `handle`
the one moe_dispatch returned with it. y (T x H, in x's dtype) = sum_j topk_weights[t, j] *
(h row of slot (t, j)) @ w2[expert]; with dispatch's h that is the MoE block
sum_j w_tj * expert_{id_tj}(x_t). Partner: moe_dispatch (the problem, hence the cache key, comes from
the handle's key, the dispatch problem's).

Variants:
- `bsp`: the grouped GEMM (torch._grouped_mm or one matmul per expert), the rows back by
  all_to_all_single with the handle's counts (the host reads them), the weighted sum by index_add.
- `hybrid`: the grouped GEMM over the C rows with the group sizes on the device, then one launch of
  kernels/moe.py's heap all-to-all pushing each output row into its token's rank's return buffer (in
  that rank's send order), then the top-k weighted sum as a gather (autofuse/ops/moe_hybrid.py): the
  host reads nothing, so the call can be captured in a CUDA graph. Takes the handle of either
  dispatch variant (they make the same one).
- `fused`: one launch of autofuse's grouped GEMM whose epilogue stores every output row straight into
  its token's rank's return buffer (the return all-to-all is the GEMM's own stores; kernels/moe_fused.py,
  autofuse/ops/moe_fused.py), then the same weighted sum as hybrid. Capturable; takes either handle.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from autofuse.core.custom import Backward, CustomOp
from autofuse.core.op import Config, InvalidInput, Op, Problem, Variant
from autofuse.core.runner import Handle, HandleSpec, Runner, TensorSpec
from autofuse.ops import moe, moe_backward, moe_fused, moe_hybrid

if TYPE_CHECKING:
    from autofuse.comm.world import World

NAME = moe.COMBINE


def problem_of(world: World, h: Any, w2: Any, handle: Any) -> Problem:
    """The combine Problem: the dispatch problem the handle was made for, with h (C x F) and w2
    (L x F x H) checked against it."""
    key = getattr(handle, "key", None)
    if not isinstance(handle, Handle) or not isinstance(key, str) or not key.startswith(moe.DISPATCH + "|"):
        raise InvalidInput(f"{NAME}: handle must be the Handle autofuse.{moe.DISPATCH} returned, got {handle!r:.80}")
    d = Problem.from_key(key)
    if d.world != world.size:
        raise InvalidInput(f"{NAME}: the handle is for {d.world} ranks, this group has {world.size}")
    problem = Problem.make(NAME, d.dtype, d.world, **dict(d.dims))
    _, _, hid, f, local, _, c = moe.problem_dims(problem)
    for name, t, shape in (("h", h, (c, f)), ("w2", w2, (local, f, hid))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != problem.torch_dtype:
            raise InvalidInput(f"{NAME}: {name} must be {shape} {problem.torch_dtype} for {key}, got "
                               f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                               f"{' ' + str(t.dtype) if isinstance(t, torch.Tensor) else ''}")
        if not t.is_contiguous():
            raise InvalidInput(f"{NAME}: {name} must be contiguous")
    return problem


def in_specs(problem: Problem) -> list:
    _, _, hid, f, local, _, c = moe.problem_dims(problem)
    dt = problem.torch_dtype
    return [TensorSpec("h", (c, f), dt), TensorSpec("w2", (local, f, hid), dt),
            HandleSpec("handle", moe.partner_key(problem))]


class BspRunner(Runner):
    def __init__(self, world: World, problem: Problem):
        super().__init__(world, problem, in_specs(problem),
                         TensorSpec("out", (problem["T"], problem["H"]), problem.torch_dtype))

    def launch(self, h: torch.Tensor, w2: torch.Tensor, handle: Handle, out: torch.Tensor) -> None:
        b = handle.tensors
        counts = b["counts"]
        h2 = moe.grouped_mm(h, w2, counts.sum(0).tolist())
        back = moe.to_tokens(self.world, h2, b["sent"], counts, b["index"], f"{NAME}.bsp rows")
        moe.weighted_sum(back, b["order"], b["weights"], out)


class Bsp(Variant):
    name, family = "bsp", "bsp"
    capturable = False  # the host reads the counts (the all-to-all's splits)

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return BspRunner(world, problem)


class ReturnRunner(Runner):
    """What hybrid and fused share: the returned rows land in a buffer in this rank's send order, then the
    top-k weighted sum out[t] = sum_j weights[t, j] * returned row of slot (t, j), NaN where the launch
    that moved them failed."""

    def __init__(self, world: World, problem: Problem, workspaces: tuple):
        t, k = problem["T"], problem["k"]
        super().__init__(world, problem, in_specs(problem), TensorSpec("out", (t, problem["H"]), problem.torch_dtype),
                         workspaces)
        self.slots = torch.arange(t * k, device=world.device)
        self.pos = torch.empty(t * k, dtype=torch.int64, device=world.device)

    def weighted_sum(self, back: torch.Tensor, handle: Handle, out: torch.Tensor, fault: torch.Tensor) -> None:
        b = handle.tensors
        self.pos.scatter_(0, b["order"], self.slots)  # the send row of each slot
        moe_hybrid.weighted_rows(back, self.pos, b["weights"], out, fault)


class HybridRunner(ReturnRunner):
    """The grouped GEMM, the heap all-to-all back into the return buffer (my send order), the weighted sum."""

    def __init__(self, world: World, problem: Problem, config: Config):
        self.a2a = moe_hybrid.Exchange(world, problem, config, f"{NAME}.hybrid")
        super().__init__(world, problem, self.a2a.workspaces)

    def launch(self, h: torch.Tensor, w2: torch.Tensor, handle: Handle, out: torch.Tensor) -> None:
        from autofuse.kernels import moe as kernels

        b = handle.tensors
        h2 = moe_hybrid.grouped_mm(h, w2, b["counts"].sum(0).cumsum(0))
        fault = self.a2a(kernels.COMBINE.value, h2, b["sent"], inv=moe_hybrid.inverse_index(b["index"]))
        self.weighted_sum(self.a2a.dst, handle, out, fault)


class Hybrid(moe_hybrid.HybridVariant):
    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return HybridRunner(world, problem, config)


class FusedRunner(ReturnRunner):
    """The grouped GEMM storing its rows into the token ranks' return buffers (autofuse/ops/moe_fused.py),
    then the weighted sum."""

    def __init__(self, world: World, problem: Problem, config: Config):
        self.gemm = moe_fused.CombineGemm(world, problem, config, f"{NAME}.fused")
        super().__init__(world, problem, self.gemm.workspaces)

    def launch(self, h: torch.Tensor, w2: torch.Tensor, handle: Handle, out: torch.Tensor) -> None:
        b = handle.tensors
        fault = self.gemm(h, w2, b["index"], b["counts"], b["sent"])
        self.weighted_sum(self.gemm.dst, handle, out, fault)


class Fused(moe_fused.FusedVariant):
    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return FusedRunner(world, problem, config)


def inputs(world: World, problem: Problem, seed: int) -> tuple:
    """(h, w2, handle): dispatch's bsp on this rank's inputs (collective: every rank makes them together),
    its handle copied (the next call of that runner would overwrite its buffers)."""
    from autofuse.ops import moe_dispatch

    d = Problem.from_key(moe.partner_key(problem))
    x, ids, weights, w1, w2 = moe.rank_inputs(d, world.rank, seed, world.device)
    h, handle = moe_dispatch.BspRunner(world, d)(x, ids, weights, w1)
    return h, w2, Handle(handle.key, **{n: t.clone() for n, t in handle.tensors.items()})


def reference(world: World, problem: Problem, seed: int) -> torch.Tensor:
    """The unsharded MoE block on this rank's tokens, float64."""
    return moe.moe_reference(problem, world.rank, seed, world.device)


def _sweep(kind: str, world: int) -> list[Problem]:
    return moe.sweep(NAME, kind, world)


# -- the custom op (autofuse/library registers it) -----------------------------------------------------
def _keep(inputs: tuple, needs: tuple, extras: dict) -> dict:
    h, w2, handle = inputs
    return {"h": h, "w2": w2, **{n: handle.tensors[n] for n in ("counts", "sent", "order", "index", "weights")}}


def _grads(kept: dict, grads: tuple, needs: tuple, group_name: str) -> tuple:
    """dh, dw2 and d weights (the handle's, which dispatch hands to topk_weights): moe_backward, whose
    all-to-all is dispatch-shaped. Flat inputs: h, w2, the handle's tensors, its key."""
    dy = grads[0]
    weights_at = 2 + moe.HANDLE.index("weights")
    none = [None] * (2 + len(moe.HANDLE) + 1)
    if dy is None or not (needs[0] or needs[1] or needs[weights_at]):
        return tuple(none)
    dh, dw2, dweights = moe_backward.combine_grads(dy.contiguous(), kept["h"], kept["w2"], kept["counts"],
                                                   kept["sent"], kept["order"], kept["index"], kept["weights"],
                                                   group_name)
    none[0], none[1] = (dh if needs[0] else None), (dw2 if needs[1] else None)
    none[weights_at] = dweights if needs[weights_at] else None
    return tuple(none)


CUSTOM = CustomOp(
    out_shape=lambda inputs, w: (inputs[2].tensors["weights"].shape[0], inputs[1].shape[2]),
    backward=Backward(_keep, _grads, helpers=(moe_backward.COMBINE_BACKWARD,)),
)

OP = Op(
    name=NAME,
    args=("h", "w2", "handle"),
    variants=[Bsp(), Hybrid(), Fused()],
    problem_of=problem_of,
    inputs=inputs,
    reference=reference,
    tolerance=moe.tolerance,
    features=moe.features,
    sweep=_sweep,
    description="MoE combine: the experts' second grouped GEMM, the rows back to their tokens, the top-k weighted sum",
    per_rank=("T",),
    custom=CUSTOM,
    partner=moe.DISPATCH,
    handles=("handle",),
    capacities=("C",),
    extra_features=("skew",),
)
