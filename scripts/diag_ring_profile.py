"""Is mm_ring's slow timing state (round 26: one timing run in eight at +28%) its pulls losing their overlap?

On 2 GPU ranks, one gemm_rs problem, mm_ring at one config: CAPTURES times over, a graph of INNER calls is
captured (autofuse.measure.timing.capture, as the tuner and confirmation capture), replayed REPS times under
CUDA events (us per call, rank-max), then replayed twice under torch.profiler. From the profile: the pulls'
device activities (copy-engine memcpys, or copy kernels if the driver made them kernels), their time, and the
share of it that overlaps a GEMM kernel on the same GPU. Eager calls are profiled once too. Prints a row per
capture and writes JSON:

    python3 scripts/diag_ring_profile.py --out diag-ring-profile.json
"""
from __future__ import annotations

import argparse
import json
import sys

PROBLEM = "gemm_rs|K=14336,M=6144,N=4096|bfloat16|w2"
GEMM_WORDS = ("gemm", "cutlass", "nvjet", "sm90_xmma", "xmma")


def _overlap(spans: list[tuple[float, float]], others: list[tuple[float, float]]) -> float:
    """Total length of `spans` covered by the union of `others` (same clock)."""
    total = 0.0
    for a, b in spans:
        for c, d in others:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                total += hi - lo
    return total


def _activities(prof) -> dict:
    """Device activities of a profile: copies (memcpy activities or copy kernels) and GEMM kernels,
    their total us and the us of copies that overlap a GEMM."""
    copies, gemms, names = [], [], {}
    for e in prof.events():
        if getattr(e, "device_type", None) is None or str(e.device_type).split(".")[-1] != "CUDA":
            continue
        name = e.name
        start, end = e.time_range.start, e.time_range.end
        low = name.lower()
        if "memcpy" in low or "copy" in low:
            copies.append((start, end))
            names[name] = names.get(name, 0) + 1
        elif any(w in low for w in GEMM_WORDS):
            gemms.append((start, end))
    copy_us = sum(b - a for a, b in copies)
    return {"copies": len(copies), "copy_us": copy_us, "overlapped_us": _overlap(copies, gemms),
            "gemms": len(gemms), "gemm_us": sum(b - a for a, b in gemms), "copy_names": names}


def run(world, variant: str, config: dict, captures: int, inner: int, reps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from autofuse.core import registry
    from autofuse.core.op import Problem
    from autofuse.measure.timing import build_checked, capture, events_us

    op = registry.get("gemm_rs")
    problem = Problem.from_key(PROBLEM)
    runner, why, _ = build_checked(world, op, problem, variant, config)
    if runner is None:
        return {"error": why}
    inputs = op.inputs(world, problem, 1)
    out = runner(*inputs)

    def batch() -> None:
        for _ in range(inner):
            runner(*inputs, out=out)

    world.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        batch()
        torch.cuda.synchronize()
    world.sync()
    result = {"eager": _activities(prof), "captures": []}
    for _ in range(captures):
        graph = capture(world, batch)
        graph.replay()
        world.sync()
        us = [events_us(graph.replay, 1) / inner for _ in range(reps)]
        us.sort()
        median = world.rank_max(us[len(us) // 2])
        world.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            graph.replay()
            torch.cuda.synchronize()
        world.sync()
        result["captures"].append({"us": median, **_activities(prof)})
        del graph
        world.sync()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="mm_ring")
    ap.add_argument("--config", default='{"CHUNKS": 4}')
    ap.add_argument("--captures", type=int, default=10)
    ap.add_argument("--inner", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="diag-ring-profile.json")
    args = ap.parse_args()
    from autofuse.comm.world import spawn

    results = spawn(run, 2, args.variant, json.loads(args.config), args.captures, args.inner, args.reps,
                    device_kind="cuda", timeout_s=300)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    for rank, r in enumerate(results):
        if "error" in r:
            print(f"rank {rank}: {r['error']}")
            continue
        e = r["eager"]
        print(f"rank {rank} eager: {e['copies']} copies {e['copy_us']:.0f} us, {e['overlapped_us']:.0f} us under a GEMM; "
              f"{e['gemms']} GEMMs {e['gemm_us']:.0f} us; {e['copy_names']}")
        for i, c in enumerate(r["captures"]):
            print(f"rank {rank} capture {i}: {c['us']:7.1f} us/call (rank-max median); copies {c['copies']} "
                  f"{c['copy_us']:.0f} us, {c['overlapped_us']:.0f} under a GEMM; GEMMs {c['gemms']} {c['gemm_us']:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
