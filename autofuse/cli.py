"""The `autofuse` command line: every module in autofuse/commands adds its commands."""
from __future__ import annotations

import importlib
import pkgutil

import typer

import autofuse.commands

app = typer.Typer(
    help="autofuse: tune, fit and dispatch fused multi-GPU kernels vs bulk-synchronous execution.",
    no_args_is_help=True,
    add_completion=False,
)



@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True),
) -> None:
    """autofuse: tune, fit and dispatch fused multi-GPU kernels vs bulk-synchronous execution."""
    if version:
        from autofuse import __version__

        typer.echo(__version__)
        raise typer.Exit()


for _info in sorted(pkgutil.iter_modules(autofuse.commands.__path__), key=lambda m: m.name):
    importlib.import_module(f"autofuse.commands.{_info.name}").register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
