"""What every plugin module provides, and helpers several scorers share."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import numpy as np

from isocost.core.errors import ConfigError
from isocost.scheduling.contract import stable_hash64
from isocost.scheduling.interface import Context
from isocost.scheduling.timing import FloatArray

__all__ = ["NoParams", "PluginKind", "PluginType", "low_is_better", "rendezvous", "session_hash"]

PluginKind = Literal["filter", "scorer", "picker"]


class NoParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A plugin without parameters."""


@dataclass(frozen=True, slots=True)
class PluginType:
    """One registered plugin type: its stable type string, kind, parameters and factory."""

    type_name: str
    kind: PluginKind
    params: type[msgspec.Struct]
    factory: Callable[[Any], object]
    summary: str

    def create(self, parameters: Mapping[str, object], source: str, key: str) -> object:
        """An instance from YAML ``parameters``; unknown or ill-typed keys name ``key``."""
        try:
            params = msgspec.convert(dict(parameters), self.params)
        except msgspec.ValidationError as exc:
            raise ConfigError(source, str(exc), key) from None
        try:
            return self.factory(params)
        except ValueError as exc:
            raise ConfigError(source, str(exc), key) from None


def low_is_better(values: FloatArray) -> FloatArray:
    """Min-max normalisation where the smallest value scores 1 and the largest 0.

    All values equal: every candidate scores 1 (llm-d's queue scorer convention).
    """
    if values.size == 0:
        return values
    low, high = float(values.min()), float(values.max())
    if high <= low:
        return np.ones_like(values)
    return np.asarray((high - values) / (high - low), dtype=np.float64)


_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)  # splitmix64's shifts


def rendezvous(
    salts: np.ndarray[Any, np.dtype[np.uint64]], key_hash: int
) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """Highest-random-weight hash of a key on each replica (splitmix64 of salt XOR key).

    Each replica's weight depends only on its id and the key, so removing a replica moves
    only the keys it held (rendezvous hashing, Thaler & Ravishankar 1996).
    """
    z = salts ^ np.uint64(key_hash & 0xFFFFFFFFFFFFFFFF)
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return np.asarray(z ^ (z >> _S31), dtype=np.uint64)


def session_hash(ctx: Context) -> int:
    """The affinity key's hash: the session key, else the request id."""
    key = ctx.request.session_key
    return stable_hash64(key) if key is not None else ctx.request_hash
