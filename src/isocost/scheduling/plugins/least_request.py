"""``least-request-scorer``: fewer requests in flight scores higher.

Formula: min-max normalised, ``(max - n_r) / (max - min)`` over the candidates (all
equal: 1), where ``n_r`` = requests waiting plus running on replica ``r`` (this caller's
shadow state plus other gateways' load from fresh scrapes). Counts requests, not work:
the baseline equal-cost is measured against. Parameters: none.
"""

from __future__ import annotations

from typing import ClassVar

from isocost.scheduling.interface import Context
from isocost.scheduling.plugins._base import NoParams, PluginKind, low_is_better
from isocost.scheduling.timing import FloatArray

TYPE = "least-request-scorer"


class LeastRequestScorer:
    type_name: ClassVar[str] = TYPE
    kind: ClassVar[PluginKind] = "scorer"

    def __init__(self, params: NoParams | None = None) -> None:
        del params

    def score(self, ctx: Context) -> FloatArray:
        return low_is_better(ctx.load.in_flight)
