"""The Kubernetes provider, through ``kubernetes_asyncio``: the ready endpoints of
EndpointSlices, or the ready Pods of an InferencePool.

Two ways to name the replicas. ``service`` or ``label_selector``: the EndpointSlices of a
Service (label ``kubernetes.io/service-name``) or of a selector, each ready address one
record. ``inference_pool``: the ``inference.networking.k8s.io/v1`` InferencePool of that
name, whose ``spec.selector.matchLabels`` picks the Pods and whose ``spec.targetPorts``
give each Pod's replicas, as a Gateway API Inference Extension endpoint picker reads it;
when its selector or ports change the Pods are followed anew with them, and with the pool
absent the provider has no replicas (one warning) until it appears. ``kube_records`` turns
the objects into records.

Each collection (the slices; the pool and its Pods) is listed, then watched from the
list's ``resourceVersion`` with bookmarks (each bookmark moves the version the next watch
starts from); a watch that ends (the server's timeout) is started again from there, a
``410 Gone`` (the version is too old) starts the provider over with a list. While the API
server does not answer, the last records stand, with backoff between attempts.

The API server's answers are read as plain JSON, not the client's models (see
``kube_records``): whatever an object holds can only make its own records ``Malformed``
(one warning, one counted rejection); a watch event that cannot be applied (not JSON, no
name, an unknown type, an ``ERROR``) ends the watch with one warning and a list follows, so
no change is lost or applied twice. Discovery is down (``discovery_down``) while a list or
the opening of a watch fails or times out; it is up once every watch the provider needs is
open, so a server that lists but refuses to watch is one warning, not one per retry. Every
request has a deadline (a hung API server or a silently dropped connection is noticed), and
bodies and event lines are read up to a bound. Backoff starts over only after a watch
delivered an event.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Generic, TypeVar, cast

import aiohttp
from aiohttp.http_exceptions import LineTooLong
from kubernetes_asyncio import client, config

from isocost.core.jsontext import parse_json
from isocost.openai.http import read_capped
from isocost.runtime.config import KubernetesDiscoveryConfig
from isocost.runtime.discovery import DiscoverySink, Reachability
from isocost.runtime.discovery.kube_records import (
    PoolTarget,
    as_mapping,
    as_text,
    pod_records,
    pool_target,
    slice_records,
)
from isocost.runtime.discovery.records import Malformed, Registration

__all__ = ["ApiError", "KubernetesDiscovery", "slice_records"]

log = logging.getLogger("isocost.discovery")

_SERVICE_LABEL = "kubernetes.io/service-name"
_POOL_GROUP, _POOL_VERSION = "inference.networking.k8s.io", "v1"
_WATCH_TIMEOUT_S = 300  # the server ends each watch after this; the next resumes from it
_WATCH_GRACE_S = 30.0  # a watch still open this long after that is a hung connection
_LIST_TIMEOUT_S = 30.0  # a list of thousands of endpoints answers in well under this
_MAX_LIST_BYTES = 64 << 20  # ~100,000 endpoints, or some thousands of Pods
_MAX_EVENT_BYTES = 4 << 20  # one object per line; etcd keeps objects under 1.5 MiB
_MAX_MESSAGE_CHARS = 300
_INITIAL_BACKOFF_S = 0.1

_Records = dict[str, Registration | Malformed]  # a source key's record
_Item = TypeVar("_Item")


class ApiError(Exception):
    """A failure the API server answered: its status code and message, on one line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message[:_MAX_MESSAGE_CHARS]}")
        self.status = status


class _Expired(Exception):
    """The version a watch started from is too old (410 Gone): list again."""


class _BadEvent(Exception):
    """A watch event that cannot be applied: what the stream says next cannot be trusted."""


async def _first(*jobs: Coroutine[Any, Any, Any]) -> None:
    """Run ``jobs`` together until one ends: its exception, if any, propagates, and the
    others are cancelled (two watches followed at once, or one until a signal)."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Collection(Generic[_Item]):
    """One collection of the API, listed, then watched from the list's version on: ``items``
    holds what ``read`` made of each object, by name, and ``changed`` gets them after every
    change. ``request`` is the client's list call for the collection (its query fixed),
    which watches too; a failure propagates (``_Expired``, ``_BadEvent``, ``ApiError``, ...)
    and the provider starts over."""

    def __init__(
        self,
        request: Callable[..., Awaitable[Any]],
        read: Callable[[Mapping[str, Any]], _Item],
        changed: Callable[[dict[str, _Item]], None],
        provider: KubernetesDiscovery,
    ) -> None:
        self.request, self.read, self.changed, self.provider = request, read, changed, provider
        self.items: dict[str, _Item] = {}
        self.version = ""
        self.watching = False  # a watch has opened

    async def follow(self) -> None:
        """List, then watch until a watch fails."""
        await self.list()
        await self.watch()

    async def list(self) -> None:
        response = await self._open(aiohttp.ClientTimeout(total=_LIST_TIMEOUT_S))
        async with response:
            listing = as_mapping(parse_json(await _answer(response, _MAX_LIST_BYTES)))
        version = as_text(as_mapping(listing.get("metadata")).get("resourceVersion"))
        items = listing.get("items")
        if version is None or not isinstance(items, list):
            raise ValueError("a list answer without items or metadata.resourceVersion")
        self.items = {}
        for i, item in enumerate(items):
            raw = as_mapping(item)
            name = as_text(as_mapping(raw.get("metadata")).get("name")) or f"?{i}"
            self.items[name] = self.read(raw)
        self.version = version
        self.changed(self.items)

    async def watch(self) -> None:
        """Watch from ``version``, one watch after another, until one fails."""
        while True:
            response = await self._open(
                aiohttp.ClientTimeout(
                    total=_WATCH_TIMEOUT_S + _WATCH_GRACE_S, sock_connect=_LIST_TIMEOUT_S
                ),
                watch=True,
                resource_version=self.version,
                allow_watch_bookmarks=True,
                timeout_seconds=_WATCH_TIMEOUT_S,
            )
            async with response:
                if response.status == 410:
                    raise _Expired
                if response.status != 200:
                    await _answer(response, _MAX_EVENT_BYTES)  # raises its ApiError
                self.watching = True
                self.provider.watch_opened()
                while line := await _line(response):
                    if line.strip():
                        self._apply(line)
                        self.provider.event_applied()

    async def _open(self, timeout: aiohttp.ClientTimeout, **query: Any) -> aiohttp.ClientResponse:
        """The raw answer to a list of the collection (a watch, with ``watch=True``)."""
        response = await self.request(_preload_content=False, _request_timeout=timeout, **query)
        return cast(aiohttp.ClientResponse, response)

    def _apply(self, line: bytes) -> None:
        """Apply one watch event and move ``version`` on. _Expired for 410 Gone, _BadEvent
        for an event that cannot be applied (another ``ERROR`` among them)."""
        try:
            event = parse_json(line)
        except ValueError:
            raise _BadEvent(f"not JSON: {line[:100]!r}") from None
        event = as_mapping(event)
        kind, obj = event.get("type"), as_mapping(event.get("object"))
        meta = as_mapping(obj.get("metadata"))
        if kind == "ERROR":
            code = obj.get("code")
            message = as_text(obj.get("message")) or "an ERROR event"
            if code == 410:
                raise _Expired
            raise _BadEvent(f"ERROR {code!r}: {message[:_MAX_MESSAGE_CHARS]}")
        if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            raise _BadEvent(f"an event of type {str(kind)[:100]!r}")
        self.version = as_text(meta.get("resourceVersion")) or self.version
        if kind == "BOOKMARK":
            return
        name = as_text(meta.get("name"))
        if name is None:
            raise _BadEvent(f"a {kind} event without metadata.name")
        if kind == "DELETED":
            self.items.pop(name, None)
        else:
            self.items[name] = self.read(obj)
        self.changed(self.items)


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
        status = parse_json(body)
    except ValueError:
        return None
    return as_text(as_mapping(status).get("message"))


class KubernetesDiscovery:
    """Follows the EndpointSlices of one Service (or selector), or the Pods of one
    InferencePool, and reports their records to ``sink``."""

    name = "kubernetes"

    def __init__(self, settings: KubernetesDiscoveryConfig, sink: DiscoverySink) -> None:
        self.settings = settings
        self.sink = sink
        self.reachability = Reachability(self.name, "Kubernetes API", sink)
        self._watches: list[_Collection[Any]] = []  # what this round follows
        self._progress = False  # this round's watch delivered an event
        self._logged_bad: str | None = None  # the bad event last warned of, until progress
        # inference_pool: what the pool picks (None: no such pool), set when it changes
        self._target: PoolTarget | Malformed | None = None
        self._retarget = asyncio.Event()
        self._pool_present: bool | None = None  # None: not listed yet

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
        follow = self._follow_pool if self.settings.inference_pool else self._follow_slices
        backoff_s = _INITIAL_BACKOFF_S
        api_client: client.ApiClient | None = None
        try:
            while True:
                self._progress = False
                try:
                    if api_client is None:  # no credentials yet is an outage, not a crash
                        api_client = await self._client()
                    await follow(api_client)
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

    def watch_opened(self) -> None:
        """Up once every watch of this round is open: one refused is an outage."""
        if all(collection.watching for collection in self._watches):
            self.reachability.set(True)

    def event_applied(self) -> None:
        """A watch delivered: the backoff starts over, a bad event is news again."""
        self._progress = True
        self._logged_bad = None

    def _report(self, records_by_object: Mapping[str, _Records]) -> None:
        """Every object's records, as the provider's whole membership."""
        merged: _Records = {}
        for records in records_by_object.values():
            merged.update(records)
        self.sink.replace(self.name, merged)

    async def _follow_slices(self, api_client: client.ApiClient) -> None:
        """The slices of the Service or selector, listed, then watched."""
        api = client.DiscoveryV1Api(api_client)
        selector = self.settings.label_selector or f"{_SERVICE_LABEL}={self.settings.service}"
        slices = _Collection(
            functools.partial(
                api.list_namespaced_endpoint_slice, self.settings.namespace, label_selector=selector
            ),
            functools.partial(slice_records, settings=self.settings),
            self._report,
            self,
        )
        self._watches = [slices]
        await slices.follow()

    async def _follow_pool(self, api_client: client.ApiClient) -> None:
        """The InferencePool, listed, then watched, beside its Pods."""
        pool_name = self.settings.inference_pool
        pools = _Collection(
            functools.partial(
                client.CustomObjectsApi(api_client).list_namespaced_custom_object,
                _POOL_GROUP,
                _POOL_VERSION,
                self.settings.namespace,
                "inferencepools",
                field_selector=f"metadata.name={pool_name}",
            ),
            pool_target,
            self._pool_changed,
            self,
        )
        self._watches = [pools]
        await pools.list()
        await _first(pools.watch(), self._follow_pods(client.CoreV1Api(api_client), pools))

    def _pool_changed(self, pools: Mapping[str, PoolTarget | Malformed]) -> None:
        """A new selector or ports (or none) wakes ``_follow_pods``; anything else, not."""
        target = pools.get(self.settings.inference_pool or "")
        if target != self._target:
            self._target = target
            self._retarget.set()

    async def _follow_pods(self, core: client.CoreV1Api, pools: _Collection[Any]) -> None:
        """The Pods the pool selects, listed, then watched, followed anew (their records
        replaced by the new list's) whenever the pool's selector or ports change; no pool,
        or one that names no Pods, is no replicas."""
        while True:
            self._retarget.clear()
            target = self._target
            self._note_pool(target is not None)
            if isinstance(target, PoolTarget):
                pods = _Collection(
                    functools.partial(
                        core.list_namespaced_pod,
                        self.settings.namespace,
                        label_selector=target.selector,
                    ),
                    functools.partial(pod_records, ports=target.ports, settings=self.settings),
                    self._report,
                    self,
                )
                self._watches = [pools, pods]
                await _first(self._retarget.wait(), pods.follow())
            else:
                self._watches = [pools]
                self.sink.replace(self.name, {} if target is None else {self._pool_key: target})
                self.watch_opened()  # the pool's watch is all there is to follow now
                await self._retarget.wait()

    @property
    def _pool_key(self) -> str:
        return f"{self.settings.namespace}/inferencepools/{self.settings.inference_pool}"

    def _note_pool(self, present: bool) -> None:
        """One warning when the pool is missing, one line when it is back."""
        if present == self._pool_present:
            return
        if not present:
            log.warning(
                "InferencePool not found, no replicas until it exists",
                extra={
                    "event": "discovery_pool_missing",
                    "provider": self.name,
                    "pool": self._pool_key,
                },
            )
        elif self._pool_present is False:
            log.info(
                "InferencePool found, following its pods",
                extra={
                    "event": "discovery_pool_found",
                    "provider": self.name,
                    "pool": self._pool_key,
                },
            )
        self._pool_present = present
