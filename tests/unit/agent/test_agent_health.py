"""The agent's success-rate judgement: only a rate bad for a whole window drains."""

from __future__ import annotations

from isocost.agent.health import SuccessWindow


def feed(window: SuccessWindow, samples: list[tuple[float, int, int]]) -> None:
    for now, ok, failed in samples:
        window.observe(now, ok, failed)


def test_one_blip_never_drains() -> None:
    window = SuccessWindow(window_s=10, min_rate=0.5, min_requests=10)
    feed(window, [(0, 0, 0), (1, 0, 20), (2, 100, 20), (3, 200, 20)])
    assert not window.failing(3)
    feed(window, [(12, 300, 20)])
    assert not window.failing(12)


def test_a_rate_bad_for_a_whole_window_drains_and_recovers() -> None:
    window = SuccessWindow(window_s=5, min_rate=0.5, min_requests=10)
    samples = [(float(t), t, 3 * t) for t in range(0, 21, 2)]  # 25% success throughout
    feed(window, samples[:3])
    assert window.rate() == 0.25 and not window.failing(4)
    feed(window, samples[3:])
    assert window.failing(20)
    feed(window, [(22, 200, 60), (24, 400, 60)])
    assert not window.failing(24)


def test_too_few_requests_tell_nothing_and_a_restart_resets() -> None:
    window = SuccessWindow(window_s=5, min_rate=0.5, min_requests=10)
    feed(window, [(0, 0, 0), (1, 0, 5)])
    assert window.rate() is None
    feed(window, [(2, 0, 50), (3, 0, 0)])  # counters went back: a new engine
    assert window.rate() is None and not window.failing(10)


def test_request_outcomes_prefer_http_status_classes_over_finish_reasons() -> None:
    from isocost.agent.engine import request_outcomes

    finished = (
        'vllm:request_success_total{finished_reason="stop",model_name="m"} 90.0\n'
        'vllm:request_success_total{finished_reason="length",model_name="m"} 5.0\n'
        'vllm:request_success_total{finished_reason="abort",model_name="m"} 3.0\n'
    )
    assert request_outcomes(finished) == (95, 3)
    http = (
        'http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 40.0\n'
        'http_requests_total{handler="/v1/chat/completions",method="POST",status="5xx"} 7.0\n'
        'http_requests_total{handler="/v1/completions",method="POST",status="4xx"} 9.0\n'
        'http_requests_total{handler="/metrics",method="GET",status="2xx"} 500.0\n'
    )
    assert request_outcomes(finished + http) == (40, 7)
    assert request_outcomes("# nothing\n") == (0, 0)
