"""`autofuse bench TARGET`: an op's variants at their known-good configs vs BSP and the bound, or an
extra benchmark (collectives, gemm_core, layer, moe, train_layer, train_model); tables, then one JSON file (autofuse/bench/bench.py)."""
from __future__ import annotations

import datetime
from pathlib import Path
from typing import Optional

import typer

from autofuse.commands._common import OutputExists, check_new, fail, note, out, write_new

TRACEBACK_LINES = 20  # of a failed rank's traceback, printed above the one-line failure


def bench(
    target: str = typer.Argument(..., help="An op (ag_gemm, gemm_rs, gemm_ar, flash_decode, ...) or an extra "
                                 "benchmark: collectives, gemm_core, layer, moe, train_layer, train_model (a '-' reads as '_': "
                                 "train-layer is train_layer)."),
    sweep: Optional[str] = typer.Option(None, help="Problem set of an op: gpu (the papers' sweep), llama70b, "
                                        "models, default or cpu (default: gpu with GPUs, else cpu); of gemm_core: gpu, "
                                        "full or cpu; of layer and train_layer: the model (70b, 8b, tiny); of train_model: 8b or tiny."),
    variants: Optional[str] = typer.Option(None, help="Comma-separated variants (default: all available); "
                                            "gemm_core: config families (tma, ptr, swap, splitk, ws, streamk)."),
    mode: Optional[str] = typer.Option(None, help="eager or graph (default: both where CUDA graphs exist; "
                                       "eager on CPU)."),
    shapes: Optional[list[str]] = typer.Option(None, "--shapes", help="Problems to keep, repeatable: for an op, "
                                               "comma-separated M (flash_decode: B) values, e.g. 64,128; "
                                               "for gemm_core, M, MxN or MxNxK items; for train_layer and "
                                               "train_model, token counts T, e.g. 4096."),
    reps: int = typer.Option(20, min=1, help="Timed batches per measurement (median taken)."),
    limit: Optional[int] = typer.Option(None, min=1, help="Only the first N problems."),
    world: Optional[int] = typer.Option(None, "--world", min=1, help="World size (default: every local GPU, "
                                        "or 2 CPU ranks)."),
    out_path: Optional[Path] = typer.Option(None, "--out", help="JSON output (default: "
                                            "./autofuse-out/bench-TARGET-SWEEP-wWORLD-DATE.json, e.g. "
                                            "autofuse-out/bench-ag_gemm-cpu-w2-2026-11-22.json; DATE in UTC)."),
    force: bool = typer.Option(False, "--force", help="Replace the output file if it exists."),
    quiet: bool = typer.Option(False, help="No line per measurement, only the tables."),
    json_out: bool = typer.Option(False, "--json", help="Print the JSON document instead of tables (no progress "
                                  "lines; the file is written as well)."),
    profile: bool = typer.Option(False, "--profile", help="Op targets: after measuring, run each variant's best "
                                 "config 20 more calls under torch.profiler and report its kernels per call "
                                 "(device us, share, GPU busy vs measured latency); rows gain a 'profile' key."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="gemm_core only: bf16 (default) or fp8 "
                                        "(float8_e4m3fn against torch._scaled_mm)."),
    tokens: Optional[list[str]] = typer.Option(None, "--tokens", help="moe only: token counts per rank, "
                                               "comma-separated, repeatable (default 1..8192 on GPUs, 4,16 on CPU)."),
    skew: Optional[int] = typer.Option(None, "--skew", min=0, max=100, help="moe only: percent of the routed rows "
                                       "on rank 0's experts (default: even routing)."),
    search: Optional[str] = typer.Option(None, "--search", help="gemm_core only: defaults (the configs the ops "
                                         "try first; the default) or wide (a grid of 40-280 configs a shape, "
                                         "compiled in parallel first: what the core reaches when tuned)."),
    layers: Optional[int] = typer.Option(None, "--layers", min=1, help="train_model only: decoder layers of the "
                                         "model (default 4 on GPUs, 2 on CPU)."),
) -> None:
    """Benchmark an op (each variant at its known-good configs vs BSP and the bound) or an extra target.

    On a machine without GPUs this runs the CPU emulation: the timings are the Triton interpreter's
    and gloo's, not a GPU's (they show that every variant runs, not which is faster).
    """
    from autofuse.bench.bench import (
        CPU_NOTE,
        BenchOptions,
        BenchTargetMissing,
        dumps,
        is_op,
        load_target,
        planned_out,
        report,
    )

    target = target.replace("-", "_")  # one spelling (train_layer), the hyphenated one accepted as typed
    try:
        module = load_target(target)
    except BenchTargetMissing as exc:
        fail(str(exc))
    if profile and not is_op(target):
        fail(f"--profile profiles an op's variants; {target} is not an op")
    if dtype is not None and target != "gemm_core":
        fail(f"--dtype selects gemm_core's input dtype; {target} takes its dtype from its problems")
    if search is not None and target != "gemm_core":
        fail(f"--search widens gemm_core's configs; {target} takes its configs from the variants' defaults")
    if layers is not None and target != "train_model":
        fail(f"--layers sets train_model's model depth; {target} takes no --layers")
    if (tokens is not None or skew is not None) and target != "moe":
        fail(f"--tokens and --skew set the moe benchmark's routing; {target} does not take them")
    if search is not None and search not in ("defaults", "wide"):
        fail(f"--search must be defaults or wide, not {search!r}")
    if dtype is not None and dtype not in ("bf16", "fp8"):
        fail(f"--dtype must be bf16 or fp8, not {dtype!r}")
    if mode is not None and mode not in ("eager", "graph"):
        fail(f"--mode must be eager or graph, not {mode!r}")
    options = BenchOptions(target=target, sweep=sweep, reps=reps, limit=limit, world=world, out=out_path,
                           variants=[v.strip() for v in variants.split(",") if v.strip()] if variants else None,
                           modes=[mode] if mode else None, shapes=list(shapes) if shapes else None, force=force,
                           progress=not (quiet or json_out), profile=profile, dtype=dtype,
                           search=search, layers=layers, tokens=list(tokens) if tokens else None,
                           skew=skew).resolved()
    if options.device_kind == "cpu" and mode == "graph":
        fail("--mode graph needs CUDA graphs (a GPU); on CPU only eager mode exists")
    if options.device_kind == "cuda":
        from autofuse.comm.world import gpu_count

        if options.world > gpu_count():
            from autofuse.measure.timing import NO_SHARED_TIMING

            fail(f"--world {options.world} needs {options.world} GPUs; {gpu_count()} are visible ({NO_SHARED_TIMING})")
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    path = options.out or planned_out(module, options, date)
    check_new([path], force)  # the one rule of every command: stop before any work, never replace silently
    where = "GPU" if options.device_kind == "cuda" else "CPU"
    sweep_shown = options.sweep or (("gpu" if options.device_kind == "cuda" else "cpu") if is_op(target) else "default")
    note(f"bench {target}: sweep {sweep_shown}, {options.world} {where} ranks", style="")
    if options.device_kind == "cpu":
        note(CPU_NOTE)
    from autofuse.comm.world import RankFailed

    try:
        result = module.run(options)
    except ValueError as exc:
        fail(f"bench {target}: {exc}")
    except Exception as exc:  # a rank failed (RankFailed) or the target broke: the rank's traceback, then one line
        lines = str(exc).strip().splitlines() or [""]
        first = lines[0]
        if isinstance(exc, RankFailed) and len(lines) > 1:
            note("\n".join(lines[-TRACEBACK_LINES:]), style="dim")
        fail(f"bench {target} failed: {first if isinstance(exc, RankFailed) else f'{type(exc).__name__}: {first}'}")
    if not json_out:
        module.render(result, out)
    doc = report(result, options)
    try:
        write_new(path, dumps(doc), force=force)
    except OutputExists as exc:
        fail(str(exc))
    if json_out:
        print(dumps(doc), end="")
    note(f"wrote {path}", style="")


def register(app: typer.Typer) -> None:
    app.command()(bench)
