"""``session-affinity-scorer``: the session's rendezvous-hash replica scores 1, others 0.

Formula: ``1`` for ``argmax_r H(session_key, replica_id_r)`` over the candidates, else 0,
with ``H`` a 64-bit rendezvous (highest random weight) hash. The same session goes to
the same replica while it is a candidate; when it is not, only that replica's sessions
move. Requests without a session key hash their request id (spread evenly). Inputs:
``RequestView.session_key``. Parameters: none.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from isocost.scheduling.interface import Context
from isocost.scheduling.plugins._base import NoParams, PluginKind, rendezvous, session_hash
from isocost.scheduling.timing import FloatArray

TYPE = "session-affinity-scorer"


class SessionAffinityScorer:
    type_name: ClassVar[str] = TYPE
    kind: ClassVar[PluginKind] = "scorer"

    def __init__(self, params: NoParams | None = None) -> None:
        del params

    def score(self, ctx: Context) -> FloatArray:
        weights = rendezvous(ctx.replicas.slots.salt[ctx.key], session_hash(ctx))
        scores = np.zeros(ctx.idx.size)
        scores[int(np.argmax(weights))] = 1.0
        return scores
