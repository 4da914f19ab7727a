"""Greedy generation with a tensor-parallel Llama made by `autofuse.parallelize`, beside the unsharded model.

    torchrun --nproc-per-node 2 examples/generate_llama.py                  # tiny random Llama, 2 ranks
    python examples/generate_llama.py --world 2                             # the same; the script starts its ranks
    torchrun --nproc-per-node 2 examples/generate_llama.py --model PATH --prompt "The capital of France is"

Every rank builds the same model, keeps an unsharded copy (unless --no-reference), parallelizes the
other and generates `--tokens` tokens greedily (KV cache on) from the same prompt: token ids drawn
from `--seed`, or `--prompt` through the model's own tokenizer. Prints both outputs and whether they
agree. Runs on GPUs (bfloat16) and on CPU ranks (float32, Triton's interpreter: slow, no timings).
"""
from __future__ import annotations

import argparse
import copy
import time
from typing import TYPE_CHECKING, Any

import torch

import autofuse
from llama_ranks import add_arguments, load_model, run, say

if TYPE_CHECKING:
    from autofuse.comm.world import World


def generate(model: Any, ids: torch.Tensor, tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                              pad_token_id=model.config.eos_token_id or 0)


def main(world: World, args: argparse.Namespace) -> None:
    model = load_model(args.model, args.seed, world.device)
    tokenizer = None
    if args.prompt is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(world.device)
    else:
        g = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, model.config.vocab_size, (args.batch, 8), generator=g).to(world.device)
    reference = None if args.no_reference else copy.deepcopy(model)
    parallel = autofuse.parallelize(model, world.group, sequence_parallel=args.sequence_parallel)
    if args.compile:
        parallel.forward = torch.compile(parallel.forward, fullgraph=True)
    say(world, f"{world.size} ranks on {world.device.type}; sequence_parallel={args.sequence_parallel}")
    t0 = time.perf_counter()
    got = generate(parallel, ids, args.tokens)
    say(world, f"autofuse ({time.perf_counter() - t0:.1f} s): {got[:, ids.shape[1]:].tolist()}")
    if tokenizer is not None:
        say(world, f"  {tokenizer.batch_decode(got, skip_special_tokens=True)}")
    if reference is not None:
        want = generate(reference, ids, args.tokens)
        say(world, f"unsharded: {want[:, ids.shape[1]:].tolist()}")
        say(world, "the same tokens" if torch.equal(got, want) else "the tokens DIFFER")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--prompt", default=None, help="text to continue (needs --model with a tokenizer)")
    parser.add_argument("--batch", type=int, default=2, help="sequences of random prompt ids (without --prompt)")
    parser.add_argument("--tokens", type=int, default=8, help="new tokens per sequence")
    cli = parser.parse_args()
    if cli.prompt is not None and cli.model is None:
        parser.error("--prompt needs --model (a directory with a tokenizer)")
    run(main, cli)
