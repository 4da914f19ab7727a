"""Run the tensor-parallel Llama-3 decoder layer of `autofuse.bench.llama_layer` on autofuse and on
NCCL + cuBLAS: every local GPU, or 2 CPU ranks without GPUs. It checks autofuse's layer against the
baseline layer (exit status 1 if they differ beyond the tolerance) and times both on GPUs:

    python examples/llama_layer.py                         # starts its own ranks
    torchrun --nproc-per-node 2 examples/llama_layer.py    # or joins torchrun's
    autofuse bench layer            # the full benchmark (autofuse/bench/bench_layer.py)
"""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import autofuse
from autofuse.bench.llama_layer import (CONFIGS, AutofuseOps, KVCache, TorchOps, TPLlamaLayer, check_tp, forced_sets,
                                     random_weights, rel_diff, time_us)

if TYPE_CHECKING:
    from autofuse.comm.world import World


TOLERANCE = 2.5e-2  # bf16 layer vs bf16 layer, norm-wise relative (the argument: tests/test_layer.py)
DEFAULTS = {"cuda": {"model": "70b", "tokens": 2048, "batch": 8, "context": 8192},
            "cpu": {"model": "tiny", "tokens": 16, "batch": 2, "context": 24}}  # the interpreter: tiny shapes


def traced(layer: "TPLlamaLayer", run: Any) -> tuple[set[str], Any]:
    """(the variants `layer`'s autofuse calls ran in `run()`, as op:variant, what `run()` returned)."""
    seen: set[str] = set()
    ops = layer.ops
    names = ("ag_gemm", "gemm_rs", "gemm_ar", "flash_decode")
    for op in names:
        plain = getattr(ops, op)

        def spy(*args: Any, _op: str = op, _plain: Any = plain) -> Any:
            out = _plain(*args)  # decides and caches first, so explain reads the decision taken
            seen.add(f"{_op}:{autofuse.explain(_op, *args, group=ops.group, variant=ops.variants.get(_op)).variant}")
            return out
        setattr(ops, op, spy)
    try:
        return seen, run()
    finally:
        for op in names:
            delattr(ops, op)


def run_layer(world: World, args: argparse.Namespace) -> int:
    """On every rank: check the autofuse layer against the baseline layer, prefill and decode, for
    autofuse's own choice and, with --variants each (or auto, when autofuse chooses bsp everywhere, as
    it does without a policy for this machine), every variant forced in turn; on GPUs also time them.
    Returns 1 if an output differs from the baseline's beyond TOLERANCE, else 0."""
    cuda = world.device.type == "cuda"
    dev, rank, size, group = world.device, world.rank, world.size, world.group
    d = DEFAULTS["cuda" if cuda else "cpu"]
    cfg = CONFIGS[args.model or d["model"]]
    tokens, batch, context = args.tokens or d["tokens"], args.batch or d["batch"], args.context or d["context"]
    check_tp(cfg, size)
    w = random_weights(cfg, rank, size, 0, dev, torch.bfloat16)
    base = TPLlamaLayer(cfg, w, TorchOps(group), group)
    g = torch.Generator(device=dev).manual_seed(1 + rank)
    x = torch.randn(tokens // size, cfg.hidden, generator=g, device=dev).to(torch.bfloat16)
    xd = torch.randn(batch, cfg.hidden, generator=torch.Generator(device=dev).manual_seed(2), device=dev).to(torch.bfloat16)
    pos = torch.full((batch,), context, device=dev)
    cache = KVCache.random(cfg, batch, context + 1, rank, size, device=dev)
    phases = {"prefill": lambda layer: layer.prefill(x), "decode": lambda layer: layer.decode(xd, pos, cache)}
    expected = {phase: run(base) for phase, run in phases.items()}
    todo: list[dict[str, str]] = forced_sets(world) if args.variants == "each" else [{}]
    failed = False
    while todo:
        forced = todo.pop(0)
        layer = TPLlamaLayer(cfg, w, AutofuseOps(group, forced), group)
        ran: set[str] = set()
        for phase, run in phases.items():
            seen, out = traced(layer, lambda: run(layer))
            ran |= seen
            err = torch.tensor([rel_diff(out, expected[phase])], device=dev)
            dist.all_reduce(err, op=dist.ReduceOp.MAX, group=group)
            ok = err.item() <= TOLERANCE
            failed |= not ok
            line = (f"{phase}: autofuse ({'forced: ' if forced else ''}{', '.join(sorted(seen))}) vs baseline: "
                    f"rel. difference {err.item():.2e} ({'ok' if ok else 'WRONG'}, tolerance {TOLERANCE})")
            if cuda:
                for mode in ("eager", "graph"):
                    tf = time_us(lambda: run(layer), mode == "graph", group=group)
                    tb = time_us(lambda: run(base), mode == "graph", group=group)
                    line += f"; {mode}: autofuse {tf:.0f} us, baseline {tb:.0f} us, x{tb / tf:.3f}"
            if rank == 0:
                print(line, flush=True)
        if not forced and args.variants == "auto" and all(v.endswith(":bsp") for v in ran):
            if rank == 0:
                print("autofuse chose bsp for every op (no policy for this machine?), the baseline's own path: "
                      "checking every variant forced in turn", flush=True)
            todo = forced_sets(world)
    return 1 if failed else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(CONFIGS), help="default: 70b on GPUs, tiny on CPU")
    p.add_argument("--tokens", type=int, help="prefill tokens, one sequence (default: 2048 GPU, 16 CPU)")
    p.add_argument("--batch", type=int, help="decode batch (default: 8 GPU, 2 CPU)")
    p.add_argument("--context", type=int, help="decode: tokens already in the KV cache (default: 8192 GPU, 24 CPU)")
    p.add_argument("--variants", default="auto", choices=("auto", "default", "each"),
                   help="default: autofuse's own choice; each: every variant forced in turn; auto (the default): "
                        "autofuse's choice, then each if that choice is bsp for every op")
    p.add_argument("--world", type=int, help="ranks to start when not run under torchrun (default: every GPU, "
                   "else 2 CPU ranks)")
    args = p.parse_args()
    from autofuse.comm.world import default_device_kind, gpu_count, init_from_env, spawn

    if "RANK" in os.environ:  # under torchrun: join its ranks
        world = init_from_env()
        try:
            code = run_layer(world, args)
        finally:
            world.close()
            dist.destroy_process_group()
    else:  # run plainly: start the ranks here (one per GPU, or CPU processes with gloo and Triton's interpreter)
        kind = default_device_kind()
        n = args.world or (gpu_count() if kind == "cuda" else 2)
        code = max(spawn(run_layer, n, args, device_kind=kind, timeout_s=3600))
    raise SystemExit(code)


if __name__ == "__main__":
    main()
