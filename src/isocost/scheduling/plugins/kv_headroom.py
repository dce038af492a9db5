"""``kv-headroom-filter``: drops replicas whose KV cache is nearly full.

Formula: keep ``r`` when ``kv_usage_r <= max_kv_usage`` (``kv_usage_r`` as in the
``kv-cache-utilization-scorer``). A replica past it would queue or preempt the new
request. If every candidate is past it the engine ignores the filter rather than fail.
Parameters: ``max_kv_usage`` (0..1, default 0.95).
"""

from __future__ import annotations

from typing import ClassVar

import msgspec
import numpy as np
import numpy.typing as npt

from isocost.scheduling.interface import Context
from isocost.scheduling.plugins._base import PluginKind

TYPE = "kv-headroom-filter"


class Params(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    max_kv_usage: float = 0.95


class KvHeadroomFilter:
    type_name: ClassVar[str] = TYPE
    kind: ClassVar[PluginKind] = "filter"

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or Params()
        if not 0.0 <= self.params.max_kv_usage <= 1.0:
            raise ValueError("max_kv_usage must be in [0, 1]")

    def filter(self, ctx: Context) -> npt.NDArray[np.bool_]:
        return np.asarray(ctx.load.kv_usage <= self.params.max_kv_usage, dtype=bool)
