"""What a workload must be before a run starts: small enough to make, timed when replayed."""

from __future__ import annotations

from typing import Any

import pytest

from isocost.core.errors import ConfigError
from isocost.workload import (
    MAX_SYNTHETIC_REQUESTS,
    Segment,
    SyntheticSpec,
    WorkloadRequest,
    check_timed,
)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        (
            {"name": "shared-prefix", "num_groups": 100_000_000},
            "--groups x --prompts-per-group: 1,600,000,000 requests, beyond the limit of 1,000,000",
        ),
        (
            {"name": "multi-turn", "sessions": MAX_SYNTHETIC_REQUESTS, "turns": 2},
            "--sessions x --turns: 2,000,000 requests, beyond the limit of 1,000,000",
        ),
    ],
)
def test_a_synthetic_workload_too_large_to_make_is_refused(
    shape: dict[str, Any], message: str
) -> None:
    """Every request of these is made before the first is sent (or simulated)."""
    with pytest.raises(ValueError, match=message):
        SyntheticSpec(**shape)


def test_only_the_named_workload_is_sized() -> None:
    SyntheticSpec("mix", num_groups=100_000_000)  # groups shape shared-prefix only
    SyntheticSpec("shared-prefix", num_groups=MAX_SYNTHETIC_REQUESTS // 16)


def _at(*times_s: float) -> list[WorkloadRequest]:
    return [WorkloadRequest(i, t, 8, 4, (Segment(i, 8),)) for i, t in enumerate(times_s)]


def test_a_trace_without_arrival_times_needs_a_rate() -> None:
    with pytest.raises(ConfigError, match=r"^l\.csv: the trace has no arrival times; pass --rate$"):
        check_timed(_at(0.0, 0.0, 0.0), "l.csv")
    check_timed(_at(0.0, 0.5), "t.jsonl")
    check_timed(_at(3.0), "one.jsonl")  # one request has no pace to keep
