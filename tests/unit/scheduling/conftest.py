"""Fixtures for scheduling tests: real cost models from the built-in catalog."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.scheduling.contract import ReplicaSpec
from isocost.scheduling.state import ReplicaSet

MODEL = "llama-3.1-8b"
Factory = Callable[..., ReplicaSet]


def cost_model(gpu: str, model: str = MODEL, tensor_parallel: int = 1) -> CostModel:
    catalog = Catalog.builtin()
    return CostModel(catalog.model(model), catalog.gpu(gpu), tensor_parallel)


@pytest.fixture
def make_replicas() -> Factory:
    """``make_replicas(["a100-80g", "h100-80g"], factor_alpha=0.0)``: replicas r0, r1, ..."""

    def make(gpus: Sequence[str], *, max_queue: int = 128, **kwargs: object) -> ReplicaSet:
        replicas = ReplicaSet(**kwargs)  # type: ignore[arg-type]
        for i, gpu in enumerate(gpus):
            replicas.add(ReplicaSpec(f"r{i}", MODEL, cost_model(gpu), max_queue=max_queue))
        return replicas

    return make
