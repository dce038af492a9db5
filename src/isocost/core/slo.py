"""The one SLO definition: what "goodput" and "capacity at SLO" mean in every tool.

``isocost sim``, ``bench`` and ``demo`` (and anything that reports goodput) judge a request
by the same targets, so their figures mean the same thing:

* TTFT target = ``ttft_s + ttft_per_1k_s * prompt_tokens / 1000``: long prompts get
  proportionally more time (DESIGN §4); ``ttft_per_1k_s = 0`` is a flat target.
* TPOT target = ``tpot_s`` (mean time per output token after the first; a one-token reply
  has TPOT 0 and always meets it).
* A request meets the SLO when it completed within both targets. An infinite target is no
  target (``from_ms(None, ...)``: the load generator's "no SLO given").
* An answer seen only whole (not streamed: no first-token time) meets it when it ended
  within both budgets together, ``TTFT target + TPOT target * (output tokens - 1)``: the
  most a client could tell from it.
* Capacity at SLO: the highest offered rate at which at least ``share`` of the requests
  (e.g. 0.9) meet the SLO.

Pure: the checks take numbers, or numpy arrays of them (the simulator judges a whole run at
once), and compare them the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import overload

import numpy as np
import numpy.typing as npt

__all__ = [
    "DEFAULT_SLO_SHARE",
    "DEFAULT_SLO_TPOT_MS",
    "DEFAULT_SLO_TTFT_MS",
    "DEFAULT_SLO_TTFT_PER_1K_MS",
    "SloTargets",
]

DEFAULT_SLO_TTFT_MS = 2000.0
DEFAULT_SLO_TTFT_PER_1K_MS = 0.0
DEFAULT_SLO_TPOT_MS = 100.0
DEFAULT_SLO_SHARE = 0.9

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class SloTargets:
    """Latency targets in seconds and the share for capacity at SLO; see the module
    docstring."""

    ttft_s: float = DEFAULT_SLO_TTFT_MS / 1000
    tpot_s: float = DEFAULT_SLO_TPOT_MS / 1000
    ttft_per_1k_s: float = DEFAULT_SLO_TTFT_PER_1K_MS / 1000
    share: float = DEFAULT_SLO_SHARE

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0 or self.ttft_per_1k_s < 0:
            raise ValueError("SLO targets must be positive (per-1k: >= 0)")
        if not 0 < self.share <= 1:
            raise ValueError("the SLO share must be in (0, 1]")

    @classmethod
    def from_ms(
        cls,
        ttft_ms: float | None,
        tpot_ms: float | None,
        ttft_per_1k_ms: float = DEFAULT_SLO_TTFT_PER_1K_MS,
        share: float = DEFAULT_SLO_SHARE,
    ) -> SloTargets:
        """Targets from milliseconds, as the command-line options give them; None: no
        target (it always holds)."""
        return cls(
            math.inf if ttft_ms is None else ttft_ms / 1000,
            math.inf if tpot_ms is None else tpot_ms / 1000,
            ttft_per_1k_ms / 1000,
            share,
        )

    @overload
    def ttft_target_s(self, prompt_tokens: int) -> float: ...
    @overload
    def ttft_target_s(self, prompt_tokens: FloatArray) -> FloatArray: ...
    def ttft_target_s(self, prompt_tokens: int | FloatArray) -> float | FloatArray:
        """The TTFT target of a prompt of ``prompt_tokens`` tokens."""
        return self.ttft_s + self.ttft_per_1k_s * prompt_tokens / 1000.0

    @overload
    def met(self, prompt_tokens: int, ttft_s: float, tpot_s: float) -> bool: ...
    @overload
    def met(
        self, prompt_tokens: FloatArray, ttft_s: FloatArray, tpot_s: FloatArray
    ) -> BoolArray: ...
    def met(
        self,
        prompt_tokens: int | FloatArray,
        ttft_s: float | FloatArray,
        tpot_s: float | FloatArray,
    ) -> bool | BoolArray:
        """Whether a completed request with these figures meets both targets (a missing
        first token is ``ttft_s = inf``; NaN, a request that did not complete, never
        meets them)."""
        ttft_ok = ttft_s <= self.ttft_target_s(prompt_tokens)
        return ttft_ok & (tpot_s <= self.tpot_s)

    def met_answer(
        self, prompt_tokens: int, output_tokens: int, ttft_s: float | None, e2e_s: float
    ) -> bool:
        """Whether one completed answer met both targets: from its first-token and end
        times when streamed, from its end time alone when not (module docstring)."""
        decode_tokens = max(output_tokens - 1, 0)
        if ttft_s is None:
            budget_s = self.ttft_target_s(prompt_tokens) + self.tpot_s * decode_tokens
            return e2e_s <= budget_s
        tpot_s = (e2e_s - ttft_s) / decode_tokens if decode_tokens else 0.0
        return bool(self.met(prompt_tokens, ttft_s, tpot_s))
