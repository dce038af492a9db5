"""Every output path a command writes, checked before the command starts its work.

A run that can only fail at its end (a folder for a file, a missing parent, a plot format
matplotlib cannot write) is refused at once, in one line, so that no long run ends in a
traceback and no first file is left behind claiming a success the second one lacks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from isocost.cli._app import fail

__all__ = ["check_outputs"]


def check_outputs(
    *,
    files: Mapping[str, str | None] | None = None,
    plots: Mapping[str, str | None] | None = None,
    folders: Mapping[str, str | None] | None = None,
) -> None:
    """Each ``flag: path`` given (None: not asked for) can be written, and no two name the
    same path; else one line naming the flag, and exit 2. Folders are made here."""
    named = [
        (flag, path, kind)
        for kind, outputs in (("file", files), ("plot", plots), ("folder", folders))
        for flag, path in (outputs or {}).items()
        if path is not None
    ]
    seen: dict[str, str] = {}
    for flag, path, kind in named:
        where = os.path.abspath(path)
        if where in seen:
            fail(f"{seen[where]} and {flag} both name {path}: give each its own file")
        seen[where] = flag
        if (problem := _problem(Path(path), kind)) is not None:
            fail(f"{flag} {path}: {problem}")


def _problem(path: Path, kind: str) -> str | None:
    """Why ``path`` cannot be written as a ``kind`` (file, plot, folder), or None."""
    if kind == "folder":
        from isocost.runtime.recording import directory_problem

        return directory_problem(path)
    return _file_problem(path) or (_plot_format_problem(path) if kind == "plot" else None)


def _file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be written as a file, or None. A new file is made and removed
    again: only an open tells a read-only or virtual file system (/proc) apart, even as root."""
    try:
        if path.is_dir():
            return "is a folder, expected a file"
        if not path.parent.is_dir():
            return f"no folder {path.parent}"
        if path.exists() and not path.is_file():  # a device or a pipe: opening it may block
            return None if os.access(path, os.W_OK) else "not writable"
        existed = path.exists()
        with path.open("ab"):
            pass
        if not existed:
            path.unlink()
    except (OSError, ValueError) as exc:  # a name too long, or with a NUL, is no file either
        return getattr(exc, "strerror", None) or str(exc)
    return None


def _plot_format_problem(path: Path) -> str | None:
    """Why matplotlib would refuse ``path``'s suffix, or None (it would add ``.png`` to a
    name without one, and the run would report a file it never wrote)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    formats = sorted(FigureCanvasAgg.get_supported_filetypes())
    if path.suffix.lower().lstrip(".") in formats:
        return None
    return f"name the image's format by its suffix, one of .{', .'.join(formats)}"
