"""Discovered replicas, checked and merged into the static config (see the package doc).

A record is checked as a config-file replica entry is (``check_replica``: URL, tp, weight,
price, catalog GPU and cost model), then for its URL and name against the file's replicas
and every member accepted before it (providers in name order, then keys in order): the
file wins a clash, then the first claimant. A refused record is reported once per reason,
for one log line and one counted rejection, however often its provider re-lists it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec

from isocost.core.catalog import Catalog
from isocost.runtime.config import (
    GatewayConfig,
    PoolConfig,
    ReplicaConfig,
    check_replica,
    normalize_replica_url,
    replica_name,
)
from isocost.runtime.discovery.records import Malformed, Registration

__all__ = ["Member", "Membership", "Refused", "with_replicas"]


@dataclass(frozen=True, slots=True)
class Member:
    """One accepted record: which provider and key it came from, and its config entry."""

    provider: str
    key: str
    record: Registration
    replica: ReplicaConfig
    url: str  # normalized


@dataclass(frozen=True, slots=True)
class Refused:
    provider: str
    key: str
    reason: str


class Membership:
    """What every provider last reported, and the config that results."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._records: dict[str, dict[str, Registration | Malformed]] = {}
        self._refused: dict[tuple[str, str], str] = {}
        # (provider, key) -> the record last checked on its own, its URL or why it failed
        self._checked: dict[tuple[str, str], tuple[Registration, str | ValueError]] = {}
        self.members: list[Member] = []

    def replace(self, provider: str, records: Mapping[str, Registration | Malformed]) -> None:
        self._records[provider] = dict(records)

    def merge(
        self, base: GatewayConfig, refuse_url: Callable[[str], None] | None = None
    ) -> tuple[GatewayConfig, list[Refused]]:
        """``base`` with every acceptable member added to the pool of its model (a new pool
        for a model ``base`` lacks); ``members`` is set to those. Also the records refused
        for a reason not reported before. ``refuse_url`` raises ValueError for a URL the
        caller must not route to (its own address)."""
        urls = {normalize_replica_url(r.url) for p in base.pools for r in p.replicas}
        names = {replica_name(r) for p in base.pools for r in p.replicas}
        members: list[Member] = []
        refused: dict[tuple[str, str], str] = {}
        checked: dict[tuple[str, str], tuple[Registration, str | ValueError]] = {}
        for provider in sorted(self._records):
            records = self._records[provider]
            for key in sorted(records):
                record = records[key]
                if isinstance(record, Malformed):
                    refused[(provider, key)] = record.reason
                    continue
                cached = self._checked.get((provider, key))
                url = cached[1] if cached and cached[0] == record else self._check(record)
                checked[(provider, key)] = (record, url)
                reason = _clash(url, record.name, urls, names, refuse_url)
                if reason is not None:
                    refused[(provider, key)] = reason
                    continue
                assert isinstance(url, str)
                members.append(Member(provider, key, record, record.replica_config(), url))
                urls.add(url)
                names.add(record.name)
        self._checked = checked
        new = [
            Refused(provider, key, reason)
            for (provider, key), reason in refused.items()
            if self._refused.get((provider, key)) != reason
        ]
        self._refused = refused
        self.members = members
        return with_replicas(base, [(m.record.model, m.replica) for m in members]), new

    def _check(self, record: Registration) -> str | ValueError:
        """The record's normalized URL, or why its fields or references are wrong (the
        checks that depend on the record alone, so they are made once per version)."""
        try:
            check_replica(
                record.replica_config(),
                record.model,
                self.catalog,
                source=f"registration {record.name}",
                key="registration",
            )
            return normalize_replica_url(record.url)
        except ValueError as exc:  # ConfigError is one
            return exc


def _clash(
    url: str | ValueError,
    name: str,
    urls: set[str],
    names: set[str],
    refuse_url: Callable[[str], None] | None,
) -> str | None:
    """Why a checked record cannot join beside those before it, or None."""
    if isinstance(url, ValueError):
        return str(url)
    try:
        if refuse_url is not None:
            refuse_url(url)
    except ValueError as exc:
        return str(exc)
    if url in urls:
        return f"{url} is already a replica (listed or registered earlier)"
    if name in names:
        return f"a replica named {name!r} already exists"
    return None


def with_replicas(base: GatewayConfig, joining: list[tuple[str, ReplicaConfig]]) -> GatewayConfig:
    """``base`` with each ``(model, replica)`` added to the pool of its model (after the
    pool's own replicas), or to a new pool, in order, for a model ``base`` lacks."""
    if not joining:
        return base
    by_model: dict[str, list[ReplicaConfig]] = {}
    for model, replica in joining:
        by_model.setdefault(model, []).append(replica)
    pools = [
        msgspec.structs.replace(pool, replicas=[*pool.replicas, *by_model.pop(pool.model, [])])
        for pool in base.pools
    ]
    pools.extend(PoolConfig(model=model, replicas=replicas) for model, replicas in by_model.items())
    return msgspec.structs.replace(base, pools=pools)
