"""`autofuse tune`: Optuna search of the fused variants' configs, every measurement into SQLite."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

console = Console()
if not console.is_terminal:
    console.width = max(console.width, 160)  # logs: keep the summary table's rows whole


def _split(values: Optional[list[str]], sep: str = ",") -> list[str]:
    return [v.strip() for item in values or [] for v in item.split(sep) if v.strip()]


def render(summary: list[dict]) -> None:
    """The end-of-run table: per problem, the best variant and config, its latency and speedup vs BSP."""
    if not summary:
        console.print("nothing was tuned")
        return
    t = Table(title=f"autofuse tune: best per problem ({summary[0]['mode']} mode, us per call, rank-max median)")
    for col, justify in (("problem", "left"), ("best variant", "left"), ("config", "left"), ("latency", "right"),
                         ("BSP", "right"), ("x BSP", "right"), ("trials", "right"), ("compile s", "right")):
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    for r in summary:
        cfg = ",".join(f"{k}={v}" for k, v in (r["config"] or {}).items()) or "-"
        t.add_row(r["problem"].replace("|", " "), r["best_variant"] or "-", cfg, f(r["latency_us"]), f(r["bsp_us"]),
                  f(r["speedup_vs_bsp"], 2), str(r["trials_this_run"]), f(r["compile_s"]))
    console.print(t)


def _torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class _ParentInterrupt:
    """While ranks run in child processes: the first Ctrl-C lets them finish their trial, the second aborts."""

    def __init__(self) -> None:
        self.count = 0
        self.previous: Any = None

    def __enter__(self) -> "_ParentInterrupt":
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.signal(signal.SIGINT, self.previous)

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count == 1:
            console.print("[yellow]stopping after the current trial (Ctrl-C again to abandon it)[/]")
            return
        raise KeyboardInterrupt


def tune(
    op: Optional[list[str]] = typer.Option(None, "--op", help="Op(s) to tune, repeatable or comma-separated "
                                           "(default: every registered op). 'module:attr' names an Op object."),
    shapes: Optional[list[str]] = typer.Option(None, "--shapes", help="Problems instead of the sweep, repeatable: "
                                               "M values to keep ('64,128'), sizes ('M=64,N=64,K=64') "
                                               "or problem keys."),
    world: Optional[list[str]] = typer.Option(None, "--world", help="World size(s), repeatable or comma-separated "
                                              "(default: every local GPU, or 2 CPU ranks)."),
    mode: Optional[str] = typer.Option(None, help="Timing mode the search minimises: graph (default on GPUs) "
                                       "or eager (the only one on CPU). Every available mode is recorded."),
    trials: Optional[int] = typer.Option(None, help="Measured trials per problem, across runs and workers "
                                         "(default: 16 on GPUs, 2 on CPU)."),
    storage: Optional[str] = typer.Option(None, help="Optuna storage URL (default: sqlite file <db stem>.optuna.db "
                                          "beside --db). Several hosts on one study: postgresql://user@host/db."),
    db: Path = typer.Option(Path("tuning_db/autofuse.db"), help="Measurement database (SQLite)."),
    sweep: Optional[str] = typer.Option(None, help="Problem set: cpu, gpu or llama70b "
                                        "(default: gpu with GPUs, else cpu)."),
    reps: Optional[int] = typer.Option(None, help="Timed batches per measurement (default: 15 GPU, 3 CPU)."),
    budget: Optional[float] = typer.Option(None, help="Seconds one trial may take before it is failed as too slow."),
    time_limit: Optional[float] = typer.Option(None, help="Minutes: no new trial starts after this."),
    seed: int = typer.Option(0, help="Seed of inputs and sampler."),
    quiet: bool = typer.Option(False, help="No progress output, only the summary table."),
) -> None:
    """Tune every fused variant's config per problem with Optuna; resumable, Ctrl-C stops cleanly."""
    from autofuse.world import RankFailed, default_device_kind, gpu_count, init_from_env, spawn

    if _torchrun() and default_device_kind() == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when Triton is first imported
    from autofuse.tune import Settings, tune_rank

    try:
        worlds = [int(w) for w in _split(world)]
    except ValueError:
        raise typer.BadParameter(f"--world takes integers, not {world}") from None
    settings = Settings(db=str(db.absolute()), ops=_split(op), sweep=sweep or "", shapes=list(shapes or []),
                        worlds=worlds, mode=mode, trials=trials, storage=storage, reps=reps, budget_s=budget,
                        seed=seed, time_limit_s=time_limit * 60 if time_limit else None, verbose=not quiet)
    job_timeout = (time_limit * 60 + 7200) if time_limit else 7 * 86400.0
    if _torchrun():
        import torch.distributed as dist

        w = init_from_env(timeout_s=job_timeout)
        try:
            summary = tune_rank(w, settings)
        finally:
            w.close()
            dist.destroy_process_group()
        if w.rank == 0:
            render(summary)
        return
    kind = default_device_kind()
    n = max(worlds) if worlds else (gpu_count() if kind == "cuda" else 2)
    if kind == "cuda" and n > gpu_count():
        raise typer.BadParameter(f"--world {n} needs {n} GPUs; {gpu_count()} are visible")
    with _ParentInterrupt() as interrupt:
        try:
            results = spawn(tune_rank, n, settings, device_kind=kind, timeout_s=job_timeout)
        except (RankFailed, KeyboardInterrupt) as exc:
            if interrupt.count:
                console.print("[yellow]interrupted: measured trials are stored; rerun the same command to resume[/]")
                sys.exit(130)
            console.print(f"[red]tuning failed: {exc}[/]")
            sys.exit(1)
    render(results[0])
    console.print(f"database: {settings.db}")


def register(app: typer.Typer) -> None:
    app.command("tune")(tune)
