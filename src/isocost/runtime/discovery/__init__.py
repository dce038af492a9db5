"""Discovery: replicas that register themselves, merged into the gateway's static pools.

A provider (``etcd``: the keys ``isocost agent`` writes; ``kubernetes``: ready endpoints of
EndpointSlices, or the ready Pods an InferencePool selects) follows its source and hands
every change to a ``DiscoverySink`` as the whole membership it now sees (``replace``): a
re-list after a reconnect or a compaction is then the same call as one watch event, and
nothing it no longer lists can linger.
``Membership`` (``membership``) checks each record as the config file's replica entries are
checked and merges the survivors, at most ``discovery.max_replicas`` per provider, into the
static config, so a data plane applies discovery through the very path a config reload
takes (drain, then remove, for what left), and one bound holds for every provider.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from isocost.runtime.discovery.records import Malformed, Registration

__all__ = ["DiscoveryProvider", "DiscoverySink", "Malformed", "Reachability", "Registration"]

log = logging.getLogger("isocost.discovery")


class DiscoverySink(Protocol):
    """Where a provider reports: the records it sees, keyed by their source key, in the
    order they registered as far as it knows (a clash between two new ones goes to the
    first), and whether its source is reachable (while it is not, the last records stand)."""

    def replace(self, provider: str, records: Mapping[str, Registration | Malformed]) -> None: ...

    def set_up(self, provider: str, up: bool) -> None: ...


class DiscoveryProvider(Protocol):
    """A source of records: ``run`` follows it until cancelled, reporting to its sink."""

    name: str

    async def run(self) -> None: ...


class Reachability:
    """Whether a provider's source answers, reported to its sink and logged only when it
    changes (an outage is one warning, not one per retry)."""

    def __init__(self, provider: str, source: str, sink: DiscoverySink) -> None:
        self.provider, self.source, self.sink = provider, source, sink
        self.up: bool | None = None  # None: not tried yet

    def set(self, up: bool, error: BaseException | None = None, **extra: Any) -> None:
        if up == self.up:
            return
        self.up = up
        self.sink.set_up(self.provider, up)
        if up:
            log.info(
                f"{self.source} reachable, registrations listed",
                extra={"event": "discovery_up", "provider": self.provider, **extra},
            )
        else:
            log.warning(
                f"{self.source} unreachable, keeping the last known replicas",
                extra={
                    "event": "discovery_down",
                    "provider": self.provider,
                    "error": f"{type(error).__name__}: {error}",
                },
            )
