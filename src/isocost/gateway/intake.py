"""Request intake: the checks a client request passes before it reaches the router.

In order: the hop count (a routing loop ends in 508) and the client headers the gateway
reads (printable UTF-8) -> auth (the API key, then its requests-per-minute budget) ->
declared body length -> ``100 Continue`` when the client asked for it (so a bad key or an
over-large body is refused before the client sends it) -> body read (deadline, actual
length) -> decoded body (a valid OpenAI body) -> pool (a served model) -> prompt and output
cap limits -> the key's tokens-per-minute budget -> the routing view (the prompt's block
hashes: computed last, so a refused prompt costs no hashing). The output cap is the one
the engine runs (``isocost.openai.requests.output_cap``). Each refusal is a ``Rejection``
carrying the reason it is counted under; it is raised here once and counted once, where
every error becomes an HTTP answer (the gateway's error middleware), so no check both
counts and raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Protocol

from aiohttp import web

from isocost.gateway.auth import ApiKey, Authenticator, bearer_token, rate_limit_headers
from isocost.gateway.body import routing_view, summarize
from isocost.gateway.loops import ListenAddress, hops
from isocost.gateway.routing import FAIRNESS_HEADER, GatewayRequest
from isocost.gateway.upstreams import Pool
from isocost.openai.errors import ApiError
from isocost.openai.http import UNREADABLE, refuse_expectation, send_continue, unreadable
from isocost.openai.requests import RequestError
from isocost.runtime.config import GatewayConfig

__all__ = [
    "CLIENT_HEADERS",
    "Intake",
    "KeyPeers",
    "Rejection",
    "defer_continue",
]

# Headers whose values the gateway keeps as text: in logs, decisions, metric labels, or
# forwarded (x-request-id). x-session-id is only hashed, from its bytes: any value goes.
CLIENT_HEADERS = (
    "x-request-id",
    "x-isocost-class",
    "x-priority",
    "x-deadline-ms",
    "x-tpot-ms",
    FAIRNESS_HEADER,
)


class Rejection(ApiError):
    """A request the gateway refuses itself; ``reason`` labels the rejection counters
    (``isocost_gateway_rejections_total`` and the admin snapshot's ``rejections``), ``key``
    names the API key it came with once that is known (``isocost_api_key_requests_total``)."""

    def __init__(
        self,
        reason: str,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        retry_after_s: float | None = None,
        key: str | None = None,
    ) -> None:
        super().__init__(status, message, code=code, param=param, retry_after_s=retry_after_s)
        self.reason = reason
        self.key = key


class KeyPeers(Protocol):
    """The other gateways' side of the keys (the state bus): it hears what this gateway
    charged to a key's budgets and when its ``in_flight`` changed, and says what the
    others hold."""

    def spent(self, key: str, *, requests: int = 0, tokens: int = 0) -> None: ...

    def holding_changed(self) -> None: ...

    def held_by_peers(self, key: str) -> int: ...


class Intake:
    """Auth, limits and the routing view of client requests; see the module docstring."""

    def __init__(
        self, config: GatewayConfig, pools: Mapping[str, Pool], block_tokens: int, now: float
    ) -> None:
        self.pools = pools
        self.block_tokens = block_tokens
        self.limits = config.limits
        self.auth = Authenticator(config.auth, now)
        self.listen = ListenAddress()
        self.peers: KeyPeers | None = None
        self.in_flight: Counter[str] = Counter()  # this gateway's requests per key name

    def charge_peer(self, key_name: str, requests: int, tokens: int, now: float) -> bool:
        """Spend what another gateway charged ``key_name``; False when no key has that
        name here (the gateways' configs differ)."""
        key = self.auth.named(key_name)
        if key is None:
            return False
        if key.requests is not None and requests > 0:
            key.requests.spend(requests, now)
        if key.tokens is not None and tokens > 0:
            key.tokens.spend(tokens, now)
        return True

    def rate_limit_headers(self, key_name: str | None) -> dict[str, str]:
        """``x-ratelimit-*`` for the key named ``key_name`` now; empty without budgets."""
        key = None if key_name is None else self.auth.named(key_name)
        return {} if key is None else rate_limit_headers(key, time.monotonic())

    def budget_levels(self, now: float) -> Iterator[tuple[str, str, float]]:
        """(key name, ``requests`` or ``tokens``, what its bucket holds) for every budget."""
        for key in self.auth.keys:
            if key.requests is not None:
                yield key.name, "requests", key.requests.level_at(now)
            if key.tokens is not None:
                yield key.name, "tokens", key.tokens.level_at(now)

    def _spent(self, key: ApiKey, *, requests: int = 0, tokens: int = 0) -> None:
        if self.peers is not None:
            self.peers.spent(key.name, requests=requests, tokens=tokens)

    def keys_in_flight(self) -> Iterator[tuple[str, int]]:
        """(key name, its requests in flight here and at the peers) for every key."""
        for key in self.auth.keys:
            yield key.name, self._held(key.name)

    def _held(self, name: str) -> int:
        return self.in_flight[name] + (self.peers.held_by_peers(name) if self.peers else 0)

    def admit(self, request: GatewayRequest) -> None:
        """Hold one of its key's ``max_in_flight`` places for ``request`` until
        ``release``; 429 when this gateway's and its peers' requests of the key fill them."""
        name = request.key_name
        if name is None:
            return
        key = self.auth.named(name)
        most = None if key is None else key.max_in_flight
        if most is not None and self._held(name) >= most:
            raise Rejection(
                "key_in_flight",
                429,
                f"key {name} has {most} requests in flight, its most",
                code="rate_limit_exceeded",
                retry_after_s=1.0,
                key=name,
            )
        self._hold(name, +1)

    def release(self, request: GatewayRequest) -> None:
        """``request`` ended: its key's place is free again."""
        if request.key_name is not None:
            self._hold(request.key_name, -1)

    def _hold(self, name: str, change: int) -> None:
        if (count := self.in_flight[name] + change) > 0:
            self.in_flight[name] = count
        else:
            self.in_flight.pop(name, None)
        if self.peers is not None:
            self.peers.holding_changed()

    def configure(self, config: GatewayConfig, now: float) -> None:
        """Take a reloaded config's limits and keys; unchanged keys keep their budgets."""
        self.limits = config.limits
        if config.auth != self.auth.config:
            self.auth = Authenticator(config.auth, now)

    def authenticate(self, headers: Mapping[str, str]) -> ApiKey | None:
        """The caller's API key; None when keys are off; 401 when missing or wrong."""
        if not self.auth.enabled:
            return None
        token = bearer_token(headers.get("Authorization"))
        key = self.auth.key_for(token)
        if key is None:
            message = "missing API key" if token is None else "invalid API key"
            raise Rejection("unauthorized", 401, message, code="invalid_api_key")
        return key

    def output_key(self, request: GatewayRequest) -> ApiKey | None:
        """The key ``request``'s output is charged to once known (``charge_output``): its
        own, when it has a token budget and the request no ``max_tokens``; else None."""
        if request.view.max_tokens is not None or request.key_name is None:
            return None
        key = self.auth.named(request.key_name)
        return key if key is not None and key.tokens is not None else None

    def charge_output(self, request: GatewayRequest, output_tokens: int, now: float) -> None:
        """Charge an uncapped request's output to its key's token budget once it is known:
        ``prepare`` could charge only the prompt, and an answer without ``max_tokens`` may
        run to the model's context. Capped requests paid prompt + cap up front."""
        key = self.output_key(request)
        if key is not None:
            self.charge_key_output(key, output_tokens, now)

    def charge_key_output(self, key: ApiKey, output_tokens: int, now: float) -> None:
        """Spend ``output_tokens`` from ``key``'s token budget (none: nothing), here and,
        through the state bus, at the peers."""
        if key.tokens is not None and output_tokens > 0:
            key.tokens.spend(output_tokens, now)
            self._spent(key, tokens=output_tokens)

    async def prepare(self, http: web.Request, *, chat: bool) -> tuple[bytes, GatewayRequest]:
        """Auth, limits and the routing view; ApiError for anything refused here."""
        arrived_at = time.monotonic()
        key = self.check_headers(http.headers, arrived_at)
        limits = self.limits
        length = http.content_length
        if length is not None:
            self.check_body_size(length)
        await send_continue(http)
        try:
            body = await _read_body(http, limits.max_body_bytes, limits.body_timeout_ms / 1000)
        except TimeoutError:
            raise Rejection(
                "body_timeout", 408, "the request body arrived too slowly", code="body_timeout"
            ) from None
        except UNREADABLE as exc:
            raise unreadable(exc, http) from None
        request = await self.routing_request(
            body, http.headers, chat=chat, key=key, arrived_at=arrived_at
        )
        return body, request

    def check_body_size(self, size: int) -> None:
        """413 for a body of ``size`` bytes over the limit; a data plane that gets the body
        in pieces asks as it grows, so as not to hold more of it."""
        limit = self.limits.max_body_bytes
        if size > limit:
            raise _too_large(limit)

    def check_headers(self, headers: Mapping[str, str], arrived_at: float) -> ApiKey | None:
        """The checks that need no body: hops, client header text, the API key and its
        requests-per-minute budget; the caller's key (None when keys are off)."""
        hops(headers)
        _check_client_headers(headers)
        key = self.authenticate(headers)
        if key is not None and key.requests is not None:
            wait_s = key.requests.take(1, arrived_at)
            if wait_s:
                raise Rejection(
                    "key_requests_per_minute",
                    429,
                    f"requests per minute exceeded for key {key.name}",
                    code="rate_limit_exceeded",
                    retry_after_s=wait_s,
                    key=key.name,
                )
            self._spent(key, requests=1)
        return key

    async def routing_request(
        self,
        body: bytes,
        headers: Mapping[str, str],
        *,
        chat: bool,
        key: ApiKey | None,
        arrived_at: float,
    ) -> GatewayRequest:
        """The checks on a whole body (length, OpenAI shape, served model, prompt and
        output caps, the key's token budget, the routing headers), then its routing
        request; shared by every data plane that hands the body over whole."""
        with _naming(key):
            self.check_body_size(len(body))
            limits = self.limits
            try:
                summary = summarize(body, chat=chat)
            except RequestError as exc:
                raise Rejection(
                    "invalid_body", 400, exc.message, code="invalid_request", param=exc.param
                ) from None
            pool = self.pools.get(summary.model)
            if pool is None:
                raise Rejection(
                    "unknown_model",
                    404,
                    f"model {summary.model!r} is not served here; see GET /v1/models",
                    code="model_not_found",
                    param="model",
                )
            if summary.prompt_tokens > limits.max_prompt_tokens:
                raise Rejection(
                    "prompt_too_long",
                    400,
                    f"prompt of ~{summary.prompt_tokens} tokens exceeds the limit of "
                    f"{limits.max_prompt_tokens}",
                    code="context_length_exceeded",
                    param="messages" if chat else "prompt",
                )
            cap = summary.max_tokens
            if cap is not None and cap > limits.max_tokens:
                raise Rejection(
                    "max_tokens_too_large",
                    400,
                    f"{summary.max_tokens_param} {cap} exceeds the limit of {limits.max_tokens}",
                    code="max_tokens_exceeded",
                    param=summary.max_tokens_param,
                )
            if key is not None and key.tokens is not None:
                asked = summary.prompt_tokens + (cap or 0)
                wait_s = key.tokens.take(asked, arrived_at)
                if wait_s:
                    raise Rejection(
                        "key_tokens_per_minute",
                        429,
                        f"tokens per minute exceeded for key {key.name}",
                        code="rate_limit_exceeded",
                        retry_after_s=wait_s,
                    )
                self._spent(key, tokens=round(key.tokens.charge_for(asked)))
            view = await routing_view(summary, self.block_tokens, pool.tokenizer)
            try:
                return GatewayRequest.from_headers(
                    headers, view, pool, arrived_at=arrived_at, key=key
                )
            except ApiError as exc:  # a routing header the request cannot be queued by
                code = exc.code or "bad_header"
                raise Rejection(code, exc.status, exc.message, code=code, param=exc.param) from None


@contextlib.contextmanager
def _naming(key: ApiKey | None) -> Iterator[None]:
    """Name ``key`` on a ``Rejection`` raised inside, for its per-key count."""
    try:
        yield
    except Rejection as exc:
        exc.key = None if key is None else key.name
        raise


def _check_client_headers(headers: Mapping[str, str]) -> None:
    """400 for a routing header that is no printable UTF-8 (aiohttp hands undecodable
    bytes on as surrogates, which nothing downstream can encode again)."""
    for name in CLIENT_HEADERS:
        value = headers.get(name)
        if value is not None and not value.isprintable():
            raise Rejection(
                "bad_header", 400, f"{name} must be printable UTF-8 text", code="bad_header"
            )


async def defer_continue(http: web.Request) -> web.Response | None:
    """The routes' ``expect_handler``: refuse unknown expectations (417) but hold back
    ``100 Continue`` until the intake has checked the key and the declared length (the
    admin API: its token), which then sends it (``send_continue``)."""
    return refuse_expectation(http)


async def _read_body(http: web.Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, or its first ``limit + 1`` bytes when it is longer; TimeoutError
    when it takes longer than ``timeout_s`` to arrive. A body that has arrived whole
    (most do, with their headers) is read without setting the timer."""
    if http.content.is_eof():
        return await _read_chunks(http, limit)
    async with asyncio.timeout(timeout_s):
        return await _read_chunks(http, limit)


async def _read_chunks(http: web.Request, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = await http.content.read(limit + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> Rejection:
    return Rejection(
        "body_too_large", 413, f"request body exceeds {limit} bytes", code="request_too_large"
    )
