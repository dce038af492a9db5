"""Routing-loop guards: a gateway never takes itself as a replica, and hops are counted.

A gateway listed as its own replica (or two gateways listing each other) would send one
request round and round. Two guards: a replica URL that is this gateway's listen address
is refused (the admin API and the config file), and every forwarded request carries
``x-isocost-hops`` (the client's count plus one), so a loop through other gateways ends
with ``508 Loop Detected`` once the count passes ``MAX_HOPS``.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from urllib.parse import urlsplit

from isocost.core.errors import ConfigError
from isocost.openai.errors import ApiError
from isocost.runtime.config import GatewayConfig, normalize_replica_url

__all__ = ["HOPS_HEADER", "MAX_HOPS", "ListenAddress", "hops"]

HOPS_HEADER = "x-isocost-hops"
MAX_HOPS = 4  # gateways a request may pass before this one; a real chain has one or two

_WILDCARDS = ("0.0.0.0", "::", "")
_LOOPBACK = ("localhost", "127.0.0.1", "::1")


def hops(headers: Mapping[str, str]) -> int:
    """The gateways ``headers``' request has already passed; 400 when the count is no
    number, 508 (Loop Detected) when it is over ``MAX_HOPS``."""
    raw = headers.get(HOPS_HEADER)
    if raw is None:
        return 0
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 6):
        raise ApiError(400, f"{HOPS_HEADER} must be a small integer", code="bad_header")
    count = int(raw)
    if count > MAX_HOPS:
        raise ApiError(
            508,
            f"routing loop: the request passed {count} gateways (at most {MAX_HOPS})",
            code="loop_detected",
        )
    return count


def _canonical(host: str) -> str:
    """``host`` lower-cased, an IP address in its one short form (``::1``, not
    ``0:0:0:0:0:0:0:1``; an IPv4-mapped IPv6 address as the IPv4 address it reaches)."""
    host = host.strip("[]").lower()
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return str(mapped or address)


def _is_local(host: str) -> bool:
    """A name or address that means this machine."""
    if host in ("localhost", socket.gethostname().lower()) or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


class ListenAddress:
    """Where this gateway listens (set once its socket is bound): replica URLs that reach
    it are refused. Compares names and addresses, without DNS: a loop through another
    name is caught by the hop count instead."""

    def __init__(self) -> None:
        self.host: str | None = None
        self.port: int | None = None

    def set(self, host: str, port: int) -> None:
        self.host, self.port = _canonical(host), port

    def reaches(self, url: str) -> bool:
        """True when ``url`` (a normalized replica URL) names this gateway: the same
        host; any local name when it listens on every address; ``localhost`` and the
        loopback addresses for each other; ``0.0.0.0`` (connecting there reaches a local
        listener)."""
        if self.host is None:
            return False
        parts = urlsplit(url)
        if parts.port != self.port:
            return False
        host = _canonical(parts.hostname or "")
        if host == self.host or host in _WILDCARDS:
            return True
        if self.host in _WILDCARDS:
            return _is_local(host)
        return host in _LOOPBACK and self.host in _LOOPBACK

    def check(self, url: str) -> None:
        """ValueError when ``url`` names this gateway."""
        if self.reaches(url):
            raise ValueError(
                f"replica {url} is this gateway's own address ({self.host}:{self.port}): "
                "it would route requests to itself"
            )

    def check_config(self, config: GatewayConfig, source: str) -> None:
        """ConfigError naming the first replica of ``config`` that is this gateway."""
        for i, pool in enumerate(config.pools):
            for j, replica in enumerate(pool.replicas):
                try:
                    self.check(normalize_replica_url(replica.url))
                except ValueError as exc:
                    key = f"pools[{i}].replicas[{j}].url"
                    raise ConfigError(source, str(exc), key=key) from None
