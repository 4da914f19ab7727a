"""Run every device primitive across the ranks of a World and check the results (doctor, tests).

Also measures what `autofuse doctor` prints: peer read bandwidth (a Triton pull kernel and the copy
engine) and the flag round-trip latency between two ranks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autofuse.comm import status
from autofuse.kernels import selftest as k
from autofuse.core.sizes import cdiv
from autofuse.comm.workspace import workspace


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


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
    ws = workspace(world, "selftest", flags=4)
    out: list[Check] = []
    block = 128

    src = heap.empty(n, name="selftest.src")
    src.copy_(_pattern(r, n, dev))
    dst = heap.full((n,), float("nan"), name="selftest.dst")
    world.sync()
    k.ring_put_kernel[(1,)](src, dst, ws.flags[0:], ws.ctx, 1, n, BLOCK=block)
    world.sync()
    ws.check()
    prev = (r - 1) % w
    out.append(Check("ring put", bool(torch.equal(dst, _pattern(prev, n, dev))), f"rank {r} got rank {prev}'s data"))

    table = heap.full((w, n), float("nan"), name="selftest.a2a")
    k.all_to_all_load_kernel[(w,)](src, table, heap.bases, r, n, BLOCK=block)
    world.sync()
    ok = all(torch.equal(table[p], _pattern(p, n, dev)) for p in range(w))
    out.append(Check("all-to-all load", ok, f"rank {r} read all {w} ranks"))

    counter = heap.zeros(1, dtype=torch.int32, name="selftest.counter")
    world.sync()
    k.atomic_add_kernel[(1,)](counter, heap.bases, r, w)
    world.sync()
    got = int(counter.item())
    out.append(Check("atomic_add from all ranks", got == w, f"counter {got}, expected {w}"))

    lock = heap.zeros(1, dtype=torch.int32, name="selftest.lock")
    old = torch.full((1,), -1, dtype=torch.int32, device=dev)
    world.sync()
    k.cas_claim_kernel[(1,)](lock, old, heap.bases, r)
    world.sync()
    olds = [v[0] for v in _gather_ints(world, [int(old.item())])]
    winners = [i for i, v in enumerate(olds) if v == 0]
    final = _gather_ints(world, [int(lock.item())])[0][0]
    ok = len(winners) == 1 and final == winners[0] + 1 and all(v in (0, final) for v in olds)
    out.append(Check("atomic_cas ownership", ok, f"old values {olds}, lock {final}"))

    word = heap.zeros(1, dtype=torch.int32, name="selftest.xchg")
    old_x = torch.full((1,), -1, dtype=torch.int32, device=dev)
    world.sync()
    k.xchg_kernel[(1,)](word, old_x, heap.bases, r, w)
    world.sync()
    ok = int(word.item()) == prev + 1 and int(old_x.item()) == 0
    out.append(Check("atomic_xchg", ok, f"word {int(word.item())}, expected {prev + 1}"))

    got_buf = torch.full((n,), float("nan"), device=dev)
    peer = (r + 1) % w
    k.get_kernel[(cdiv(n, block),)](src, got_buf, heap.bases, r, peer, n, BLOCK=block)
    world.sync()
    out.append(Check("get from next rank", bool(torch.equal(got_buf, _pattern(peer, n, dev))), f"rank {r} <- {peer}"))

    ring = ws.flags[1:]
    world.sync()
    calls, per_call = 4, max(1, epochs // 4)
    for c in range(calls):
        k.ring_token_kernel[(1,)](ring, ws.ctx, 1 + c * per_call, per_call)
    world.sync()
    ws.check()
    last = calls * per_call
    out.append(Check("epoch flags, no reset", int(ring[0].item()) == last,
                     f"{calls} calls x {per_call} epochs, flag {int(ring[0].item())}, expected {last}"))
    return out


def check_timeout(world, waiter: int = 0, budget_s: float = 0.5
                  ) -> tuple[status.FlagTimeout | None, status.WorkspaceAborted | None]:
    """Every rank waits on a flag nobody raises; rank `waiter` starts first, so its budget runs out
    first and it aborts the others, which stop at once. Returns the FlagTimeout this rank's host
    raised and the WorkspaceAborted of the next call (None where one is missing: a bug), then
    rebuilds the workspace.
    """
    ws = workspace(world, "selftest.timeout", flags=1)
    world.sync()
    if world.rank != waiter:
        time.sleep(budget_s / 2)  # start later than the waiter: its wait runs out first
    k.wait_kernel[(1,)](ws.flags, ws.ctx._replace(budget=int(budget_s * 1e9)), 1)
    timeout = aborted = None
    try:
        ws.check()
    except status.FlagTimeout as exc:
        timeout = exc
    try:
        ws.refuse_if_faulty()
    except status.WorkspaceAborted as exc:
        aborted = exc
    ws.rebuild()
    return timeout, aborted


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
        grid = (cdiv(n, block),)

        def pull() -> None:
            k.get_kernel[grid](src, dst, heap.bases, r, peer, n, BLOCK=block, num_warps=8)

        res["pull_GBps"] = nbytes / _time_cuda(world, pull) / 1e9
        remote = heap.peer_tensor(src, peer)
        res["copy_engine_GBps"] = nbytes / _time_cuda(world, lambda: dst.copy_(remote)) / 1e9
        ok = torch.equal(dst, remote)
        res["copy_ok"] = bool(ok)
    else:
        iters = min(iters, 50)
    ws = workspace(world, "doctor", flags=1)
    world.sync()
    warm = max(1, iters // 4)  # compile, then warm the GPUs up: the first round trips of a process are slow
    k.ring_token_kernel[(1,)](ws.flags, ws.ctx, 1, warm)
    world.sync()
    t0 = time.perf_counter()
    k.ring_token_kernel[(1,)](ws.flags, ws.ctx, 1 + warm, iters)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dt = time.perf_counter() - t0
    world.sync()
    ws.check()
    res["flag_round_trip_us"] = dt / iters * 2 / w * 1e6
    res["flag_iters"] = iters
    return res


def _time_cuda(world, fn, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    world.sync()
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
