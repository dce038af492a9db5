"""The shared-state bus: several gateways, one view of every replica's in-flight work.

Each gateway publishes what it does to the replicas (``Dispatch``, ``FirstToken``,
``Tokens``: the output streamed since its last message, ``Complete``, ``Cancel``), what it
charged to API keys' budgets (``Spend``, summed per key per message), how many requests of
each key it has in flight (``Holding``, when that changed and with every heartbeat) and,
every ``heartbeat_ms``, a ``Heartbeat`` with the in-flight count it sees per replica.
Peers apply those events to their own ``ReplicaSet`` as foreign in-flight through the very
hooks local traffic takes (``ForeignSink``: ``on_dispatch``, ``on_first_token``,
``on_tokens``, ``on_complete``), so a peer's request is priced, queued against and
prefix-matched exactly like one's own, and the scrape merge counts it as known load rather
than as unexplained foreign load. A peer's ``Spend`` is charged to the key of that name
here too (``on_spend``), so a key's budget holds across the gateways rather than once per
gateway; a lost one is not replayed, and while the bus is down each gateway enforces the
budgets on its own traffic alone. A peer's ``Holding`` replaces the last one heard from it,
so a key's ``max_in_flight`` counts every gateway's requests (``held_by_peers``).

The transport is Redis pub/sub or NATS core (``runtime.bus_transport``, by the URL's
scheme), on one channel or subject: fire and forget, one hop on loopback, no storage to
trim. The state is soft, so nothing needs replaying: a message lost (a peer's
publish that failed, a reconnect) shows as a gap in that peer's sequence numbers, and the
receiver then drops every contribution of that peer (the scrape truth covers them) and
tracks its new dispatches exactly from there on. A peer silent for ``peer_timeout_ms`` is
dropped the same way. While the bus is down (no message, not even this gateway's own
heartbeat, for ``peer_timeout_ms``, or the connection lost) every peer is dropped, the
gateway serves on its scrapes alone, and it reconnects with a doubling backoff; each change
of state is one log line and ``isocost_state_bus_up``.

Messages are msgpack ``Batch``es: the sender's id (random per process start, so a restarted
gateway is a new peer), a sequence number per message, its send time (wall clock: the lag
``isocost_state_bus_lag_seconds`` shows holds between gateways on one host or with
synchronized clocks) and the events queued since the last one (one message per event loop
turn under load, not one per event).

Nothing a peer sends is trusted further than the types allow: every count is bounded
(``MAX_TOKENS``, ``MAX_IN_FLIGHT``, a prompt no longer than its replica's context), a
message that breaks a bound is dropped whole and its loss shows as the next one's sequence
gap, a request already in flight is not dispatched twice, and at most ``MAX_PEERS`` peers
are tracked. Each drop is counted (``ForeignSink.foreign_rejected``) and logged at most once
per ``_WARN_INTERVAL_S`` per reason: one bad peer must neither stop the subscriber nor fill
the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

import msgspec

from isocost.core.jsontext import UNDECODABLE
from isocost.runtime.bus_transport import Subscription, TransportError, transport_for
from isocost.runtime.config import StateBusConfig, redacted
from isocost.scheduling.contract import InFlight, RequestView
from isocost.scheduling.state import ReplicaSet

__all__ = [
    "MAX_IN_FLIGHT",
    "MAX_PEERS",
    "MAX_TOKENS",
    "Batch",
    "Cancel",
    "Complete",
    "Dispatch",
    "Event",
    "FirstToken",
    "ForeignSink",
    "Heartbeat",
    "Holding",
    "PeerViews",
    "Spend",
    "StateBus",
    "Tokens",
]

log = logging.getLogger("isocost.bus")

_INITIAL_BACKOFF_S = 0.05
_WARN_INTERVAL_S = 10.0  # at most one warning per reason this often (the rest are counted)
_MAX_LAG_S = 60.0  # a send time further from now is a wrong clock or junk, not lag

MAX_TOKENS = 1 << 24  # any token count: above every model's context, far below overflow
MAX_IN_FLIGHT = 1 << 16  # requests one gateway can see on one replica
MAX_PEERS = 256  # other gateways on one channel; more are refused, not tracked
MAX_SPEND = 1 << 48  # a key's charge in one message: requests or tokens of a whole batch

# Bounds the decoder checks: a value outside fails the whole message (``StateBus.receive``).
_Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
_InFlight = Annotated[int, msgspec.Meta(ge=0, le=MAX_IN_FLIGHT)]
# No "/": a peer's request is known here as "<gateway>/<id>", which must name one request.
_GatewayId = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern="^[^/]+$")]
_Spent = Annotated[int, msgspec.Meta(ge=0, le=MAX_SPEND)]
_KeyName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class Dispatch(msgspec.Struct, tag="d", array_like=True, frozen=True):
    """A request sent to ``replica``: its prefill work (prompt tokens and block hashes)
    and what predicts its decode work (``max_tokens`` and the route class the sender's
    policy gave it: the receiver's output-length estimator, fed by everyone's completions,
    predicts it)."""

    request_id: str
    replica: str
    model: str
    prompt_tokens: _Tokens  # and at most its replica's context (``PeerViews``)
    max_tokens: _Tokens | None
    route_class: str
    stream: bool
    session: str | None
    block_hashes: tuple[int, ...]


class FirstToken(msgspec.Struct, tag="f", array_like=True, frozen=True):
    request_id: str


class Tokens(msgspec.Struct, tag="t", array_like=True, frozen=True):
    """``count`` more output tokens streamed since the last message: without them a peer
    would take the request's whole decode to be still ahead of it until its end."""

    request_id: str
    count: _Tokens


class Complete(msgspec.Struct, tag="c", array_like=True, frozen=True):
    request_id: str
    output_tokens: _Tokens | None  # None when the data plane never saw them (the picker)


class Cancel(msgspec.Struct, tag="x", array_like=True, frozen=True):
    """The request failed or its client left."""

    request_id: str


class Spend(msgspec.Struct, tag="s", array_like=True, frozen=True):
    """What the sender charged to the API key named ``key`` since its last message: the
    requests it let through and the tokens it took from the key's token budget."""

    key: _KeyName
    requests: _Spent
    tokens: _Spent


class Holding(msgspec.Struct, tag="k", array_like=True, frozen=True):
    """The sender's requests in flight per API key, every key it holds any of: the whole
    count, so one heard replaces the last (a lost one is made good by the next)."""

    in_flight: dict[_KeyName, _InFlight]


class Heartbeat(msgspec.Struct, tag="h", array_like=True, frozen=True):
    """The sender is alive; ``in_flight``: the requests it sees per replica (its own and
    its peers'), against which a receiver measures its view divergence."""

    in_flight: dict[str, _InFlight]


Event = Dispatch | FirstToken | Tokens | Complete | Cancel | Spend | Holding | Heartbeat


class Batch(msgspec.Struct, array_like=True, frozen=True):
    gateway: _GatewayId
    seq: int  # per sender, +1 per message: a jump means messages were lost
    sent_unix_s: float  # when it was sent: how stale a peer's view is, on one host
    events: list[Event]


class ForeignSink(Protocol):
    """Where peers' events land: the shadow state and its hooks (the gateway's router)."""

    replicas: ReplicaSet

    def foreign_dispatch(self, view: RequestView, replica_id: str) -> bool:
        """``on_dispatch`` for a peer's request; False when the replica is unknown here."""
        ...

    def foreign_first_token(self, request_id: str) -> None: ...

    def foreign_tokens(self, request_id: str, count: int) -> None: ...

    def foreign_end(self, request_id: str, *, ok: bool, output_tokens: int | None) -> None: ...

    def foreign_rejected(self, reason: str) -> None:
        """A message or event dropped unapplied: ``undecodable`` (not MessagePack),
        ``invalid`` (not a batch, or a value out of bounds), ``duplicate`` (a request
        already in flight), ``unknown_key`` (a spend on an API key not configured here)
        or ``too_many_peers``."""
        ...

    def foreign_gap(self) -> None:
        """A peer's messages were lost: its in-flight is left to the scrapes."""
        ...


def in_flight_view(replicas: ReplicaSet) -> dict[str, int]:
    """Requests in flight per replica as ``replicas`` sees them (local and foreign)."""
    return {state.replica_id: len(state.in_flight) for state in replicas}


@dataclass(slots=True)
class _Peer:
    seq: int
    seen_s: float
    requests: set[str] = field(default_factory=set)  # its in-flight ids applied here
    holding: dict[str, int] = field(default_factory=dict)  # its in-flight per API key
    gaps: dict[str, float] | None = None  # per replica, view divergence at its heartbeat
    duplicate_logged: bool = False  # its duplicates are counted, the first one logged


class _Throttle:
    """Warnings at most once per ``interval_s`` per event name; the next line that gets
    through says how many were held back (``unlogged``): a peer sending junk in every
    message must not turn the log into a copy of the bus."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._logged_s: dict[str, float] = {}
        self._unlogged: Counter[str] = Counter()

    def warning(self, message: str, now: float, event: str, **fields: object) -> None:
        if now - self._logged_s.get(event, -float("inf")) < self.interval_s:
            self._unlogged[event] += 1
            return
        self._logged_s[event] = now
        unlogged = self._unlogged.pop(event, 0)
        log.warning(message, extra={"event": event, "unlogged": unlogged, **fields})


SpendSink = Callable[[str, int, int], bool]
"""Charges a peer's ``Spend`` (key name, requests, tokens) to the key here; False when no
key of that name is configured here."""


def _no_budgets(key: str, requests: int, tokens: int) -> bool:
    return False


class PeerViews:
    """Applies peers' batches to a ``ForeignSink`` (and their spends to ``on_spend``);
    expires silent peers and drops those whose sequence jumps (no I/O: the clock comes in
    as ``now``)."""

    def __init__(
        self,
        gateway_id: str,
        sink: ForeignSink,
        peer_timeout_s: float,
        *,
        max_peers: int = MAX_PEERS,
        on_spend: SpendSink = _no_budgets,
    ) -> None:
        self.gateway_id = gateway_id
        self.sink = sink
        self.on_spend = on_spend
        self.peer_timeout_s = peer_timeout_s
        self.max_peers = max_peers
        self.peers: dict[str, _Peer] = {}
        self.gaps = 0  # sequence jumps seen, over all peers
        # A peer's gaps changed since the bus last passed the divergence on: it does so
        # once per heartbeat period (``StateBus.show_divergence``), not per heartbeat.
        self.divergence_changed = False
        self._refusing = False  # at ``max_peers``, the refusal logged
        self._warnings = _Throttle(_WARN_INTERVAL_S)

    def apply(self, batch: Batch, now: float) -> None:
        """One message off the bus (this gateway's own are ignored)."""
        if batch.gateway == self.gateway_id:
            return
        peer = self.peers.get(batch.gateway)
        if peer is None:
            if len(self.peers) >= self.max_peers:
                self._refuse(batch.gateway)
                return
            self._refusing = False
            peer = self.peers[batch.gateway] = _Peer(batch.seq - 1, now)
            log.info("state bus peer joined", extra={"event": "peer_joined", "peer": batch.gateway})
        elif batch.seq <= peer.seq:  # a duplicate: pub/sub keeps one sender's order
            return
        elif batch.seq != peer.seq + 1:
            self.gaps += 1
            self.sink.foreign_gap()
            self._warnings.warning(
                "state bus messages lost: the peer's in-flight is left to the scrapes",
                now,
                "peer_gap",
                peer=batch.gateway,
                lost=batch.seq - peer.seq - 1,
            )
            self._forget(peer)
        peer.seq, peer.seen_s = batch.seq, now
        for event in batch.events:
            self._apply_event(batch.gateway, peer, event, now)

    def reject(self, reason: str, now: float, error: str) -> None:
        """Count a message or event dropped unapplied; warn, at most once an interval."""
        self.sink.foreign_rejected(reason)
        self._warnings.warning(
            "state bus: message or event dropped", now, "bus_rejected", reason=reason, error=error
        )

    def _refuse(self, gateway: str) -> None:
        """A new peer beyond ``max_peers``: counted, and logged once each time the cap is
        reached (a flood of made-up ids would otherwise cost a join and an expiry each)."""
        self.sink.foreign_rejected("too_many_peers")
        if not self._refusing:
            self._refusing = True
            log.warning(
                "state bus: too many peers, new ones are ignored",
                extra={"event": "too_many_peers", "peer": gateway, "max_peers": self.max_peers},
            )

    def _apply_event(self, gateway: str, peer: _Peer, event: Event, now: float) -> None:
        sink = self.sink
        if isinstance(event, Heartbeat):
            own = in_flight_view(sink.replicas)
            peer.gaps = {r: float(abs(n - event.in_flight.get(r, 0))) for r, n in own.items()}
            self.divergence_changed = True
            return
        if isinstance(event, Spend):
            if not self.on_spend(event.key, event.requests, event.tokens):
                self.reject("unknown_key", now, f"no API key named {event.key!r} here")
            return
        if isinstance(event, Holding):
            peer.holding = dict(event.in_flight)
            return
        request_id = f"{gateway}/{event.request_id}"  # unique across gateways
        if isinstance(event, Dispatch):
            if request_id in peer.requests:
                self._duplicate(gateway, peer, request_id)
                return
            context = _context_tokens(sink.replicas, event.replica)
            if context is not None and event.prompt_tokens > context:
                error = f"{event.prompt_tokens} prompt tokens, context {context}"
                self.reject("invalid", now, error)
                return
            view = RequestView(
                request_id=request_id,
                model=event.model,
                prompt_tokens=event.prompt_tokens,
                block_hashes=event.block_hashes,
                max_tokens=event.max_tokens,
                session_key=event.session,
                route_class=event.route_class,
                stream=event.stream,
            )
            if sink.foreign_dispatch(view, event.replica):
                peer.requests.add(request_id)
        elif request_id in peer.requests:
            if isinstance(event, FirstToken):
                sink.foreign_first_token(request_id)
                return
            if isinstance(event, Tokens):
                sink.foreign_tokens(request_id, event.count)
                return
            peer.requests.discard(request_id)
            if isinstance(event, Complete):
                sink.foreign_end(request_id, ok=True, output_tokens=event.output_tokens)
            else:
                sink.foreign_end(request_id, ok=False, output_tokens=None)

    def held_by_peers(self, key: str) -> int:
        """The requests of API key ``key`` the peers last said they hold in flight."""
        return sum(peer.holding.get(key, 0) for peer in self.peers.values())

    def expire(self, now: float) -> list[str]:
        """Drop the peers silent for longer than ``peer_timeout_s``; their ids."""
        silent = [g for g, p in self.peers.items() if now - p.seen_s > self.peer_timeout_s]
        for gateway in silent:
            self._forget(self.peers.pop(gateway))
            log.info("state bus peer expired", extra={"event": "peer_expired", "peer": gateway})
        return silent

    def drop_all(self) -> None:
        """The bus is down: nothing more will be heard of any peer's requests."""
        for peer in self.peers.values():
            self._forget(peer)
        self.peers.clear()

    def _duplicate(self, gateway: str, peer: _Peer, request_id: str) -> None:
        """A dispatch of a request already in flight here: the first stays, this one is
        counted, and logged once per peer (a peer that repeats ids keeps repeating)."""
        self.sink.foreign_rejected("duplicate")
        if not peer.duplicate_logged:
            peer.duplicate_logged = True
            log.warning(
                "state bus: a request dispatched twice, the repeat ignored",
                extra={"event": "bus_duplicate", "peer": gateway, "request_id": request_id},
            )

    def divergence(self) -> dict[str, float]:
        """Per replica, the largest gap between this gateway's in-flight count and a
        peer's heartbeat, each taken as that heartbeat was applied (0 with no peer).

        Then every event the peer sent before its heartbeat has been applied here, so the
        gap is what is in transit or lost. Measured against a heartbeat kept from earlier
        it would count how far this view moved since (up to ``heartbeat_ms`` of traffic):
        p99 2-3 requests for three gateways at 8-20 req/s, against 0-1 taken this way."""
        worst = dict.fromkeys(in_flight_view(self.sink.replicas), 0.0)
        for peer in self.peers.values():
            if peer.gaps is None:  # no heartbeat since it joined or resynced
                continue
            for replica, gap in peer.gaps.items():
                if replica in worst:
                    worst[replica] = max(worst[replica], gap)
        return worst

    def _forget(self, peer: _Peer) -> None:
        for request_id in peer.requests:
            self.sink.foreign_end(request_id, ok=False, output_tokens=None)
        peer.requests.clear()
        peer.gaps = None
        self.divergence_changed = True


def _context_tokens(replicas: ReplicaSet, replica_id: str) -> int | None:
    """The most tokens a request on ``replica_id`` can hold (None: not a replica here)."""
    if replica_id not in replicas:
        return None
    return replicas.get(replica_id).spec.cost_model.model.max_context_tokens


class StateBus:
    """The transport side of ``PeerViews``: publishes this gateway's events, subscribes to its
    peers', reconnects with backoff (module docstring). ``on_divergence`` hears every
    replica's view divergence once per heartbeat period when a peer's heartbeat or loss
    changed it (per heartbeat, a few hundred peers would make it quadratic), ``on_lag``
    the seconds each peer's message took from its send to its arrival here."""

    def __init__(
        self,
        config: StateBusConfig,
        sink: ForeignSink,
        *,
        on_divergence: Callable[[dict[str, float]], None],
        on_lag: Callable[[float], None],
        on_spend: SpendSink = _no_budgets,
        holding: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        self.config = config
        self.heartbeat_s = config.heartbeat_ms / 1000
        self.peer_timeout_s = config.peer_timeout_ms / 1000
        self.gateway_id = uuid.uuid4().hex[:12]
        self.views = PeerViews(self.gateway_id, sink, self.peer_timeout_s, on_spend=on_spend)
        self.up: bool | None = None  # None: not tried yet
        self._on_divergence, self._on_lag = on_divergence, on_lag
        self._pending: list[Event] = []
        self._streamed: dict[str, int] = {}  # tokens per request since the last message
        self._spent: dict[str, list[int]] = {}  # [requests, tokens] per key since then
        self._holding = holding  # this gateway's in flight per key (the intake's counts)
        self._holding_changed = False
        self._wanted = asyncio.Event()
        self._seq = 0
        self._heard_s = -float("inf")  # when the last message, ours included, came
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Batch)
        self._transport = transport_for(config.url, self.peer_timeout_s)

    # -- what this gateway did (the router calls these) -------------------------------

    def dispatched(self, view: RequestView, record: InFlight) -> None:
        self._publish(
            Dispatch(
                request_id=record.request_id,
                replica=record.replica_id,
                model=record.model,
                prompt_tokens=record.prompt_tokens,
                max_tokens=record.max_tokens,
                route_class=record.route_class,
                stream=record.stream,
                session=view.session_key,
                block_hashes=view.block_hashes,
            )
        )

    def streamed(self, request_id: str, num_tokens: int, *, first: bool) -> None:
        """``num_tokens`` output tokens arrived, the first of the request among them when
        ``first``; the others are summed per request into one ``Tokens`` per message."""
        if first:
            self._publish(FirstToken(request_id))
            num_tokens -= 1
        if num_tokens > 0 and self.up:
            self._streamed[request_id] = self._streamed.get(request_id, 0) + num_tokens
            self._wanted.set()

    def ended(self, request_id: str, *, ok: bool, output_tokens: int | None) -> None:
        self._streamed.pop(request_id, None)  # its end says how many it made
        self._publish(Complete(request_id, output_tokens) if ok else Cancel(request_id))

    def spent(self, key: str, *, requests: int = 0, tokens: int = 0) -> None:
        """This gateway charged ``requests`` and ``tokens`` to ``key``'s budgets; summed
        per key into one ``Spend`` per message."""
        if self.up and (requests > 0 or tokens > 0):
            totals = self._spent.setdefault(key, [0, 0])
            totals[0] += requests
            totals[1] += tokens
            self._wanted.set()

    def holding_changed(self) -> None:
        """This gateway's in-flight count of some key changed: the next message says them."""
        if self.up:
            self._holding_changed = True
            self._wanted.set()

    def held_by_peers(self, key: str) -> int:
        """The requests of ``key`` the other gateways hold in flight, as last heard."""
        return self.views.held_by_peers(key)

    def _publish(self, event: Event) -> None:
        if self.up:  # while down peers drop all of ours anyway
            self._pending.append(event)
            self._wanted.set()

    # -- the loops (each run under the gateway's supervise) ---------------------------

    def loops(self) -> list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]]:
        """(name, coroutine function) of every task the bus needs running."""
        return [
            ("state_bus_subscriber", self.subscribe),
            ("state_bus_publisher", self.publish),
            ("state_bus_heartbeat", self.heartbeat),
        ]

    async def subscribe(self) -> None:
        """Follow the channel; on any failure go down, wait, and subscribe afresh."""
        backoff_s = _INITIAL_BACKOFF_S
        while True:
            subscription: Subscription | None = None
            try:
                subscription = await self._transport.subscribe(self.config.channel)
                self._heard_s = time.monotonic()
                self._went_up()
                backoff_s = _INITIAL_BACKOFF_S
                await self._read(subscription)
            except TransportError as exc:
                _reraise_cancellation()
                self._went_down(str(exc))
            except Exception as exc:
                # A fault of ours: nothing is applied until supervise restarts this loop,
                # so the bus is down meanwhile (peers dropped, isocost_state_bus_up 0).
                self._went_down(f"{type(exc).__name__}: {exc}")
                raise
            finally:
                if subscription is not None:
                    await subscription.close()
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self.config.max_backoff_ms / 1000)

    async def _read(self, subscription: Subscription) -> None:
        """Apply messages until none (not even our own heartbeat) came for the timeout."""
        channel = self.config.channel
        while True:
            data = await subscription.next(self.heartbeat_s)
            _reraise_cancellation()
            now = time.monotonic()
            if data is not None:
                self._heard_s = now
                self.receive(data, now)
            elif now - self._heard_s > self.peer_timeout_s:
                raise TransportError(f"nothing heard on {channel} for {self.peer_timeout_s} s")

    def receive(self, data: bytes, now: float) -> None:
        """One message off the channel: decoded, its lag observed, applied. A message that
        does not decode, or holds a value out of bounds, is dropped whole, not applied in
        part: were a ``Complete`` dropped alone, its request would stay in flight here for
        good; lost whole, the peer's next message shows the gap and its in-flight goes."""
        try:
            batch = self._decoder.decode(data)
        except msgspec.ValidationError as exc:
            self.views.reject("invalid", now, str(exc))
            return
        except UNDECODABLE as exc:  # RecursionError: nested deeper than msgspec follows
            self.views.reject("undecodable", now, str(exc))
            return
        if batch.gateway != self.gateway_id:
            lag_s = time.time() - batch.sent_unix_s
            if abs(lag_s) <= _MAX_LAG_S:  # False for nan and the infinities too
                self._on_lag(max(lag_s, 0.0))
        self.views.apply(batch, now)

    async def publish(self) -> None:
        """Send what queued up since the last message, one message per wake."""
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            events, self._pending = self._pending, []
            events += [Tokens(request_id, count) for request_id, count in self._streamed.items()]
            events += [Spend(key, *totals) for key, totals in self._spent.items()]
            if self._holding_changed:
                events.append(Holding(dict(self._holding())))
                self._holding_changed = False
            self._streamed.clear()
            self._spent.clear()
            if not events:
                continue
            self._seq += 1
            batch = Batch(self.gateway_id, self._seq, time.time(), events)
            payload = self._encoder.encode(batch)
            with contextlib.suppress(TransportError):  # lost: a gap the peers see
                await self._transport.publish(self.config.channel, payload)
            _reraise_cancellation()

    async def heartbeat(self) -> None:
        """Say this gateway is alive (with its view) and expire silent peers."""
        while True:
            self._publish(Heartbeat(in_flight_view(self.views.sink.replicas)))
            if self._holding():  # again: a peer that joined or lost the last one converges
                self._holding_changed = True
            self.views.expire(time.monotonic())
            self.show_divergence()
            await asyncio.sleep(self.heartbeat_s)

    def show_divergence(self) -> None:
        """Pass the view divergence on if a peer's heartbeat or loss changed it since."""
        if self.views.divergence_changed:
            self.views.divergence_changed = False
            self._on_divergence(self.views.divergence())

    async def close(self) -> None:
        await self._transport.close()

    def _went_up(self) -> None:
        if self.up:
            return
        self.up = True
        log.info(
            "state bus up: sharing in-flight with the peers",
            extra={"event": "bus_up", "url": redacted(self.config.url)},
        )

    def _went_down(self, error: str) -> None:
        self.views.drop_all()
        self._pending.clear()
        self._streamed.clear()
        self._spent.clear()
        self.show_divergence()
        if self.up is False:
            return
        self.up = False
        log.warning(
            "state bus down: serving on scrapes alone, and API key budgets on this"
            " gateway's own traffic, until it returns",
            extra={"event": "bus_down", "url": redacted(self.config.url), "error": error},
        )


def _reraise_cancellation() -> None:
    """Raise ``CancelledError`` if the running task is being cancelled: a bus client
    (Redis's does) may swallow a cancellation that hits it mid-command (or turn it into
    its own error), which would leave the task running past its cancel and its gateway
    unable to stop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
