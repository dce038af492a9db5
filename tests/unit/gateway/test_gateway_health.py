"""The circuit breaker's transitions, driven by a fake clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isocost.gateway.health import Breaker, BreakerState, StatusFault, status_fault


def breaker(**overrides: float) -> Breaker:
    params = {"failure_threshold": 3, "min_success_rate": 0.5, "window_size": 10, "open_s": 1.0}
    params.update(overrides)
    return Breaker(
        failure_threshold=int(params["failure_threshold"]),
        min_success_rate=params["min_success_rate"],
        window_size=int(params["window_size"]),
        open_s=params["open_s"],
    )


def test_one_slow_answer_among_successes_does_not_open() -> None:
    b = breaker()
    for t in range(20):
        b.record_success(float(t))
        if t == 10:
            b.record_failure(float(t), "timeout")
    assert b.state(20.0) is BreakerState.CLOSED


def test_consecutive_failures_open_then_half_open_then_probe_closes() -> None:
    b = breaker()
    b.record_failure(0.0, "status 500")
    b.record_failure(0.1, "status 500")
    assert b.allows_traffic(0.1)
    b.record_failure(0.2, "status 500")
    assert b.state(0.2) is BreakerState.OPEN and not b.allows_traffic(0.2)
    assert b.state(1.19) is BreakerState.OPEN
    assert b.state(1.2) is BreakerState.HALF_OPEN and not b.allows_traffic(1.2)
    b.record_success(1.3)  # a live answer is not a probe
    assert b.state(1.3) is BreakerState.HALF_OPEN
    b.record_success(1.3, probe_started_at=1.1)  # sent before it was half-open
    assert b.state(1.3) is BreakerState.HALF_OPEN
    b.record_success(1.3, probe_started_at=1.25)
    assert b.state(1.3) is BreakerState.CLOSED and b.success_rate() == 1.0


def test_hard_failure_opens_at_once_and_failed_probes_back_off() -> None:
    b = breaker()
    b.record_failure(0.0, "connect: refused", hard=True)
    assert b.state(0.0) is BreakerState.OPEN and b.last_error == "connect: refused"
    b.record_failure(1.0, "/health refused")  # half-open probe fails: cool-down doubles
    assert b.state(2.9) is BreakerState.OPEN
    assert b.state(3.0) is BreakerState.HALF_OPEN


def test_passing_probes_do_not_hide_failing_requests() -> None:
    b = breaker()
    for t in range(3):
        b.record_failure(float(t), "status 500")
        b.record_success(t + 0.5, probe_started_at=t + 0.4)
    assert b.state(2.5) is BreakerState.OPEN and b.needs_live_probe


def test_low_success_rate_over_a_full_window_opens() -> None:
    b = breaker(failure_threshold=100, window_size=4)
    b.record_success(0.0)
    b.record_failure(1.0, "x")
    b.record_success(2.0)
    b.record_failure(3.0, "x")
    assert b.state(3.0) is BreakerState.CLOSED  # 2 of 4: not below 50%
    b.record_failure(4.0, "x")  # the window is now F S F F: 25%
    assert b.state(4.0) is BreakerState.OPEN


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["ok", "probe", "fail", "hard"]),
            st.floats(min_value=0.0, max_value=5.0),
        ),
        max_size=60,
    )
)
def test_invariants(events: list[tuple[str, float]]) -> None:
    """Open means no traffic; a hard failure in the closed state always opens."""
    b = breaker()
    now = 0.0
    for kind, step in events:
        now += step
        was_closed = b.state(now) is BreakerState.CLOSED
        if kind == "ok":
            b.record_success(now)
        elif kind == "probe":
            b.record_success(now, probe_started_at=now)
        else:
            b.record_failure(now, kind, hard=kind == "hard")
            if kind == "hard" and was_closed:
                assert b.state(now) is BreakerState.OPEN
        assert b.allows_traffic(now) == (b.state(now) is BreakerState.CLOSED)
        assert 0.0 <= b.success_rate() <= 1.0


@pytest.mark.parametrize(
    ("status", "fault"),
    [
        (200, None),
        (400, None),  # the client's error
        (508, None),  # a loop found down the line: relayed
        (500, StatusFault()),
        (502, StatusFault()),
        (503, StatusFault(busy=True)),
        (429, StatusFault(soft=True)),
        (401, StatusFault()),
        (404, StatusFault()),
    ],
)
def test_status_fault_is_the_replicas_or_not(status: int, fault: StatusFault | None) -> None:
    assert status_fault(status) == fault
