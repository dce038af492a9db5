"""``dynamo-kv-scorer``: NVIDIA Dynamo KV router's cost, lower cost scoring higher.

Source: Dynamo ``docs/design_docs/router_design.md`` and ``lib/llm/src/kv_router/
scheduler.rs``. Per replica ``r``, in KV blocks of ``block_tokens`` tokens::

    prefill_blocks_r = (prompt_tokens - overlap_blocks_r * block_tokens) / block_tokens
    active_blocks_r  = blocks held by requests in flight on r + the request's own blocks
    cost_r           = overlap_score_weight * prefill_blocks_r + active_blocks_r

``overlap_blocks_r`` comes from the prefix index (Dynamo: its KV indexer, or the
approximate indexer fed by routing decisions as here); active blocks from this caller's
shadow state, raised to the engine's scraped KV usage when that is higher. Dynamo picks
the least cost (``router_temperature`` 0, its default); as a score:
``(max - cost_r) / (max - min)``, all equal: 1. Parameters: ``overlap_score_weight``
(float >= 0, default 1.0; 0 ignores the cache).
"""

from __future__ import annotations

from typing import ClassVar

import msgspec
import numpy as np

from isocost.scheduling.interface import Context
from isocost.scheduling.plugins._base import PluginKind, low_is_better
from isocost.scheduling.timing import FloatArray

TYPE = "dynamo-kv-scorer"


class Params(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    overlap_score_weight: float = 1.0


class DynamoKvScorer:
    type_name: ClassVar[str] = TYPE
    kind: ClassVar[PluginKind] = "scorer"

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or Params()
        if self.params.overlap_score_weight < 0:
            raise ValueError("overlap_score_weight must be >= 0")

    def score(self, ctx: Context) -> FloatArray:
        block = float(ctx.replicas.block_tokens)
        prompt = float(ctx.request.prompt_tokens)
        prefill_blocks = np.maximum(prompt - ctx.cached_blocks * block, 0.0) / block
        active_blocks = (ctx.load.kv_used_tokens + prompt) / block
        return low_is_better(self.params.overlap_score_weight * prefill_blocks + active_blocks)
