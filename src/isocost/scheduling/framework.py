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
   deadline, or whose predicted inter-token time (the request's own, or that of the
   requests already running there once its prefill joins them) exceeds its TPOT target,
   are dropped; none left: REJECT ``deadline`` with ``retry_after_s`` = the least
   predicted wait among them (the time their queued work needs to clear).
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

Plugins are registered by a stable type string (``scheduling.plugins``); stateful plugins
additionally implement ``on_dispatch`` / ``on_first_token`` / ``on_complete`` (the
``ShadowListener`` protocol), which the policy forwards after ``ReplicaSet`` applied them
(``replicas.add_listener(policy)``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, fields
from random import Random
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt

from isocost.scheduling.decision import Decision, Explanation, Outcome, RejectReason
from isocost.scheduling.predict import IndexArray, Load, Prediction, SlotKey, predict
from isocost.scheduling.routes import RouteTable
from isocost.scheduling.state import InFlight, ReplicaSet, RequestView, stable_hash64
from isocost.scheduling.timing import FloatArray

__all__ = [
    "AdmissionSettings",
    "Context",
    "Filter",
    "Picker",
    "Plugin",
    "Policy",
    "Scorer",
    "StatefulPlugin",
]

BoolArray = npt.NDArray[np.bool_]


class Context:
    """Everything a plugin may read for one decision; derived arrays are computed once."""

    __slots__ = (
        "_cached",
        "_load",
        "_prediction",
        "_request_hash",
        "expected_output_tokens",
        "idx",
        "key",
        "now",
        "replicas",
        "request",
        "rng",
        "route_class",
    )

    def __init__(
        self,
        request: RequestView,
        replicas: ReplicaSet,
        now: float,
        rng: Random,
        idx: IndexArray,
        route_class: str,
    ) -> None:
        self.request = request
        self.replicas = replicas
        self.now = now
        self.rng = rng
        self.idx = idx  # candidate slots, ascending
        self.key = _slot_key(idx)  # the same slots, to read arrays with
        self.route_class = route_class
        self.expected_output_tokens = replicas.estimator.expected_tokens(
            request.model, route_class, request.max_tokens
        )
        self._load: Load | None = None
        self._cached: FloatArray | None = None
        self._prediction: Prediction | None = None
        self._request_hash: int | None = None

    def narrow(self, keep: BoolArray) -> None:
        """Keep only the candidates where ``keep`` is true (derived arrays follow)."""
        if keep.all():
            return
        self.idx = self.idx[keep]
        self.key = _slot_key(self.idx)
        if self._load is not None:
            self._load = _take(self._load, keep)
        if self._cached is not None:
            self._cached = self._cached[keep]
        if self._prediction is not None:
            self._prediction = _take(self._prediction, keep)

    @property
    def load(self) -> Load:
        if self._load is None:
            self._load = self.replicas.load(self.now, self.key)
        return self._load

    @property
    def cached_blocks(self) -> FloatArray:
        """Prompt blocks of the request the prefix index holds on each candidate."""
        if self._cached is None:
            replicas = self.replicas
            slots, matched = replicas.prefix.match(self.request.block_hashes)
            blocks = np.zeros(replicas.capacity)
            blocks[slots] = matched
            self._cached = blocks[self.key]
        return self._cached

    @property
    def cached_tokens(self) -> FloatArray:
        """Prompt tokens cached on each candidate (whole blocks, at most the prompt)."""
        tokens = self.cached_blocks * self.replicas.block_tokens
        return np.asarray(np.minimum(tokens, self.request.prompt_tokens), dtype=np.float64)

    def cached_blocks_at(self, position: int) -> int:
        """``cached_blocks`` of one candidate, without matching against every replica."""
        if self._cached is not None:
            return int(self._cached[position])
        slot = int(self.idx[position])
        return self.replicas.prefix.match_replica(slot, self.request.block_hashes)

    @property
    def priced(self) -> bool:
        """Whether ``prediction`` has been computed for the candidates."""
        return self._prediction is not None

    @property
    def prediction(self) -> Prediction:
        if self._prediction is None:
            r, key = self.replicas, self.key
            self._prediction = predict(
                r.coef,
                key,
                self.load,
                self.request.prompt_tokens,
                self.cached_tokens,
                self.expected_output_tokens,
                r.ttft_factor[key],
                r.itl_factor[key],
            )
        return self._prediction

    @property
    def request_hash(self) -> int:
        """A stable 64-bit hash of the request id (deterministic tie-breaks)."""
        if self._request_hash is None:
            self._request_hash = stable_hash64(self.request.request_id)
        return self._request_hash


class Plugin(Protocol):
    type_name: ClassVar[str]


class Filter(Plugin, Protocol):
    def filter(self, ctx: Context) -> BoolArray:
        """True for the candidates (aligned with ``ctx.idx``) to keep."""
        ...


class Scorer(Plugin, Protocol):
    def score(self, ctx: Context) -> FloatArray:
        """One score per candidate, higher is better; clamped to [0, 1] by the engine."""
        ...


class Picker(Plugin, Protocol):
    def pick(self, ctx: Context, total: FloatArray) -> int:
        """Position (into ``ctx.idx``) of the chosen candidate."""
        ...


@runtime_checkable
class StatefulPlugin(Protocol):
    def on_dispatch(self, record: InFlight, now: float) -> None: ...

    def on_first_token(self, record: InFlight, now: float) -> None: ...

    def on_complete(self, record: InFlight, now: float, ok: bool) -> None: ...


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """Admission knobs of a policy (see ``scheduling.admission`` for the gateway queue).

    ``slo``: drop candidates predicted to miss the deadline, reject when none is left.
    ``min_available_fraction`` (0..1): shed all traffic for a model while fewer of its
    replicas than this fraction are healthy and not draining. ``retry_after_s`` (> 0):
    the Retry-After for unavailable/shed, and the floor for deadline rejections.
    """

    slo: bool = False
    min_available_fraction: float = 0.0
    retry_after_s: float = 1.0


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
        self._stateful = [p for p in plugins if isinstance(p, StatefulPlugin)]

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
    ) -> Decision:
        """Choose a replica for ``request`` at ``now``, or say why not (module docstring).

        ``exclude`` names replicas this request must not use (e.g. those that already
        failed it); they count as unavailable for it, not for the global shed.
        """
        route = self.routes.classify(request)
        serving = replicas.model_mask(request.model)
        available = serving & replicas.healthy & ~replicas.draining
        usable = available
        if exclude:
            usable = available.copy()
            for name in exclude:
                if name in replicas:
                    usable[replicas.get(name).slot] = False
        notes: dict[str, str] = {}
        eligible: BoolArray | None = None
        has_any = False
        for tier_number, tier in enumerate(route.tiers):
            in_tier = serving if not tier else serving & replicas.group_mask(tier)
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

        ctx = Context(
            request, replicas, now, self.rng, np.flatnonzero(eligible).astype(np.int64), route.name
        )
        ctx.narrow(replicas.waiting(now, ctx.key) < replicas.max_queue[ctx.key])
        if ctx.idx.size == 0:
            return Decision(Outcome.QUEUE, self.name, route_class=route.name)
        for plugin in self.filters:
            keep = np.asarray(plugin.filter(ctx), dtype=bool)
            if keep.any():
                ctx.narrow(keep)
            else:
                notes[plugin.type_name] = "ignored: would remove every replica"
        if self.admission.slo and (
            request.deadline_s is not None or request.tpot_target_s is not None
        ):
            prediction = ctx.prediction
            meets = np.ones(ctx.idx.size, dtype=bool)
            if request.deadline_s is not None:
                meets &= prediction.ttft_s <= request.deadline_s - now
            if request.tpot_target_s is not None:
                meets &= prediction.tpot_s <= request.tpot_target_s
                meets &= prediction.others_tpot_s <= request.tpot_target_s
            if not meets.any():
                retry = max(float(prediction.wait_s.min()), self.admission.retry_after_s)
                return self._reject(RejectReason.DEADLINE, route.name, retry)
            ctx.narrow(meets)

        scores: dict[str, FloatArray] = {}
        weights: dict[str, float] = {}
        total = np.zeros(ctx.idx.size)
        for label, scorer, weight in self.scorers:
            raw = np.asarray(scorer.score(ctx), dtype=np.float64)
            clamped = np.fmin(np.fmax(raw, 0.0), 1.0)  # NaN -> 0 (fmax drops NaN)
            scores[label] = clamped
            weights[label] = weight
            total += weight * clamped
        chosen = self.picker.pick(ctx, total)
        slot = int(ctx.idx[chosen])
        cached_tokens = min(
            ctx.cached_blocks_at(chosen) * replicas.block_tokens, request.prompt_tokens
        )
        if ctx.priced:  # the policy priced every candidate already
            chosen_times = ctx.prediction.raw_at(chosen)
        else:
            chosen_times = replicas.predict_one(
                slot, now, request.prompt_tokens, cached_tokens, ctx.expected_output_tokens
            )
        ttft_s, e2e_s = chosen_times.corrected(
            float(replicas.ttft_factor[slot]), float(replicas.itl_factor[slot])
        )
        ids = replicas.ids[ctx.key].copy()  # a copy: the set may reuse a slot later
        return Decision(
            Outcome.ADMIT,
            self.name,
            replica_id=str(ids[chosen]),
            route_class=route.name,
            predicted_ttft_s=ttft_s,
            predicted_e2e_s=e2e_s,
            predicted_output_tokens=ctx.expected_output_tokens,
            cached_tokens=cached_tokens,
            explanation=Explanation(ids, scores, weights, total, notes),
            raw_times=chosen_times,
        )

    def _reject(self, reason: RejectReason, route_class: str, retry_after_s: float) -> Decision:
        retry = retry_after_s if math.isfinite(retry_after_s) else self.admission.retry_after_s
        return Decision(
            Outcome.REJECT, self.name, reason=reason, retry_after_s=retry, route_class=route_class
        )


def _slot_key(idx: IndexArray) -> SlotKey:
    """``idx`` as a slice when it is one contiguous run of slots (the usual case: every
    replica eligible), so that reading arrays gives views instead of gathered copies."""
    if idx.size and int(idx[-1]) - int(idx[0]) + 1 == idx.size:
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


_T = TypeVar("_T", Load, Prediction)


def _take(arrays: _T, keep: BoolArray) -> _T:
    """``arrays`` (a ``Load`` or ``Prediction``) with every array field narrowed to ``keep``."""
    values = (getattr(arrays, f.name) for f in fields(arrays))
    narrowed: list[Any] = [v[keep] if isinstance(v, np.ndarray) else v for v in values]
    return type(arrays)(*narrowed)
