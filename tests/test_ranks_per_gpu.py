"""Several ranks on one GPU (tests and diagnostics only): what can be checked without a GPU.

The mode itself runs on GPUs (`AUTOFUSE_RANKS_PER_GPU=4 AUTOFUSE_TEST_WORLD=2 pytest -m gpu`, README);
here: where ranks go, what the setting accepts, that timing refuses, that sharing ranks get the IPC
heap and no torch_symm (with the reason), and that the case tables skip what a World cannot run,
saying why.
"""
from __future__ import annotations

import pytest
import torch

import harness
from _row_parallel import tiny
from autofuse.comm import heap as heap_mod
from autofuse.comm.world import World, device_plan, spawn
from autofuse.core import registry, settings
from autofuse.core.op import InvalidConfig, Problem
from autofuse.measure import timing
from autofuse.ops import ag_gemm, gemm_rs


def _sharing_world(device: str = "cpu") -> World:
    """A World as a rank of a job whose ranks share a GPU sees itself (no process group behind it)."""
    return World(rank=0, size=2, device=torch.device(device), backend="gloo", shares_gpu=True)


def test_ranks_go_round_robin_and_a_plan_that_does_not_fit_says_what_to_set():
    assert device_plan(2, 1, 2) == [0, 1] and device_plan(2, 4, 2) == [0, 1]  # enough GPUs: one each
    assert device_plan(2, 2, 1) == [0, 0] and device_plan(4, 4, 1) == [0, 0, 0, 0]
    assert device_plan(4, 2, 2) == [0, 1, 0, 1] and device_plan(3, 2, 2) == [0, 1, 0]
    with pytest.raises(ValueError, match="AUTOFUSE_RANKS_PER_GPU=2"):
        device_plan(2, 1, 1)
    with pytest.raises(ValueError, match="at most 2 ranks per GPU"):
        device_plan(3, 2, 1)
    with pytest.raises(ValueError, match="only 0 GPUs"):
        device_plan(1, 4, 0)


def test_the_setting_and_confirmation_on_first_use(monkeypatch):
    monkeypatch.delenv("AUTOFUSE_RANKS_PER_GPU", raising=False)
    assert settings.ranks_per_gpu() == 1
    for bad in ("0", "-1", "two", "65"):
        monkeypatch.setenv("AUTOFUSE_RANKS_PER_GPU", bad)
        with pytest.raises(settings.SettingError, match="AUTOFUSE_RANKS_PER_GPU"):
            settings.ranks_per_gpu()
    monkeypatch.setenv("AUTOFUSE_RANKS_PER_GPU", "4")
    assert settings.ranks_per_gpu() == 4
    monkeypatch.delenv("AUTOFUSE_ONLINE", raising=False)
    assert settings.online("cuda") and not settings.online("cuda", shares_gpu=True)  # never confirmed by timing
    monkeypatch.setenv("AUTOFUSE_ONLINE", "1")
    with pytest.raises(settings.SettingError, match="share a GPU"):
        settings.online("cuda", shares_gpu=True)


def test_timing_refuses_where_ranks_share_a_gpu():
    world = _sharing_world()
    problem = Problem.make("gemm_rs", "float32", 2, M=4, N=4, K=4)
    with pytest.raises(timing.TimingRefused, match="share a GPU.*timings mean nothing"):
        timing.measure(world, gemm_rs.OP, problem, "bsp", {})  # before building anything
    with pytest.raises(timing.TimingRefused):
        timing.time_fn(world, lambda: None)
    with pytest.raises(timing.TimingRefused):
        timing.Batches(world, [lambda: None])


def test_sharing_ranks_get_the_ipc_heap_and_no_torch_symm_with_the_reason():
    cuda = torch.device("cuda", 0)
    assert heap_mod.default_provider(cuda, spans_job=True) == "symm"
    assert heap_mod.default_provider(cuda, spans_job=True, shares_gpu=True) == "torch"
    world = _sharing_world("cuda")
    peers = [(op, v) for op in map(registry.get, registry.names()) for v in op.variants.values() if v.family == "peer"]
    assert {(op.name, v.name) for op, v in peers} >= {("ag_gemm", "torch_symm"), ("gemm_rs", "torch_symm")}
    for op, v in peers:  # torch's symmetric-memory ops, every one
        why = v.unavailable(world)
        assert why and "share a GPU" in why and not v.available(world), (op.name, v.name, why)
    problem = Problem.make("ag_gemm", "bfloat16", 2, M=8, N=8, K=8, gather="rows")
    with pytest.raises(InvalidConfig, match="not available: ranks share a GPU"):
        ag_gemm.OP.variant("torch_symm").build(world, problem, {})
    assert "needs CUDA" in gemm_rs.OP.variant("torch_symm").unavailable(World(0, 2, torch.device("cpu"), "gloo"))
    with pytest.raises(heap_mod.HeapRendezvousError, match="cannot serve.*share a GPU"):
        heap_mod.SymmetricHeap(world, provider="symm")


ODD = {"M": 40, "N": 40, "K": 48}
SKIPPING = [("torch_symm", ODD, "float32", {}), ("push_last", ODD, "float32", tiny(PARTIAL="fp32")),
            ("push_last", {"M": 41, "N": 40, "K": 48}, "float32", tiny(PARTIAL="fp32"))]  # 41 rows over 2 ranks


def test_case_tables_skip_what_the_world_cannot_run_and_say_why():
    rows = spawn(harness.run_cases, 2, gemm_rs.OP, SKIPPING, 1, False, True, device_kind="cpu", timeout_s=300)
    for rank_rows in rows:
        symm, fused, odd = rank_rows[-2], rank_rows[0], rank_rows[-1]
        assert symm[0].startswith("torch_symm") and symm[1] is None
        assert "skipped: torch's symmetric memory needs CUDA" in symm[4]
        assert odd[1] is None and "invalid at 2 ranks" in odd[4] and "not divisible" in odd[4], odd
        assert fused[0].startswith("push_last") and fused[1] <= fused[2] and fused[4] == ""
    with pytest.warns(UserWarning, match="skipped: torch's symmetric memory"):
        harness.assert_ok(rows)
    with pytest.raises(AssertionError, match="every case was skipped"):
        harness.assert_ok([[r for r in rank_rows if r[1] is None] for rank_rows in rows])
