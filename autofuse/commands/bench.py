"""`autofuse bench OP`: every variant at its best quick-sweep config vs BSP and the bound; table + JSON."""
from __future__ import annotations

import datetime
import math
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

console = Console()


def _short(problem: dict) -> str:
    skip = {"op", "dtype", "world", "problem"}
    return " ".join(f"{k}={v}" for k, v in problem.items() if k not in skip)


def render(result: dict, op_name: str) -> None:
    """One table per mode, then the geomean speedup of the best fused variant over BSP."""
    from autofuse.bench import geomean

    for mode in result["modes"]:
        rows = [r for r in result["rows"] if r["mode"] == mode]
        t = Table(title=f"{op_name}, {mode} mode, us per call (median, rank-max)")
        t.add_column("problem")
        for v in result["variants"]:
            t.add_column(v, justify="right")
        for col in ("bound", "best fused", "x BSP", "/ bound"):
            t.add_column(col, justify="right")
        for r in rows:
            cells = [f"{r['best_us'][v]:.1f}" if v in r["best_us"] else ("fail" if v in r["failures"] else "-")
                     for v in result["variants"]]
            f = lambda x, d=2: "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"  # noqa: E731
            t.add_row(_short({k: r[k] for k in r if k not in ("best_us", "config", "pieces_us", "bound_us", "best_fused",
                                                              "best_fused_us", "speedup_vs_bsp", "vs_bound",
                                                              "failures", "mode", "bandwidth")}),
                      *cells, f(r["bound_us"], 1), r["best_fused"], f(r["speedup_vs_bsp"]), f(r["vs_bound"]))
        console.print(t)
        bw = [r for r in rows if r.get("bandwidth", {}).get("local_GBps")]
        if bw:
            b = Table(title=f"{op_name}, {mode} mode: local kernel bandwidth vs a device copy in the same run")
            for col in ("problem", "local GB/s", "copy GB/s (read+write)", "local / copy"):
                b.add_column(col, justify="right")
            for r in bw:
                x = r["bandwidth"]
                b.add_row(r["problem"], f"{x['local_GBps']:.0f}", f"{x['copy_GBps']:.0f}", f"{x['local_vs_copy']:.2f}")
            console.print(b)
        console.print(f"{mode}: geomean speedup of the best fused variant over BSP = "
                      f"{geomean([r['speedup_vs_bsp'] for r in rows]):.3f}x over {len(rows)} problems")
        fails = {(r["problem"], v): why for r in rows for v, why in r["failures"].items()}
        for (p, v), why in list(fails.items())[:10]:
            console.print(f"  [yellow]{v} failed on {p}: {why}[/]")


def bench(
    op: str = typer.Argument(..., help="Op to benchmark (ag_gemm, gemm_rs, gemm_ar, flash_decode)."),
    sweep: Optional[str] = typer.Option(None, help="Problem set: gpu, llama70b or cpu (default: gpu with GPUs, else cpu)."),
    variants: Optional[str] = typer.Option(None, help="Comma-separated variants (default: all available)."),
    mode: Optional[str] = typer.Option(None, help="eager or graph (default: both where CUDA graphs exist)."),
    shapes: Optional[str] = typer.Option(None, help="Comma-separated M (or batch) values to keep from the sweep."),
    reps: int = typer.Option(20, help="Timed batches per measurement (median taken)."),
    limit: Optional[int] = typer.Option(None, help="Only the first N problems."),
    ranks: Optional[int] = typer.Option(None, help="World size (default: every local GPU, or 2 CPU ranks)."),
    out: Optional[Path] = typer.Option(None, help="JSON output (default: docs/results/bench-OP-SWEEP-DATE.json)."),
) -> None:
    """Benchmark an op: each variant at its best known-good config, BSP and the bound, eager and graph."""
    from autofuse import registry
    from autofuse.bench import bench_rank, write_report
    from autofuse.world import default_device_kind, gpu_count, spawn

    if op not in registry.names():
        raise typer.BadParameter(f"unknown op {op!r}; available: {', '.join(registry.names())}")
    kind = default_device_kind()
    sweep = sweep or ("gpu" if kind == "cuda" else "cpu")
    n = ranks or (gpu_count() if kind == "cuda" else 2)
    var = [v.strip() for v in variants.split(",")] if variants else None
    modes = [mode] if mode else None
    keep = [int(s) for s in shapes.split(",")] if shapes else None
    console.print(f"bench {op}: sweep {sweep}, {n} {'GPU' if kind == 'cuda' else 'CPU'} ranks")
    results = spawn(bench_rank, n, op, sweep, var, modes, reps, limit, keep, device_kind=kind, timeout_s=3600)
    result = results[0]
    render(result, op)
    date = datetime.date.today().isoformat()
    path = write_report(result, op, sweep, out or Path("docs/results") / f"bench-{op}-{sweep}-w{n}-{date}.json")
    console.print(f"wrote {path}")


def register(app: typer.Typer) -> None:
    app.command()(bench)
