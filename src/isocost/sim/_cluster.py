"""The simulated cluster: ``cluster.yaml`` (msgspec, unknown keys rejected) or flags.

::

    network_delay_ms: 1          # gateway <-> replica, each way
    scrape_interval_ms: 200      # how often the gateway reads each engine's metrics (0: never)
    queue_size: 1024             # the gateway's late-binding queue (requests)
    queue_timeout_ms: 30000      # longest wait there for a request without a deadline
    max_retries: 2               # re-dispatches of a request whose replica failed
    replicas:
      - {gpu: a100-80g, model: llama-3.1-8b, count: 12}
      - {name: slow, gpu: a100-80g, model: llama-3.1-8b, slowdown: 3.0}
      - {name: l20, gpu: l20-48g, model: llama-3.1-8b, tp: 2, count: 4, max_queue: 64}
      - {name: late, gpu: h100-80g, model: llama-3.1-8b, start_s: 600, cold_start_s: 90}
    link: infiniband             # P/D KV hand-offs: nvlink | infiniband | roce | tcp
    disaggregation: conditional  # colocated | pd | conditional (default: conditional when
                                 # a replica has a role other than both, else colocated)
    prefill_fit: false           # the brain fits each replica's prefill terms to its TTFTs
                                 # (a gateway config's ``calibration.prefill_fit``)
    events:
      - {at_s: 300, replica: slow-0, action: fail}
      - {at_s: 420, replica: slow-0, action: recover}
      - {at_s: 100, replica: l20-2, action: slowdown, factor: 2.0}

A replica group expands to ``count`` replicas named ``<name>-<i>`` (``name`` defaults to
``<model>-<gpu>-tp<tp>``). All replicas serve ``served_model`` (default: the first group's
``model``), the name requests ask for, so a mixed fleet may run different catalog models
(a quantised variant, another size) behind one name. Replicas with ``start_s: 0`` are
running when the simulation starts; a later ``start_s`` launches the replica then, ready
``cold_start_s`` later, and a recovered replica also pays its cold start, with an empty
cache. ``slowdown`` multiplies every step time (a degraded node; 0.001 to 1000, as the
engine's). Every number must be finite; ``sim._limits`` bounds the replicas (10,000 in all),
the network delay (a minute) and the times (a week). ``role`` (``prefill``,
``decode`` or ``both``, the default) is the replica's part in prefill/decode
disaggregation (``scheduling.disagg``): ``- {gpu: h100-80g, model: llama-3.1-8b, count: 4,
role: prefill}``; a split request's KV moves over the cluster's ``link``
(``core.links``).

``gateway_cluster`` reads the cluster from ``isocost serve``'s own config instead
(``isocost sim --config gateway.yaml``): one pool's replicas, by their gateway names, with
their GPU, ``tp``, cost model, weight, price, groups, ``max_queue`` and ``role``, the pool's
``kv_link`` and ``disaggregation`` (where some replica has a role), and the gateway's
scrape interval, queue size, queue timeout and retries. URLs and secrets play no part: the
simulator simulates each replica from its GPU, model and ``tp``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar, cast

import msgspec

from isocost.core.bounds import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Bounds, check_fields
from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.core.errors import ConfigError
from isocost.core.links import LINK_KINDS
from isocost.core.yamltext import load_yaml
from isocost.engine.config import MAX_SLOWDOWN
from isocost.files import resolve_model
from isocost.runtime.config import GatewayConfig, PoolConfig, replica_name
from isocost.scheduling.contract import Role
from isocost.scheduling.policies import UnknownConfigEntryError
from isocost.sim._limits import MAX_NETWORK_DELAY_MS, MAX_REPLICAS, MAX_SPAN_S

DisaggregationMode = Literal["colocated", "pd", "conditional"]  # scheduling.disagg.DisaggMode

__all__ = [
    "ClusterConfig",
    "ClusterEvent",
    "ReplicaGroup",
    "SimReplica",
    "gateway_cluster",
    "gateway_pool",
    "lowest_slowdowns",
    "named_pool",
    "parse_cluster_yaml",
    "resolve_cluster",
    "served_model",
    "uniform_cluster",
    "with_settings",
]


class ReplicaGroup(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    gpu: str
    model: str
    tp: int = 1
    count: int = 1
    name: str | None = None
    slowdown: float = 1.0
    weight: float = 1.0
    max_queue: int = 128
    usd_per_hour: float | None = None
    start_s: float = 0.0
    cold_start_s: float = 0.0
    groups: list[str] = []
    role: Role = "both"


class ClusterEvent(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    at_s: float
    replica: str
    action: Literal["fail", "recover", "slowdown"]
    factor: float = 1.0  # the new slowdown (action: slowdown)


class ClusterConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    replicas: list[ReplicaGroup]
    events: list[ClusterEvent] = []
    served_model: str | None = None
    network_delay_ms: float = 1.0
    scrape_interval_ms: float = 200.0
    queue_size: int = 1024
    queue_timeout_ms: float = 30_000.0
    max_retries: int = 2
    link: str = "infiniband"
    disaggregation: DisaggregationMode | None = None
    prefill_fit: bool = False


@dataclass(frozen=True, slots=True)
class SimReplica:
    """One resolved replica of the simulated cluster."""

    replica_id: str
    cost_model: CostModel
    slowdown: float
    weight: float
    max_queue: int
    usd_per_hour: float | None
    start_s: float
    cold_start_s: float
    groups: frozenset[str]
    role: Role = "both"


def parse_cluster_yaml(text: str, source: str) -> ClusterConfig:
    """Decode and check a cluster file; errors name ``source`` and the key."""
    raw = load_yaml(text, source)
    try:
        config = msgspec.convert(raw, ClusterConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(source, str(exc)) from None
    _check(config, source)
    return config


def uniform_cluster(
    replicas: int, gpu: str, model: str, tp: int, **settings: float
) -> ClusterConfig:
    """``replicas`` identical replicas (the ``--replicas --gpu --model --tp`` flags)."""
    config = ClusterConfig(replicas=[ReplicaGroup(gpu=gpu, model=model, tp=tp, count=replicas)])
    return with_settings(config, "--replicas", **settings)


def with_settings(config: ClusterConfig, source: str, **settings: float) -> ClusterConfig:
    """``config`` with top-level settings replaced (command-line overrides), checked."""
    config = msgspec.structs.replace(config, **settings)
    _check(config, source)
    return config


def resolve_cluster(config: ClusterConfig, catalog: Catalog) -> list[SimReplica]:
    """Every replica with its cost model (unknown GPUs and models name the valid ones)."""
    out: list[SimReplica] = []
    for group in config.replicas:
        cost = CostModel(resolve_model(group.model, catalog), catalog.gpu(group.gpu), group.tp)
        if cost.kv_capacity_tokens <= 0:
            raise ConfigError(
                "cluster", f"{group.model} does not fit on {group.tp}x {group.gpu}", "replicas"
            )
        for replica_id in _names(group):
            out.append(
                SimReplica(
                    replica_id=replica_id,
                    cost_model=cost,
                    slowdown=group.slowdown,
                    weight=group.weight,
                    max_queue=group.max_queue,
                    usd_per_hour=group.usd_per_hour,
                    start_s=group.start_s,
                    cold_start_s=group.cold_start_s,
                    groups=frozenset(group.groups),
                    role=group.role,
                )
            )
    return out


class _Pool(Protocol):
    @property
    def model(self) -> str: ...


_PoolT = TypeVar("_PoolT", bound=_Pool)


def named_pool(pools: Sequence[_PoolT], pool: str | None, source: str, verb: str) -> _PoolT:
    """The pool named ``pool`` (the model its clients ask for) among ``pools``; None: the
    only one. ``verb`` says what ``--pool`` names it for (simulate, replay)."""
    models = [p.model for p in pools]
    if pool is None:
        if len(models) != 1:
            found = f"pools {', '.join(models)}" if models else "no pool"
            raise ConfigError(source, f"{found}: name the one to {verb} with --pool")
        return pools[0]
    for candidate in pools:
        if candidate.model == pool:
            return candidate
    raise UnknownConfigEntryError("pool", pool, models, "--pool")


def gateway_pool(config: GatewayConfig, pool: str | None, source: str) -> PoolConfig:
    """The gateway file's pool named ``pool``; None: the file's only pool."""
    return named_pool(config.pools, pool, source, "simulate")


def gateway_cluster(
    config: GatewayConfig, pool: PoolConfig, catalog: Catalog, source: str, **settings: float
) -> tuple[ClusterConfig, list[SimReplica]]:
    """``pool`` of a gateway config as a simulated cluster (see the module docstring), with
    command-line ``settings`` applied; the cluster and its replicas, by their gateway names.
    Cost models resolve as the gateway resolves them (``cost_model``, else the pool's
    model)."""
    if not pool.replicas:
        raise ConfigError(source, "lists no replica to simulate", f"pool {pool.model}")
    names = [replica_name(r) for r in pool.replicas]
    groups = [
        ReplicaGroup(
            gpu=r.gpu,
            model=r.cost_model or pool.model,
            tp=r.tp,
            name=name,
            weight=r.weight,
            max_queue=r.max_queue,
            usd_per_hour=r.usd_per_hour,
            groups=r.groups,
            role=r.role,
        )
        for r, name in zip(pool.replicas, names, strict=True)
    ]
    limits = config.limits
    split = any(r.role != "both" for r in pool.replicas)  # as the gateway: else never split
    cluster = ClusterConfig(
        replicas=groups,
        served_model=pool.model,
        scrape_interval_ms=config.scrape_interval_ms,
        queue_size=limits.max_queue,
        queue_timeout_ms=limits.queue_timeout_ms,
        max_retries=limits.max_retries,
        link=pool.kv_link,
        disaggregation=cast(DisaggregationMode, pool.disaggregation) if split else None,
        prefill_fit=config.calibration.prefill_fit,
    )
    cluster = with_settings(cluster, source, **settings)
    replicas = resolve_cluster(cluster, catalog)  # one per group, each named <name>-0
    named = [
        dataclasses.replace(r, replica_id=name) for r, name in zip(replicas, names, strict=True)
    ]
    return cluster, named


def lowest_slowdowns(config: ClusterConfig, replicas: Sequence[SimReplica]) -> list[float]:
    """Per replica, the smallest slowdown it ever runs at: its own, or a ``slowdown``
    event's factor (what the isolated-service bound must not be beaten by)."""
    lowest = {r.replica_id: r.slowdown for r in replicas}
    for event in config.events:
        if event.action == "slowdown" and event.replica in lowest:
            lowest[event.replica] = min(lowest[event.replica], event.factor)
    return [lowest[r.replica_id] for r in replicas]


def served_model(config: ClusterConfig) -> str:
    return config.served_model or config.replicas[0].model


# Every number's range (all finite; ``sim._limits`` says why the upper bounds).
_SLOWDOWN = Bounds(1 / MAX_SLOWDOWN, MAX_SLOWDOWN)
_SPAN = Bounds(0.0, MAX_SPAN_S)
_CLUSTER_BOUNDS: dict[str, Bounds] = {
    "network_delay_ms": Bounds(0.0, MAX_NETWORK_DELAY_MS),
    "scrape_interval_ms": NON_NEGATIVE,  # 0: never
    "queue_size": NON_NEGATIVE,
    "queue_timeout_ms": Bounds(0.0, MAX_SPAN_S * 1000, low_open=True),
    "max_retries": NON_NEGATIVE,
}
_GROUP_BOUNDS: dict[str, Bounds] = {
    "tp": AT_LEAST_ONE,
    "count": Bounds(1, MAX_REPLICAS),
    "slowdown": _SLOWDOWN,
    "weight": POSITIVE,
    "max_queue": NON_NEGATIVE,
    "usd_per_hour": NON_NEGATIVE,
    "start_s": _SPAN,
    "cold_start_s": _SPAN,
}
_EVENT_BOUNDS: dict[str, Bounds] = {"at_s": _SPAN, "factor": _SLOWDOWN}


def _check(config: ClusterConfig, source: str) -> None:
    check_fields(config, _CLUSTER_BOUNDS, source)
    for i, group in enumerate(config.replicas):
        check_fields(group, _GROUP_BOUNDS, source, f"replicas[{i}]")
    for i, event in enumerate(config.events):
        check_fields(event, _EVENT_BOUNDS, source, f"events[{i}]")
    total = sum(g.count for g in config.replicas)
    problems: list[tuple[str, bool, str]] = [
        ("replicas", bool(config.replicas), "must list at least one replica group"),
        ("replicas", total <= MAX_REPLICAS, f"{total:,}, beyond the limit of {MAX_REPLICAS:,}"),
        ("link", config.link in LINK_KINDS, f"must be one of {', '.join(LINK_KINDS)}"),
    ]
    for key, ok, message in problems:
        if not ok:
            raise ConfigError(source, message, key)
    names = [name for group in config.replicas for name in _names(group)]
    if len(set(names)) != len(names):
        raise ConfigError(source, "replica names must be unique", "replicas")
    for i, event in enumerate(config.events):
        if event.replica not in names:
            raise ConfigError(
                source,
                f"unknown replica {event.replica!r}; valid: {', '.join(names)}",
                f"events[{i}].replica",
            )


def _names(group: ReplicaGroup) -> list[str]:
    prefix = group.name or f"{group.model}-{group.gpu}-tp{group.tp}"
    return [f"{prefix}-{i}" for i in range(group.count)]
