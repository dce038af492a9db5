"""The state bus against peers that misbehave, without Redis: a request dispatched twice,
values out of bounds, send times that are no times, a flood of made-up peers, a subscriber
that fails; each dropped message counted by reason and logged at most once an interval."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import pytest
from test_bus import REPLICA, TIMEOUT_S, batch, dispatch, in_flight, router

from isocost.gateway.routing import Router
from isocost.runtime.bus import (
    MAX_PEERS,
    MAX_TOKENS,
    Batch,
    Cancel,
    Complete,
    Dispatch,
    Event,
    FirstToken,
    Heartbeat,
    PeerViews,
    StateBus,
    Tokens,
)
from isocost.runtime.config import StateBusConfig

ENCODE = msgspec.msgpack.Encoder().encode  # checks no bounds (decoding does): a faulty peer


def rejected(target: Router, reason: str) -> float:
    value = target.metrics.registry.get_sample_value(
        "isocost_state_bus_rejected_total", {"reason": reason}
    )
    return 0.0 if value is None else value


def logged(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == event]


class Heard:
    """A bus on a real router, with what it passed to ``on_lag`` and ``on_divergence``."""

    def __init__(self) -> None:
        self.target = router()
        self.lags: list[float] = []
        self.divergences: list[dict[str, float]] = []
        self.bus = StateBus(
            StateBusConfig(url="redis://127.0.0.1:1"),
            self.target,
            on_divergence=self.divergences.append,
            on_lag=self.lags.append,
        )


def test_a_request_dispatched_twice_is_counted_and_logged_once_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    target = router()
    views = PeerViews("me", target, TIMEOUT_S)
    views.apply(batch("a", 1, dispatch("r1")), now=0.0)
    views.apply(batch("a", 2, dispatch("r1")), now=0.1)  # again, in the next message
    views.apply(batch("a", 3, dispatch("r2"), dispatch("r2")), now=0.2)  # twice in one
    assert in_flight(target) == ["a/r1", "a/r2"]
    assert rejected(target, "duplicate") == 2
    assert len(logged(caplog, "bus_duplicate")) == 1  # once per peer
    views.apply(batch("b", 1, dispatch("r1")), now=0.3)  # another peer's r1 is its own
    assert in_flight(target) == ["a/r1", "a/r2", "b/r1"]
    views.apply(batch("a", 4, Complete("r1", 5), dispatch("r1")), now=0.4)  # ended: new
    assert in_flight(target) == ["a/r1", "a/r2", "b/r1"] and rejected(target, "duplicate") == 2


@pytest.mark.parametrize(
    "event",
    [
        Dispatch("r", REPLICA, "m", -5, 16, "default", True, None, ()),
        Dispatch("r", REPLICA, "m", 2**63 - 1, 16, "default", True, None, ()),
        Dispatch("r", REPLICA, "m", 10, -3, "default", True, None, ()),
        Dispatch("r", REPLICA, "m", 10, MAX_TOKENS + 1, "default", True, None, ()),
        Tokens("r", -100),
        Tokens("r", 2**63 - 1),
        Complete("r", -50),
        Complete("r", 2**64 - 1),
        Heartbeat({REPLICA: 2**62}),
        Heartbeat({REPLICA: -1}),
    ],
)
def test_a_count_out_of_bounds_fails_decoding(event: Event) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(ENCODE(batch("a", 1, event)), type=Batch)


def test_a_prompt_longer_than_its_replica_holds_is_not_dispatched() -> None:
    """10M tokens once drove the replica's prefill duty to 15,928 and kept every gateway
    away from it for minutes; the longest that fits is taken like a local request."""
    target = router()
    views = PeerViews("me", target, TIMEOUT_S)
    context = target.replicas.get(REPLICA).spec.cost_model.model.max_context_tokens
    fits = Dispatch("ok", REPLICA, "m", context, 16, "default", True, None, ())
    too_long = msgspec.structs.replace(fits, request_id="big", prompt_tokens=10_000_000)
    views.apply(batch("a", 1, too_long, fits), now=0.0)
    assert in_flight(target) == ["a/ok"]
    assert rejected(target, "invalid") == 1
    views.apply(batch("a", 2, Complete("big", 16), Cancel("ok")), now=0.1)
    assert in_flight(target) == [] and views.gaps == 0  # the rest of its message stands


def test_a_message_out_of_bounds_is_dropped_whole_and_its_loss_is_a_gap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    heard = Heard()
    target, bus = heard.target, heard.bus
    bus.receive(ENCODE(batch("a", 1, dispatch("r1"), FirstToken("r1"))), now=0.0)
    bus.receive(ENCODE(batch("a", 2, Complete("r2", 3), Complete("r1", 2**63))), now=0.1)
    assert in_flight(target) == ["a/r1"]  # not applied in part
    assert rejected(target, "invalid") == 1
    bus.receive(ENCODE(batch("a", 3, Heartbeat({}))), now=0.2)  # after the one dropped
    assert in_flight(target) == []  # its in-flight is left to the scrapes
    assert target.metrics.registry.get_sample_value("isocost_state_bus_gaps_total") == 1
    for junk in (b"", b"\xc1", b"hello", ENCODE([1, 2, 3]), ENCODE(["a/b", 1, 1.0, []])):
        bus.receive(junk, now=0.3)
    assert rejected(target, "undecodable") == 2  # not MessagePack
    assert rejected(target, "invalid") == 4  # no batch, or a gateway id with a "/"
    assert len(logged(caplog, "bus_rejected")) == 1  # six drops in one interval: one line
    bus.receive(b"", now=10.3)
    assert [r.__dict__["unlogged"] for r in logged(caplog, "bus_rejected")] == [0, 5]


@pytest.mark.parametrize("sent_unix_s", [float("nan"), float("inf"), -float("inf"), -1e308, 4e9])
def test_a_send_time_that_is_no_time_is_no_lag_but_the_message_is_applied(
    sent_unix_s: float,
) -> None:
    heard = Heard()
    heard.bus.receive(ENCODE(Batch("a", 1, sent_unix_s, [dispatch("r1")])), now=0.0)
    assert heard.lags == []
    assert in_flight(heard.target) == ["a/r1"]
    heard.bus.receive(ENCODE(Batch("a", 2, time.time(), [])), now=0.1)
    (lag,) = heard.lags
    assert 0.0 <= lag < 60


def test_a_flood_of_peer_ids_is_capped_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    heard = Heard()
    flood = [ENCODE(batch(f"fake{i}", 1, Heartbeat({REPLICA: 0}))) for i in range(MAX_PEERS + 50)]
    for message in flood:
        heard.bus.receive(message, now=0.0)
    assert len(heard.bus.views.peers) == MAX_PEERS
    assert rejected(heard.target, "too_many_peers") == 50
    assert len(logged(caplog, "too_many_peers")) == 1
    later = heard.bus.peer_timeout_s + 1
    assert len(heard.bus.views.expire(later)) == MAX_PEERS  # room again: a new peer joins
    heard.bus.receive(ENCODE(batch("late", 1, Heartbeat({}))), now=later)
    assert list(heard.bus.views.peers) == ["late"]


def test_divergence_is_passed_on_once_per_heartbeat_period_not_per_heartbeat() -> None:
    """Taken per heartbeat it walked every peer each time: quadratic in the peers."""
    heard = Heard()
    for i in range(20):
        heard.bus.receive(ENCODE(batch(f"g{i}", 1, Heartbeat({REPLICA: i}))), now=0.0)
    assert heard.divergences == []
    heard.bus.show_divergence()  # what the heartbeat loop does each period
    heard.bus.show_divergence()
    assert heard.divergences == [{REPLICA: 19.0}]
    heard.bus.views.expire(heard.bus.peer_timeout_s + 1)  # peers lost change it too
    heard.bus.show_divergence()
    assert heard.divergences[1:] == [{REPLICA: 0.0}]


def test_a_failing_subscriber_reports_the_bus_down_before_it_fails() -> None:
    """Supervise restarts it after a doubling delay; meanwhile nothing is applied, so the
    peers' in-flight must go and ``isocost_state_bus_up`` must read 0."""

    class BrokenSubscription:
        """Delivers ``messages``, then fails as a fault in applying one would."""

        def __init__(self, messages: list[bytes]) -> None:
            self.messages = messages

        async def next(self, timeout_s: float) -> bytes:
            if not self.messages:
                raise RuntimeError("a fault of ours")
            return self.messages.pop(0)

        async def close(self) -> None:
            pass

    class Transport:
        async def subscribe(self, channel: str) -> BrokenSubscription:
            return BrokenSubscription([ENCODE(batch("a", 1, dispatch("r1")))])

    heard = Heard()
    heard.bus._transport = Transport()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="a fault of ours"):
        asyncio.run(heard.bus.subscribe())
    assert heard.bus.up is False
    assert in_flight(heard.target) == [] and heard.bus.views.peers == {}
