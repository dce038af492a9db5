"""The one late-binding dispatcher: the gateway's and the simulator's queue discipline.

Why it exists: the gateway (``gateway.routing.Router``) and the simulator
(``sim.Simulator``) must hold, wake and expire waiting requests in exactly the same way,
or the simulator would evaluate a queue the gateway does not have. Both drive this one
pure object, each from its own event loop with its own clock: the caller passes ``now``,
arms the timers the dispatcher asks for, and is called back with what to do.

The discipline, for one pool of replicas:

* ``submit``: the request is scheduled (the host's ``schedule``, i.e. ``Policy.schedule``);
  ADMIT binds it now (the host's ``bind``: dispatch it, ``ReplicaSet.on_dispatch``), REJECT
  refuses it (the host's ``reject`` with the decision's reason), QUEUE parks it in the
  bounded ``RequestQueue`` below. A parked request may wait until its deadline or
  ``queue_timeout_s`` after its arrival, whichever is first: ``submit`` returns that time,
  the host arms a timer for it and calls ``time_out`` when it fires (``QUEUE_TIMEOUT``).
* Held requests (a QUEUE decision with ``held``: SLO admission found that it would meet
  its deadline somewhere, but that no replica can take it now without pushing running
  streams, or its own, past the TPOT target) wait apart, in a second bounded
  ``RequestQueue``, until their deadline or ``queue_timeout_s`` as above. Why apart: they
  wait for the streams on some replica to end, not for a free slot, so one of them
  still waiting says nothing about the requests behind it. Each costs a ``schedule`` at
  every wake, so at most ``MAX_HELD`` wait held (fewer if the queue is smaller); beyond
  that the least urgent is refused (``QUEUE_FULL``), whatever an overload brings.
* ``wake``: a replica freed capacity (a completion, a first token, a replica back, fresh
  load figures); the host calls ``wake(now)``. First every held request is scheduled
  again, most urgent first: ADMIT or REJECT (no replica can meet its deadline any more)
  settles it, QUEUE keeps it held. Then requests whose deadline has passed leave
  (``DEADLINE``), and the most urgent queued request is scheduled again. ADMIT or
  REJECT: it leaves the queue and the turn passes to the next one, so a freed burst of
  capacity drains the queue in order. QUEUE: every replica is still full, so it keeps its
  place (it is not re-sequenced, and later arrivals do not pass it) and the wake ends; a
  queued request that is held instead moves to the held ones.
* ``cancel``: the client went away; the request leaves without an answer.
* Eviction: a full queue refuses the least urgent of the newcomer and the queued requests
  (``QUEUE_FULL``).

Every submitted request therefore ends exactly once: bound, rejected (by the policy, the
full queue, its deadline or the queue timeout) or cancelled. Callbacks run synchronously
inside the call that caused them, in the order they happen, and must not call back into
the dispatcher; a ``bind`` must update the shadow state before it returns, since the next
request of the same wake is scheduled against it.

The queue itself (formerly ``scheduling.admission``), a pure structure:

When ``Policy.schedule`` answers QUEUE (every eligible replica is at its queue cap) the
gateway parks the request here instead of pinning it to a replica. Whenever a replica
frees capacity (a completion), the most urgent request is scheduled again, so it goes to
whichever replica frees first: late binding.

Order: higher ``priority`` first, then earlier ``deadline_s`` (none = last), then the
request's fair turn among flows, then earlier arrival, then insertion order, a total order
so that equal requests leave FIFO. Bounded by ``max_size``: when full, a new request that
outranks the least urgent queued one evicts it (that one is rejected instead), else the
new request is rejected. Requests whose deadline has passed are removed by ``expire`` and
handed back to be answered (504 or 429). Cancelled requests (client gone) are removed
lazily. Every operation is O(log n) except ``expire`` and eviction (O(n) in the bounded
size).

Fair turns (start-time fair queueing, one unit per request): a request of a named
``flow`` (a tenant: the gateway's API key) starts at the later of the queue's virtual time
and the end of that flow's previous turn, and its turn ends one unit later; the virtual
time moves to the start of each request that leaves from the head (``take``). So a flow
that queued a thousand requests holds turns 0..999 while one that arrives next starts at
the current turn: flows alternate instead of the first flood going first, and a full
queue evicts the flood's last turn, not a newcomer. Requests of no flow start at the
current virtual time each (with no flow anywhere it stays 0 and the order is the one
above without turns, as the simulator runs it).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Generic, TypeVar

from isocost.scheduling.contract import RequestView
from isocost.scheduling.decision import Decision, Outcome, RejectReason

__all__ = ["MAX_HELD", "Dispatcher", "PushResult", "RequestQueue"]

MAX_HELD = 64  # requests held by SLO admission at once, per pool (each re-priced per wake)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PushResult:
    """Outcome of ``push``: whether the request is queued, and who must be rejected now."""

    queued: bool
    rejected: RequestView | None  # the new request (queue full) or an evicted one


_Key = tuple[int, float, float, float, int]  # priority, deadline, turn, arrival, sequence


class RequestQueue:
    """Bounded priority queue of requests waiting for a replica (see module docstring)."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._heap: list[tuple[_Key, RequestView]] = []
        self._live: dict[str, _Key] = {}  # request id -> key of its live heap entry
        self._sequence = 0
        self._virtual = 0.0  # the turn of the request that last left from the head
        self._turn_ends: dict[str, float] = {}  # per flow, where its last queued turn ends

    @property
    def max_size(self) -> int:
        return self._max_size

    @max_size.setter
    def max_size(self, value: int) -> None:
        """Resizable in place (a reload); a smaller size evicts as new requests come."""
        if value < 0:
            raise ValueError("max_size must be >= 0")
        self._max_size = value

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def push(self, request: RequestView) -> PushResult:
        """Queue ``request``; when full, the least urgent of it and the queued ones is rejected."""
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already queued")
        key = self._key(request)
        self._sequence += 1
        rejected: RequestView | None = None
        if len(self._live) >= self.max_size:
            worst = self._worst()
            if worst is None or worst[0] < key:
                if request.flow is not None:  # refused: the turn it took is its flow's again
                    self._turn_ends[request.flow] = key[2]
                return PushResult(False, request)
            self._discard(worst[1].request_id)
            rejected = worst[1]
        heapq.heappush(self._heap, (key, request))
        self._live[request.request_id] = key
        return PushResult(True, rejected)

    def peek(self) -> RequestView | None:
        """The most urgent queued request (it may have expired), without removing it."""
        while self._heap:
            key, request = self._heap[0]
            if self._live.get(request.request_id) == key:
                return request
            heapq.heappop(self._heap)
        return None

    def cancel(self, request_id: str) -> bool:
        """Drop a queued request (its client went away, or it timed out)."""
        return self._discard(request_id)

    def take(self, request_id: str) -> bool:
        """Remove a request that leaves to be answered (bound or refused by its policy):
        its turn has come, so the virtual time moves to it."""
        key = self._live.get(request_id)
        if key is None:
            return False
        self._virtual = max(self._virtual, key[2])
        return self._discard(request_id)

    def _key(self, request: RequestView) -> _Key:
        if len(self._turn_ends) > 2 * len(self._live) + 16:  # flows whose turns are past
            virtual = self._virtual  # (bounded even while newcomers of new flows are refused)
            self._turn_ends = {f: end for f, end in self._turn_ends.items() if end > virtual}
        turn = self._virtual
        if request.flow is not None:
            turn = max(turn, self._turn_ends.get(request.flow, 0.0))
            self._turn_ends[request.flow] = turn + 1.0
        deadline = request.deadline_s if request.deadline_s is not None else math.inf
        return (-request.priority, deadline, turn, request.arrival_s, self._sequence)

    def flows(self) -> Counter[str | None]:
        """How many requests of each flow wait here (None: of no flow)."""
        return Counter(r.flow for key, r in self._heap if self._live.get(r.request_id) == key)

    def ordered(self) -> list[RequestView]:
        """Every queued request, most urgent first (a snapshot: O(n log n))."""
        live = [(key, r) for key, r in self._heap if self._live.get(r.request_id) == key]
        return [r for _, r in sorted(live, key=lambda entry: entry[0])]

    def expire(self, now: float) -> list[RequestView]:
        """Remove and return every request whose deadline has passed."""
        expired: list[RequestView] = []
        for key, request in self._heap:
            late = request.deadline_s is not None and request.deadline_s < now
            if late and self._live.get(request.request_id) == key:
                expired.append(request)
                del self._live[request.request_id]
        return expired

    def _worst(self) -> tuple[_Key, RequestView] | None:
        live = [(k, r) for k, r in self._heap if self._live.get(r.request_id) == k]
        return max(live, key=lambda entry: entry[0]) if live else None

    def _discard(self, request_id: str) -> bool:
        if self._live.pop(request_id, None) is None:
            return False
        if len(self._heap) > 2 * len(self._live) + 16:  # compact stale entries
            self._heap = [(k, r) for k, r in self._heap if self._live.get(r.request_id) == k]
            heapq.heapify(self._heap)
        return True


Schedule = Callable[[RequestView, Collection[str], float], Decision]


@dataclass(frozen=True, slots=True)
class _Waiting(Generic[T]):
    ticket: T  # the host's handle on the request (its future, its record)
    request: RequestView
    exclude: Collection[str]  # replicas this attempt must not use


class Dispatcher(Generic[T]):
    """Late binding over one ``RequestQueue`` (see the module docstring).

    ``schedule(request, exclude, now)`` asks the policy; ``bind(ticket, request, decision,
    now)`` dispatches an admitted request; ``reject(ticket, request, reason, decision)``
    answers a refused one (``decision`` is the policy's REJECT, None when the queue itself
    refused it: full, deadline passed, queue timeout). ``ticket`` is the host's own handle,
    handed back as given.
    """

    def __init__(
        self,
        max_size: int,
        queue_timeout_s: float,
        *,
        schedule: Schedule,
        bind: Callable[[T, RequestView, Decision, float], None],
        reject: Callable[[T, RequestView, RejectReason, Decision | None], None],
    ) -> None:
        self.queue = RequestQueue(max_size)
        self.held = RequestQueue(min(max_size, MAX_HELD))  # held by SLO admission
        self.queue_timeout_s = queue_timeout_s
        self._schedule = schedule
        self._bind = bind
        self._reject = reject
        self._waiting: dict[str, _Waiting[T]] = {}  # by request id, while queued or held

    @property
    def max_size(self) -> int:
        return self.queue.max_size

    @max_size.setter
    def max_size(self, value: int) -> None:
        self.queue.max_size = value
        self.held.max_size = min(value, MAX_HELD)

    def __len__(self) -> int:
        return len(self.queue) + len(self.held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.queue or request_id in self.held

    def flows(self) -> Counter[str | None]:
        """How many requests of each flow wait, queued or held."""
        return self.queue.flows() + self.held.flows()

    def submit(
        self, ticket: T, request: RequestView, now: float, exclude: Collection[str] = ()
    ) -> float | None:
        """Schedule ``request`` now: bound or rejected through the callbacks (None), or
        queued or held: then the time at which the host must call ``time_out`` for it."""
        decision = self._schedule(request, exclude, now)
        if decision.outcome is not Outcome.QUEUE:
            self._settle(ticket, request, decision, now)
            return None
        if not self._park(ticket, request, exclude, decision.held):
            return None
        limit = request.arrival_s + self.queue_timeout_s
        if request.deadline_s is not None:
            limit = min(limit, request.deadline_s)
        return max(limit, now)

    def wake(self, now: float) -> None:
        """Capacity freed: every held request tries again, then the most urgent queued
        request, then the next, until one still finds every replica full (it keeps its
        place) or the queue is empty."""
        for held in self.held.ordered():
            entry = self._waiting[held.request_id]
            decision = self._schedule(held, entry.exclude, now)
            if decision.outcome is not Outcome.QUEUE:
                self.held.take(held.request_id)
                del self._waiting[held.request_id]
                self._settle(entry.ticket, held, decision, now)
        queue = self.queue
        while len(queue):
            for late in queue.expire(now):
                entry = self._waiting.pop(late.request_id)
                self._reject(entry.ticket, late, RejectReason.DEADLINE, None)
            request = queue.peek()
            if request is None:
                return
            entry = self._waiting[request.request_id]
            decision = self._schedule(request, entry.exclude, now)
            if decision.outcome is Outcome.QUEUE and not decision.held:
                return
            queue.take(request.request_id)
            del self._waiting[request.request_id]
            if decision.outcome is Outcome.QUEUE:  # held now: it waits for streams to end
                self._park(entry.ticket, request, entry.exclude, held=True)
            else:
                self._settle(entry.ticket, request, decision, now)

    def time_out(self, request_id: str) -> None:
        """The time ``submit`` returned for ``request_id`` has come: if it still waits
        (queued or held), it is rejected (``QUEUE_TIMEOUT``)."""
        entry = self._waiting.pop(request_id, None)
        if entry is not None:
            if not self.held.cancel(request_id):
                self.queue.cancel(request_id)
            self._reject(entry.ticket, entry.request, RejectReason.QUEUE_TIMEOUT, None)

    def cancel(self, request_id: str) -> bool:
        """The client went away: drop its request if it still waits (no callback)."""
        if self._waiting.pop(request_id, None) is None:
            return False
        return self.held.cancel(request_id) or self.queue.cancel(request_id)

    def clear(self) -> list[T]:
        """Remove every waiting request, held ones first, each most urgent first, and hand
        back their tickets (the pool is gone; the host answers them)."""
        tickets: list[T] = []
        for waiting in (self.held, self.queue):
            while (request := waiting.peek()) is not None:
                waiting.cancel(request.request_id)
                tickets.append(self._waiting.pop(request.request_id).ticket)
        return tickets

    def _park(self, ticket: T, request: RequestView, exclude: Collection[str], held: bool) -> bool:
        """Queue (or hold) ``request``; whether it waits now (a full queue refuses the
        least urgent of it and those waiting there)."""
        pushed = (self.held if held else self.queue).push(request)
        if pushed.rejected is not None:
            evicted = self._waiting.pop(pushed.rejected.request_id, None)
            if evicted is None:  # the newcomer itself
                self._reject(ticket, request, RejectReason.QUEUE_FULL, None)
            else:
                self._reject(evicted.ticket, evicted.request, RejectReason.QUEUE_FULL, None)
        if pushed.queued:
            self._waiting[request.request_id] = _Waiting(ticket, request, exclude)
        return pushed.queued

    def _settle(self, ticket: T, request: RequestView, decision: Decision, now: float) -> None:
        if decision.outcome is Outcome.ADMIT:
            self._bind(ticket, request, decision, now)
        else:
            self._reject(ticket, request, decision.reason or RejectReason.UNAVAILABLE, decision)
