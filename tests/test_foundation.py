"""Foundation on the CPU emulation: primitives across 1, 2, 4 ranks, bounded waits, launcher failures,
symmetric offsets and shared-memory cleanup. Real processes, gloo, the shm heap, Triton's interpreter."""
from __future__ import annotations

import glob
import os
import re
import time

import pytest
import torch

from autofuse.comm import heap as heap_mod
from autofuse.comm import selftest
from autofuse.comm.world import RankFailed, spawn


def _shm_files() -> set[str]:
    return set(glob.glob(os.path.join(heap_mod.SHM_DIR, f"{heap_mod.SHM_PREFIX}-*")))


def _primitives(world):
    checks = selftest.check_primitives(world, n=300, epochs=24)
    t0 = time.monotonic()
    timeout, refused = selftest.check_timeout(world, waiter=world.size - 1, budget_s=1.0)
    took = time.monotonic() - t0
    again = [(c.name, c.ok, c.detail) for c in selftest.check_primitives(world, n=64, epochs=4)]
    offsets = [(a.name, a.offset) for a in world.heap._allocs]
    return ([(c.name, c.ok, c.detail) for c in checks], None if timeout is None else str(timeout),
            None if refused is None else str(refused), took, again, offsets)


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_primitives_across_ranks(nranks):
    before = _shm_files()
    results = spawn(_primitives, nranks, timeout_s=300)
    waiter = nranks - 1
    for rank, (checks, timeout, refused, took, again, _) in enumerate(results):
        bad = [c for c in checks + again if not c[1]]
        assert not bad, f"rank {rank}: failed checks {bad}"
        assert len(checks) == 7
        assert timeout is not None, f"rank {rank}: the unreachable flag did not time out"
        if rank == waiter:
            assert f"rank {rank} timed out waiting on flag selftest.timeout.flags[0]" in timeout, timeout
        else:  # aborted by the waiter, naming it and its flag
            assert f"rank {rank} stopped because rank {waiter} timed out" in timeout, timeout
            assert "selftest.timeout.flags[0]" in timeout, timeout
        assert refused is not None and "refuses to compute until it is rebuilt" in refused, refused
        assert took < 1.0 + 5.0, f"rank {rank}: {took:.1f} s to fail with a 1 s budget"
    offsets = [r[-1] for r in results]
    assert all(o == offsets[0] for o in offsets), "heap offsets differ across ranks"
    assert _shm_files() <= before, "shared-memory heap files left behind"


def _raise_on_rank_one(world):
    world.heap  # every rank maps the heap first, so cleanup after a crash is exercised
    if world.rank == 1:
        raise ValueError("deliberate failure on rank 1")
    time.sleep(60)  # the launcher must stop this rank instead of waiting for it
    return "should not finish"


def test_rank_failure_stops_the_job_and_names_the_rank():
    before = _shm_files()
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        spawn(_raise_on_rank_one, 2, timeout_s=120)
    assert info.value.rank == 1
    assert "deliberate failure on rank 1" in str(info.value)
    assert time.monotonic() - t0 < 50, "the healthy rank was waited for instead of stopped"
    assert _shm_files() <= before


def _die_hard(world):
    world.heap
    if world.rank == 0:
        os._exit(3)  # no Python cleanup at all
    time.sleep(60)


def test_rank_killed_without_report_is_named():
    before = _shm_files()
    with pytest.raises(RankFailed) as info:
        spawn(_die_hard, 2, timeout_s=120)
    assert info.value.rank == 0 and "exit" in info.value.reason
    assert _shm_files() <= before, "heap files survived a hard crash"


def _killed_while_waiting_for_the_heap(world):
    """Rank 0 makes the heap and waits for rank 1, which never comes: it kills rank 0 (SIGKILL, no cleanup)
    once rank 0 is waiting in the heap's rendezvous."""
    import signal

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if world.rank == 0:
        store.set("pid0", str(os.getpid()))
        world.heap
        return "rank 1 did not kill rank 0"
    pid = int(store.get("pid0"))
    prefix = f"autofuse/heap/0_1/{dist.group.WORLD.group_name}/0"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(store.check([f"{prefix}/{phase}/0"]) for phase in ("arrived", "paths")):
        time.sleep(0.05)
    time.sleep(0.5)  # rank 0 is waiting in store.wait now
    os.kill(pid, signal.SIGKILL)
    time.sleep(60)


def test_a_rank_killed_while_it_waits_for_the_heap_leaves_no_file():
    before = _shm_files()
    with pytest.raises(RankFailed) as info:
        spawn(_killed_while_waiting_for_the_heap, 2, timeout_s=120)
    assert info.value.rank == 0 and "exit" in info.value.reason, info.value
    assert _shm_files() <= before, "a heap file survived a rank killed in the heap rendezvous"


def _rank(world):
    return world.rank


def test_the_launcher_makes_no_named_semaphores(monkeypatch):
    """multiprocessing's queues and locks are named semaphores (/dev/shm/sem.mp-*) that a job killed as a
    group (the launcher with its ranks) leaves behind: the launcher uses none."""
    import multiprocessing.synchronize

    def refuse(*args, **kwargs):
        raise AssertionError("the launcher made a named semaphore")

    monkeypatch.setattr(multiprocessing.synchronize.SemLock, "__init__", refuse)
    assert spawn(_rank, 2, timeout_s=120) == [0, 1]


def _environment(world):
    return os.environ.get("AUTOFUSE_TEST_SPAWN_PROBE"), os.environ.get("TRITON_INTERPRET"), os.getppid()


@pytest.mark.parametrize("start_method", [None, "spawn"])
def test_ranks_see_the_launchers_environment_as_it_is_at_each_spawn(monkeypatch, start_method):
    """CPU ranks fork from a server started at the first spawn (None: the default) or start fresh ("spawn",
    as `autofuse tune` does): either way a rank sees the launcher's environment of that call, a variable set
    or removed after the server started included, and spawn's own settings (TRITON_INTERPRET on CPU)."""
    monkeypatch.setenv("AUTOFUSE_TEST_SPAWN_PROBE", "first")
    assert [r[:2] for r in spawn(_environment, 2, timeout_s=120, start_method=start_method)] == [("first", "1")] * 2
    monkeypatch.setenv("AUTOFUSE_TEST_SPAWN_PROBE", "second")
    assert [r[:2] for r in spawn(_environment, 2, timeout_s=120, start_method=start_method)] == [("second", "1")] * 2
    monkeypatch.delenv("AUTOFUSE_TEST_SPAWN_PROBE")
    got = spawn(_environment, 2, timeout_s=120, start_method=start_method)
    assert [r[:2] for r in got] == [(None, "1")] * 2
    assert all((r[2] == os.getpid()) == (start_method == "spawn") for r in got)  # the fork server is the parent
    with pytest.raises(ValueError, match="start_method 'fork'"):
        spawn(_environment, 2, timeout_s=120, start_method="fork")


def _store_after_rank_0_returned(world):
    import torch.distributed as dist

    if world.rank == 0:
        return "returned"
    time.sleep(1.0)  # rank 0 (the store's process) has returned by now
    store = dist.distributed_c10d._get_default_store()
    store.set("late", "1")
    return store.get("late").decode()


def test_the_store_outlives_rank_0_until_every_rank_has_left_it():
    """The job's store lives in rank 0's process; a peer still using it after rank 0 returned (a refusal, an
    agreement) finds it there: rank 0 exits once every rank has left (bounded)."""
    assert spawn(_store_after_rank_0_returned, 2, timeout_s=120) == ["returned", "1"]


def _sleep_forever(world):
    time.sleep(600)


def test_job_timeout_is_bounded():
    with pytest.raises(RankFailed) as info:
        spawn(_sleep_forever, 2, timeout_s=8)
    assert "limit" in info.value.reason


def _heap_api(world):
    h = world.heap
    a = h.zeros(3, 5, dtype=torch.bfloat16, name="a")
    b = h.full((7,), 2.5, name="b")
    c = h.randn(4, 4, dtype=torch.float16, name="c")
    peer = h.peer_tensor(b, (world.rank + 1) % world.size)
    errors = []
    try:
        h.empty(h.size, name="too-big")
    except heap_mod.HeapFull as exc:
        errors.append(str(exc))
    return (tuple(a.shape), a.dtype == torch.bfloat16, float(a.abs().sum()), float(b.sum()),
            bool(torch.isfinite(c).all()), float(peer.sum()), h.offset_of(b) % heap_mod.ALIGN, errors)


@pytest.mark.parametrize("size", ["1M", "256K"])
def test_heap_allocation_api_and_full_heap_error(monkeypatch, size):
    monkeypatch.setenv("AUTOFUSE_HEAP_SIZE", size)
    for shape, is_bf16, zsum, bsum, finite, peer_sum, align, errors in spawn(_heap_api, 2, timeout_s=120):
        assert shape == (3, 5) and is_bf16 and zsum == 0.0 and bsum == 17.5 and finite
        assert peer_sum == 17.5 and align == 0
        assert errors and "raise AUTOFUSE_HEAP_SIZE (e.g. " in errors[0], errors
        suggested = int(re.search(r"e\.g\. (\d+)M", errors[0]).group(1)) << 20
        needed = int(re.search(r"needs (\d+) B at offset (\d+)", errors[0]).group(1))
        assert suggested > heap_mod.parse_size(size) and suggested >= needed, errors  # never "e.g. 0M"


def _mismatched_allocation(world):
    world.heap.empty(10 + world.rank, name="lopsided")
    world.heap.empty(4, name="next")


def test_divergent_allocations_are_caught():
    with pytest.raises(RankFailed) as info:
        spawn(_mismatched_allocation, 2, timeout_s=120)
    assert "disagrees across ranks" in info.value.reason


def test_parse_size():
    assert heap_mod.parse_size("64M") == 64 << 20
    assert heap_mod.parse_size("2G") == 2 << 30
    assert heap_mod.parse_size("65536") == 65536
    for tiny in ("0", "4096", "0M"):  # AUTOFUSE_HEAP_SIZE=0 gets a clear minimum, not an mmap error
        with pytest.raises(ValueError, match="below the minimum"):
            heap_mod.parse_size(tiny)
    with pytest.raises(ValueError):
        heap_mod.parse_size("lots")


def test_in_own_thread_returns_or_raises_in_the_caller():
    """Variant.build's escape from a CUDA graph's pool (core.op.outside_graph_pool) runs the build in
    a thread of its own: its result comes back, its exception is raised in the caller, and it ran off
    the caller's thread; off CUDA the build runs inline."""
    import threading

    from autofuse.core.op import in_own_thread, outside_graph_pool

    caller = threading.get_ident()
    assert in_own_thread(lambda: threading.get_ident()) != caller
    with pytest.raises(KeyError, match="lost"):
        in_own_thread(lambda: {}["lost"])
    assert outside_graph_pool(torch.device("cpu"), lambda: threading.get_ident()) == caller


def _time_with_budget_by_rank(world) -> str:
    from autofuse.measure import timing

    budget = 5.0 if world.rank == 0 else -1.0  # rank 1's build and check overran the measurement's budget
    try:
        timing.time_fn(world, lambda: None, reps=2, warmup=1, budget_s=budget)
        return "timed"
    except timing.TooSlow as exc:
        return str(exc)


def test_ranks_whose_clocks_left_different_budgets_agree_on_a_timing_verdict():
    """Each rank passes what its own clock left of a measurement's budget; they must agree (the smallest)
    before timing, or one rank gives up while the others wait in the timing's collectives."""
    out = spawn(_time_with_budget_by_rank, 2, timeout_s=120)
    assert all(o.startswith("no time left for eager timing") for o in out), out
