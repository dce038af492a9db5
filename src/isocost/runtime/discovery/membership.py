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
from isocost.core.errors import ConfigError
from isocost.runtime.config import (
    GatewayConfig,
    PoolConfig,
    ReplicaConfig,
    check_replica,
    normalize_replica_url,
    replica_name,
)
from isocost.runtime.discovery.records import Malformed, Registration

__all__ = ["Member", "Membership", "Refused"]


@dataclass(frozen=True, slots=True)
class Member:
    """One accepted record: which provider and key it came from, and its config entry."""

    provider: str
    key: str
    record: Registration
    replica: ReplicaConfig

    @property
    def url(self) -> str:
        return normalize_replica_url(self.replica.url)


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
        for provider in sorted(self._records):
            records = self._records[provider]
            for key in sorted(records):
                record = records[key]
                reason = self._check(provider, key, record, urls, names, refuse_url)
                if reason is not None:
                    refused[(provider, key)] = reason
                    continue
                assert isinstance(record, Registration)
                member = Member(provider, key, record, record.replica_config())
                urls.add(member.url)
                names.add(record.name)
                members.append(member)
        new = [
            Refused(provider, key, reason)
            for (provider, key), reason in refused.items()
            if self._refused.get((provider, key)) != reason
        ]
        self._refused = refused
        self.members = members
        return _with_members(base, members), new

    def _check(
        self,
        provider: str,
        key: str,
        record: Registration | Malformed,
        urls: set[str],
        names: set[str],
        refuse_url: Callable[[str], None] | None,
    ) -> str | None:
        """Why ``record`` cannot join, or None."""
        if isinstance(record, Malformed):
            return record.reason
        try:
            check_replica(
                record.replica_config(),
                record.model,
                self.catalog,
                source=f"{provider} {key}",
                key="registration",
            )
            url = normalize_replica_url(record.url)
            if refuse_url is not None:
                refuse_url(url)
        except (ConfigError, ValueError) as exc:
            return str(exc)
        if url in urls:
            return f"{url} is already a replica (listed or registered earlier)"
        if record.name in names:
            return f"a replica named {record.name!r} already exists"
        return None


def _with_members(base: GatewayConfig, members: list[Member]) -> GatewayConfig:
    if not members:
        return base
    joining: dict[str, list[ReplicaConfig]] = {}
    for member in members:
        joining.setdefault(member.record.model, []).append(member.replica)
    pools = [
        msgspec.structs.replace(pool, replicas=[*pool.replicas, *joining.pop(pool.model, [])])
        for pool in base.pools
    ]
    pools.extend(PoolConfig(model=model, replicas=replicas) for model, replicas in joining.items())
    return msgspec.structs.replace(base, pools=pools)
