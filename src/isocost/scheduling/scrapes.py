"""Scrape merging: what the engines report beyond this caller's own traffic.

Per replica the shadow state keeps what this caller sent and has seen streamed, plus the
latest engine scrape (``EngineMetrics``) which reveals traffic from other gateways: the
engine's counts above the local ones at scrape time are "foreign" load, weighted by
freshness ``exp(-age / staleness_tau_s)`` so that a stale scrape fades out. Foreign
requests are assumed to be of the mean size seen here (``mean_prompt_tokens``,
``mean_output_tokens``: EWMAs of this caller's prompts and completions). A scrape whose
cumulative prefix-cache counters go backwards says the engine restarted with an empty
cache: ``merge`` returns those slots so that their prefix entries can be forgotten.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, overload

import numpy as np

from isocost.scheduling.predict import IndexArray, SlotKey
from isocost.scheduling.slots import SlotArrays
from isocost.scheduling.timing import FloatArray

__all__ = ["NUMPY_OPS", "PYTHON_OPS", "Ops", "ScrapeMerge"]

# (maximum, minimum, any) for formulas written once for one slot and for many
Ops = tuple[Callable[[Any, Any], Any], Callable[[Any, Any], Any], Callable[[Any], Any]]
PYTHON_OPS: Ops = (max, min, bool)
NUMPY_OPS: Ops = (np.maximum, np.minimum, np.any)


class ScrapeMerge(SlotArrays):
    """The latest scrape of every replica, merged into foreign load (module docstring).

    ``staleness_tau_s`` (> 0): how fast a scrape's foreign load fades;
    ``prior_prompt_tokens``, ``prior_output_tokens``: the mean prompt and output assumed
    for foreign requests until this caller has seen some.
    """

    FRESH: ClassVar[Mapping[str, float]] = {
        "foreign_waiting": 0.0,
        "foreign_running": 0.0,
        "kv_usage": 0.0,
        "prefix_queries": -np.inf,
        "prefix_hits": -np.inf,
        "taken_s": -np.inf,
    }

    foreign_waiting: FloatArray
    foreign_running: FloatArray
    kv_usage: FloatArray
    prefix_queries: FloatArray  # the latest scrape's cumulative counters, -inf before
    prefix_hits: FloatArray
    taken_s: FloatArray  # when the latest scrape was taken, -inf before the first

    def __init__(
        self, staleness_tau_s: float, *, prior_prompt_tokens: float, prior_output_tokens: float
    ) -> None:
        if staleness_tau_s <= 0:
            raise ValueError("staleness_tau_s must be > 0")
        super().__init__()
        self.staleness_tau_s = staleness_tau_s
        self.mean_prompt_tokens = prior_prompt_tokens
        self.mean_output_tokens = prior_output_tokens

    def observe_prompt(self, prompt_tokens: int) -> None:
        """This caller dispatched a prompt of ``prompt_tokens``."""
        self.mean_prompt_tokens += 0.05 * (prompt_tokens - self.mean_prompt_tokens)

    def observe_output(self, output_tokens: int) -> None:
        """A request of this caller completed with ``output_tokens``."""
        self.mean_output_tokens += 0.05 * (output_tokens - self.mean_output_tokens)

    @overload
    def freshness(self, now: float, key: int) -> float: ...

    @overload
    def freshness(self, now: float, key: SlotKey) -> FloatArray: ...

    def freshness(self, now: float, key: SlotKey | int) -> FloatArray | float:
        """Weight of each slot's latest scrape: ``exp(-age / staleness_tau_s)``, 0 if none.
        One slot's without arrays (it is asked for every streamed chunk), through numpy's
        ``exp`` still: libm's differs from it in the last bit for some ages, and one
        replica's prediction must be the vector one's to the bit."""
        if isinstance(key, int):
            one_age = max(now - float(self.taken_s[key]), 0.0)
            return float(np.exp(-one_age / self.staleness_tau_s))
        age = np.maximum(now - self.taken_s[key], 0.0)
        return np.asarray(np.exp(-age / self.staleness_tau_s), dtype=np.float64)

    def merge(
        self,
        key: IndexArray | int,
        local: tuple[Any, Any],
        load: tuple[Any, Any, Any],
        counters: tuple[Any, Any],
        now: float,
        ops: Ops,
    ) -> list[int]:
        """A scrape of one slot (Python numbers, ``PYTHON_OPS``) or of the slots ``key``
        (aligned arrays, ``NUMPY_OPS``): one formula for both, as in ``ReplicaSet``'s
        effective load. ``local`` is this caller's (waiting, running) there, ``load`` the
        engine's (running, waiting, KV usage); ``counters`` the cumulative prefix-cache
        (queries, hits): when they go back the engine restarted with an empty cache, and
        the slots returned are those whose prefix entries must be forgotten."""
        maximum, minimum, any_true = ops
        running, waiting, kv_usage = load
        queries, hits = counters
        restarted = (queries < self.prefix_queries[key]) | (hits < self.prefix_hits[key])
        forget: list[int] = np.extract(restarted, key).tolist() if any_true(restarted) else []
        local_waiting, local_running = local
        local_total = local_waiting + local_running
        foreign_waiting = maximum(waiting - local_waiting, 0.0)
        self.foreign_waiting[key] = foreign_waiting
        self.foreign_running[key] = maximum(running + waiting - local_total - foreign_waiting, 0.0)
        self.kv_usage[key] = minimum(maximum(kv_usage, 0.0), 1.0)
        self.prefix_queries[key] = queries
        self.prefix_hits[key] = hits
        self.taken_s[key] = now
        return forget
