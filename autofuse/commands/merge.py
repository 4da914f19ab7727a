"""`autofuse merge OUT.db IN.db...`: one measurement database from several tuning hosts' databases."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, List, NoReturn

import typer
from rich.console import Console

from autofuse.commands._common import not_a_file

console = Console()
errors = Console(stderr=True)


def merge(
    out: Path = typer.Argument(..., metavar="OUT.db", help="Database to merge into (created if missing; its rows are kept)."),
    inputs: List[Path] = typer.Argument(..., metavar="IN.db...", help="Host databases to read (opened read-only, never changed)."),
    as_json: bool = typer.Option(False, "--json", help="Print the counts as JSON instead of text."),
) -> None:
    """Merge tuning databases (e.g. one per host sharing a PostgreSQL Optuna study) so that `autofuse fit`
    sees every host's rows. Environments, problems and configs are copied once. A measurement OUT already
    holds (same problem, config, environment, mode, verdict, latency and time) is skipped; every other one is
    added, so two real measurements of one config are both kept (fit and dispatch use the faster; a failure in
    either keeps the config out). Independent runs number their trials alike: a trial whose study and number
    OUT already holds for another measurement is kept under the study name '<study>#<tag>'. Every input is
    opened and checked before OUT is touched: a missing or foreign input changes nothing and creates no file;
    an input that is OUT itself is skipped (with no other input, OUT is not even opened)."""
    from autofuse.measure.store import Store, StoreError

    def fail(text: str) -> NoReturn:
        errors.print(f"autofuse merge: {text}", style="red", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1)

    why = not_a_file(out)
    if why:
        fail(why)
    sources: list[tuple[Path, Any]] = []
    try:
        for path in inputs:
            if path.exists() and out.exists() and os.path.samefile(path, out):
                sources.append((path, None))
                continue
            try:
                sources.append((path, Store.open(path, readonly=True, fingerprint={})))
                sources[-1][1].check_rows()
            except StoreError as exc:
                fail(str(exc))
        report = _merge_into(out, sources, fail)
    finally:
        for _, source in sources:
            if source is not None:
                source.close()
    if as_json:
        typer.echo(json.dumps({"out": str(out), "inputs": report}, indent=2))
        return
    for r in report:
        if "skipped" in r:
            console.print(f"{r['input']}: skipped ({r['skipped']})", markup=False, highlight=False)
            continue
        renamed = (f" ({r['renamed']} of them trials whose study and number another run already used in {out}: "
                   "kept under '<study>#<tag>')") if r["renamed"] else ""
        console.print(f"{r['input']}: {r['added']} of {r['rows']} measurements added{renamed}, {r['identical']} "
                      "already there (identical)", markup=False, highlight=False, soft_wrap=True)
    console.print(f"merged into {out}", markup=False, highlight=False)


def _merge_into(out: Path, sources: list[tuple[Path, Any]], fail: Callable[[str], NoReturn]) -> list[dict]:
    """Merge every opened source into `out` (None: the input is `out` itself); a new `out` is removed
    again (with SQLite's side files) if the merge fails."""
    from autofuse.measure.store import Store, StoreError

    if all(source is None for _, source in sources):  # nothing to read but OUT itself: OUT is not opened
        return [{"input": str(path), "skipped": "it is the output"} for path, _ in sources]
    created = not out.exists()
    ok = False
    try:
        try:
            target = Store.open(out, fingerprint={})
        except StoreError as exc:
            fail(str(exc))
        try:
            report = []
            for path, source in sources:
                if source is None:
                    report.append({"input": str(path), "skipped": "it is the output"})
                else:
                    report.append({"input": str(path), **target.merge_from(source)})
        finally:
            target.close()
        ok = True
        return report
    finally:
        if created and not ok:
            for suffix in ("", "-wal", "-shm", "-journal"):
                Path(f"{out}{suffix}").unlink(missing_ok=True)


def register(app: typer.Typer) -> None:
    app.command("merge")(merge)
