"""The scheduling engine: eligibility -> filters -> weighted scorers -> picker -> admission.

``Policy.schedule(request, replicas, now)`` runs one fixed pipeline over the replica slots
of a ``ReplicaSet``, vectorised (every plugin sees and returns numpy arrays aligned with
the candidate slots ``ctx.idx``, and reads per-replica arrays through ``ctx.key``, a slice
when the candidates are one contiguous run of slots, as they are when every replica is
eligible, so that reading is a view rather than a copy):

1. Eligibility, enforced by the engine for every policy: the replica is in the set, serves
   ``request.model``, belongs to the first route-class tier that has an available replica,
   is healthy and not draining. None serves the model: REJECT ``no_replica``; none
   available: REJECT ``unavailable``; fewer available than ``min_available_fraction`` of
   the model's replicas: REJECT ``shed``. Replicas whose waiting queue is at their
   ``max_queue`` cap are dropped; none left: QUEUE.
2. Filters (plugins) narrow the candidates further; one that empties the set is ignored
   (recorded in the explanation) rather than failing the request.
3. SLO admission (``admission.slo``): candidates whose predicted TTFT misses the request's
   deadline, whose predicted inter-token time exceeds its TPOT target, or where its
   prefill is expected to push more than ``MAX_TPOT_VICTIMS`` of the streams already
   running there past that target (``scheduling.predict``: a stall ruins a short reply,
   not a long one), are dropped. None left: if some candidate would still meet the
   deadline and ``admission.hold`` is on, QUEUE with ``held`` (the dispatcher schedules
   it again at every wake, as streams end and the stall it would cause shrinks, until
   it is admitted or no candidate can meet the deadline any more); otherwise REJECT
   ``deadline`` with ``retry_after_s`` = the least predicted wait among them (the time
   their queued work needs to clear).
4. Scorers (plugins) return one score per candidate; the engine clamps each to [0, 1]
   (NaN counts as 0) and sums them with the profile's weights.
5. The picker (plugin) chooses one candidate from the totals.

The decision carries every scorer's clamped scores (the explanation) and the predicted
TTFT / end-to-end time / output length on the chosen replica, from the same cost model
that equal-cost prices with, whatever the policy. Predictions are computed lazily: every
candidate's only when a plugin or SLO admission reads ``ctx.prediction``, otherwise the
chosen replica's alone, in Python floats (``ReplicaSet.predict_one``); its uncorrected
times ride on the decision (``raw_times``) so that ``ReplicaSet.on_dispatch`` need not
compute them again. Hot-path outcomes are values; nothing here raises on a request.

Plugins are registered by a stable type string (``scheduling.plugins``); what they see and
implement (``Context``, ``Filter``, ``Scorer``, ``Picker``) is in ``scheduling.interface``.
Stateful plugins additionally implement ``on_dispatch`` / ``on_first_token`` /
``on_complete`` (the ``ShadowListener`` protocol of ``scheduling.contract``), which the
policy forwards after ``ReplicaSet`` applied them (``replicas.add_listener(policy)``).

``schedule`` runs these stages in this order, one small method each: ``_eligible`` and
``_under_queue_cap`` (1), ``_filter`` (2) — together ``candidates``, public for callers
that need the candidates without a decision — ``_slo_admission`` (3), ``_score`` (4), the
picker (5), then ``_admit`` builds the ADMIT decision with its predictions and explanation.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from random import Random

import numpy as np

from isocost.scheduling.contract import InFlight, RequestView, Role, ShadowListener
from isocost.scheduling.decision import Decision, Explanation, Outcome, RejectReason
from isocost.scheduling.interface import Context, Filter, Picker, Scorer
from isocost.scheduling.predict import MAX_TPOT_VICTIMS, IndexArray
from isocost.scheduling.routes import RouteClass, RouteTable
from isocost.scheduling.slots import BoolArray
from isocost.scheduling.state import ReplicaSet
from isocost.scheduling.timing import FloatArray

__all__ = ["SLO_CHECKS", "AdmissionSettings", "Policy", "slo_ratios"]

SLO_CHECKS = ("ttft", "tpot", "victims")  # SLO admission's checks, rows of ``slo_ratios``


def slo_ratios(ctx: Context) -> FloatArray:
    """Per check of ``SLO_CHECKS`` (rows) and candidate, what is predicted over its bound
    (above 1 fails; 0 where the check does not apply): the TTFT over the time left before
    the deadline, the inter-token time over the TPOT target, and the running streams the
    prefill is expected to push past that target over ``MAX_TPOT_VICTIMS`` (a request
    joining with its KV ready, ``decode_only``, stalls no one)."""
    request, prediction = ctx.request, ctx.prediction
    ratios = np.zeros((len(SLO_CHECKS), ctx.idx.size))
    if request.deadline_s is not None:
        ratios[0] = prediction.ttft_s / max(request.deadline_s - ctx.now, 1e-12)
    if request.tpot_target_s is not None:
        ratios[1] = prediction.tpot_s / request.tpot_target_s
        if not request.decode_only:
            ratios[2] = ctx.tpot_victims(request.tpot_target_s) / MAX_TPOT_VICTIMS
    return ratios


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """Admission knobs of a policy (see ``scheduling.dispatch`` for the late-binding queue).

    ``slo``: drop candidates predicted to miss the deadline, reject when none is left.
    ``hold`` (with ``slo``): a request refused only for the TPOT checks while some
    candidate would meet its deadline is held and scheduled again as replicas free,
    instead of rejected (module docstring, stage 3). ``min_available_fraction``
    (0..1): shed all traffic for a model while fewer of its replicas than this fraction
    are healthy and not draining. ``retry_after_s`` (> 0):
    the Retry-After for unavailable/shed, and the floor for deadline rejections.
    """

    slo: bool = False
    min_available_fraction: float = 0.0
    retry_after_s: float = 1.0
    hold: bool = True


class Policy:
    """A named pipeline of plugin instances; ``schedule`` is the one entry point."""

    def __init__(
        self,
        name: str,
        *,
        filters: Sequence[Filter] = (),
        scorers: Sequence[tuple[str, Scorer, float]] = (),
        picker: Picker,
        admission: AdmissionSettings | None = None,
        routes: RouteTable | None = None,
        rng: Random | None = None,
    ) -> None:
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker
        self.admission = admission or AdmissionSettings()
        self.routes = routes or RouteTable()
        self.rng = rng or Random(0)
        plugins: list[object] = [*self.filters, *(s for _, s, _ in self.scorers), picker]
        self._stateful = [p for p in plugins if isinstance(p, ShadowListener)]

    # -- hooks (ShadowListener) -------------------------------------------------------

    def on_dispatch(self, record: InFlight, now: float) -> None:
        for plugin in self._stateful:
            plugin.on_dispatch(record, now)

    def on_first_token(self, record: InFlight, now: float) -> None:
        for plugin in self._stateful:
            plugin.on_first_token(record, now)

    def on_complete(self, record: InFlight, now: float, ok: bool) -> None:
        for plugin in self._stateful:
            plugin.on_complete(record, now, ok)

    # -- the pipeline ----------------------------------------------------------------

    def schedule(
        self,
        request: RequestView,
        replicas: ReplicaSet,
        now: float,
        *,
        exclude: Collection[str] = (),
        roles: Collection[Role] | None = None,
    ) -> Decision:
        """Choose a replica for ``request`` at ``now``, or say why not (module docstring).

        ``exclude`` names replicas this request must not use (e.g. those that already
        failed it); they count as unavailable for it, not for the global shed. ``roles``
        (None: any) limits the replicas that serve it to those of these roles, as if no
        other served the model (``scheduling.disagg`` picks prefill and decode legs so).
        """
        notes: dict[str, str] = {}
        ctx = self.candidates(request, replicas, now, exclude=exclude, roles=roles, notes=notes)
        if isinstance(ctx, Decision):
            return ctx
        rejected = self._slo_admission(ctx)
        if rejected is not None:
            return rejected
        scores, weights, total = self._score(ctx)
        chosen = self.picker.pick(ctx, total)
        return self._admit(ctx, chosen, scores, weights, total, notes)

    def candidates(
        self,
        request: RequestView,
        replicas: ReplicaSet,
        now: float,
        *,
        exclude: Collection[str] = (),
        roles: Collection[Role] | None = None,
        rng: Random | None = None,
        notes: dict[str, str] | None = None,
    ) -> Context | Decision:
        """Stages 1 and 2: the decision context of the candidates left after eligibility,
        the queue caps and the filters, or the REJECT / QUEUE decision when none is left.
        ``rng`` is what plugins will draw from (default: the policy's; the simulator's
        admission audit passes its own, so that the run's stream stays as it was)."""
        route = self.routes.classify(request)
        notes = {} if notes is None else notes
        eligible = self._eligible(request, replicas, route, exclude, roles, notes)
        if isinstance(eligible, Decision):
            return eligible
        ctx = Context(request, replicas, now, rng or self.rng, eligible, route.name)
        if not self._under_queue_cap(ctx):
            return Decision(Outcome.QUEUE, self.name, route_class=route.name)
        self._filter(ctx, notes)
        return ctx

    def _eligible(
        self,
        request: RequestView,
        replicas: ReplicaSet,
        route: RouteClass,
        exclude: Collection[str],
        roles: Collection[Role] | None,
        notes: dict[str, str],
    ) -> IndexArray | Decision:
        """Stage 1: the slots serving the model in the first route tier with a usable
        replica (healthy, not draining, not excluded), or the REJECT when there is none
        or too few of the model's replicas are available (the global shed)."""
        slots = replicas.slots
        serving = slots.model_mask(request.model)
        if roles is not None:
            serving = serving & slots.role_mask(roles)
        available = serving & slots.healthy & ~slots.draining
        usable = available
        if exclude:
            usable = available.copy()
            for name in exclude:
                if name in replicas:
                    usable[replicas.get(name).slot] = False
        eligible: BoolArray | None = None
        has_any = False
        for tier_number, tier in enumerate(route.tiers):
            in_tier = serving if not tier else serving & slots.group_mask(tier)
            has_any = has_any or bool(in_tier.any())
            candidates = in_tier & usable
            if candidates.any():
                eligible = candidates
                if tier_number:
                    notes["route_tier"] = str(tier_number)
                break
        if eligible is None:
            reason = RejectReason.UNAVAILABLE if has_any else RejectReason.NO_REPLICA
            return self._reject(reason, route.name, self.admission.retry_after_s)
        num_serving = int(np.count_nonzero(serving))
        num_available = int(np.count_nonzero(available))
        if num_available < self.admission.min_available_fraction * num_serving:
            return self._reject(RejectReason.SHED, route.name, self.admission.retry_after_s)
        return np.flatnonzero(eligible).astype(np.int64)

    @staticmethod
    def _under_queue_cap(ctx: Context) -> bool:
        """Drop the candidates whose waiting queue is at its ``max_queue`` cap; whether
        any is left (none: the request queues)."""
        replicas = ctx.replicas
        ctx.narrow(replicas.waiting(ctx.now, ctx.key) < replicas.slots.max_queue[ctx.key])
        return bool(ctx.idx.size)

    def _filter(self, ctx: Context, notes: dict[str, str]) -> None:
        """Stage 2: the filter plugins, each ignored (and noted) where it would empty the set."""
        for plugin in self.filters:
            keep = np.asarray(plugin.filter(ctx), dtype=bool)
            if keep.any():
                ctx.narrow(keep)
            else:
                notes[plugin.type_name] = "ignored: would remove every replica"

    def _slo_admission(self, ctx: Context) -> Decision | None:
        """Stage 3: keep the candidates predicted to meet the request's deadline and TPOT
        target, or hold the request (QUEUE ``held``) or REJECT ``deadline`` when none
        would (``None``: admitted)."""
        request = ctx.request
        if not self.admission.slo or (request.deadline_s is None and request.tpot_target_s is None):
            return None
        ratios = slo_ratios(ctx)
        meets = np.all(ratios <= 1.0, axis=0)
        if meets.any():
            ctx.narrow(meets)
            return None
        on_time = ratios[0] <= 1.0
        if self.admission.hold and request.deadline_s is not None and on_time.any():
            return Decision(Outcome.QUEUE, self.name, route_class=ctx.route_class, held=True)
        retry = max(float(ctx.prediction.wait_s.min()), self.admission.retry_after_s)
        return self._reject(RejectReason.DEADLINE, ctx.route_class, retry)

    def _score(self, ctx: Context) -> tuple[dict[str, FloatArray], dict[str, float], FloatArray]:
        """Stage 4: every scorer's clamped scores, its weight, and their weighted total."""
        scores: dict[str, FloatArray] = {}
        weights: dict[str, float] = {}
        total = np.zeros(ctx.idx.size)
        for label, scorer, weight in self.scorers:
            raw = np.asarray(scorer.score(ctx), dtype=np.float64)
            clamped = np.fmin(np.fmax(raw, 0.0), 1.0)  # NaN -> 0 (fmax drops NaN)
            scores[label] = clamped
            weights[label] = weight
            total += weight * clamped
        return scores, weights, total

    def _admit(
        self,
        ctx: Context,
        chosen: int,
        scores: dict[str, FloatArray],
        weights: dict[str, float],
        total: FloatArray,
        notes: dict[str, str],
    ) -> Decision:
        """Stage 5, after the picker: the ADMIT decision for candidate ``chosen``, with its
        predicted times (the candidates' when priced already, else its own alone)."""
        request, replicas = ctx.request, ctx.replicas
        slot = int(ctx.idx[chosen])
        cached_tokens = min(
            max(ctx.cached_blocks_at(chosen) * replicas.block_tokens, request.kv_ready_tokens),
            request.prompt_tokens,
        )
        if ctx.priced:  # the policy priced every candidate already
            chosen_times = ctx.prediction.raw_at(chosen)
        else:
            chosen_times = replicas.predict_one(
                slot, ctx.now, request.prompt_tokens, cached_tokens, ctx.expected_output_tokens
            )
        calibration = replicas.calibration
        ttft_s, e2e_s = chosen_times.corrected(
            float(calibration.ttft_factor[slot]), float(calibration.itl_factor[slot])
        )
        ids = replicas.slots.ids[ctx.key].copy()  # a copy: the set may reuse a slot later
        return Decision(
            Outcome.ADMIT,
            self.name,
            replica_id=str(ids[chosen]),
            route_class=ctx.route_class,
            predicted_ttft_s=ttft_s,
            predicted_e2e_s=e2e_s,
            predicted_output_tokens=ctx.expected_output_tokens,
            cached_tokens=cached_tokens,
            explanation=Explanation(ids, scores, weights, total, notes, ctx.inputs_read()),
            raw_times=chosen_times,
        )

    def _reject(self, reason: RejectReason, route_class: str, retry_after_s: float) -> Decision:
        retry = retry_after_s if math.isfinite(retry_after_s) else self.admission.retry_after_s
        return Decision(
            Outcome.REJECT, self.name, reason=reason, retry_after_s=retry, route_class=route_class
        )
