"""Hybrid variants (autofuse.ops.hybrid): heap collectives beside torch.matmul, against float64 references.

The variants are built straight from Problem objects of three small test ops that mirror the public
semantics of ag_gemm (both gather forms), gemm_rs and gemm_ar (the op modules are being ported
elsewhere; these tests do not depend on them). One case table per op, used by the CPU tests (2 and 4
ranks) and by the GPU test (GPU sizes, CUDA-graph replay through tests/harness.py).
"""
from __future__ import annotations

import os
import random

import pytest
import torch

import harness
from autofuse.core import registry
from autofuse.ops import ag_gemm
from autofuse.comm import status
from autofuse.core.op import InvalidConfig, Op, Problem, default_tolerance
from autofuse.comm.workspace import workspaces
from autofuse.comm.world import spawn
from test_collectives import gpu_test

BF, HALF, F32 = "bfloat16", "float16", "float32"


# -- the three ops' semantics (inputs deterministic in (seed, rank), references in float64) ------------
def _gen(seed: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 100_003 + rank * 7_919 + 11)


def _ag_inputs_of(problem: Problem, seed: int, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    m, n, k, w = problem["M"], problem["N"], problem["K"], problem.world
    shape = (m // w, k) if problem["gather"] == "rows" else (m, k // w)
    g = _gen(seed, rank)
    a = torch.randn(shape, generator=g).to(problem.torch_dtype)
    b = torch.randn(k, n, generator=g).to(problem.torch_dtype)
    return a.to(device), b.to(device)


def _ag_reference(world, problem, seed):
    """float64 on the World's device (inputs are drawn on the CPU, so every device sees the same)."""
    dev = world.device
    shards = [_ag_inputs_of(problem, seed, q, dev)[0].double() for q in range(problem.world)]
    full = torch.cat(shards, dim=0 if problem["gather"] == "rows" else 1)
    return full @ _ag_inputs_of(problem, seed, world.rank, dev)[1].double()


def _row_inputs_of(problem: Problem, seed: int, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    m, n, k, w = problem["M"], problem["N"], problem["K"], problem.world
    g = _gen(seed, rank)
    a = torch.randn(m, k // w, generator=g).to(problem.torch_dtype)
    b = torch.randn(k // w, n, generator=g).to(problem.torch_dtype)
    return a.to(device), b.to(device)


def _sum_reference(world, problem, seed):
    total = None
    for q in range(problem.world):
        a, b = _row_inputs_of(problem, seed, q, world.device)
        part = a.double() @ b.double()
        total = part if total is None else total + part
    return total


def _rs_reference(world, problem, seed):
    per = problem["M"] // problem.world
    return _sum_reference(world, problem, seed)[world.rank * per:(world.rank + 1) * per]


def hybrids(op: str) -> list:
    """Fresh instances of the hybrid variants the op module defines (family "hybrid")."""
    return [type(v)() for v in registry.get(op).variants.values() if v.family == "hybrid"]


def _op(name, inputs_of, reference) -> Op:
    return Op(name=name, args=("a", "b"), variants=hybrids(name), problem_of=None,
              inputs=lambda world, problem, seed: inputs_of(problem, seed, world.rank, world.device),
              reference=reference, tolerance=lambda p: default_tolerance(p.dtype, p["K"]),
              features=lambda p: {}, sweep=lambda kind, w: [])


OPS = {"ag_gemm": _op("ag_gemm", _ag_inputs_of, _ag_reference),
       "gemm_rs": _op("gemm_rs", _row_inputs_of, _rs_reference),
       "gemm_ar": _op("gemm_ar", _row_inputs_of, _sum_reference)}

SMALL = {"COMM_SMS": 2, "BLOCK": 1024, "num_warps": 4}
OVER = {"FLAG": "shard", "PRIORITY": "high"}


def _ag(m, n, k, gather):
    return {"M": m, "N": n, "K": k, "gather": gather}


def _mk(m, n, k):
    return {"M": m, "N": n, "K": k}


CASES = {
    "ag_gemm": [
        ("heap_mm", _ag(8, 24, 32, "rows"), BF, {"ENGINE": "sm", "ALGO": "inbox", **SMALL}),
        ("heap_mm", _ag(8, 24, 32, "rows"), HALF, {"ENGINE": "sm", "ALGO": "push", **SMALL}),
        ("heap_mm", _ag(4, 24, 32, "rows"), F32, {"ENGINE": "ce", "COMM_SMS": 1}),
        ("heap_mm", _ag(5, 24, 32, "k"), BF, {"ENGINE": "sm", "ALGO": "pull", **SMALL}),
        ("heap_mm_overlap", _ag(8, 24, 32, "rows"), BF, {"ENGINE": "sm", "ALGO": "push", **SMALL, **OVER}),
        ("heap_mm_overlap", _ag(12, 24, 32, "rows"), F32,
         {"ENGINE": "sm", "ALGO": "inbox", **SMALL, "FLAG": "row_block", "CHUNKS": 2, "PRIORITY": "normal"}),
        ("heap_mm_overlap", _ag(6, 24, 32, "k"), BF, {"ENGINE": "sm", "ALGO": "inbox", **SMALL, **OVER}),
        ("heap_mm_overlap", _ag(8, 16, 32, "rows"), HALF, {"ENGINE": "ce", "COMM_SMS": 1, **OVER}),
    ],
    "gemm_rs": [
        ("mm_heap", _mk(8, 40, 32), BF, {"ENGINE": "sm", **SMALL}),
        ("mm_heap", _mk(8, 24, 32), F32, {"ENGINE": "ce", "COMM_SMS": 1}),
        ("mm_heap_overlap", _mk(8, 40, 32), BF, {"ENGINE": "sm", **SMALL, **OVER}),
        ("mm_heap_overlap", _mk(16, 24, 32), HALF,
         {"ENGINE": "sm", **SMALL, "FLAG": "row_block", "CHUNKS": 2, "PRIORITY": "normal"}),
    ],
    "gemm_ar": [
        ("mm_heap", _mk(5, 40, 32), BF, {"ENGINE": "sm", "ALGO": "one_shot", **SMALL}),
        ("mm_heap", _mk(5, 40, 32), HALF, {"ENGINE": "sm", "ALGO": "two_shot", **SMALL}),
        ("mm_heap", _mk(4, 24, 32), F32, {"ENGINE": "ce", "ALGO": "one_shot", "COMM_SMS": 1}),
        ("mm_ll", _mk(5, 40, 32), BF, {"COMM_SMS": 2, "BLOCK": 256, "num_warps": 4}),
        ("mm_ll", _mk(3, 24, 32), HALF, {"COMM_SMS": 4, "BLOCK": 256, "num_warps": 4}),
        ("mm_ll", _mk(3, 24, 32), F32, {}),
    ],
}
FOUR_RANKS = {"ag_gemm": [0, 3, 4, 6], "gemm_rs": [0, 3], "gemm_ar": [1, 3]}
SAME_BITS = ("mm_heap", "mm_ll")  # gemm_ar's heap all-reduces sum in rank order: bitwise equal on every rank


def _cpu_job(world, picks):
    return {op: harness.run_cases(world, OPS[op], [CASES[op][i] for i in idx], calls=2) for op, idx in picks.items()}


def _assert_all(results):
    for op in results[0]:
        harness.assert_ok([r[op] for r in results], same_bits=SAME_BITS if op == "gemm_ar" else ())


def test_two_ranks_every_hybrid():
    picks = {op: list(range(len(cases))) for op, cases in CASES.items()}
    _assert_all(spawn(_cpu_job, 2, picks, device_kind="cpu", timeout_s=900))


def test_four_ranks():
    _assert_all(spawn(_cpu_job, 4, FOUR_RANKS, device_kind="cpu", timeout_s=900))


def test_one_rank_overlap_variants_without_peers():
    _assert_all(spawn(_cpu_job, 1, {"ag_gemm": [4, 6], "gemm_rs": [2], "gemm_ar": [0]}, device_kind="cpu",
                      timeout_s=600))


# -- faults (the overlap waits too) --------------------------------------------------------------------
FAULTS = [
    ("ag_gemm", "heap_mm_overlap", _ag(8, 24, 32, "rows"), BF, {"ENGINE": "sm", "ALGO": "push", **SMALL, **OVER},
     ("late_peer", "skipped_call", "dead_peer")),
    ("ag_gemm", "heap_mm", _ag(6, 24, 32, "k"), BF, {"ENGINE": "sm", "ALGO": "inbox", **SMALL}, ("skipped_call",)),
    ("gemm_rs", "mm_heap_overlap", _mk(8, 40, 32), BF, {"ENGINE": "sm", **SMALL, **OVER},
     ("late_peer", "skipped_call")),
    ("gemm_ar", "mm_heap", _mk(4, 40, 32), BF, {"ENGINE": "sm", "ALGO": "two_shot", **SMALL}, ("skipped_call",)),
    ("gemm_ar", "mm_ll", _mk(4, 40, 32), BF, {"COMM_SMS": 2, "BLOCK": 256, "num_warps": 4},
     ("late_peer", "skipped_call", "dead_peer")),
]


def _fault_job(world, plan):
    os.environ["AUTOFUSE_WAIT_TIMEOUT"] = str(harness.FAULT_BUDGET_S)
    seen = []
    for op, variant, dims, dtype, config, scenario in plan:
        seen.append(harness.fault_run(world, OPS[op], variant, dims, dtype, config, scenario, calls=3))
        world.sync()
        for ws in workspaces(world):
            ws.rebuild()
    return seen


def test_faults_raise_on_every_rank_and_never_return_wrong_results():
    plan = [(op, v, d, t, c, s) for op, v, d, t, c, scenarios in FAULTS for s in scenarios]
    results = spawn(_fault_job, 2, plan, device_kind="cpu", timeout_s=900)
    for i in range(len(plan)):
        harness.check_fault_run([r[i] for r in results])


STALE_CASES = [
    ("heap_mm", _ag(8, 24, 32, "rows"), BF, {"ENGINE": "sm", "ALGO": "inbox", **SMALL}),
    ("heap_mm", _ag(8, 24, 32, "rows"), BF, {"ENGINE": "sm", "ALGO": "push", **SMALL}),
    ("heap_mm_overlap", _ag(8, 24, 32, "rows"), BF, {"ENGINE": "sm", "ALGO": "push", **SMALL, **OVER}),
]


def _stale_job(world, cases):
    """Per case: the last rank skips call 1 (every rank passes a barrier after it), so its peers time out and
    abort it; then every rank calls again WITHOUT reading the fault record (as a GPU call that is not checked)
    into an `out` prefilled with finite values. Returns, per case and for that call: (what it raised or
    'launched', the relative error of its finite elements against the reference, how many elements are finite
    after `check(out)`)."""
    os.environ["AUTOFUSE_WAIT_TIMEOUT"] = str(harness.FAULT_BUDGET_S)
    op, rows = OPS["ag_gemm"], []
    for variant, dims, dtype, config in cases:
        problem = harness.problem_of(op, world.size, dims, dtype)
        runner = op.variant(variant).build(world, problem, config)
        for seed in (0, 1):
            if seed == 0 or world.rank != world.size - 1:
                try:
                    runner(*op.inputs(world, problem, seed))
                    runner.check()
                except harness.FAULTS:
                    pass
            world.sync()
        ref = op.reference(world, problem, 2).to(problem.torch_dtype)
        out = torch.full(ref.shape, harness.STALE, dtype=problem.torch_dtype, device=world.device)
        try:
            runner(*op.inputs(world, problem, 2), out=out)
            what = "launched"
        except status.WorkspaceAborted:
            what = "WorkspaceAborted"
        finite = torch.isfinite(out)
        err = float((out[finite] - ref[finite]).double().norm() / ref[finite].double().norm()) if finite.any() else 0.0
        try:
            runner.check(out)
        except harness.FAULTS:
            pass
        rows.append((what, err, int(torch.isfinite(out).sum()), problem.key))
        world.sync()
        for ws in workspaces(world):
            ws.rebuild()
    return rows


def _assert_no_stale(results) -> None:
    last = len(results) - 1
    for rank, rows in enumerate(results):
        for what, err, finite, key in rows:
            assert what == ("launched" if rank == last else "WorkspaceAborted"), (rank, key, what)
            assert err <= 1e-2, f"rank {rank} {key}: finite values of an aborted call are wrong (rel err {err:.3g})"
            assert finite == 0, f"rank {rank} {key}: {finite} elements not NaN after the fault was read"


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_call_after_a_peers_fault_reads_no_stale_data(world_size):
    """A rank whose workspace a peer aborted reads none of the peers' data (a flag of its epoch may have come
    from the peer's other call, the one it skipped): no finite value of `out` is wrong even before the fault
    is read, and once it is read (`check(out)`) every element is NaN. The peers refuse the call (NaN)."""
    cases = STALE_CASES if world_size == 2 else STALE_CASES[:1]
    _assert_no_stale(spawn(_stale_job, world_size, cases, device_kind="cpu", timeout_s=600))


@harness.gpu(2)
def test_gpu_a_call_after_a_peers_fault_reads_no_stale_data():
    _assert_no_stale(spawn(_stale_job, harness.gpu_world(), STALE_CASES, device_kind="cuda", timeout_s=900))


# -- spaces, defaults, checks (no ranks) ---------------------------------------------------------------
class _Trial:
    def __init__(self, seed):
        self.rng = random.Random(seed)

    def suggest_categorical(self, name, choices):
        return self.rng.choice(list(choices))

    def suggest_int(self, name, low, high, step=1, log=False):
        return self.rng.randrange(low, high + 1, step)


PROBLEMS = [Problem.make("ag_gemm", BF, w, **_ag(m, 3584, 8192, g)) for w in (2, 4, 8) for m in (8, 1024, 16384)
            for g in ("rows", "k")] + [
    Problem.make(op, BF, w, **_mk(m, 8192, 14336)) for op in ("gemm_rs", "gemm_ar") for w in (2, 8)
    for m in (8 * w, 1024, 8192)]


def test_defaults_and_sampled_configs_pass_checks():
    for problem in PROBLEMS:
        for variant in hybrids(problem.op):
            defs = variant.defaults(problem)
            too_big = variant.name == "mm_ll" and problem["M"] * problem["N"] * 2 > 4 << 20
            assert bool(defs) != too_big, (variant, problem)  # mm_ll: small messages only
            if too_big:
                assert "more than the low-latency" in variant.check(problem, {})
                continue
            for cfg in defs:
                assert variant.check(problem, cfg) is None, (variant, problem.key, cfg, variant.check(problem, cfg))
            for seed in range(20):
                cfg = variant.space(_Trial(seed), problem)
                assert variant.check(problem, cfg) is None, (variant, problem.key, cfg, variant.check(problem, cfg))
            assert variant.family == "hybrid" and variant.tunable


@pytest.mark.parametrize("op,name,dims,config,needle", [
    ("ag_gemm", "heap_mm", _ag(7, 64, 64, "rows"), {}, "not divisible by the world size"),
    ("ag_gemm", "heap_mm", _ag(8, 64, 64, "cols"), {}, "gather must be rows or k"),
    ("ag_gemm", "heap_mm", _ag(8, 64, 64, "k"), {"ENGINE": "ce"}, "copy engine does not run all_gather along columns"),
    ("ag_gemm", "heap_mm", _ag(8, 64, 64, "rows"), {"FLAG": "shard"}, "unknown config keys ['FLAG']"),
    ("ag_gemm", "heap_mm_overlap", _ag(8, 64, 64, "rows"), {"FLAG": "row_block", "PRIORITY": "high"}, "needs CHUNKS"),
    ("ag_gemm", "heap_mm_overlap", _ag(8, 64, 64, "rows"), {"FLAG": "shard", "CHUNKS": 2, "PRIORITY": "high"},
     "drop CHUNKS"),
    ("ag_gemm", "heap_mm_overlap", _ag(8, 64, 64, "rows"), {"FLAG": "shard", "PRIORITY": "max"}, "PRIORITY"),
    ("gemm_rs", "mm_heap", _mk(7, 64, 64), {}, "rows are not divisible"),
    ("gemm_rs", "mm_heap_overlap", _mk(8, 64, 64), {"ENGINE": "ce", **OVER}, "ENGINE must be one of ('sm',)"),
    ("gemm_ar", "mm_heap", _mk(8, 64, 63), {}, "K=63 is not divisible"),
    ("gemm_ar", "mm_heap", _mk(8, 64, 64), {"ALGO": "two_shot", "ENGINE": "ce"}, "does not run two_shot"),
])
def test_checks_give_reasons(op, name, dims, config, needle):
    problem = Problem.make(op, BF, 2, **dims)
    variant = OPS[op].variant(name)
    why = variant.check(problem, config)
    assert why is not None and needle in why, why


def test_variants_serve_only_their_op():
    problem = Problem.make("gemm_rs", BF, 2, **_mk(8, 64, 64))
    assert "serves ag_gemm" in ag_gemm.HeapMM().check(problem, {})
    assert [v.name for v in hybrids("ag_gemm")] == ["heap_mm", "heap_mm_overlap"]
    assert [v.name for v in hybrids("gemm_rs")] == ["mm_heap", "mm_heap_overlap", "mm_ring"]  # mm_ring: no heap collective
    ag = Problem.make("ag_gemm", BF, 2, **_ag(8, 64, 64, "rows"))
    assert "serves gemm_rs" in OPS["gemm_rs"].variant("mm_ring").check(ag, {"CHUNKS": 2})
    assert [v.name for v in hybrids("gemm_ar")] == ["mm_heap", "mm_ll"]
    assert [v.name for v in hybrids("flash_decode")] == ["split_heap"]  # its own kind: partials, not a GEMM


def _build_invalid(world):
    problem = Problem.make("ag_gemm", BF, world.size, **_ag(8, 24, 32, "rows"))
    try:
        ag_gemm.HeapMM().build(world, problem, {"ALGO": "ring"})
    except InvalidConfig as exc:
        return str(exc)
    return None


def test_build_rejects_an_invalid_config_before_allocating():
    for msg in spawn(_build_invalid, 2, device_kind="cpu", timeout_s=300):
        assert msg is not None and "ALGO must be one of" in msg


# -- GPU ----------------------------------------------------------------------------------------------
GPU_AG = {"COMM_SMS": 16, "BLOCK": 4096, "num_warps": 8}
GPU_CASES = {
    "ag_gemm": [
        ("heap_mm", _ag(8, 3584, 8192, "rows"), BF, {"ENGINE": "sm", "ALGO": a, **GPU_AG})
        for a in ("inbox", "push", "pull")
    ] + [
        ("heap_mm", _ag(512, 3584, 8192, "rows"), BF, {"ENGINE": "ce", "COMM_SMS": 1}),
        ("heap_mm", _ag(200, 1000, 4096, "k"), HALF, {"ENGINE": "sm", "ALGO": "push", **GPU_AG}),
        ("heap_mm_overlap", _ag(2048, 3584, 8192, "rows"), BF, {"ENGINE": "sm", "ALGO": "push", **GPU_AG, **OVER}),
        ("heap_mm_overlap", _ag(1024, 3584, 8192, "rows"), BF,
         {"ENGINE": "sm", "ALGO": "inbox", **GPU_AG, "FLAG": "row_block", "CHUNKS": 4, "PRIORITY": "high"}),
        ("heap_mm_overlap", _ag(1000, 2048, 8192, "k"), BF, {"ENGINE": "sm", "ALGO": "inbox", **GPU_AG, **OVER}),
    ],
    "gemm_rs": [
        ("mm_heap", _mk(128, 8192, 14336), BF, {"ENGINE": "sm", **GPU_AG}),
        ("mm_heap", _mk(1024, 8192, 14336), BF, {"ENGINE": "ce", "COMM_SMS": 1}),
        ("mm_heap_overlap", _mk(1024, 8192, 14336), BF, {"ENGINE": "sm", **GPU_AG, **OVER}),
        ("mm_heap_overlap", _mk(2000, 5120, 4096), HALF,
         {"ENGINE": "sm", **GPU_AG, "FLAG": "row_block", "CHUNKS": 2, "PRIORITY": "normal"}),
    ],
    "gemm_ar": [
        ("mm_heap", _mk(8, 8192, 8192), BF, {"ENGINE": "sm", "ALGO": "one_shot", **GPU_AG}),
        ("mm_heap", _mk(256, 8192, 8192), BF, {"ENGINE": "sm", "ALGO": "two_shot", **GPU_AG}),
        ("mm_heap", _mk(1000, 8192, 8192), HALF, {"ENGINE": "ce", "ALGO": "one_shot", "COMM_SMS": 1}),
    ],
}


def _gpu_job(world, copy_engine: bool):
    return {op: harness.gpu_cases(world, OPS[op], [c for c in cases if harness.on_copy_engine(c) == copy_engine])
            for op, cases in GPU_CASES.items()}


@gpu_test()
def test_gpu_hybrids_with_graph_replay(monkeypatch):
    """SM-driven collectives on the default heap (torch symmetric memory for the whole job); the
    copy-engine ones on the IPC heap (harness.on_copy_engine)."""
    _assert_all(spawn(_gpu_job, harness.gpu_world(), False, device_kind="cuda", timeout_s=900))
    harness.use_ipc_heap(monkeypatch)
    _assert_all(spawn(_gpu_job, harness.gpu_world(), True, device_kind="cuda", timeout_s=900))
