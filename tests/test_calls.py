"""The public entry points (`autofuse.<op>`) as callers use them, on CPU ranks (and GPUs: marker `gpu`).

- A first call made under `torch.inference_mode()` (how inference servers warm up) builds nothing that
  later calls outside it cannot write: every variant of every op, the first call in inference mode, the
  next one outside it, each checked against the op's float64 reference.
"""
from __future__ import annotations

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
    _assert_correct(spawn(_inference_mode_job, 2, GPU_SIZES, device_kind="cuda", timeout_s=900))
