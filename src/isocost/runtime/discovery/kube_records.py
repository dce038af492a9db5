"""Kubernetes API JSON as discovery records: EndpointSlices, Pods, and the InferencePool
that selects the Pods.

Pure: the objects come in as the API server sent them (plain JSON, not the client's
models, which refuse a whole list for one object missing a required field), and whatever
an object holds can only make its own records ``Malformed``, never raise. What the cost
model needs comes from the object's ``isocost.io/*`` annotations, else its labels
(``model``, ``gpu``, ``tensor-parallel``, ``groups`` comma-separated, ``weight``,
``usd-per-hour``, ``cost-model``, ``scheme``, ``engine``): the same keys on a slice (whose
labels the EndpointSlice controller copies from its Service) and on a Pod.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from isocost.core.hosts import is_host, is_port
from isocost.runtime.config import KubernetesDiscoveryConfig
from isocost.runtime.discovery.records import Malformed, Registration

__all__ = ["PoolTarget", "as_mapping", "as_text", "pod_records", "pool_target", "slice_records"]

_ANNOTATION = "isocost.io/"
# What a label key and value may hold (a looser form of Kubernetes' rules): enough to
# keep a hostile selector from smuggling terms into the ``labelSelector`` it becomes.
_LABEL_KEY = re.compile(r"[A-Za-z0-9][-A-Za-z0-9_./]{0,316}")
_LABEL_VALUE = re.compile(r"[-A-Za-z0-9_.]{0,63}")


def as_mapping(value: object) -> Mapping[str, Any]:
    """``value`` if it is a JSON object, else an empty one: junk reads as absent."""
    return value if isinstance(value, Mapping) else {}


def as_text(value: object) -> str | None:
    """``value`` if it is a non-empty string."""
    return value if isinstance(value, str) and value else None


def _list(value: object) -> list[Any]:
    """``value`` if it is a JSON array, else an empty one."""
    return value if isinstance(value, list) else []


def _field(meta: Mapping[str, Any], name: str) -> str | None:
    for source in ("annotations", "labels"):
        value = as_mapping(meta.get(source)).get(_ANNOTATION + name)
        if value is not None:
            if not isinstance(value, str):
                raise ValueError(f"{_ANNOTATION}{name} is not a string")
            return value
    return None


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


def _template(
    meta: Mapping[str, Any], settings: KubernetesDiscoveryConfig
) -> dict[str, Any] | Malformed:
    """The fields every replica of the object shares; ValueError for a bad number."""
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


def _registration(template: dict[str, Any], name: str, host: str, port: int) -> Registration:
    return Registration(
        name=name,
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


# -- EndpointSlices -------------------------------------------------------------------------


def _slice_port(
    endpoint_slice: Mapping[str, Any], settings: KubernetesDiscoveryConfig
) -> int | str:
    """The slice's port for its endpoints, or why it has none."""
    ports = [as_mapping(p) for p in endpoint_slice.get("ports") or [] if isinstance(p, Mapping)]
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


def _identity(
    obj: Mapping[str, Any], settings: KubernetesDiscoveryConfig, collection: str
) -> tuple[Mapping[str, Any], str | None, str]:
    """An object's metadata, its name (None: it has none) and the prefix of its records'
    keys, ``namespace/<collection>name``."""
    meta = as_mapping(obj.get("metadata"))
    namespace = as_text(meta.get("namespace")) or settings.namespace
    name = as_text(meta.get("name"))
    return meta, name, f"{namespace}/{collection}{name or '?'}"


def slice_records(
    endpoint_slice: Mapping[str, Any], settings: KubernetesDiscoveryConfig
) -> dict[str, Registration | Malformed]:
    """The records of one EndpointSlice, keyed ``namespace/slice/address:port``: one per
    ready address (``conditions.ready`` true or unset, as Kubernetes defines it) with the
    chosen port (``port_name``, else ``port``, else the slice's first), named after its Pod
    (``targetRef``) or ``address:port``."""
    meta, name, prefix = _identity(endpoint_slice, settings, "")
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
        ready = as_mapping(conditions).get("ready")
        if not isinstance(conditions, Mapping) or not isinstance(ready, bool | None):
            records[at] = Malformed(f"conditions {str(conditions)[:100]} are not booleans")
            continue
        if ready is False:
            continue
        target = as_text(as_mapping(endpoint.get("targetRef")).get("name"))
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
            records[key] = _registration(template, target or f"{host}:{port}", host, port)
    return records


# -- an InferencePool and its Pods ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolTarget:
    """What an InferencePool picks: the Pods of ``selector`` (a ``labelSelector`` query),
    each serving on every one of ``ports``."""

    selector: str
    ports: tuple[int, ...]


def pool_target(pool: Mapping[str, Any]) -> PoolTarget | Malformed:
    """The Pods and ports an ``inference.networking.k8s.io/v1`` InferencePool names
    (``spec.selector.matchLabels``, ``spec.targetPorts[].number``), or why it names none."""
    spec = as_mapping(pool.get("spec"))
    labels = as_mapping(spec.get("selector")).get("matchLabels")
    if not isinstance(labels, Mapping) or not labels:
        return Malformed("an InferencePool without spec.selector.matchLabels")
    terms: list[str] = []
    for key, value in sorted(labels.items(), key=lambda item: str(item[0])):
        if not (
            isinstance(key, str)
            and isinstance(value, str)
            and _LABEL_KEY.fullmatch(key)
            and _LABEL_VALUE.fullmatch(value)
        ):
            return Malformed(f"selector label {str(key)[:100]}={str(value)[:100]} is not a label")
        terms.append(f"{key}={value}")
    numbers = [as_mapping(port).get("number") for port in _list(spec.get("targetPorts"))]
    if not numbers:
        return Malformed("an InferencePool without spec.targetPorts")
    ports = [number for number in numbers if is_port(number)]
    if len(ports) < len(numbers):
        bad = next(number for number in numbers if not is_port(number))
        return Malformed(f"target port {bad!r:.100} is not a TCP port")
    return PoolTarget(",".join(terms), tuple(dict.fromkeys(ports)))


def pod_records(
    pod: Mapping[str, Any], ports: Sequence[int], settings: KubernetesDiscoveryConfig
) -> dict[str, Registration | Malformed]:
    """The records of one Pod an InferencePool selects, keyed ``namespace/pods/pod:port``:
    none unless it is Running, Ready and not being deleted; then one per port, named
    ``pod`` (one port) or ``pod:port`` (several: data-parallel ranks, say), at its
    ``status.podIP``. A Pod with a wrong part is one ``Malformed`` record."""
    meta, name, prefix = _identity(pod, settings, "pods/")
    if name is None:
        return {prefix: Malformed("a Pod without metadata.name")}
    status = as_mapping(pod.get("status"))
    ready = any(
        as_mapping(condition).get("type") == "Ready"
        and as_mapping(condition).get("status") == "True"
        for condition in _list(status.get("conditions"))
    )
    if meta.get("deletionTimestamp") is not None or status.get("phase") != "Running" or not ready:
        return {}
    host = _host(status.get("podIP"), "IP")
    if host is None:
        return {prefix: Malformed(f"podIP {status.get('podIP')!r:.100} is no IP address")}
    try:
        template = _template(meta, settings)
    except ValueError as exc:
        return {prefix: Malformed(str(exc))}
    if isinstance(template, Malformed):
        return {prefix: template}
    return {
        f"{prefix}:{port}": _registration(
            template, name if len(ports) == 1 else f"{name}:{port}", host, port
        )
        for port in ports
    }
