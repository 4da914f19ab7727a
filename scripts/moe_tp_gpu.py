"""MoE models whose experts `autofuse.parallelize` splits by width (autofuse/nn/moe_tp.py) on CUDA ranks, at
real layer sizes in bfloat16: GPT-OSS at gpt-oss-20b's (the hidden width equals the experts' width, so the cut
is not told by shapes alone), Llama 4 at Llama-4-Scout's (a shared expert, 16 experts top-1), DeepSeek-V2 at
DeepSeek-V2-Lite's (latent attention, 64 experts top-6 and 2 shared experts). The cut is found
(the simulated ranks' sum within bfloat16 rounding of the block), and the parallel model's logits, loss and
gradients are compared with the whole model's in the same dtype, both forms. `--family mixtral` gives the same
comparison for an expert-parallel model at GPT-OSS's sizes (what bfloat16 alone moves).

Ranks may share GPUs (AUTOFUSE_RANKS_PER_GPU): a correctness check, nothing is timed.

    AUTOFUSE_RANKS_PER_GPU=4 python3 scripts/moe_tp_gpu.py --world 2,4 [--layers 2] [--family llama4_text]
    python3 scripts/moe_tp_gpu.py --device cpu --tiny      # a dry run of the script on CPU ranks
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

# gpt-oss-20b's layer (hidden 2880, 64 query / 8 KV heads of 64, 32 experts of 2880, top-4, sliding window 128)
SIZES = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
             num_local_experts=32, num_experts_per_tok=4, sliding_window=128, vocab_size=1024, pad_token_id=0)
FAMILY_SIZES = {  # Llama-4-Scout's layer: hidden 5120, 40 query / 8 KV heads of 128, 16 experts of 8192, top-1
    "llama4_text": dict(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_attention_heads=40,
                        num_key_value_heads=8, head_dim=128, num_local_experts=16, num_experts_per_tok=1,
                        vocab_size=1024, pad_token_id=0),
    # DeepSeek-V2-Lite's layer: hidden 2048, 16 heads of latent attention (KV rank 512), 64 experts of 1408, top-6,
    # 2 shared experts; layer 0 dense (first_k_dense_replace=1), as in the model
    "deepseek_v2": dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_attention_heads=16,
                        num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6,
                        n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
                        vocab_size=1024, pad_token_id=0)}
TINY = dict(SIZES, hidden_size=64, intermediate_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
            num_local_experts=4, num_experts_per_tok=2, vocab_size=64)


TINY_FAMILY = {"deepseek_v2": dict(FAMILY_SIZES["deepseek_v2"], hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
                                   num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                                   qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                                   n_shared_experts=1, vocab_size=64)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().float(), b.detach().cpu().float()  # on the host: ranks sharing a GPU leave little room
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def job(world: Any, layers: int, sizes: dict, dtype: str, family: str) -> list[dict]:
    from transformers import AutoConfig, AutoModelForCausalLM

    import autofuse

    warnings.simplefilter("ignore")
    dev = world.device
    cfg = AutoConfig.for_model(family, num_hidden_layers=layers, attn_implementation="eager", **sizes)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg).to(dev, getattr(torch, dtype)).train()
    with torch.no_grad():
        for n, p in base.named_parameters():
            if p.dim() == 1 or n.endswith("bias"):
                p.add_(torch.randn_like(p), alpha=0.1)
    ids = torch.randint(0, sizes["vocab_size"], (2, 160), generator=torch.Generator().manual_seed(1)).to(dev)
    whole = copy.deepcopy(base)
    out = whole(input_ids=ids, labels=ids)
    out.loss.backward()
    want_grads = {n: p.grad for n, p in whole.named_parameters() if p.grad is not None}
    rows = []
    for sp in (False, True):
        t0 = time.perf_counter()
        par = autofuse.parallelize(copy.deepcopy(base), world.group, sequence_parallel=sp)
        made = time.perf_counter() - t0
        got = par(input_ids=ids, labels=ids)
        got.loss.backward()
        grads = autofuse.nn.full_grads(par)
        worst = max(want_grads, key=lambda n: _rel(grads[n], want_grads[n]) if n in grads else float("inf"))
        rows.append({"world": world.size, "sp": sp, "parallelize s": made, "logits": _rel(got.logits, out.logits),
                     "loss": _rel(got.loss, out.loss), "worst grad": _rel(grads[worst], want_grads[worst]),
                     "worst name": worst, "grad keys": sorted(grads) == sorted(want_grads)})
        del par, got, grads
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", default="2,4")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="small sizes (a dry run)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--family", default="gpt_oss", help="gpt_oss, llama4_text, or another transformers MoE family "
                    "at GPT-OSS's sizes, for the bfloat16 differences an expert-parallel model shows (mixtral)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from autofuse.comm.world import spawn

    print(f"{args.family}, {args.dtype}")
    print("world sp    parallelize_s  logits    loss      worst_grad  grad_keys  worst_name")
    for w in (int(x) for x in args.world.split(",")):
        sizes = (TINY_FAMILY.get(args.family, TINY) if args.tiny else FAMILY_SIZES.get(args.family, SIZES))
        for r in spawn(job, w, args.layers, sizes, args.dtype, args.family,
                       device_kind=args.device, timeout_s=900)[0]:
            print(f"{r['world']:5d} {str(r['sp']):5s} {r['parallelize s']:13.1f}  {r['logits']:.2e}  {r['loss']:.2e}  "
                  f"{r['worst grad']:.2e}    {str(r['grad keys']):9s}  {r['worst name']}", flush=True)


if __name__ == "__main__":
    main()
