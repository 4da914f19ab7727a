"""Where the MoE block's time goes: each (dispatch, combine) pair's block and its combine alone, per kernel.

The op-by-op tune times moe_combine alone (back-to-back calls on one handle); `autofuse bench moe` shows the
hybrid combine costing about 100 us more inside the block than alone at decode sizes, the fused one not
(round 16). This profiles, on every rank alike, CUDA-graph replays of: the block of each pair, and the
combine alone with its pair's handle (`autofuse.bench.kernel_profile.profile_calls`: device time per kernel per
call, GPU busy vs the profiled window), beside their latencies timed in turns. Rank 0 prints the tables and
writes --out.

    python3 scripts/moe_profile_gpu.py --world 2 --model qwen3 --tokens 64 [--pairs hybrid/hybrid,hybrid/fused]
"""
from __future__ import annotations

import argparse
import json
import math

import torch

PAIRS = "hybrid/hybrid,hybrid/fused,fused/fused,fused/hybrid"


def _rank(world, args: argparse.Namespace) -> dict:
    import autofuse
    from autofuse.bench import bench_moe, kernel_profile
    from autofuse.measure.timing import Batches, time_in_turns

    h, f, e, k = bench_moe.MODELS[args.model]
    e = e or 2 * world.size  # tiny: two experts per rank
    cuda = world.device.type == "cuda"
    mode = "graph" if cuda else "eager"  # CPU ranks: a smoke run of the script, nothing timed that means anything
    local, dev, dt = e // world.size, world.device, (torch.bfloat16 if cuda else torch.float32)
    gen = torch.Generator().manual_seed(1234 + world.rank)
    ids, weights = bench_moe.routing(args.tokens, e, k, world.size, 0, gen)
    x = torch.randn(args.tokens, h, generator=gen).to(dev, dt)
    ids, weights = ids.to(dev), weights.to(dev)
    g = torch.Generator(device=dev).manual_seed(11 + world.rank)
    w1 = (torch.randn(local, h, 2 * f, generator=g, device=dev, dtype=dt) / math.sqrt(h)).reshape(local, h, 2, f).contiguous()
    w2 = torch.randn(local, f, h, generator=g, device=dev, dtype=dt) / math.sqrt(f)
    pairs = [tuple(p.split("/")) for p in args.pairs.split(",")]
    group = world.group

    def block(d: str, c: str):
        def go():
            hh, handle = autofuse.moe_dispatch(x, ids, weights, w1, group=group, variant=d)
            return autofuse.moe_combine(hh, w2, handle, group=group, variant=c)
        return go

    steps: dict[str, object] = {}
    for d, c in pairs:
        steps[f"block {d}/{c}"] = block(d, c)
        hh, handle = autofuse.moe_dispatch(x, ids, weights, w1, group=group, variant=d)  # the combine alone reads
        # this pair's handle, as the bench does (later calls of the same inputs rewrite it with the same rows)
        steps[f"combine {c} after {d}"] = (lambda hh=hh, handle=handle, c=c:
                                            autofuse.moe_combine(hh, w2, handle, group=group, variant=c))
    for fn in steps.values():
        fn()  # every problem seen (and confirmed) before any capture
    times, _ = time_in_turns(world, list(steps.values()), mode, reps=args.reps, warmup=3, rounds=args.reps)
    out = {"model": args.model, "tokens": args.tokens, "world": world.size,
           "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "mode": mode, "steps": {}}
    for (name, fn), t in zip(steps.items(), times):
        prof = kernel_profile.profile_calls(world, [fn], mode)
        out["steps"][name] = {"latency_us": t.median_us, "inner": t.inner, **prof}
        if args.long_batch_us:  # the same timer with more calls per replayed graph: a per-replay cost thins out
            b = Batches(world, fn, mode, 3, target_batch_us=args.long_batch_us, max_inner=200)
            b.start()
            long = b.stats([b.sample() for _ in range(args.reps)])
            b.close()
            out["steps"][name].update(latency_long_us=long.median_us, inner_long=long.inner)
    return out


def main() -> None:
    from autofuse.comm.world import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--model", default="qwen3")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--pairs", default=PAIRS)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--long-batch-us", type=float, default=0.0,
                   help="also time each step with batches of about this many us (more calls per replayed graph)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    res = spawn(_rank, args.world, args)[0]
    print(f"{args.model} T={args.tokens} EP={args.world} on {res['device']}, {res['mode']} mode, us per call (rank 0's kernels)")
    for name, s in res["steps"].items():
        long = f" ({s['latency_long_us']:.1f} us at {s['inner_long']} calls a batch)" if "latency_long_us" in s else ""
        print(f"== {name}: measured {s['latency_us']:.1f} us at {s['inner']} calls a batch{long}, GPU busy {s.get('busy_us', math.nan):.1f}, "
              f"kernels sum {s.get('kernel_us', math.nan):.1f}, profiled window {s.get('window_us', math.nan):.1f}")
        for kern in s.get("kernels", [])[:10]:
            print(f"   {kern.get('us', math.nan):8.1f} us  x{kern.get('calls', math.nan):<5.2g} {kern.get('name', '?')[:90]}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
