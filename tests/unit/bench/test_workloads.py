"""From bench's workload choices to requests, and the refusals of impossible choices."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from isocost.bench import BenchOptions, EndpointError, WorkloadSpec, build_workload, normalize_url
from isocost.core.errors import ConfigError
from isocost.workload import SyntheticSpec

TRACES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"


def test_trace_keeps_its_times_compressed_by_speedup() -> None:
    spec = WorkloadSpec(trace=str(TRACES / "azure_code_head.csv"), speedup=2.0)
    plain = list(build_workload(WorkloadSpec(trace=spec.trace), closed_loop=False))
    fast = list(build_workload(spec, closed_loop=False))
    assert [r.arrival_s / 2 for r in plain] == pytest.approx([r.arrival_s for r in fast])


def test_rate_replaces_trace_times_and_lengths_only_traces_need_it() -> None:
    lengths = str(TRACES / "vidur_arxiv_head.csv")
    with pytest.raises(ConfigError, match="no arrival times; pass --rate"):
        build_workload(WorkloadSpec(trace=lengths), closed_loop=False)
    timed = list(build_workload(WorkloadSpec(trace=lengths, rate_rps=50.0), closed_loop=False))
    assert len({r.arrival_s for r in timed}) == len(timed)
    assert len(list(build_workload(WorkloadSpec(trace=lengths), closed_loop=True))) == 120


def test_synthetic_workloads_are_seeded() -> None:
    spec = WorkloadSpec(synthetic=SyntheticSpec("mix"), rate_rps=3.0, seed=4)
    first = list(itertools.islice(build_workload(spec, closed_loop=False), 20))
    again = list(itertools.islice(build_workload(spec, closed_loop=False), 20))
    assert first == again
    multi_turn = SyntheticSpec("multi-turn", sessions=2, turns=3)
    sessions = list(build_workload(WorkloadSpec(synthetic=multi_turn), True))
    assert len(sessions) == 6 and {r.session_id for r in sessions} == {"session-0", "session-1"}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (WorkloadSpec(), "exactly one of --trace and --workload"),
        (WorkloadSpec(trace="t.jsonl", synthetic=SyntheticSpec("mix")), "exactly one of"),
        (WorkloadSpec(synthetic=SyntheticSpec("mix")), "needs --rate or --concurrency"),
        (WorkloadSpec(trace="/no/such/trace.jsonl"), "no such file"),
    ],
)
def test_impossible_choices_are_refused(spec: WorkloadSpec, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_workload(spec, closed_loop=False)


def test_urls_are_normalized_to_the_server_base() -> None:
    assert normalize_url("http://h:8000/v1/") == "http://h:8000"
    with pytest.raises(EndpointError, match="not an http"):
        normalize_url("h:8000")


def test_bench_options_refuse_non_positive_bounds() -> None:
    with pytest.raises(ValueError, match="concurrency must be positive"):
        BenchOptions(concurrency=0)
    with pytest.raises(ValueError, match="duration_s must be positive"):
        BenchOptions(duration_s=-1.0)
