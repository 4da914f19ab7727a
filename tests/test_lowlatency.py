"""The low-latency (data-as-flag) all-reduce (autofuse.comm.lowlatency, kernels/lowlatency.py).

CPU ranks (Triton's interpreter, shm heap) at 2 and 4 ranks against float64 and bitwise against the flag
protocol's one-shot all-reduce; words an earlier life of the workspace left in its inbox (before a rebuild)
are never taken for the current call's; bad configs and inputs; the kernel compiled for sm_90. gemm_ar's
`mm_ll` runs it through the op tables (tests/test_gemm_ar.py, tests/test_hybrid.py: faults included).
"""
from __future__ import annotations

import time

import harness
import pytest
import torch
import torch.distributed as dist
from conftest import CTX, assert_uniform, compile_request, compile_sm90_many

from autofuse.comm import collectives, lowlatency
from autofuse.comm.world import spawn
from autofuse.core.op import InvalidConfig, InvalidInput

CASES = [  # rows, cols, dtype, config
    (3, 40, torch.bfloat16, {"COMM_SMS": 2, "BLOCK": 256, "num_warps": 4}),
    (5, 24, torch.float16, None),
    (2, 33, torch.float32, {"COMM_SMS": 4, "BLOCK": 256, "num_warps": 8}),
    (1, 2, torch.bfloat16, {"COMM_SMS": 8}),   # one word: programs beyond it send nothing
    (64, 96, torch.bfloat16, {"COMM_SMS": 2, "BLOCK": 512}),   # several blocks per program
]


def _partial(rows, cols, dtype, seed, rank):
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    return torch.randn(rows, cols, generator=g).to(dtype)


def _job(world, cases, calls):
    """Per case and call: (max error vs float64, bitwise equal to the flag protocol's one-shot, the result)."""
    out = []
    for rows, cols, dtype, config in cases:
        ll = lowlatency.all_reduce(world, rows, cols, dtype, config)
        flag = collectives.all_reduce(world, rows, cols, dtype, {"ALGO": "one_shot"})
        for call in range(calls):
            x = _partial(rows, cols, dtype, call, world.rank)
            inplace = x.clone()
            got = ll(inplace, out=inplace) if call % 2 else ll(x)
            every = [torch.empty_like(x) for _ in range(world.size)]
            dist.all_gather(every, x, group=world.group)
            ref = sum(t.double() for t in every)
            out.append((float((got.double() - ref).abs().max()), bool(torch.equal(got, flag(x))), got.float().tolist()))
    return out


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_sums_like_the_one_shot_all_reduce_bitwise_on_every_rank(ranks):
    calls = 4  # epochs 1 (flag path), 2, 3 (after the zeroing of both halves) and 4
    results = spawn(_job, ranks, CASES, calls, device_kind="cpu", timeout_s=600)
    for i, (_, _, dtype, _) in enumerate(c for c in CASES for _ in range(calls)):
        errors = [r[i][0] for r in results]
        assert max(errors) <= ranks * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10) * 8, (i, errors)
        assert all(r[i][1] for r in results), f"case {i}: not the one-shot all-reduce's bits"
        assert all(r[i][2] == results[0][i][2] for r in results), f"case {i}: ranks differ"


def _stale_job(world, stale_tags):
    """Rebuild the workspace, fill both inbox halves with words tagged `stale_tags` (half 0, half 1) as an
    earlier life could have left them, then call 4 times, with the last rank 0.3 s late each time so the
    others poll while only stale words are there: calls 1-2 with a 1-row all-reduce, calls 3-4 with a 4-row
    one on the same workspace (so their slots reach words that calls 1-2 did not overwrite). Returns the max
    error per call."""
    cols, dtype, cfg = 32, torch.bfloat16, {"COMM_SMS": 2, "BLOCK": 256}
    big = lowlatency.all_reduce(world, 4, cols, dtype, cfg)
    small = lowlatency.all_reduce(world, 1, cols, dtype, cfg)
    assert small.ws is big.ws
    big(_partial(4, cols, dtype, 99, world.rank))
    world.sync()
    big.ws.rebuild()
    half = big.inbox_half
    garbage = 0x3F803F80  # payload 1.0, 1.0 in bfloat16: wrong sums if read
    for p, tag in enumerate(stale_tags):
        big.inbox[p * half:(p + 1) * half] = (tag << 32) | garbage
    world.sync()
    errors = []
    for call, (ll, rows) in enumerate(((small, 1), (small, 1), (big, 4), (big, 4))):
        x = _partial(rows, cols, dtype, call, world.rank)
        if world.rank == world.size - 1:
            time.sleep(0.3)
        got = ll(x)
        every = [torch.empty_like(x) for _ in range(world.size)]
        dist.all_gather(every, x, group=world.group)
        errors.append(float((got.double() - sum(t.double() for t in every)).abs().max()))
    return errors


@pytest.mark.parametrize("stale", [(2, 1), (4, 3)], ids=["epochs-1-2", "epochs-3-4"])
def test_words_of_an_earlier_life_are_never_taken_for_the_current_call(stale):
    """(2, 1): epoch 1 would take half 1's stale words without the flag, epoch 2 half 0's without the
    zeroing in epoch 1; (4, 3): epochs 3 and 4 would take them without the zeroing in epochs 1 and 2."""
    for errors in spawn(_stale_job, 2, stale, device_kind="cpu", timeout_s=600):
        assert max(errors) < 0.1, errors


@pytest.mark.parametrize("rows,cols,dtype,config,needle", [
    (3, 3, torch.bfloat16, {}, "not a whole number of 32-bit words"),
    (4096, 1024, torch.bfloat16, {}, "more than the low-latency all-reduce's"),
    (4, 8, torch.float64, {}, "not torch.float64"),
    (4, 8, torch.bfloat16, {"COMM_SMS": 3}, "COMM_SMS must be one of"),
    (4, 8, torch.bfloat16, {"BLOCK": 100}, "BLOCK must be one of"),
    (4, 8, torch.bfloat16, {"ALGO": "one_shot"}, "unknown config keys ['ALGO']"),
])
def test_check_gives_reasons(rows, cols, dtype, config, needle):
    why = lowlatency.check(2, rows, cols, dtype, config)
    assert why is not None and needle in why, why
    with pytest.raises(InvalidConfig, match="low-latency all_reduce"):
        lowlatency.resolve(2, rows, cols, dtype, config)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_defaults_pass_their_checks_and_spread_work_over_programs(world):
    for rows, cols in ((1, 8192), (3, 8192), (32, 8192), (256, 8192), (1, 2)):
        defaults = lowlatency.defaults(world, rows, cols, torch.bfloat16)
        assert defaults and len({str(c) for c in defaults}) == len(defaults)
        assert all(lowlatency.check(world, rows, cols, torch.bfloat16, c) is None for c in defaults)
    assert lowlatency.defaults(2, 3, 8192, torch.bfloat16)[0]["COMM_SMS"] >= 8  # 12288 words: many programs


def _bad_inputs(world):
    ll = lowlatency.all_reduce(world, 4, 8, torch.bfloat16)
    seen = []
    for x, out in [(torch.randn(4, 8), None), (torch.randn(4, 9).to(torch.bfloat16), None),
                   (torch.randn(8, 4).to(torch.bfloat16).t(), None),
                   (torch.randn(4, 8).to(torch.bfloat16), torch.empty(4, 8))]:
        try:
            ll(x, out=out)
            seen.append("returned")
        except InvalidInput as exc:
            seen.append(str(exc))
    x = _partial(4, 8, torch.bfloat16, 0, world.rank)
    every = [torch.empty_like(x) for _ in range(world.size)]
    dist.all_gather(every, x, group=world.group)
    ok = torch.allclose(ll(x).double(), sum(t.double() for t in every), atol=0.05)
    return seen, ok


def test_bad_inputs_are_refused_before_launch_and_the_next_call_works():
    for seen, ok in spawn(_bad_inputs, 2, device_kind="cpu", timeout_s=300):
        assert all("low-latency all_reduce: x must be" in s or "out must be" in s for s in seen), seen
        assert ok


SIG = {"x": "*i32", "out": "*i32", "inbox": "*i64", "ctx": CTX, "flags": "*i32", "half_flags": "i32",
       "inbox_half": "i64", "capacity": "i64", "words": "i32", "piece": "i32", "nan_word": "i32",
       "PAIRS": "constexpr", "FP16": "constexpr", "BLOCK": "constexpr"}


def test_kernel_compiles_for_sm90_with_wide_stores_bounded_polls_and_a_system_fence():
    reqs = [compile_request("autofuse.kernels.lowlatency", "ll_all_reduce_kernel", SIG,
                            {"PAIRS": pairs, "FP16": fp16, "BLOCK": 1024}, num_warps=4, num_stages=1,
                            divisible=["x", "out", "inbox", "flags", "inbox_half", "capacity", "words", "piece"],
                            name=name)
            for name, pairs, fp16 in (("bf16", True, False), ("fp16", True, True), ("fp32", False, False))]
    for name, k in compile_sm90_many(reqs).items():
        assert_uniform(k, name)  # every poll's decision is the program's
        ptx = k["ptx"]
        assert "st.global.v2.b64" in ptx or "st.global.v4" in ptx, name  # 16-byte stores of tagged words
        assert "ld.volatile.global" in ptx and "%globaltimer" in ptx, name  # bounded polls
        assert "fence.acq_rel.sys" in ptx, name  # the zeroing of a new life lands before the words


# -- GPU: gemm_ar's mm_ll at decode sizes, eager and under graph replay; its faults ----------------------
MM_LL_GPU = [("mm_ll", {"M": m, "N": 8192, "K": 8192}, dtype, config)
             for m, dtype, config in ((1, "bfloat16", {}), (3, "bfloat16", {"COMM_SMS": 32, "BLOCK": 256}),
                                      (77, "float16", {"COMM_SMS": 64, "BLOCK": 2048, "num_warps": 8}),
                                      (9, "float32", {}), (256, "bfloat16", {}))]


@harness.gpu()
def test_gpu_mm_ll_eager_and_graph_replay_bitwise_equal_across_ranks():
    from autofuse.ops import gemm_ar

    results = spawn(harness.gpu_cases, harness.gpu_world(), gemm_ar.OP, MM_LL_GPU, device_kind="cuda",
                    timeout_s=900)
    harness.assert_ok(results, same_bits=("mm_ll",))


@harness.gpu()
def test_gpu_mm_ll_faults():
    from _row_parallel import check_faults_on_gpus, fault_plan

    from autofuse.ops import gemm_ar

    check_faults_on_gpus(gemm_ar.OP, fault_plan({"M": 8, "N": 8192, "K": 8192}, "bfloat16",
                                                (("mm_ll", {"COMM_SMS": 8, "BLOCK": 1024}),)))


def _misaligned_out(world):
    """gemm_ar mm_ll into an `out=` 2 bytes off a 4-byte boundary (a bfloat16 slice of a larger buffer)."""
    from autofuse.core.op import Problem
    from autofuse.ops import gemm_ar

    problem = Problem.make("gemm_ar", "bfloat16", world.size, M=3, N=40, K=32)
    runner = gemm_ar.OP.variant("mm_ll").build(world, problem, {"COMM_SMS": 2, "BLOCK": 256})
    errors = []
    for seed in (0, 1, 2):
        a, b = gemm_ar.OP.inputs(world, problem, seed)
        buf = torch.full((3 * 40 + 1,), float("nan"), dtype=torch.bfloat16)
        out = buf[1:].view(3, 40)
        runner(a, b, out=out)
        ref = gemm_ar.OP.reference(world, problem, seed)
        errors.append(float((out.double() - ref).abs().max() / ref.abs().max()))
    return errors


def test_mm_ll_writes_an_out_that_is_not_4_byte_aligned():
    for errors in spawn(_misaligned_out, 2, device_kind="cpu", timeout_s=300):
        assert max(errors) < 2 ** -6, errors
