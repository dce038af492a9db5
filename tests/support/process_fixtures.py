"""The ``procs`` fixture, for every suite that starts `isocost` processes: import it into
a conftest or a test module (``from process_fixtures import procs``)."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from isocost_procs import Proc

__all__ = ["procs"]


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes a test starts (append them); SIGKILLed, newest first, when it ends."""
    started: list[Proc] = []
    yield started
    for proc in reversed(started):
        proc.stop(signal.SIGKILL)
