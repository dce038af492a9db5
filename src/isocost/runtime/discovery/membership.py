"""Discovered replicas, checked and merged into the static config (see the package doc).

A record is checked as ``isocost agent`` checks it before registering
(``check_registration``: its models, then every check of a config-file replica entry),
then for its URL and name against the file's replicas and every member accepted before
it. Who is accepted first decides a clash: the file, then the incumbents (the members of
the last merge, so a serving replica is never pushed out by a later duplicate), then the
newcomers, providers in name order, each provider's records in the order they registered.
URLs are compared as written (normalized, not resolved): ``localhost`` and ``127.0.0.1`` are
two replicas, as they may be two listeners (``::1`` and ``127.0.0.1``), and a wrong guess
would refuse a real replica where a missed duplicate only weights one engine twice.

A refused record is reported once per reason, for one log line and one counted rejection,
however often its provider re-lists it; whatever a record holds, it can only refuse that
record, never stop the merge of the others.

Each provider adds at most ``max_replicas`` members (``discovery.max_replicas``), whatever
its source lists: a selector matching a whole namespace, or a registration loop, must leave
the gateway routing to the replicas it has, not scraping and pricing tens of thousands. The
order that decides a clash decides who stays (the incumbents, then the first registered),
so a flood never evicts a replica already routed to, and every re-list keeps the same ones;
the registrations past the bound are not even checked, and ``dropped`` counts them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec

from isocost.core.catalog import Catalog
from isocost.runtime.config import (
    MAX_DISCOVERED_REPLICAS,
    GatewayConfig,
    PoolConfig,
    ReplicaConfig,
    normalize_replica_url,
    replica_name,
)
from isocost.runtime.discovery.records import Malformed, Registration, check_registration

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


@dataclass(frozen=True, slots=True)
class _Checked:
    """A record checked on its own: its normalized URL and config entry, or why it fails."""

    record: Registration
    verdict: tuple[str, ReplicaConfig] | str


class Membership:
    """What every provider last reported, and the config that results."""

    def __init__(self, catalog: Catalog, max_replicas: int = MAX_DISCOVERED_REPLICAS) -> None:
        self.catalog = catalog
        self.max_replicas = max_replicas  # members per provider
        self._records: dict[str, dict[str, Registration | Malformed]] = {}
        self._refused: dict[tuple[str, str], str] = {}
        self._checked: dict[tuple[str, str], _Checked] = {}  # by (provider, key)
        self.members: list[Member] = []
        self.dropped: dict[str, int] = {}  # by provider: registrations past max_replicas

    def replace(self, provider: str, records: Mapping[str, Registration | Malformed]) -> None:
        """``provider``'s records now, in the order they registered (first first)."""
        self._records[provider] = dict(records)

    def merge(
        self, base: GatewayConfig, refuse_url: Callable[[str], None] | None = None
    ) -> tuple[GatewayConfig, list[Refused]]:
        """``base`` with every acceptable member added to the pool of its model (a new pool
        for a model ``base`` lacks); ``members`` is set to those, at most ``max_replicas``
        per provider, and ``dropped`` to the number of registrations past that. Also the
        records refused for a reason not reported before. ``refuse_url`` raises ValueError
        for a URL the caller must not route to (its own address)."""
        urls = {normalize_replica_url(r.url) for p in base.pools for r in p.replicas}
        names = {replica_name(r) for p in base.pools for r in p.replicas}
        incumbents = {(m.provider, m.key) for m in self.members}
        present = [(p, key) for p in sorted(self._records) for key in self._records[p]]
        members: list[Member] = []
        refused: dict[tuple[str, str], str] = {}
        checked: dict[tuple[str, str], _Checked] = {}
        accepted: Counter[str] = Counter()
        dropped: Counter[str] = Counter()
        for provider, key in sorted(present, key=lambda at: at not in incumbents):  # stable
            record = self._records[provider][key]
            if isinstance(record, Malformed):
                refused[(provider, key)] = record.reason
                continue
            if accepted[provider] >= self.max_replicas:
                dropped[provider] += 1
                continue
            checks = self._checked.get((provider, key))
            if checks is None or checks.record != record:
                checks = self._check(record)
            checked[(provider, key)] = checks
            reason = _clash(checks.verdict, record.name, urls, names, refuse_url)
            if reason is not None:
                refused[(provider, key)] = reason
                continue
            assert not isinstance(checks.verdict, str)
            url, replica = checks.verdict
            members.append(Member(provider, key, record, replica, url))
            accepted[provider] += 1
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
        self.dropped = dict(dropped)
        return with_replicas(base, [(m.record.model, m.replica) for m in members]), new

    def _check(self, record: Registration) -> _Checked:
        """The checks that depend on the record alone, made once per version of it. Any
        exception is the record's fault and refuses it alone (ValueError, a ConfigError,
        is the expected one; another is named with its type)."""
        try:
            url = check_registration(record, self.catalog)
        except ValueError as exc:
            return _Checked(record, str(exc))
        except Exception as exc:  # one record must not stop the merge of the others
            return _Checked(record, f"{type(exc).__name__}: {exc}")
        return _Checked(record, (url, record.replica_config()))


def _clash(
    verdict: tuple[str, ReplicaConfig] | str,
    name: str,
    urls: set[str],
    names: set[str],
    refuse_url: Callable[[str], None] | None,
) -> str | None:
    """Why a checked record cannot join beside those before it, or None."""
    if isinstance(verdict, str):
        return verdict
    url = verdict[0]
    try:
        if refuse_url is not None:
            refuse_url(url)
    except ValueError as exc:
        return str(exc)
    if url in urls:
        return f"{url} is already a replica (listed, or registered before this record)"
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
