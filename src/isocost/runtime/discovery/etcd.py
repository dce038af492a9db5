"""The etcd provider: the registrations under ``<prefix>/replicas/``, listed, then watched.

One round: list the prefix (its records and the store revision), report them, then watch
from revision + 1, so no change between the list and the watch is missed; each watch
message updates the records and reports them all again. A compaction of that revision, a
broken stream, or a failed liveness probe (``/v3/maintenance/status`` every
``probe_interval_ms``: an idle watch sends nothing, so only a probe tells a silent etcd
from a quiet registry) ends the round, and the next starts with a fresh list, after a
backoff while etcd does not answer. While etcd is away the last records stand: the data
plane keeps routing to the replicas it knew, and the re-list reconciles them.

Records are reported in the order they registered (each key's ``create_revision``: the
list is sorted by it, and a watch adds a new key after all others), which is how a clash
between two new records is decided. A key that is not UTF-8 is a malformed record, like a
value that is not JSON: no agent writes one, and it must not fail the whole list.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

import aiohttp

from isocost.runtime.config import EtcdDiscoveryConfig
from isocost.runtime.discovery import DiscoverySink, Reachability
from isocost.runtime.discovery.records import Malformed, Registration, decode_registration
from isocost.runtime.etcd import Compacted, EtcdClient, EtcdError, EtcdRefused

__all__ = ["EtcdDiscovery", "replicas_prefix"]

log = logging.getLogger("isocost.discovery")

_INITIAL_BACKOFF_S = 0.1
# What ends a round and is retried after a backoff; a refusal (a permission, say) too: an
# operator may fix it, and the gateway keeps its last replicas meanwhile.
_ROUND_FAILURES = (EtcdError, EtcdRefused, aiohttp.ClientError, TimeoutError, ValueError)


def replicas_prefix(prefix: str) -> str:
    """Where registrations live under ``prefix``: ``<prefix>/replicas/``."""
    return prefix.rstrip("/") + "/replicas/"


class EtcdDiscovery:
    """Follows one etcd cluster's registrations and reports them to ``sink``."""

    name = "etcd"

    def __init__(
        self,
        config: EtcdDiscoveryConfig,
        sink: DiscoverySink,
        tls: ssl.SSLContext | bool = True,  # from config.tls (runtime.tls.client_ssl)
    ) -> None:
        self.config = config
        self.sink = sink
        self.reachability = Reachability(self.name, "etcd", sink)
        self.prefix = replicas_prefix(config.prefix)
        self.client = EtcdClient(
            list(config.endpoints), timeout_s=config.timeout_ms / 1000, tls=tls
        )
        self.records: dict[str, Registration | Malformed] = {}
        self._listed = False  # this round's list succeeded

    async def run(self) -> None:
        """Rounds of list-then-watch, forever (cancel to stop)."""
        backoff_s = _INITIAL_BACKOFF_S
        try:
            while True:
                self._listed = False
                try:
                    await self._round()
                except Compacted as exc:
                    log.info(
                        "etcd watch compacted, listing again",
                        extra={"event": "discovery_relist", "provider": self.name,
                               "compact_revision": exc.compact_revision},
                    )  # fmt: skip
                    continue
                except _ROUND_FAILURES as exc:
                    self.reachability.set(False, exc)
                if self._listed:  # it was healthy: retry at once, back off from there
                    backoff_s = _INITIAL_BACKOFF_S
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self.config.max_backoff_ms / 1000)
        finally:
            await self.client.close()

    async def _round(self) -> None:
        revision, kvs = await self.client.range_prefix(self.prefix)
        kvs.sort(key=lambda kv: kv.create_revision)
        self.records = {kv.key: _record(kv.key, kv.value) for kv in kvs}
        self.sink.replace(self.name, self.records)
        self._listed = True
        self.reachability.set(True, replicas=len(self.records))
        probe = asyncio.create_task(self._probe(), name="etcd discovery probe")
        watch = asyncio.create_task(self._watch(revision + 1), name="etcd discovery watch")
        try:
            done, _ = await asyncio.wait({probe, watch}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # the exception that ended the round
        finally:  # a cancel of this round itself still propagates out of gather
            probe.cancel()
            watch.cancel()
            await asyncio.gather(probe, watch, return_exceptions=True)

    async def _watch(self, start_revision: int) -> None:
        async for events in self.client.watch(self.prefix, start_revision):
            for event in events:
                if event.value is None:
                    self.records.pop(event.key, None)
                else:  # a new key goes last: it registered after every other
                    self.records[event.key] = _record(event.key, event.value)
            self.sink.replace(self.name, self.records)

    async def _probe(self) -> None:
        while True:
            await asyncio.sleep(self.config.probe_interval_ms / 1000)
            await self.client.status()


def _record(key: str, value: bytes) -> Registration | Malformed:
    """The record under ``key``; Malformed for a key that is not UTF-8 (its bytes kept as
    surrogate escapes by the client), whatever its value."""
    try:
        key.encode()
    except UnicodeEncodeError:
        return Malformed("the key is not UTF-8 text")
    return decode_registration(value)
