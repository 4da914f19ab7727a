"""gemm_rs mm_ring on the GPUs: its host cost per call, piece by piece, and its time alone and in turns.

mm_ring's eager calls cost the host 0.5-1.5 ms (round 25) where its GPU time was 56-114 us, which is
why it refuses problems below AUTOFUSE_RING_MIN_GFLOP. This measures where that host time goes (one
Triton launch with the device context, one without, a 4-byte copy-engine flag write, an event pair, a
stream switch, a small matmul: host microseconds per launch, no sync in the loop) and the whole call's
host time per CHUNKS; then mm_ring, BSP and torch's op timed alone (the tuner's timer) and in turns
(confirmation's timer), graph and eager, over sizes on both sides of the floor. GPU machine, 2 ranks;
prints tables and writes JSON:

    python3 scripts/diag_ring_gpu.py --out diag-ring.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import triton
import triton.language as tl

PROBLEMS = [("bfloat16", 768, 4096, 4096), ("bfloat16", 2048, 4096, 4096), ("bfloat16", 1024, 4096, 14336),
            ("bfloat16", 4096, 4096, 14336), ("bfloat16", 2048, 8192, 8192), ("bfloat16", 6144, 4096, 14336)]
CANDIDATES = [("bsp", {}), ("torch_symm", {}), ("mm_ring", {"CHUNKS": 1}), ("mm_ring", {"CHUNKS": 2}),
              ("mm_ring", {"CHUNKS": 4})]
LAUNCHES = 400


@triton.jit
def _touch(p):
    tl.store(p, tl.load(p))


def _host_us(fn, n: int = LAUNCHES) -> float:
    """Host microseconds per call of `fn` (no device sync inside the loop; one after it)."""
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


def host_costs(world) -> dict:
    """Host us per launch of each piece an mm_ring call is made of, and per whole eager call."""
    import torch

    from autofuse.core import registry
    from autofuse.core.op import Problem
    from autofuse.kernels import ring as k
    from autofuse.measure.timing import build_checked

    op = registry.get("gemm_rs")
    problem = Problem.make("gemm_rs", "bfloat16", world.size, M=768, N=4096, K=4096)
    inputs = op.inputs(world, problem, 0)
    runner, why, _ = build_checked(world, op, problem, "mm_ring", {"CHUNKS": 1})
    if runner is None:
        return {"error": why}
    out = runner(*inputs)
    torch.cuda.synchronize()
    ws = runner.ws
    s = torch.cuda.Stream()
    ev = torch.cuda.Event()
    x = torch.randn(64, 64, device=world.device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    scratch = torch.zeros(1, dtype=torch.int32, device=world.device)

    def stream_switch():
        with torch.cuda.stream(s):
            pass

    def event_pair():
        ev.record()
        s.wait_event(ev)

    pieces = {
        "triton finish_kernel (ctx, 8 programs)": lambda: k.finish_kernel[(8,)](
            ws.ctx, ws.flags, out, out.numel(), BLOCK=1024, num_warps=4),
        "triton one-pointer kernel": lambda: _touch[(1,)](scratch, num_warps=4),
        # the value the flag holds already (my epoch = the previous rank's): the protocol is left as it was
        "copy-engine flag write (4 bytes to a peer)": lambda: runner.taken_before.copy_(runner.current),
        "event record + wait": event_pair,
        "stream switch (enter + exit)": stream_switch,
        "torch.mm 64x64": lambda: torch.mm(x, x, out=y),
    }
    world.sync()
    costs = {name: _host_us(fn) for name, fn in pieces.items()}
    world.sync()
    for chunks in (1, 2, 4):
        r, why, _ = build_checked(world, op, problem, "mm_ring", {"CHUNKS": chunks})
        if r is None:
            costs[f"whole mm_ring call, CHUNKS={chunks}"] = why
            continue
        o = r(*inputs)
        world.sync()
        costs[f"whole mm_ring call, CHUNKS={chunks}"] = _host_us(lambda: r(*inputs, out=o), 100)
        world.sync()
    return costs


def run(world, modes: list[str]) -> dict:
    from autofuse.core import registry
    from autofuse.core.op import Problem
    from autofuse.measure.timing import build_checked, time_fn, time_in_turns

    costs = host_costs(world)
    op = registry.get("gemm_rs")
    rows = []
    for dtype, m, n, k in PROBLEMS:
        problem = Problem.make("gemm_rs", dtype, world.size, M=m, N=n, K=k)
        inputs = op.inputs(world, problem, 0)
        built = []
        for variant, config in CANDIDATES:
            runner, why, err = build_checked(world, op, problem, variant, config)
            if runner is None:
                rows.append({"problem": problem.key, "variant": variant, "config": config, "error": why})
                continue
            out = runner(*inputs)
            built.append((variant, config, lambda r=runner, o=out: r(*inputs, out=o)))
        for mode in modes:
            alone = [time_fn(world, fn, mode, reps=20).median_us for _, _, fn in built]
            turns, _ = time_in_turns(world, [fn for _, _, fn in built], mode, reps=12, rounds=3)
            for (variant, config, _), a, t in zip(built, alone, turns):
                rows.append({"problem": problem.key, "variant": variant, "config": config, "mode": mode,
                             "alone_us": a, "turns_us": t.median_us})
    return {"host_us": costs, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="diag-ring.json")
    ap.add_argument("--modes", default="graph,eager")
    args = ap.parse_args()
    import os

    os.environ.setdefault("AUTOFUSE_RING_MIN_GFLOP", "0")  # every size: this is what the floor is chosen from
    from autofuse.comm.world import spawn

    result = spawn(run, 2, args.modes.split(","), device_kind="cuda", timeout_s=500)[0]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("host us per launch (rank 0, no sync in the loop):")
    for name, us in result["host_us"].items():
        print(f"  {name:46} {us:8.1f}" if isinstance(us, float) else f"  {name}: {us}")
    print(f"{'problem':44} {'variant':10} {'config':14} {'mode':5} {'alone us':>9} {'turns us':>9}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['problem']:44} {r['variant']:10} {json.dumps(r['config']):14} {r['error'][:60]}")
        else:
            print(f"{r['problem']:44} {r['variant']:10} {json.dumps(r['config']):14} {r['mode']:5} "
                  f"{r['alone_us']:9.1f} {r['turns_us']:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
