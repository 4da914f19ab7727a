"""What every op's tests share, on CPU ranks (Triton's interpreter) and on GPUs (marker `gpu`).

- `run_cases(world, op, cases, calls)`: build each (variant, problem, config) once, call it `calls`
  times with fresh random inputs into NaN-poisoned outputs, then once more with the cases
  interleaved (so calls of different runners share workspaces and epochs), and compare every output
  with the op's float64 reference at `op.tolerance(problem)`. On GPUs each case is also captured in
  a CUDA graph and replayed with new inputs copied into the captured buffers.
- `assert_ok(results)`: every rank within tolerance; optionally bitwise-equal results across ranks.
- fault scenarios (`late_peer`, `skipped_call`, `dead_peer`): a peer that is late past the wait
  budget, that skips a call, or that never calls; every rank must raise (FlagTimeout or
  WorkspaceAborted) within the budget plus a few seconds, no call may return a wrong result, and
  a call that raises must leave NaN in every element of its `out` (given prefilled with finite
  values, so stale or untouched elements show).
The case tables live in each op's test module and are used by its CPU and GPU tests alike.
"""
from __future__ import annotations

import faulthandler
import math
import os
import sys
import time
from typing import Any, Sequence

import pytest
import torch

from autofuse.comm import status
from autofuse.measure.timing import capture
from autofuse.core.op import Op, Problem, rel_error

Case = tuple[str, dict, str, dict]  # (variant, dims, dtype, config)


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu(min_gpus: int = 2):
    """Marks a test that runs on `min_gpus` or more CUDA GPUs (`pytest -m gpu` on the GPU machine) and
    is skipped elsewhere."""
    skip = pytest.mark.skipif(gpus() < min_gpus, reason=f"needs {min_gpus} CUDA GPUs")
    return lambda fn: pytest.mark.gpu(skip(fn))


def problem_of(op: Op, world_size: int, dims: dict, dtype: str) -> Problem:
    return Problem.make(op.name, dtype, world_size, **dims)


def _out_like(ref: torch.Tensor, problem: Problem, device: torch.device) -> torch.Tensor:
    return torch.full(ref.shape, math.nan, dtype=problem.torch_dtype, device=device)


def _checksum(out: torch.Tensor) -> int:
    bits = out.contiguous().view(torch.int16 if out.element_size() == 2 else torch.int32)
    return int(bits.to(torch.int64).sum().item())


def on_copy_engine(case: Case) -> bool:
    """The case's collective runs on the copy engine: it needs peer-mapped heap tensors, which the
    IPC heap (provider 'torch') has and the default heap of a whole-job group on GPUs (torch's
    symmetric memory) refuses with InvalidConfig. GPU tests run such cases after `use_ipc_heap`."""
    return case[3].get("ENGINE") == "ce"


def use_ipc_heap(monkeypatch: Any) -> None:
    """Ranks spawned from now on (in this test) build their heaps on CUDA IPC (provider 'torch')."""
    monkeypatch.setenv("AUTOFUSE_HEAP_PROVIDER", "torch")


def run_cases(world: Any, op: Op, cases: Sequence[Case], calls: int = 3, graph: bool | None = None) -> list[tuple]:
    """Per case: (name, worst relative error, tolerance, checksum of the last output); see the module doc."""
    graph = world.device.type == "cuda" if graph is None else graph
    built = []
    for variant, dims, dtype, config in cases:
        problem = problem_of(op, world.size, dims, dtype)
        runner = op.variant(variant).build(world, problem, config)
        built.append((f"{variant} {config} {problem.key}", problem, runner))
    worst = {name: 0.0 for name, _, _ in built}
    last: dict[str, int] = {}

    def call(name: str, problem: Problem, runner: Any, seed: int) -> None:
        inputs = op.inputs(world, problem, seed)
        ref = op.reference(world, problem, seed)
        out = _out_like(ref, problem, world.device)
        assert runner(*inputs, out=out) is out
        runner.check()
        worst[name] = max(worst[name], rel_error(out, ref))
        last[name] = _checksum(out)

    for name, problem, runner in built:
        for seed in range(calls):
            call(name, problem, runner, seed)
    for name, problem, runner in built:
        call(name, problem, runner, 100)
    if graph:
        for name, problem, runner in built:
            worst[name] = max(worst[name], _graph_replays(world, op, problem, runner, seeds=(200, 201, 202)))
    return [(name, worst[name], op.tolerance(problem), last[name]) for name, problem, _ in built]


def _graph_replays(world: Any, op: Op, problem: Problem, runner: Any, seeds: Sequence[int]) -> float:
    """Capture one call in a CUDA graph, replay it with each seed's inputs copied in; worst error."""
    static = [x.clone() for x in op.inputs(world, problem, seeds[0])]
    out = runner(*static)
    g = capture(world, lambda: runner(*static, out=out))
    worst = 0.0
    for seed in seeds:
        for s, x in zip(static, op.inputs(world, problem, seed)):
            s.copy_(x)
        out.fill_(math.nan)
        world.sync()
        g.replay()
        world.sync()
        runner.check()
        worst = max(worst, rel_error(out, op.reference(world, problem, seed)))
    del g
    return worst


def assert_ok(results: Sequence[Sequence[tuple]], same_bits: Sequence[str] = ()) -> None:
    """Every rank within tolerance; cases whose name starts with one of `same_bits` bitwise equal across ranks."""
    for rank, rows in enumerate(results):
        bad = [(name, err, tol) for name, err, tol, _ in rows if not err <= tol]
        assert not bad, f"rank {rank}: outside tolerance: {bad}"
    for i, (name, *_rest) in enumerate(results[0]):
        if any(name.startswith(p) for p in same_bits):
            sums = [rows[i][3] for rows in results]
            assert len(set(sums)) == 1, f"{name}: ranks returned different bits ({sums})"


# -- faults -------------------------------------------------------------------------------------------
FAULT_BUDGET_S = 2.0  # AUTOFUSE_WAIT_TIMEOUT the fault tests run with
FAULTS = (status.FlagTimeout, status.WorkspaceAborted)
STALE = 3.0  # what fault runs prefill `out` with: finite, so a failed call that leaves it (or stale data) shows


def _call(op: Op, world: Any, problem: Problem, runner: Any, seed: int) -> tuple[str, float]:
    """One call into an `out` prefilled with STALE: ('returned', relative error vs the reference) or
    (the exception's name, how many elements of `out` are not NaN after it: 0 is what a failed call owes)."""
    inputs = op.inputs(world, problem, seed)
    ref = op.reference(world, problem, seed)
    out = torch.full(ref.shape, STALE, dtype=problem.torch_dtype, device=world.device)
    try:
        runner(*inputs, out=out)
        runner.check(out)
    except FAULTS as exc:
        if world.device.type == "cuda":
            torch.cuda.synchronize(world.device)
        return type(exc).__name__, int((~torch.isnan(out)).sum().item())
    return "returned", rel_error(out, ref)


PROGRESS_ENV = "AUTOFUSE_TEST_PROGRESS"  # set (e.g. to 60): fault runs print each call's outcome to stderr and
                                        # dump every thread's stack each that many seconds while one lasts


def _progress(what: str):
    """A printer of `what`'s steps (with seconds since the start) when PROGRESS_ENV is set, else a no-op;
    while set, a stuck step dumps the Python stacks (faulthandler) every PROGRESS_ENV seconds."""
    every = float(os.environ.get(PROGRESS_ENV, "0") or 0)
    if every <= 0:
        return lambda step: None
    faulthandler.dump_traceback_later(every, repeat=True, file=sys.__stderr__)
    t0 = time.monotonic()

    def say(step: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f} s] {what}: {step}", file=sys.__stderr__, flush=True)
        if step == "done":
            faulthandler.cancel_dump_traceback_later()
    say("start")
    return say


def fault_run(world: Any, op: Op, variant: str, dims: dict, dtype: str, config: dict, scenario: str,
              calls: int = 4) -> dict:
    """Run one fault scenario on every rank; returns what this rank saw (see `check_fault_run`).

    late_peer: the last rank sleeps past the budget before its 2nd call. skipped_call: the last rank
    skips the 2nd call. dead_peer: the last rank makes no call after the first. Ranks pass a host
    barrier after every call, as a program's other collectives would: without any such point, a
    rank that skips a call and goes on pairs its next call with the peers' missed one (as NCCL
    collectives do) and that is only found when the sequences end (the last call times out).
    """
    os.environ["AUTOFUSE_WAIT_TIMEOUT"] = str(FAULT_BUDGET_S)
    say = _progress(f"rank {world.rank} {op.name}.{variant} {scenario}")
    problem = problem_of(op, world.size, dims, dtype)
    runner = op.variant(variant).build(world, problem, config)
    victim = world.size - 1
    seen, first_fault_s = [], None
    t0 = time.monotonic()
    outcome = _call(op, world, problem, runner, 0)
    seen.append(outcome)
    say(f"call 0: {outcome[0]}")
    world.sync()
    for i in range(1, calls):
        me = world.rank == victim
        absent = me and (scenario == "dead_peer" or (scenario == "skipped_call" and i == 1))
        if me and scenario == "late_peer" and i == 1:
            time.sleep(FAULT_BUDGET_S + 1.0)
        if not absent:
            t0 = time.monotonic()
            outcome = _call(op, world, problem, runner, i)
            seen.append(outcome)
            say(f"call {i}: {outcome[0]}")
            if outcome[0] != "returned" and first_fault_s is None:
                first_fault_s = time.monotonic() - t0
        world.sync()
    say("done")
    return {"rank": world.rank, "seen": seen, "first_fault_s": first_fault_s, "tol": op.tolerance(problem),
            "victim": victim, "scenario": scenario}


def check_fault_run(results: Sequence[dict]) -> None:
    """No call returned a wrong result, every call that raised left NaN in all of `out`, and every rank
    that kept calling raised, within budget + 5 s."""
    for r in results:
        for kind, err in r["seen"]:
            assert kind != "returned" or err <= r["tol"], f"rank {r['rank']}: silent wrong result ({err:.3g})"
            assert kind == "returned" or err == 0, (
                f"rank {r['rank']}: a call raised {kind} but left {err} elements of out that are not NaN")
        calls_made = len(r["seen"])
        if r["scenario"] == "dead_peer" and r["rank"] == r["victim"]:
            continue
        if calls_made > 1:
            assert r["first_fault_s"] is not None, f"rank {r['rank']} ({r['scenario']}): never raised: {r['seen']}"
            assert r["first_fault_s"] <= FAULT_BUDGET_S + 5.0, (
                f"rank {r['rank']}: {r['first_fault_s']:.1f} s to raise with a {FAULT_BUDGET_S} s budget")
