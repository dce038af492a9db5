"""Each replica's prefill terms fitted online to its TTFTs (``calibration.prefill_fit``).

The cost model prices the first token of a request with ``u`` new prompt tokens after
``c`` cached ones, queued behind ``W`` requests of ``Q`` prefill tokens, joining ``b``
sequences that decode there, as (``timing``, ``predict``)::

    ttft = a * (ceil(Q / C) + ceil(u / C)) + beta * (Q + u) + gamma * u * (c + u / 2)
           + r * (W + 1) + s * b

(``a`` per chunk of ``C`` tokens, ``beta`` per token, ``gamma`` per attention pair, ``r``
per request: 0 in the roofline, where requests queued together share a chunk; ``s`` per
running sequence: 0 in the roofline, where the decode tokens ride in the chunk). A
correction factor scales them alike, and that cannot price an engine whose costs have
another shape. CPU vLLM serving the tiny test model: the roofline says 5 ms per chunk
and 7 ns per token; the engine takes ~20 ms per request and ~0.07 ms per token, and a
first token there waits longer the more requests are in flight beside it (two CPU
replicas at 8 concurrent streams, an uncached prompt: median TTFT 37 ms with no other
request in flight there, 73-77 ms with one to three). A factor fitted to that prices a
cached prefix at nothing and five queued or streaming requests as one, so equal-cost
herds them onto one replica and ignores its cache.

Here each replica's ``theta = (a, beta, gamma, r, s)`` is fitted to the TTFTs it is seen to
give, on the terms' counts (``features``):

* a ridge regression: the analytic terms are the prior, its spread ``_SPREAD`` times
  their size (at least ``_FLOOR`` seconds per unit), weighing as much as
  ``_PRIOR_WEIGHT`` observations for ever, so a replica starts as the catalog prices it,
  the data take over within tens of requests, and terms the traffic cannot tell apart (a
  chunk and a request, when every request is one chunk) stay near the prior instead of
  drifting apart on noise;
* relative errors are fitted (each observation divided by its TTFT), as a MAPE is
  judged, so a long queue's second does not drown a cached request's millisecond; an
  observation more than ``_CLIP`` times off the prediction, either way (a stall the terms
  do not explain: a GC pause, a compile), teaches only as much as one ``_CLIP`` times
  off, so stalls cannot drag the fit up;
* forgetting (``_FORGET``, over about ``ERROR_WINDOW`` observations) follows a replica
  that changes;
* bounds keep the prices physical: every term priced at least ``_LOWEST`` of the
  roofline's (a replica cannot beat the roofline by much) and at least 0 (the fit itself
  is left unbounded, so that a bound never skews what it learns next).

Pooled by hardware class, as the factors are (``calibration``): a class fit learns from
every member's observations; a replica joins with the class's figures, and its own fit
weighs ``w = n / (n + PRIOR_SAMPLES)`` (``n`` its observations, fading with
``FRESHNESS_TAU_S``) against the class's, so identical replicas are priced alike from the
first observation and one that stopped getting traffic drifts back to its class.

Pure arithmetic on a few floats per observation; no I/O, so the gateway and the
simulator share it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import numpy.typing as npt

from isocost.scheduling.calibration import ERROR_WINDOW, FRESHNESS_TAU_S, PRIOR_SAMPLES
from isocost.scheduling.timing import StepCoefficients

__all__ = ["PrefillFit", "features"]

Vector = npt.NDArray[np.float64]

# theta per chunk, 1k tokens, 1M pairs, request, running sequence
_UNITS = np.array([1.0, 1e-3, 1e-6, 1.0, 1.0])
_PRIOR_WEIGHT = 5.0  # the prior weighs as much as this many observations, always
_SPREAD = 4.0  # its spread: this many times the analytic term ...
_FLOOR = np.array([0.05, 0.1, 0.1, 0.05, 0.05])  # ... and at least this (s per unit)
_FORGET = 1.0 - 1.0 / ERROR_WINDOW
_CLIP = 2.0  # an observation is taught as at most this many times off the prediction
_LOWEST = 0.1  # bound: each term at least this share of the roofline's
_BROADCAST = 0.02  # a class estimate that moved this much (relative) is given to its members


def features(
    coefficients: StepCoefficients,
    queued_requests: float,
    queued_tokens: float,
    new_tokens: float,
    cached_tokens: float,
    running: float,
) -> Vector:
    """The counts the prefill terms multiply (chunks, 1k tokens, 1M attention pairs,
    requests, running sequences) for a first token behind ``queued_requests`` holding
    ``queued_tokens``, with ``new_tokens`` computed after ``cached_tokens``, beside
    ``running`` sequences decoding."""
    chunk = float(max(coefficients.prefill_chunk_tokens, 1))
    queued, new = max(queued_tokens, 0.0), max(new_tokens, 0.0)
    chunks = math.ceil(queued / chunk) + math.ceil(new / chunk)
    pairs = new * (max(cached_tokens, 0.0) + new / 2.0)
    requests = max(queued_requests, 0.0) + 1.0
    counts = np.array([chunks, queued + new, pairs, requests, max(running, 0.0)])
    return np.asarray(counts * _UNITS, dtype=np.float64)


def _theta(coefficients: StepCoefficients) -> Vector:
    """The analytic terms in the fit's units."""
    terms = (
        coefficients.prefill_per_chunk_s,
        coefficients.prefill_per_token_s,
        coefficients.prefill_per_pair_s,
        coefficients.prefill_per_request_s,
        coefficients.prefill_per_running_s,
    )
    return np.asarray(np.array(terms) / _UNITS, dtype=np.float64)


@dataclasses.dataclass
class _Fit:
    """One exponentially weighted ridge regression, in information form: ``info`` and
    ``vector`` sum the observations (each weighing ``_FORGET`` less with every new one)
    and a prior worth ``_PRIOR_WEIGHT`` observations that never fades; ``theta`` solves
    ``info @ theta = vector``."""

    info: Vector  # 5 x 5
    vector: Vector
    prior_info: Vector
    prior_vector: Vector
    theta: Vector

    @classmethod
    def start(cls, center: Vector, analytic: Vector) -> _Fit:
        """A fit at ``center`` whose prior has the spread of the ``analytic`` terms."""
        scale = np.maximum(_SPREAD * analytic, _FLOOR)
        prior_info = np.diag(_PRIOR_WEIGHT / scale**2)
        prior_vector = prior_info @ center
        return cls(prior_info.copy(), prior_vector.copy(), prior_info, prior_vector, center.copy())

    def learn(self, x: Vector, observed_s: float) -> None:
        predicted = float(x @ self.theta)
        taught = min(max(observed_s, predicted / _CLIP), predicted * _CLIP) or observed_s
        z = x / taught  # relative: the fit minimises relative errors (z @ theta = 1)
        keep = 1.0 - _FORGET
        self.info = _FORGET * self.info + np.outer(z, z) + keep * self.prior_info
        self.vector = _FORGET * self.vector + z + keep * self.prior_vector
        self.theta = np.asarray(np.linalg.solve(self.info, self.vector), dtype=np.float64)


@dataclasses.dataclass
class _Member:
    class_id: int
    analytic: StepCoefficients
    own: _Fit
    lowest: Vector  # the least each term is priced at
    samples: float = 0.0
    seen_s: float = -math.inf


class PrefillFit:
    """The fitted prefill terms of every replica slot (module docstring)."""

    def __init__(self) -> None:
        self._classes: dict[str, int] = {}
        self._class_fits: list[_Fit] = []
        self._given: list[Vector] = []  # per class: the estimate its members were last given
        self._members: dict[int, _Member] = {}  # by slot

    def join(self, slot: int, hardware_class: str, analytic: StepCoefficients) -> None:
        """``slot`` holds a new replica of ``hardware_class`` priced ``analytic``: it
        starts from its class's fit (a new class from the analytic terms)."""
        base = _theta(analytic)
        class_id = self._classes.get(hardware_class)
        if class_id is None:
            class_id = self._classes[hardware_class] = len(self._class_fits)
            self._class_fits.append(_Fit.start(base, base))
            self._given.append(base.copy())
        start = self._class_fits[class_id].theta
        own = _Fit.start(start, base)
        self._members[slot] = _Member(class_id, analytic, own, np.maximum(_LOWEST * base, 0.0))

    def leave(self, slot: int) -> None:
        self._members.pop(slot, None)

    def observe(
        self, slot: int, x: Vector, observed_s: float, now: float
    ) -> list[tuple[int, StepCoefficients]]:
        """A first token came ``observed_s`` after dispatch to ``slot`` with term counts
        ``x`` (``features``): learn, and return the (slot, coefficients) to price with now
        (this slot's; every member's of its class when the class estimate moved)."""
        member = self._members.get(slot)
        if member is None or observed_s <= 0.0 or not math.isfinite(observed_s):
            return []
        member.own.learn(x, observed_s)
        class_fit = self._class_fits[member.class_id]
        class_fit.learn(x, observed_s)
        member.samples = self._evidence(member, now) + 1.0
        member.seen_s = now
        given = self._given[member.class_id]
        moved = np.abs(class_fit.theta - given) > _BROADCAST * np.maximum(given, 1e-12)
        if not moved.any():
            return [(slot, self._priced(member, now))]
        self._given[member.class_id] = class_fit.theta.copy()
        return [
            (s, self._priced(m, now))
            for s, m in self._members.items()
            if m.class_id == member.class_id
        ]

    def coefficients(self, slot: int, now: float) -> StepCoefficients | None:
        """The coefficients ``slot`` is priced with at ``now`` (None: not a member)."""
        member = self._members.get(slot)
        return None if member is None else self._priced(member, now)

    def _evidence(self, member: _Member, now: float) -> float:
        return member.samples * math.exp(-max(now - member.seen_s, 0.0) / FRESHNESS_TAU_S)

    def _priced(self, member: _Member, now: float) -> StepCoefficients:
        evidence = self._evidence(member, now)
        weight = evidence / (evidence + PRIOR_SAMPLES)
        pooled = self._class_fits[member.class_id].theta
        theta = np.maximum(pooled + weight * (member.own.theta - pooled), member.lowest) * _UNITS
        # No floor: the fitted per-chunk term is what a small chunk costs (the roofline's
        # memory-bound floor would put back the shape the fit replaced).
        return dataclasses.replace(
            member.analytic,
            prefill_per_chunk_s=float(theta[0]),
            prefill_per_token_s=float(theta[1]),
            prefill_per_pair_s=float(theta[2]),
            prefill_per_request_s=float(theta[3]),
            prefill_per_running_s=float(theta[4]),
            prefill_floor_s=0.0,
        )
