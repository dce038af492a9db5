"""Fixtures shared by the integration suites."""

from __future__ import annotations

from process_fixtures import procs

__all__ = ["procs"]
