"""Fixtures shared by the integration suites."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kube_api import KubeApi
from process_fixtures import procs

__all__ = ["kube", "procs"]


@pytest.fixture
def kube() -> Iterator[KubeApi]:
    """The small Kubernetes API server (``kube_api``), on a random port."""
    api = KubeApi()
    api.start()
    yield api
    api.close()
