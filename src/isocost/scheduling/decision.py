"""What ``Policy.schedule`` returns: an outcome value with its explanation.

Outcomes (``Outcome``) and how the gateway answers them:

* ``ADMIT``: send the request to ``replica_id`` now, then call ``ReplicaSet.on_dispatch``.
* ``QUEUE``: every eligible replica is at its queue cap; hold the request in the bounded
  queue of a ``dispatch.Dispatcher``, which schedules it again when a replica frees (late
  binding). With ``held``, SLO admission holds it instead: it would still meet its
  deadline somewhere, but no replica can take it now without pushing the streams there
  (or its own) past the TPOT target; the dispatcher schedules it again at every wake.
* ``REJECT``: answer now; ``reason`` (``RejectReason``) says why and ``retry_after_s`` when
  to retry. Suggested HTTP mapping: ``NO_REPLICA`` 404 (no replica serves the model),
  ``UNAVAILABLE`` and ``SHED`` 503, ``DEADLINE`` and ``QUEUE_FULL`` 429, all with
  ``Retry-After`` where ``retry_after_s`` is set. The dispatcher adds ``QUEUE_TIMEOUT``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from isocost.scheduling.predict import RawTimes

__all__ = ["Decision", "Explanation", "Outcome", "RejectReason"]


class Outcome(StrEnum):
    ADMIT = "admit"
    QUEUE = "queue"
    REJECT = "reject"


class RejectReason(StrEnum):
    NO_REPLICA = "no_replica"  # no replica serves this model / route class
    UNAVAILABLE = "unavailable"  # replicas exist but none is healthy and not draining
    SHED = "shed"  # too few replicas available: global load shedding
    DEADLINE = "deadline"  # predicted TTFT past the deadline, or inter-token time past target
    QUEUE_FULL = "queue_full"  # the gateway queue is full (set by dispatch.Dispatcher)
    QUEUE_TIMEOUT = "queue_timeout"  # waited in the queue past its limit (dispatch.Dispatcher)


ScoreRow = dict[str, float | str | dict[str, float]]
"""One candidate of ``Explanation.top``: ``replica_id``, a score per plugin, ``total``,
and ``inputs`` (name -> value) when the decision read any."""


@dataclass(frozen=True, slots=True)
class Explanation:
    """Why a replica was chosen: every plugin's scores for every eligible replica, and
    what the decision read about each (``Context.inputs_read``).

    ``replica_ids[i]`` pairs with ``scores[plugin][i]``, ``total[i]`` and
    ``inputs[name][i]``; scores are the clamped [0, 1] values each scorer returned,
    ``total`` their weighted sum.
    """

    replica_ids: npt.NDArray[np.object_]  # of str
    scores: Mapping[str, npt.NDArray[np.float64]]
    weights: Mapping[str, float]
    total: npt.NDArray[np.float64]
    notes: Mapping[str, str] = field(default_factory=dict)  # e.g. the route tier used
    inputs: Mapping[str, npt.NDArray[np.float64]] = field(default_factory=dict)

    def top(self, n: int = 5) -> list[ScoreRow]:
        """The ``n`` best replicas with their per-plugin scores, best first (and, under
        ``inputs``, what the decision read about each, when it read anything)."""
        order = np.argsort(-self.total, kind="stable")[:n]
        rows: list[ScoreRow] = []
        for i in order:
            row: ScoreRow = {"replica_id": str(self.replica_ids[i])}
            for name, values in self.scores.items():
                row[name] = float(values[i])
            row["total"] = float(self.total[i])
            if self.inputs:
                row["inputs"] = {name: float(values[i]) for name, values in self.inputs.items()}
            rows.append(row)
        return rows


@dataclass(frozen=True, slots=True)
class Decision:
    """One scheduling outcome; predictions refer to the chosen (or best) replica."""

    outcome: Outcome
    policy: str
    replica_id: str | None = None
    reason: RejectReason | None = None
    retry_after_s: float | None = None
    route_class: str = ""
    predicted_ttft_s: float | None = None
    predicted_e2e_s: float | None = None
    predicted_output_tokens: int | None = None
    cached_tokens: int = 0  # predicted prefix-cache hit on the chosen replica
    explanation: Explanation | None = None
    raw_times: RawTimes | None = None  # the chosen replica's, uncorrected (for on_dispatch)
    held: bool = False  # QUEUE by SLO admission (it fits the deadline, not the TPOT checks)
