"""The slot store: which replica holds which dense slot, and per-slot numpy arrays.

Dynamic per-replica quantities live in numpy arrays indexed by a dense *slot* and are
updated incrementally by the hooks, so that a policy can price a thousand replicas with a
few vector operations; ``ReplicaState`` is a per-replica read view over them. Each part of
the shadow state (``scheduling.state``: local load, scrape merging, calibration, prefill
duty) owns its arrays as a ``SlotArrays``; the ``SlotStore`` hands out slots, holds the
arrays of each replica's spec and status, and grows every part's arrays with its own so
that one slot indexes them all. A plugin reads them through ``ctx.key``: a slice when the
candidates are one contiguous run of slots, so that reading is a view rather than a copy.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from isocost.core.errors import UnknownEntryError
from isocost.scheduling.contract import ReplicaSpec, stable_hash64
from isocost.scheduling.timing import CoefficientArrays, FloatArray, StepCoefficients

__all__ = ["BoolArray", "SlotArrays", "SlotStore"]

BoolArray = npt.NDArray[np.bool_]
_StateT = TypeVar("_StateT")
_MIN_SLOTS = 8


def _grown(a: npt.NDArray[Any], size: int) -> npt.NDArray[Any]:
    """``a`` zero-padded to ``size`` (a new array)."""
    out = np.zeros(size, dtype=a.dtype)
    out[: a.size] = a
    return out


class SlotArrays:
    """Per-slot float arrays of one owner, grown together with the store's slots.

    A subclass names its arrays in ``FRESH`` with the value each takes in a freshly
    added slot (declaring them as ``FloatArray`` attributes for the type checker); the
    ``SlotStore`` grows them with its own and resets a slot when a replica takes it.
    """

    FRESH: ClassVar[Mapping[str, float]] = {}

    def __init__(self) -> None:
        for name in self.FRESH:
            setattr(self, name, np.zeros(0))

    def grow(self, size: int) -> None:
        """Make every array ``size`` long (new slots hold zeros until ``reset``)."""
        for name in self.FRESH:
            setattr(self, name, _grown(getattr(self, name), size))

    def reset(self, slot: int) -> None:
        """Give ``slot`` the values of a freshly added replica."""
        for name, value in self.FRESH.items():
            getattr(self, name)[slot] = value


class SlotStore(SlotArrays, Generic[_StateT]):
    """Replicas by id and by slot, with the arrays of their specs and status.

    ``parts``: the ``SlotArrays`` of the shadow state, grown with the store and reset for
    each replica added. The arrays here are set from the spec when a replica is added
    (``weight``, ``usd_per_hour``, ``num_gpus``, ``kv_capacity_tokens``, ``max_queue``,
    ``max_num_seqs``, the fitted timing ``coef``, the id's hash ``salt``, the ``ids``
    themselves) or by status changes (``active``: the slot holds a replica; ``healthy``,
    ``draining``).
    """

    FRESH: ClassVar[Mapping[str, float]] = dict.fromkeys(
        (
            "weight",
            "usd_per_hour",
            "num_gpus",
            "kv_capacity_tokens",
            "max_queue",
            "max_num_seqs",
        ),
        0.0,
    )
    _FLAGS = ("active", "healthy", "draining")

    def __init__(self, parts: Sequence[SlotArrays]) -> None:
        super().__init__()
        self._parts = tuple(parts)
        self._attached: weakref.WeakSet[SlotArrays] = weakref.WeakSet()
        self._capacity = 0
        self._states: list[_StateT | None] = []
        self._by_id: dict[str, _StateT] = {}
        self._free_slots: list[int] = []
        self._model_masks: dict[str, BoolArray] = {}
        self._group_masks: dict[str, BoolArray] = {}
        self._role_masks: dict[str, BoolArray] = {}
        self.salt = np.zeros(0, dtype=np.uint64)
        self.coef = CoefficientArrays.zeros(0)
        self.ids = np.zeros(0, dtype=object)
        for name in self._FLAGS:
            setattr(self, name, np.zeros(0, dtype=bool))
        self.grow(_MIN_SLOTS)

    # The arrays, declared for the type checker (set in grow).
    weight: FloatArray
    usd_per_hour: FloatArray
    num_gpus: FloatArray
    kv_capacity_tokens: FloatArray
    max_queue: FloatArray
    max_num_seqs: FloatArray
    active: BoolArray
    healthy: BoolArray
    draining: BoolArray

    def add(
        self, spec: ReplicaSpec, coefficients: StepCoefficients, view: Callable[[int], _StateT]
    ) -> _StateT:
        """Give ``spec`` (a new id) the lowest free slot, healthy and not draining, with
        ``view(slot)`` as its state; every part's arrays are reset for the slot."""
        if spec.replica_id in self._by_id:
            raise ValueError(f"replica {spec.replica_id!r} already exists")
        if not self._free_slots:
            self.grow(2 * self._capacity)
        slot = min(self._free_slots)
        self._free_slots.remove(slot)
        state = view(slot)
        self._states[slot] = state
        self._by_id[spec.replica_id] = state
        cm = spec.cost_model
        self.coef.set(slot, coefficients)
        self.salt[slot] = np.uint64(stable_hash64(spec.replica_id))
        self.ids[slot] = spec.replica_id
        for part in (self, *self._parts, *self._attached):
            part.reset(slot)
        self.weight[slot] = spec.weight
        self.usd_per_hour[slot] = spec.price_usd_per_hour
        self.num_gpus[slot] = cm.tensor_parallel
        self.kv_capacity_tokens[slot] = cm.kv_capacity_tokens
        self.max_queue[slot] = spec.max_queue
        self.max_num_seqs[slot] = cm.limits.max_num_seqs
        self.active[slot] = True
        self.healthy[slot] = True
        self.draining[slot] = False
        self._mask(self._model_masks, spec.model)[slot] = True
        for group in spec.groups:
            self._mask(self._group_masks, group)[slot] = True
        self._mask(self._role_masks, spec.role)[slot] = True
        return state

    def remove(self, replica_id: str, slot: int) -> None:
        """Free the slot of ``replica_id``."""
        self.active[slot] = self.healthy[slot] = self.draining[slot] = False
        for masks in (self._model_masks, self._group_masks, self._role_masks):
            for mask in masks.values():
                mask[slot] = False
        self.ids[slot] = None
        self._states[slot] = None
        del self._by_id[replica_id]
        self._free_slots.append(slot)

    def get(self, replica_id: str) -> _StateT:
        state = self._by_id.get(replica_id)
        if state is None:
            raise UnknownEntryError("replica", replica_id, self._by_id)
        return state

    def state_at(self, slot: int) -> _StateT:
        state = self._states[slot]
        if state is None:
            raise KeyError(f"slot {slot} is empty")
        return state

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._by_id

    def __iter__(self) -> Iterator[_StateT]:
        return (s for s in self._states if s is not None)

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def capacity(self) -> int:
        """Length of every per-slot array."""
        return self._capacity

    def model_mask(self, model: str) -> BoolArray:
        """Slots serving ``model`` (all False for an unknown model); do not modify."""
        mask = self._model_masks.get(model)
        return mask if mask is not None else np.zeros(self._capacity, dtype=bool)

    def group_mask(self, groups: frozenset[str]) -> BoolArray:
        """Slots in any of ``groups``."""
        return self._union(self._group_masks, groups)

    def role_mask(self, roles: Collection[str]) -> BoolArray:
        """Slots whose replica has one of ``roles`` (``contract.Role``)."""
        return self._union(self._role_masks, roles)

    def _union(self, masks: dict[str, BoolArray], keys: Collection[str]) -> BoolArray:
        out = np.zeros(self._capacity, dtype=bool)
        for key in keys:
            mask = masks.get(key)
            if mask is not None:
                out |= mask
        return out

    def _mask(self, masks: dict[str, BoolArray], key: str) -> BoolArray:
        mask = masks.get(key)
        if mask is None:
            mask = masks[key] = np.zeros(self._capacity, dtype=bool)
        return mask

    def attach(self, part: SlotArrays) -> None:
        """Grow ``part`` with the store and reset its slot for each replica added, like
        the parts given at construction: a plugin's own per-slot state, which the store
        cannot know when it is built. Held weakly (a replaced policy's plugin goes)."""
        part.grow(self._capacity)
        for slot in range(self._capacity):
            part.reset(slot)
        self._attached.add(part)

    def detach(self, part: SlotArrays) -> None:
        """Stop growing and resetting ``part`` (it follows another store now)."""
        self._attached.discard(part)

    def grow(self, size: int) -> None:
        """Make every array of the store and of its parts ``size`` long, more free slots."""
        old = self._capacity
        size = max(size, _MIN_SLOTS)
        super().grow(size)
        for part in (*self._parts, *self._attached):
            part.grow(size)
        for name in self._FLAGS:
            setattr(self, name, _grown(getattr(self, name), size))
        self.salt = _grown(self.salt, size)
        self.ids = _grown(self.ids, size)
        self.coef = self.coef.grown(size)
        for masks in (self._model_masks, self._group_masks, self._role_masks):
            for key in masks:
                masks[key] = _grown(masks[key], size)
        self._states.extend([None] * (size - old))
        self._free_slots.extend(range(old, size))
        self._capacity = size
