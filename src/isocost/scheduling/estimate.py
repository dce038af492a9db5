"""Online output-length estimator per (model, route class).

Decode cost is the output length times the step time, and a request's output length is
unknown until it finishes. ``max_tokens`` is only an upper bound (often absent or huge), so
the estimate is an exponentially weighted mean of the lengths observed for the same model
and route class, started from ``prior_tokens`` and capped by the request's ``max_tokens``.
The weight ``alpha`` (0 < alpha <= 1) trades reactivity for noise; the first
``1 / alpha`` observations are averaged plainly so a bad prior washes out quickly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["OutputLengthEstimator"]


@dataclass(slots=True)
class _Mean:
    value: float
    count: int = 0


@dataclass(slots=True)
class OutputLengthEstimator:
    """Expected output tokens per ``(model, route_class)``; mutable, updated on completions."""

    prior_tokens: float = 256.0
    alpha: float = 0.05
    _means: dict[tuple[str, str], _Mean] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        if self.prior_tokens < 1:
            raise ValueError("prior_tokens must be >= 1")

    def expected_tokens(self, model: str, route_class: str, max_tokens: int | None) -> int:
        """Predicted output tokens, at least 1 and at most ``max_tokens`` when given."""
        mean = self._means.get((model, route_class))
        estimate = max(round(mean.value if mean else self.prior_tokens), 1)
        if max_tokens is not None and max_tokens > 0:
            return min(estimate, max_tokens)
        return estimate

    def observe(self, model: str, route_class: str, output_tokens: int) -> None:
        """Fold in one finished request's output length."""
        key = (model, route_class)
        mean = self._means.get(key)
        if mean is None:
            mean = self._means[key] = _Mean(self.prior_tokens)
        mean.count += 1
        weight = max(self.alpha, 1.0 / mean.count)
        mean.value += weight * (output_tokens - mean.value)
