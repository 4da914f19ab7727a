"""What every op's tests share, on CPU ranks (Triton's interpreter) and on GPUs (marker `gpu`).

- `run_cases(world, op, cases, calls)`: build each (variant, problem, config) once, call it `calls`
  times with fresh random inputs into NaN-poisoned outputs, then once more with the cases
  interleaved (so calls of different runners share workspaces and epochs), and compare every output
  with the op's float64 reference at `op.tolerance(problem)`. On GPUs each case is also captured in
  a CUDA graph and replayed with new inputs copied into the captured buffers. A case whose variant
  is unavailable on the World (torch_symm where ranks share a GPU, say) is skipped with its reason.
- `assert_ok(results)`: every rank within tolerance; optionally bitwise-equal results across ranks;
  skipped cases and skipped graph replays are reported as warnings, and at least one case must run.
- GPU tests: `gpu()` marks them; they spawn `gpu_world()` ranks (AUTOFUSE_TEST_WORLD, default 2), one
  GPU each or, with AUTOFUSE_RANKS_PER_GPU, several ranks per GPU (autofuse.comm.world: gloo, the
  IPC heap, no timing; BSP runs eagerly on gloo, so its graph replays are skipped there).
- fault scenarios (`late_peer`, `skipped_call`, `dead_peer`): a peer that is late past the wait
  budget, that skips a call, or that never calls; every rank must raise (FlagTimeout or
  WorkspaceAborted) within the budget plus a few seconds, no call may return a wrong result, and
  a call that raises must leave NaN in every element of its `out` (given prefilled with finite
  values, so stale or untouched elements show).
The case tables live in each op's test module and are used by its CPU and GPU tests alike.
- models (tests/test_nn.py, tests/test_moe_nn.py): `cpu_job(fn, world)` spawns one CPU job;
  `unsharded_run(ref, forward)` runs the unsharded reference (logits, loss and every gradient), and
  `against(model, forward, want)` runs a parallelized model the same way, gathers its gradients back
  into the unsharded model's keys (autofuse.nn.full_grads) and measures every difference (`rel`).
"""
from __future__ import annotations

import faulthandler
import math
import os
import sys
import time
import warnings
from typing import Any, Callable, Sequence

import pytest
import torch

from autofuse.comm import status
from autofuse.core import settings
from autofuse.measure.timing import capture
from autofuse.core.op import Op, Problem, rel_error

Case = tuple[str, dict, str, dict]  # (variant, dims, dtype, config)


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


WORLD_ENV = "AUTOFUSE_TEST_WORLD"  # GPU tests: how many ranks they spawn (default 2)


def gpu_world() -> int:
    """The world size of the multi-rank GPU tests: AUTOFUSE_TEST_WORLD, default 2."""
    text = os.environ.get(WORLD_ENV, "").strip() or "2"
    if not text.isdigit() or int(text) < 2:
        raise ValueError(f"{WORLD_ENV}={text!r}: a world size of at least 2")
    return int(text)


def gpu_ranks_fit(ranks: int) -> bool:
    """`ranks` ranks fit the visible GPUs: one each, or several each with AUTOFUSE_RANKS_PER_GPU."""
    return gpus() > 0 and gpus() * settings.ranks_per_gpu() >= ranks


def ranks_share_gpus(ranks: int | None = None) -> bool:
    """Spawned GPU ranks (default gpu_world()) share GPUs here (more ranks than GPUs)."""
    return gpus() < (ranks or gpu_world())


def gpu(min_ranks: int = 2):
    """Marks a test that runs `max(min_ranks, gpu_world())` ranks on CUDA GPUs (`pytest -m gpu` on the GPU
    machine), one GPU each or several per GPU (AUTOFUSE_RANKS_PER_GPU); skipped where they do not fit."""
    ranks = max(min_ranks, gpu_world())
    skip = pytest.mark.skipif(not gpu_ranks_fit(ranks),
                              reason=f"needs {ranks} CUDA GPUs, or fewer with AUTOFUSE_RANKS_PER_GPU (tests only)")
    return lambda fn: pytest.mark.gpu(skip(fn))


def distinct_gpus(count: int, why: str):
    """Marks a GPU test that needs `count` GPUs, one per rank, for `why` (NCCL, torch's symmetric memory,
    timing): skipped with that reason where fewer are visible, whatever AUTOFUSE_RANKS_PER_GPU says."""
    skip = pytest.mark.skipif(gpus() < count, reason=f"needs {count} CUDA GPUs, one per rank: {why}")
    return lambda fn: pytest.mark.gpu(skip(fn))


def problem_of(op: Op, world_size: int, dims: dict, dtype: str) -> Problem:
    return Problem.make(op.name, dtype, world_size, **dims)


def _out_like(ref: torch.Tensor, problem: Problem, device: torch.device) -> torch.Tensor:
    return torch.full(ref.shape, math.nan, dtype=problem.out_dtype, device=device)


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


NO_GLOO_GRAPH = "graph replay skipped: ranks share a GPU, so BSP runs on gloo, which a CUDA graph cannot capture"


def run_cases(world: Any, op: Op, cases: Sequence[Case], calls: int = 3, graph: bool | None = None,
              allow_invalid: bool = False, relayout: Callable[[tuple], tuple] | None = None) -> list[tuple]:
    """Per case: (name, worst relative error, tolerance, checksum of the last output, note); see the module
    doc. A skipped case has error None and its reason as note. `allow_invalid`: a case the World's size
    makes invalid (InvalidInput / InvalidConfig at build, e.g. rows not divisible by 4 ranks) is skipped
    too (for case tables written for 2 ranks and run at another size), as is one whose inputs the op's
    `problem_of` refuses at this size. `relayout`: applied to every call's inputs (the same values in
    another memory layout, e.g. a column-major B), graph replays' static inputs included."""
    from autofuse.core.op import InvalidConfig, InvalidInput

    def inputs_of(problem: Problem, seed: int) -> tuple:
        inputs = op.inputs(world, problem, seed)
        return tuple(relayout(inputs)) if relayout else inputs

    graph = world.device.type == "cuda" if graph is None else graph
    built, skipped = [], []
    for variant, dims, dtype, config in cases:
        problem = problem_of(op, world.size, dims, dtype)
        name = f"{variant} {config} {problem.key}"
        why = op.variant(variant).unavailable(world)
        if why is None:
            try:
                if allow_invalid and op.problem_of is not None:
                    op.problem_of(world, *op.inputs(world, problem, 0))  # e.g. rows not divisible by the ranks
                runner = op.variant(variant).build(world, problem, config)
            except (InvalidInput, InvalidConfig) as exc:
                if not allow_invalid:
                    raise
                why = f"invalid at {world.size} ranks: {exc}"
        if why is not None:
            skipped.append((name, None, op.tolerance(problem), None, f"skipped: {why}"))
            continue
        replay = graph and not (getattr(world, "shares_gpu", False) and op.variant(variant).family == "bsp")
        built.append((name, problem, runner, replay))
    worst = {b[0]: 0.0 for b in built}
    last: dict[str, int] = {}

    def call(name: str, problem: Problem, runner: Any, seed: int) -> None:
        inputs = inputs_of(problem, seed)
        ref = op.reference(world, problem, seed)
        out = _out_like(ref, problem, world.device)
        assert runner(*inputs, out=out) is out
        runner.check()
        worst[name] = max(worst[name], rel_error(out, ref))
        last[name] = _checksum(out)

    for name, problem, runner, _ in built:
        for seed in range(calls):
            call(name, problem, runner, seed)
    for name, problem, runner, _ in built:
        call(name, problem, runner, 100)
    for name, problem, runner, replay in built:
        if replay:
            worst[name] = max(worst[name], _graph_replays(world, op, problem, runner, seeds=(200, 201, 202),
                                                              inputs_of=inputs_of))
    notes = {b[0]: ("" if b[3] or not graph else NO_GLOO_GRAPH) for b in built}
    return [(name, worst[name], op.tolerance(problem), last[name], notes[name]) for name, problem, _, _ in built] + skipped


def gpu_cases(world: Any, op: Op, cases: Sequence[Case], calls: int = 2,
              relayout: Callable[[tuple], tuple] | None = None) -> list[tuple]:
    """run_cases for a GPU case table written for 2 ranks, on however many ranks gpu_world() spawned:
    at other sizes the cases those ranks cannot take are skipped with the reason."""
    return run_cases(world, op, cases, calls, allow_invalid=world.size != 2, relayout=relayout)


def _graph_replays(world: Any, op: Op, problem: Problem, runner: Any, seeds: Sequence[int],
                   inputs_of: Callable[[Problem, int], tuple]) -> float:
    """Capture one call in a CUDA graph, replay it with each seed's inputs copied in; worst error."""
    static = [x.clone() for x in inputs_of(problem, seeds[0])]  # clone keeps a column-major layout
    out = runner(*static)
    g = capture(world, lambda: runner(*static, out=out))
    worst = 0.0
    for seed in seeds:
        for s, x in zip(static, inputs_of(problem, seed)):
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
    """Every rank within tolerance; cases whose name starts with one of `same_bits` bitwise equal across ranks.
    Rows are run_cases' (name, err, tol, checksum[, note]); skipped ones (err None) and notes are warned
    about, and at least one case must have run."""
    for rank, rows in enumerate(results):
        ran = [row for row in rows if row[1] is not None]
        assert ran or not rows, f"rank {rank}: every case was skipped: {[row[4] for row in rows]}"
        bad = [(row[0], row[1], row[2]) for row in ran if not row[1] <= row[2]]
        assert not bad, f"rank {rank}: outside tolerance: {bad}"
    for row in results[0]:
        if len(row) > 4 and row[4]:
            warnings.warn(f"{row[0]}: {row[4]}")
    for i, (name, err, *_rest) in enumerate(results[0]):
        if err is not None and any(name.startswith(p) for p in same_bits):
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
    out = torch.full(ref.shape, STALE, dtype=problem.out_dtype, device=world.device)
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


# -- models against the unsharded one -----------------------------------------------------------------
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference of `a` from `b`, in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def cpu_job(fn: Any, world: int) -> list:
    """Every rank's result of `fn(world)` on `world` CPU ranks (a test module's one spawned job; 600 s bound)."""
    from autofuse.comm.world import spawn

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return spawn(fn, world, device_kind="cpu", timeout_s=600)


def unsharded_run(ref: Any, forward: Any) -> dict:
    """`forward(ref)` -> (logits, loss) on the unsharded model `ref`, the loss's backward: {"logits",
    "loss", "grads": every parameter's gradient by name, "state keys": its state_dict's keys}."""
    logits, loss = forward(ref)
    loss.backward()
    return {"logits": logits, "loss": loss, "grads": {n: p.grad for n, p in ref.named_parameters() if p.grad is not None},
            "state keys": sorted(ref.state_dict())}


def random_head_norms(model: Any) -> Any:
    """`model` (a transformers Qwen3 or Qwen3-MoE) with its per-head q/k norm weights drawn at random:
    transformers' ones would hide a norm left out or applied to the wrong width."""
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.normal_(1.0, 0.5)
    return model


def against(model: Any, forward: Any, want: dict, call: Any = None) -> dict:
    """`forward(model if call is None else call)` -> (logits, loss) on the parallelized `model` and the loss's backward,
    against `unsharded_run`'s `want`: the logits' and loss's relative differences, whether the gathered
    gradients (autofuse.nn.full_grads) have exactly the reference's keys, the worst gradient's
    difference and name, and whether full_state_dict has the reference's keys (`call`: a compiled
    `model`, say)."""
    import autofuse

    logits, loss = forward(model if call is None else call)
    loss.backward()
    grads, ref = autofuse.nn.full_grads(model), want["grads"]
    errs = {k: rel(grads[k], g) if k in grads else math.inf for k, g in ref.items()}
    worst = max(errs, key=errs.get)
    return {"logits": rel(logits, want["logits"]), "loss": rel(loss, want["loss"]), "grad keys": sorted(grads) == sorted(ref),
            "worst grad": errs[worst], "worst name": worst,
            "state keys": sorted(autofuse.nn.full_state_dict(model)) == want["state keys"]}


class Counter:
    """Wrap attributes of objects (functions, methods) with call counters; `restore()` puts them back,
    deleting what was only inherited. The hot-path tests count calls, never time."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._saved: list[tuple] = []

    def wrap(self, obj, name: str, label: str) -> None:
        orig = getattr(obj, name)
        self.counts.setdefault(label, 0)

        def counted(*args, **kwargs):
            self.counts[label] += 1
            return orig(*args, **kwargs)

        self._saved.append((obj, name, orig, name in vars(obj) if hasattr(obj, "__dict__") else True))
        setattr(obj, name, counted)

    def restore(self) -> None:
        for obj, name, orig, own in reversed(self._saved):
            if own:
                setattr(obj, name, orig)
            else:
                delattr(obj, name)
        self._saved.clear()
