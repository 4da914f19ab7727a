"""Helpers shared by tests/test_gemm_rs.py and tests/test_gemm_ar.py (the row-parallel GEMM ops)."""
from __future__ import annotations

import math
import random
import re
from typing import Any, Callable, Sequence

import pytest
import torch
import torch.distributed as dist

import harness
from autofuse.core import gemm
from autofuse.comm import workspace
from autofuse.core.op import InvalidConfig, Op, Problem, Variant
from autofuse.comm.world import World, spawn
from conftest import assert_pipelined_gemm, assert_uniform

TINY = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}
SCENARIOS = ("late_peer", "skipped_call", "dead_peer")  # harness.fault_run's
FEATURES = {"log2_flops", "log2_comm_bytes", "comm_bytes_per_flop", "log2_M_per_rank"}


def tiny(**changes: Any) -> dict:
    """The interpreter's 16x16x16 GEMM config with `changes` (the op's keys among them)."""
    return {**TINY, **changes}


def default_cases(op: Op, variant: str, dims: dict, dtype: str = "bfloat16", pick: int | slice = 2,
                  world: int = 2) -> list[harness.Case]:
    """Cases of `variant` at its default configs for the problem: the first `pick`, or the slice `pick`."""
    problem = Problem.make(op.name, dtype, world, **dims)
    configs = op.variant(variant).defaults(problem)
    return [(variant, dims, dtype, c) for c in configs[pick if isinstance(pick, slice) else slice(0, pick)]]


# -- cases and faults on CPU ranks or GPUs ---------------------------------------------------------------
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


def cases_and_faults(size: int, op: Op, cases: Sequence[harness.Case], calls: int, plan: Sequence[tuple],
                     **spawn_kw: Any) -> tuple[list[list[tuple]], list[list[dict]]]:
    """cases_then_faults on `size` spawned ranks (`spawn_kw`: device_kind, timeout_s): (run_cases
    results per rank, [scenario][rank] -> what the rank saw in harness.fault_run)."""
    per_rank = spawn(cases_then_faults, size, op, cases, calls, plan, **spawn_kw)
    return [r[0] for r in per_rank], by_scenario(per_rank, plan)


def fault_plan(dims: dict, dtype: str, variant_configs: Sequence[tuple[str, dict]]) -> list[tuple]:
    """cases_then_faults' plan rows (variant, dims, dtype, config, scenario): each of SCENARIOS (a late
    peer, a skipped call, a dead peer) for every (variant, config) of `variant_configs`."""
    return [(v, dims, dtype, c, s) for s in SCENARIOS for v, c in variant_configs]


def fault_ids(plan: Sequence[tuple]) -> list[str]:
    """pytest ids of plan rows: variant-scenario."""
    return [f"{v}-{s}" for v, _, _, _, s in plan]


def check_faults_on_gpus(op: Op, plan: Sequence[tuple]) -> None:
    """Every scenario of `plan` on harness.gpu_world() GPU ranks: harness.check_fault_run on what they saw."""
    for seen in cases_and_faults(harness.gpu_world(), op, [], 0, plan, device_kind="cuda", timeout_s=900)[1]:
        harness.check_fault_run(seen)


def check_fault(seen: list[dict], scenario: str) -> None:
    """A 2-rank fault scenario: harness.check_fault_run, the survivor's own wait ran out, and a late or
    skipping victim is refused too (a dead one makes no call to refuse)."""
    harness.check_fault_run(seen)
    survivor, victim = seen
    assert survivor["seen"][1][0] == "FlagTimeout", survivor
    if scenario != "dead_peer":
        assert victim["seen"][-1][0] != "returned", victim


def check_dead_peer_time(faults: list[list[dict]], plan: Sequence[tuple], variant: str, small: dict) -> None:
    """A dead peer is found within the budget at `variant`'s `small` dims and at the plan's last (large)
    scenario alike: the time to fail does not grow with the problem."""
    small_run = next(r for (v, d, _, _, s), r in zip(plan, faults) if v == variant and s == "dead_peer" and d == small)
    large = faults[-1]
    for result in (small_run, large):
        harness.check_fault_run(result)  # within budget + 5 s at 1 tile and at 8 tiles
    assert large[0]["seen"][1][0] == "FlagTimeout"


# -- configs and sweeps ------------------------------------------------------------------------------------
def fake_world(size: int = 2) -> World:
    """A World for checks that never touch the heap or a process group."""
    return World(rank=0, size=size, device=torch.device("cpu"), backend="gloo")


def assert_rejected(world: World, problem: Problem, variant: Variant, config: dict, msg: str) -> None:
    """`variant.check` names what is wrong with `config` (`msg`), and `build` raises it before touching
    the heap or launching."""
    why = variant.check(problem, config)
    assert msg in (why or ""), (variant.name, config, why)
    with pytest.raises(InvalidConfig, match=re.escape(msg)):
        variant.build(world, problem, config)


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


def check_space(variant: Variant, problem: Problem, config_ok: Callable[[dict], bool], draws: int = 40) -> None:
    """`draws` configs from the variant's space (RandomTrial): each passes `config_ok` and is not warp
    specialised (WARP_SPEC is never offered), and at least 5 pass the variant's check."""
    seen, valid = {}, 0
    for seed in range(draws):
        config = variant.space(RandomTrial(seed, seen), problem)
        assert config_ok(config) and not config["WARP_SPEC"], (variant.name, config)
        valid += variant.check(problem, config) is None
    assert "WARP_SPEC" not in seen and valid >= 5, (variant.name, problem, valid)


def check_sweeps(op: Op, divisible: Sequence[str]) -> list[tuple[Problem, Variant, list[dict]]]:
    """Every sweep kind at 2, 4 and 8 ranks: problems of `op` whose `divisible` dims split over the
    world, every variant's defaults pass its check (fused ones not warp specialised; a peer variant that
    refuses a problem has none, and gemm_ar's mm_ll none above its message size), finite features.
    Returns (problem, fused variant, its defaults) for the op's own checks."""
    fused = []
    for kind in ("cpu", "gpu", "llama70b", "models", "default"):
        for world in (2, 4, 8):
            problems = op.sweep(kind, world)
            assert problems and all(p.op == op.name and all(p[d] % world == 0 for d in divisible) for p in problems)
            for p in problems:
                for name, v in op.variants.items():
                    configs = v.defaults(p)
                    why = v.check(p, {}) or ""
                    refused = ((v.family == "peer" and bool(why))  # e.g. torch's fp16 all-reduce
                               or (name == "mm_ll" and "more than the low-latency" in why))  # small messages only
                    assert (configs or refused) and all(v.check(p, c) is None for c in configs), (name, p)
                    if v.family == "fused":
                        assert not any(c["WARP_SPEC"] for c in configs)
                        fused.append((p, v, configs))
                feats = op.features(p)
                assert set(feats) == FEATURES
                assert all(math.isfinite(v) for v in feats.values())
    return fused


# -- sm_90 -------------------------------------------------------------------------------------------------
def check_compiled_gemm(compiled: dict, name: str, base: dict, table: dict) -> tuple[str, dict]:
    """conftest.assert_pipelined_gemm and assert_uniform on row `name` of one version's compile_table
    `table` over `base`; (its PTX, its constexprs) for the op's own checks."""
    ptx, shared = compiled[name]["ptx"], compiled[name]["shared"]
    consts = {**base, **table[name][0]}
    assert_pipelined_gemm(ptx, shared, consts, gemm.SMEM_LIMIT)
    assert_uniform(compiled[name], name)
    return ptx, consts
