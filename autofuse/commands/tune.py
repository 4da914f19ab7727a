"""`autofuse tune`: Optuna search of the tunable variants' configs, every measurement into SQLite."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, NoReturn, Optional

import typer
from rich.console import Console

from autofuse.core.settings import DEFAULT_DB

console = Console()
errors = Console(stderr=True)

CPU_INTRO = (
    "No GPU here, so this is the CPU emulation: each rank is a process, the real Triton kernels run under "
    "Triton's interpreter, gloo carries the collectives and a shared-memory file stands in for the GPUs' "
    "symmetric heap. It checks that every tuned variant matches the float64 reference, and records each "
    "measurement, as the first step of the tune -> fit -> dispatch loop, on small problems. Its timings are "
    "the interpreter's, not a GPU's: they say nothing about which variant is faster on GPUs, so no speedup "
    "is shown.")
ONE_GPU = (
    "One GPU: world size 1, where there is nothing to communicate: each problem's baselines are measured "
    "(the base of strong scaling, `--world 1,2 --sweep scaling` on two GPUs) and nothing is tuned. What one GPU "
    "cannot tell: which variant is faster with 2 or more GPUs; tune on the GPUs you will run on.")


def next_steps(db: Path, kind: str) -> str:
    """What to run after this tune, with its --db (omitted where it is the default)."""
    where = "" if db == DEFAULT_DB else f" --db {db}"
    mode = " --mode eager" if kind == "cpu" else ""
    text = (f"Next: `autofuse show{where}` lists these rows again, `autofuse fit{where}{mode}` fits a dispatch "
            "policy on them and writes it where dispatch finds it.")
    if kind == "cpu":
        text += (" On a machine with GPUs, `autofuse tune` tunes on every local GPU (graph and eager modes, the "
                 "default sweep of every op, budgeted: 4 min of tuning by default, --time-limit to change it).")
    return text


def say(text: str, style: str | None = None) -> None:
    """Print plain text (never parsed as markup: problem keys and errors hold brackets)."""
    console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)


def fail(text: str, code: int = 1) -> NoReturn:
    """One line on stderr, then exit."""
    errors.print(f"autofuse tune: {text}", style="red", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _split(values: Optional[list[str]], sep: str = ",") -> list[str]:
    return [v.strip() for item in values or [] for v in item.split(sep) if v.strip()]


def run_line(stats: dict) -> str:
    """The run's throughput: trials, trials per second, and the share of wall time the ranks spent timing
    (the GPUs at work) and compiling and checking kernels; what compiling ahead did."""
    wall = max(float(stats.get("wall_s", 0.0)), 1e-9)
    trials = int(stats.get("trials", 0))
    text = (f"{trials} trials ({int(stats.get('screened_out', 0))} rejected on a short screen), "
            f"{int(stats.get('baselines', 0))} baselines, {int(stats.get('confirmed', 0))} outliers re-measured in "
            f"turns in {wall:.0f} s: {trials / wall:.2f} trials/s; timing {100 * stats.get('timing_s', 0.0) / wall:.0f}% "
            f"of the wall time, compiling and checking {100 * stats.get('build_check_s', 0.0) / wall:.0f}%")
    if "compiled" in stats:
        text += (f"; compiled ahead: {int(stats['compiled'])} of {int(stats.get('compile_submitted', 0))} configs "
                 f"({int(stats.get('compile_sampled', 0))} sampled, asked ahead in the search; "
                 f"{int(stats.get('compile_failed', 0))} failed, {int(stats.get('compile_skipped', 0))} reached first)")
    return text


def coverage_line(stats: dict) -> str:
    """Problems covered per op (baselines and the previous winner, else every tunable variant's first default,
    measured)."""
    per = stats.get("coverage") or {}
    return "covered: " + ", ".join(f"{op} {done}/{total} problems" for op, (done, total) in per.items())


def render(result: dict) -> None:
    """The table of `autofuse show` for what this run tuned: per op, each problem's best latency per
    variant, the best, x BSP and x alt (latencies only for the CPU emulation); then the run's
    coverage and throughput."""
    from autofuse.bench.tables import print_problems, problem_table
    from autofuse.measure.compare import interpreted

    summary, stats = result.get("rows", []), result.get("stats", {})
    if not summary:
        say("nothing was tuned")
    else:
        rows = [{"problem": r["problem"], "op": r["op"], "variant": v, "median_us": t,
                 "config": r["configs"].get(v, {}), "extra": {"confirmed": r.get("confirmed", {}).get(v, False)}}
                for r in summary for v, t in r["variants_us"].items()]
        print_problems(console, problem_table(rows, interpreted(summary[0]["device_kind"])), summary[0]["mode"])
    if stats:
        say(coverage_line(stats))
        say(run_line(stats))


def _torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _check_writable(options: Any) -> None:
    """Open the database and Optuna's storage for writing before any rank starts (one line if not)."""
    from autofuse.measure.store import Store, StoreError
    from autofuse.tuning.progress import first_line
    from autofuse.tuning.storage import check_writable, open_storage

    try:
        Store.open(options.db, fingerprint={}).close()
    except StoreError as exc:
        fail(f"cannot use the database: {exc}")
    try:
        check_writable(open_storage(options.storage_url()))
    except Exception as exc:  # noqa: BLE001 - SQLAlchemy / driver errors: the first line says it
        fail(f"cannot write the Optuna storage {options.storage_url()}: {first_line(str(exc), 300)}")


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
                                         "(default: up to 32 on GPUs within the time limit; on CPU one per "
                                         "tunable variant). Given without --time-limit: exactly that many, no limit."),
    storage: Optional[str] = typer.Option(None, help="Optuna storage URL (default: sqlite file <db stem>.optuna.db "
                                          "beside --db). Several hosts on one study: postgresql://user@host/db."),
    db: Path = typer.Option(DEFAULT_DB, help="Measurement database (SQLite; created if missing)."),
    sweep: Optional[str] = typer.Option(None, help="Problem set: default (every op's mix of model shapes and the "
                                        "papers' sweeps), models, gpu, llama70b, scaling (the same global problems at "
                                        "every --world: strong scaling), train (ag_gemm, gemm_rs: the forward and backward "
                                        "GEMMs of a sequence-parallel training step of Llama-3 70B and 8B), fp8 (ag_gemm, "
                                        "gemm_ar, gemm_rs: the default problems in FP8, both scalings), cpu, or stored "
                                        "(the problems --db holds for this hardware and --world, measured with any code "
                                        "of their op: after a code change, a re-tune of a table that re-measures each "
                                        "problem's previous winners first; every stored problem unless --limit) "
                                        "(default: default with GPUs, else cpu)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N problems of each op per world size "
                                        "(0: every problem; default: 2 on CPU, every problem on GPUs and with --sweep stored)."),
    reps: Optional[int] = typer.Option(None, help="Timed batches per measurement (default: 10 GPU, 5 CPU)."),
    budget: Optional[float] = typer.Option(None, help="Seconds one trial may take before it is failed as too slow."),
    time_limit: Optional[float] = typer.Option(None, help="Minutes: no new trial starts after this (default on "
                                               "GPUs: 4, the scheduler deciding how deep to go; none on CPU or "
                                               "with --trials; 0: none). Every op is covered first, and the first "
                                               "problem of each op always completes."),
    compile_workers: Optional[int] = typer.Option(None, "--compile-workers", help="Processes compiling the "
                                                  "run's known-good configs ahead of their measurement (default "
                                                  "on GPUs: the idle cores, up to 8; 0: off; CPU: off)."),
    seed: int = typer.Option(0, help="Seed of inputs and sampler."),
    quiet: bool = typer.Option(False, help="No progress output, only the summary table."),
) -> None:
    """Tune every hybrid and fused variant's config per problem with Optuna; resumable. Every op is covered first
    (baselines and each variant's first default, problem by problem), then the other defaults, then a search where
    it matters most; on GPUs the run is budgeted (--time-limit). After a change to an op's code, the configs that
    won with the older code (rows in --db) are measured first, each problem's winner in its coverage. SIGINT /
    SIGTERM finish the current trial and exit 130 / 143 (a second one abandons the trial)."""
    ops = _split(op)
    if not quiet and os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the job
        say(f"autofuse tune: {', '.join(ops) if ops else 'every op'} into {db}; finding GPUs and reading the sweeps")
    try:
        _run(ops, world, options_args=dict(sweep=sweep or "", shapes=list(shapes or []), mode=mode, trials=trials,
                                            storage=storage, reps=reps, budget_s=budget, seed=seed, limit=limit,
                                            compile_workers=compile_workers,
                                            time_limit_s=time_limit * 60 if time_limit is not None else None,
                                            verbose=not quiet), db=db, quiet=quiet)
    except KeyboardInterrupt:  # before the ranks started, or a torchrun rank's second signal
        from autofuse.tuning.lifecycle import STOP

        errors.print("autofuse tune: interrupted; what was measured is stored", style="yellow", markup=False)
        raise typer.Exit(STOP.exit_code() or 130) from None


def _run(ops: list[str], world: Optional[list[str]], options_args: dict, db: Path, quiet: bool) -> None:
    """The command after its first line: validate, plan, check the database, spawn the ranks, report."""
    from autofuse.comm.world import RankFailed, default_device_kind, gpu_count

    kind = default_device_kind()
    if kind == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when Triton is first imported (torchrun ranks)
    from autofuse.tuning.tune import SetupError, TuneOptions, describe_plan, make_plan, tune_rank

    try:
        worlds = [int(w) for w in _split(world)]
    except ValueError:
        fail(f"--world takes integers, not {', '.join(world or [])}", 2)
    options = TuneOptions(db=str(db.absolute()), ops=ops, worlds=worlds, **options_args)
    limit_s = options.time_limit_for(kind)
    job_timeout = (limit_s + 7200) if limit_s else 7 * 86400.0
    if _torchrun():
        _tune_torchrun(options, job_timeout)
        return
    visible = gpu_count() if kind == "cuda" else 0
    n = max(worlds) if worlds else (visible if kind == "cuda" else 2)
    try:
        options.validate(kind, visible if kind == "cuda" else n)
        plan = make_plan(options, kind, n)
    except (ValueError, KeyError, ImportError, AttributeError) as exc:
        fail(str(exc).strip("'\""), 2)
    if not quiet:
        say(describe_plan(plan, options, n))
        if kind == "cpu":
            say(CPU_INTRO)
        elif plan.worlds == [1]:
            say(ONE_GPU)
    _check_writable(options)
    from autofuse.tuning.lifecycle import Supervisor
    from autofuse.comm.world import spawn

    if not quiet:
        say(f"starting {n} rank{'s' if n > 1 else ''} (each imports torch and Triton first)")
    t0 = time.monotonic()
    with Supervisor(say=lambda text: say(text, "yellow")) as supervisor:
        try:
            results = spawn(tune_rank, n, options, supervisor.link(), device_kind=kind, timeout_s=job_timeout,
                            start_method="spawn")  # ranks are this process's children: they die with it
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
    if not quiet:
        say(next_steps(db, kind))
    say(f"database: {options.db} ({time.monotonic() - t0:.0f} s)")
    code = supervisor.exit_code()
    if code is not None:
        say("interrupted: measured trials are stored; rerun the same command to resume", "yellow")
        raise typer.Exit(code)


def _tune_torchrun(options: Any, job_timeout: float) -> None:
    """Under torchrun: join the job's ranks; every rank handles its own SIGINT / SIGTERM."""
    import torch.distributed as dist

    from autofuse.tuning.lifecycle import STOP
    from autofuse.tuning.tune import tune_rank
    from autofuse.comm.world import init_from_env

    w = init_from_env(timeout_s=job_timeout)
    try:
        result = tune_rank(w, options)
    except ValueError as exc:
        fail(str(exc), 2)
    finally:
        w.close()
        dist.destroy_process_group()
    if w.rank == 0:
        render(result)
    code = STOP.exit_code()
    if code is not None:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("tune")(tune)

