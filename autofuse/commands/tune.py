"""`autofuse tune`: Optuna search of the tunable variants' configs, every measurement into SQLite."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, NoReturn, Optional

import typer
from rich.console import Console
from rich.table import Table

console = Console()
errors = Console(stderr=True)

CPU_INTRO = (
    "No GPU here, so this is the CPU emulation: each rank is a process, the real Triton kernels run under "
    "Triton's interpreter, gloo carries the collectives and a shared-memory file stands in for the GPUs' "
    "symmetric heap. It checks that every tuned variant matches the float64 reference and runs the whole "
    "tune -> fit -> dispatch loop on small problems. Its timings are the interpreter's, not a GPU's: the "
    "interpreter runs a kernel element by element, so BSP (torch's own compute) wins almost everywhere, "
    "and differences of a few tens of percent are noise of a busy CPU.")
CPU_OUTRO = (
    "How to read it: one table per op, one row per problem; each variant's best latency in microseconds per "
    "call (median of the timed calls, slowest rank); bsp = collective + torch compute, torch_symm = torch's own "
    "symmetric-memory op, the others are autofuse's tuned variants (hybrid and fused kernels); x BSP = BSP's "
    "latency / the fastest tuned one (above 1: it pays). Every tuned variant was "
    "checked against the reference and timed on every problem.\n"
    "Next: `autofuse fit --mode eager` fits a dispatch policy on these rows, `autofuse show --mode eager` lists "
    "them. On a machine with GPUs, `autofuse tune` tunes on every local GPU (graph and eager modes, 8 trials "
    "per problem of the default sweep, about 10 min for all ops on two GPUs), then `autofuse fit` writes the policy that dispatch uses.")
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def say(text: str, style: str | None = None) -> None:
    """Print plain text (never parsed as markup: problem keys and errors hold brackets)."""
    console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)


def fail(text: str, code: int = 1) -> NoReturn:
    """One line on stderr, then exit."""
    errors.print(f"autofuse tune: {text}", style="red", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _split(values: Optional[list[str]], sep: str = ",") -> list[str]:
    return [v.strip() for item in values or [] for v in item.split(sep) if v.strip()]


def _short(problem: str) -> str:
    """'ag_gemm|K=64,M=4,N=32,gather=rows|bfloat16|w2' -> 'K=64,M=4,N=32,gather=rows bf16 w2'."""
    parts = problem.split("|")
    if len(parts) != 4:
        return problem
    return f"{parts[1]} {DTYPES.get(parts[2], parts[2])} {parts[3]}"


def _us(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1f}"


def render(summary: list[dict]) -> None:
    """One table per op: per problem, every variant's best latency, the best, and BSP / best tuned."""
    if not summary:
        say("nothing was tuned")
        return
    mode = summary[0]["mode"]
    by_op: dict[str, list[dict]] = {}
    for r in summary:
        by_op.setdefault(r["op"], []).append(r)
    for op, rows in by_op.items():
        variants: list[str] = []
        for r in rows:
            variants += [v for v in r.get("variants_us", {}) if v not in variants]
        variants.sort(key=lambda v: (v != "bsp", v))
        say(f"{op}: best latency per variant, us per call ({mode} mode)", "bold")
        t = Table()
        t.add_column("problem", overflow="fold")
        for v in variants:
            t.add_column(v, justify="right")
        t.add_column("best")
        t.add_column("x BSP", justify="right")
        for r in rows:
            us = r.get("variants_us", {})
            speed = (r["bsp_us"] / r["best_tuned_us"]) if r.get("bsp_us") and r.get("best_tuned_us") else None
            t.add_row(_short(r["problem"]), *[_us(us.get(v)) for v in variants], r["best_variant"] or "-",
                      "-" if speed is None else f"{speed:.2f}")
        console.print(t)
    trials = sum(r["trials_this_run"] for r in summary)
    compile_s = sum(r["compile_s"] for r in summary)
    say(f"{trials} trials measured in this run ({compile_s:.0f} s of it compiling and checking kernels)")


def _torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _check_writable(settings: Any) -> None:
    """Open the database and Optuna's storage for writing before any rank starts (one line if not)."""
    from autofuse.measure.store import Store, StoreError
    from autofuse.training.progress import first_line
    from autofuse.training.storage import check_writable, open_storage

    try:
        Store.open(settings.db, fingerprint={}).close()
    except StoreError as exc:
        fail(f"cannot use the database: {exc}")
    try:
        check_writable(open_storage(settings.storage_url()))
    except Exception as exc:  # noqa: BLE001 - SQLAlchemy / driver errors: the first line says it
        fail(f"cannot write the Optuna storage {settings.storage_url()}: {first_line(str(exc), 300)}")


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
                                         "(default: 8 on GPUs; on CPU one per tunable variant)."),
    storage: Optional[str] = typer.Option(None, help="Optuna storage URL (default: sqlite file <db stem>.optuna.db "
                                          "beside --db). Several hosts on one study: postgresql://user@host/db."),
    db: Path = typer.Option(Path("tuning_db/autofuse.db"), help="Measurement database (SQLite)."),
    sweep: Optional[str] = typer.Option(None, help="Problem set: default (every op's mix of model shapes and the "
                                        "papers' sweeps), models, gpu, llama70b, scaling (the same global problems at "
                                        "every --world: strong scaling) or cpu (default: default with GPUs, "
                                        "else cpu)."),
    reps: Optional[int] = typer.Option(None, help="Timed batches per measurement (default: 10 GPU, 5 CPU)."),
    budget: Optional[float] = typer.Option(None, help="Seconds one trial may take before it is failed as too slow."),
    time_limit: Optional[float] = typer.Option(None, help="Minutes: no new trial starts after this."),
    seed: int = typer.Option(0, help="Seed of inputs and sampler."),
    quiet: bool = typer.Option(False, help="No progress output, only the summary table."),
) -> None:
    """Tune every hybrid and fused variant's config per problem with Optuna; resumable. SIGINT / SIGTERM finish the
    current trial and exit 130 / 143 (a second one abandons the trial)."""
    ops = _split(op)
    if not quiet and os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the job
        say(f"autofuse tune: {', '.join(ops) if ops else 'every op'} into {db}; finding GPUs and reading the sweeps")
    try:
        _run(ops, world, settings_args=dict(sweep=sweep or "", shapes=list(shapes or []), mode=mode, trials=trials,
                                            storage=storage, reps=reps, budget_s=budget, seed=seed,
                                            time_limit_s=time_limit * 60 if time_limit is not None else None,
                                            verbose=not quiet), db=db, quiet=quiet)
    except KeyboardInterrupt:  # before the ranks started, or a torchrun rank's second signal
        from autofuse.training.lifecycle import STOP

        errors.print("autofuse tune: interrupted; what was measured is stored", style="yellow", markup=False)
        raise typer.Exit(STOP.exit_code() or 130) from None


def _run(ops: list[str], world: Optional[list[str]], settings_args: dict, db: Path, quiet: bool) -> None:
    """The command after its first line: validate, plan, check the database, spawn the ranks, report."""
    from autofuse.comm.world import RankFailed, default_device_kind, gpu_count

    kind = default_device_kind()
    if kind == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when Triton is first imported (torchrun ranks)
    from autofuse.training.tune import SetupError, Settings, describe_plan, make_plan, tune_rank

    try:
        worlds = [int(w) for w in _split(world)]
    except ValueError:
        fail(f"--world takes integers, not {', '.join(world or [])}", 2)
    settings = Settings(db=str(db.absolute()), ops=ops, worlds=worlds, **settings_args)
    job_timeout = (settings.time_limit_s + 7200) if settings.time_limit_s else 7 * 86400.0
    if _torchrun():
        _tune_torchrun(settings, job_timeout)
        return
    visible = gpu_count() if kind == "cuda" else 0
    n = max(worlds) if worlds else (visible if kind == "cuda" else 2)
    try:
        settings.validate(kind, visible if kind == "cuda" else n)
        plan = make_plan(settings, kind, n)
    except (ValueError, KeyError, ImportError, AttributeError) as exc:
        fail(str(exc).strip("'\""), 2)
    if not quiet:
        say(describe_plan(plan, settings, n))
        if kind == "cpu":
            say(CPU_INTRO)
    _check_writable(settings)
    from autofuse.training.lifecycle import Supervisor
    from autofuse.comm.world import spawn

    if not quiet:
        say(f"starting {n} rank{'s' if n > 1 else ''} (each imports torch and Triton first)")
    t0 = time.monotonic()
    with Supervisor(say=lambda text: say(text, "yellow")) as supervisor:
        try:
            results = spawn(tune_rank, n, settings, supervisor.link(), device_kind=kind, timeout_s=job_timeout)
        except (RankFailed, KeyboardInterrupt) as exc:
            code = supervisor.exit_code()
            if code is not None:
                say("interrupted: measured trials are stored; rerun the same command to resume", "yellow")
                raise typer.Exit(code) from None
            reason = exc.reason if isinstance(exc, RankFailed) else str(exc)
            setup = SetupError.__name__ + ": "
            line = reason.split(setup, 1)[1] if setup in reason else reason
            fail(f"rank {getattr(exc, 'rank', '?')} failed: {line.strip().splitlines()[0] if line.strip() else exc}")
    render(results[0])
    if kind == "cpu" and not quiet:
        say(CPU_OUTRO)
    say(f"database: {settings.db} ({time.monotonic() - t0:.0f} s)")
    code = supervisor.exit_code()
    if code is not None:
        say("interrupted: measured trials are stored; rerun the same command to resume", "yellow")
        raise typer.Exit(code)


def _tune_torchrun(settings: Any, job_timeout: float) -> None:
    """Under torchrun: join the job's ranks; every rank handles its own SIGINT / SIGTERM."""
    import torch.distributed as dist

    from autofuse.training.lifecycle import STOP
    from autofuse.training.tune import tune_rank
    from autofuse.comm.world import init_from_env

    w = init_from_env(timeout_s=job_timeout)
    try:
        summary = tune_rank(w, settings)
    except ValueError as exc:
        fail(str(exc), 2)
    finally:
        w.close()
        dist.destroy_process_group()
    if w.rank == 0:
        render(summary)
    code = STOP.exit_code()
    if code is not None:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("tune")(tune)

