"""The late-binding dispatcher: submit, wake (pass the turn, keep the place), expiry, queue
timeout, cancel, eviction, requests held by SLO admission; and, as a property, every
request ends exactly once."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import pytest
from conftest import MODEL
from hypothesis import given, settings
from hypothesis import strategies as st

from isocost.scheduling.contract import RequestView
from isocost.scheduling.decision import Decision, Outcome, RejectReason
from isocost.scheduling.dispatch import MAX_HELD, Dispatcher


@dataclass
class Host:
    """A pool with ``capacity`` free slots; requests named in ``refuse`` are rejected, those
    in ``hold`` held (SLO admission: no replica can take them yet without harm)."""

    capacity: int = 0
    refuse: set[str] = field(default_factory=set)
    hold: set[str] = field(default_factory=set)
    tried: list[str] = field(default_factory=list)  # every schedule call, in order
    log: list[tuple[str, str]] = field(default_factory=list)  # (ticket, replica | reason)

    def schedule(self, request: RequestView, exclude: Collection[str], now: float) -> Decision:
        self.tried.append(request.request_id)
        if request.request_id in self.refuse:
            return Decision(Outcome.REJECT, "test", reason=RejectReason.UNAVAILABLE)
        if request.request_id in self.hold:
            return Decision(Outcome.QUEUE, "test", held=True)
        if self.capacity <= 0:
            return Decision(Outcome.QUEUE, "test")
        replica = "r1" if "r0" in exclude else "r0"
        return Decision(Outcome.ADMIT, "test", replica_id=replica)

    def bind(self, ticket: str, request: RequestView, decision: Decision, now: float) -> None:
        assert decision.replica_id is not None
        self.capacity -= 1  # the shadow state changes before the next one is tried
        self.log.append((ticket, decision.replica_id))

    def reject(
        self, ticket: str, request: RequestView, reason: RejectReason, decision: Decision | None
    ) -> None:
        assert (decision is None) == (reason is not RejectReason.UNAVAILABLE)
        self.log.append((ticket, str(reason)))

    def dispatcher(self, max_size: int = 10, queue_timeout_s: float = 30.0) -> Dispatcher[str]:
        return Dispatcher(
            max_size, queue_timeout_s, schedule=self.schedule, bind=self.bind, reject=self.reject
        )


def view(name: str, arrival_s: float = 0.0, **kwargs: object) -> RequestView:
    return RequestView(name, MODEL, 100, arrival_s=arrival_s, **kwargs)  # type: ignore[arg-type]


def submit(dispatcher: Dispatcher[str], request: RequestView, now: float = 0.0) -> float | None:
    return dispatcher.submit(request.request_id, request, now)


def test_submit_binds_or_rejects_at_once_or_names_the_waiting_limit() -> None:
    host = Host(capacity=1, refuse={"no"})
    dispatcher = host.dispatcher(queue_timeout_s=30.0)
    assert submit(dispatcher, view("a")) is None
    assert submit(dispatcher, view("no")) is None
    assert submit(dispatcher, view("b", arrival_s=1.0), now=2.0) == 31.0  # arrival + timeout
    assert submit(dispatcher, view("c", arrival_s=1.0, deadline_s=5.0), now=2.0) == 5.0
    late = view("d", arrival_s=1.0, deadline_s=1.5)  # deadline already past: time out now
    assert submit(dispatcher, late, now=2.0) == 2.0
    assert host.log == [("a", "r0"), ("no", "unavailable")]
    assert len(dispatcher) == 3 and "b" in dispatcher and "a" not in dispatcher


def test_wake_passes_the_turn_and_a_head_that_must_wait_again_keeps_its_place() -> None:
    host = Host()
    dispatcher = host.dispatcher()
    for name in ("h1", "h2", "h3"):  # equal keys: only insertion order tells them apart
        submit(dispatcher, view(name))
    host.tried.clear()
    dispatcher.wake(1.0)  # no room: the head tries, keeps its place, the wake ends
    assert host.tried == ["h1"] and host.log == []
    submit(dispatcher, view("later"))  # an equal-key later arrival does not pass it
    host.capacity = 2
    host.tried.clear()
    dispatcher.wake(2.0)  # room for two: the turn passes on, the third keeps its place
    assert host.tried == ["h1", "h2", "h3"]
    assert host.log == [("h1", "r0"), ("h2", "r0")]
    host.capacity = 5
    dispatcher.wake(3.0)
    assert [t for t, _ in host.log] == ["h1", "h2", "h3", "later"] and len(dispatcher) == 0


def test_a_flow_arriving_behind_a_flood_is_served_at_the_next_turn() -> None:
    host = Host()
    dispatcher = host.dispatcher()
    for i in range(4):
        submit(dispatcher, view(f"bulk{i}", flow="bulk"))
    host.capacity = 2
    dispatcher.wake(1.0)  # two of the flood served: their turns are past
    submit(dispatcher, view("light0", arrival_s=2.0, flow="light"))
    submit(dispatcher, view("light1", arrival_s=2.0, flow="light"))
    host.capacity = 4
    dispatcher.wake(3.0)
    order = [ticket for ticket, _ in host.log]
    assert order == ["bulk0", "bulk1", "light0", "bulk2", "light1", "bulk3"]


def test_a_head_refused_on_wake_passes_the_turn_too() -> None:
    host = Host()
    dispatcher = host.dispatcher()
    submit(dispatcher, view("a", priority=1))
    submit(dispatcher, view("b"))
    host.refuse.add("a")
    host.capacity = 1
    dispatcher.wake(1.0)
    assert host.log == [("a", "unavailable"), ("b", "r0")]


def test_wake_expires_passed_deadlines_before_trying_the_head() -> None:
    host = Host()
    dispatcher = host.dispatcher()
    submit(dispatcher, view("soon", priority=1, deadline_s=1.0))
    submit(dispatcher, view("open"))
    host.capacity = 1
    dispatcher.wake(1.0)  # a deadline equal to now has not passed
    assert host.log == [("soon", "r0")]
    submit(dispatcher, view("x", priority=1, deadline_s=2.0))
    host.capacity = 1
    host.tried.clear()
    dispatcher.wake(2.5)
    assert host.log[1:] == [("x", "deadline"), ("open", "r0")] and host.tried == ["open"]


def test_time_out_rejects_a_waiting_request_once() -> None:
    host = Host()
    dispatcher = host.dispatcher()
    submit(dispatcher, view("a"))
    submit(dispatcher, view("b"))
    dispatcher.time_out("a")
    dispatcher.time_out("a")
    assert host.log == [("a", "queue_timeout")] and "a" not in dispatcher
    host.capacity = 1
    dispatcher.wake(1.0)
    dispatcher.time_out("b")  # bound already: its timer is stale
    assert host.log == [("a", "queue_timeout"), ("b", "r0")]


def test_cancel_drops_a_waiting_request_without_an_answer() -> None:
    host = Host()
    dispatcher = host.dispatcher()
    submit(dispatcher, view("gone", priority=1))
    submit(dispatcher, view("stays"))
    assert dispatcher.cancel("gone") and not dispatcher.cancel("gone")
    host.capacity = 2
    dispatcher.wake(1.0)
    dispatcher.time_out("gone")
    assert host.log == [("stays", "r0")] and not dispatcher.cancel("stays")


def test_a_full_queue_evicts_the_least_urgent_or_refuses_the_newcomer() -> None:
    host = Host()
    dispatcher = host.dispatcher(max_size=2)
    submit(dispatcher, view("a", arrival_s=0.0))
    submit(dispatcher, view("b", arrival_s=1.0))
    assert submit(dispatcher, view("c", arrival_s=2.0)) is None  # least urgent: refused
    assert submit(dispatcher, view("d", arrival_s=3.0, priority=5)) == 33.0  # evicts b
    assert host.log == [("c", "queue_full"), ("b", "queue_full")]
    dispatcher.max_size = 3  # a reload resizes the queue in place
    assert submit(dispatcher, view("e", arrival_s=4.0)) is not None
    assert dispatcher.clear() == ["d", "a", "e"] and len(dispatcher) == 0
    with pytest.raises(ValueError):
        dispatcher.max_size = -1


def test_the_exclusions_of_an_attempt_travel_with_it_through_the_queue() -> None:
    host = Host()
    dispatcher = host.dispatcher()
    dispatcher.submit("retry", view("retry"), 0.0, ("r0",))
    host.capacity = 1
    dispatcher.wake(1.0)
    assert host.log == [("retry", "r1")]


def test_a_held_request_waits_apart_and_does_not_hold_up_the_queue() -> None:
    host = Host(hold={"long"})
    dispatcher = host.dispatcher()
    assert submit(dispatcher, view("long", priority=2, deadline_s=9.0)) == 9.0
    submit(dispatcher, view("a"))
    submit(dispatcher, view("b"))
    assert len(dispatcher) == 3 and "long" in dispatcher and dispatcher.queue.peek() is not None
    host.capacity = 1
    host.tried.clear()
    dispatcher.wake(1.0)  # the held one tries first, still held; the queue's head goes on
    assert host.tried == ["long", "a", "b"] and host.log == [("a", "r0")]
    host.hold.clear()  # the streams it would stall ended: it goes first, ahead of "b"
    host.capacity = 1
    dispatcher.wake(2.0)
    assert host.log == [("a", "r0"), ("long", "r0")] and len(dispatcher) == 1


def test_a_held_request_is_refused_once_no_replica_can_meet_it() -> None:
    host = Host(hold={"long"})
    dispatcher = host.dispatcher()
    submit(dispatcher, view("long", deadline_s=9.0))
    host.hold.clear()
    host.refuse.add("long")  # the policy's REJECT (here unavailable) settles it at a wake
    dispatcher.wake(1.0)
    assert host.log == [("long", "unavailable")] and len(dispatcher) == 0
    host.hold.add("timed")
    submit(dispatcher, view("timed", deadline_s=5.0))
    dispatcher.time_out("timed")  # its deadline came first: refused like a queued one
    dispatcher.time_out("timed")
    assert host.log[1:] == [("timed", "queue_timeout")] and len(dispatcher) == 0


def test_a_queued_request_held_at_a_wake_moves_aside_and_the_turn_passes() -> None:
    host = Host()
    dispatcher = host.dispatcher()
    submit(dispatcher, view("first", priority=1))
    submit(dispatcher, view("second"))
    host.hold.add("first")  # room now, but taking it would stall the streams there
    host.capacity = 1
    dispatcher.wake(1.0)
    assert host.log == [("second", "r0")]
    assert dispatcher.queue.peek() is None and dispatcher.held.peek() is not None
    host.hold.clear()
    host.capacity = 1
    dispatcher.wake(2.0)
    assert host.log[-1] == ("first", "r0") and len(dispatcher) == 0


def test_held_requests_are_bounded_cancelled_and_cleared_like_queued_ones() -> None:
    host = Host(hold={"h1", "h2", "h3"})
    dispatcher = host.dispatcher(max_size=2)
    submit(dispatcher, view("h1", arrival_s=0.0))
    submit(dispatcher, view("h2", arrival_s=1.0, priority=1))
    assert submit(dispatcher, view("h3", arrival_s=2.0)) is None  # least urgent: refused
    submit(dispatcher, view("q"))  # the queue proper has its own bound
    assert host.log == [("h3", "queue_full")] and len(dispatcher) == 3
    assert dispatcher.cancel("h1") and not dispatcher.cancel("h1")
    assert dispatcher.clear() == ["h2", "q"] and len(dispatcher) == 0
    dispatcher.max_size = 10_000  # a large queue: held ones are still bounded apart
    assert (dispatcher.queue.max_size, dispatcher.held.max_size) == (10_000, MAX_HELD)


# -- property: every request ends exactly once ---------------------------------------------

_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"),
            st.integers(0, 2),  # priority
            st.one_of(st.none(), st.floats(0.0, 20.0)),  # deadline, relative to now
            st.booleans(),  # the policy refuses it
            st.booleans(),  # SLO admission holds it
        ),
        st.tuples(st.just("release"), st.integers(0, 40)),  # no longer held
        st.tuples(st.just("wake"), st.integers(0, 3)),  # slots freed
        st.tuples(st.just("time_out"), st.integers(0, 40)),
        st.tuples(st.just("cancel"), st.integers(0, 40)),
        st.tuples(st.just("tick"), st.floats(0.0, 5.0)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=_ops, max_size=st.integers(0, 6))
def test_every_request_is_bound_rejected_or_cancelled_exactly_once(
    ops: list[tuple[object, ...]], max_size: int
) -> None:
    host = Host()
    dispatcher = host.dispatcher(max_size=max_size, queue_timeout_s=10.0)
    names: list[str] = []
    cancelled: list[str] = []
    now = 0.0
    for op in ops:
        kind = op[0]
        if kind == "submit":
            _, priority, deadline, refused, held = op
            name = f"q{len(names)}"
            names.append(name)
            if refused:
                host.refuse.add(name)
            if held:
                host.hold.add(name)
            deadline_s = None if deadline is None else now + float(deadline)  # type: ignore[arg-type]
            request = view(name, arrival_s=now, priority=priority, deadline_s=deadline_s)
            limit = dispatcher.submit(name, request, now)
            assert (limit is not None) == (name in dispatcher)
            assert limit is None or limit >= now
        elif kind == "wake":
            host.capacity += int(op[1])  # type: ignore[call-overload]
            before = len(host.log)
            host.tried.clear()
            dispatcher.wake(now)
            settled = {t for t, _ in host.log[before:]}
            held = {r.request_id for r in dispatcher.held.ordered()}
            waits_again = [name for name in host.tried if name not in settled | held]
            # of the queued, only the last one tried may still wait, and it is the head
            # again (its place); every held one is tried (and stays held until it is
            # settled), the queued ones after them
            assert waits_again in ([], host.tried[-1:])
            if waits_again:
                head = dispatcher.queue.peek()
                assert head is not None and head.request_id == waits_again[0]
        elif kind == "release" and names:
            host.hold.discard(names[int(op[1]) % len(names)])  # type: ignore[call-overload]
        elif kind in ("time_out", "cancel") and names:
            name = names[int(op[1]) % len(names)]  # type: ignore[call-overload]
            if kind == "time_out":
                dispatcher.time_out(name)
            elif dispatcher.cancel(name):
                cancelled.append(name)
        elif kind == "tick":
            now += float(op[1])  # type: ignore[arg-type]
        assert len(dispatcher) == len(names) - len(host.log) - len(cancelled)
    remaining = dispatcher.clear()
    ended = [t for t, _ in host.log] + cancelled + remaining
    assert sorted(ended) == sorted(names)
