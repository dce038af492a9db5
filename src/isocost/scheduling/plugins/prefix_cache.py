"""``prefix-cache-scorer``: the share of the prompt's blocks already cached there (llm-d).

Formula: ``matched_blocks_r / total_blocks`` where ``matched_blocks_r`` is the longest run
of the request's chained block hashes, from the first, that the prefix index holds for
replica ``r`` (what was routed there, LRU-bounded by its KV capacity); 0 for a prompt
shorter than one block. Source: llm-d inference scheduler's prefix-cache scorer
(``pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go``). Parameters: none.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from isocost.scheduling.interface import Context
from isocost.scheduling.plugins._base import NoParams, PluginKind
from isocost.scheduling.timing import FloatArray

TYPE = "prefix-cache-scorer"


class PrefixCacheScorer:
    type_name: ClassVar[str] = TYPE
    kind: ClassVar[PluginKind] = "scorer"

    def __init__(self, params: NoParams | None = None) -> None:
        del params

    def score(self, ctx: Context) -> FloatArray:
        total = len(ctx.request.block_hashes)
        if total == 0:
            return np.zeros(ctx.idx.size)
        return ctx.cached_blocks / total
