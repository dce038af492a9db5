"""``queue-scorer``: a shorter waiting queue scores higher (llm-d's queue scorer).

Formula: ``(max - q_r) / (max - min)`` over the candidates (all equal: 1), ``q_r`` the
requests waiting for prefill on replica ``r`` (engine ``num_requests_waiting`` from fresh
scrapes, plus what this caller dispatched that has not started streaming). Source: llm-d
inference scheduler, ``pkg/epp/scheduling/framework/plugins/scorer/queue.go``.
Parameters: none.
"""

from __future__ import annotations

from typing import ClassVar

from isocost.scheduling.interface import Context
from isocost.scheduling.plugins._base import NoParams, PluginKind, low_is_better
from isocost.scheduling.timing import FloatArray

TYPE = "queue-scorer"


class QueueScorer:
    type_name: ClassVar[str] = TYPE
    kind: ClassVar[PluginKind] = "scorer"

    def __init__(self, params: NoParams | None = None) -> None:
        del params

    def score(self, ctx: Context) -> FloatArray:
        return low_is_better(ctx.load.waiting)
