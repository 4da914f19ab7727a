"""Where a training step's GPU time goes: the kernels of one forward + backward of the Llama decoder layer,
per contender of `autofuse bench train_layer` (autofuse eager, autofuse compiled, torch TP, torch async TP).

Issue 44 measured eager autofuse 0.6-1.4% behind torch TP at 70B T=4096-8192, and the bench's per-op shares
put the gap outside the projections ("rest" = layer - ops). This script says which kernels: per contender,
torch.profiler over `--steps` steps after warm-up (CUDA activity only), the GPU kernel time grouped by
kernel class (`classify`: NCCL, attention, copies, elementwise, reductions, GEMMs (autofuse's fused
GEMM kernels among them), other Triton kernels (autofuse's collectives), other), the kernel count and busy time per step, and the step's wall time, rank 0's; then the top kernels' time on
every rank (a kernel that waits for its peers, a barrier or a fused kernel's flags, runs longer on the rank
that arrives first: where the ranks differ, one of them is late). The busy
time (kernel time summed) against the wall time separates device work from host gaps.

    python3 scripts/profile_train_layer_gpu.py --world 2 --model 70b --tokens 8192 --out profile.json
    python3 scripts/profile_train_layer_gpu.py --cpu     # CPU smoke: 2 ranks, gloo, tiny layer
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from typing import Any

import torch

CLASSES = (  # (class, pattern on the kernel name), first match wins
    ("nccl", r"nccl"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("copy", r"copy|memcpy|memset|catarray|cat_"),
    ("elementwise", r"elementwise|triton_poi|::(mul|add|silu|neg|cos|sin)$"),
    ("reduction", r"reduce|triton_red|triton_per|norm|softmax|::(sum|mean)$"),
    ("gemm", r"gemm|xmma|cutlass|cublas|nvjet|matmul|::mm$|addmm|bmm"),  # autofuse's fused GEMM kernels too
    ("triton", r"triton|_kernel"),
)


def classify(name: str) -> str:
    """The class of a kernel by its name (CLASSES); `other` if none matches."""
    low = name.lower()
    for cls, pattern in CLASSES:
        if re.search(pattern, low):
            return cls
    return "other"


def _rank(world: Any, cfg: dict) -> dict:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from autofuse.bench import torch_tp
    from autofuse.bench.bench_train_layer import MODELS, _first, contenders

    cuda = world.device.type == "cuda"
    dev, dtype = world.device, (torch.bfloat16 if cuda else torch.float32)
    if not cuda:
        torch.set_num_threads(1)
    config = LlamaConfig(**MODELS[cfg["model"]], num_hidden_layers=1, vocab_size=128, rms_norm_eps=1e-5,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    whole = LlamaDecoderLayer(config, 0).to(dev, dtype)
    rotary = LlamaRotaryEmbedding(config).to(dev)
    layers, _ = contenders(whole, world, torch_tp.mesh(world), cfg["contenders"])
    t, w, r = cfg["tokens"], world.size, world.rank
    g = torch.Generator(device=dev).manual_seed(t)
    x = torch.randn(1, t // w, config.hidden_size, generator=g, device=dev).to(dtype).requires_grad_()
    dy = torch.randn(1, t // w, config.hidden_size, generator=g, device=dev).to(dtype)
    pos = torch.arange(t, device=dev)[None]
    pe = rotary(x, pos)
    out: dict[str, dict] = {}
    for name, layer in layers.items():
        def step() -> None:
            _first(layer(x, position_embeddings=pe, position_ids=pos)).backward(dy)
        for _ in range(cfg["warmup"]):
            step()
        world.sync()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(cfg["steps"]):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6 / cfg["steps"]
        world.sync()
        acts = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(cfg["steps"]):
                step()
            if cuda:
                torch.cuda.synchronize()
        by_class: dict[str, float] = defaultdict(float)
        by_kernel: dict[str, list] = defaultdict(lambda: [0.0, 0])
        count = 0
        for e in prof.events():
            if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = (e.device_time if cuda else e.self_cpu_time_total) / cfg["steps"]
            if not cuda and not e.name.startswith("aten::"):
                continue
            count += 1
            by_class[classify(e.name)] += us
            by_kernel[e.name][0] += us
            by_kernel[e.name][1] += 1
        top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:cfg["top"]]
        out[name] = {"wall_us": wall_us, "busy_us": sum(by_class.values()), "kernels_per_step": count / cfg["steps"],
                     "by_class_us": dict(by_class),
                     "top": [{"kernel": k[:140], "us": v[0], "calls_per_step": v[1] / cfg["steps"]} for k, v in top],
                     "kernels": {k[:140]: v[0] for k, v in by_kernel.items()}}
        world.sync()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--model", default=None, help="70b, 8b or tiny (default: 70b on GPUs, tiny on CPU)")
    p.add_argument("--tokens", type=int, default=None, help="sequence length T (default 8192 on GPUs, 32 on CPU)")
    p.add_argument("--contenders", default="autofuse,autofuse-compiled,torch-tp,torch-async-tp")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=12, help="kernels listed per contender")
    p.add_argument("--cpu", action="store_true", help="CPU smoke (gloo, Triton's interpreter, tiny layer)")
    p.add_argument("--out", default=None, help="JSON output")
    a = p.parse_args(argv)
    from autofuse.comm.world import spawn

    from autofuse.bench.bench_train_layer import CONTENDERS

    names = [c.strip() for c in a.contenders.split(",") if c.strip()]
    if not names or set(names) - set(CONTENDERS):
        p.error(f"--contenders: one or more of {', '.join(CONTENDERS)}, comma-separated")
    kind = "cpu" if a.cpu or not torch.cuda.is_available() else "cuda"
    cfg = {"model": a.model or ("70b" if kind == "cuda" else "tiny"), "tokens": a.tokens or (8192 if kind == "cuda" else 32),
           "contenders": names, "steps": a.steps,
           "warmup": a.warmup if kind == "cuda" else 1, "top": a.top}
    ranks = spawn(_rank, a.world, cfg, device_kind=kind, timeout_s=1800)
    res = ranks[0]
    dev = torch.cuda.get_device_name(0) if kind == "cuda" else "cpu"
    doc = {"device": dev, "world": a.world, **cfg, "contenders": res,
           "kernels_by_rank": {name: [r[name]["kernels"] for r in ranks] for name in res}}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    classes = sorted({c for v in res.values() for c in v["by_class_us"]})
    print(f"{dev}, world {a.world}, {cfg['model']} T={cfg['tokens']}: us per step (rank 0)")
    print(f"{'contender':<20}{'wall':>9}{'busy':>9}{'kernels':>9}" + "".join(f"{c[:11]:>12}" for c in classes))
    for name, v in res.items():
        print(f"{name:<20}{v['wall_us']:>9.0f}{v['busy_us']:>9.0f}{v['kernels_per_step']:>9.0f}"
              + "".join(f"{v['by_class_us'].get(c, 0.0):>12.0f}" for c in classes))
    for name, v in res.items():
        print(f"\n{name}: top kernels")
        for k in v["top"]:
            print(f"  {k['us']:>9.0f} us  x{k['calls_per_step']:<4.0f} {k['kernel'][:100]}")
        if len(ranks) > 1:  # a kernel that waits on its peers runs longer on the rank that arrives first
            print(f"{name}: the same kernels on every rank (us per step; wall per rank: "
                  + ", ".join(f"{r[name]['wall_us']:.0f}" for r in ranks) + ")")
            for k in v["top"]:
                print("  " + "".join(f"{r[name]['kernels'].get(k['kernel'], 0.0):>9.0f}" for r in ranks)
                      + f"  {k['kernel'][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
