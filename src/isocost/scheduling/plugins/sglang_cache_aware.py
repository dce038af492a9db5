"""``sglang-cache-aware-scorer``: SGLang router's cache-aware policy as a one-hot scorer.

Source: SGLang router, ``sgl-router/src/policies/cache_aware.rs`` (approximate radix tree
per worker + shortest queue under imbalance). The algorithm, per request:

1. ``load_r`` = requests in flight on replica ``r`` as counted by this router. The system
   is *imbalanced* when ``max(load) - min(load) > balance_abs_threshold`` **and**
   ``max(load) > balance_rel_threshold * min(load)``; then the least-loaded replica wins
   (shortest queue), ignoring the cache.
2. Otherwise the prompt is matched against each replica's tree of routed prompts:
   ``match_rate = matched / prompt length``. If the best ``match_rate >
   cache_threshold`` the replica with the longest match wins; else the replica whose tree
   is smallest (the most free cache) wins.
3. The prompt is inserted into the chosen replica's tree (here: ``on_dispatch`` inserts the
   block hashes into the shared prefix index, LRU-bounded by KV capacity where SGLang
   evicts by a size limit on a timer).

Difference, stated: SGLang matches characters in a radix tree; here the match is counted
in the request's hashed blocks (text blocks of ``4 * block_tokens`` characters when the
gateway hashes text), so ``match_rate`` moves in steps of one block.

Formula (the score): 1 for the winner above, 0 elsewhere; ties among equal winners go to
the picker. Parameters (defaults are sgl-router's): ``balance_abs_threshold`` (int >= 0,
64), ``balance_rel_threshold`` (float >= 1, 1.5), ``cache_threshold`` (0..1, 0.3).
"""

from __future__ import annotations

from typing import ClassVar

import msgspec
import numpy as np

from isocost.scheduling.interface import Context
from isocost.scheduling.plugins._base import PluginKind
from isocost.scheduling.timing import FloatArray

TYPE = "sglang-cache-aware-scorer"


class Params(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.3


class SglangCacheAwareScorer:
    type_name: ClassVar[str] = TYPE
    kind: ClassVar[PluginKind] = "scorer"

    def __init__(self, params: Params | None = None) -> None:
        self.params = p = params or Params()
        if p.balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold must be >= 0")
        if p.balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold must be >= 1")
        if not 0.0 <= p.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")

    def score(self, ctx: Context) -> FloatArray:
        p, replicas, key = self.params, ctx.replicas, ctx.key
        load = replicas.local.waiting[key] + replicas.local.running[key]
        low, high = float(load.min()), float(load.max())
        if high - low > p.balance_abs_threshold and high > p.balance_rel_threshold * low:
            return np.asarray(load == low, dtype=np.float64)
        total_blocks = len(ctx.request.block_hashes)
        matched = ctx.cached_blocks
        best = float(matched.max()) if total_blocks else 0.0
        if total_blocks and best / total_blocks > p.cache_threshold:
            return np.asarray(matched == best, dtype=np.float64)
        tree_blocks = replicas.prefix.block_counts[key]
        return np.asarray(tree_blocks == tree_blocks.min(), dtype=np.float64)
