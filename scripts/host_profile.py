"""Where the host time of an eager decode layer goes: autofuse's layer against the NCCL + cuBLAS one.

In eager mode a decode layer is bound by the host (docs/results/layer.md), so what decides its speed
is the CPU time each call costs, not the GPU time. For one decode shape of `autofuse.bench.llama_layer`
this measures, on every rank (rank-max), with the policy of each timing mode:
- per layer and per op call: *host* us (the calls issued while the GPU is held busy by a sleep
  kernel, so the host never waits: pure launch cost) and *eager* us (back-to-back calls between two
  device events, what `autofuse.measure.timing` times in eager mode);
- for every variant of every autofuse op of the layer (forced with AUTOFUSE_VARIANT): the same two;
- a cProfile of the autofuse layer's host path (top functions by own time) and a torch.profiler
  table of CUDA runtime calls (launches, synchronisations) of both layers.

    python3 scripts/host_profile.py --model 70b --batch 8 --context 16384 --out host.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from typing import Any, Callable

import torch

CALLS = 8  # layer calls per host sample (about 100 launches each, well under the launch queue's depth)


def _host_us(world, fn: Callable[[], Any], calls: int, samples: int = 7) -> float:
    """Median host us per call of `fn` issued behind a sleep kernel (the GPU busy: no host waits)."""
    cuda = world.device.type == "cuda"
    out = []
    for _ in range(samples):
        world.sync()
        if cuda:
            torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU time: longer than issuing `calls` calls
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) * 1e6 / calls)
        if cuda:
            torch.cuda.synchronize()
    return sorted(out)[len(out) // 2]


def _rank(world, args: dict) -> dict:
    import autofuse
    from autofuse.measure.timing import time_fn
    from autofuse.bench import bench_layer

    from autofuse.bench import llama_layer as m
    cfg = m.CONFIGS[args["model"]]
    if world.device.type != "cuda":
        torch.set_num_threads(1)
    weights = m.random_weights(cfg, world.rank, world.size, 0, world.device, torch.bfloat16)
    layers = {"autofuse": m.TPLlamaLayer(cfg, weights, m.AutofuseOps(world.group), world.group),
              "baseline": m.TPLlamaLayer(cfg, weights, m.TorchOps(world.group), world.group)}
    s = bench_layer._decode(world, m, cfg, layers, args["batch"], args["context"], 0, args["block"])
    reps = args["reps"]
    result: dict[str, Any] = {"rows": [], "profiles": {}}

    def pick(variants: str, mode: str) -> None:
        os.environ["AUTOFUSE_VARIANT"] = variants
        os.environ["AUTOFUSE_MODE"] = mode
        autofuse.set_policy(None)
        s.layers["autofuse"]()
        for fn, a in s.ops["autofuse"].values():
            fn(*a)
        s.layers["baseline"]()

    def row(label: str, fn: Callable[[], Any], calls: int, **extra: Any) -> None:
        eager = time_fn(world, fn, "eager", warmup=2, reps=reps).median_us
        host = world.rank_max(_host_us(world, fn, calls))
        result["rows"].append({"what": label, "host_us": host, "eager_us": eager, **extra})
        if world.rank == 0:
            print(f"{label:46s} host {host:8.1f} us   eager {eager:8.1f} us", flush=True)

    modes = ("eager", "graph") if world.device.type == "cuda" else ("eager",)
    for mode in modes:
        pick("", mode)
        chosen = {lab: autofuse.explain(op, *s.ops["autofuse"][lab][1], group=world.group).variant
                  for lab, op in s.autofuse_ops.items()}
        for name in ("baseline", "autofuse"):
            row(f"{mode}-policy layer {name}", s.layers[name], CALLS, layer=name, policy=mode,
                variants=chosen if name == "autofuse" else {})
            for lab, (fn, a) in s.ops[name].items():
                if name == "autofuse" and lab not in s.autofuse_ops:
                    continue
                row(f"  {mode}-policy {name} {lab}" + (f" ({chosen[lab]})" if name == "autofuse" else ""),
                    lambda fn=fn, a=a: fn(*a), 4 * CALLS, layer=name, policy=mode, op=lab)
    ops = sorted(set(s.autofuse_ops.values()))
    for op in ops:
        for v, var in autofuse.core.registry.get(op).variants.items():
            if not var.available(world):
                continue
            try:
                pick(f"{op}:{v}", modes[-1])
            except (ValueError, NotImplementedError) as exc:
                result["rows"].append({"what": f"{op}:{v}", "error": str(exc)})
                continue
            for lab, name in s.autofuse_ops.items():
                if name == op:
                    fn, a = s.ops["autofuse"][lab]
                    row(f"  forced {op}:{v} {lab}", lambda fn=fn, a=a: fn(*a), 4 * CALLS, op=lab, variant=v)
    pick("", "eager")
    prof = cProfile.Profile()
    world.sync()
    if world.device.type == "cuda":
        torch.cuda._sleep(int(2e8))
    prof.enable()
    for _ in range(CALLS):
        s.layers["autofuse"]()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    result["profiles"]["cprofile_autofuse_eager_policy"] = text.getvalue()
    if world.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        for name in ("baseline", "autofuse"):
            world.sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                for _ in range(3):
                    s.layers[name]()
                torch.cuda.synchronize()
            result["profiles"][f"torch_{name}"] = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    os.environ.pop("AUTOFUSE_VARIANT", None)
    os.environ.pop("AUTOFUSE_MODE", None)
    return result


def main() -> None:
    from autofuse.comm.world import default_device_kind, gpu_count, spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="70b | 8b | tiny (default 70b on GPUs, tiny on CPU)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=os.path.join("autofuse-out", "host_profile.json"))
    a = ap.parse_args()
    kind = default_device_kind()
    cpu = kind == "cpu"
    args = {"model": a.model or ("tiny" if cpu else "70b"), "batch": a.batch if not cpu else 2,
            "context": a.context if not cpu else 24, "block": 4 if cpu else 64, "reps": 3 if cpu else a.reps}
    res = spawn(_rank, 2 if cpu else gpu_count(), args, device_kind=kind, timeout_s=1200)
    out = {"args": args, "device": torch.cuda.get_device_name() if not cpu else "cpu", **res[0]}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    for k, v in out["profiles"].items():
        print(f"\n==== {k}\n{v}")
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
