"""`autofuse bench train_layer`: forward + backward of a tensor-parallel Llama decoder layer, sequence
parallel, on autofuse against torch's own tensor parallelism.

The layer is transformers' LlamaDecoderLayer with random weights (`--sweep` names the sizes: 70b,
8b, both as `70b,8b`, or tiny, the CPU default), bf16 on GPUs, float32 on CPU; one sequence of T tokens (batch 1, so
autofuse's row blocks and torch's sequence shards hold the same tokens). Every contender takes this
rank's T/W tokens and returns them; a step is the forward, then the backward from a fixed output
gradient (the input's gradient and every weight's). Contenders, all from one set of weights:
- `autofuse`: `autofuse.nn.llama.parallelize_layer(layer, group, sequence_parallel=True)`: q/k/v one
  ag_gemm, o_proj gemm_rs, gate/up one ag_gemm, down gemm_rs, their backward GEMMs gemm_rs /
  ag_gemm, every call dispatched by autofuse (AUTOFUSE_VARIANT forces variants as anywhere), eager.
- `autofuse-compiled`: the same layer under `torch.compile(fullgraph=True)` (inductor), what the docs
  recommend for training: the ops are custom ops, so the graph holds one node per call and inductor
  fuses the elementwise work around them.
- `autofuse-compiled-graph` (by name only, GPUs): `autofuse-compiled` with its training calls decided
  for graph timing (`autofuse.dispatch.set_train_mode("graph")` around its steps), to compare the two
  timing modes' decisions on one layer in one run.
- `torch-tp`: torch's DTensor tensor parallelism on the same layer, as torchtitan lays it out
  (SequenceParallel norms, PrepareModuleInput all-gathers, ColwiseParallel q/k/v/gate/up,
  RowwiseParallel o/down reduce-scattering to Shard(1)): NCCL + cuBLAS, one after the other.
- `torch-async-tp` (where torch's symmetric memory runs: CUDA, one GPU per rank, the group spanning
  the job): torch-tp
  under torch.compile with inductor's micro-pipeline pass (torch's async TP), which fuses the
  all-gathers and reduce-scatters with the matmuls.
Every autofuse call of the step is a training call (autograd records it or runs it in the backward), so
it dispatches as `autofuse.parallelize`d training does, with no setting: decided in AUTOFUSE_TRAIN_MODE's
timing mode, eager by default (the step is run, not replayed from a CUDA graph, so a variant's launches
count beside its GPU time: round 27 measured the graph policy's picks 1-2.3 ms per layer step slower than
BSP on the host-bound 8B layer); AUTOFUSE_TRAIN_MODE=graph decides them on GPU time alone. MFU per contender: the layer's model FLOPs (forward + backward = 3x the forward's
matmuls, attention causal) over the step's time and the GPUs' dense bf16 peak (`PEAK_TFLOPS`).
First, each contender's output and input gradient against the unsharded layer (rank-max relative
difference, norm-wise, vs TOLERANCE). Then the contenders are timed in turns
(`autofuse.measure.time_in_turns`, eager: training runs eagerly or compiled, not graph-replayed),
median of reps, rank-max. Per-op shares: each communicating projection alone (forward + backward)
in autofuse and in torch-tp (torch's all-gather counted with the projections it feeds), timed in
turns; `rest` = layer - ops (attention, norms, residuals, SwiGLU).
On CPU: the tiny sizes, T in (16, 32), gloo and Triton's interpreter: those timings show that it
runs and agrees, not which is faster. `run(options)` / `render(result, console)` follow
autofuse/bench/bench.py's contract; `--variants` picks contenders by name.
"""
from __future__ import annotations

import copy
import datetime
import math
from typing import TYPE_CHECKING, Any, Callable

import torch

from autofuse.bench import target_options, torch_tp
from autofuse.core import modes

if TYPE_CHECKING:
    from autofuse.comm.world import World

MODELS = {  # one decoder layer's transformers LlamaConfig fields
    "70b": {"hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 28672},
    "8b": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "intermediate_size": 14336},
    "tiny": {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
             "intermediate_size": 128},
}
TOKENS = {"cuda": (2048, 4096, 8192), "cpu": (16, 32)}
CONTENDERS = ("autofuse", "autofuse-compiled", "torch-tp", "torch-async-tp")
OPTIONAL = ("autofuse-compiled-graph",)  # run only where --variants names them
COMPILED = {"autofuse-compiled", "autofuse-compiled-graph", "torch-async-tp"}  # contenders under torch.compile
TRAIN_MODES = {"autofuse-compiled-graph": "graph"}  # contenders whose training calls decide in another timing mode
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4}  # dense bf16 per GPU (SXM datasheets), by a word of the device name
BASELINE = "torch-tp"
OPS = ("qkv", "o_proj", "gate_up", "down")
TOLERANCE = {"bf16": 2.5e-2, "fp32": 1e-4}  # vs the unsharded layer, norm-wise (tests/test_layer.py argues bf16's)
CPU_REPS = 3


def run(options: Any) -> dict:
    """Spawn the ranks, check and time every contender at every token count; rank 0's result."""
    from autofuse.comm.world import spawn
    from autofuse.nn.llama import check_sizes

    s = target_options.setting(options, CPU_REPS)
    kind, world = s.kind, s.world
    models = [m.strip() for m in (options.sweep or ("70b" if kind == "cuda" else "tiny")).split(",") if m.strip()]
    unknown_models = [m for m in models if m not in MODELS]
    if unknown_models or not models:
        raise ValueError(f"unknown model {','.join(unknown_models) or '(none)'}: use one or more of "
                         f"{', '.join(MODELS)}, comma-separated")
    for model in models:
        check_sizes(MODELS[model], world)
    contenders = target_options.contenders(options.variants, CONTENDERS, OPTIONAL)
    tokens = target_options.token_counts(options.shapes, TOKENS[kind], world)
    cfg = {"models": models, "tokens": tokens[:options.limit or None], "reps": s.reps,
           "contenders": contenders, "progress": bool(options.progress), "seed": 0, "interpreted": s.interpreted}
    started = datetime.datetime.now(datetime.timezone.utc)
    result = dict(spawn(_rank, world, cfg, device_kind=kind, timeout_s=3600)[0])
    notes = s.notes + result.pop("notes", [])
    result.update(sweep=",".join(models), world=world, device_kind=kind, model=",".join(models), reps=s.reps,
                  notes=notes,
                  interpreted=s.interpreted,
                  wall_s=(datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(),
                  method=("forward + backward per step, eager or compiled (never graph-replayed); median of "
                          "reps timed batches, rank-max, the contenders in turns (autofuse.measure.time_in_turns); "
                          "each projection alone the same way; rest = layer - ops; MFU = layer model FLOPs / "
                          "(step time x GPUs x dense bf16 peak)"))
    return result  # the command's writer turns non-finite floats into null


# ------------------------------------------------------------------------------- the contenders
def _compiled_async_tp(layer: torch.nn.Module, world: World) -> torch.nn.Module:
    """torch-tp under torch.compile with inductor's micro-pipeline TP pass (torch's async TP)."""
    torch_tp.enable_async_tp(world)
    return torch.compile(layer, fullgraph=True)


def contenders(whole: torch.nn.Module, world: World, mesh: Any,
               names: list[str]) -> tuple[dict[str, torch.nn.Module], list[str]]:
    """Each contender `names` picks (CONTENDERS) made from a copy of the unsharded layer `whole`, by name, and
    notes on those that cannot run here (torch-async-tp without symmetric memory)."""
    from autofuse.nn.llama import parallelize_layer

    layers: dict[str, torch.nn.Module] = {}
    notes: list[str] = []
    for name in names:
        if name == "autofuse":
            layers[name] = parallelize_layer(copy.deepcopy(whole), world.group, sequence_parallel=True)
        elif name in ("autofuse-compiled", "autofuse-compiled-graph"):
            if TRAIN_MODES.get(name, "eager") not in modes.supported(world.device.type):
                notes.append(f"{name} skipped: {world.device.type} has no {TRAIN_MODES[name]} timing mode")
                continue
            layers[name] = torch.compile(parallelize_layer(copy.deepcopy(whole), world.group, sequence_parallel=True),
                                         fullgraph=True)
        elif name == "torch-tp":
            layers[name] = torch_tp.parallelize_layer(copy.deepcopy(whole), mesh)
        elif (why := torch_tp.async_tp_unavailable(world)) is None:
            layers[name] = _compiled_async_tp(torch_tp.parallelize_layer(copy.deepcopy(whole), mesh), world)
        else:
            notes.append(f"torch-async-tp skipped: {why}")
    return layers, notes


def in_mode(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` with the training calls it makes decided in contender `name`'s timing mode (TRAIN_MODES; every other
    autofuse contender: AUTOFUSE_TRAIN_MODE's), set before each call: the contenders take turns."""
    from autofuse.dispatch import set_train_mode

    if not name.startswith("autofuse"):
        return fn
    mode = TRAIN_MODES.get(name)

    def go() -> Any:
        set_train_mode(mode)
        return fn()
    return go


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# ------------------------------------------------------------------------------------- per rank
def layer_flops(config: Any, tokens: int) -> float:
    """Model FLOPs of one decoder layer's forward + backward on `tokens` tokens (3x the forward's):
    the projections' matmuls (2 x tokens x in x out each) and causal attention's two matmuls (QK^T and
    PV, half of the T x T scores); norms, rotary and SwiGLU's elementwise work are not counted."""
    h, d, hq, hkv, f = (config.hidden_size, config.head_dim, config.num_attention_heads,
                        config.num_key_value_heads, config.intermediate_size)
    matmuls = 2 * tokens * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * f)
    attention = 2 * 2 * tokens * tokens * hq * d / 2
    return 3.0 * (matmuls + attention)


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 TFLOP/s of one GPU named `device_name`, where known (PEAK_TFLOPS), else None."""
    return next((v for k, v in PEAK_TFLOPS.items() if k in device_name), None)


def _rank(world: World, cfg: dict) -> dict:
    cuda = world.device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    mesh = torch_tp.mesh(world)
    rows, notes, contenders = [], [], []
    for model in cfg["models"]:
        got = _model_rows(world, cfg, model, mesh)
        rows += got["rows"]
        notes += [n for n in got["notes"] if n not in notes]
        contenders += [c for c in got["contenders"] if c not in contenders]
    device = torch.cuda.get_device_name(world.device) if cuda else "cpu"
    peak = peak_tflops(device) if cuda else None
    for row in rows:
        row["mfu"] = ({} if peak is None or cfg["interpreted"] else
                      {n: row["flops"] / (us * 1e-6) / (world.size * peak * 1e12) for n, us in row["us"].items()})
    return {"rows": rows, "tolerance": TOLERANCE["bf16" if cuda else "fp32"], "contenders": contenders,
            "notes": notes, "config": {m: MODELS[m] for m in cfg["models"]}, "device": device,
            "peak_tflops": peak}


def _model_rows(world: World, cfg: dict, model: str, mesh: Any) -> dict:
    """Check and time every contender on `model`'s layer at every token count."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from autofuse.measure.timing import time_in_turns

    cuda = world.device.type == "cuda"
    dev, dtype = world.device, (torch.bfloat16 if cuda else torch.float32)
    tol = TOLERANCE["bf16" if cuda else "fp32"]
    w, r = world.size, world.rank
    config = LlamaConfig(**MODELS[model], num_hidden_layers=1, vocab_size=128, rms_norm_eps=1e-5,
                         attn_implementation="sdpa")
    torch.manual_seed(cfg["seed"])
    whole = LlamaDecoderLayer(config, 0).to(dev, dtype)
    rotary = LlamaRotaryEmbedding(config).to(dev)
    layers, notes = contenders(whole, world, mesh, cfg["contenders"])
    say = world.rank == 0 and cfg["progress"]
    warmup = 3 if cuda else 1

    def gathered(x: torch.Tensor) -> DTensor:
        """torch-tp's all-gather of this rank's tokens (dim 1), differentiable, a DTensor as the plan hands the
        column-parallel linears (torch_tp's module doc): its gradient is a reduce-scatter."""
        return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])

    rows = []
    for t in cfg["tokens"]:
        g = torch.Generator(device=dev).manual_seed(cfg["seed"] + t)
        x = torch.randn(1, t, config.hidden_size, generator=g, device=dev).to(dtype)
        dy = torch.randn(1, t, config.hidden_size, generator=g, device=dev).to(dtype)
        pos = torch.arange(t, device=dev)[None]
        pe = rotary(x, pos)
        mine = slice(r * t // w, (r + 1) * t // w)
        xw = x.clone().requires_grad_()
        want = _first(whole(xw, position_embeddings=pe, position_ids=pos))
        want.backward(dy)
        want_grads = {n: p.grad for n, p in whole.named_parameters()}
        x_r, dy_r = x[:, mine].contiguous().requires_grad_(), dy[:, mine].contiguous()

        def step(name: str, layer: torch.nn.Module) -> Callable[[], None]:
            return in_mode(name, lambda: _first(layer(x_r, position_embeddings=pe, position_ids=pos)).backward(dy_r))

        diffs, weight_diffs = {}, {}
        for name, layer in layers.items():
            x_r.grad = None
            layer.zero_grad(set_to_none=True)
            got = in_mode(name, lambda: _first(layer(x_r, position_embeddings=pe, position_ids=pos)))()
            in_mode(name, lambda: got.backward(dy_r))()
            diffs[name] = world.rank_max(max(_rel(got, want[:, mine]), _rel(x_r.grad, xw.grad[:, mine])))
            if name.startswith("autofuse"):
                weight_diffs[name] = world.rank_max(_weight_grad_diff(layer, want_grads))
        whole.zero_grad(set_to_none=True)
        times, _ = time_in_turns(world, [step(n, layer) for n, layer in layers.items()], "eager", reps=cfg["reps"],
                                 warmup=warmup, rounds=cfg["reps"])
        us = {name: tm.median_us for name, tm in zip(layers, times)}
        ops = _op_times(world, layers, config, t, dev, dtype, gathered, cfg, warmup)
        speedup = {} if cfg["interpreted"] or BASELINE not in us else {n: us[BASELINE] / v for n, v in us.items()}
        ok = all(d <= tol for d in diffs.values()) and all(d <= tol for d in weight_diffs.values())
        row = {"model": model, "tokens": t, "us": us, "diff": diffs, "weight_grad_diff": weight_diffs, "ok": ok,
               "ops_us": ops, "speedup": speedup, "flops": layer_flops(config, t)}
        rows.append(row)
        if say:
            print(f"{model} T={t}: " + ", ".join(f"{n} {v:.0f} us (diff {diffs[n]:.1e})" for n, v in us.items()),
                  flush=True)
    return {"rows": rows, "notes": notes, "contenders": list(layers)}


def _weight_grad_diff(layer: torch.nn.Module, want: dict[str, torch.Tensor]) -> float:
    """The worst norm-wise difference between an autofuse layer's (plain or compiled) weight gradients,
    gathered whole (`autofuse.nn.full_grads`, collective), and the unsharded layer's."""
    from autofuse.nn import full_grads

    got = full_grads(getattr(layer, "_orig_mod", layer))
    return max((_rel(g, want[k]) for k, g in got.items() if want.get(k) is not None), default=math.inf)


def _op_times(world: World, layers: dict, config: Any, t: int, dev: torch.device, dtype: torch.dtype,
              gathered: Callable, cfg: dict, warmup: int) -> dict[str, dict[str, float]]:
    """Each communicating projection alone, forward + backward, in autofuse and torch-tp (in turns)."""
    from autofuse.measure.timing import time_in_turns

    names = [n for n in ("autofuse", BASELINE) if n in layers]
    if not names:
        return {}
    w = world.size
    h, d = config.hidden_size, config.head_dim
    attn_in = config.num_attention_heads * d // w
    mlp_in = config.intermediate_size // w
    g = torch.Generator(device=dev).manual_seed(cfg["seed"] + 7)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev).to(dtype).requires_grad_()

    x_r, attn_out, act = leaf(1, t // w, h), leaf(1, t, attn_in), leaf(1, t, mlp_in)

    def fwd_bwd(fn: Callable[[], Any]) -> Callable[[], None]:
        def go() -> None:
            outs = fn()
            outs = outs if isinstance(outs, tuple) else (outs,)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        return go

    steps: dict[str, dict[str, Callable[[], None]]] = {}
    if "autofuse" in layers:
        a = layers["autofuse"]
        steps["autofuse"] = {
            "qkv": fwd_bwd(lambda: a.self_attn.qkv_proj(x_r.view(-1, h))),
            "o_proj": fwd_bwd(lambda: a.self_attn.o_proj(attn_out)),
            "gate_up": fwd_bwd(lambda: a.mlp.gate_up_proj(x_r.view(-1, h))),
            "down": fwd_bwd(lambda: a.mlp.down_proj(act)),
        }
    if BASELINE in layers:
        b = layers[BASELINE]

        def qkv() -> tuple:
            xs = gathered(x_r)
            return b.self_attn.q_proj(xs), b.self_attn.k_proj(xs), b.self_attn.v_proj(xs)

        def gate_up() -> tuple:
            xs = gathered(x_r)
            return b.mlp.gate_proj(xs), b.mlp.up_proj(xs)

        steps[BASELINE] = {"qkv": fwd_bwd(qkv), "o_proj": fwd_bwd(lambda: b.self_attn.o_proj(attn_out)),
                           "gate_up": fwd_bwd(gate_up), "down": fwd_bwd(lambda: b.mlp.down_proj(act))}
    out: dict[str, dict[str, float]] = {n: {} for n in steps}
    for op in OPS:
        times, _ = time_in_turns(world, [steps[n][op] for n in steps], "eager", reps=cfg["reps"], warmup=warmup,
                                 rounds=cfg["reps"])
        for n, tm in zip(steps, times):
            out[n][op] = tm.median_us
    return out


# ------------------------------------------------------------------------------------------ render
def _f(x: Any, digits: int = 0) -> str:
    return "-" if not isinstance(x, (int, float)) or not math.isfinite(x) else f"{x:.{digits}f}"


def render(result: dict, console: Any) -> None:
    """The layer table (us per forward+backward, x vs torch-tp, MFU, check), the per-op table, the notes."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    rows, names = result["rows"], result.get("contenders", [])
    ratios = not result.get("interpreted")  # the CPU emulation's timings are never shown as speedups or shares
    mfu = ratios and any(row.get("mfu") for row in rows)
    console.print(Text(f"Llama {result.get('model', '?')} decoder layer, forward + backward, TP={result.get('world')} "
                       f"with sequence parallelism, on {result.get('device', '?')}; us per step, median, rank-max; "
                       + (f"x = {BASELINE} / contender; " if ratios else "")
                       + (f"MFU = model FLOPs / (time x GPUs x {result.get('peak_tflops')} TFLOP/s); " if mfu else "")
                       + f"diff vs the unsharded layer (tolerance {result.get('tolerance')})"))
    t = Table(title=Text("layer"), box=box.SIMPLE_HEAD)
    t.add_column("model")
    t.add_column("T", justify="right")
    for n in names:
        t.add_column(f"{n} us", justify="right")
        if n != BASELINE and ratios:
            t.add_column("x", justify="right")
        if mfu:
            t.add_column("MFU", justify="right")
    t.add_column("diff", justify="right")
    for row in rows:
        cells = []
        for n in names:
            cells.append(_f(row["us"].get(n)))
            if n != BASELINE and ratios:
                cells.append(_f(row["speedup"].get(n), 3))
            if mfu:
                value = row.get("mfu", {}).get(n)
                cells.append("-" if value is None else f"{100 * value:.1f}%")
        worst = max([*row["diff"].values(), *row.get("weight_grad_diff", {}).values()] or [float("nan")])
        cells.append(Text(f"{worst:.1e}" + ("" if row["ok"] else " WRONG"), style="" if row["ok"] else "red"))
        t.add_row(str(row.get("model", "")), str(row["tokens"]), *cells)
    console.print(t)
    with_ops = [row for row in rows if row.get("ops_us")]
    if with_ops:
        o = Table(title=Text("each projection alone, forward + backward: us" + (" (share of its layer)" if ratios else "")),
                  box=box.SIMPLE_HEAD)
        o.add_column("model")
        o.add_column("T", justify="right")
        o.add_column("who")
        for op in (*OPS, "rest"):
            o.add_column(op, justify="right")
        for row in with_ops:
            for n, ops in row["ops_us"].items():
                layer = row["us"].get(n) or float("nan")
                vals = [ops[op] for op in OPS] + [layer - sum(ops[op] for op in OPS)]
                o.add_row(str(row.get("model", "")), str(row["tokens"]), n,
                          *(f"{_f(v)} ({_f(100 * v / layer)}%)" if ratios else _f(v) for v in vals))
        console.print(o)
    for line in result.get("notes", []):
        console.print(Text(line, style="yellow"))
