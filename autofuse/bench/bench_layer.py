"""`autofuse bench layer`: a tensor-parallel Llama-3 layer on autofuse against the same layer on NCCL + cuBLAS.

The layer is `autofuse.bench.llama_layer` (one module, one code path; only its four communicating steps
differ: autofuse's public API, or torch.distributed collectives + torch.matmul). One rank per
local GPU (or 2 CPU ranks running Triton's interpreter); both layers share one set of random bf16
weights; in the same run, per shape and timing mode:
- the check: both layers on the same inputs, ||autofuse - baseline|| / ||baseline|| (rank-max)
  against TOLERANCE (the argument is in tests/test_layer.py's docstring);
- per-layer latency of both layers: median of `reps` timed batches (device events; in graph mode
  the calls are captured in a CUDA graph after a warm-up and replayed, as inference servers run),
  rank-max, the two layers timed in turns batch by batch (`autofuse.measure.timing.time_in_turns`), so that
  a drift of the host's speed (large in eager mode, where a decode layer is bound by the host) or of
  the clocks is shared by both instead of charged to the one timed later;
- the baseline's communication alone (its collectives with the layer's shapes, one after the
  other, nothing else): c = comm / baseline layer, ceiling = 1 / (1 - c) (perfect overlap);
- speedup = baseline / autofuse; ceiling captured = (speedup - 1) / (ceiling - 1);
- each op alone (qkv, attention, o_proj, gate_up, down) with the layer's shapes and the same
  timing method, in both layers (the two forms of an op timed in turns); `rest` = layer - sum of
  ops (norms, RoPE, cache write, SwiGLU, residuals, copies; negative where the layer overlaps more
  than its ops alone);
- which variant autofuse ran for each op (autofuse.explain), and geomeans per phase and mode.

Shapes (GPU): prefill of one sequence of 512, 2048, 8192 tokens; decode of batch 1, 8, 32, 128
with 4K, 8K, 16K, 32K tokens already in the KV cache of every sequence (split over the ranks).
On CPU a tiny config and tiny shapes, eager only: interpreter timings, no GPU meaning.

The `autofuse bench` contract (autofuse/bench/bench.py): `run(options) -> dict` (JSON-able,
"rows" one per shape, mode and autofuse configuration; writes no file) and `render(result,
console)`. `options` is the command's BenchOptions or this module's Options (or a dict): from
BenchOptions, `sweep` names the model (70b, 8b, tiny), `shapes` the shape filter, `variants` the
autofuse configurations (see Options), `progress` a line per measured row. `python -m
autofuse.bench.bench_layer` runs it without the CLI and writes `--out`.
"""
from __future__ import annotations

import datetime
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from autofuse.core import registry, settings
from autofuse.bench import llama_layer, target_options

if TYPE_CHECKING:
    from autofuse.comm.world import World

TOLERANCE = 2.5e-2  # bf16 layer vs bf16 layer, norm-wise relative; see tests/test_layer.py
OPS = ("qkv", "attention", "o_proj", "gate_up", "down")
PREFILL_TOKENS = {"cuda": (512, 2048, 8192), "cpu": (16, 32)}
DECODE_BATCH = {"cuda": (1, 8, 32, 128), "cpu": (1, 2)}
DECODE_CONTEXT = {"cuda": (4096, 8192, 16384, 32768), "cpu": (24,)}
KV_BLOCK = {"cuda": 64, "cpu": 4}
CPU_NOTE = ("CPU emulation: Triton's interpreter and gloo on a tiny config; these are interpreter timings, "
            "not GPU numbers: no speedup is shown (run on a GPU machine for the layer's real latency)")
DEFAULT_SWEEP = {"cuda": "70b", "cpu": "tiny"}  # the model, when --sweep is not given
GPU_REPS = 30  # timed batches per median where Options.reps is not given
CPU_REPS = 3  # timed batches per median on CPU at most: the interpreter takes ~0.1-0.5 s per attention call


@dataclass
class Options:
    """What `run` measures. Every field has a default (None: chosen from the device).

    world: ranks (default every local GPU, or 2 CPU ranks); model (or sweep): 70b | 8b | tiny (default
    70b on GPUs, tiny on CPU); modes: eager and/or graph (default both on GPUs, eager on CPU); phases:
    prefill and/or decode; shapes: filter, items like 'T=2048' (prefill tokens), 'B=8', 'S=16K'
    (decode batch / context; a missing one takes the default grid), '8x16K' (one decode shape),
    'prefill' / 'decode' (that phase's default grid); shapes not in the grid are added; reps: timed
    batches per median (default 30 GPU; at most 3 on CPU); op_shares: time each op alone;
    kv_block: positions per KV-cache block (ranks own blocks round-robin; default 64, 4 on CPU);
    autofuse: the autofuse configurations to time against the one baseline, each an AUTOFUSE_VARIANT
    value ('' or 'default': autofuse's own choice; 'ag_gemm:push,gemm_rs:push_last' forces those), a
    list or one string split at ';' (default: this process's AUTOFUSE_VARIANT, else autofuse's choice);
    'each' stands for one configuration per non-bsp variant: the i-th run forces every op's i-th
    variant available on the device (cycling), as listed by autofuse.core.registry.
    variants (the CLI's --variants, split at commas), used when `autofuse` is not given: 'default'
    and 'each' as above; a bare variant name V is one configuration forcing V on every op that has
    it; all op:variant items together form one configuration. progress: a line per measured row.
    limit: only the first N shapes of the plan.
    """

    world: int | None = None
    model: str | None = None
    modes: Sequence[str] | None = None
    phases: Sequence[str] | None = None
    shapes: Sequence[str] | str | None = None
    reps: int | None = None
    op_shares: bool = True
    seed: int = 0
    kv_block: int | None = None
    autofuse: Sequence[str] | str | None = None
    variants: Sequence[str] | None = None
    progress: bool = True
    device_kind: str = ""
    limit: int | None = None

    @classmethod
    def of(cls, options: Any = None) -> "Options":
        """Options from an Options, a dict, the CLI's BenchOptions (sweep = model), an argparse
        namespace, or None (every default)."""
        if options is None or isinstance(options, cls):
            return options or cls()
        get = options.get if isinstance(options, dict) else lambda k, d: getattr(options, k, d)
        opts = cls(**{f.name: get(f.name, f.default) for f in fields(cls)})
        opts.model = opts.model or get("sweep", None)
        return opts


# ------------------------------------------------------------------------------------- the plan
def _size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([kK]?)", text.strip())
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 2048 or 16K)")
    return int(m.group(1)) * (1024 if m.group(2) else 1)


def plan(opts: Options, kind: str) -> list[dict]:
    """The shapes to run: [{'phase': 'prefill', 'tokens': T} | {'phase': 'decode', 'batch': B, 'context': S}]."""
    tokens, batches, contexts = PREFILL_TOKENS[kind], DECODE_BATCH[kind], DECODE_CONTEXT[kind]
    given = [opts.shapes] if isinstance(opts.shapes, str) else list(opts.shapes or [])
    items = [i.strip() for text in given for i in str(text).split(",") if i.strip()]
    pre: list[int] = []
    dec: list[tuple[int, int]] = []
    bs: list[int] = []
    ss: list[int] = []
    for item in items:
        low = item.lower()
        if low == "prefill":
            pre += tokens
        elif low == "decode":
            dec += [(b, s) for b in batches for s in contexts]
        elif low.startswith("t="):
            pre.append(_size(item[2:]))
        elif low.startswith("b="):
            bs.append(_size(item[2:]))
        elif low.startswith("s="):
            ss.append(_size(item[2:]))
        elif "x" in low:
            b, s = low.removeprefix("decode:").split("x")
            dec.append((_size(b), _size(s)))
        elif low.startswith("prefill:"):
            pre.append(_size(item[8:]))
        else:
            raise ValueError(f"shape filter item {item!r}: use T=2048, B=8, S=16K, 8x16K, prefill or decode")
    if bs or ss:
        dec += [(b, s) for b in (bs or batches) for s in (ss or contexts)]
    if not items:
        pre, dec = list(tokens), [(b, s) for b in batches for s in contexts]
    phases = set(opts.phases or ("prefill", "decode"))
    unknown = phases - {"prefill", "decode"}
    if unknown:
        raise ValueError(f"phases {sorted(unknown)}: use prefill and/or decode")
    out = [{"phase": "prefill", "tokens": t} for t in dict.fromkeys(pre)] if "prefill" in phases else []
    out += [{"phase": "decode", "batch": b, "context": s} for b, s in dict.fromkeys(dec)] if "decode" in phases else []
    return out


def autofuse_configs(opts: Options) -> list[str]:
    """The AUTOFUSE_VARIANT values to run ('' = autofuse's own choice, 'each' expanded in the ranks)."""
    items = opts.autofuse
    if items is None and opts.variants:
        items = _from_variants([v.strip() for v in opts.variants if v.strip()])
    if items is None:
        items = [os.environ.get("AUTOFUSE_VARIANT", "")]
    elif isinstance(items, str):
        items = items.split(";")
    return list(dict.fromkeys("" if i.strip() in ("", "default") else i.strip() for i in items))


def _from_variants(names: Sequence[str]) -> list[str]:
    """The CLI's --variants items as configurations (see Options.variants)."""
    out: list[str] = []
    pairs = [n for n in names if ":" in n]
    for name in names:
        if ":" in name:
            continue
        if name in ("default", "each"):
            out.append(name)
            continue
        ops = [op for op in registry.names() if name in registry.get(op).variants]
        if not ops:
            raise ValueError(f"no op has a variant {name!r}")
        out.append(",".join(f"{op}:{name}" for op in ops))
    if pairs:
        out.append(",".join(pairs))
    return out


def expand_configs(configs: Sequence[str], world: World) -> list[str]:
    """Replace 'each' by the forced combinations covering every non-bsp variant of every op available
    on `world` (combination i takes each op's i-th variant, cycling); keeps the order, no repeats."""
    out: list[str] = []
    for c in configs:
        if c != "each":
            out.append(c)
            continue
        out += [",".join(f"{op}:{v}" for op, v in forced.items()) for forced in llama_layer.forced_sets(world)]
    return list(dict.fromkeys(out))


def alternative_sets(world: World) -> list[dict[str, str]]:
    """The layers users would otherwise run (autofuse.measure.compare.alternatives: torch's symmetric-memory
    ops): set i forces each op's i-th alternative available on `world` (cycling) and BSP on ops that have
    none; [] where no op has an alternative here (the CPU emulation)."""
    from autofuse.core import registry
    from autofuse.measure.compare import alternatives

    per_op = {op: [v for v in alternatives(op) if registry.get(op).variants[v].available(world)]
              for op in registry.names()}
    runs = max((len(vs) for vs in per_op.values()), default=0)
    return [{op: vs[i % len(vs)] if vs else "bsp" for op, vs in per_op.items()} for i in range(runs)]


def shape_label(item: dict) -> str:
    return f"T={item['tokens']}" if item["phase"] == "prefill" else f"B={item['batch']} S={item['context']}"


# ----------------------------------------------------------------------------------- the run
def run(options: Any = None) -> dict:
    """Spawn the ranks, measure every planned shape in every mode, return (and write) the result."""
    from autofuse.comm.world import spawn

    opts = Options.of(options)
    s = target_options.setting(replace(opts, reps=opts.reps or GPU_REPS), CPU_REPS, CPU_NOTE)
    kind, world, modes, reps, notes = s.kind, s.world, s.modes, s.reps, s.notes
    model = opts.model or DEFAULT_SWEEP[kind]
    if kind != "cuda" and "graph" in modes:
        raise ValueError("graph mode needs CUDA graphs; on CPU only eager mode runs")
    shapes = plan(opts, kind)[:opts.limit or None]
    if model not in llama_layer.CONFIGS:
        raise ValueError(f"unknown model {model!r}: use one of {', '.join(llama_layer.CONFIGS)}")
    cfg = {"model": model, "modes": modes, "reps": reps, "progress": bool(opts.progress),
           "op_shares": opts.op_shares, "seed": opts.seed, "kv_block": opts.kv_block or KV_BLOCK[kind],
           "autofuse": autofuse_configs(opts),
           "policy_mode": os.environ.get("AUTOFUSE_MODE", "")}
    llama_layer.check_tp(llama_layer.CONFIGS[model], world)
    started = datetime.datetime.now(datetime.timezone.utc)
    per_rank = spawn(_rank, world, cfg, shapes, device_kind=kind, timeout_s=3600)
    result = dict(per_rank[0])
    result.update(sweep=model, world=world, device_kind=kind, model=model, modes=modes, reps=cfg["reps"],
                  wall_s=(datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(),
                  summary=summarize(result["rows"]), notes=notes,
                  method=("per-layer and per-op latency: median of reps timed batches, rank-max "
                          "(autofuse.measure.timing.time_in_turns: both layers in turns, batch by batch; graph mode: "
                          "captured after warm-up, replayed); each op timed alone with the layer's shapes in the "
                          "same run and mode, both forms in turns; rest = layer - ops; "
                          "comm = the baseline's collectives alone, c = comm / baseline layer"))
    return _finite(result)


def _finite(obj: Any) -> Any:
    """obj with NaN and infinite floats replaced by None, so the JSON is standard."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


@dataclass
class _Shape:
    """One shape's callables: both layers, each op alone in each layer, the baseline's collectives."""

    layers: dict[str, Callable[[], Any]]
    ops: dict[str, dict[str, tuple[Callable, tuple]]] = field(default_factory=dict)
    comm: Callable[[], Any] = lambda: None
    autofuse_ops: dict[str, str] = field(default_factory=dict)  # label -> autofuse op name
    keep: list = field(default_factory=list)  # tensors the callables use (the KV cache)


def _rand(g: torch.Generator, *shape: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=g, device=device).to(dtype)


def _prefill(world, m, cfg, layers: dict, tokens: int, seed: int) -> _Shape:
    dev, dt, w = world.device, torch.bfloat16, world.size
    rows, d, hq, hkv = tokens // w, cfg.head_dim, cfg.heads // w, cfg.kv_heads // w
    if tokens % w:
        raise ValueError(f"prefill tokens {tokens} must be divisible by the world size {w}")
    g = torch.Generator(device=dev).manual_seed(seed * 7919 + 1 + world.rank)
    x = _rand(g, rows, cfg.hidden, device=dev, dtype=dt)
    h = _rand(g, rows, cfg.hidden, device=dev, dtype=dt)
    q = _rand(g, tokens, hq, d, device=dev, dtype=dt)
    k, v = (_rand(g, tokens, hkv, d, device=dev, dtype=dt) for _ in range(2))
    a_o = _rand(g, tokens, hq * d, device=dev, dtype=dt)
    a_d = _rand(g, tokens, cfg.mlp // w, device=dev, dtype=dt)
    s = _Shape({name: (lambda layer=layer: layer.prefill(x)) for name, layer in layers.items()})
    for name, layer in layers.items():
        o, wt = layer.ops, layer.w
        s.ops[name] = {"qkv": (o.ag_gemm, (h, wt.qkv)), "attention": (m.causal_attention, (q, k, v)),
                       "o_proj": (o.gemm_rs, (a_o, wt.o)), "gate_up": (o.ag_gemm, (h, wt.gate_up)),
                       "down": (o.gemm_rs, (a_d, wt.down))}
    s.autofuse_ops = {"qkv": "ag_gemm", "o_proj": "gemm_rs", "gate_up": "ag_gemm", "down": "gemm_rs"}
    base = layers["baseline"].ops
    gather, scatter = torch.zeros(rows, cfg.hidden, device=dev, dtype=dt), torch.zeros(tokens, cfg.hidden, device=dev, dtype=dt)
    s.comm = lambda: (base.all_gather_rows(gather), base.reduce_scatter_rows(scatter),
                      base.all_gather_rows(gather), base.reduce_scatter_rows(scatter))
    return s


def _decode(world, m, cfg, layers: dict, batch: int, context: int, seed: int, block: int) -> _Shape:
    dev, dt, w = world.device, torch.bfloat16, world.size
    d, hq = cfg.head_dim, cfg.heads // w
    cache = m.KVCache.random(cfg, batch, context + 1, world.rank, w, block, seed, dev, dt)
    g_all = torch.Generator(device=dev).manual_seed(seed * 7919 + 2)  # the same on every rank
    x = _rand(g_all, batch, cfg.hidden, device=dev, dtype=dt)
    q = _rand(g_all, batch, cfg.heads, d, device=dev, dtype=dt)
    pos = torch.full((batch,), context, dtype=torch.int64, device=dev)
    lengths = cache.lengths(pos + 1)
    g = torch.Generator(device=dev).manual_seed(seed * 7919 + 3 + world.rank)
    h = _rand(g, batch, cfg.hidden, device=dev, dtype=dt)
    h_k = _rand(g, batch, cfg.hidden // w, device=dev, dtype=dt)
    a_o = _rand(g, batch, hq * d, device=dev, dtype=dt)
    a_d = _rand(g, batch, cfg.mlp // w, device=dev, dtype=dt)
    s = _Shape({name: (lambda layer=layer: layer.decode(x, pos, cache)) for name, layer in layers.items()},
               keep=[cache])
    for name, layer in layers.items():
        o, wt = layer.ops, layer.w
        s.ops[name] = {"qkv": (o.gemm_ar, (h_k, wt.qkv_rows)),
                       "attention": (o.flash_decode, (q, cache.keys, cache.values, lengths)),
                       "o_proj": (o.gemm_ar, (a_o, wt.o)), "gate_up": (torch.matmul, (h, wt.gate_up)),
                       "down": (o.gemm_ar, (a_d, wt.down))}
    s.autofuse_ops = {"qkv": "gemm_ar", "attention": "flash_decode", "o_proj": "gemm_ar", "down": "gemm_ar"}
    base = layers["baseline"].ops
    qkv = torch.zeros(batch, (cfg.heads + 2 * cfg.kv_heads) * d, device=dev, dtype=dt)
    partials = torch.zeros(1, batch * cfg.heads * (d + 1), device=dev, dtype=torch.float32)  # flash_decode bsp's (O, LSE)
    hid = [torch.zeros(batch, cfg.hidden, device=dev, dtype=dt) for _ in range(2)]
    s.comm = lambda: (base.all_reduce(qkv), base.all_gather_rows(partials), base.all_reduce(hid[0]),
                      base.all_reduce(hid[1]))
    return s


def _rank(world, cfg: dict, shapes: list[dict]) -> dict:
    import autofuse
    from autofuse.measure.timing import time_fn, time_in_turns

    m = llama_layer
    model = m.CONFIGS[cfg["model"]]
    cuda = world.device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    weights = m.random_weights(model, world.rank, world.size, cfg["seed"], world.device, torch.bfloat16)
    group = world.group
    layers = {"autofuse": m.TPLlamaLayer(model, weights, m.AutofuseOps(group), group),
              "baseline": m.TPLlamaLayer(model, weights, m.TorchOps(group), group)}
    alternatives = {f"alternative {i}": (forced, m.TPLlamaLayer(model, weights, m.AutofuseOps(group, forced), group))
                    for i, forced in enumerate(alternative_sets(world))}
    layers.update({name: layer for name, (_, layer) in alternatives.items()})
    reps, warmup = cfg["reps"], 3 if cuda else 1
    configs = expand_configs(cfg["autofuse"], world)

    def timed(fn: Callable[[], Any], mode: str) -> float:
        return time_fn(world, fn, mode, warmup=warmup, reps=reps).median_us

    def together(fns: dict[str, Callable[[], Any]], mode: str) -> dict[str, float]:
        """Median us of each of `fns`, timed in turns batch by batch (a drift of the host or the
        clocks during the run is shared by both layers instead of charged to the one timed later)."""
        times, _ = time_in_turns(world, list(fns.values()), mode, reps=reps, warmup=warmup, rounds=reps)
        return {name: t.median_us for name, t in zip(fns, times)}

    def select(variants: str, mode: str) -> None:
        """Make autofuse decide afresh: the variants this configuration forces (AUTOFUSE_VARIANT's
        syntax, passed as autofuse's `variant=` argument), and the policy fitted for this timing mode
        (unless AUTOFUSE_MODE was set for the whole run)."""
        forced = settings.parse_variants(variants, "configuration")
        layers["autofuse"].ops.variants = {op: forced.get(op, forced.get("*")) for op in registry.names()}
        os.environ["AUTOFUSE_MODE"] = cfg["policy_mode"] or mode
        autofuse.set_policy(None)  # forgets cached decisions and policies; every rank calls it alike

    def op_times(s: _Shape, mode: str, layer_us: dict[str, float]) -> dict[str, dict[str, float]]:
        """Each op alone in both layers (timed in turns, op by op); `rest` = layer - ops."""
        if not cfg["op_shares"]:
            return {}
        out: dict[str, dict[str, float]] = {name: {} for name in ("baseline", "autofuse")}
        for label in s.ops["baseline"]:
            pair = together({name: (lambda fn=s.ops[name][label][0], args=s.ops[name][label][1]: fn(*args))
                             for name in out}, mode)
            for name, us in pair.items():
                out[name][label] = us
        for name, ops in out.items():
            ops["rest"] = layer_us[name] - sum(ops.values())
        return out

    say = world.rank == 0 and cfg["progress"]
    rows = []
    for item in shapes:
        if item["phase"] == "prefill":
            s = _prefill(world, m, model, layers, item["tokens"], cfg["seed"])
        else:
            s = _decode(world, m, model, layers, item["batch"], item["context"], cfg["seed"], cfg["kv_block"])
        select("", "eager")
        expected = s.layers["baseline"]()
        for mode in cfg["modes"]:
            select("", mode)
            for fn, args in s.ops["baseline"].values():
                fn(*args)  # every problem seen before any capture (autofuse raises CaptureMiss otherwise)
            comm = timed(s.comm, mode)
            for variants in configs:
                select(variants, mode)
                try:  # a forced variant that cannot run a shape is refused on every rank alike, before any launch
                    err = world.rank_max(m.rel_diff(s.layers["autofuse"](), expected))
                    for fn, args in s.ops["autofuse"].values():
                        fn(*args)
                except (ValueError, NotImplementedError) as exc:  # InvalidConfig, InvalidInput, unavailable
                    rows.append({**item, "shape": shape_label(item), "mode": mode, "autofuse": variants or "default",
                                 "error": f"{type(exc).__name__}: {exc}"})
                    if say:
                        print(f"{item['phase']} {shape_label(item)} {mode} autofuse {variants}: refused", flush=True)
                    continue
                forced = layers["autofuse"].ops.variants
                chosen = {label: f"{op}:{autofuse.explain(op, *s.ops['autofuse'][label][1], group=group, variant=forced.get(op)).variant}"
                          for label, op in s.autofuse_ops.items()}
                alts = [name for name in alternatives if not variants]  # beside autofuse's own choice only
                for name in alts:
                    s.layers[name]()  # its problems seen before any capture
                t = together({name: s.layers[name] for name in ("baseline", "autofuse", *alts)}, mode)
                base, fused = t["baseline"], t["autofuse"]
                row = _row(item, mode, variants or "default", t, comm, op_times(s, mode, t), err, chosen, not cuda,
                           {name: alternatives[name][0] for name in alts})
                rows.append(row)
                if say:
                    alt = f", best alternative {row['alternative_us']:.0f} us" if row["alternative_us"] else ""
                    print(f"{item['phase']} {shape_label(item)} {mode} autofuse {variants or 'default'}: baseline "
                          f"{base:.0f} us, autofuse {fused:.0f} us{alt}, diff {err:.1e}", flush=True)
        select("", "eager")
        del s, expected
        if cuda:
            torch.cuda.empty_cache()
    if cfg["policy_mode"]:
        os.environ["AUTOFUSE_MODE"] = cfg["policy_mode"]
    else:
        os.environ.pop("AUTOFUSE_MODE", None)
    return {"rows": rows, "config": asdict(model), "tolerance": TOLERANCE, "autofuse": [c or "default" for c in configs],
            "device": torch.cuda.get_device_name(world.device) if cuda else "cpu"}


def _row(item: dict, mode: str, config: str, t: dict[str, float], comm: float, ops: dict, err: float,
         variants: dict, is_interpreted: bool, alternatives: dict[str, dict[str, str]]) -> dict:
    """One shape in one mode: both layers' latencies and the numbers of autofuse.measure.compare, the
    layer's bound being the larger of the baseline's collectives alone and the rest of its layer
    (perfect overlap); x alt against the fastest of the alternative layers timed beside it. The CPU
    emulation gets latencies only."""
    from autofuse.measure.compare import captured, ceiling, ratio

    base, fused = t["baseline"], t["autofuse"]
    c = comm / base if base > 0 else math.nan
    alt_name = min(alternatives, key=lambda n: t[n]) if alternatives else None
    alt_us = t[alt_name] if alt_name else None
    speedup = top = x_alt = None
    if not is_interpreted:
        speedup, top, x_alt = ratio(base, fused), ceiling(base, max(comm, base - comm)), ratio(alt_us, fused)
    shares = {name: {k: v / t[name] for k, v in table.items()} for name, table in ops.items()}
    return {**item, "shape": shape_label(item), "mode": mode, "autofuse": config, "autofuse_us": fused, "baseline_us": base,
            "speedup": speedup, "comm_us": comm, "comm_share": c, "bound_us": max(comm, base - comm), "ceiling": top,
            "ceiling_captured": captured(speedup, top), "alternative_us": alt_us,
            "alternative": alternatives.get(alt_name) if alt_name else None, "speedup_vs_alternative": x_alt,
            "interpreted": is_interpreted, "ops_us": ops, "ops_share": shares, "variants": variants, "rel_diff": err,
            "tolerance": TOLERANCE, "ok": err <= TOLERANCE}


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) else math.nan


def summarize(rows: Sequence[dict]) -> list[dict]:
    """Per mode, phase and autofuse configuration: geomean speedup over the baseline and over the best
    alternative, the geomean ceiling and the share of it captured, the worst speedup, shapes refused,
    and whether every output matched (ratios None for the CPU emulation)."""
    from autofuse.measure.compare import captured, geomean

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["mode"], r["phase"], r["autofuse"]), []).append(r)
    out = []
    for (mode, phase, config), group in groups.items():
        rs = [r for r in group if "error" not in r]
        if not rs:
            out.append({"mode": mode, "phase": phase, "autofuse": config, "shapes": 0, "refused": len(group)})
            continue
        sp, ce = geomean(r["speedup"] for r in rs), geomean(r["ceiling"] for r in rs)
        worst = min(rs, key=lambda r: r["speedup"] if r["speedup"] is not None else math.inf)
        out.append({"mode": mode, "phase": phase, "autofuse": config, "shapes": len(rs),
                    "refused": len(group) - len(rs), "speedup_geomean": sp, "ceiling_geomean": ce,
                    "ceiling_captured": captured(sp, ce),
                    "speedup_vs_alternative_geomean": geomean(r.get("speedup_vs_alternative") for r in rs),
                    "comm_share_mean": sum(_num(r["comm_share"]) for r in rs) / len(rs),
                    "worst_speedup": worst["speedup"], "worst_shape": worst["shape"],
                    "all_ok": all(r["ok"] for r in rs), "interpreted": any(r.get("interpreted") for r in rs),
                    "all_bsp": all(v.endswith(":bsp") for r in rs for v in r.get("variants", {}).values())})
    return out


# ---------------------------------------------------------------------------------------- render
def _f(x: float, digits: int = 2) -> str:
    return "-" if x is None or not isinstance(x, (int, float)) or not math.isfinite(x) else f"{x:.{digits}f}"


def _short(r: dict) -> str:
    """A compact shape for tables: 'T 2048' (prefill tokens) or 'B8 S16K' (decode batch and context)."""
    if r["phase"] == "prefill":
        return f"T {r['tokens']}"
    ctx = r["context"]
    return f"B{r['batch']} S{ctx // 1024}K" if ctx % 1024 == 0 else f"B{r['batch']} S{ctx}"


def render(result: dict, console: Any) -> None:
    """Readable at 80 columns, in a log too, without markup: per mode and autofuse configuration the layer
    latencies and the numbers of autofuse.measure.compare (latencies only for the CPU emulation), then
    where the time goes op by op; the geomeans; the notes."""
    from rich.text import Text

    from autofuse.bench.tables import print_split_table

    def say(text: str, style: str = "") -> None:
        console.print(Text(text, style=style))

    rows = result["rows"]
    interp = any(r.get("interpreted") for r in rows) or result.get("device_kind") == "cpu"
    say(f"Llama-3 {result.get('model', '?')} layer, TP={result.get('world', '?')} on {result.get('device', '?')}, "
        "bf16. Baseline: torch.distributed + torch.matmul, the same kernels otherwise. us per layer, median, "
        "rank-max." + ("" if interp else " x base = baseline / autofuse; x alt = the fastest alternative layer "
                       "(torch's symmetric-memory ops) / autofuse; c = the baseline's collectives alone / its layer; "
                       "ceiling = baseline / max(collectives, rest); captured = (x base - 1) / (ceiling - 1)."))
    configs = list(dict.fromkeys(r["autofuse"] for r in rows))
    alt = any(r.get("alternative_us") for r in rows)
    cols = ["base", "autofuse"] + ([] if interp else ["x base"] + (["alt", "x alt"] if alt else [])
                                   + ["c", "ceiling", "captured"]) + ["diff"]
    for mode in result.get("modes") or list(dict.fromkeys(r["mode"] for r in rows)):
        for config in configs:
            rs = [r for r in rows if r["mode"] == mode and r["autofuse"] == config]
            if not rs:
                continue
            name = f"{mode} mode" + (f", autofuse {config}" if len(configs) > 1 else "")
            body = []
            for r in rs:
                if "error" in r:
                    body.append([_short(r), *["-"] * (len(cols) - 1), "refused"])
                    continue
                cell = {"base": _f(r["baseline_us"], 0), "autofuse": _f(r["autofuse_us"], 0),
                        "x base": _f(r["speedup"], 3), "alt": _f(r.get("alternative_us"), 0),
                        "x alt": _f(r.get("speedup_vs_alternative"), 3), "c": _f(r["comm_share"], 3),
                        "ceiling": _f(r["ceiling"], 3), "captured": _f(r["ceiling_captured"], 2),
                        "diff": f"{r['rel_diff']:.1e}" + ("" if r["ok"] else " WRONG")}
                body.append([_short(r), *[cell[c] for c in cols]])
            print_split_table(console, f"layer, {name}", ["shape"], cols, body)
            with_ops = [r for r in rs if r.get("ops_us")]
            if not with_ops:
                continue
            body = []
            for r in with_ops:
                b, a, share = r["ops_us"]["baseline"], r["ops_us"]["autofuse"], r["ops_share"]["baseline"]
                body.append([_short(r), *(f"{_f(100 * _num(share[op]), 0)}% {_f(_num(a[op]) - _num(b[op]), 0)}"
                                          for op in (*OPS, "rest"))])
            print_split_table(console, f"ops alone, {name}: % of the baseline layer, autofuse - baseline us",
                              ["shape"], [*OPS, "rest"], body)
    for s in result.get("summary") or summarize(rows):
        head = f"{s['mode']} {s['phase']}" + (f" (autofuse {s['autofuse']})" if len(configs) > 1 else "")
        if not s["shapes"]:
            say(f"{head}: every shape refused", "red")
            continue
        refused = f", {s['refused']} shapes refused" if s["refused"] else ""
        wrong = "" if s["all_ok"] else ", SOME OUTPUTS DIFFER FROM THE BASELINE"
        if s.get("interpreted"):
            say(f"{head}: {s['shapes']} shapes, outputs " + ("agree" if s["all_ok"] else "DIFFER") + refused,
                "" if s["all_ok"] else "red")
        else:
            x_alt = s.get("speedup_vs_alternative_geomean")
            say(f"{head}: x{_f(s['speedup_geomean'], 3)} geomean over {s['shapes']} shapes (worst "
                f"x{_f(s['worst_speedup'], 3)} at {s['worst_shape']})"
                + (f", x{_f(x_alt, 3)} over the best alternative" if x_alt else "")
                + f", ceiling x{_f(s['ceiling_geomean'], 3)}, captured {_f(s['ceiling_captured'], 2)} of it"
                + refused + wrong, "" if s["all_ok"] else "red")
        if s.get("all_bsp"):
            say(f"{head}: autofuse ran bsp on every op, the baseline's own path: this compares BSP with itself "
                "(no policy for this machine?); `--variants each` forces autofuse's other variants", "yellow")
    for r in rows:
        if "error" in r:
            say(f"{r['mode']} {r['phase']} {r['shape']} autofuse {r['autofuse']}: {r['error']}", "red")
    chosen = sorted({f"{k}={v}" for r in rows for k, v in r.get("variants", {}).items()})
    if chosen:
        say("autofuse ran: " + ", ".join(chosen))
    for line in result.get("notes", []):
        say(line, "yellow")
