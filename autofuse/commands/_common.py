"""What every command shares: consoles that print foreign text as written, one-line failures and safe
output files (the tables they print: autofuse.bench.tables).

Consoles here have rich markup off: error texts from gloo ("[/...]"), trial errors, paths and
install hints such as `pip install 'autofuse[plot]'` print exactly as written; style comes from the
`style=` argument, never from markup in the text.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import NoReturn, Sequence

import typer
from rich.console import Console

from autofuse.core.modes import DISPLAY_ORDER
from autofuse.core.settings import DEFAULT_DB

MODE_ORDER = DISPLAY_ORDER
SHIPPED_DB_DIR = Path(__file__).resolve().parents[2] / "tuning_db"


def console_for(stderr: bool = False) -> Console:
    """A console with markup and highlighting off (stdout, or stderr for notes and errors)."""
    return Console(stderr=stderr, markup=False, highlight=False)


out = console_for()
notes = console_for(stderr=True)  # notes and errors: stdout stays machine-readable with --json


def fail(text: str, code: int = 1) -> NoReturn:
    """Print one line (as written, in red) on stderr and exit with `code`."""
    notes.print(text, style="red", soft_wrap=True)
    raise typer.Exit(code)


def note(text: str, style: str = "yellow") -> None:
    notes.print(text, style=style, soft_wrap=True)


def missing_db(db: Path) -> NoReturn:
    """Fail for a database that does not exist, naming what could be read instead."""
    hint = "run `autofuse tune` first, or pass --db"
    legacy = Path("tuning_db/autofuse.db")
    if db == DEFAULT_DB and legacy.is_file():
        hint += f" (an earlier autofuse wrote its default database to {legacy}: --db {legacy})"
    shipped = sorted(SHIPPED_DB_DIR.glob("*.db")) if SHIPPED_DB_DIR.is_dir() else []
    if shipped:
        hint += "; shipped GPU measurements: " + ", ".join(f"--db {_shown(p)}" for p in shipped)
    fail(f"no tuning database at {db}: {hint}")


def _shown(path: Path) -> str:
    """`path` relative to the current folder where it lies inside it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def order_modes(modes: Sequence[str]) -> list[str]:
    return sorted(set(modes), key=lambda m: (MODE_ORDER.index(m) if m in MODE_ORDER else len(MODE_ORDER), m))


# ---------------------------------------------------------------------------------------------
# output files


class OutputExists(FileExistsError):
    """An output file exists and --force was not given."""


def not_a_file(path: Path) -> str | None:
    """Why `path` cannot be an output file (a folder, a device, a FIFO, a socket, a link to one or a link to
    nothing), None if it is a regular file or does not exist. `--force` replaces regular files only."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):  # writing would create the missing target somewhere else
            return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist; name the file itself"
        return None
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    if stat.S_ISDIR(mode):
        return f"{path} is a directory; name a file"
    if not stat.S_ISREG(mode):
        return f"{path} is not a regular file (a device, FIFO or socket); name a file"
    return None


def write_new(path: Path, text: str | bytes, force: bool = False) -> Path:
    """Write `text` (str or bytes) to `path`, creating folders; an existing file is replaced only with `force`.

    Without `force` the file is created exclusively (no race with another writer); with it, the
    text goes to a temporary file beside `path` that then replaces it (never half-written). Anything
    but a regular file at `path` (a device such as /dev/null, a FIFO, a folder) is never replaced.
    """
    path = Path(path)
    why = not_a_file(path)
    if why:
        raise OutputExists(why)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode("utf-8") if isinstance(text, str) else text
    if not force:
        try:
            with open(path, "xb") as f:
                f.write(data)
        except FileExistsError:
            raise OutputExists(f"{path} exists; pass --force to replace it, or --out to write elsewhere") from None
        return path
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_new(paths: Sequence[Path], force: bool) -> None:
    """Fail (one line) before any work if an output exists and --force was not given, or is not a regular
    file (never replaced, whatever --force says)."""
    for p in paths:
        why = not_a_file(Path(p))
        if why:
            fail(why)
        if not force and Path(p).exists():
            fail(f"{p} exists; pass --force to replace it, or --out to write elsewhere")
