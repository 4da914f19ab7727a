"""`autofuse bench train_model`: whole training steps of a tensor-parallel Llama (embedding, N decoder
layers, final norm, lm_head, cross-entropy, backward, AdamW), autofuse against torch's tensor
parallelism with torch.compile and async TP, the way torchtitan runs it.

The model is transformers' LlamaForCausalLM with random weights: `--sweep 8b` is Llama-3-8B's
configuration (hidden 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128256) with `--layers N`
decoder layers (default 4: the full 32 would not fit a contender set in one GPU's memory and
the bench's time), bf16; `tiny` (the CPU default) float32. One sequence of T tokens per step
(`--shapes 2048,4096`: T values; default 2048, 4096, 8192 on GPUs, 16 on CPU). A step is the forward
with labels = the inputs (transformers' next-token cross-entropy), backward, AdamW step, zero_grad.
Every contender starts from the same weights and trains on the same token batches. Contenders:
- `autofuse`: `autofuse.parallelize(model, group, sequence_parallel=True)`, eager: each decoder layer's
  projections are autofuse's ops (q/k/v and gate/up ag_gemm, o and down gemm_rs, their backward GEMMs
  too), the first layer scatters the token rows and the last gathers them.
- `autofuse-compiled`: the same, each decoder layer compiled in place (`layer.compile(fullgraph=True)`,
  per block as torchtitan compiles; the first and last layers' row scatter and gather hooks inside).
- `autofuse-compiled-graph` (by name only, GPUs): `autofuse-compiled` with its training calls decided for
  graph timing (`autofuse.dispatch.set_train_mode("graph")` around its steps; the others: the default,
  eager), to compare the two timing modes' decisions on one model in one run.
- `torch-tp`: torch's DTensor TP with sequence parallelism on every decoder layer, torchtitan's plan
  (`autofuse.bench.torch_tp`), the first layer's input split along the sequence and the last's
  output gathered (PrepareModuleInput / PrepareModuleOutput), eager.
- `torch-async-tp` (CUDA with torch's symmetric memory only; skipped elsewhere with the reason in
  the notes): torch-tp with each decoder layer replaced by `torch.compile(layer, fullgraph=True)`
  (torchtitan's form; the sequence split and gather hooked on the wrappers, eager) after torch's async TP is turned on as
  torchtitan does (`_micro_pipeline_tp` and `enable_symm_mem_for_group`).
Embeddings, the final norm, lm_head and the loss stay whole on every rank in all four (autofuse's
`parallelize` keeps them replicated, so torch's contenders lay them out the same way: what differs
is the decoder layers' TP; torchtitan would shard the vocabulary, which neither does here).
First the losses: LOSS_STEPS steps of every contender, and of the unsharded model (`unsharded`, on
every rank alike), from the same weights on the same batches; the rank-max relative difference of
each contender's losses from torch-tp's and from the unsharded model's, flagged beyond
LOSS_TOLERANCE (reported, never asserted). These steps also compile the compiled contenders. Then
the contenders keep training, timed in turns (`autofuse.measure.time_in_turns`, eager: never
graph-replayed), median of reps, rank-max: ms per step, tokens/s (T / step time), MFU (model FLOPs:
`bench_train_layer.layer_flops` per decoder layer plus lm_head's matmul, forward + backward, over
step time x GPUs x dense bf16 peak; the replicated lm_head counted once), and x = torch-async-tp's
step time / the contender's (its tokens/s over torch-async-tp's). On CPU: gloo and Triton's
interpreter; those timings show that it runs and agrees, not which is faster.
"""
from __future__ import annotations

import copy
import datetime
import gc
import math
from typing import TYPE_CHECKING, Any, Callable

import torch

from autofuse.bench import target_options, torch_tp
from autofuse.bench.bench_train_layer import MODELS as LAYERS_OF, OPTIONAL, TRAIN_MODES, in_mode, layer_flops, peak_tflops
from autofuse.core import modes

if TYPE_CHECKING:
    from autofuse.comm.world import World

VOCAB = {"8b": 128256, "tiny": 128}
MODELS = {name: {**LAYERS_OF[name], "vocab_size": vocab} for name, vocab in VOCAB.items()}
DEFAULT_SWEEP = {"cuda": "8b", "cpu": "tiny"}
DEFAULT_LAYERS = {"cuda": 4, "cpu": 2}
TOKENS = {"cuda": (2048, 4096, 8192), "cpu": (16,)}
CONTENDERS = ("autofuse", "autofuse-compiled", "torch-tp", "torch-async-tp")
COMPILED = {"autofuse-compiled", "autofuse-compiled-graph", "torch-async-tp"}
BASELINE = "torch-async-tp"  # x = its step time / the contender's
REFERENCES = ("torch-tp", "unsharded")  # whose losses each contender's are compared with
LOSS_STEPS = 3
LOSS_TOLERANCE = {"bf16": 2e-2, "fp32": 1e-5}  # relative, any of the first steps
LR = 1e-3
CPU_REPS = 2


def run(options: Any) -> dict:
    """Spawn the ranks; check the losses and time every contender at every token count; rank 0's result."""
    from autofuse.comm.world import spawn
    from autofuse.nn.llama import check_sizes

    s = target_options.setting(options, CPU_REPS)
    kind, world = s.kind, s.world
    model = options.sweep or DEFAULT_SWEEP[kind]
    if model not in MODELS:
        raise ValueError(f"unknown model {model}: use one of {', '.join(MODELS)}")
    check_sizes(MODELS[model], world)
    layers = getattr(options, "layers", None) or DEFAULT_LAYERS[kind]
    contenders = target_options.contenders(options.variants, CONTENDERS, OPTIONAL)
    tokens = target_options.token_counts(options.shapes, TOKENS[kind], world)
    cfg = {"model": model, "layers": layers, "tokens": tokens[:options.limit or None],
           "reps": s.reps, "contenders": contenders, "progress": bool(options.progress), "seed": 0,
           "interpreted": s.interpreted}
    started = datetime.datetime.now(datetime.timezone.utc)
    result = dict(spawn(_rank, world, cfg, device_kind=kind, timeout_s=3600)[0])
    notes = s.notes + result.pop("notes", [])
    result.update(sweep=model, model=model, layers=layers, world=world, device_kind=kind, reps=s.reps, notes=notes,
                  interpreted=s.interpreted,
                  wall_s=(datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(),
                  method=(f"forward + loss + backward + AdamW step + zero_grad per step; first {LOSS_STEPS} steps' "
                          "losses from the same weights and batches; then median of reps timed steps, rank-max, "
                          "the contenders in turns (autofuse.measure.time_in_turns, eager); tokens/s = T / step "
                          "time; MFU = model FLOPs / (step time x GPUs x dense bf16 peak)"))
    return result  # the command's writer turns non-finite floats into null


# ------------------------------------------------------------------------------- the contenders
def _build(config: Any, dev: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """The whole LlamaForCausalLM with random weights, made on `dev` (alike on every rank: same seed)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(dev):
        model = LlamaForCausalLM(config)
    return model.to(dtype).train()


def _compile_layers(model: torch.nn.Module, in_place: bool) -> None:
    """Each decoder layer under torch.compile(fullgraph=True), per block as torchtitan compiles. in_place:
    `layer.compile()`, the layer's forward hooks inside the graph (autofuse's row scatter and gather:
    with torch 2.11, `torch.compile(layer)` dropped the last layer's forward hook); else the layer
    replaced by `torch.compile(layer)`, torchtitan's form (torch's split and gather are hooked on the
    wrapper afterwards, eager around the graph: traced, the first layer's failed in fake-tensor propagation)."""
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if in_place:
            layer.compile(fullgraph=True)
        else:
            layers[i] = torch.compile(layer, fullgraph=True)


def _torch_tp_layers(model: torch.nn.Module, mesh: Any) -> None:
    """torch-tp (torchtitan's plan) inside every decoder layer."""
    for layer in model.model.layers:
        torch_tp.parallelize_layer(layer, mesh)


def _torch_tp_ends(model: torch.nn.Module, mesh: Any) -> None:
    """The first layer's whole input split along the sequence, the last layer's output gathered whole, so
    embeddings, norm, lm_head and loss run replicated as in autofuse. Hooked on the layers as they stand
    now (a compiled layer's wrapper: eager around its graph)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    layers = model.model.layers
    parallelize_module(layers[0], mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                           desired_input_layouts=(Shard(1),), use_local_output=True))
    parallelize_module(layers[-1], mesh, PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                                             use_local_output=True))


def contender(name: str, model: torch.nn.Module, world: World, mesh: Any) -> torch.nn.Module:
    """`model` (a fresh copy, changed in place) made into contender `name` (module doc)."""
    import autofuse

    if name in ("autofuse", "autofuse-compiled", *OPTIONAL):
        autofuse.parallelize(model, world.group, sequence_parallel=True)
    elif name in ("torch-tp", "torch-async-tp"):
        _torch_tp_layers(model, mesh)
        if name == "torch-async-tp":
            torch_tp.enable_async_tp(world)
    elif name != "unsharded":
        raise ValueError(f"unknown contender {name}")
    if name in COMPILED:
        _compile_layers(model, in_place=name.startswith("autofuse"))
    if name.startswith("torch"):
        _torch_tp_ends(model, mesh)
    return model


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over the model's parameters: DTensors and plain tensors in separate groups (the foreach
    kernels take one kind at a time)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if isinstance(p, DTensor) == d]} for d in (True, False)]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=LR)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> torch.Tensor:
    """One training step: next-token cross-entropy on `ids`, backward, optimizer step, zero_grad; the loss."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


# ------------------------------------------------------------------------------------- per rank
def model_flops(config: Any, tokens: int) -> float:
    """Model FLOPs of one training step on `tokens` tokens (forward + backward = 3x the forward's
    matmuls): every decoder layer's (`layer_flops`: projections and causal attention) and lm_head's
    (2 x tokens x hidden x vocab, x3); the embedding lookup, norms and the loss are not counted."""
    lm_head = 3.0 * 2 * tokens * config.hidden_size * config.vocab_size
    return config.num_hidden_layers * layer_flops(config, tokens) + lm_head


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _rank(world: World, cfg: dict) -> dict:
    from transformers import LlamaConfig

    cuda = world.device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    mesh = torch_tp.mesh(world)
    config = LlamaConfig(**MODELS[cfg["model"]], num_hidden_layers=cfg["layers"], rms_norm_eps=1e-5,
                         attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False)
    notes: list[str] = []
    names = list(cfg["contenders"])
    if "torch-async-tp" in names and (why := torch_tp.async_tp_unavailable(world)) is not None:
        names.remove("torch-async-tp")
        notes.append(f"torch-async-tp skipped: {why}")
    for name, mode in TRAIN_MODES.items():
        if name in names and mode not in modes.supported(world.device.type):
            names.remove(name)
            notes.append(f"{name} skipped: {world.device.type} has no {mode} timing mode")
    device = torch.cuda.get_device_name(world.device) if cuda else "cpu"
    peak = None if cfg["interpreted"] else peak_tflops(device)
    rows = [_tokens_row(world, cfg, config, t, mesh, names, peak) for t in cfg["tokens"]]
    return {"rows": rows, "contenders": names, "notes": notes, "device": device, "peak_tflops": peak,
            "loss_tolerance": LOSS_TOLERANCE["bf16" if cuda else "fp32"], "loss_steps": LOSS_STEPS,
            "config": {**MODELS[cfg["model"]], "num_hidden_layers": cfg["layers"]}}


def _tokens_row(world: World, cfg: dict, config: Any, t: int, mesh: Any, names: list[str],
                peak: float | None) -> dict:
    """The losses and timings of every contender at T = `t` tokens (fresh copies, compiled afresh)."""
    from autofuse.measure.timing import time_in_turns

    cuda = world.device.type == "cuda"
    dev, dtype = world.device, (torch.bfloat16 if cuda else torch.float32)
    tol = LOSS_TOLERANCE["bf16" if cuda else "fp32"]
    say = world.rank == 0 and cfg["progress"]
    base = _build(config, dev, dtype, cfg["seed"])
    g = torch.Generator(device=dev).manual_seed(cfg["seed"] + t)
    batches = [torch.randint(0, config.vocab_size, (1, t), generator=g, device=dev) for _ in range(LOSS_STEPS)]
    losses: dict[str, list[float]] = {}
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    for name in ["unsharded", *names]:
        model = contender(name, copy.deepcopy(base), world, mesh)
        opt = optimizer(model)
        losses[name] = [float(in_mode(name, lambda ids=ids: train_step(model, opt, ids))()) for ids in batches]
        if name == "unsharded":
            del model, opt
            _free(cuda)
        else:
            models[name] = (model, opt)
        if say:
            print(f"T={t} {name}: losses " + " ".join(f"{v:.5f}" for v in losses[name]), flush=True)
    del base
    _free(cuda)
    diffs = {n: {ref: world.rank_max(max(_rel(a, b) for a, b in zip(losses[n], losses[ref])))
                 for ref in REFERENCES if ref in losses and ref != n} for n in names}
    ids = batches[0]

    def step(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        return in_mode(name, lambda: train_step(model, opt, ids))

    times, _ = time_in_turns(world, [step(n, *models[n]) for n in names], "eager", reps=cfg["reps"], warmup=1,
                             rounds=cfg["reps"])
    ms = {n: tm.median_us / 1e3 for n, tm in zip(names, times)}
    del models
    _free(cuda)
    torch._dynamo.reset()
    flops = model_flops(config, t)
    row = {"tokens": t, "ms": ms, "losses": losses, "loss_diff": diffs,
           "loss_ok": all(d <= tol for per in diffs.values() for d in per.values()),
           "tokens_per_s": {n: t / (v * 1e-3) for n, v in ms.items()}, "flops": flops,
           "mfu": {} if peak is None else {n: flops / (v * 1e-3) / (world.size * peak * 1e12) for n, v in ms.items()},
           "speedup": ({} if cfg["interpreted"] or BASELINE not in ms else
                       {n: ms[BASELINE] / v for n, v in ms.items()})}
    if say:
        print(f"T={t}: " + ", ".join(f"{n} {v:.1f} ms" for n, v in ms.items()), flush=True)
    return row


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ render
def _f(x: Any, digits: int = 0) -> str:
    return "-" if not isinstance(x, (int, float)) or not math.isfinite(x) else f"{x:.{digits}f}"


def render(result: dict, console: Any) -> None:
    """The step table (ms, tokens/s, MFU, x vs torch-async-tp, loss differences), the losses, the notes."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    rows, names = result["rows"], result.get("contenders", [])
    ratios = not result.get("interpreted")
    tol = result.get("loss_tolerance")
    console.print(Text(f"Llama {result.get('model', '?')} with {result.get('layers')} layers, training step "
                       f"(forward, loss, backward, AdamW), TP={result.get('world')} with sequence parallelism, on "
                       f"{result.get('device', '?')}; ms per step, median, rank-max; tokens/s = T / step"
                       + (f"; x = {BASELINE} / contender" if ratios else "")
                       + (f"; MFU = model FLOPs / (time x GPUs x {result.get('peak_tflops')} TFLOP/s)"
                          if result.get("peak_tflops") else "")
                       + f"; loss diff: the first {result.get('loss_steps')} steps' worst relative difference "
                         f"(tolerance {tol})"))
    t = Table(title=Text("training step"), box=box.SIMPLE_HEAD)
    for col in ("T", "contender", "ms", "tokens/s", "MFU", "x", *(f"vs {r}" for r in REFERENCES)):
        t.add_column(col, justify="left" if col == "contender" else "right", no_wrap=col == "contender")
    for row in rows:
        for n in names:
            mfu = row.get("mfu", {}).get(n)
            diff_cells = []
            for ref in REFERENCES:
                d = row["loss_diff"].get(n, {}).get(ref)
                bad = d is not None and tol is not None and d > tol
                diff_cells.append(Text("-" if d is None else f"{d:.1e}" + (" WRONG" if bad else ""),
                                       style="red" if bad else ""))
            t.add_row(str(row["tokens"]), n, _f(row["ms"].get(n), 1), _f(row["tokens_per_s"].get(n)),
                      "-" if mfu is None else f"{100 * mfu:.1f}%",
                      _f(row["speedup"].get(n), 3) if ratios else "-", *diff_cells)
    console.print(t)
    ls = Table(title=Text("losses of the first steps"), box=box.SIMPLE_HEAD)
    ls.add_column("T", justify="right")
    ls.add_column("who")
    for i in range(result.get("loss_steps", 0)):
        ls.add_column(f"step {i}", justify="right")
    for row in rows:
        for n, values in row["losses"].items():
            ls.add_row(str(row["tokens"]), n, *(f"{v:.5f}" for v in values))
    console.print(ls)
    for line in result.get("notes", []):
        console.print(Text(line, style="yellow"))
