"""What a plugin sees and implements: the decision ``Context`` and the plugin protocols.

A plugin is a filter, a scorer or a picker (``Filter``, ``Scorer``, ``Picker``), registered
by a stable type string (``scheduling.plugins``). ``Policy.schedule`` (``scheduling.framework``)
builds one ``Context`` per decision: every plugin sees and returns numpy arrays aligned with
the candidate slots ``ctx.idx``, and reads per-replica arrays through ``ctx.key`` (a slice
when the candidates are one contiguous run of slots, as they are when every replica is
eligible, so that reading is a view rather than a copy), from the parts of the
``ReplicaSet`` (``ctx.replicas.slots``, ``.local``, ``.scrapes``, ``.calibration``,
``.duty``). Derived arrays (the effective load, the cached prefix, the predictions) are
computed once per decision, on first read. A stateful plugin also implements the three
hooks of ``scheduling.contract.ShadowListener``; its policy forwards them.
"""

from __future__ import annotations

from dataclasses import fields
from random import Random
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np

from isocost.scheduling.contract import RequestView, stable_hash64
from isocost.scheduling.predict import (
    IndexArray,
    Load,
    Prediction,
    SlotKey,
    predict,
    tpot_victims,
)
from isocost.scheduling.slots import BoolArray
from isocost.scheduling.state import ReplicaSet
from isocost.scheduling.timing import FloatArray

__all__ = ["Context", "Filter", "Picker", "Plugin", "Scorer"]


class Context:
    """Everything a plugin may read for one decision; derived arrays are computed once."""

    __slots__ = (
        "_cached",
        "_cached_tokens",
        "_load",
        "_prediction",
        "_request_hash",
        "eligible",
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
        self.eligible = idx  # the candidates before any narrowing (filters, SLO admission)
        self.key = _slot_key(idx)  # the same slots, to read arrays with
        self.route_class = route_class
        self.expected_output_tokens = replicas.estimator.expected_tokens(
            request.model, route_class, request.max_tokens
        )
        self._load: Load | None = None
        self._cached: FloatArray | None = None
        self._cached_tokens: FloatArray | None = None
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
        if self._cached_tokens is not None:
            self._cached_tokens = self._cached_tokens[keep]
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
            blocks = np.zeros(replicas.slots.capacity)
            blocks[slots] = matched
            self._cached = blocks[self.key]
        return self._cached

    @property
    def cached_tokens(self) -> FloatArray:
        """Prompt tokens cached on each candidate (whole blocks, at most the prompt), or
        whose KV arrives with the request (``RequestView.kv_ready_tokens``)."""
        if self._cached_tokens is None:
            request, block_tokens = self.request, self.replicas.block_tokens
            tokens = np.maximum(self.cached_blocks * block_tokens, request.kv_ready_tokens)
            self._cached_tokens = np.minimum(tokens, request.prompt_tokens)
        return self._cached_tokens

    def cached_blocks_at(self, position: int) -> int:
        """``cached_blocks`` of one candidate, without matching against every replica."""
        if self._cached is not None:
            return int(self._cached[position])
        slot = int(self.idx[position])
        return self.replicas.prefix.match_replica(slot, self.request.block_hashes)

    def inputs_read(self) -> dict[str, FloatArray]:
        """Per candidate, the inputs the decision has read so far: cached prompt tokens,
        queued and running requests and the predicted TTFT, each only when a plugin or
        admission read it (reading one here would cost a policy that does not). They
        stay what the policy saw: ``load`` and ``prediction`` are computed for this
        context, never views of the replica state."""
        read: dict[str, FloatArray] = {}
        if self._cached is not None:
            read["cached_tokens"] = self.cached_tokens
        if self._load is not None:
            read["waiting"] = self._load.waiting
            read["running"] = self._load.running
        if self._prediction is not None:
            read["predicted_ttft_ms"] = self._prediction.ttft_s * 1000.0
        return read

    @property
    def priced(self) -> bool:
        """Whether ``prediction`` has been computed for the candidates."""
        return self._prediction is not None

    @property
    def prediction(self) -> Prediction:
        if self._prediction is None:
            calibration, key = self.replicas.calibration, self.key
            self._prediction = predict(
                self.replicas.slots.coef,
                key,
                self.load,
                self.request.prompt_tokens,
                self.cached_tokens,
                self.expected_output_tokens,
                calibration.ttft_factor[key],
                calibration.itl_factor[key],
            )
        return self._prediction

    @property
    def mean_output_tokens(self) -> float:
        """The mean reply of the request's model and route class, whatever its own
        ``max_tokens``: what the streams running beside it are expected to produce."""
        request = self.request
        return float(self.replicas.estimator.expected_tokens(request.model, self.route_class, None))

    def tpot_victims(self, tpot_target_s: float) -> FloatArray:
        """Per candidate, the running streams its prefill is expected to push past
        ``tpot_target_s`` (``scheduling.predict``); their mean output is the model's."""
        prediction = self.prediction
        return tpot_victims(
            self.load.running,
            prediction.prefill_s,
            prediction.others_itl_s,
            tpot_target_s,
            self.mean_output_tokens,
        )

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
