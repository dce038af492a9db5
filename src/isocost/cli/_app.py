"""The one Typer app, its consoles, and the CLI's one way to report bad input."""

from __future__ import annotations

import sys
from typing import NoReturn

import typer
from rich.console import Console
from rich.text import Text

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
    _print_error(message)
    raise typer.Exit(code)


def _print_error(message: str) -> None:
    """One line, the message as typed: brackets and ":x:" in a user's input stay text, and
    a message of several lines (a YAML parser's, with its excerpt) is joined into one."""
    text = Text.assemble(("error:", "bold red"), " ", " ".join(message.split()))
    err_console.print(text, highlight=False, soft_wrap=True, emoji=False)


def _print_version(version: bool) -> None:
    """Eager: ``isocost --version`` alone prints it, without asking for a command."""
    if version:
        console.print(__version__)
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,
        callback=_print_version,
        help="Print the version and exit.",
    ),
) -> None:
    pass


def main() -> None:
    try:
        app()
    except IsocostError as exc:
        _print_error(str(exc))
        sys.exit(2)
