"""The gateway as the autoscaler sees it: its admin API and its ``/metrics`` counters."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Protocol
from urllib.parse import urlsplit

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from isocost.core.errors import IsocostError
from isocost.core.jsontext import parse_json

__all__ = [
    "AdminClient",
    "FleetGateway",
    "FleetSnapshot",
    "GatewayCounters",
    "GatewayError",
    "ReplicaRow",
    "read_counters",
    "read_snapshot",
]

# A count past 2**53 is no count (nor exact as a float): junk, not a fleet to decide on.
_MAX_COUNT = 2**53
_Count = Annotated[int, msgspec.Meta(ge=0, le=_MAX_COUNT)]
SERVING_STATES = frozenset({"healthy", "ejected"})  # a replica's states that are not drained


class GatewayError(IsocostError):
    """The gateway refused, could not be reached, or answered something unusable;
    ``status``: the HTTP status it refused with, if it answered."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ReplicaRow(msgspec.Struct, frozen=True):
    """The fields of a ``/admin/snapshot`` replica the loop and the actuators read
    (others are ignored)."""

    name: str
    state: str
    in_flight: _Count
    gpu: str = ""  # none: on no pool's GPU, not the autoscaler's
    url: str = ""  # where the gateway sends it (its Pod's IP, on Kubernetes)
    engine_waiting: _Count | None = None
    # who drained it, as its drain named itself (UNSET: a gateway too old to say)
    drained_by: str | msgspec.UnsetType | None = msgspec.UNSET
    # merged from several gateways (``GatewaySet``): serving on some, drained on others
    partly_drained: bool = False


class AutoscalerRow(msgspec.Struct, frozen=True):
    """The autoscaler status the gateway holds: which instances still post one."""

    live_instances: list[str] = msgspec.field(default_factory=list)


class PoolRow(msgspec.Struct, frozen=True):
    queue_depth: _Count
    model: str = ""


class WorkersRow(msgspec.Struct, frozen=True):
    """``serve --workers``: the workers whose requests the snapshot could not count."""

    missing: list[int] = msgspec.field(default_factory=list)


class FleetSnapshot(msgspec.Struct, frozen=True):
    """``/admin/snapshot`` as checked data: a loop deciding on junk would scale on junk."""

    pools: list[PoolRow]
    replicas: list[ReplicaRow]
    autoscaler: AutoscalerRow | None = None
    workers: WorkersRow | None = None
    # of several gateways read as one (``GatewaySet``), those that did not answer: URL ->
    # why; a gateway's own snapshot has none
    unread: dict[str, str] = msgspec.field(default_factory=dict)

    def gaps(self) -> dict[str, str]:
        """What the snapshot does not count (where -> why): gateways of a set that did not
        answer, workers of a ``serve --workers`` gateway that did not. Decisions may go on
        without them; a replica's idle needs them."""
        missing = self.workers.missing if self.workers is not None else []
        return self.unread | {f"worker {w}": "its requests not counted" for w in missing}


def read_snapshot(raw: object) -> FleetSnapshot:
    """``raw`` checked; a GatewayError (the round fails, reported) for a wrong shape, a
    missing key, a wrong type or a count that is negative or absurd."""
    try:
        return msgspec.convert(raw, FleetSnapshot)
    except msgspec.ValidationError as exc:
        raise GatewayError(f"GET /admin/snapshot: unusable answer: {exc}") from None


def _samples(metrics_text: str, name: str) -> list[tuple[dict[str, str], int]]:
    """The samples of counter ``name``: other families' lines are not parsed (one of them
    malformed costs nothing); a malformed or non-count one of ``name`` is a GatewayError."""
    lines = [
        line for line in metrics_text.splitlines() if line.startswith((name + "{", name + " "))
    ]
    try:
        families = list(text_string_to_metric_families("".join(f"{x}\n" for x in lines)))
    except ValueError as exc:
        raise GatewayError(f"GET /metrics: malformed {name}: {exc}") from None
    samples = []
    for sample in (s for family in families for s in family.samples):
        if not (math.isfinite(sample.value) and 0 <= sample.value <= _MAX_COUNT):
            raise GatewayError(f"GET /metrics: {name}{sample.labels} is {sample.value}")
        samples.append((sample.labels, int(sample.value)))
    return samples


def _answered_by_replica(metrics_text: str) -> dict[str, tuple[int, int]]:
    """``isocost_requests_total`` per replica label: (answered, of which status 200). A
    gateway declares the family before its first request; a text without it is something
    else (a proxy's error page), and counting it as no traffic would scale in."""
    if "# TYPE isocost_requests_total " not in metrics_text:
        raise GatewayError("GET /metrics: no isocost_requests_total: not a gateway's metrics")
    counts: dict[str, tuple[int, int]] = {}
    for labels, value in _samples(metrics_text, "isocost_requests_total"):
        replica = labels.get("replica", "")
        total, ok = counts.get(replica, (0, 0))
        counts[replica] = (total + value, ok + value * (labels.get("status") == "200"))
    return counts


def _slo_verdicts(metrics_text: str) -> tuple[int, int]:
    """``isocost_slo_requests_total`` over every pool: (met, judged)."""
    met = judged = 0
    for labels, value in _samples(metrics_text, "isocost_slo_requests_total"):
        judged += value
        met += value * (labels.get("verdict") == "met")
    return met, judged


def _increase(value: int, before: int) -> int:
    """A counter's growth since ``before``; one that went down was reset (the gateway
    restarted), so all of it is new."""
    return value - before if value >= before else value


@dataclass(frozen=True, slots=True)
class GatewayCounters:
    """The gateway's counters the autoscaler reads, cumulative: requests answered per
    replica (answered, of which status 200: the growth of the first is arrivals, of the
    second completions) and SLO verdicts over every pool (met, judged)."""

    answered: dict[str, tuple[int, int]]
    verdicts: tuple[int, int]

    def since(self, before: GatewayCounters) -> GatewayCounters:
        """The growth since ``before``: a counter that went down was reset (its gateway
        restarted), so all of it is new; the verdicts reset together."""
        answered = {}
        for name, (total, ok) in self.answered.items():
            total_before, ok_before = before.answered.get(name, (0, 0))
            answered[name] = (_increase(total, total_before), _increase(ok, ok_before))
        (met, judged), (met_before, judged_before) = self.verdicts, before.verdicts
        if met < met_before or judged < judged_before:
            met_before = judged_before = 0
        return GatewayCounters(answered, (met - met_before, judged - judged_before))

    def plus(self, other: GatewayCounters) -> GatewayCounters:
        """Both together: several gateways' counters (or growths) as one."""
        answered = dict(self.answered)
        for name, (total, ok) in other.answered.items():
            total_here, ok_here = answered.get(name, (0, 0))
            answered[name] = (total_here + total, ok_here + ok)
        met, judged = self.verdicts
        return GatewayCounters(answered, (met + other.verdicts[0], judged + other.verdicts[1]))


def read_counters(metrics_text: str) -> GatewayCounters:
    """A gateway's ``/metrics`` text as its counters; a GatewayError for a text that is no
    gateway's or a sample that is no count."""
    return GatewayCounters(_answered_by_replica(metrics_text), _slo_verdicts(metrics_text))


class FleetGateway(Protocol):
    """What the autoscaler needs of a gateway: ``AdminClient``, ``GatewaySet`` (several
    as one), a fake in unit tests. Every call is a ``GatewayError`` when refused."""

    @property
    def url(self) -> str: ...
    async def snapshot(self) -> dict[str, Any]: ...
    async def counters(self) -> GatewayCounters: ...
    async def add(self, model: str, replica: dict[str, Any]) -> None: ...
    async def drain(self, name: str, by: str) -> None: ...
    async def undrain(self, name: str) -> None: ...
    async def remove(self, name: str) -> None: ...
    async def post_status(self, status: Mapping[str, Any]) -> None: ...


class AdminClient:
    """The admin API calls the autoscaler needs, each a ``GatewayError`` when refused.
    ``host``: the ``host[:port]`` to present where ``url`` names an address (one gateway
    Pod behind a Service's name), as the Host header and the name TLS verifies."""

    def __init__(
        self, session: aiohttp.ClientSession, url: str, token: str, host: str | None = None
    ) -> None:
        self.session = session
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self._tls_name = None if host is None else urlsplit(f"//{host}").hostname
        if host is not None:
            self._headers["Host"] = host

    async def _call(self, method: str, path: str, body: object = None) -> Any:
        try:
            async with self.session.request(
                method,
                self.url + path,
                json=body,
                headers=self._headers,
                server_hostname=self._tls_name,
            ) as response:
                if response.status >= 300:
                    text = (await response.text())[:200]
                    raise GatewayError(
                        f"{method} {path}: HTTP {response.status} {text}", response.status
                    )
                if path == "/metrics":
                    return await response.text()
                return parse_json(await response.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise GatewayError(f"{method} {path}: {exc or type(exc).__name__}") from None
        except ValueError as exc:  # not JSON, or not UTF-8, whatever its content type says
            raise GatewayError(f"{method} {path}: unreadable answer: {exc}") from None

    async def snapshot(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", "/admin/snapshot")
        return result

    async def counters(self) -> GatewayCounters:
        text: str = await self._call("GET", "/metrics")
        return read_counters(text)

    async def add(self, model: str, replica: dict[str, Any]) -> None:
        await self._call("POST", "/admin/replicas", {"model": model, "replica": replica})

    async def drain(self, name: str, by: str) -> None:
        await self._call("POST", f"/admin/replicas/{name}/drain", {"by": by})

    async def undrain(self, name: str) -> None:
        await self._call("POST", f"/admin/replicas/{name}/undrain")

    async def remove(self, name: str) -> None:
        await self._call("DELETE", f"/admin/replicas/{name}")

    async def post_status(self, status: Mapping[str, Any]) -> None:
        await self._call("POST", "/admin/autoscaler", dict(status))
