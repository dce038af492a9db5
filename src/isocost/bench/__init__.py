"""``isocost bench``: the load generator against any OpenAI-compatible endpoint.

Talks HTTP only, so it measures an engine, the gateway, vLLM or another router alike. Use
``run_bench`` from Python (the demo and drills do); the CLI wraps it with a live view.
"""

from isocost.bench._client import MAX_BODY_BYTES, error_snippet
from isocost.bench._main import bench_command, compare_command, run_with_live_view
from isocost.bench._records import BenchRecord, BenchSummary, meets_slo, summarize_bench
from isocost.bench._report import (
    compare_table,
    live_table,
    load_summary,
    plot_comparison,
    summary_table,
)
from isocost.bench._runner import (
    BenchOptions,
    BenchProgress,
    BenchResult,
    EndpointError,
    normalize_url,
    run_bench,
)
from isocost.bench._workloads import WorkloadSpec, build_workload
from isocost.openai.http import read_capped
from isocost.workload import TRACE_FORMATS

__all__ = [
    "MAX_BODY_BYTES",
    "TRACE_FORMATS",
    "BenchOptions",
    "BenchProgress",
    "BenchRecord",
    "BenchResult",
    "BenchSummary",
    "EndpointError",
    "WorkloadSpec",
    "bench_command",
    "build_workload",
    "compare_command",
    "compare_table",
    "error_snippet",
    "live_table",
    "load_summary",
    "meets_slo",
    "normalize_url",
    "plot_comparison",
    "read_capped",
    "run_bench",
    "run_with_live_view",
    "summarize_bench",
    "summary_table",
]
