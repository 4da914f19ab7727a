"""`autofuse.warmup(model, group, tokens)`: the first calls a parallelized model's layers make, ahead of serving.

Each distinct call an autofuse.nn layer makes (RowParallelLinear: gemm_ar, or gemm_rs with sequence
parallelism; ColumnParallelLinear with sequence parallelism: ag_gemm; ExpertParallelMoE: moe_dispatch and
moe_combine, on random rows routed by its own router) is made once per token count, through the layer's
own forward, so the calls (shapes, dtype, device, group) are exactly the ones
serving makes; autofuse/dispatch/warmup.py says what is paid and what later processes keep.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from autofuse.dispatch.state import world_of
from autofuse.dispatch.warmup import WarmupReport, first_calls, new_report
from autofuse.nn import functional as tpf
from autofuse.nn.linear import ColumnParallelLinear, RowParallelLinear
from autofuse.nn.moe import ExpertParallelMoE


def _layers(model: torch.nn.Module, group: Any) -> list[tuple[str, torch.nn.Module]]:
    """One layer per distinct call an autofuse.nn layer of `model` makes (shapes, dtype, device, group)."""
    wanted = tpf.process_group(group)
    seen: dict[tuple, tuple[str, torch.nn.Module]] = {}
    for name, m in model.named_modules():
        calls_op = (isinstance(m, (RowParallelLinear, ExpertParallelMoE))
                    or (isinstance(m, ColumnParallelLinear) and m.sequence_parallel))
        if not calls_op:
            continue
        if group is not None and m.group is not wanted:
            raise ValueError(f"warmup: layer {name} is parallelized over another process group than the one given")
        if isinstance(m, ExpertParallelMoE):
            w = m.w1
            sig = ("moe", m.sequence_parallel, tuple(m.w1.shape), tuple(m.w2.shape), m.top_k, w.dtype, w.device,
                   id(m.group))
        else:
            w = m.weight
            sig = (type(m).__name__, m.sequence_parallel, tuple(w.shape), w.dtype, w.device, w.t().is_contiguous(),
                   id(m.group))
        seen.setdefault(sig, (name, m))
    if not seen:
        raise ValueError("warmup: the model has no autofuse.nn layer that calls an op (RowParallelLinear, "
                         "ColumnParallelLinear with sequence_parallel=True, ExpertParallelMoE): parallelize it first "
                         "(autofuse.parallelize)")
    return list(seen.values())


def warmup(model: torch.nn.Module, group: Any = None, tokens: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
           *, seed: int = 0) -> WarmupReport:
    """Make the first call of every op call `model`'s parallel layers make at each token count, on
    every rank of `group` (collective: every rank calls it alike; `group` is the one the model was
    parallelized over; None: the layers' own).

    `tokens`: the token rows one forward pass feeds the layers (batch x sequence: a server's batch
    sizes of decode steps, as vLLM's capture sizes, or prefill lengths). With sequence parallelism a
    count is rounded up to a multiple of the group size, as the layers pad it. Inference calls only
    (no autograd: backward calls are other problems). Returns this rank's report.
    """
    layers = _layers(model, group)
    world = world_of(layers[0][1].group if group is None else tpf.process_group(group))
    counts = [int(t) for t in tokens]
    if not counts or any(t < 1 for t in counts):
        raise ValueError(f"warmup: tokens must be positive counts, got {list(tokens)}")
    gen = torch.Generator().manual_seed(seed)

    def calls() -> Iterable[tuple[str, Any]]:
        for t in counts:
            for name, m in layers:
                rows = -(-t // world.size) * world.size if m.sequence_parallel else t
                if m.sequence_parallel and (isinstance(m, ExpertParallelMoE) or m.split_dim == 0):
                    rows //= world.size  # a column-parallel layer's or MoE block's input: this rank's block of the rows
                w = m.w1 if isinstance(m, ExpertParallelMoE) else m.weight
                x = torch.randn(rows, w.shape[1], generator=gen).to(w.device, w.dtype)

                def thunk(m: torch.nn.Module = m, x: torch.Tensor = x) -> None:
                    with torch.no_grad():
                        m(x)

                yield f"{name} x {t} tokens", thunk

    return first_calls(world, calls(), new_report(world))
