"""Helpers shared by the GPU check scripts: host sync, rank agreement, CUDA-graph capture and replay."""
from __future__ import annotations

import math
import time
from typing import Sequence

import torch
import torch.distributed as dist

from autofuse import status
from autofuse.op import rel_error


def sync(world) -> None:
    """Finish this rank's device work (a no-op on the CPU emulation)."""
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)


def agree_any(world, flag: bool) -> bool:
    """True on every rank if `flag` is True on any rank (so ranks skip or stop together)."""
    t = torch.tensor([1.0 if flag else 0.0], device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world.group)
    return bool(t.item() > 0)


def capture(world, runner, inputs: Sequence[torch.Tensor], out: torch.Tensor):
    """Static copies of `inputs` and a CUDA graph of one call into `out` (warm-up on a side stream first)."""
    static = [x.clone() for x in inputs]
    side = torch.cuda.Stream(device=world.device)
    side.wait_stream(torch.cuda.current_stream(world.device))
    with torch.cuda.stream(side):
        runner(*static, out=out)
    torch.cuda.current_stream(world.device).wait_stream(side)
    sync(world)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        runner(*static, out=out)
    sync(world)
    return graph, static, out


def replays(world, captured, cases: Sequence[tuple[Sequence[torch.Tensor], torch.Tensor]], name: str) -> float:
    """Copy each case's inputs into the static buffers, poison the output, replay, compare; worst error."""
    graph, static, out = captured
    worst = 0.0
    for inputs, ref in cases:
        for s, x in zip(static, inputs):
            s.copy_(x)
        out.fill_(math.nan)
        graph.replay()
        sync(world)
        status.check(world.heap, name)
        worst = max(worst, rel_error(out, ref))
    return worst


def graph_check(world, row: dict, runner, data: dict, out: torch.Tensor, name: str, optional: bool) -> None:
    """Capture one call in a CUDA graph, replay it on seeds 2-4 of `data`, record the worst error in
    `row['graph']`; a capture or replay failure marks the row (n/a for an optional peer variant)."""
    captured, error = None, ""
    try:
        captured = capture(world, runner, data[1][0], out)
    except Exception as exc:
        error = f"capture: {type(exc).__name__}: {exc}"
    if agree_any(world, bool(error)):
        row.update(status="n/a" if optional else "FAIL", why=error or "capture failed on the other rank")
        return
    try:
        row["graph"] = replays(world, captured, [data[s] for s in (2, 3, 4)], name)
    except Exception as exc:
        row.update(status="FAIL", why=f"replay: {type(exc).__name__}: {exc}")


def finish(row: dict, t0: float) -> dict:
    """Fail the row if its worst eager/graph error is over tolerance; stamp its duration."""
    errors = [e for e in (row["eager"], row["graph"]) if not math.isnan(e)]
    worst = max(errors) if errors else math.inf
    if row["status"] == "ok" and not worst <= row["tol"]:
        row.update(status="FAIL", why=f"rel error {worst:.3g} > tolerance {row['tol']:.3g}")
    row["s"] = round(time.perf_counter() - t0, 2)
    return row


def report(results: Sequence[Sequence[dict]], t0: float, columns: Sequence[tuple[str, str, int]],
           extra_check=None) -> int:
    """Print one line per case, merging the two ranks' rows (worst error, any FAIL fails); return the
    exit code. `columns` are (row key, header, width) shown before the errors; `extra_check(r0, r1)`
    may return a reason to fail an otherwise passing case."""
    r0s, r1s = results
    head = " ".join(f"{h:{w}}" for _, h, w in columns)
    print(f"{head} {'eager':>9} {'graph':>9} {'tol':>8} {'s':>6}  status")
    failed = 0
    for r0, r1 in zip(r0s, r1s):
        st = "FAIL" if "FAIL" in (r0["status"], r1["status"]) else r0["status"]
        why = r0["why"] or r1["why"]
        extra = extra_check(r0, r1) if extra_check and st == "ok" else None
        if extra:
            st, why = "FAIL", extra
        failed += st == "FAIL"
        cells = " ".join(f"{str(r0[k]):{w}}" for k, _, w in columns)
        print(f"{cells} {max(r0['eager'], r1['eager']):9.2e} {max(r0['graph'], r1['graph']):9.2e} "
              f"{r0['tol']:8.1e} {max(r0.get('s', 0), r1.get('s', 0)):6.1f}  {st}" + (f"  {why[:200]}" if why else ""))
    if len(r0s) != len(r1s):
        print("ranks ran different numbers of cases")
        failed += 1
    print(f"{len(r0s)} cases, {failed} failed, {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0
