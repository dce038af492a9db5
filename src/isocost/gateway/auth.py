"""API keys with per-key request and token budgets, and the admin token.

Keys are compared in constant time (``hmac.compare_digest``) against every configured key,
so neither a wrong key's length nor its prefix shows in the response time, and the key
itself is never stored anywhere but here: logs and metrics carry the key's ``name``. The
comparison is on bytes (``secret_bytes``): a header with bytes that are no UTF-8 (which
aiohttp hands on as surrogates) is a wrong key, never an encoding error.

Budgets are token buckets refilled continuously: ``requests_per_minute`` buckets hold one
minute's worth and each request takes one; ``tokens_per_minute`` buckets are charged the
prompt estimate plus ``max_tokens`` up front. A request that finds its bucket short is
refused with the seconds until it would fit (``Retry-After``). What other gateways charged
the same key (the state bus) is spent here after the fact. The clock is passed in.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass

from isocost.runtime.config import AuthConfig

__all__ = [
    "ApiKey",
    "Authenticator",
    "TokenBucket",
    "bearer_token",
    "go_duration",
    "rate_limit_headers",
    "secret_bytes",
]


class TokenBucket:
    """Capacity ``per_minute``, refilled at ``per_minute / 60`` per second."""

    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = per_minute
        self.rate_per_s = per_minute / 60.0
        self.level = per_minute
        self.updated_at = now

    def level_at(self, now: float) -> float:
        """What the bucket holds at ``now`` (below 0 while spends made after the fact, or
        by other gateways, are being paid back)."""
        return min(self.capacity, self.level + (now - self.updated_at) * self.rate_per_s)

    def charge_for(self, amount: float) -> float:
        """What ``take`` takes for ``amount``: a request larger than the bucket waits for
        a full bucket once and takes it, rather than never fitting."""
        return min(amount, self.capacity)

    def take(self, amount: float, now: float) -> float:
        """Take ``charge_for(amount)`` and return 0, or take nothing and return the
        seconds to wait."""
        self.level = self.level_at(now)
        self.updated_at = now
        need = self.charge_for(amount)
        if self.level >= need:
            self.level -= need
            return 0.0
        return (need - self.level) / self.rate_per_s

    def spend(self, amount: float, now: float) -> None:
        """Take ``amount`` after the fact, even below empty: what a request used but could
        not be charged up front (an uncapped answer), or what another gateway charged the
        same key, delays the key's next requests."""
        self.level = self.level_at(now)
        self.updated_at = now
        self.level -= amount


@dataclass(slots=True)
class ApiKey:
    name: str
    secret: bytes
    requests: TokenBucket | None
    tokens: TokenBucket | None
    priority: int = 0  # of its requests that send no x-priority
    max_priority: int = 0  # the highest x-priority it may send
    max_in_flight: int | None = None  # its requests at once, over every gateway


def rate_limit_headers(key: ApiKey, now: float) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers for ``key``'s budgets at ``now``: the limit per
    minute, what is left (whole units, never below 0), and the time until the bucket is
    full again, as a Go duration (``1.5s``, ``6m0s``) as OpenAI writes it. Clients and
    proxies (LiteLLM, the SDKs' raw responses) pace themselves by them."""
    headers: dict[str, str] = {}
    for kind, bucket in (("requests", key.requests), ("tokens", key.tokens)):
        if bucket is None:
            continue
        level = bucket.level_at(now)
        headers[f"x-ratelimit-limit-{kind}"] = str(round(bucket.capacity))
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(level)))
        reset_s = max(0.0, bucket.capacity - level) / bucket.rate_per_s
        headers[f"x-ratelimit-reset-{kind}"] = go_duration(reset_s)
    return headers


def go_duration(seconds: float) -> str:
    """``seconds`` as Go prints a duration, to the millisecond: ``0s``, ``20ms``, ``1.5s``,
    ``6m0s``, ``1h2m3s``."""
    millis = round(seconds * 1000)
    if millis == 0:
        return "0s"
    if millis < 1000:
        return f"{millis}ms"
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    text = f"{millis / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    return f"{hours}h{text}" if hours else text


def secret_bytes(text: str) -> bytes:
    """``text`` as bytes for a comparison; any str encodes, lone surrogates included."""
    return text.encode("utf-8", "surrogatepass")


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class Authenticator:
    """Resolves bearer tokens to keys; ``enabled`` is False when no key is configured."""

    def __init__(self, config: AuthConfig, now: float) -> None:
        self.config = config
        self.keys: list[ApiKey] = []
        self._by_name: dict[str, ApiKey] = {}
        for entry in config.api_keys:
            secret = entry.key if entry.key is not None else os.environ[entry.key_env or ""]
            self.keys.append(
                ApiKey(
                    name=entry.name,
                    secret=secret_bytes(secret),
                    requests=None
                    if entry.requests_per_minute is None
                    else TokenBucket(entry.requests_per_minute, now),
                    tokens=None
                    if entry.tokens_per_minute is None
                    else TokenBucket(entry.tokens_per_minute, now),
                    priority=entry.priority,
                    max_priority=entry.priority
                    if entry.max_priority is None
                    else entry.max_priority,
                    max_in_flight=entry.max_in_flight,
                )
            )
            self._by_name[entry.name] = self.keys[-1]
        admin = config.admin_token
        if admin is None and config.admin_token_env is not None:
            admin = os.environ[config.admin_token_env]
        self._admin = secret_bytes(admin) if admin else None
        self._admin_token = admin or None

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    @property
    def admin_enabled(self) -> bool:
        return self._admin is not None

    def admin_headers(self) -> dict[str, str]:
        """Headers that pass the admin check (a worker of ``serve --workers`` making its
        siblings' changes on itself); empty without an admin token."""
        return {"X-Admin-Token": self._admin_token} if self._admin_token else {}

    def key_for(self, token: str | None) -> ApiKey | None:
        """The key whose secret equals ``token``, checking every key in constant time."""
        if token is None:
            return None
        candidate = secret_bytes(token)
        found: ApiKey | None = None
        for key in self.keys:
            if hmac.compare_digest(candidate, key.secret):
                found = key
        return found

    def named(self, name: str) -> ApiKey | None:
        """The key configured as ``name`` (names are unique: ``parse_config``)."""
        return self._by_name.get(name)

    def is_admin(self, token: str | None) -> bool:
        if self._admin is None or token is None:
            return False
        return hmac.compare_digest(secret_bytes(token), self._admin)
