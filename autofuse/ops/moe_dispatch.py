"""moe_dispatch: expert-parallel MoE's first half: token rows to their experts' ranks, then the
experts' first grouped GEMM (+ SwiGLU).

`h, handle = autofuse.moe_dispatch(x, topk_ids, topk_weights, w1, group=ep_group)`: rank r holds its
T tokens x (T x H), their routing (topk_ids T x k, int32 or int64, global expert ids; topk_weights
T x k, floating) and its L = E/W experts' w1 (L x H x 2 x F: gate and up, SwiGLU; a view of the
L x H x 2F matrix [gate | up]; or L x H x F: no activation). Every slot's row goes to the rank owning
its expert (the counts are exchanged first), and each local expert computes act(rows @ w1[l]).
Outputs: `h` (C x F, C = W * T * k the capacity: rows grouped by local expert, then source rank;
zero beyond the used count) and `handle` (autofuse/ops/moe.py: counts, sent, order, index, weights,
rows), which `autofuse.moe_combine(h', w2, handle)` takes. The routing weights are applied by
combine; gradients reach them through the handle. Calls are keyed by shapes only (the problem's
skew is the even routing's: reading the routing would cost a device sync per call).

Variants:
- `bsp`: the counts by all_to_all_single, then the rows by all_to_all_single with those splits (the
  host reads the counts: not capturable in a CUDA graph), then torch's grouped GEMM
  (`torch._grouped_mm`, CUDA bfloat16 with 16-byte aligned rows) or one matmul per expert.
- `hybrid`: one launch of kernels/moe.py's heap all-to-all (the counts through the heap, every row
  pushed straight into its owner's receive buffer at a row computed on the device), then the grouped
  GEMM on the capacity-bounded rows with the group sizes on the device (autofuse/ops/moe_hybrid.py):
  the host reads nothing, so the call can be captured in a CUDA graph. Same handle as bsp.
- `fused`: one launch (kernels/moe_fused.py): mover programs push the rows as hybrid's all-to-all does
  while the other programs run autofuse's grouped GEMM + SwiGLU into h, each tile once the rows it covers
  have landed (flags per source and mover program); capturable, same handle (autofuse/ops/moe_fused.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from autofuse.core.custom import Backward, CustomOp, HandleLayout
from autofuse.core.op import Config, Op, Problem, Variant
from autofuse.core.runner import HandleSpec, Runner, TensorSpec
from autofuse.ops import moe, moe_backward, moe_fused, moe_hybrid

if TYPE_CHECKING:
    from autofuse.comm.world import World

NAME = moe.DISPATCH


class RoutingSpec(TensorSpec):
    """A routing tensor: its shape, any of `dtypes` (ids: int32 or int64; weights: any floating)."""

    def __init__(self, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]):
        super().__init__(name, shape, dtypes[0])
        object.__setattr__(self, "dtypes", dtypes)

    def fits(self, t: Any, device: torch.device) -> bool:
        return (isinstance(t, torch.Tensor) and t.shape == self.shape and t.dtype in self.dtypes
                and t.device == device and t.is_contiguous())

    def problem_with(self, t: Any, device: torch.device) -> str | None:
        if self.fits(t, device):
            return None
        if isinstance(t, torch.Tensor) and t.dtype in self.dtypes:
            return TensorSpec(self.name, self.shape, t.dtype).problem_with(t, device)
        return f"{self.name} must be {self.shape} of {[str(d) for d in self.dtypes]} on {device}, got {t!r:.80}"


FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def in_specs(problem: Problem) -> list[TensorSpec]:
    _, t, h, _, _, k, _ = moe.problem_dims(problem)
    dt = problem.torch_dtype
    return [TensorSpec("x", (t, h), dt), RoutingSpec("topk_ids", (t, k), moe.ID_DTYPES),
            RoutingSpec("topk_weights", (t, k), FLOATS), TensorSpec("w1", moe.w1_shape(problem), dt)]


class DispatchRunner(Runner):
    """The outputs and the handle's buffers (made once: a captured graph replays with the same pointers);
    subclasses fill them in `launch`."""

    def __init__(self, world: World, problem: Problem, workspaces: tuple = ()):
        _, _, _, f, _, _, c = moe.problem_dims(problem)
        super().__init__(world, problem, in_specs(problem),
                         [TensorSpec("h", (c, f), problem.torch_dtype), HandleSpec("handle", problem.key)], workspaces)
        self.buffers = {n: torch.zeros(shape, dtype=dt, device=world.device)
                        for n, (shape, dt) in moe.handle_specs(problem).items()}
        self.local = moe.local_experts(problem)

    def fill_handle(self, out: Any) -> None:
        out["handle"].tensors.update(self.buffers)

    def finish_heap_handle(self, weights: torch.Tensor, out: Any) -> None:
        """The heap variants' handle once the launch wrote its counts: the index computed on the device."""
        b = self.buffers
        b["index"].copy_(moe_hybrid.group_index(b["counts"], self.problem["C"]))
        b["weights"].copy_(weights)
        self.fill_handle(out)


class BspRunner(DispatchRunner):
    def launch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, out: Any) -> None:
        p, b, world = self.problem, self.buffers, self.world
        k, c = p["k"], p["C"]
        order, sent = moe.send_plan(ids, p["E"])
        counts = moe.exchange_counts(world, sent, f"{NAME}.bsp counts")
        index = moe.group_index(counts)
        n = index.numel()
        rows = moe.to_experts(world, x[order // k], sent, counts, index, c, f"{NAME}.bsp rows")
        pre = moe.grouped_mm(rows, w1.reshape(self.local, p["H"], -1), counts.sum(0).tolist())
        h = out["h"]
        h[:n] = moe.act_forward(pre, p["act"])
        h[n:] = 0
        b["counts"].copy_(counts)
        b["sent"].copy_(sent)
        b["order"].copy_(order)
        b["index"][:n] = index
        b["index"][n:] = -1
        b["weights"].copy_(weights)
        b["rows"].copy_(rows)
        self.fill_handle(out)


class Bsp(Variant):
    name, family = "bsp", "bsp"
    capturable = False  # the host reads the counts (the all-to-all's splits)

    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return BspRunner(world, problem)


class HybridRunner(DispatchRunner):
    """The heap all-to-all into the receive buffer (the handle's `rows`), then the grouped GEMM and the
    activation over the C rows, zero beyond the used ones, NaN where the all-to-all failed."""

    def __init__(self, world: World, problem: Problem, config: Config):
        self.a2a = moe_hybrid.Exchange(world, problem, config, f"{NAME}.hybrid")
        super().__init__(world, problem, self.a2a.workspaces)
        self.buffers["rows"] = self.a2a.dst

    def launch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, out: Any) -> None:
        from autofuse.kernels import moe as kernels

        p, b = self.problem, self.buffers
        moe_hybrid.send_plan(ids, p["E"], b["order"], b["sent"])
        fault = self.a2a(kernels.DISPATCH.value, x, b["sent"], ids=ids, order=b["order"], counts_out=b["counts"])
        ends = b["counts"].sum(0).cumsum(0)
        pre = moe_hybrid.grouped_mm(b["rows"], w1.reshape(self.local, p["H"], -1), ends)
        moe_hybrid.activate(pre, out["h"], ends, fault, p["act"])
        self.finish_heap_handle(weights, out)


class Hybrid(moe_hybrid.HybridVariant):
    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return HybridRunner(world, problem, config)


class FusedRunner(DispatchRunner):
    """One launch moving the rows into the receive buffer (the handle's `rows`) while its other programs
    run the grouped GEMM + activation into h, tile by tile as rows land (autofuse/ops/moe_fused.py); zero
    beyond the used rows, NaN where the launch failed."""

    def __init__(self, world: World, problem: Problem, config: Config):
        self.gemm = moe_fused.DispatchGemm(world, problem, config, f"{NAME}.fused")
        super().__init__(world, problem, self.gemm.workspaces)
        self.buffers["rows"] = self.gemm.rows

    def launch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, out: Any) -> None:
        p, b = self.problem, self.buffers
        moe_hybrid.send_plan(ids, p["E"], b["order"], b["sent"])
        self.gemm(x, ids, b["order"], b["sent"], w1, out["h"], b["counts"])
        self.finish_heap_handle(weights, out)


class Fused(moe_fused.FusedDispatchVariant):
    def runner(self, world: World, problem: Problem, config: Config) -> Runner:
        return FusedRunner(world, problem, config)


def problem_of(world: World, x: Any, topk_ids: Any, topk_weights: Any, w1: Any) -> Problem:
    """The dispatch Problem of a call (InvalidInput naming what is wrong): E must divide by W, every id an
    expert of the group (checked where dispatch validates a call: its first call of a shape; a later call
    with an id outside [0, E) fails in torch's scatter of the routing plan, a device-side assert on CUDA)."""
    problem = moe.dispatch_problem(world.size, x, topk_ids, topk_weights, w1)
    moe.check_expert_ids(topk_ids, problem["E"])
    return problem


def inputs(world: World, problem: Problem, seed: int) -> tuple[torch.Tensor, ...]:
    return moe.rank_inputs(problem, world.rank, seed, world.device)[:4]


def reference(world: World, problem: Problem, seed: int) -> tuple:
    """`h` in float64 (the handle has no reference: combine's output checks it)."""
    return moe.expert_rows_reference(problem, world.rank, seed, second=False, device=world.device), None


def _sweep(kind: str, world: int) -> list[Problem]:
    return moe.sweep(NAME, kind, world)


# -- the custom op (autofuse/library registers it) -----------------------------------------------------
def _handle_fake(inputs: tuple, w: int) -> list[tuple[tuple, torch.dtype]]:
    return list(moe.handle_specs(moe.dispatch_problem(w, *inputs)).values())


def _keep(inputs: tuple, needs: tuple, extras: dict) -> dict:
    x, _, weights, w1 = inputs
    handle = extras["handle"]
    return {"w1": w1, "tokens": x.shape[0], "weights_dtype": weights.dtype, **{n: handle.tensors[n] for n in ("counts", "sent", "order", "index", "rows")}}


def _grads(kept: dict, grads: tuple, needs: tuple, group_name: str) -> tuple:
    """dx, dw1 from dh (moe_backward: the return all-to-all, combine-shaped); d topk_weights is the
    gradient the handle's weights received (combine applied them)."""
    dh, dweights = grads[0], grads[1 + moe.HANDLE.index("weights")]
    dx = dw1 = None
    if (needs[0] or needs[3]) and dh is not None:
        dx, dw1 = moe_backward.dispatch_grads(dh.contiguous(), kept["rows"], kept["w1"], kept["counts"], kept["sent"],
                                              kept["order"], kept["index"], kept["tokens"], group_name)
    dweights = dweights.to(kept["weights_dtype"]) if needs[2] and dweights is not None else None
    return dx if needs[0] else None, None, dweights, dw1 if needs[3] else None


CUSTOM = CustomOp(
    out_shape=lambda inputs, w: (w * inputs[0].shape[0] * inputs[1].shape[1], inputs[3].shape[-1]),
    backward=Backward(_keep, _grads, helpers=(moe_backward.DISPATCH_BACKWARD,)),
    handle=HandleLayout(moe.HANDLE, _handle_fake, lambda inputs, w: moe.dispatch_key(w, inputs[0], inputs[1], inputs[3])),
)

OP = Op(
    name=NAME,
    args=("x", "topk_ids", "topk_weights", "w1"),
    variants=[Bsp(), Hybrid(), Fused()],
    problem_of=problem_of,
    inputs=inputs,
    reference=reference,
    tolerance=moe.tolerance,
    features=moe.features,
    sweep=_sweep,
    description="MoE dispatch: token rows to their top-k experts' ranks, then the experts' first grouped GEMM",
    per_rank=("T",),
    custom=CUSTOM,
    outputs=("h", "handle"),
    capacities=("C",),
    extra_features=("skew",),
)
