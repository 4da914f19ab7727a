"""A toy op for policy and dispatch tests: a local matmul whose variants cost known, different times.

`bsp` costs about 20 + 0.5*M us, `fused` about 60 + 0.1*M us (+ a little per BLOCK), so fused wins
above M ~ 100: real CPU measurements (busy waits, not sleeps) with a crossover the policy must find.
No communication inside the runners, so any collective or file access during a cached call comes
from dispatch itself. `gpu_only` is never available on CPU. Counters record builds and calls.
Its custom-op declaration (`CUSTOM`: output shape, a backward in terms of the op itself) is all that
registering it (`core.registry.register`) needs for autograd and torch.compile (tests/test_adding_an_op.py).
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch

from autofuse.core.custom import Backward, CustomOp
from autofuse.core.op import InvalidInput, Op, Problem, Variant, default_tolerance
from autofuse.core.runner import Runner, TensorSpec
from autofuse.comm.workspace import workspace

NAME = "toy_mm"
BUILDS = {"bsp": 0, "fused": 0}
CALLS = {"bsp": 0, "fused": 0}


def _spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def problem_of(world: Any, a: torch.Tensor, b: torch.Tensor) -> Problem:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or a.dtype != b.dtype:
        raise InvalidInput(f"toy_mm: A (M x K) and B (K x N) of one dtype, got {tuple(a.shape)}, {tuple(b.shape)}")
    return Problem.make(NAME, a.dtype, world.size, M=a.shape[0], N=b.shape[1], K=a.shape[1])


def inputs(world: Any, problem: Problem, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + world.rank)
    a = torch.randn(problem["M"], problem["K"], generator=g).to(problem.torch_dtype)
    b = torch.randn(problem["K"], problem["N"], generator=g).to(problem.torch_dtype)
    return a, b


def reference(world: Any, problem: Problem, seed: int) -> torch.Tensor:
    a, b = inputs(world, problem, seed)
    return a.double() @ b.double()


class _Runner(Runner):
    """A local matmul after a busy wait of the variant's cost. The fused one owns a (never used)
    heap workspace, as real fused variants do, so dispatch reads its fault record."""

    def __init__(self, world: Any, problem: Problem, variant: str, cost_us: float, workspaces: tuple = ()):
        m, n, k = problem["M"], problem["N"], problem["K"]
        dt = problem.torch_dtype
        super().__init__(world, problem, [TensorSpec("a", (m, k), dt), TensorSpec("b", (k, n), dt)],
                         TensorSpec("out", (m, n), dt), workspaces)
        self.variant, self.cost_us = variant, cost_us

    def launch(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        CALLS[self.variant] += 1
        _spin(self.cost_us)
        torch.matmul(a, b, out=out)


class Bsp(Variant):
    name, family = "bsp", "bsp"

    def runner(self, world: Any, problem: Problem, config: dict) -> Any:
        BUILDS["bsp"] += 1
        return _Runner(world, problem, "bsp", 20 + 0.5 * problem["M"])


class Fused(Variant):
    name, family = "fused", "fused"

    def defaults(self, problem: Problem) -> list[dict]:
        return [{"BLOCK": 32}, {"BLOCK": 16}]

    def check(self, problem: Problem, config: dict) -> str | None:
        block = config.get("BLOCK")
        if block not in (16, 32):
            return f"BLOCK must be 16 or 32, got {block!r}"
        if problem["M"] % block:
            return f"M={problem['M']} is not a multiple of BLOCK={block}"
        return None

    def runner(self, world: Any, problem: Problem, config: dict) -> Any:
        BUILDS["fused"] += 1
        return _Runner(world, problem, "fused", 60 + 0.1 * problem["M"] + (5 if config["BLOCK"] == 16 else 0),
                       (workspace(world, NAME),))


class GpuOnly(Bsp):
    name, family = "gpu_only", "fused"

    def unavailable(self, world: Any) -> str | None:
        return None if world.device.type == "cuda" else "runs on CUDA only"


def _features(problem: Problem) -> dict[str, float]:
    return {"log2_flops": math.log2(2.0 * problem["M"] * problem["N"] * problem["K"])}


def _sweep(kind: str, world: int) -> list[Problem]:
    return [Problem.make(NAME, "float32", world, M=m, N=n, K=16) for m in (16, 32, 64, 128, 256, 512, 1024)
            for n in (16, 32)]


def _keep(inputs: tuple, needs: tuple, extras: Any) -> dict:
    a, b = inputs
    return {"a": a if needs[1] else None, "b": b if needs[0] else None}


def _grads(kept: dict, grad: torch.Tensor, needs: tuple, group_name: str) -> tuple:
    """dA = dC @ B^T, dB = A^T @ dC, each a call of the op itself through its custom op."""
    mm = getattr(torch.ops.autofuse, NAME)
    grad = grad.contiguous()
    da = mm(grad, kept["b"].t().contiguous(), group_name) if needs[0] else None
    db = mm(kept["a"].t().contiguous(), grad, group_name) if needs[1] else None
    return da, db


CUSTOM = CustomOp(out_shape=lambda inputs, w: (inputs[0].shape[0], inputs[1].shape[1]),
                  backward=Backward(_keep, _grads))

OP = Op(
    name=NAME,
    args=("a", "b"),
    variants=[Bsp(), Fused(), GpuOnly()],
    problem_of=problem_of,
    inputs=inputs,
    reference=reference,
    tolerance=lambda p: default_tolerance(p.dtype, p["K"]),
    features=_features,
    sweep=_sweep,
    custom=CUSTOM,
)


def tuned_rows() -> list[dict]:
    """Toy measurements for fitting a policy in tests: fused wins from M=128 up (N 16 and 32 tuned)."""
    out = []
    for m in (16, 32, 64, 128, 256, 512, 1024):
        for n in (16, 32):
            key = Problem.make(NAME, "float32", 2, M=m, N=n, K=16).key
            out.append({"problem": key, "op": NAME, "variant": "bsp", "config": {}, "median_us": 20 + 0.5 * m})
            out.append({"problem": key, "op": NAME, "variant": "fused", "config": {"BLOCK": 16},
                        "median_us": 60 + 0.1 * m})
    return out
