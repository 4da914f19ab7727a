"""Heaps of several process groups in one job (issue 17): sub-groups of any size, in any order, the
whole group before and after them, disjoint groups on different ranks, user-made groups through
World.from_group, and a bounded rendezvous that names the group when a rank never joins.

Each heap moves real data: the self-test ring kernel (remote stores + an epoch flag) and plain
peer_tensor reads and writes. Patterns depend on the heap and the global rank, and every earlier
heap is checked again at the end, so a heap mapped to the wrong peer or shared between two
groups shows up as wrong data. CPU: gloo + shm heap + Triton's interpreter. `-m gpu`: the same
orders with the torch provider on real GPUs (two or four).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import harness
from autofuse.core import settings
from autofuse.comm import heap as heap_mod
from autofuse.kernels import selftest as k
from autofuse.comm.workspace import workspace
from autofuse.comm.world import World, spawn

N = 64
BLOCK = 64


def _pattern(tag: int, grank: int) -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32) + 1000.0 * grank + 100_000.0 * tag


def _exchange(world: World, tag: int, seen: list) -> None:
    """Ring put, peer read and peer write through `world`'s heap; appends what to re-check later."""
    h = world.heap
    r, w, g = world.rank, world.size, world.global_ranks
    prev, nxt = (r - 1) % w, (r + 1) % w
    src = h.empty(N, name=f"t{tag}.src")
    src.copy_(_pattern(tag, g[r]).to(world.device))
    dst = h.full((N,), float("nan"), name=f"t{tag}.dst")
    ws = workspace(world, f"test_groups.t{tag}", flags=1)
    mail = h.zeros(w, name=f"t{tag}.mail")
    world.sync()
    k.ring_put_kernel[(1,)](src, dst, ws.flags, ws.ctx, 1, N, BLOCK=BLOCK)
    world.sync()
    ws.check()
    assert torch.equal(dst.cpu(), _pattern(tag, g[prev])), f"tag {tag}: ring put from global rank {g[prev]} wrong"
    peer_src = h.peer_tensor(src, nxt)
    assert torch.equal(peer_src.cpu(), _pattern(tag, g[nxt])), f"tag {tag}: peer read of global rank {g[nxt]} wrong"
    h.peer_tensor(mail, nxt)[r] = float(g[r] + 1 + tag)
    world.sync()
    assert mail[prev].item() == g[prev] + 1 + tag, f"tag {tag}: peer write from global rank {g[prev]} missing"
    seen.append((tag, world, dst, g[prev]))


def _recheck(seen: list) -> list[int]:
    """Every heap still holds its own data, and no two heaps of this rank overlap."""
    for tag, _, dst, src_rank in seen:
        assert torch.equal(dst.cpu(), _pattern(tag, src_rank)), f"heap of tag {tag} was overwritten"
    heaps = {id(world.heap): world.heap for _, world, _, _ in seen}
    spans = sorted((h._local.data_ptr(), h._local.data_ptr() + h.size) for h in heaps.values())
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, "two groups' heaps overlap on this rank"
    return sorted(tag for tag, *_ in seen)


def _pairs(size: int) -> list[list[int]]:
    """Disjoint sub-groups covering the job: [[0], [1]] at 2 ranks, [[0, 1], [2, 3]] at 4."""
    half = max(1, size // 2)
    return [list(range(i, min(i + half, size))) for i in range(0, size, half)]


def _sub_first(world: World) -> list[int]:
    """A 1-rank sub-world (rank 0 only) before the whole group: the order that hung on two H200."""
    seen: list = []
    one = world.sub(1)
    if one is not None:
        _exchange(one, 1, seen)
        assert World.from_group(one.group) is one and world.sub(1) is one
    _exchange(world, 2, seen)
    assert World.from_group(None) is world
    if world.size >= 4:
        two = world.sub(2)
        if two is not None:
            _exchange(two, 3, seen)
    groups = [dist.new_group(ranks) for ranks in _pairs(world.size)]  # every rank creates every group
    mine = next(g for g, ranks in zip(groups, _pairs(world.size)) if dist.get_rank() in ranks)
    _exchange(World.from_group(mine), 4, seen)
    for w in range(1, world.size + 1):  # what `autofuse tune --world 1,..,W` does with the heap
        sub = world.sub(w)
        if sub is not None:
            _exchange(sub, 10 + w, seen)
        world.rank_max(0.0)  # a collective over the whole job between the sub-group heaps
    return _recheck(seen)


def _whole_first(world: World) -> list[int]:
    """The whole group first, then sub-groups created and used in a different order on different ranks."""
    seen: list = []
    _exchange(world, 1, seen)
    last = dist.new_group([world.size - 1])  # a 1-rank group on the last rank, not rank 0
    pairs = [dist.new_group(ranks) for ranks in _pairs(world.size)]
    again = dist.new_group(list(range(world.size)))  # a second group of every rank gets its own heap
    mine = next(g for g, ranks in zip(pairs, _pairs(world.size)) if dist.get_rank() in ranks)
    if dist.get_rank() != world.size - 1:
        with pytest.raises(ValueError, match="not a member"):
            World.from_group(last)
    upper = dist.get_rank() >= world.size // 2
    if upper:
        _exchange(World.from_group(mine), 2, seen)
        if dist.get_rank() == world.size - 1:
            _exchange(World.from_group(last), 3, seen)
    one = world.sub(1)
    if one is not None:
        _exchange(one, 4, seen)
    other = World.from_group(again)
    assert other is not world and other.heap is not world.heap
    _exchange(other, 5, seen)
    if not upper:
        _exchange(World.from_group(mine), 2, seen)
    return _recheck(seen)


def _run(fn, size: int, device_kind: str = "cpu") -> list:
    return spawn(fn, size, device_kind=device_kind, timeout_s=240)


@pytest.fixture
def small_heap(monkeypatch):
    monkeypatch.setenv("AUTOFUSE_HEAP_SIZE", "256K")
    monkeypatch.setenv("AUTOFUSE_HEAP_TIMEOUT", "60")


@pytest.mark.parametrize("size", [2, 4])
def test_sub_world_before_whole(small_heap, size):
    got = _run(_sub_first, size)
    assert got[0][:2] == [1, 2] and all(2 in tags and 4 in tags for tags in got)


@pytest.mark.parametrize("size", [2, 4])
def test_whole_before_sub_groups_in_rank_dependent_order(small_heap, size):
    got = _run(_whole_first, size)
    assert 4 in got[0] and 3 in got[-1] and all({1, 2, 5} <= set(tags) for tags in got)


def _never_joined(world: World) -> str:
    """Rank 1 never creates the heap: rank 0 must fail within its timeout, naming the group."""
    if world.rank == 1:
        return ""
    try:
        heap_mod.SymmetricHeap(world, timeout_s=2)
    except heap_mod.HeapRendezvousError as exc:
        return str(exc)
    return "no error"


def _disagree(world: World) -> str:
    """The ranks of a fresh group ask for different heap sizes: both fail, saying so."""
    group = World.from_group(dist.new_group(list(range(world.size))))
    try:
        heap_mod.SymmetricHeap(group, size=(1 << 16) * (1 + world.rank), timeout_s=60)
    except heap_mod.HeapRendezvousError as exc:
        return str(exc)
    return "no error"


def _failures(world: World) -> tuple[str, str]:
    return _never_joined(world), _disagree(world)


def test_rendezvous_is_bounded_names_the_group_and_fails_together(small_heap):
    got = _run(_failures, 2)
    msg = got[0][0]
    assert "global ranks [0, 1]" in msg and "[1] never arrived" in msg, msg
    assert "AUTOFUSE_HEAP_TIMEOUT" in msg
    for _, msg in got:
        assert "disagree on the heap's size" in msg and "AUTOFUSE_HEAP_SIZE" in msg, msg


def test_timeout_setting(monkeypatch):
    monkeypatch.delenv("AUTOFUSE_HEAP_TIMEOUT", raising=False)
    assert settings.heap_timeout_s() == settings.DEFAULT_HEAP_TIMEOUT_S
    monkeypatch.setenv("AUTOFUSE_HEAP_TIMEOUT", "12.5")
    assert settings.heap_timeout_s() == 12.5
    monkeypatch.setenv("AUTOFUSE_HEAP_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="AUTOFUSE_HEAP_TIMEOUT"):
        settings.heap_timeout_s()


# -- GPUs: the same orders with the torch provider (CUDA IPC), and torch's symmetric memory fallback --

def _gpus(n: int):
    """n ranks on the GPUs: one each, or several per GPU with AUTOFUSE_RANKS_PER_GPU (the heaps are IPC then)."""
    return pytest.mark.skipif(not harness.gpu_ranks_fit(n),
                              reason=f"needs {n} CUDA GPUs, or fewer with AUTOFUSE_RANKS_PER_GPU (tests only)")


@pytest.fixture
def gpu_heap(monkeypatch):
    monkeypatch.setenv("AUTOFUSE_HEAP_SIZE", "64M")
    monkeypatch.setenv("AUTOFUSE_HEAP_TIMEOUT", "120")
    monkeypatch.delenv("AUTOFUSE_HEAP_PROVIDER", raising=False)


@pytest.mark.gpu
@pytest.mark.parametrize("size", [pytest.param(2, marks=_gpus(2)), pytest.param(4, marks=_gpus(4))])
@pytest.mark.parametrize("order", [_sub_first, _whole_first], ids=["sub_first", "whole_first"])
def test_gpu_group_orders(gpu_heap, size, order):
    got = _run(order, size, "cuda")
    assert all(len(tags) >= 3 for tags in got), got


@pytest.mark.gpu
@_gpus(2)
def test_gpu_rendezvous_is_bounded(gpu_heap):
    msg = _run(_never_joined, 2, "cuda")[0]
    assert "global ranks [0, 1]" in msg and "[1] never arrived" in msg, msg


def _symm_provider(world: World) -> tuple[bool, str]:
    """torch's symmetric memory: fine on the whole job, refused (not hung) on a sub-group."""
    seen: list = []
    world._heap = heap_mod.SymmetricHeap(world, provider="symm")
    _exchange(world, 1, seen)
    one = world.sub(1)
    refused = ""
    if one is not None:
        try:
            heap_mod.SymmetricHeap(one, provider="symm")
        except heap_mod.HeapRendezvousError as exc:
            refused = str(exc)
    return bool(_recheck(seen)), refused


@harness.distinct_gpus(2, "torch's symmetric memory refuses ranks that share a device")
def test_gpu_symm_provider_whole_job_only(gpu_heap):
    got = _run(_symm_provider, 2, "cuda")
    assert all(ok for ok, _ in got)
    assert "spans the whole job" in got[0][1]
