"""The engine model (pure, clock passed in) and the ``isocost engine`` HTTP server.

The package root exports only the pure model, so that the cluster simulator can import it
without pulling in aiohttp; the server lives in ``isocost.engine.server``.
"""

from isocost.engine.kvcache import BlockPool
from isocost.engine.model import EngineModel, prefill_floor_s
from isocost.engine.records import (
    EngineCounters,
    EngineEvent,
    EngineObservation,
    Finished,
    FirstToken,
    Preempted,
    RequestSpec,
    RequestState,
)

__all__ = [
    "BlockPool",
    "EngineCounters",
    "EngineEvent",
    "EngineModel",
    "EngineObservation",
    "Finished",
    "FirstToken",
    "Preempted",
    "RequestSpec",
    "RequestState",
    "prefill_floor_s",
]
