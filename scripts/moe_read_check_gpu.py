"""On one GPU, in bfloat16 and with transformers' default experts implementation: `ExpertParallelMoE.from_module`'s
check (the block run on random rows against what it read) accepts the MoE blocks autofuse takes, and the whole
parallelized model (world 1) gives the unsharded model's logits. A false refusal on GPUs would stop a user's
model at parallelize; this is the check that it does not.

    python3 scripts/moe_read_check_gpu.py
"""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    import autofuse

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1)
    for name in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "ernie4_5_moe", "glm4_moe"):
        cfg = AutoConfig.for_model(name, vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=8,
                                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, pad_token_id=0)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).to(dev, torch.bfloat16).eval()
        ids = torch.randint(0, 256, (2, 16), device=dev)
        with torch.no_grad():
            want = model(ids).logits.float()
        try:
            par = autofuse.parallelize(copy.deepcopy(model), None)
            with torch.no_grad():
                got = par(ids).logits.float()
            line = f"accepted; logits rel {float((got - want).norm() / want.norm()):.2e}"
        except ValueError as exc:
            line = f"REFUSED: {exc}"
        print(f"{name:14s} experts={cfg._experts_implementation or 'default'}: {line}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
