"""`autofuse bench moe`: the expert-parallel MoE block (moe_dispatch + the experts' grouped GEMMs +
moe_combine) per contender, against BSP, with dispatch and combine bandwidth per GPU.

Models (`--sweep`, comma-separated; SwiGLU experts): `mixtral` (Mixtral-8x7B: H 4096, F 14336, E 8,
top-2), `qwen3` (Qwen3-30B-A3B: H 2048, F 768, E 128, top-8), `deepseek` (DeepSeek-V3-like: H 7168,
F 2048, E 256, top-8), `tiny` (the CPU default: H 32, F 16, E 2W, top-2). Token counts per rank
`--tokens` (default 1, 8, 64, 256, 1024, 4096, 8192 on GPUs; 4, 16 on CPU). bf16 on GPUs, float32 on
CPU. Routing: random, k distinct experts per token; `--skew S` sends each token wholly to rank 0's
experts with the probability that makes rank 0's expected share of the rows S percent (as the ops'
sweeps do; 0: even).

Contenders (`--variants` picks some): every combine variant that runs here, forced with the ops'
`variant=` argument (what AUTOFUSE_VARIANT does), with dispatch's variant of the same name (or, where
dispatch has none, dispatch's `hybrid`); `DISPATCH/COMBINE` pairs (default: `hybrid/fused`, hybrid's
dispatch beside the fused combine); and `autofuse` (dispatched: the policy's choice). A contender refused
on every rank (an input it does not take; buffers that do not fit the symmetric heap, where each contender
keeps its own: at DeepSeek-like T=4096 on 4 GPUs they need more than the default 8G, AUTOFUSE_HEAP_SIZE=32G
holds them) is left out of that row with a note. Each is first checked: its output against bsp's (rank-max relative difference, norm-wise),
and on CPU against the unsharded block in float64. Then, per timing mode (eager and graph on GPUs,
eager on CPU): the block, dispatch alone and combine alone (with a handle its dispatch made), the
contenders in turns (`autofuse.measure.timing.time_in_turns`), median of reps, rank-max. Variants that
cannot be captured in a CUDA graph (`Variant.capturable` False: bsp reads the counts on the host) are
timed eagerly in graph mode, in the same turns (`autofuse.measure.timing.timed_mode`; `autofuse` too
where it dispatches to one), marked `timed_eager` (what a captured model does around them: runs that
piece eagerly). x BSP = bsp's time / the contender's, in the same
mode row; `autofuse_vs_best`: autofuse's time over the fastest forced contender's (its misses).
Bandwidth per GPU: bytes of the token rows the busiest rank sends to and receives from
other ranks (H x dtype bytes per row; rows to its own experts not counted) over the time of dispatch
alone (combine alone for combine): an effective rate, the expert GEMM included in that time. The
all-to-all alone (autofuse/bench/moe_a2a.py): hybrid's heap exchange at the config dispatch would use
(dispatch's and combine's), without the GEMM, against NCCL's all_to_all_single of the same rows with
the splits known; GB/s = bytes a rank receives from other ranks / time (issue 41's measure).
On CPU the timings are the interpreter's and gloo's: no speedups or rates are shown.
`run(options)` / `render(result, console)` follow autofuse/bench/bench.py's contract.
"""
from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from autofuse.bench import moe_a2a, target_options

if TYPE_CHECKING:
    from autofuse.comm.world import World

MODELS = {"mixtral": (4096, 14336, 8, 2), "qwen3": (2048, 768, 128, 8), "deepseek": (7168, 2048, 256, 8),
          "tiny": (32, 16, 0, 2)}  # H, F, E, k (tiny: E = 2W)
TOKENS = {"cuda": (1, 8, 64, 256, 1024, 4096, 8192), "cpu": (4, 16)}
DEFAULT_SWEEP = {"cuda": "mixtral,qwen3,deepseek", "cpu": "tiny"}
AUTOFUSE = "autofuse"
BASELINE = "bsp"
PAIRED_DISPATCH = "hybrid"  # dispatch's variant beside a combine variant dispatch has not (fused)
TOLERANCE = {"cuda": 2.5e-2, "cpu": 1e-5}  # vs bsp's output (bf16 / float32, the same sums in other orders)
CPU_REPS = 3


def run(options: Any) -> dict:
    """Spawn the ranks; check and time every contender at every model and token count; rank 0's result."""
    from autofuse.comm.world import spawn
    from autofuse.core import registry

    s = target_options.setting(options, CPU_REPS)
    kind, world = s.kind, s.world
    models = [m.strip() for m in (options.sweep or DEFAULT_SWEEP[kind]).split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        raise ValueError(f"unknown model {','.join(bad) or '(none)'}: use one or more of {', '.join(MODELS)}")
    models = [m for m in models if m == "tiny" or MODELS[m][2] % world == 0]
    variants = list(registry.get("moe_combine").variants)
    pairs = [f"{PAIRED_DISPATCH}/{v}" for v in variants
             if v not in (BASELINE, PAIRED_DISPATCH) and v in registry.get("moe_dispatch").variants]
    names = target_options.contenders(options.variants, [*variants, *pairs, AUTOFUSE])
    skew = getattr(options, "skew", None) or 0
    if not 0 <= skew <= 100:
        raise ValueError(f"--skew is a percent of the rows on rank 0's experts (0..100), got {skew}")
    tokens = target_options.token_counts(getattr(options, "tokens", None) or options.shapes, TOKENS[kind])
    if any(t < 1 for t in tokens):
        raise ValueError(f"token counts must be positive, got {tokens}")
    cfg = {"models": models, "tokens": tokens[:options.limit or None], "reps": s.reps, "skew": skew,
           "contenders": names, "modes": s.modes,
           "progress": bool(options.progress), "seed": 0, "interpreted": s.interpreted}
    started = datetime.datetime.now(datetime.timezone.utc)
    result = dict(spawn(_rank, world, cfg, device_kind=kind, timeout_s=3600)[0])
    result.update(sweep=",".join(models), world=world, device_kind=kind, reps=s.reps, skew=skew,
                  notes=s.notes + result.get("notes", []),
                  interpreted=s.interpreted, tolerance=TOLERANCE[kind],
                  wall_s=(datetime.datetime.now(datetime.timezone.utc) - started).total_seconds())
    return result


# -------------------------------------------------------------------------------------------- inputs
def routing(t: int, e: int, k: int, world: int, skew: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 T x k: k distinct experts per token, weights float32 rows summing to 1); with `skew`,
    a token goes wholly to rank 0's experts with the probability giving rank 0 `skew`% of the rows."""
    local = e // world
    share = skew / 100 if skew else 1 / world
    q = 0.0 if world == 1 else max(0.0, (share - 1 / world) / (1 - 1 / world))
    ids = torch.topk(torch.rand(t, e, generator=gen), k, dim=1).indices
    if q > 0 and k <= local:
        skewed = torch.rand(t, generator=gen) < q
        ids[skewed] = torch.topk(torch.rand(int(skewed.sum()), local, generator=gen), k, dim=1).indices
    weights = torch.rand(t, k, generator=gen) + 0.1
    return ids, weights / weights.sum(1, keepdim=True)


def remote_rows(world: World, ids: torch.Tensor, experts: int) -> int:
    """Rows the busiest rank sends to and receives from other ranks (both all-to-alls move as many)."""
    import torch.distributed as dist

    owner = ids.reshape(-1).cpu() // (experts // world.size)
    per_dest = torch.bincount(owner, minlength=world.size).to(world.device)
    table = [torch.zeros_like(per_dest) for _ in range(world.size)]  # on the rank's device: NCCL writes there
    dist.all_gather(table, per_dest, group=world.group)
    m = torch.stack([row.cpu() for row in table])  # m[src, dst]
    off = m - torch.diag(torch.diag(m))
    return int((off.sum(1) + off.sum(0)).max())


# -------------------------------------------------------------------------------------------- per rank
def _rank(world: World, cfg: dict) -> dict:
    cuda = world.device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    rows, notes = [], []
    for model in cfg["models"]:
        for t in cfg["tokens"]:
            got = _case(world, cfg, model, t)
            rows += got["rows"]
            notes += [n for n in got["notes"] if n not in notes]
            if cuda:
                torch.cuda.empty_cache()
    return {"rows": rows, "notes": notes, "contenders": cfg["contenders"], "modes": cfg["modes"],
            "device": torch.cuda.get_device_name(world.device) if cuda else "cpu"}


def _case(world: World, cfg: dict, model: str, t: int) -> dict:
    import autofuse
    from autofuse.core import registry
    from autofuse.measure.timing import time_in_turns, timed_mode
    from autofuse.ops import moe

    cuda = world.device.type == "cuda"
    dev, dt = world.device, (torch.bfloat16 if cuda else torch.float32)
    h, f, e, k = MODELS[model]
    e = e or 2 * world.size
    local = e // world.size
    group = world.group
    gen = torch.Generator().manual_seed(cfg["seed"] * 7919 + world.rank * 104729 + t)
    ids, weights = routing(t, e, k, world.size, cfg["skew"], gen)
    x = torch.randn(t, h, generator=gen)
    wgen = torch.Generator().manual_seed(cfg["seed"] + 11)
    whole = model == "tiny"  # every expert on every rank: the float64 reference can be computed
    if whole:
        w1g, w2g = torch.randn(e, h, 2 * f, generator=wgen) / math.sqrt(h), torch.randn(e, f, h, generator=wgen) / math.sqrt(f)
        mine = slice(world.rank * local, (world.rank + 1) * local)
        w1, w2 = w1g[mine], w2g[mine]
    else:  # this rank's experts only, drawn on the device (hundreds of MB to GB)
        g = torch.Generator(device=dev).manual_seed(cfg["seed"] + 11 + world.rank)
        w1 = torch.randn(local, h, 2 * f, generator=g, device=dev, dtype=dt) / math.sqrt(h)
        w2 = torch.randn(local, f, h, generator=g, device=dev, dtype=dt) / math.sqrt(f)
    x, ids, weights = x.to(dev, dt), ids.to(dev), weights.to(dev)
    w1 = w1.to(dev, dt).reshape(local, h, 2, f).contiguous()
    w2 = w2.to(dev, dt).contiguous()
    names = cfg["contenders"]
    dispatch_variants = registry.get("moe_dispatch").variants
    forced = {n: _pair(n, dispatch_variants) for n in names}  # (dispatch's variant, combine's)

    def block(v: tuple[str | None, str | None]) -> Callable[[], torch.Tensor]:
        def go() -> torch.Tensor:
            hh, handle = autofuse.moe_dispatch(x, ids, weights, w1, group=group, variant=v[0])
            return autofuse.moe_combine(hh, w2, handle, group=group, variant=v[1])
        return go

    notes: list[str] = []
    outs: dict[str, torch.Tensor] = {}
    for n in names:
        try:
            outs[n] = block(forced[n])().clone()
        except (ValueError, NotImplementedError, MemoryError) as exc:  # alike on every rank, before any launch
            # (MemoryError: HeapFull, the symmetric heap holds every contender's buffers; its message says to
            # raise AUTOFUSE_HEAP_SIZE)
            notes.append(f"{n} refused on {model} T={t}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    live = [n for n in names if n in outs]
    chosen = autofuse.explain("moe_dispatch", x, ids, weights, w1, group=group).variant if AUTOFUSE in live else None
    base = outs.get(BASELINE) if BASELINE in outs else block((BASELINE, BASELINE))()
    diff = {n: world.rank_max(_rel(y, base)) for n, y in outs.items()}
    ref_diff = None
    if whole:
        want = moe.unsharded(x.double().cpu(), ids.cpu(), weights.double().cpu(), w1g.double(), w2g.double(), "swiglu")
        ref_diff = {n: world.rank_max(_rel(y.cpu(), want)) for n, y in outs.items()}
    tol = TOLERANCE["cuda" if cuda else "cpu"]
    ok = all(d <= tol for d in diff.values()) and all(d <= tol for d in (ref_diff or {}).values())
    handles = {n: autofuse.moe_dispatch(x, ids, weights, w1, group=group, variant=forced[n][0]) for n in live}
    steps = {n: {"block": block(forced[n]),
                 "dispatch": (lambda v=forced[n][0]: autofuse.moe_dispatch(x, ids, weights, w1, group=group, variant=v)),
                 "combine": (lambda n=n: autofuse.moe_combine(handles[n][0], w2, handles[n][1], group=group,
                                                              variant=forced[n][1]))} for n in live}
    variant = {n: registry.get("moe_dispatch").variant(chosen if n == AUTOFUSE else forced[n][0]) for n in live}
    chosen_combine = (autofuse.explain("moe_combine", handles[AUTOFUSE][0], w2, handles[AUTOFUSE][1], group=group).variant
                      if AUTOFUSE in live else None)
    moved = remote_rows(world, ids, e) * h * x.element_size()
    warmup, reps = (3 if cuda else 1), cfg["reps"]
    try:
        heap_configs = _heap_configs(world, x, ids, weights, w1, w2, handles.get(PAIRED_DISPATCH))
    except (ValueError, NotImplementedError) as exc:  # no heap exchange here: refused alike on every rank
        heap_configs = []
        notes.append(f"all-to-all alone not timed on {model} T={t}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    rows = []
    for mode in cfg["modes"]:
        a2a = moe_a2a.measure(world, x, ids, weights, w1, heap_configs, mode, reps) if heap_configs else None
        us: dict[str, dict[str, float]] = {n: {} for n in live}
        as_mode = [timed_mode(variant[n], mode) for n in live]
        for part in ("block", "dispatch", "combine"):
            times, _ = time_in_turns(world, [steps[n][part] for n in live], as_mode, reps=reps, warmup=warmup,
                                     rounds=reps)
            for n, tm in zip(live, times):
                us[n][part] = tm.median_us
        ratios = not cfg["interpreted"]
        bsp = us.get(BASELINE, {}).get("block")
        row = {"model": model, "tokens": t, "H": h, "F": f, "E": e, "k": k, "mode": mode, "skew": cfg["skew"],
               "us": {n: v["block"] for n, v in us.items()},
               "dispatch_us": {n: v["dispatch"] for n, v in us.items()},
               "combine_us": {n: v["combine"] for n, v in us.items()},
               "timed_eager": sorted(n for n, m in zip(live, as_mode) if m != mode),
               "x_bsp": ({n: bsp / v["block"] for n, v in us.items()} if ratios and bsp else {}),
               "moved_bytes": moved,
               "dispatch_GBps": ({n: moved / v["dispatch"] / 1e3 for n, v in us.items()} if ratios else {}),
               "combine_GBps": ({n: moved / v["combine"] / 1e3 for n, v in us.items()} if ratios else {}),
               "autofuse_vs_best": _vs_best(us) if ratios else None,
               "a2a": a2a, "diff": diff, "ref_diff": ref_diff, "ok": ok, "autofuse_variant": chosen,
               "autofuse_combine_variant": chosen_combine}
        rows.append(row)
        if world.rank == 0 and cfg["progress"]:
            print(f"{model} T={t} {mode}: " + ", ".join(f"{n} {v['block']:.1f} us" for n, v in us.items())
                  + f" (diff vs bsp {max(diff.values(), default=0):.1e})", flush=True)
    return {"rows": rows, "notes": notes}


def _pair(name: str, dispatch_variants: dict) -> tuple[str | None, str | None]:
    """A contender's (dispatch variant, combine variant): `autofuse` (None, None), `D/C` (D, C), else the
    combine variant beside dispatch's variant of that name, or hybrid's where dispatch has none."""
    if name == AUTOFUSE:
        return None, None
    if "/" in name:
        d, c = name.split("/", 1)
        return d, c
    return (name if name in dispatch_variants else PAIRED_DISPATCH), name


def _vs_best(us: dict[str, dict[str, float]]) -> float | None:
    """autofuse's block time over the fastest forced contender's (same turns); None without both."""
    forced = [v["block"] for n, v in us.items() if n != AUTOFUSE and math.isfinite(v.get("block", math.nan))]
    mine = us.get(AUTOFUSE, {}).get("block", math.nan)
    return mine / min(forced) if forced and math.isfinite(mine) else None


def _heap_configs(world: World, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                  w2: torch.Tensor, handle: Any) -> list[dict]:
    """The all-to-all configs the hybrid variants run with here (what dispatch would pick: the policy's
    or the known-good default), dispatch's and, given a hybrid handle, combine's."""
    import autofuse

    configs = [dict(autofuse.explain("moe_dispatch", x, ids, weights, w1, group=world.group,
                                     variant=PAIRED_DISPATCH).config)]
    if handle is not None:
        c = dict(autofuse.explain("moe_combine", handle[0], w2, handle[1], group=world.group,
                                  variant=PAIRED_DISPATCH).config)
        if c not in configs:
            configs.append(c)
    return configs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# ------------------------------------------------------------------------------------------ render
def _f(x: Any, digits: int = 1) -> str:
    return "-" if not isinstance(x, (int, float)) or not math.isfinite(x) else f"{x:.{digits}f}"


def render(result: dict, console: Any) -> None:
    """Per mode: the block's us per contender and x BSP; dispatch / combine alone and their GB/s; the heap
    all-to-all alone against NCCL's; geomeans."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from autofuse.measure.compare import geomean

    names = result.get("contenders", [])
    ratios = not result.get("interpreted")
    console.print(Text(f"MoE block (dispatch + experts + combine), EP={result.get('world')}, skew {result.get('skew')}%, "
                       f"on {result.get('device', '?')}: us per call, median, rank-max"
                       + ("; x BSP = bsp / contender; GB/s = the busiest rank's remote token-row bytes / time "
                          "(eager* = timed eagerly: not capturable)" if ratios else "")))
    for mode in result.get("modes", []):
        rows = [r for r in result["rows"] if r["mode"] == mode]
        t = Table(title=Text(f"{mode} mode: block"), box=box.SIMPLE_HEAD)
        for c in ("model", "T"):
            t.add_column(c, justify="right" if c == "T" else "left")
        for n in names:
            t.add_column(f"{n} us", justify="right")
            if ratios and n != "bsp":
                t.add_column("x BSP", justify="right")
        t.add_column("check", justify="right")
        for r in rows:
            cells = []
            for n in names:
                star = "*" if n in r["timed_eager"] else ""
                cells.append(_f(r["us"].get(n)) + star)
                if ratios and n != "bsp":
                    cells.append(_f(r["x_bsp"].get(n), 2))
            worst = max([*r["diff"].values(), *(r["ref_diff"] or {}).values()] or [float("nan")])
            cells.append(Text(f"{worst:.1e}" + ("" if r["ok"] else " WRONG"), style="" if r["ok"] else "red"))
            t.add_row(r["model"], str(r["tokens"]), *cells)
        console.print(t)
        b = Table(title=Text(f"{mode} mode: dispatch / combine alone, us" + (" and GB/s per GPU" if ratios else "")),
                  box=box.SIMPLE_HEAD)
        for c in ("model", "T", "who", "dispatch us", "combine us") + (("dispatch GB/s", "combine GB/s") if ratios else ()):
            b.add_column(c, justify="left" if c in ("model", "who") else "right")
        for r in rows:
            for n in r["dispatch_us"]:
                extra = [_f(r["dispatch_GBps"].get(n)), _f(r["combine_GBps"].get(n))] if ratios else []
                b.add_row(r["model"], str(r["tokens"]), n, _f(r["dispatch_us"][n]), _f(r["combine_us"][n]), *extra)
        console.print(b)
        a = Table(title=Text(f"{mode} mode: the heap all-to-all alone (hybrid's exchange at its config) vs NCCL "
                             "all_to_all_single with known splits, us" + (" and GB/s per GPU received" if ratios else "")),
                  box=box.SIMPLE_HEAD)
        for c in ("model", "T", "remote MB", "NCCL us", "heap dispatch us", "heap combine us") + (
                ("NCCL GB/s", "dispatch GB/s", "combine GB/s") if ratios else ()):
            a.add_column(c, justify="left" if c == "model" else "right")
        for r in rows:
            x2 = r.get("a2a")
            if not x2:
                continue
            u, g = x2["us"], x2.get("GBps", {})
            extra = [_f(g.get("nccl")), _f(g.get("dispatch")), _f(g.get("combine"))] if ratios else []
            a.add_row(r["model"], str(r["tokens"]), _f(x2["recv_bytes"] / 1e6, 2), _f(u.get("nccl")), _f(u.get("dispatch")),
                      _f(u.get("combine")), *extra)
            if x2.get("wrong"):
                console.print(Text(f"{r['model']} T={r['tokens']}: heap all-to-all rows differ from NCCL's at "
                                   f"{x2['wrong']}", style="red"))
        console.print(a)
        if ratios:
            for n in names:
                if n != "bsp":
                    console.print(f"{mode}: geomean x BSP of {n} over {len(rows)} rows = "
                                  f"{_f(geomean(r['x_bsp'].get(n) for r in rows), 3)}")
            vs_best = [r["autofuse_vs_best"] for r in rows if r.get("autofuse_vs_best")]
            if vs_best:
                worst = max(rows, key=lambda r: r.get("autofuse_vs_best") or 0)
                console.print(f"{mode}: autofuse over the fastest forced contender in the same turns, geomean "
                              f"{_f(geomean(vs_best), 3)}, worst {_f(worst['autofuse_vs_best'], 3)} "
                              f"({worst['model']} T={worst['tokens']})")
    for line in result.get("notes", []):
        console.print(Text(line, style="yellow"))
