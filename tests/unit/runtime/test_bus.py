"""The state bus without Redis: peers' batches applied to a real router's shadow state
through its hooks, sequence gaps, silent peers, the view divergence, the wire format, a
publisher that stops when cancelled whatever the client does, and the ``state_bus``
config section."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping

import msgspec
import pytest

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError
from isocost.gateway.metrics import GatewayMetrics
from isocost.gateway.routing import Router
from isocost.gateway.upstreams import Pool, Upstream
from isocost.runtime.bus import (
    Batch,
    Cancel,
    Complete,
    Dispatch,
    Event,
    FirstToken,
    Heartbeat,
    Holding,
    PeerViews,
    Spend,
    StateBus,
    Tokens,
)
from isocost.runtime.config import HealthConfig, ReplicaConfig, StateBusConfig, parse_config

MODEL = "llama-3.1-8b"
REPLICA = "127.0.0.1:9"
HASHES = (11, 22, 33, 2**64 - 1)  # block hashes are unsigned 64-bit
TIMEOUT_S = 1.0


def router() -> Router:
    built = Router(
        Catalog.builtin(),
        GatewayMetrics(),
        on_idle=lambda replica: None,
        on_reject=lambda reason: None,
        queue_size=4,
        queue_timeout_s=5.0,
        clock=lambda: 0.0,  # the hooks' time; the peers' times are PeerViews' own
    )
    pool = Pool(MODEL, "equal_cost")
    built.set_policy(pool, "equal_cost")
    replica = Upstream(ReplicaConfig(url=f"http://{REPLICA}"), MODEL, HealthConfig())
    built.add_replica(pool, replica)
    return built


def dispatch(request_id: str, replica: str = REPLICA) -> Dispatch:
    return Dispatch(request_id, replica, MODEL, 512, 64, "default", True, "s-1", HASHES)


def batch(gateway: str, seq: int, *events: Event) -> Batch:
    return Batch(gateway, seq, 1.8e9, list(events))


def in_flight(target: Router) -> list[str]:
    return sorted(target.replicas.get(REPLICA).in_flight)


def test_a_peer_dispatch_is_in_flight_and_prefix_indexed_like_a_local_one() -> None:
    target = router()
    views = PeerViews("me", target, TIMEOUT_S)
    views.apply(batch("a", 7, dispatch("r1")), now=0.0)
    state = target.replicas.get(REPLICA)
    assert in_flight(target) == ["a/r1"]
    assert state.num_waiting == 1  # the same hook: local load counts it
    assert target.replicas.prefix.match_replica(state.slot, HASHES) == len(HASHES)
    wait_s = target.replicas.predict_one(state.slot, 0.0, 512, 0, 1).wait_s
    assert wait_s > 0  # its prefill is queued ahead of the next request
    views.apply(batch("a", 8, FirstToken("r1")), now=0.1)
    assert (state.num_waiting, state.num_running) == (0, 1)
    views.apply(batch("a", 9, Tokens("r1", 10)), now=0.15)
    assert state.in_flight["a/r1"].generated_tokens == 11  # its decode ahead shrinks
    views.apply(batch("a", 10, Complete("r1", 40)), now=0.2)
    assert in_flight(target) == [] and views.peers["a"].requests == set()


def test_own_messages_duplicates_and_unknown_replicas_are_ignored() -> None:
    target = router()
    views = PeerViews("me", target, TIMEOUT_S)
    views.apply(batch("me", 1, dispatch("mine")), now=0.0)
    views.apply(batch("a", 1, dispatch("r1"), dispatch("r2", replica="elsewhere:1")), now=0.0)
    views.apply(batch("a", 1, dispatch("again")), now=0.0)  # a duplicate of seq 1
    assert in_flight(target) == ["a/r1"]
    views.apply(batch("a", 2, Cancel("r2"), Cancel("r1")), now=0.1)
    assert in_flight(target) == [] and views.gaps == 0


def test_a_sequence_gap_drops_the_peer_then_tracks_it_afresh() -> None:
    target = router()
    views = PeerViews("me", target, TIMEOUT_S)
    views.apply(batch("a", 1, dispatch("r1")), now=0.0)
    views.apply(batch("b", 1, dispatch("r9")), now=0.0)
    views.apply(batch("a", 4, dispatch("r2")), now=0.1)  # 2 and 3 were lost
    assert views.gaps == 1
    assert in_flight(target) == ["a/r2", "b/r9"]  # only the peer that jumped is dropped
    views.apply(batch("a", 5, Complete("r1", 3), Complete("r2", 3)), now=0.2)
    assert in_flight(target) == ["b/r9"]


def test_a_silent_peer_expires_and_a_lost_bus_drops_everyone() -> None:
    target = router()
    views = PeerViews("me", target, TIMEOUT_S)
    views.apply(batch("a", 1, dispatch("r1")), now=0.0)
    views.apply(batch("b", 1, dispatch("r2")), now=0.8)
    assert views.expire(TIMEOUT_S - 0.01) == []
    assert views.expire(TIMEOUT_S + 0.01) == ["a"]
    assert in_flight(target) == ["b/r2"] and list(views.peers) == ["b"]
    views.drop_all()
    assert in_flight(target) == [] and views.peers == {}


def test_divergence_is_the_widest_gap_to_a_peer_heartbeat() -> None:
    target = router()
    views = PeerViews("me", target, TIMEOUT_S)
    assert views.divergence() == {REPLICA: 0.0}
    views.apply(batch("a", 1, dispatch("r1"), Heartbeat({REPLICA: 1})), now=0.0)
    views.apply(batch("b", 1, Heartbeat({REPLICA: 4})), now=0.0)
    assert views.divergence() == {REPLICA: 3.0}
    views.apply(batch("c", 1, Heartbeat({})), now=0.0)  # c sees nothing there
    assert views.divergence() == {REPLICA: 3.0}


def test_divergence_is_taken_as_each_heartbeat_lands() -> None:
    """A view that moved since a peer's heartbeat is no divergence: the gap is taken
    where the heartbeat sits in its peer's stream, after the events sent before it."""
    target = router()
    views = PeerViews("me", target, TIMEOUT_S)
    views.apply(batch("a", 1, dispatch("r1"), dispatch("r2"), Heartbeat({REPLICA: 2})), 0.0)
    views.apply(batch("b", 1, Heartbeat({REPLICA: 2})), now=0.0)
    assert views.divergence() == {REPLICA: 0.0}
    # a's requests end before its next heartbeat: both views now hold none
    views.apply(batch("a", 2, Complete("r1", 9), Complete("r2", 9)), now=0.1)
    assert views.divergence() == {REPLICA: 0.0}
    # an event behind the heartbeat in its batch was not in the sender's count
    views.apply(batch("a", 3, Heartbeat({REPLICA: 0}), dispatch("r3")), now=0.2)
    assert views.divergence() == {REPLICA: 0.0}
    views.apply(batch("b", 2, Heartbeat({REPLICA: 0})), now=0.3)  # b has not seen r3
    assert views.divergence() == {REPLICA: 1.0}


def test_batches_survive_the_wire() -> None:
    events = (dispatch("r1"), FirstToken("r1"), Tokens("r1", 4), Complete("r1", 9))
    keys = (Spend("team-a", 2, 900), Holding({"team-a": 3}))
    sent = batch("a", 3, *events, *keys, Heartbeat({"x": 2}))
    wire = msgspec.msgpack.encode(sent)
    assert msgspec.msgpack.decode(wire, type=Batch) == sent


def test_a_peer_spend_is_charged_and_one_on_an_unknown_key_is_counted() -> None:
    target = router()
    charged: list[tuple[str, int, int]] = []

    def on_spend(key: str, requests: int, tokens: int) -> bool:
        charged.append((key, requests, tokens))
        return key == "team-a"

    views = PeerViews("me", target, TIMEOUT_S, on_spend=on_spend)
    views.apply(batch("a", 1, Spend("team-a", 3, 1200), Spend("team-z", 1, 5)), now=0.0)
    views.apply(batch("me", 1, Spend("team-a", 9, 9)), now=0.0)  # our own: charged already
    assert charged == [("team-a", 3, 1200), ("team-z", 1, 5)]
    rejected = target.metrics.state_bus_rejected.labels("unknown_key")._value.get()
    assert rejected == 1  # the configs differ: visible, and nothing else is dropped


def test_a_peers_holding_replaces_the_last_and_leaves_with_the_peer() -> None:
    views = PeerViews("me", router(), TIMEOUT_S)
    views.apply(batch("a", 1, Holding({"team-a": 2, "team-b": 1})), now=0.0)
    views.apply(batch("b", 1, Holding({"team-a": 3})), now=0.0)
    assert views.held_by_peers("team-a") == 5 and views.held_by_peers("team-c") == 0
    views.apply(batch("a", 5, Holding({"team-a": 1})), now=0.2)  # after a gap: still whole
    assert (views.held_by_peers("team-a"), views.held_by_peers("team-b")) == (4, 0)
    views.apply(batch("a", 6), now=TIMEOUT_S + 0.5)
    views.expire(TIMEOUT_S + 0.5)  # b went silent: what it held is no longer counted
    assert views.held_by_peers("team-a") == 1


@pytest.mark.parametrize("spend", [[["s", "k", -1, 0]], [["s", "", 1, 0]], [["s", "k", 1, 2**60]]])
def test_a_spend_out_of_bounds_fails_its_whole_message(spend: list[object]) -> None:
    wire = msgspec.msgpack.encode(["a", 1, 1.8e9, spend])
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(wire, type=Batch)


def test_state_bus_config_defaults_and_errors() -> None:
    config = parse_config("state_bus: {url: 'redis://10.0.0.3:6379'}", "g.yaml")
    assert config.state_bus is not None
    assert (config.state_bus.channel, config.state_bus.peer_timeout_ms) == ("isocost:state", 2000)
    assert parse_config("{}", "g.yaml").state_bus is None
    bad = {
        "state_bus: {url: 'redis://h:1', color: red}": "color",
        "state_bus: {url: 'http://h:1'}": "state_bus.url",
        "state_bus: {url: 'redis://h:1', heartbeat_ms: 0}": "state_bus.heartbeat_ms",
        "state_bus: {url: 'redis://h:1', peer_timeout_ms: 100}": "state_bus.peer_timeout_ms",
    }
    for text, key in bad.items():
        with pytest.raises(ConfigError, match=key):
            parse_config(text, "g.yaml")


def test_a_bus_url_with_a_password_is_not_logged() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config("state_bus: {url: 'http://user:s3cret@h:1'}", "g.yaml")
    assert "s3cret" not in str(info.value)


def test_a_cancellation_the_redis_client_swallows_still_stops_the_publisher() -> None:
    class SwallowingClient:
        """Answers a publish cancelled mid-way as if it had gone (what redis-py may do)."""

        def __init__(self) -> None:
            self.entered = asyncio.Event()

        async def publish(self, channel: str, payload: bytes) -> int:
            self.entered.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
            return 0

    async def run() -> None:
        bus = StateBus(
            StateBusConfig(url="redis://127.0.0.1:1"),
            router(),
            on_divergence=lambda divergence: None,
            on_lag=lambda seconds: None,
        )
        client = SwallowingClient()
        bus._transport = client  # type: ignore[assignment]
        bus.up = True
        task = asyncio.create_task(bus.publish())
        bus.streamed("r1", 1, first=True)
        await client.entered.wait()
        task.cancel()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 2)
        assert task.cancelled()

    asyncio.run(run())


class CapturingClient:
    """A transport that keeps what is published."""

    def __init__(self) -> None:
        self.sent: list[Batch] = []
        self.arrived = asyncio.Event()

    async def publish(self, channel: str, payload: bytes) -> int:
        self.sent.append(msgspec.msgpack.decode(payload, type=Batch))
        self.arrived.set()
        return 1


def published(
    before_up: Callable[[StateBus], None],
    up: Callable[[StateBus], None],
    holding: Callable[[], Mapping[str, int]] = dict,
) -> Batch:
    """The one message the publisher sends after ``before_up`` ran on a bus not yet up
    and ``up`` on the bus up (``holding``: the gateway's in-flight per key)."""

    async def run() -> list[Batch]:
        bus = StateBus(
            StateBusConfig(url="redis://127.0.0.1:1"),
            router(),
            on_divergence=lambda divergence: None,
            on_lag=lambda seconds: None,
            holding=holding,
        )
        client = CapturingClient()
        bus._transport = client  # type: ignore[assignment]
        before_up(bus)
        bus.up = True
        up(bus)
        task = asyncio.create_task(bus.publish())
        await client.arrived.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return client.sent

    (sent,) = asyncio.run(run())
    return sent


def test_streamed_tokens_go_summed_per_request_after_its_first_token() -> None:
    def stream(bus: StateBus) -> None:
        bus.streamed("r1", 3, first=True)
        bus.streamed("r1", 4, first=False)
        bus.streamed("r2", 2, first=False)
        bus.streamed("r3", 5, first=False)
        bus.ended("r3", ok=True, output_tokens=9)  # its end carries the count

    sent = published(lambda bus: None, stream)
    assert sent.seq == 1
    assert sent.events == [FirstToken("r1"), Complete("r3", 9), Tokens("r1", 6), Tokens("r2", 2)]


def test_spends_go_summed_per_key_and_none_while_the_bus_is_down() -> None:
    def spend(bus: StateBus) -> None:
        bus.spent("team-a", requests=1)
        bus.spent("team-a", tokens=300)
        bus.spent("team-b", requests=1, tokens=40)
        bus.spent("team-b")  # nothing charged: no event

    sent = published(lambda bus: bus.spent("team-a", requests=1), spend)  # down: nobody hears
    assert sent.events == [Spend("team-a", 1, 300), Spend("team-b", 1, 40)]


def test_holdings_go_whole_once_per_message_and_a_key_at_zero_leaves_them() -> None:
    counts: dict[str, int] = {}  # the intake's in-flight per key, as the bus reads it

    def change(bus: StateBus, **now: int) -> None:
        counts.update(now)
        for key in [k for k, n in counts.items() if n == 0]:
            del counts[key]
        bus.holding_changed()

    def hold(bus: StateBus) -> None:
        change(bus, **{"team-a": 2})
        change(bus, **{"team-b": 1})
        change(bus, **{"team-a": 1})
        change(bus, **{"team-b": 0})

    # team-c's count changed while the bus was down: kept, and said once it is up
    sent = published(lambda bus: change(bus, **{"team-c": 4}), hold, holding=lambda: counts)
    assert sent.events == [Holding({"team-c": 4, "team-a": 1})]
