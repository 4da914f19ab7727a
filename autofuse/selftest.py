"""Run every device primitive across the ranks of a World and check the results (doctor, tests).

Also measures what `autofuse doctor` prints: peer read bandwidth (a Triton pull kernel and the copy
engine) and the flag round-trip latency between two ranks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autofuse import status
from autofuse.kernels import selftest as k


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


def sync(world) -> None:
    """Finish this rank's device work, then wait for every rank (the host-side barrier)."""
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)
    dist.barrier(group=world.group)


def _pattern(rank: int, n: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(n, generator=g).to(device)


def _gather_ints(world, values: list[int]) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64, device=world.device)
    every = [torch.empty_like(mine) for _ in range(world.size)]
    dist.all_gather(every, mine, group=world.group)
    return [t.tolist() for t in every]


def check_primitives(world, n: int = 300, epochs: int = 20) -> list[Check]:
    """Ring put, all-to-all load, atomic add/cas/xchg, and an epoch-flag ring for many epochs."""
    heap, r, w, dev = world.heap, world.rank, world.size, world.device
    spin = status.spin_limit(dev.type)
    out: list[Check] = []
    block = 128

    src = heap.empty(n, name="selftest.src")
    src.copy_(_pattern(r, n, dev))
    dst = heap.full((n,), float("nan"), name="selftest.dst")
    flags = heap.zeros(1, dtype=torch.int32, name="selftest.ring_flag")
    sync(world)
    k.ring_put_kernel[(1,)](src, dst, flags, heap.status, heap.bases, r, w, 1, spin, n, BLOCK=block)
    sync(world)
    status.check(heap, "selftest.ring_put")
    prev = (r - 1) % w
    out.append(Check("ring put", bool(torch.equal(dst, _pattern(prev, n, dev))), f"rank {r} got rank {prev}'s data"))

    table = heap.full((w, n), float("nan"), name="selftest.a2a")
    k.all_to_all_load_kernel[(w,)](src, table, heap.bases, r, w, n, BLOCK=block)
    sync(world)
    ok = all(torch.equal(table[p], _pattern(p, n, dev)) for p in range(w))
    out.append(Check("all-to-all load", ok, f"rank {r} read all {w} ranks"))

    counter = heap.zeros(1, dtype=torch.int32, name="selftest.counter")
    sync(world)
    k.atomic_add_kernel[(1,)](counter, heap.bases, r, w)
    sync(world)
    got = int(counter.item())
    out.append(Check("atomic_add from all ranks", got == w, f"counter {got}, expected {w}"))

    lock = heap.zeros(1, dtype=torch.int32, name="selftest.lock")
    old = torch.full((1,), -1, dtype=torch.int32, device=dev)
    sync(world)
    k.cas_claim_kernel[(1,)](lock, old, heap.bases, r)
    sync(world)
    olds = [v[0] for v in _gather_ints(world, [int(old.item())])]
    winners = [i for i, v in enumerate(olds) if v == 0]
    final = _gather_ints(world, [int(lock.item())])[0][0]
    ok = len(winners) == 1 and final == winners[0] + 1 and all(v in (0, final) for v in olds)
    out.append(Check("atomic_cas ownership", ok, f"old values {olds}, lock {final}"))

    word = heap.zeros(1, dtype=torch.int32, name="selftest.xchg")
    old_x = torch.full((1,), -1, dtype=torch.int32, device=dev)
    sync(world)
    k.xchg_kernel[(1,)](word, old_x, heap.bases, r, w)
    sync(world)
    ok = int(word.item()) == prev + 1 and int(old_x.item()) == 0
    out.append(Check("atomic_xchg", ok, f"word {int(word.item())}, expected {prev + 1}"))

    got_buf = torch.full((n,), float("nan"), device=dev)
    peer = (r + 1) % w
    k.get_kernel[(triton_cdiv(n, block),)](src, got_buf, heap.bases, r, peer, n, BLOCK=block)
    sync(world)
    out.append(Check("get from next rank", bool(torch.equal(got_buf, _pattern(peer, n, dev))), f"rank {r} <- {peer}"))

    ring = heap.zeros(1, dtype=torch.int32, name="selftest.token")
    sync(world)
    calls, per_call = 4, max(1, epochs // 4)
    for c in range(calls):
        k.ring_token_kernel[(1,)](ring, heap.status, heap.bases, r, w, 1 + c * per_call, per_call, spin)
    sync(world)
    status.check(heap, "selftest.ring_token")
    last = calls * per_call
    out.append(Check("epoch flags, no reset", int(ring.item()) == last,
                     f"{calls} calls x {per_call} epochs, flag {int(ring.item())}, expected {last}"))
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_timeout(world, spin_limit: int = 2000) -> status.FlagTimeout | None:
    """Wait on a flag no rank ever raises; returns the FlagTimeout the host raised (None: bug)."""
    heap = world.heap
    never = heap.zeros(1, dtype=torch.int32, name="selftest.never")
    sync(world)
    k.wait_kernel[(1,)](never, heap.status, heap.bases, world.rank, 1, spin_limit)
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)
    try:
        status.check(heap, "selftest.wait")
    except status.FlagTimeout as exc:
        return exc
    return None


def measure_link(world, nbytes: int = 256 << 20, iters: int = 5000) -> dict:
    """Peer read bandwidth (GB/s, Triton pull and copy engine) and flag round trip (us), rank 0 <-> 1."""
    heap, r, w, dev = world.heap, world.rank, world.size, world.device
    res: dict = {}
    if w < 2:
        return res
    peer = (r + 1) % w
    if dev.type == "cuda":
        n = nbytes // 4
        src = heap.randn(n, dtype=torch.float32, name="doctor.bw_src")
        dst = torch.empty(n, device=dev)
        block = 4096
        grid = (triton_cdiv(n, block),)

        def pull() -> None:
            k.get_kernel[grid](src, dst, heap.bases, r, peer, n, BLOCK=block, num_warps=8)

        res["pull_GBps"] = nbytes / _time_cuda(world, pull) / 1e9
        remote = heap.peer_tensor(src, peer)
        res["copy_engine_GBps"] = nbytes / _time_cuda(world, lambda: dst.copy_(remote)) / 1e9
        ok = torch.equal(dst, remote)
        res["copy_ok"] = bool(ok)
    else:
        iters = min(iters, 50)
    flags = heap.zeros(1, dtype=torch.int32, name="doctor.token")
    spin = status.spin_limit(dev.type)
    sync(world)
    k.ring_token_kernel[(1,)](flags, heap.status, heap.bases, r, w, 1, 1, spin)  # compile + warm up
    sync(world)
    t0 = time.perf_counter()
    k.ring_token_kernel[(1,)](flags, heap.status, heap.bases, r, w, 2, iters, spin)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dt = time.perf_counter() - t0
    sync(world)
    status.check(heap, "doctor.ring_token")
    res["flag_round_trip_us"] = dt / iters * 2 / w * 1e6
    res["flag_iters"] = iters
    return res


def _time_cuda(world, fn, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    sync(world)
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]
