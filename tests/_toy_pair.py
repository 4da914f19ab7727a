"""A toy op pair for the op contract MoE needs (tests/test_op_contract.py), on CPU, no communication.

`toy_route(x, counts)`: x is C x H with C a capacity (a static upper bound: `Op.capacities`), counts a
1-element int32 tensor holding the rows actually used; it returns two named outputs, `y` (2 x the used
rows, zeros beyond) and `handle` (a Handle carrying the counts, for its partner). `toy_combine(y, handle)`
(partner `toy_route`) returns y / 2 on the rows the handle says are used. `skew` is an extra feature
(not a size): the policy reads its value.
"""
from __future__ import annotations

from typing import Any

import torch

from autofuse.core.op import InvalidInput, Op, Problem, Variant, default_tolerance
from autofuse.core.runner import HandleSpec, Runner, TensorSpec

ROUTE, COMBINE = "toy_route", "toy_combine"


def _route_problem(world: Any, x: torch.Tensor, counts: torch.Tensor) -> Problem:
    if x.dim() != 2 or not isinstance(counts, torch.Tensor) or counts.shape != (1,) or counts.dtype != torch.int32:
        raise InvalidInput(f"{ROUTE}: x (C x H) and counts (1,) int32")
    return Problem.make(ROUTE, x.dtype, world.size, C=x.shape[0], H=x.shape[1], skew=1)  # C from the shape only


def _combine_problem(world: Any, y: torch.Tensor, handle: Any) -> Problem:
    key = getattr(handle, "key", None)
    if not isinstance(key, str) or not key.startswith(ROUTE + "|"):
        raise InvalidInput(f"{COMBINE}: handle must be {ROUTE}'s, got {handle!r}")
    return Problem.make(COMBINE, y.dtype, world.size, C=y.shape[0], H=y.shape[1])


class RouteRunner(Runner):
    def __init__(self, world: Any, problem: Problem):
        c, h, dt = problem["C"], problem["H"], problem.torch_dtype
        super().__init__(world, problem, [TensorSpec("x", (c, h), dt), TensorSpec("counts", (1,), torch.int32)],
                         [TensorSpec("y", (c, h), dt), HandleSpec("handle", problem.key)])
        self.counts = torch.zeros(1, dtype=torch.int32)  # the handle's buffer: the same one every call
        self.rows = torch.arange(c).unsqueeze(1)

    def launch(self, x: torch.Tensor, counts: torch.Tensor, out: Any) -> None:
        self.counts.copy_(counts)
        torch.mul(x, 2 * (self.rows < self.counts), out=out["y"])
        out["handle"].tensors["counts"] = self.counts


class CombineRunner(Runner):
    def __init__(self, world: Any, problem: Problem, route_key: str):
        c, h, dt = problem["C"], problem["H"], problem.torch_dtype
        super().__init__(world, problem, [TensorSpec("y", (c, h), dt), HandleSpec("handle", route_key)],
                         TensorSpec("out", (c, h), dt))
        self.rows = torch.arange(c).unsqueeze(1)

    def launch(self, y: torch.Tensor, handle: Any, out: torch.Tensor) -> None:
        torch.mul(y, 0.5 * (self.rows < handle.tensors["counts"]), out=out)


class RouteBsp(Variant):
    name, family = "bsp", "bsp"

    def runner(self, world: Any, problem: Problem, config: dict) -> Runner:
        return RouteRunner(world, problem)


class CombineBsp(Variant):
    name, family = "bsp", "bsp"

    def runner(self, world: Any, problem: Problem, config: dict) -> Runner:
        route = Problem.make(ROUTE, problem.dtype, problem.world, C=problem["C"], H=problem["H"], skew=1)
        return CombineRunner(world, problem, route.key)


def _inputs(world: Any, problem: Problem, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(problem["C"], problem["H"], generator=g).to(problem.torch_dtype),
            torch.tensor([problem["C"] // 2], dtype=torch.int32))


def _route_reference(world: Any, problem: Problem, seed: int) -> tuple:
    x, counts = _inputs(world, problem, seed)
    y = x.double() * 2 * (torch.arange(problem["C"]).unsqueeze(1) < counts)
    return y, counts.double()


COMMON = dict(tolerance=lambda p: default_tolerance(p.dtype, 1), features=lambda p: {},
              sweep=lambda kind, world: [])
ROUTE_OP = Op(name=ROUTE, args=("x", "counts"), variants=[RouteBsp()], problem_of=_route_problem, inputs=_inputs,
              reference=_route_reference, outputs=("y", "handle"), capacities=("C",), extra_features=("skew",),
              **COMMON)
COMBINE_OP = Op(name=COMBINE, args=("y", "handle"), variants=[CombineBsp()], problem_of=_combine_problem,
                inputs=_inputs, reference=_route_reference, partner=ROUTE, handles=("handle",), capacities=("C",),
                **COMMON)
