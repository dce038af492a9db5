"""Prefill/decode disaggregation: per request, colocated on one replica or a (P, D) pair.

Prefill is compute-bound and decode bandwidth-bound; a long prompt prefilled beside
running streams stalls every one of them (``scheduling.predict``: ``stall``, ``victims``).
Split across a prefill replica P and a decode replica D, the prompt is computed on P, its
KV moves to D over a link (``core.links``), and D only decodes. Splitting pays P's queue,
the transfer, and a second replica's time, so it wins only where prompts are long and
uncached; a short prompt, or one whose prefix D already holds, is cheaper prefilled where
it decodes. This module decides which, per request, with the same cost the equal-cost
scorer prices a replica with (``plugins.equal_cost``: own latency + lambda * the delay it
inflicts on the replica's running requests + KV pressure + GPU price)::

    colocated = cost_R(q)                              R: the policy's pick among decode|both
    split     = cost_P(q_prefill) + transfer + cost_D(q_decode)
                q_prefill: q with max_tokens=1 (its prefill alone) on P among prefill|both
                q_decode:  q with its prompt's KV arriving (kv_ready_tokens = n - 1: D
                           computes the last prompt token, which yields the first output)
                           on D among decode|both, D != P
    transfer  = kv_transfer_s(n - cached_D, kv_bytes_per_token_D, link)

Each leg is chosen by the caller's own policy (``Policy.schedule`` limited to the leg's
roles), so filters, SLO admission, affinity and queue caps apply to each as to any request.
The prefill leg keeps the request's TTFT deadline (the link's milliseconds are not charged
against it) and drops its TPOT target; the decode leg keeps the TPOT target and no
deadline. Modes (``DisaggMode``): ``colocated`` never splits; ``pd`` always splits when both
legs have replicas of their roles (a leg that queues or is refused makes the request queue
or be refused: the split is the rule), else runs colocated; ``conditional`` splits when
both legs are admitted and ``split < colocated`` (or colocated is not admitted).

Public API (what the gateway, the picker and the simulator call)::

    pair = choose_pair(policy, request, replicas, now, mode=DisaggMode.CONDITIONAL,
                       link=core.links.link("infiniband"))
    pair.decision            # act on it like Policy.schedule's (ADMIT / QUEUE / REJECT)
    if pair.disaggregated:   # two legs to dispatch, both at once:
        replicas.on_dispatch(pair.prefill_request, pair.prefill.replica_id, now,
                             decision=pair.prefill)
        replicas.on_dispatch(pair.decode_request, pair.decision.replica_id, now,
                             decision=pair.decision)
        # prefill leg's completion (1 token) -> transfer -> the decode leg streams
    else:
        replicas.on_dispatch(request, pair.decision.replica_id, now, decision=pair.decision)

Both legs are in the shadow state from the decision on, so P's queue shows the prefill and
D's KV room is reserved while the prompt is still being computed. The prefill leg's id is
``prefill_leg_id(request_id)`` and its route class ``<class>:prefill``, so the output-length
estimator never learns its one-token replies as the class's; the decode leg's predicted
wait includes the prefill leg's predicted TTFT and the transfer, so D's TTFT calibration
compares like with like. ``PairDecision`` also carries both options' costs, the transfer
and the P and D queue depths, for logs and metrics.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from isocost.core.links import Link, kv_transfer_s
from isocost.scheduling.contract import RequestView, Role
from isocost.scheduling.decision import Decision, Outcome, RejectReason
from isocost.scheduling.framework import Policy
from isocost.scheduling.interface import Context
from isocost.scheduling.plugins.equal_cost import EqualCostScorer
from isocost.scheduling.state import ReplicaSet

__all__ = [
    "DECODE_ROLES",
    "PREFILL_ROLES",
    "DisaggMode",
    "PairDecision",
    "choose_pair",
    "prefill_leg_id",
]

PREFILL_ROLES: frozenset[Role] = frozenset(("prefill", "both"))
DECODE_ROLES: frozenset[Role] = frozenset(("decode", "both"))  # also whole requests
_NO_REPLICAS = (RejectReason.NO_REPLICA, RejectReason.UNAVAILABLE)


class DisaggMode(StrEnum):
    COLOCATED = "colocated"  # never split
    PD = "pd"  # always split when prefill and decode replicas exist
    CONDITIONAL = "conditional"  # split where it is predicted cheaper


def prefill_leg_id(request_id: str) -> str:
    """The id of ``request_id``'s prefill leg (the decode leg keeps the request's)."""
    return f"{request_id}:prefill"


@dataclass(frozen=True, slots=True)
class PairDecision:
    """One request's placement: colocated (``prefill`` None) or a (P, D) pair."""

    mode: DisaggMode
    decision: Decision  # act on it: colocated, the decode leg when split, or why neither
    decode_request: RequestView  # the view to dispatch ``decision`` with
    prefill: Decision | None = None  # the prefill leg's ADMIT when split
    prefill_request: RequestView | None = None
    colocated_cost_s: float = math.inf  # inf: not priced, or not admitted
    split_cost_s: float = math.inf
    transfer_s: float = 0.0  # the split's predicted KV transfer (priced when split was)
    transfer_tokens: int = 0  # prompt tokens whose KV moves (those D lacks)
    prefill_queue: int = 0  # requests waiting at P when split was priced
    decode_queue: int = 0  # ... at D

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


@dataclass(frozen=True, slots=True)
class _Split:
    """The two legs, priced; or the leg decision that stopped them (``stopped``)."""

    stopped: Decision | None
    prefill: Decision | None = None
    decode: Decision | None = None
    prefill_request: RequestView | None = None
    decode_request: RequestView | None = None
    cost_s: float = math.inf
    transfer_s: float = 0.0
    transfer_tokens: int = 0


def choose_pair(
    policy: Policy,
    request: RequestView,
    replicas: ReplicaSet,
    now: float,
    *,
    mode: DisaggMode,
    link: Link,
    exclude: Collection[str] = (),
) -> PairDecision:
    """Colocated or split for ``request`` at ``now`` under ``mode`` (module docstring);
    ``exclude`` as in ``Policy.schedule``. A value, never raises on a request."""
    scorer = _equal_cost(policy)
    if mode is DisaggMode.COLOCATED:
        return _colocated(mode, policy, scorer, request, replicas, now, exclude)
    split = _split(policy, scorer, request, replicas, now, link, exclude)
    if split.stopped is not None and split.stopped.reason in _NO_REPLICAS:
        return _colocated(mode, policy, scorer, request, replicas, now, exclude)
    if mode is DisaggMode.PD:
        return _as_pair(mode, split, request, replicas)
    local = _colocated(mode, policy, scorer, request, replicas, now, exclude)
    if split.stopped is None and split.cost_s < local.colocated_cost_s:
        return dataclasses.replace(
            _as_pair(mode, split, request, replicas), colocated_cost_s=local.colocated_cost_s
        )
    return dataclasses.replace(
        local,
        split_cost_s=split.cost_s,
        transfer_s=split.transfer_s,
        transfer_tokens=split.transfer_tokens,
    )


def _colocated(
    mode: DisaggMode,
    policy: Policy,
    scorer: EqualCostScorer,
    request: RequestView,
    replicas: ReplicaSet,
    now: float,
    exclude: Collection[str],
) -> PairDecision:
    decision = policy.schedule(request, replicas, now, exclude=exclude, roles=DECODE_ROLES)
    cost = math.inf
    if mode is not DisaggMode.COLOCATED and decision.outcome is Outcome.ADMIT:
        cost = _cost_s(scorer, policy, request, replicas, now, decision)
    return PairDecision(mode, decision, request, colocated_cost_s=cost)


def _split(
    policy: Policy,
    scorer: EqualCostScorer,
    request: RequestView,
    replicas: ReplicaSet,
    now: float,
    link: Link,
    exclude: Collection[str],
) -> _Split:
    """Both legs chosen by ``policy`` and priced, or the leg decision that stopped them."""
    prefill_view = dataclasses.replace(
        request, request_id=prefill_leg_id(request.request_id), max_tokens=1, tpot_target_s=None
    )
    prefill = policy.schedule(prefill_view, replicas, now, exclude=exclude, roles=PREFILL_ROLES)
    if prefill.outcome is not Outcome.ADMIT or prefill.raw_times is None:
        return _Split(prefill)
    assert prefill.replica_id is not None
    decode_view = dataclasses.replace(
        request, kv_ready_tokens=max(request.prompt_tokens - 1, 0), deadline_s=None
    )
    decode = policy.schedule(
        decode_view, replicas, now, exclude=(*exclude, prefill.replica_id), roles=DECODE_ROLES
    )
    if decode.outcome is not Outcome.ADMIT or decode.raw_times is None:
        return _Split(decode)
    assert decode.replica_id is not None
    target = replicas.get(decode.replica_id)
    held = replicas.prefix.match_replica(target.slot, request.block_hashes)
    transfer_tokens = max(request.prompt_tokens - held * replicas.block_tokens, 0)
    transfer = kv_transfer_s(transfer_tokens, target.spec.cost_model.kv_bytes_per_token, link)
    cost = (
        _cost_s(scorer, policy, prefill_view, replicas, now, prefill)
        + transfer
        + _cost_s(scorer, policy, decode_view, replicas, now, decode)
    )
    handoff = prefill.raw_times.ttft_s + transfer
    decode_times = dataclasses.replace(decode.raw_times, wait_s=decode.raw_times.wait_s + handoff)
    return _Split(
        None,
        prefill=dataclasses.replace(prefill, route_class=f"{prefill.route_class}:prefill"),
        decode=dataclasses.replace(
            decode,
            raw_times=decode_times,
            predicted_ttft_s=(decode.predicted_ttft_s or 0.0) + handoff,
        ),
        prefill_request=prefill_view,
        decode_request=decode_view,
        cost_s=cost,
        transfer_s=transfer,
        transfer_tokens=transfer_tokens,
    )


def _as_pair(
    mode: DisaggMode, split: _Split, request: RequestView, replicas: ReplicaSet
) -> PairDecision:
    if split.stopped is not None:
        return PairDecision(mode, split.stopped, request)
    assert split.prefill is not None and split.decode is not None
    assert split.decode_request is not None
    assert split.prefill.replica_id is not None and split.decode.replica_id is not None
    return PairDecision(
        mode,
        split.decode,
        split.decode_request,
        prefill=split.prefill,
        prefill_request=split.prefill_request,
        split_cost_s=split.cost_s,
        transfer_s=split.transfer_s,
        transfer_tokens=split.transfer_tokens,
        prefill_queue=replicas.get(split.prefill.replica_id).num_waiting,
        decode_queue=replicas.get(split.decode.replica_id).num_waiting,
    )


def _equal_cost(policy: Policy) -> EqualCostScorer:
    """The policy's equal-cost scorer (its parameters price both options), else a default
    one: a policy that routes by other scores still compares costs in seconds."""
    for _, scorer, _ in policy.scorers:
        if isinstance(scorer, EqualCostScorer):
            return scorer
    return EqualCostScorer()


def _cost_s(
    scorer: EqualCostScorer,
    policy: Policy,
    request: RequestView,
    replicas: ReplicaSet,
    now: float,
    decision: Decision,
) -> float:
    """Equal-cost's ``cost_r`` of ``request`` on the replica ``decision`` chose."""
    assert decision.replica_id is not None
    slot = np.array([replicas.get(decision.replica_id).slot], dtype=np.int64)
    ctx = Context(request, replicas, now, policy.rng, slot, decision.route_class)
    return float(scorer.cost_s(ctx)[0])
