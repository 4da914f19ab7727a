"""Helpers shared by tests/test_gemm_rs.py and tests/test_gemm_ar.py (the row-parallel GEMM ops)."""
from __future__ import annotations

import random
from typing import Any, Sequence

import torch
import torch.distributed as dist

import harness
from autofuse import workspace
from autofuse.op import Op
from autofuse.world import World

TINY = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}


def tiny(**changes: Any) -> dict:
    """The interpreter's 16x16x16 GEMM config with `changes` (the op's keys among them)."""
    return {**TINY, **changes}


def cases_then_faults(world: World, op: Op, cases: Sequence[harness.Case], calls: int,
                      plan: Sequence[tuple]) -> tuple[list, list[dict]]:
    """harness.run_cases over `cases`, then every (variant, dims, dtype, config, scenario) of `plan`
    with harness.fault_run on a fresh World: its own heap, so its workspaces are made after
    fault_run set the short wait budget (the cases' workspaces keep the default one). The fresh
    World's workspaces are rebuilt (collectively) after each scenario and its heap closed at the end."""
    results = harness.run_cases(world, op, cases, calls=calls) if cases else []
    fresh = World.from_group(dist.new_group(ranks=list(world.global_ranks), backend=world.backend))
    seen = []
    try:
        for variant, dims, dtype, config, scenario in plan:
            seen.append(harness.fault_run(fresh, op, variant, dims, dtype, config, scenario))
            for ws in workspace.workspaces(fresh):
                ws.rebuild()
    finally:
        fresh.close()
    return results, seen


def by_scenario(per_rank: list[tuple[list, list[dict]]], plan: Sequence[tuple]) -> list[list[dict]]:
    """cases_then_faults' fault results regrouped as [scenario][rank]."""
    return [[r[1][i] for r in per_rank] for i in range(len(plan))]


def fake_world(size: int = 2) -> World:
    """A World for checks that never touch the heap or a process group."""
    return World(rank=0, size=size, device=torch.device("cpu"), backend="gloo")


class RandomTrial:
    """The SearchSpace protocol with random draws, each name's choices fixed (as Optuna requires)."""

    def __init__(self, seed: int, seen: dict):
        self.rng, self.seen = random.Random(seed), seen

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        assert self.seen.setdefault(name, list(choices)) == list(choices), f"{name}: choices changed"
        return self.rng.choice(list(choices))

    def suggest_int(self, name: str, low: int, high: int, step: int = 1, log: bool = False) -> int:
        assert self.seen.setdefault(name, (low, high)) == (low, high), f"{name}: range changed"
        return self.rng.randint(low, high)
