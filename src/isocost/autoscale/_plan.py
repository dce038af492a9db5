"""``isocost autoscale --plan FILE``: the capacity per replica from ``isocost plan --json``.

The planner's document names its GPU (``gpu``), the replica's tensor-parallel size
(``recommended_tensor_parallel``), its price (``usd_per_hour_per_replica``) and the
requests/s one replica sustains at the SLOs (``requests_per_s_per_replica``). A file holds
one such document, or a list of them (one per GPU type, e.g. ``jq -s`` of several plans);
each pool takes the one on its GPU.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import msgspec

from isocost.control import PoolConfig, PoolOffer
from isocost.core.errors import ConfigError
from isocost.core.jsontext import parse_json

__all__ = ["offers_from_plan"]


class _PlanDocument(msgspec.Struct, frozen=True):
    """The fields of ``isocost plan --json`` the autoscaler uses (others are ignored)."""

    gpu: str
    recommended_tensor_parallel: int
    usd_per_hour_per_replica: float
    requests_per_s_per_replica: float


def offers_from_plan(text: str, source: str, pools: Sequence[PoolConfig]) -> list[PoolOffer]:
    """Each pool's offer from the plan on its GPU; ConfigError (one line) for a file that
    is not a plan, a figure that is not positive, or a pool whose GPU no plan covers."""
    try:
        raw = parse_json(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(source, f"not JSON ({exc.msg}, line {exc.lineno})") from None
    try:
        documents = msgspec.convert(raw if isinstance(raw, list) else [raw], list[_PlanDocument])
    except msgspec.ValidationError as exc:
        raise ConfigError(source, f"not `isocost plan --json` output: {exc}") from None
    by_gpu = {d.gpu: d for d in documents}
    offers = []
    for i, pool in enumerate(pools):
        plan = by_gpu.get(pool.gpu)
        if plan is None:
            found = ", ".join(sorted(by_gpu)) or "none"
            raise ConfigError(source, f"no plan for {pool.gpu} (plans for: {found})", f"pools[{i}]")
        if not (plan.requests_per_s_per_replica > 0 and plan.recommended_tensor_parallel > 0):
            raise ConfigError(source, f"{pool.gpu}: requests_per_s_per_replica must be > 0")
        offers.append(
            PoolOffer(
                pool.gpu,
                plan.recommended_tensor_parallel,
                plan.usd_per_hour_per_replica,
                plan.requests_per_s_per_replica,
            )
        )
    return offers
