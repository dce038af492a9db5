"""The one Typer app, its consoles, and the CLI's one way to report bad input."""

from __future__ import annotations

import sys
from typing import NoReturn

import typer
from rich.console import Console

from isocost import __version__
from isocost.core.errors import IsocostError

app = typer.Typer(
    name="isocost",
    help="Cost-aware load balancer, scheduler and capacity planner for LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # Click's plain help: readable at 80 columns and in pipes
)
console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one line to stderr and exit: the CLI's only way to report bad input."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit."),
) -> None:
    if version:
        console.print(__version__)
        raise typer.Exit(0)


def main() -> None:
    try:
        app()
    except IsocostError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
