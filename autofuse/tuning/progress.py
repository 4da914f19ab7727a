"""Rank 0's view of a tuning run: a rich progress bar on a terminal (trial, best so far, coverage per op,
time left), one line per trial otherwise, and a coverage line (problems covered per op, the time
left) whenever a problem's coverage completes. Text from outside (errors, problem keys) is printed
without markup, so a gloo message holding `[/...]` cannot break the display."""
from __future__ import annotations

import math

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from typing import Any, Mapping, Sequence

from autofuse.measure.timing import Measurement
from autofuse.core.op import Problem, config_key
from autofuse.tuning.study import Job


def first_line(text: str | None, limit: int = 100) -> str:
    """The first line of a message, cut to `limit` characters."""
    return ((text or "").strip().splitlines() or [""])[0][:limit]


class Progress:
    """A rich progress display on a terminal; plain lines in a pipe or log."""

    def __init__(self, total: int, verbose: bool):
        self.console = Console()
        self.verbose = verbose
        self.live = self.console.is_terminal and verbose
        self.bar = RichProgress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                                TextColumn("best {task.fields[best]}", markup=False),
                                TextColumn("{task.fields[covered]}", markup=False), TimeElapsedColumn(),
                                TextColumn("ETA"), TimeRemainingColumn(), console=self.console, disable=not self.live)
        self.task = self.bar.add_task("tuning", total=max(total, 1), best="-", covered="")
        self.total, self.done = total, 0
        if self.live:
            self.bar.start()

    def log(self, text: str, style: str | None = None) -> None:
        """Print one message (plain text: never parsed as markup)."""
        if self.verbose:
            (self.bar.console if self.live else self.console).print(text, style=style, markup=False,
                                                                    highlight=False, soft_wrap=True)

    def baseline(self, problem: Problem, variant: str, m: Measurement) -> None:
        what = f"{m.median_us:.1f} us" if m.ok else f"failed: {first_line(m.error)}"
        self.log(f"  baseline {problem.key} {variant}: {what}")

    def trial(self, problem: Problem, job: Job, m: Measurement | None, best: tuple[float, str],
              screened_out: bool = False) -> None:
        self.done += 1
        best_text = "-" if math.isnan(best[0]) else f"{best[0]:.1f} us ({best[1]})"
        self.bar.update(self.task, advance=1, description=f"{problem.key} #{job.trial}", best=best_text)
        if not self.live and self.verbose:
            what = (f"{m.median_us:.1f} us" if m is not None and m.ok
                    else f"failed: {first_line(m.error if m else 'not measured')}")
            if screened_out:
                what += f" (screened out: {m.reps if m else 0} reps)"
            self.log(f"[{self.done}] {problem.key} trial {job.trial} {job.variant} {config_key(job.config)}: "
                     f"{what}; best {best_text}")

    def confirmed(self, problem: Problem, candidates: Sequence[tuple[str, Any]], rows: Sequence[Measurement],
                  board: Mapping[str, float]) -> None:
        """A problem whose x BSP deviated from its neighbours': what re-measuring in turns found."""
        found = ", ".join(f"{m.variant} {m.median_us:.1f} us" if m.ok else f"{m.variant} failed" for m in rows)
        self.log(f"  re-measured in turns {problem.key} (x BSP off its neighbours'): {found or 'timing failed'}")

    def coverage(self, per_op: Mapping[str, tuple[int, int]], time_left: float | None) -> None:
        """Problems covered per op (baselines and each study's coverage: its previous winner, else every variant's
        first default) and the time left."""
        text = "covered " + ", ".join(f"{op} {done}/{total}" for op, (done, total) in per_op.items())
        if time_left is not None:
            text += f"; {time_left / 60:.1f} min left"
        self.bar.update(self.task, covered=text)
        if not self.live:
            self.log(f"  {text}")

    def expect(self, change: int) -> None:
        """Adjust the total: trials a resumed study already had, or trials a study did not need."""
        self.total = max(self.done, self.total + change)
        self.bar.update(self.task, total=max(self.total, 1))

    def close(self) -> None:
        if self.live:
            self.bar.stop()

