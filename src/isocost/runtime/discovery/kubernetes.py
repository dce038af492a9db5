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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from isocost.runtime.config import KubernetesDiscoveryConfig
from isocost.runtime.discovery import DiscoverySink, Reachability
from isocost.runtime.discovery.records import Malformed, Registration

__all__ = ["KubernetesDiscovery", "slice_records"]

log = logging.getLogger("isocost.discovery")

_ANNOTATION = "isocost.io/"
_SERVICE_LABEL = "kubernetes.io/service-name"
_WATCH_TIMEOUT_S = 300  # the server ends each watch after this; the next resumes from it
_INITIAL_BACKOFF_S = 0.1


def _field(meta: Mapping[str, Any], name: str) -> str | None:
    for source in ("annotations", "labels"):
        value = (meta.get(source) or {}).get(_ANNOTATION + name)
        if value is not None:
            return str(value)
    return None


def slice_records(
    endpoint_slice: Mapping[str, Any], settings: KubernetesDiscoveryConfig
) -> dict[str, Registration | Malformed]:
    """The records of one EndpointSlice (API JSON), keyed ``namespace/slice/address:port``."""
    meta = endpoint_slice.get("metadata") or {}
    prefix = f"{meta.get('namespace', settings.namespace)}/{meta.get('name', '?')}"
    ports = endpoint_slice.get("ports") or []
    port = settings.port
    if settings.port_name is not None:
        port = next((p.get("port") for p in ports if p.get("name") == settings.port_name), None)
    elif port is None and ports:
        port = ports[0].get("port")
    if port is None:
        return {prefix: Malformed("no port: set discovery.kubernetes.port or port_name")}
    try:
        template = _template(meta, settings)
    except ValueError as exc:
        return {prefix: Malformed(str(exc))}
    records: dict[str, Registration | Malformed] = {}
    for endpoint in endpoint_slice.get("endpoints") or []:
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        target = (endpoint.get("targetRef") or {}).get("name")
        for address in endpoint.get("addresses") or []:
            host = f"[{address}]" if ":" in address else address
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


class KubernetesDiscovery:
    """Follows the EndpointSlices of one Service (or selector) and reports them to ``sink``."""

    name = "kubernetes"

    def __init__(self, settings: KubernetesDiscoveryConfig, sink: DiscoverySink) -> None:
        self.settings = settings
        self.sink = sink
        self.reachability = Reachability(self.name, "Kubernetes API", sink)
        self.selector = settings.label_selector or f"{_SERVICE_LABEL}={settings.service}"
        self.slices: dict[str, dict[str, Registration | Malformed]] = {}
        self._listed = False  # this round's list succeeded

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
        api_client = await self._client()
        try:
            api = client.DiscoveryV1Api(api_client)
            while True:
                self._listed = False
                try:
                    await self._follow(api, api_client)
                except ApiException as exc:
                    if exc.status == 410:  # too old a version: list again at once
                        log.info(
                            "resource version expired, listing again",
                            extra={"event": "discovery_relist", "provider": self.name},
                        )
                        continue
                    self.reachability.set(False, exc)
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                    self.reachability.set(False, exc)
                if self._listed:  # it was healthy: retry at once, back off from there
                    backoff_s = _INITIAL_BACKOFF_S
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self.settings.max_backoff_ms / 1000)
        finally:
            await api_client.close()

    async def _follow(self, api: client.DiscoveryV1Api, api_client: client.ApiClient) -> None:
        """List, report, then watch from the list's version until a watch fails."""
        namespace = self.settings.namespace
        listing = await api.list_namespaced_endpoint_slice(namespace, label_selector=self.selector)
        version = str(listing.metadata.resource_version)
        self.slices = {}
        for item in listing.items:
            raw = api_client.sanitize_for_serialization(item)
            self.slices[raw["metadata"]["name"]] = slice_records(raw, self.settings)
        self._report()
        self._listed = True
        self.reachability.set(True)
        while True:
            async with watch.Watch() as stream:
                events = stream.stream(
                    api.list_namespaced_endpoint_slice,
                    namespace,
                    label_selector=self.selector,
                    resource_version=version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=_WATCH_TIMEOUT_S,
                )
                async for event in events:
                    raw = event["raw_object"]
                    version = str(raw["metadata"]["resourceVersion"])
                    if event["type"] == "BOOKMARK":
                        continue
                    name = raw["metadata"]["name"]
                    if event["type"] == "DELETED":
                        self.slices.pop(name, None)
                    else:
                        self.slices[name] = slice_records(raw, self.settings)
                    self._report()

    def _report(self) -> None:
        merged: dict[str, Registration | Malformed] = {}
        for records in self.slices.values():
            merged.update(records)
        self.sink.replace(self.name, merged)
