"""What examples/train_llama.py and examples/generate_llama.py share: their ranks and their model.

Ranks: under torchrun (RANK in the environment) a script joins torchrun's job; run plainly, it starts
`--world` ranks itself (`autofuse.comm.world.spawn`: one process per GPU, or CPU processes with gloo and
Triton's interpreter where there are no GPUs). Model: a local transformers checkpoint (`--model PATH`,
read with local_files_only, nothing downloaded) or the tiny random Llama below, built alike on every
rank from one seed.
"""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from autofuse.comm.world import World


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options both scripts take."""
    p.add_argument("--model", default=None, help="a local transformers causal LM directory (default: a tiny "
                   "random Llama)")
    p.add_argument("--world", type=int, default=2, help="ranks to start when not run under torchrun")
    p.add_argument("--sequence-parallel", action="store_true", help="split the token rows inside the layers "
                   "(ag_gemm + gemm_rs) instead of the all-reduce form (gemm_ar)")
    p.add_argument("--compile", action="store_true", help="torch.compile the parallel model")
    p.add_argument("--no-reference", action="store_true", help="skip the unsharded copy (a real model that "
                   "does not fit twice)")
    p.add_argument("--seed", type=int, default=0)


def tiny_llama() -> Any:
    """A random LlamaForCausalLM small enough for CPU ranks: hidden 64, 2 layers, 8 heads, 4 KV heads
    (head dim 8; it splits over 1, 2 or 4 ranks), MLP 128, vocab 128."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=128)
    return LlamaForCausalLM(cfg)


def load_model(path: str | None, seed: int, device: torch.device) -> Any:
    """The model of `--model` (or the tiny one), the same on every rank, on `device`, in eval mode:
    bfloat16 on GPUs, float32 on CPU."""
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if path is None:
        model = tiny_llama().to(dtype)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, local_files_only=True)
    return model.to(device).eval()


def run(main: Callable[[World, argparse.Namespace], Any], args: argparse.Namespace) -> None:
    """main(world, args) on every rank: torchrun's, or `args.world` ranks started here."""
    import autofuse.comm.world as aw

    if "RANK" in os.environ:
        world = aw.init_from_env()
        try:
            main(world, args)
        finally:
            world.close()
            torch.distributed.destroy_process_group()
    else:
        aw.spawn(main, args.world, args, timeout_s=3600)


def say(world: World, text: str) -> None:
    """Print on the first rank only."""
    if world.rank == 0:
        print(text, flush=True)
