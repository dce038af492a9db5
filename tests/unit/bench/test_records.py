"""Summaries of hand-made request timelines: latencies from due times, goodput, errors."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isocost.bench import BenchRecord, BenchSummary, summarize_bench


def _record(
    request_id: int,
    intended_s: float,
    chunks: list[float],
    *,
    sent_s: float | None = None,
    error_kind: str | None = None,
) -> BenchRecord:
    return BenchRecord(
        request_id=request_id,
        prompt_tokens=10,
        max_tokens=len(chunks) or 1,
        intended_s=intended_s,
        sent_s=intended_s if sent_s is None else sent_s,
        first_token_s=chunks[0] if chunks else None,
        chunk_times_s=chunks,
        end_s=None if error_kind else chunks[-1],
        output_tokens=len(chunks),
        error_kind=error_kind,
    )


def test_latencies_count_from_the_due_time_not_the_send() -> None:
    late = _record(0, 1.0, [1.5, 1.6, 1.7], sent_s=1.4)
    assert late.ttft_s == pytest.approx(0.5)
    assert late.e2e_s == pytest.approx(0.7)
    assert late.tpot_s == pytest.approx(0.1)
    assert late.itl_s == pytest.approx([0.1, 0.1])
    summary = summarize_bench([late], label="x", url="u", model="m")
    assert summary.send_lag_max_s == pytest.approx(0.4)


def test_goodput_counts_requests_within_both_slos_over_the_run() -> None:
    records = [
        _record(0, 0.0, [0.1, 0.2, 0.3]),  # TTFT 100 ms, TPOT 100 ms: good
        _record(1, 1.0, [1.5, 1.6]),  # TTFT 500 ms: misses the TTFT SLO
        _record(2, 2.0, [2.1, 2.5, 2.9, 3.3]),  # TPOT 400 ms: misses the TPOT SLO
        _record(3, 3.0, [3.05, 3.1, 4.0]),  # TPOT 475 ms: misses
        _record(4, 3.5, [], error_kind="http_503"),
        _record(5, 3.6, [], error_kind="http_503"),
        _record(6, 3.7, [3.8], error_kind="truncated"),
    ]
    summary = summarize_bench(
        records, label="x", url="u", model="m", slo_ttft_ms=200, slo_tpot_ms=200
    )
    assert (summary.requests, summary.completed, summary.errors) == (7, 4, 3)
    assert summary.errors_by_kind == {"http_503": 2, "truncated": 1}
    assert summary.duration_s == pytest.approx(4.0)
    assert summary.goodput_rps == pytest.approx(1 / 4.0)
    assert summary.throughput_rps == pytest.approx(4 / 4.0)
    assert summary.output_tokens_per_s == pytest.approx((3 + 2 + 4 + 3) / 4.0)
    assert summary.ttft_samples_s == pytest.approx([0.05, 0.1, 0.1, 0.5])
    assert summary.ttft_p50_s == pytest.approx(0.1)
    no_slo = summarize_bench(records, label="x", url="u", model="m")
    assert no_slo.goodput_rps == no_slo.throughput_rps


def test_an_empty_run_has_no_percentiles() -> None:
    summary = summarize_bench([], label="x", url="u", model="m")
    assert summary.ttft_p99_s is None and summary.goodput_rps == 0.0


timelines = st.lists(
    st.tuples(
        st.floats(0, 100),  # due
        st.floats(0, 1),  # send lag
        st.lists(st.floats(0.001, 5), max_size=6),  # gaps to each chunk
        st.sampled_from([None, None, "http_500", "truncated"]),
    ),
    max_size=30,
)


@settings(max_examples=100, deadline=None)
@given(timelines=timelines, slo_ttft_ms=st.none() | st.floats(1, 5000))
def test_summary_invariants(
    timelines: list[tuple[float, float, list[float], str | None]], slo_ttft_ms: float | None
) -> None:
    records = []
    for i, (due, lag, gaps, kind) in enumerate(timelines):
        chunks = list(itertools.accumulate(gaps, initial=due + lag))[1:]
        kind = kind or (None if chunks else "empty")  # as the client records it
        record = _record(i, due, chunks, sent_s=due + lag, error_kind=kind)
        records.append(record)
    summary = summarize_bench(records, label="x", url="u", model="m", slo_ttft_ms=slo_ttft_ms)
    assert summary.completed + summary.errors == summary.requests == len(records)
    assert 0 <= summary.goodput_rps <= summary.throughput_rps
    for name in ("ttft", "tpot", "itl", "e2e"):
        p50, p90, p99 = (getattr(summary, f"{name}_p{q}_s") for q in (50, 90, 99))
        assert (p50 is None) == (p99 is None)
        if p50 is not None:
            assert 0 <= p50 <= p90 <= p99
    assert summary.ttft_samples_s == sorted(summary.ttft_samples_s)


def test_a_per_1k_ttft_target_gives_long_prompts_more_time_as_in_the_simulator() -> None:
    short = _record(0, 0.0, [0.3, 0.4])  # TTFT 300 ms, 10 prompt tokens
    long = msgspec.structs.replace(_record(1, 1.0, [1.3, 1.4]), prompt_tokens=4000)
    flat = summarize_bench([short, long], label="x", url="u", model="m", slo_ttft_ms=200)
    scaled = summarize_bench(
        [short, long], label="x", url="u", model="m", slo_ttft_ms=200, slo_ttft_per_1k_ms=50
    )
    assert flat.goodput_rps == 0.0
    assert scaled.goodput_rps == pytest.approx(1 / scaled.duration_s)  # only the long one
    assert scaled.slo_ttft_per_1k_ms == 50


def test_the_summary_file_is_unchanged_without_a_per_1k_target() -> None:
    records = [_record(0, 0.0, [0.1, 0.2])]
    plain = msgspec.json.decode(
        msgspec.json.encode(summarize_bench(records, label="x", url="u", model="m"))
    )
    assert "slo_ttft_per_1k_ms" not in plain
    assert (
        msgspec.json.decode(msgspec.json.encode(plain), type=BenchSummary).slo_ttft_per_1k_ms == 0
    )
    scaled = summarize_bench(records, label="x", url="u", model="m", slo_ttft_per_1k_ms=5)
    assert msgspec.json.decode(msgspec.json.encode(scaled))["slo_ttft_per_1k_ms"] == 5
