"""What torch's async TP (inductor's micro-pipeline TP pass) finds to fuse in `autofuse bench train_layer`'s
torch-async-tp contender: per compiled graph (forward, backward), the collectives in it and the all-gather ->
matmul and matmul -> reduce-scatter patterns the pass matched. A contender whose pass matches nothing runs as
compiled torch TP, not async TP (inductor only logs a warning), so the bench's baseline would be weaker than
what a torchtitan user runs.

    python3 scripts/async_tp_patterns.py --world 2 --model 70b --tokens 4096    # GPUs: the pass fuses as usual
    python3 scripts/async_tp_patterns.py --cpu                                  # CPU: patterns counted, not fused
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from typing import Any

import torch


def _rank(world: Any, cfg: dict) -> list[dict]:
    import torch._inductor.config as inductor
    import torch._inductor.fx_passes.micro_pipeline_tp as mp
    import torch._inductor.fx_passes.post_grad as post_grad
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from autofuse.bench import torch_tp
    from autofuse.bench.bench_train_layer import MODELS, _first

    cuda = world.device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    graphs: list[dict] = []
    real_pass = mp.micro_pipeline_tp_pass

    def counting_pass(graph: torch.fx.Graph) -> None:
        ops: dict[str, int] = {}
        for n in graph.nodes:
            if n.op == "call_function" and "c10d" in str(n.target):
                ops[str(n.target).split(".")[-2]] = ops.get(str(n.target).split(".")[-2], 0) + 1
        graphs.append({"collectives": ops, "all_gather_matmul": len(mp.find_all_gather_patterns(graph)),
                       "matmul_reduce_scatter": len(mp.find_reduce_scatter_patterns(graph))})
        if cuda:  # on CPU there is no symmetric memory to fuse onto: count only
            real_pass(graph)

    mp.micro_pipeline_tp_pass = post_grad.micro_pipeline_tp_pass = counting_pass  # either import style
    if cuda:
        torch_tp.enable_async_tp(world)
    else:
        inductor._micro_pipeline_tp = True
    dev, dtype = world.device, (torch.bfloat16 if cuda else torch.float32)
    config = LlamaConfig(**MODELS[cfg["model"]], num_hidden_layers=1, vocab_size=128, rms_norm_eps=1e-5,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    whole = LlamaDecoderLayer(config, 0).to(dev, dtype)
    layer = torch.compile(torch_tp.parallelize_layer(copy.deepcopy(whole), torch_tp.mesh(world)), fullgraph=True)
    t = cfg["tokens"]
    x = torch.randn(1, t // world.size, config.hidden_size, device=dev, dtype=dtype, requires_grad=True)
    pos = torch.arange(t, device=dev)[None]
    pe = LlamaRotaryEmbedding(config).to(dev)(x, pos)
    _first(layer(x, position_embeddings=pe, position_ids=pos)).sum().backward()
    return graphs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--model", default=None, help="70b, 8b or tiny (default: 8b on GPUs, tiny on CPU)")
    p.add_argument("--tokens", type=int, default=None, help="T (default 4096 on GPUs, 32 on CPU)")
    p.add_argument("--cpu", action="store_true", help="CPU: gloo, the patterns counted, nothing fused")
    p.add_argument("--out", default=None, help="JSON output")
    a = p.parse_args(argv)
    from autofuse.comm.world import spawn

    kind = "cpu" if a.cpu or not torch.cuda.is_available() else "cuda"
    cfg = {"model": a.model or ("8b" if kind == "cuda" else "tiny"), "tokens": a.tokens or (4096 if kind == "cuda" else 32)}
    graphs = spawn(_rank, a.world, cfg, device_kind=kind, timeout_s=900)[0]
    doc = {"device": torch.cuda.get_device_name(0) if kind == "cuda" else "cpu", "world": a.world, **cfg,
           "torch": torch.__version__, "graphs": graphs}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(f"{doc['device']}, torch {torch.__version__}, world {a.world}, {cfg['model']} T={cfg['tokens']}")
    for i, g in enumerate(graphs):
        print(f"graph {i}: collectives {g['collectives']}; async TP matched {g['all_gather_matmul']} all-gather -> "
              f"matmul, {g['matmul_reduce_scatter']} matmul -> reduce-scatter")
    return 0 if all(g["all_gather_matmul"] + g["matmul_reduce_scatter"] for g in graphs) else 1


if __name__ == "__main__":
    sys.exit(main())
