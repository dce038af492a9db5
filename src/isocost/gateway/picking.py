"""The gateway's runtime deciding for an external data plane (``isocost picker``).

Envoy relays the bytes; this side keeps everything else of ``isocost serve``: the config,
discovery, scrapes, breakers, the router and its shadow state, the intake's checks. A pick
passes the same intake (headers, then the whole body) and the same ``Router.acquire`` (the
unchanged ``Policy.schedule``, queue included) as a proxied request; it differs only in
what the data plane reports back. Envoy tells the picker a response's headers and when its
stream ends, not its tokens (relaying every chunk through Python is what the picker is
for avoiding), so every request is shadowed as one the caller does not stream
(``RequestView.stream=False``: no first token, started at its predicted prefill end) and
the scrapes correct the rest. One consequence: a route class that matches on ``stream``
sees every picked request as not streamed.

The exception: an uncapped request of an API key with a token budget, whose output only
its answer tells (``Intake.output_key``). Its pick names how the answer comes
(``EndpointGrant.meter``), the data plane routes it so that a second, observing ext_proc
stream passes the answer's body on without waiting for the picker, and ``meter`` counts
it there and charges the key (``OutputMeter``), as ``isocost serve`` charges it. That
stream stands alone (the key from its own headers), so any picker of several may take it.

With ``fallbacks`` N (``isocost picker --fallbacks``), the next N replicas by the
decision's scores follow the choice in ``x-gateway-destination-endpoint`` (GAIE v0.4:
the data plane tries them in order on a retry); when the response says a fallback served
it, the choice's breaker counts a soft failure and the shadow state moves the request to
the fallback (``Router.reassign``).

A request the brain splits (``Router.plan_handoff``, P/D disaggregation) is granted the
decode replica, and the prefill replica's ``ip:port`` goes with it
(``EndpointGrant.prefill_endpoint``, llm-d's ``x-prefiller-host-port``); the prefill leg
is held in the shadow state until the exchange ends, the data plane not reporting it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping
from urllib.parse import urlsplit

from isocost.core.jsontext import UNDECODABLE
from isocost.gateway.auth import ApiKey
from isocost.gateway.health import status_fault
from isocost.gateway.intake import Rejection
from isocost.gateway.lifecycle import Gateway
from isocost.gateway.proxy import AnswerTooLarge, StreamReader
from isocost.gateway.routing import GatewayRequest, Grant
from isocost.gateway.upstreams import Upstream
from isocost.openai.errors import ApiError
from isocost.openai.usage import answer_usage

__all__ = ["EndpointGrant", "GatewayPicker", "OutputMeter", "endpoint_of"]

log = logging.getLogger("isocost.picker")

# How a metered answer comes (``EndpointGrant.meter``): server-sent events, or one JSON.
STREAMED_ANSWER = "stream"
WHOLE_ANSWER = "whole"
# The paths a pick serves, and whether each body is a chat request.
_CHAT_BY_PATH = {"/v1/chat/completions": True, "/v1/completions": False}


def endpoint_of(replica: Upstream) -> str:
    """The replica's ``ip:port``, as GAIE's ``x-gateway-destination-endpoint`` names it."""
    parts = urlsplit(replica.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


class GatewayPicker:
    """One gateway runtime as an endpoint picker's brain; see the module docstring."""

    def __init__(self, gateway: Gateway, fallbacks: int = 0) -> None:
        self.gateway = gateway
        self.fallbacks = fallbacks  # replicas named after the choice, best first

    async def start(self) -> None:
        await self.gateway.start()

    async def stop(self) -> None:
        self.gateway.draining = True
        await self.gateway.stop()

    def ready(self) -> bool:
        """Serving, with at least one replica that may take new work."""
        now = time.monotonic()
        gateway = self.gateway
        return not gateway.draining and any(r.routable(now) for r in gateway.replicas.values())

    def reload_requested(self) -> None:
        self.gateway.reload_requested()

    def check_body_size(self, size: int) -> None:
        """413 once a body arriving in pieces passes the limit, not when it is whole."""
        with self._counting_rejections():
            self.gateway.intake.check_body_size(size)

    def meter(self, shape: str, headers: Mapping[str, str]) -> OutputMeter | None:
        """A meter for an answer a pick marked ``shape`` (``EndpointGrant.meter``), charged
        to the key of ``headers``; None when it has no token budget, or the marking is
        none of the pick's (the key unknown, a shape unknown)."""
        try:
            key = self.gateway.intake.authenticate(headers)
        except ApiError:
            return None
        if key is None or key.tokens is None or shape not in (STREAMED_ANSWER, WHOLE_ANSWER):
            return None
        limit = self.gateway.intake.limits.max_response_bytes
        return OutputMeter(self.gateway, key, shape == STREAMED_ANSWER, limit)

    async def pick(
        self,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        subset: frozenset[str] | None,
    ) -> EndpointGrant:
        """The replica for one request (``subset``: GAIE's hint, the only endpoints it may
        go to); ApiError, OpenAI-shaped, for a request refused or that nothing can take,
        with its API key's ``x-ratelimit-*`` headers once the key is known."""
        intake = self.gateway.intake
        key_name: str | None = None
        try:
            with self._counting_rejections():
                request = await self._routing_request(path, headers, body)
                key_name = request.key_name
                intake.admit(request)
            meter = None  # the answer's shape, to meter it; the shadow state's is not streamed
            if intake.output_key(request) is not None:
                meter = STREAMED_ANSWER if request.view.stream else WHOLE_ANSWER
            shadowed = dataclasses.replace(request.view, stream=False)
            request = dataclasses.replace(request, view=shadowed)
            try:
                return await self._grant(request, subset, meter)
            except BaseException:
                intake.release(request)  # no grant: its key's place is free again
                raise
        except ApiError as exc:
            if isinstance(exc, Rejection) and exc.key is not None:
                key_name = exc.key
            exc.headers |= intake.rate_limit_headers(key_name)
            raise

    async def _grant(
        self, request: GatewayRequest, subset: frozenset[str] | None, meter: str | None
    ) -> EndpointGrant:
        exclude = frozenset(
            replica.name
            for replica in request.pool.replicas.values()
            if subset is not None and endpoint_of(replica) not in subset
        )
        if subset is not None and len(exclude) == len(request.pool.replicas):
            raise ApiError(
                503, "no replica of the subset hint serves this model", code="subset_unavailable"
            )
        handoff = self.gateway.router.plan_handoff(request, exclude)
        if handoff is not None:
            return EndpointGrant(
                self.gateway, request, meter, handoff.decode, prefill=handoff.prefill
            )
        grant = await self.gateway.router.acquire(request, exclude)
        fallbacks = self._fallbacks(request, grant, exclude)
        return EndpointGrant(self.gateway, request, meter, grant, fallbacks=fallbacks)

    @contextlib.contextmanager
    def _counting_rejections(self) -> Iterator[None]:
        """Count what the intake refuses (``Rejection``) under its reason."""
        try:
            yield
        except Rejection as exc:
            self.gateway.refused(exc)
            raise

    def _fallbacks(
        self, request: GatewayRequest, grant: Grant, exclude: frozenset[str]
    ) -> tuple[Upstream, ...]:
        """The ``fallbacks`` best replicas after the choice, by the decision's scores:
        routable now and allowed by the subset hint."""
        explanation = grant.decision.explanation
        if not self.fallbacks or explanation is None:
            return ()
        now = time.monotonic()
        by_name = {replica.name: replica for replica in request.pool.replicas.values()}
        ranked = (by_name.get(str(row["replica_id"])) for row in explanation.top(len(by_name)))
        return tuple(
            replica
            for replica in ranked
            if replica is not None
            and replica is not grant.replica
            and replica.name not in exclude
            and replica.routable(now)
        )[: self.fallbacks]

    async def _routing_request(
        self, path: str, headers: Mapping[str, str], body: bytes
    ) -> GatewayRequest:
        chat = _CHAT_BY_PATH.get(path.partition("?")[0])
        if chat is None:
            routed = ", ".join(_CHAT_BY_PATH)
            raise ApiError(404, f"{path} is not routed here: only {routed}", code="not_found")
        intake = self.gateway.intake
        arrived_at = time.monotonic()
        key = intake.check_headers(headers, arrived_at)
        return await intake.routing_request(
            body, headers, chat=chat, key=key, arrived_at=arrived_at
        )


class EndpointGrant:
    """A replica granted to one picked request, until the data plane reports its end."""

    def __init__(
        self,
        gateway: Gateway,
        request: GatewayRequest,
        meter: str | None,
        grant: Grant,
        *,
        prefill: Grant | None = None,
        fallbacks: tuple[Upstream, ...] = (),
    ) -> None:
        self._gateway = gateway
        self._request = request
        self._grant = grant
        self._prefill = prefill  # the prefill leg of a split request
        self._fallbacks = {endpoint_of(replica): replica for replica in fallbacks}
        self._status: int | None = None
        self._meter = meter

    @property
    def meter(self) -> str | None:
        """How the answer comes when its output is to be charged to the request's key
        (``GatewayPicker.meter``): an uncapped request of a key with a token budget."""
        return self._meter

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Where to send it: the choice, then the fallbacks in order."""
        return (endpoint_of(self._grant.replica), *self._fallbacks)

    @property
    def replica(self) -> str:
        return self._grant.replica.name

    @property
    def key_headers(self) -> dict[str, str]:
        """The request's API key's ``x-ratelimit-*`` now (none without budgets)."""
        return self._gateway.intake.rate_limit_headers(self._request.key_name)

    @property
    def prefill_endpoint(self) -> str | None:
        """The prefill replica's ``ip:port`` of a split request, else None."""
        return None if self._prefill is None else endpoint_of(self._prefill.replica)

    def responded(self, status: int, served: str | None) -> None:
        """The response headers: ``served`` is the endpoint the data plane used."""
        self._status = status
        replica = self._grant.replica
        if served is not None and served != endpoint_of(replica):
            fallback = self._fallbacks.get(served)
            if fallback is None:
                log.warning(
                    "served elsewhere",
                    extra={"event": "served_elsewhere", "replica": replica.name,
                           "served": served},
                )  # fmt: skip
            else:  # the data plane could not use the choice and retried on a fallback
                log.info(
                    "served by a fallback",
                    extra={"event": "served_by_fallback", "replica": replica.name,
                           "fallback": fallback.name},
                )  # fmt: skip
                replica.breaker.record_failure(time.monotonic(), "skipped", soft=True)
                self._gateway.metrics.retries.labels("fallback").inc()
                self._grant = self._gateway.router.reassign(self._grant, self._request, fallback)
                replica = fallback
        fault = status_fault(status)
        if fault is not None and not fault.busy:  # judged as the proxy judges it
            replica.breaker.record_failure(time.monotonic(), f"status {status}", soft=fault.soft)

    def ended(self) -> None:
        """The exchange is over: ``ok`` when a response below 400 arrived; its output
        tokens are unknown here (None: the shadow state keeps what it counted)."""
        now = time.monotonic()
        status = self._status
        ok = status is not None and status < 400
        if ok:
            self._grant.replica.breaker.record_success(now)
        router = self._gateway.router
        router.release(self._grant, now, ok=ok, output_tokens=None)
        if self._prefill is not None:
            router.release(self._prefill, now, ok=ok, output_tokens=1 if ok else None)
        self._gateway.metrics.disaggregated.labels(
            self._request.pool.model, "no" if self._prefill is None else "yes"
        ).inc()
        self._gateway.metrics.requests.labels(
            str(status or 0), self._request.pool.model, self._grant.replica.name
        ).inc()
        request = self._request
        self._gateway.intake.release(request)
        self._gateway.account_key(
            request.key_name, status or 0, prompt_tokens=request.view.prompt_tokens
        )


class OutputMeter:
    """The completion tokens of one answer, counted as the data plane passes its body on,
    and charged to ``key`` when it ends: a stream's events (its usage, when one carries
    it) as ``isocost serve`` counts them (``StreamReader``), or a whole answer's usage
    once it is all there. An answer past ``limit`` bytes (or a stream line past it), or
    one that is not what OpenAI's API sends, keeps the count it had there."""

    def __init__(self, gateway: Gateway, key: ApiKey, streamed: bool, limit: int) -> None:
        self._gateway = gateway
        self._key = key
        self._reader = StreamReader(limit) if streamed else None
        self._limit = limit
        self._whole: bytearray | None = None if streamed else bytearray()
        self.tokens = 0
        self._charged = False

    def feed(self, chunk: bytes, end_of_stream: bool) -> None:
        reader = self._reader
        if reader is not None:
            if reader.broken is None and not reader.done:
                try:
                    reader.feed(chunk)
                except AnswerTooLarge:
                    reader.broken = "a line past the limit"
                self.tokens = reader.tokens
        elif (whole := self._whole) is not None:
            whole += chunk
            if len(whole) > self._limit:
                self._whole = None
            elif end_of_stream:
                try:
                    usage = answer_usage(whole)
                except UNDECODABLE:
                    usage = None
                self.tokens = 0 if usage is None else usage.completion_tokens
                self._whole = None
        if end_of_stream:
            self.ended()

    def ended(self) -> None:
        """The answer is over, or the data plane stopped passing it on (its stream
        closed, which observability mode defers by seconds): charge what was counted,
        once."""
        if self._charged:
            return
        self._charged = True
        if self.tokens > 0:
            self._gateway.intake.charge_key_output(self._key, self.tokens, time.monotonic())
            self._gateway.metrics.api_key_tokens.labels(self._key.name, "completion").inc(
                self.tokens
            )
