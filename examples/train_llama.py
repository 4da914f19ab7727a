"""Train a tensor-parallel Llama made by `autofuse.parallelize` a few steps, beside the unsharded model.

    torchrun --nproc-per-node 2 examples/train_llama.py                    # tiny random Llama, 2 ranks
    python examples/train_llama.py --world 2 --sequence-parallel           # the script starts its ranks
    torchrun --nproc-per-node 2 examples/train_llama.py --model PATH --steps 5 --no-reference

Every rank builds the same model, keeps an unsharded copy (unless --no-reference), parallelizes the
other, and trains both with AdamW on the same random token batches (next-token loss, labels = the
inputs). Prints each step's loss of both models: they agree to rounding (float32 on CPU; bfloat16 on
GPUs drifts apart slowly over steps, as any two summation orders do). The forward and backward GEMMs
of the projections go through autofuse's ops (dispatched: on GPUs the tuned fused or hybrid
variants, on CPU the bulk-synchronous one unless AUTOFUSE_VARIANT forces another).
"""
from __future__ import annotations

import argparse
import copy
from typing import TYPE_CHECKING

import torch

import autofuse
from llama_ranks import add_arguments, load_model, run, say

if TYPE_CHECKING:
    from autofuse.comm.world import World


def main(world: World, args: argparse.Namespace) -> None:
    model = load_model(args.model, args.seed, world.device).train()
    reference = None if args.no_reference else copy.deepcopy(model)
    parallel = autofuse.parallelize(model, world.group, sequence_parallel=args.sequence_parallel)
    step_of = torch.compile(parallel, fullgraph=True) if args.compile else parallel
    models = {"autofuse": (step_of, torch.optim.AdamW(parallel.parameters(), lr=args.lr))}
    if reference is not None:
        models["unsharded"] = (reference, torch.optim.AdamW(reference.parameters(), lr=args.lr))
    say(world, f"{world.size} ranks on {world.device.type}; sequence_parallel={args.sequence_parallel}, "
               f"compile={args.compile}")
    g = torch.Generator().manual_seed(args.seed + 1)
    for step in range(args.steps):
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g).to(world.device)
        losses = {}
        for name, (m, opt) in models.items():
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name] = loss.item()
        say(world, f"step {step}: " + ", ".join(f"{name} loss {v:.6f}" for name, v in losses.items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=1e-3)
    run(main, parser.parse_args())
