"""`autofuse merge OUT.db IN.db...`: one measurement database from several tuning hosts' databases."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List

import typer
from rich.console import Console

console = Console()
errors = Console(stderr=True)


def merge(
    out: Path = typer.Argument(..., metavar="OUT.db", help="Database to merge into (created if missing; its rows are kept)."),
    inputs: List[Path] = typer.Argument(..., metavar="IN.db...", help="Host databases to read (opened read-only, never changed)."),
    as_json: bool = typer.Option(False, "--json", help="Print the counts as JSON instead of text."),
) -> None:
    """Merge tuning databases (e.g. one per host sharing a PostgreSQL Optuna study) so that `autofuse fit`
    sees every host's rows. Environments, problems and configs are copied once. A measurement is skipped
    when OUT already holds the same trial (same study, trial and mode) or the identical row (same
    problem, config, environment, mode, source, time and latency); two real measurements of one config
    are both kept (fit and dispatch use the faster; a failure in either keeps the config out)."""
    from autofuse.measure.store import Store, StoreError

    def fail(text: str) -> None:
        errors.print(f"autofuse merge: {text}", style="red", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1)

    try:
        target = Store.open(out, fingerprint={})
    except StoreError as exc:
        fail(str(exc))
    report = []
    try:
        for path in inputs:
            if path.exists() and out.exists() and path.resolve() == out.resolve():
                report.append({"input": str(path), "skipped": "it is the output"})
                continue
            try:
                source = Store.open(path, readonly=True, fingerprint={})
            except StoreError as exc:
                fail(str(exc))
            try:
                report.append({"input": str(path), **target.merge_from(source)})
            finally:
                source.close()
    finally:
        target.close()
    if as_json:
        typer.echo(json.dumps({"out": str(out), "inputs": report}, indent=2))
        return
    for r in report:
        if "skipped" in r:
            console.print(f"{r['input']}: skipped ({r['skipped']})", markup=False, highlight=False)
            continue
        console.print(f"{r['input']}: {r['added']} of {r['rows']} measurements added, {r['same_trial']} already "
                      f"there as the same trial, {r['identical']} identical copies skipped",
                      markup=False, highlight=False, soft_wrap=True)
    console.print(f"merged into {out}", markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    app.command("merge")(merge)
