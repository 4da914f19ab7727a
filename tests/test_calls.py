"""The public entry points (`autofuse.<op>`) as callers use them, on CPU ranks (and GPUs: marker `gpu`).

- A first call made under `torch.inference_mode()` (how inference servers warm up) builds nothing that
  later calls outside it cannot write: every variant of every op, the first call in inference mode, the
  next one outside it, each checked against the op's float64 reference.
- A call that raises a fault (FlagTimeout, WorkspaceAborted) leaves NaN in every element of its `out=`,
  given prefilled with finite values: never the previous call's values, data of a peer's other call, or
  this rank's own part alone; after `autofuse.rebuild()` calls are correct again.
"""
from __future__ import annotations

import os

import torch

import harness
from autofuse.core import registry
from autofuse.core.op import Problem, rel_error
from autofuse.comm.world import spawn

TINY = {"ag_gemm": ({"M": 8, "N": 16, "K": 32, "gather": "rows"}, "float32"),
        "gemm_rs": ({"M": 8, "N": 16, "K": 32}, "float32"),
        "gemm_ar": ({"M": 4, "N": 16, "K": 32}, "float32"),
        "flash_decode": ({"B": 2, "Hq": 4, "Hkv": 2, "D": 16, "S": 24}, "bfloat16")}
GPU_SIZES = {"ag_gemm": ({"M": 256, "N": 512, "K": 1024, "gather": "rows"}, "bfloat16"),
             "gemm_rs": ({"M": 256, "N": 512, "K": 1024}, "bfloat16"),
             "gemm_ar": ({"M": 64, "N": 512, "K": 1024}, "bfloat16"),
             "flash_decode": ({"B": 2, "Hq": 32, "Hkv": 8, "D": 128, "S": 1024}, "bfloat16")}


def _inference_mode_job(world, problems: dict, variants: tuple[str, ...] | None = None):
    """Every variant available here (or those named) of every op in `problems`: the first call under
    inference mode, the next outside it. Returns (op, variant, worst relative error, tolerance) each."""
    import autofuse

    rows = []
    for name, (dims, dtype) in problems.items():
        op = registry.get(name)
        problem = Problem.make(name, dtype, world.size, **dims)
        for variant, v in op.variants.items():
            if not v.available(world) or (variants and variant not in variants):
                continue
            worst = 0.0
            for seed, inference in enumerate((True, False)):
                args = op.inputs(world, problem, seed)
                with torch.inference_mode(inference):
                    out = getattr(autofuse, name)(*args, variant=variant)
                worst = max(worst, rel_error(out, op.reference(world, problem, seed)))
            rows.append((name, variant, worst, op.tolerance(problem)))
    return rows


def _assert_correct(results) -> None:
    assert results[0], "no variant ran"
    for rank, rows in enumerate(results):
        for name, variant, err, tol in rows:
            assert err <= tol, f"rank {rank}: {name}.{variant}: relative error {err:.3g} > {tol:.3g}"


def test_a_first_call_under_inference_mode_leaves_later_calls_working():
    _assert_correct(spawn(_inference_mode_job, 2, TINY, device_kind="cpu", timeout_s=900))


def test_inference_mode_at_four_ranks():
    _assert_correct(spawn(_inference_mode_job, 4, {"gemm_rs": TINY["gemm_rs"]}, ("bsp", "mm_heap"),
                          device_kind="cpu", timeout_s=900))


@harness.gpu(2)
def test_gpu_a_first_call_under_inference_mode_leaves_later_calls_working():
    _assert_correct(spawn(_inference_mode_job, harness.gpu_world(), GPU_SIZES, device_kind="cuda", timeout_s=900))


FAULT_CASES = [("ag_gemm", "heap_mm_overlap"), ("gemm_ar", "one_shot")]


def _fault_job(world, cases, problems: dict = TINY):
    """Per (op, variant): call 0 on every rank; call 1 skipped by the last rank (a barrier after it, so the
    others time out and abort it); call 2 on every rank (the others refuse, the last rank reads the abort);
    `autofuse.rebuild()`; call 3. Every call into an `out=` prefilled with finite values. Returns per case
    [(call, what it raised or 'returned', non-NaN elements left after a raise or the relative error)]."""
    import autofuse

    os.environ["AUTOFUSE_WAIT_TIMEOUT"] = str(harness.FAULT_BUDGET_S)  # before the workspaces are made
    os.environ["AUTOFUSE_CHECK"] = "1"  # GPUs read the fault record of every call (CPU always does)
    seen = []
    for name, variant in cases:
        op = registry.get(name)
        dims, dtype = problems[name]
        problem = Problem.make(name, dtype, world.size, **dims)
        rows = []
        for i in range(4):
            if i == 1 and world.rank == world.size - 1:
                world.sync()
                continue
            if i == 3:
                autofuse.rebuild()
            ref = op.reference(world, problem, i)
            out = torch.full(tuple(ref.shape), harness.STALE, dtype=problem.torch_dtype, device=world.device)
            try:
                getattr(autofuse, name)(*op.inputs(world, problem, i), variant=variant, out=out)
                rows.append((i, "returned", rel_error(out, ref)))
            except harness.FAULTS as exc:
                rows.append((i, type(exc).__name__, int((~torch.isnan(out)).sum())))
            world.sync()
        seen.append((name, variant, rows, op.tolerance(problem)))
    return seen


def _assert_fault_outputs(results) -> None:
    last = len(results) - 1
    for rank, cases in enumerate(results):
        for name, variant, rows, tol in cases:
            what = {i: (kind, x) for i, kind, x in rows}
            expected = {0: "returned", 2: "FlagTimeout" if rank == last else "WorkspaceAborted", 3: "returned"}
            if rank != last:
                expected[1] = "FlagTimeout"
            assert {i: k for i, (k, _) in what.items()} == expected, (rank, name, variant, rows)
            for i, (kind, x) in what.items():
                if kind == "returned":
                    assert x <= tol, (rank, name, variant, i, x)
                else:
                    assert x == 0, f"rank {rank} {name}.{variant} call {i}: {kind} left {x} elements that are not NaN"


def test_a_call_that_raises_leaves_nan_in_out():
    _assert_fault_outputs(spawn(_fault_job, 2, FAULT_CASES, device_kind="cpu", timeout_s=600))


def test_a_call_that_raises_leaves_nan_in_out_at_four_ranks():
    _assert_fault_outputs(spawn(_fault_job, 4, FAULT_CASES[:1], device_kind="cpu", timeout_s=600))


@harness.gpu(2)
def test_gpu_a_call_that_raises_leaves_nan_in_out():
    _assert_fault_outputs(spawn(_fault_job, harness.gpu_world(), FAULT_CASES, GPU_SIZES, device_kind="cuda",
                                timeout_s=900))
