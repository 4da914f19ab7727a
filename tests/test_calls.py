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

import pytest
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


@pytest.mark.sweep  # 40 s on CI's two cores; the 2-rank test covers every variant
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


@pytest.mark.sweep  # 45 s on CI's two cores; test_hybrid's stale-data test runs at 4 ranks
def test_a_call_that_raises_leaves_nan_in_out_at_four_ranks():
    _assert_fault_outputs(spawn(_fault_job, 4, FAULT_CASES[:1], device_kind="cpu", timeout_s=600))


@harness.gpu(2)
def test_gpu_a_call_that_raises_leaves_nan_in_out():
    _assert_fault_outputs(spawn(_fault_job, harness.gpu_world(), FAULT_CASES, GPU_SIZES, device_kind="cuda",
                                timeout_s=900))


# -- one rank's mistake (issue 31, item 2): never a hang, never a wrong result on the others -------------
MISTAKE_CASES = {"gemm_ar": ({"M": 4, "N": 16, "K": 32}, "float32"),
                 "ag_gemm": ({"M": 8, "N": 32, "K": 64, "gather": "rows"}, "bfloat16")}


def _mistaken_args(world, op, problem, seed: int, mistake: str) -> tuple[tuple, object]:
    """This rank's (args, out) for call `seed`, with `mistake` made (the last rank only)."""
    args = list(op.inputs(world, problem, seed))
    ref = op.reference(world, problem, seed)
    out = torch.full(tuple(ref.shape), harness.STALE, dtype=problem.torch_dtype, device=world.device)
    if world.rank != world.size - 1:
        return tuple(args), out
    if mistake == "bad_out":
        out = torch.empty(ref.shape[0] + 1, *ref.shape[1:], dtype=problem.torch_dtype, device=world.device)
    elif mistake == "strided_out":
        out = torch.full(tuple(reversed(ref.shape)), harness.STALE, dtype=problem.torch_dtype,
                         device=world.device).t()
    elif mistake == "misaligned":
        a = args[0]
        backing = torch.empty(a.numel() + 1, dtype=a.dtype, device=a.device)
        args[0] = backing[1:].view(a.shape)
        args[0].copy_(a)
    elif mistake == "not_a_tensor":
        args[1] = None
    elif mistake == "new_shape":
        args[0] = torch.cat([args[0], args[0]])
    return tuple(args), out


def _mistake_job(world, cases, budget_s: float = harness.FAULT_BUDGET_S):
    """Per (op, variant, mistake): call 0 on every rank (cached); call 1 with the last rank's mistake; then,
    where the group still works, `autofuse.rebuild()`, call 2 on every rank, and call 3, the first call of a
    new problem on every rank (its agreement must pair every rank's). Returns per case the outcomes: (call,
    what, detail): 'returned' and the relative error, or the exception and its message. A bsp case whose
    peers' collective gave up ends the job (the process group is unusable: no barrier may follow)."""
    import autofuse

    os.environ["AUTOFUSE_WAIT_TIMEOUT"] = str(budget_s)
    os.environ["AUTOFUSE_CHECK"] = "1"  # GPUs read the fault record of every call (CPU always does)
    seen = []
    for name, variant, mistake in cases:
        op = registry.get(name)
        dims, dtype = MISTAKE_CASES[name]
        rows = []
        ends_group = variant == "bsp" and mistake in ("not_a_tensor", "new_shape")
        for i in range(4):
            if i == 2:
                autofuse.rebuild()
            problem = Problem.make(name, dtype, world.size, **{k: v * (2 if i == 3 and k == "N" else 1)
                                                                for k, v in dims.items()})
            args, out = _mistaken_args(world, op, problem, i, mistake if i == 1 else "")
            try:
                got = getattr(autofuse, name)(*args, variant=variant, out=out)
                rows.append((i, "returned", rel_error(got, op.reference(world, problem, i))))
            except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
                rows.append((i, type(exc).__name__, str(exc)))
            if i == 1 and ends_group:
                break
            world.sync()
        seen.append((name, variant, mistake, rows, op.tolerance(problem)))
        if ends_group:
            break
    return seen


def _outcomes(results):
    """{(op, variant, mistake): {rank: {call: (what, detail)}}}"""
    out = {}
    for rank, cases in enumerate(results):
        for name, variant, mistake, rows, tol in cases:
            out.setdefault((name, variant, mistake), {})[rank] = ({i: (w, d) for i, w, d in rows}, tol)
    return out


def _assert_mistakes(results, expect_last, expect_peers, third=True):
    last = len(results) - 1
    for case, per_rank in _outcomes(results).items():
        for rank, (calls, tol) in per_rank.items():
            for i, (what, detail) in calls.items():
                if what == "returned":
                    assert detail <= tol, (case, rank, i, detail)
            assert calls[0][0] == "returned", (case, rank, calls)
            want = expect_last if rank == last else expect_peers
            assert calls[1][0] in want, (case, rank, calls[1])
            if third:
                assert calls[2][0] == "returned" and calls[3][0] == "returned", (case, rank, calls)


def test_a_mistake_one_rank_can_see_lets_the_others_complete():
    """A wrong out=, a strided out= or a misaligned A on one rank of a cached call: that rank runs the call on
    copies (so the others, already in it, complete correctly) and raises InvalidInput where out= was not
    written or the op refuses its input; nothing is aborted (the next call needs no rebuild)."""
    cases = [("gemm_ar", "bsp", "bad_out"), ("gemm_ar", "one_shot", "bad_out"), ("gemm_ar", "one_shot", "strided_out"),
             ("ag_gemm", "push", "misaligned"), ("ag_gemm", "heap_mm", "bad_out")]
    # every rank completes here: a wait budget far above the interpreter's lag on a loaded machine (the
    # rank with the mistake runs the call on copies, after the others started; 2 s failed under load)
    results = spawn(_mistake_job, 2, cases, 30.0, device_kind="cpu", timeout_s=900)
    _assert_mistakes(results, {"InvalidInput", "returned"}, {"returned"})
    outcomes = _outcomes(results)
    for case in cases:
        what, detail = outcomes[case][1][0][1]
        if case[2] == "strided_out":
            assert what == "returned", (case, what, detail)
        elif what == "InvalidInput":
            assert "so that the other ranks complete" in detail and "out was not written" in detail, detail


def test_a_rank_that_does_not_take_part_makes_the_others_raise_in_bounded_time():
    """One rank passes None, or other shapes than the others on a problem they cached: it raises (InvalidInput
    or DispatchMismatch) and, from its first call's agreement, stops the others inside the call they cached
    (heap and fused variants), which raise PeerRefused (a FlagTimeout) naming it; after autofuse.rebuild() on
    every rank, calls and first calls (whose agreement rounds stay paired) work again."""
    cases = [("gemm_ar", "one_shot", "not_a_tensor"), ("gemm_ar", "one_shot", "new_shape"),
             ("ag_gemm", "heap_mm", "new_shape")]
    results = spawn(_mistake_job, 2, cases, device_kind="cpu", timeout_s=900)
    _assert_mistakes(results, {"InvalidInput", "DispatchMismatch"}, {"PeerRefused"})


def test_a_rank_that_does_not_take_part_at_four_ranks():
    results = spawn(_mistake_job, 4, [("gemm_ar", "one_shot", "new_shape")], device_kind="cpu", timeout_s=900)
    _assert_mistakes(results, {"DispatchMismatch"}, {"PeerRefused"})


def test_bsp_peers_of_a_rank_that_does_not_take_part_raise_in_bounded_time():
    """bsp on the CPU emulation: the rank with the mistake stops the others' collective from its agreement
    (CollectiveTimeout naming it) instead of leaving them to the process group's timeout; the group is then
    unusable (it says so)."""
    results = spawn(_mistake_job, 2, [("gemm_ar", "bsp", "not_a_tensor")], 5.0, device_kind="cpu", timeout_s=600)
    _assert_mistakes(results, {"InvalidInput"}, {"CollectiveTimeout"}, third=False)
    calls, _ = _outcomes(results)[("gemm_ar", "bsp", "not_a_tensor")][0]
    assert "restart the job" in calls[1][1], calls[1]


@harness.gpu(2)
def test_gpu_one_ranks_mistake_never_hangs_the_other():
    """The CPU tests' heap and fused cases on GPUs (several ranks may share one GPU): a mistake the rank sees
    lets the other complete; a rank absent from a cached call stops the other there (PeerRefused), and after
    rebuild both work, first calls too."""
    seen = [("gemm_ar", "one_shot", "bad_out"), ("gemm_ar", "one_shot", "strided_out"),
            ("ag_gemm", "push", "misaligned"), ("ag_gemm", "heap_mm", "bad_out")]
    _assert_mistakes(spawn(_mistake_job, harness.gpu_world(), seen, device_kind="cuda", timeout_s=900),
                     {"InvalidInput", "returned"}, {"returned"})
    absent = [("gemm_ar", "one_shot", "not_a_tensor"), ("ag_gemm", "heap_mm", "new_shape")]
    _assert_mistakes(spawn(_mistake_job, harness.gpu_world(), absent, device_kind="cuda", timeout_s=900),
                     {"InvalidInput", "DispatchMismatch"}, {"PeerRefused"})


SETTINGS_SCENARIOS = [
    ("too long everywhere", {"AUTOFUSE_WAIT_TIMEOUT": "1e12"}, {"AUTOFUSE_WAIT_TIMEOUT": "1e12"}),
    ("different", {"AUTOFUSE_WAIT_TIMEOUT": "2"}, {"AUTOFUSE_WAIT_TIMEOUT": "3"}),
    ("bad on one rank", {}, {"AUTOFUSE_HEAP_SIZE": "lots"}),
    ("bad provider on one rank", {}, {"AUTOFUSE_HEAP_PROVIDER": "nvshmem"}),
    ("good", {}, {}),
]


def _settings_job(world, scenarios):
    """Per scenario (name, env of the other ranks, env of the last rank): a first call of gemm_ar one_shot
    (which makes the heap) under that environment. Returns (scenario, what it raised or 'returned', text)."""
    import autofuse
    from autofuse import dispatch

    seen = []
    op = registry.get("gemm_ar")
    dims, dtype = MISTAKE_CASES["gemm_ar"]
    problem = Problem.make("gemm_ar", dtype, world.size, **dims)
    for name, others, last in scenarios:
        env = last if world.rank == world.size - 1 else others
        saved = {k: os.environ.pop(k, None) for k in ("AUTOFUSE_WAIT_TIMEOUT", "AUTOFUSE_HEAP_SIZE",
                                                      "AUTOFUSE_HEAP_PROVIDER")}
        os.environ.update(env)
        dispatch.reset()
        try:
            got = autofuse.gemm_ar(*op.inputs(world, problem, 0), variant="one_shot")
            seen.append((name, "returned", str(rel_error(got, op.reference(world, problem, 0)))))
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            seen.append((name, type(exc).__name__, str(exc)))
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
        world.sync()
    return seen


def test_settings_are_validated_where_every_rank_agrees():
    """A setting that cannot be used (a wait too long for the kernels' clock, a heap size or provider that does
    not parse), on every rank or on one, raises on every rank at the first call, before any heap is made
    (the others never wait in the heap's rendezvous); ranks whose settings differ raise DispatchMismatch
    naming the variable; afterwards a first call works (the agreement rounds stayed paired)."""
    results = spawn(_settings_job, 2, SETTINGS_SCENARIOS, device_kind="cpu", timeout_s=600)
    by = [{name: (what, text) for name, what, text in rows} for rows in results]
    for rank in (0, 1):
        assert by[rank]["too long everywhere"][0] == "SettingError" and "AUTOFUSE_WAIT_TIMEOUT" in by[rank][
            "too long everywhere"][1]
        assert by[rank]["different"][0] == "DispatchMismatch" and "AUTOFUSE_WAIT_TIMEOUT" in by[rank]["different"][1]
        assert by[rank]["good"][0] == "returned" and float(by[rank]["good"][1]) < 1e-3, by[rank]["good"]
    for name, variable in (("bad on one rank", "AUTOFUSE_HEAP_SIZE"), ("bad provider on one rank",
                                                                        "AUTOFUSE_HEAP_PROVIDER")):
        assert by[1][name][0] == "SettingError" and variable in by[1][name][1], by[1][name]
        assert by[0][name][0] == "InvalidInput" and "rank 1" in by[0][name][1] and variable in by[0][name][1], by[0][name]
