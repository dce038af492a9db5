"""Built-in plugins, one per module, registered here by their stable type string.

Each module's docstring is its reference: type string, formula, inputs, parameters and
their ranges. ``isocost policies`` lists them.
"""

from __future__ import annotations

from types import ModuleType

import msgspec

from isocost.scheduling.plugins import (
    dynamo_kv,
    equal_cost,
    kv_headroom,
    kv_utilization,
    least_request,
    max_score,
    power_of_two,
    prefix_cache,
    queue,
    random_pick,
    round_robin,
    session_affinity,
    sglang_cache_aware,
)
from isocost.scheduling.plugins._base import NoParams, PluginKind, PluginType

__all__ = ["PLUGIN_TYPES", "PluginType"]


def _entry(module: ModuleType, cls: type, params: type[msgspec.Struct] = NoParams) -> PluginType:
    kind: PluginKind = cls.kind  # type: ignore[attr-defined]
    summary = (module.__doc__ or "").strip().splitlines()[0].split(": ", 1)[-1]
    return PluginType(module.TYPE, kind, params, cls, summary)


PLUGIN_TYPES: dict[str, PluginType] = {
    entry.type_name: entry
    for entry in (
        _entry(kv_headroom, kv_headroom.KvHeadroomFilter, kv_headroom.Params),
        _entry(least_request, least_request.LeastRequestScorer),
        _entry(queue, queue.QueueScorer),
        _entry(kv_utilization, kv_utilization.KvCacheUtilizationScorer),
        _entry(prefix_cache, prefix_cache.PrefixCacheScorer),
        _entry(session_affinity, session_affinity.SessionAffinityScorer),
        _entry(
            sglang_cache_aware,
            sglang_cache_aware.SglangCacheAwareScorer,
            sglang_cache_aware.Params,
        ),
        _entry(dynamo_kv, dynamo_kv.DynamoKvScorer, dynamo_kv.Params),
        _entry(equal_cost, equal_cost.EqualCostScorer, equal_cost.Params),
        _entry(max_score, max_score.MaxScorePicker),
        _entry(random_pick, random_pick.RandomPicker),
        _entry(round_robin, round_robin.RoundRobinPicker),
        _entry(power_of_two, power_of_two.PowerOfTwoPicker, power_of_two.Params),
    )
}
