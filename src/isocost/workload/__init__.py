"""Pure: arrival processes x length distributions x trace loaders.

Shared by the cluster simulator and the load generator. Parsers take text lines and a
source name for errors; nothing here opens a file, reads a clock or uses the global RNG.
"""

from isocost.workload._arrivals import (
    check_timed,
    gamma_arrivals,
    mean_rate_rps,
    poisson_arrivals,
    scale_to_rate,
    speedup,
    with_arrivals,
)
from isocost.workload._render import TextRenderer
from isocost.workload._request import (
    TRACE_BLOCK_TOKENS,
    Segment,
    WorkloadRequest,
    prefix_block_hashes,
    prefix_block_keys,
    segments_for_blocks,
)
from isocost.workload._synthetic import (
    MAX_SYNTHETIC_REQUESTS,
    SCENARIO_MIX,
    SYNTHETIC_WORKLOADS,
    ScenarioClass,
    SyntheticName,
    SyntheticSpec,
    multi_turn,
    scenario_mix,
    shared_prefix,
    synthetic_workload,
)
from isocost.workload._traces import (
    TRACE_FORMATS,
    TraceFormat,
    detect_trace_format,
    parse_trace,
)

__all__ = [
    "MAX_SYNTHETIC_REQUESTS",
    "SCENARIO_MIX",
    "SYNTHETIC_WORKLOADS",
    "TRACE_BLOCK_TOKENS",
    "TRACE_FORMATS",
    "ScenarioClass",
    "Segment",
    "SyntheticName",
    "SyntheticSpec",
    "TextRenderer",
    "TraceFormat",
    "WorkloadRequest",
    "check_timed",
    "detect_trace_format",
    "gamma_arrivals",
    "mean_rate_rps",
    "multi_turn",
    "parse_trace",
    "poisson_arrivals",
    "prefix_block_hashes",
    "prefix_block_keys",
    "scale_to_rate",
    "scenario_mix",
    "segments_for_blocks",
    "shared_prefix",
    "speedup",
    "synthetic_workload",
    "with_arrivals",
]
