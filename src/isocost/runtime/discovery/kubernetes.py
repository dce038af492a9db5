"""The Kubernetes provider: ready endpoints of EndpointSlices, through ``kubernetes_asyncio``.

It lists the slices of one Service (label ``kubernetes.io/service-name``) or of a label
selector in one namespace, then watches from the list's ``resourceVersion`` with bookmarks
(each bookmark moves the version the next watch starts from); a watch that ends (the
server's timeout) is started again from there, a ``410 Gone`` (the version is too old)
starts over with a list. While the API server does not answer, the last records stand,
with backoff between attempts.

Each ready address (``conditions.ready`` true or unset, as Kubernetes defines it) with the
chosen port (``port_name``, else ``port``, else the slice's first) is one record, named after
its Pod (``targetRef``) or ``address:port``. What the cost model needs comes from the slice's
``isocost.io/*`` annotations, else its labels (the EndpointSlice controller copies the
Service's labels, not its annotations): ``model``, ``gpu``, ``tensor-parallel``, ``groups``
(comma-separated), ``weight``, ``usd-per-hour``, ``cost-model``, ``scheme``. One Service is
one kind of replica, as one Deployment per GPU type gives.

The API server's answers are read as plain JSON, not the client's models: the models refuse
a whole list for one slice that lacks a required field, which would stop discovery for every
replica. Whatever a slice holds can only make that slice's records ``Malformed`` (one
warning, one counted rejection); a watch event that cannot be applied (not JSON, no name, an
unknown type, an ``ERROR``) ends the watch with one warning and a list follows, so no change
is lost or applied twice. Discovery is down (``discovery_down``) while a list or the opening
of a watch fails or times out; it is up once a watch opens, so a server that lists but
refuses to watch is one warning, not one per retry. Every request has a deadline (a hung
API server or a silently dropped connection is noticed), and bodies and event lines are
read up to a bound. Backoff starts over only after a watch delivered an event.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections.abc import Mapping
from typing import Any, cast

import aiohttp
from aiohttp.http_exceptions import LineTooLong
from kubernetes_asyncio import client, config

from isocost.core.hosts import is_host, is_port
from isocost.openai.http import read_capped
from isocost.runtime.config import KubernetesDiscoveryConfig
from isocost.runtime.discovery import DiscoverySink, Reachability
from isocost.runtime.discovery.records import Malformed, Registration

__all__ = ["ApiError", "KubernetesDiscovery", "slice_records"]

log = logging.getLogger("isocost.discovery")

_ANNOTATION = "isocost.io/"
_SERVICE_LABEL = "kubernetes.io/service-name"
_WATCH_TIMEOUT_S = 300  # the server ends each watch after this; the next resumes from it
_WATCH_GRACE_S = 30.0  # a watch still open this long after that is a hung connection
_LIST_TIMEOUT_S = 30.0  # a list of thousands of endpoints answers in well under this
_MAX_LIST_BYTES = 64 << 20  # ~100,000 endpoints
_MAX_EVENT_BYTES = 4 << 20  # one object per line; etcd keeps objects under 1.5 MiB
_MAX_MESSAGE_CHARS = 300
_INITIAL_BACKOFF_S = 0.1


class ApiError(Exception):
    """A failure the API server answered: its status code and message, on one line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message[:_MAX_MESSAGE_CHARS]}")
        self.status = status


class _Expired(Exception):
    """The version a watch started from is too old (410 Gone): list again."""


class _BadEvent(Exception):
    """A watch event that cannot be applied: what the stream says next cannot be trusted."""


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _field(meta: Mapping[str, Any], name: str) -> str | None:
    for source in ("annotations", "labels"):
        value = _mapping(meta.get(source)).get(_ANNOTATION + name)
        if value is not None:
            if not isinstance(value, str):
                raise ValueError(f"{_ANNOTATION}{name} is not a string")
            return value
    return None


def _slice_port(
    endpoint_slice: Mapping[str, Any], settings: KubernetesDiscoveryConfig
) -> int | str:
    """The slice's port for its endpoints, or why it has none."""
    ports = [_mapping(p) for p in endpoint_slice.get("ports") or [] if isinstance(p, Mapping)]
    if settings.port_name is not None:
        named = next((p for p in ports if p.get("name") == settings.port_name), None)
        if named is None:
            return f"no port named {settings.port_name!r}"
        value = named.get("port")
    elif settings.port is not None:
        return settings.port
    elif ports:
        value = ports[0].get("port")
    else:
        return "no port: set discovery.kubernetes.port or port_name"
    return value if is_port(value) else f"port {value!r} is not a TCP port"


def _host(address: object, address_type: object) -> str | None:
    """``address`` as a URL host: an IP address, or a DNS name in an ``FQDN`` slice."""
    if not isinstance(address, str):
        return None
    if address_type == "FQDN":
        return address if is_host(address) else None
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    return f"[{ip}]" if ip.version == 6 else str(ip)


def slice_records(
    endpoint_slice: Mapping[str, Any], settings: KubernetesDiscoveryConfig
) -> dict[str, Registration | Malformed]:
    """The records of one EndpointSlice (API JSON), keyed ``namespace/slice/address:port``;
    whatever the JSON holds, a part that is wrong is a ``Malformed`` record, never an error."""
    meta = _mapping(endpoint_slice.get("metadata"))
    namespace = _text(meta.get("namespace")) or settings.namespace
    name = _text(meta.get("name"))
    prefix = f"{namespace}/{name or '?'}"
    if name is None:
        return {prefix: Malformed("an EndpointSlice without metadata.name")}
    port = _slice_port(endpoint_slice, settings)
    if isinstance(port, str):
        return {prefix: Malformed(port)}
    try:
        template = _template(meta, settings)
    except ValueError as exc:
        return {prefix: Malformed(str(exc))}
    endpoints = endpoint_slice.get("endpoints") or []
    if not isinstance(endpoints, list):
        return {prefix: Malformed("endpoints is not a list")}
    address_type = endpoint_slice.get("addressType")
    records: dict[str, Registration | Malformed] = {}
    for i, endpoint in enumerate(endpoints):
        at = f"{prefix}/endpoints[{i}]"
        if not isinstance(endpoint, Mapping):
            records[at] = Malformed("an endpoint that is not an object")
            continue
        conditions = endpoint.get("conditions") or {}
        ready = _mapping(conditions).get("ready")
        if not isinstance(conditions, Mapping) or not isinstance(ready, bool | None):
            records[at] = Malformed(f"conditions {str(conditions)[:100]} are not booleans")
            continue
        if ready is False:
            continue
        target = _text(_mapping(endpoint.get("targetRef")).get("name"))
        addresses = endpoint.get("addresses")
        if not isinstance(addresses, list):
            records[at] = Malformed("addresses is not a list")
            continue
        for j, address in enumerate(addresses):
            host = _host(address, address_type)
            if host is None:
                records[f"{at}.addresses[{j}]"] = Malformed(
                    f"address {str(address)[:100]!r} is not a host of a {address_type} slice"
                )
                continue
            key = f"{prefix}/{host}:{port}"
            if isinstance(template, Malformed):
                records[key] = template
                continue
            records[key] = Registration(
                name=target or f"{host}:{port}",
                url=f"{template['scheme']}://{host}:{port}",
                models=[template["model"]],
                gpu=template["gpu"],
                tp=template["tp"],
                groups=template["groups"],
                weight=template["weight"],
                usd_per_hour=template["usd_per_hour"],
                cost_model=template["cost_model"],
                engine=template["engine"],
            )
    return records


def _template(
    meta: Mapping[str, Any], settings: KubernetesDiscoveryConfig
) -> dict[str, Any] | Malformed:
    """The fields every endpoint of the slice shares; ValueError for a bad number."""
    model = settings.model or _field(meta, "model")
    if not model:
        return Malformed("no model: set discovery.kubernetes.model or isocost.io/model")
    usd = _field(meta, "usd-per-hour")
    fields = {
        "model": model,
        "scheme": _field(meta, "scheme") or "http",
        "gpu": _field(meta, "gpu") or "a100-80g",
        "tp": int(_field(meta, "tensor-parallel") or 1),
        "groups": [g for g in (_field(meta, "groups") or "").split(",") if g],
        "weight": float(_field(meta, "weight") or 1.0),
        "usd_per_hour": float(usd) if usd is not None else None,
        "cost_model": _field(meta, "cost-model"),
        "engine": _field(meta, "engine") or "unknown",
    }
    if fields["scheme"] not in ("http", "https"):
        return Malformed(f"isocost.io/scheme {fields['scheme']!r} is not http or https")
    return fields


async def _answer(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body of a successful answer, at most ``limit`` bytes; ApiError for a failure."""
    body = await read_capped(response, limit)
    if body is None:
        raise ValueError(f"an answer over {limit} bytes")
    if response.status != 200:
        raise ApiError(response.status, _status_message(body) or str(response.reason))
    return body


async def _line(response: aiohttp.ClientResponse) -> bytes:
    """The next line of a watch (empty at its end); _BadEvent for one past the bound."""
    try:
        return await response.content.readline(max_line_length=_MAX_EVENT_BYTES)
    except LineTooLong:
        raise _BadEvent(f"an event over {_MAX_EVENT_BYTES} bytes") from None


def _status_message(body: bytes) -> str | None:
    """The ``message`` of a ``Status`` failure body, if it is one."""
    try:
        status = json.loads(body)
    except ValueError:
        return None
    return _text(_mapping(status).get("message"))


class KubernetesDiscovery:
    """Follows the EndpointSlices of one Service (or selector) and reports them to ``sink``."""

    name = "kubernetes"

    def __init__(self, settings: KubernetesDiscoveryConfig, sink: DiscoverySink) -> None:
        self.settings = settings
        self.sink = sink
        self.reachability = Reachability(self.name, "Kubernetes API", sink)
        self.selector = settings.label_selector or f"{_SERVICE_LABEL}={settings.service}"
        self.slices: dict[str, dict[str, Registration | Malformed]] = {}
        self._progress = False  # this round's watch delivered an event
        self._logged_bad: str | None = None  # the bad event last warned of, until progress

    async def _client(self) -> client.ApiClient:
        configuration = client.Configuration()
        if self.settings.kubeconfig is None:
            try:
                config.load_incluster_config(  # type: ignore[no-untyped-call]
                    client_configuration=configuration
                )
                return client.ApiClient(configuration)
            except config.ConfigException:
                pass
        await config.load_kube_config(
            config_file=self.settings.kubeconfig, client_configuration=configuration
        )
        return client.ApiClient(configuration)

    async def run(self) -> None:
        backoff_s = _INITIAL_BACKOFF_S
        api_client: client.ApiClient | None = None
        try:
            while True:
                self._progress = False
                try:
                    if api_client is None:  # no credentials yet is an outage, not a crash
                        api_client = await self._client()
                    await self._follow(client.DiscoveryV1Api(api_client))
                except _Expired:
                    log.info(
                        "resource version expired, listing again",
                        extra={"event": "discovery_relist", "provider": self.name},
                    )
                except _BadEvent as exc:
                    self._bad_event(str(exc))
                except (
                    ApiError,
                    aiohttp.ClientError,
                    TimeoutError,
                    OSError,
                    ValueError,
                    config.ConfigException,
                ) as exc:
                    self.reachability.set(False, exc)
                if self._progress:  # it was following: retry at once, back off from there
                    backoff_s = _INITIAL_BACKOFF_S
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self.settings.max_backoff_ms / 1000)
        finally:
            if api_client is not None:
                await api_client.close()

    def _bad_event(self, reason: str) -> None:
        """One warning per kind of bad event, until a watch delivers a good one."""
        if reason != self._logged_bad:
            self._logged_bad = reason
            log.warning(
                "bad watch event, listing again",
                extra={"event": "discovery_bad_event", "provider": self.name, "error": reason},
            )

    async def _follow(self, api: client.DiscoveryV1Api) -> None:
        """List, report, then watch from the list's version until a watch fails."""
        response = await self._request(api, aiohttp.ClientTimeout(total=_LIST_TIMEOUT_S))
        async with response:
            listing = _mapping(json.loads(await _answer(response, _MAX_LIST_BYTES)))
        version = _text(_mapping(listing.get("metadata")).get("resourceVersion"))
        items = listing.get("items")
        if version is None or not isinstance(items, list):
            raise ValueError("a list answer without items or metadata.resourceVersion")
        self.slices = {}
        for i, item in enumerate(items):
            raw = _mapping(item)
            name = _text(_mapping(raw.get("metadata")).get("name")) or f"?{i}"
            self.slices[name] = slice_records(raw, self.settings)
        self._report()
        while True:
            version = await self._watch(api, version)

    async def _watch(self, api: client.DiscoveryV1Api, version: str) -> str:
        """Apply one watch's events from ``version``; the version the next starts from."""
        response = await self._request(
            api,
            aiohttp.ClientTimeout(
                total=_WATCH_TIMEOUT_S + _WATCH_GRACE_S, sock_connect=_LIST_TIMEOUT_S
            ),
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=_WATCH_TIMEOUT_S,
        )
        async with response:
            if response.status == 410:
                raise _Expired
            if response.status != 200:
                await _answer(response, _MAX_EVENT_BYTES)  # raises its ApiError
            self.reachability.set(True)
            while line := await _line(response):
                if line.strip():
                    version = self._apply(line, version)
                    self._progress = True
                    self._logged_bad = None
        return version

    async def _request(
        self, api: client.DiscoveryV1Api, timeout: aiohttp.ClientTimeout, **query: Any
    ) -> aiohttp.ClientResponse:
        """The raw answer to a list of the selected slices (a watch, with ``watch=True``)."""
        response = await api.list_namespaced_endpoint_slice(
            self.settings.namespace,
            label_selector=self.selector,
            _preload_content=False,
            _request_timeout=timeout,
            **query,
        )
        return cast(aiohttp.ClientResponse, response)

    def _apply(self, line: bytes, version: str) -> str:
        """Apply one watch event; the version it moves to. _Expired for 410 Gone, _BadEvent
        for an event that cannot be applied (another ``ERROR`` among them)."""
        try:
            event = json.loads(line)
        except ValueError:
            raise _BadEvent(f"not JSON: {line[:100]!r}") from None
        event = _mapping(event)
        kind, obj = event.get("type"), _mapping(event.get("object"))
        meta = _mapping(obj.get("metadata"))
        if kind == "ERROR":
            code = obj.get("code")
            message = _text(obj.get("message")) or "an ERROR event"
            if code == 410:
                raise _Expired
            raise _BadEvent(f"ERROR {code!r}: {message[:_MAX_MESSAGE_CHARS]}")
        if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            raise _BadEvent(f"an event of type {str(kind)[:100]!r}")
        version = _text(meta.get("resourceVersion")) or version
        if kind == "BOOKMARK":
            return version
        name = _text(meta.get("name"))
        if name is None:
            raise _BadEvent(f"a {kind} event without metadata.name")
        if kind == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = slice_records(obj, self.settings)
        self._report()
        return version

    def _report(self) -> None:
        merged: dict[str, Registration | Malformed] = {}
        for records in self.slices.values():
            merged.update(records)
        self.sink.replace(self.name, merged)
