"""Several gateways in front of one fleet, as the autoscaler sees them: one ``FleetGateway``.

A pool behind an L4 balancer runs several gateways (``isocost autoscale --gateway`` named
more than once), each with its own admin API, counters and requests in flight. Read
through one of them, the autoscaler would see a share of the arrivals (and scale too
little), and a drain there would leave the others sending the victim new work that its
stop cuts. ``GatewaySet`` reads them all and acts on them all:

* **snapshot**: what each gateway answered, merged. A replica's requests in flight are
  summed (each gateway counts its own), its engine's queue is the largest seen (each
  scrapes the same engine), the pools' queues are summed and the live autoscaler
  instances united. A replica serves if any gateway routes to it (``ejected`` only where
  none has it healthy; ``partly_drained`` where another has it drained), else it is
  leaving (``removing`` on any) or ``drained``; its drain
  mark is the one the gateways that drained it agree on (None where they differ: drained
  again in another name somewhere). Those that did not answer are named in ``unread``
  (with the workers of a ``serve --workers`` gateway that did not): one gateway down
  leaves the others to decide on, but a drain's end needs them all.
* **counters**: summed over the gateways, each one's growth since its own last reading
  (a gateway restarted counts from zero again; one first read after the start brings its
  history in as a baseline, not as arrivals), so the sum only grows. One that cannot be
  read adds nothing until it can: its growth meanwhile counts then.
* **drain, undrain, remove**: sent to every gateway; one that does not list the replica
  (404) has nothing to do. A failure anywhere fails the call (the loop retries it on all;
  each is idempotent), as does a replica that none lists.
* **add**: sent to every gateway; if one refuses, those that took it remove it again, so
  that no gateway routes to a replica whose start failed.
* **status**: posted to every gateway, so that each one's dashboard shows it and the
  autoscaler stays live as long as any one of them hears it.

The members may change between calls (``set_members``): ``GatewayAddresses`` resolves
each gateway's host name to every address it has, again each round, so that a
Kubernetes headless Service names every gateway Pod as they come and go (a plain
Service's one address would hand each call to any Pod: counters from one, drains on
another). A gateway that leaves takes its counters with it; one that joins is a late
first reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import msgspec

from isocost.autoscale._admin import (
    SERVING_STATES,
    AutoscalerRow,
    FleetGateway,
    FleetSnapshot,
    GatewayCounters,
    GatewayError,
    PoolRow,
    ReplicaRow,
    read_snapshot,
)

__all__ = ["GatewayAddresses", "GatewaySet", "merge_snapshots"]

log = logging.getLogger("isocost.autoscale")

_T = TypeVar("_T")
_NOT_LISTED = 404  # the admin API's answer for a replica it does not list


def _merge_replica(rows: Sequence[ReplicaRow]) -> ReplicaRow:
    """One replica as several gateways list it (module docstring)."""
    states = [row.state for row in rows]
    if serving := [s for s in states if s in SERVING_STATES]:
        state = "healthy" if "healthy" in serving else "ejected"
    else:
        state = "removing" if "removing" in states else states[0]
    marks = {
        row.drained_by
        for row in rows
        if row.state not in SERVING_STATES and row.drained_by is not msgspec.UNSET
    }
    waiting = [row.engine_waiting for row in rows if row.engine_waiting is not None]
    return ReplicaRow(
        name=rows[0].name,
        state=state,
        in_flight=sum(row.in_flight for row in rows),
        gpu=next((row.gpu for row in rows if row.gpu), ""),
        url=next((row.url for row in rows if row.url), ""),
        engine_waiting=max(waiting, default=None),
        drained_by=marks.pop() if len(marks) == 1 else None if marks else rows[0].drained_by,
        partly_drained=0 < len(serving) < len(states),
    )


def merge_snapshots(readings: Sequence[FleetSnapshot], unread: Mapping[str, str]) -> FleetSnapshot:
    """The snapshots of several gateways as one (module docstring); ``unread``: the
    gateways that did not answer (URL -> why)."""
    queues: dict[str, int] = {}
    listed: dict[str, list[ReplicaRow]] = {}
    live: dict[str, None] = {}  # an ordered set
    for snapshot in readings:
        for pool in snapshot.pools:
            queues[pool.model] = queues.get(pool.model, 0) + pool.queue_depth
        for row in snapshot.replicas:
            listed.setdefault(row.name, []).append(row)
        if snapshot.autoscaler is not None:
            live.update(dict.fromkeys(snapshot.autoscaler.live_instances))
    heard = any(snapshot.autoscaler is not None for snapshot in readings)
    return FleetSnapshot(
        pools=[PoolRow(depth, model) for model, depth in queues.items()],
        replicas=[_merge_replica(rows) for rows in listed.values()],
        autoscaler=AutoscalerRow(list(live)) if heard else None,
        unread=dict(unread),
    )


def _failure(errors: Sequence[tuple[str, GatewayError]]) -> GatewayError:
    """One error naming each gateway's; the status where they all agree on one."""
    statuses = {error.status for _, error in errors}
    status = statuses.pop() if len(statuses) == 1 else None
    return GatewayError("; ".join(f"{url}: {error}" for url, error in errors), status)


class GatewaySet:
    """Several gateways as one ``FleetGateway`` (module docstring)."""

    def __init__(self, members: Sequence[FleetGateway]) -> None:
        self.members: tuple[FleetGateway, ...] = ()
        self._counted: dict[str, GatewayCounters] = {}  # by URL: each one's last reading
        self._total: GatewayCounters | None = None  # what ``counters`` last answered
        self.set_members(members)

    def set_members(self, members: Sequence[FleetGateway]) -> None:
        """The gateways from now on; those gone take their counters' state with them."""
        if not members:
            raise ValueError("a gateway set needs a gateway")
        self.members = tuple(members)
        urls = {member.url for member in members}
        self._counted = {url: c for url, c in self._counted.items() if url in urls}

    @property
    def url(self) -> str:
        return ", ".join(member.url for member in self.members)

    async def _each(self, call: Callable[[FleetGateway], Awaitable[_T]]) -> list[_T | GatewayError]:
        """``call`` on every gateway at once: each one's answer, or its GatewayError."""

        async def one(member: FleetGateway) -> _T | GatewayError:
            try:
                return await call(member)
            except GatewayError as exc:
                return exc

        return list(await asyncio.gather(*(one(member) for member in self.members)))

    def _errors(self, results: Sequence[object]) -> list[tuple[str, GatewayError]]:
        return [
            (member.url, result)
            for member, result in zip(self.members, results, strict=True)
            if isinstance(result, GatewayError)
        ]

    async def snapshot(self) -> dict[str, Any]:
        readings: list[FleetSnapshot] = []
        unread: dict[str, str] = {}
        for member, raw in zip(self.members, await self._each(lambda m: m.snapshot()), strict=True):
            try:
                if isinstance(raw, GatewayError):
                    raise raw
                readings.append(reading := read_snapshot(raw))
            except GatewayError as exc:
                unread[member.url] = str(exc)
                continue
            unread |= {f"{member.url} {part}": why for part, why in reading.gaps().items()}
        if not readings:
            raise GatewayError("; ".join(f"{url}: {why}" for url, why in unread.items()))
        merged: dict[str, Any] = msgspec.to_builtins(merge_snapshots(readings, unread))
        return merged

    async def counters(self) -> GatewayCounters:
        results = await self._each(lambda m: m.counters())
        if len(errors := self._errors(results)) == len(self.members):
            raise _failure(errors)
        for url, error in errors:
            log.warning(
                "gateway counters unreadable: its arrivals count once it is read again",
                extra={
                    "event": "autoscale_failure",
                    "action": "observe",
                    "gateway": url,
                    "error": str(error),
                },
            )
        growth = GatewayCounters({}, (0, 0))
        for member, reading in zip(self.members, results, strict=True):
            if isinstance(reading, GatewayError):
                continue
            before = self._counted.get(member.url)
            if before is not None:
                growth = growth.plus(reading.since(before))
            elif self._total is None:  # the first reading: every gateway's is the baseline
                growth = growth.plus(reading)
            self._counted[member.url] = reading
        self._total = growth if self._total is None else self._total.plus(growth)
        return self._total

    async def _on_all(self, call: Callable[[FleetGateway], Awaitable[None]]) -> None:
        """``call`` on every gateway; one that does not list the replica has nothing to do.
        A GatewayError naming those that failed, or the 404s if none lists it."""
        errors = self._errors(await self._each(call))
        failed = [(url, error) for url, error in errors if error.status != _NOT_LISTED]
        if failed or len(errors) == len(self.members):
            raise _failure(failed or errors)

    async def drain(self, name: str, by: str) -> None:
        await self._on_all(lambda member: member.drain(name, by))

    async def undrain(self, name: str) -> None:
        await self._on_all(lambda member: member.undrain(name))

    async def remove(self, name: str) -> None:
        await self._on_all(lambda member: member.remove(name))

    async def add(self, model: str, replica: dict[str, Any]) -> None:
        results = await self._each(lambda member: member.add(model, replica))
        if not (errors := self._errors(results)):
            return
        took = [
            m for m, r in zip(self.members, results, strict=True) if not isinstance(r, GatewayError)
        ]
        if isinstance(name := replica.get("name"), str):
            for member in took:  # the start fails: listed, it would be routed to dead
                with contextlib.suppress(GatewayError):
                    await member.remove(name)
        raise _failure(errors)

    async def post_status(self, status: Mapping[str, Any]) -> None:
        if errors := self._errors(await self._each(lambda m: m.post_status(status))):
            raise _failure(errors)


class GatewayAddresses:
    """Each gateway URL's host name resolved to every address it has (module docstring):
    one member per address, made by ``make(url, host)`` (``host``: the name to present,
    as the Host header and to TLS). A name that cannot be resolved keeps the addresses it
    last had (never had any: it is one member as given, its calls failing, reported);
    an IP address is itself."""

    def __init__(
        self, urls: Sequence[str], make: Callable[[str, str | None], FleetGateway]
    ) -> None:
        self.urls = list(urls)
        self.make = make
        self._members: dict[str, FleetGateway] = {}  # by URL: kept while it resolves
        self._addresses_of: dict[str, list[str]] = {}  # each URL's at the last lookup

    async def resolve(self) -> list[FleetGateway]:
        wanted: dict[str, str | None] = {}
        for url in self.urls:
            for address in await self._addresses(url):
                wanted.setdefault(address, urlsplit(url).netloc if address != url else None)
        self._members = {
            url: self._members.get(url) or self.make(url, host) for url, host in wanted.items()
        }
        return list(self._members.values())

    async def follow(self, gateways: GatewaySet, every_s: float) -> None:
        """Resolve again every ``every_s`` and make the result ``gateways``' members, until
        cancelled."""
        while True:
            await asyncio.sleep(every_s)
            gateways.set_members(await self.resolve())

    async def _addresses(self, url: str) -> list[str]:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with contextlib.suppress(ValueError):
            ipaddress.ip_address(host)
            return [url]
        try:
            ips = await self.lookup(host, port)
        except (OSError, UnicodeError) as exc:  # UnicodeError: a label IDNA refuses
            log.warning(
                "gateway name not resolved: its last addresses kept",
                extra={
                    "event": "autoscale_failure",
                    "action": "resolve",
                    "gateway": url,
                    "error": str(exc),
                },
            )
            return self._addresses_of.get(url, [url])
        path = parts.path.rstrip("/")
        self._addresses_of[url] = [
            f"{parts.scheme}://{f'[{ip}]' if ':' in ip else ip}:{port}{path}" for ip in ips
        ] or [url]
        return self._addresses_of[url]

    async def lookup(self, host: str, port: int) -> list[str]:
        """The addresses of ``host`` (DNS, /etc/hosts); an OSError when it has none."""
        found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return sorted({str(info[4][0]) for info in found})
