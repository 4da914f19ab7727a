"""The `autofuse` command line: every public module in autofuse/commands adds its commands.

Help texts are plain text (rich_markup_mode=None): install hints such as `pip install
'autofuse[plot]'` print as written instead of losing their `[plot]` to rich markup.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Optional

import typer

import autofuse.commands

app = typer.Typer(
    help="autofuse: tune, fit and dispatch fused multi-GPU kernels vs bulk-synchronous execution.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    """Runs while the command line is parsed, so `autofuse --version` needs no command."""
    if value:
        from autofuse import __version__

        typer.echo(f"autofuse {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Optional[bool] = typer.Option(None, "--version", help="Print the version and exit.", is_eager=True,
                                           callback=_print_version),
) -> None:
    """autofuse: tune, fit and dispatch fused multi-GPU kernels vs bulk-synchronous execution."""


for _info in sorted(pkgutil.iter_modules(autofuse.commands.__path__), key=lambda m: m.name):
    if not _info.name.startswith("_"):  # _common: helpers, not commands
        importlib.import_module(f"autofuse.commands.{_info.name}").register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
