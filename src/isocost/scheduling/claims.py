"""Where held requests are expected to go: the replica each one waits for, and its prefill.

SLO admission holds a request that would meet its deadline on some replica but that no
replica can take yet without pushing the streams there past their TPOT target
(``scheduling.dispatch``). It waits for the streams on one replica to end, and the one
it will most likely take is the candidate it would harm least: the fewest expected TPOT
victims among those that would meet its deadline. That replica is *claimed*: its
prefill is as good as queued there, and every stream placed there meanwhile is one more
it must wait for, then one more its prefill will stall. A scorer may count the claimed
prefill as pending work (``equal-cost-scorer`` does); the claim is the policy's own
bookkeeping, not shadow state: nothing has been sent.

A claim is renewed each time its request is held again (a wake schedules it again), and
ends when the policy admits or refuses it, or at its deadline, whichever is first: a
request that leaves the dispatcher otherwise (a queue timeout, a client gone) is never
seen again, so the deadline bounds what it can claim. Pure: time comes in as ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from isocost.scheduling.predict import IndexArray
from isocost.scheduling.timing import FloatArray

__all__ = ["Claims"]


@dataclass(frozen=True, slots=True)
class _Claim:
    slot: int
    prefill_s: float  # the held request's predicted prefill there (corrected)
    until_s: float  # its deadline: after it, the claim is void


class Claims:
    """The claims of one policy's held requests, by request id."""

    def __init__(self) -> None:
        self._claims: dict[str, _Claim] = {}

    def __len__(self) -> int:
        return len(self._claims)

    def claim(
        self, request_id: str, slot: int, prefill_s: float, until_s: float, now: float
    ) -> None:
        """``request_id`` is held, expected on ``slot`` (replacing any earlier claim)."""
        self._drop_expired(now)
        self._claims[request_id] = _Claim(slot, prefill_s, until_s)

    def release(self, request_id: str) -> None:
        """``request_id`` was admitted or refused: it waits for nothing any more."""
        self._claims.pop(request_id, None)

    def pending_prefill_s(self, now: float, idx: IndexArray, request_id: str) -> FloatArray | None:
        """Per slot of ``idx`` (ascending), the prefill seconds other held requests claimed there;
        None when none of them is claimed (claims past their deadline are dropped here)."""
        if not self._claims:
            return None
        self._drop_expired(now)
        pending: dict[int, float] = {}
        for rid, c in self._claims.items():
            if rid != request_id:
                pending[c.slot] = pending.get(c.slot, 0.0) + c.prefill_s
        if not pending:
            return None
        slots = np.fromiter(pending, dtype=np.int64, count=len(pending))
        at = np.minimum(np.searchsorted(idx, slots), max(idx.size - 1, 0))
        found = idx.size > 0 and idx[at] == slots
        if not np.any(found):
            return None
        held = np.zeros(idx.size)
        held[at[found]] = np.fromiter(pending.values(), dtype=np.float64)[found]
        return held

    def _drop_expired(self, now: float) -> None:
        """Claims past their deadline: requests that left unseen (a queue timeout, a
        client gone), so that a policy that never reads its claims keeps none for long."""
        expired = [rid for rid, c in self._claims.items() if c.until_s < now]
        for rid in expired:
            del self._claims[rid]
