"""The gateway's bounded, priority-ordered request queue (late binding), as a pure structure.

When ``Policy.schedule`` answers QUEUE (every eligible replica is at its queue cap) the
gateway parks the request here instead of pinning it to a replica. Whenever a replica
frees capacity (a completion), the gateway pops the most urgent request and schedules it
again, so it goes to whichever replica frees first: late binding.

Order: higher ``priority`` first, then earlier ``deadline_s`` (none = last), then earlier
arrival, then insertion order, a total order so that equal requests leave FIFO. Bounded
by ``max_size``: when full, a new request that outranks the least urgent queued one
evicts it (that one is rejected instead), else the new request is rejected. Requests
whose deadline has passed are removed by ``pop`` and ``expire`` and handed back to be
answered (504 or 429). Cancelled requests (client gone) are removed lazily. Every
operation is O(log n) except ``expire`` and eviction (O(n) in the bounded size).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from isocost.scheduling.contract import RequestView

__all__ = ["PushResult", "RequestQueue"]


@dataclass(frozen=True, slots=True)
class PushResult:
    """Outcome of ``push``: whether the request is queued, and who must be rejected now."""

    queued: bool
    rejected: RequestView | None  # the new request (queue full) or an evicted one


_Key = tuple[int, float, float, int]


def _key(request: RequestView, sequence: int) -> _Key:
    deadline = request.deadline_s if request.deadline_s is not None else math.inf
    return (-request.priority, deadline, request.arrival_s, sequence)


class RequestQueue:
    """Bounded priority queue of requests waiting for a replica (see module docstring)."""

    def __init__(self, max_size: int) -> None:
        if max_size < 0:
            raise ValueError("max_size must be >= 0")
        self.max_size = max_size
        self._heap: list[tuple[_Key, RequestView]] = []
        self._live: dict[str, _Key] = {}  # request id -> key of its live heap entry
        self._sequence = 0
        self._expired: list[RequestView] = []

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def push(self, request: RequestView) -> PushResult:
        """Queue ``request``; when full, the least urgent of it and the queued ones is rejected."""
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already queued")
        key = _key(request, self._sequence)
        self._sequence += 1
        rejected: RequestView | None = None
        if len(self._live) >= self.max_size:
            worst = self._worst()
            if worst is None or worst[0] < key:
                return PushResult(False, request)
            self._discard(worst[1].request_id)
            rejected = worst[1]
        heapq.heappush(self._heap, (key, request))
        self._live[request.request_id] = key
        return PushResult(True, rejected)

    def pop(self, now: float) -> RequestView | None:
        """The most urgent queued request whose deadline has not passed, or None."""
        while self._heap:
            key, request = heapq.heappop(self._heap)
            if self._live.get(request.request_id) != key:
                continue  # cancelled or evicted earlier
            del self._live[request.request_id]
            if request.deadline_s is not None and request.deadline_s < now:
                self._expired.append(request)
                continue
            return request
        return None

    def peek(self) -> RequestView | None:
        """The request ``pop`` would consider next (it may have expired), without removing it."""
        while self._heap:
            key, request = self._heap[0]
            if self._live.get(request.request_id) == key:
                return request
            heapq.heappop(self._heap)
        return None

    def cancel(self, request_id: str) -> bool:
        """Drop a queued request (its client went away)."""
        return self._discard(request_id)

    def expire(self, now: float) -> list[RequestView]:
        """Remove and return every request whose deadline has passed (including those
        ``pop`` skipped since the last call)."""
        expired, self._expired = self._expired, []
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
