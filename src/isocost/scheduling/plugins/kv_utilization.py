"""``kv-cache-utilization-scorer``: more free KV cache scores higher (llm-d).

Formula: ``1 - kv_usage_r``, ``kv_usage_r`` in [0, 1] the larger of the engine's scraped
KV usage (faded by staleness) and this caller's own estimate (prompt plus generated
tokens in flight over the KV capacity). Source: llm-d inference scheduler,
``pkg/epp/scheduling/framework/plugins/scorer/kvcache_utilization.go``. Parameters: none.
"""

from __future__ import annotations

from typing import ClassVar

from isocost.scheduling.interface import Context
from isocost.scheduling.plugins._base import NoParams, PluginKind
from isocost.scheduling.timing import FloatArray

TYPE = "kv-cache-utilization-scorer"


class KvCacheUtilizationScorer:
    type_name: ClassVar[str] = TYPE
    kind: ClassVar[PluginKind] = "scorer"

    def __init__(self, params: NoParams | None = None) -> None:
        del params

    def score(self, ctx: Context) -> FloatArray:
        return 1.0 - ctx.load.kv_usage
