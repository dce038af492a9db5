"""Reading vLLM and SGLang /metrics text into the brain's EngineMetrics."""

from __future__ import annotations

import pytest

from isocost.gateway.scrape import ScrapeError, parse_engine_metrics

VLLM_V1 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 7.0
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.415
vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 1200.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 300.0
vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 4.0
vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="tiny-llama"} 5.0
"""

VLLM_V0 = """\
vllm:num_requests_running{model_name="m"} 3
vllm:num_requests_waiting{model_name="m"} 0
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
"""

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct",tp_rank="0"} 12.0
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct",tp_rank="0"} 5.0
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct",tp_rank="0"} 0.28
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct",tp_rank="0"} 0.0075
"""


def test_vllm_v1_names() -> None:
    m = parse_engine_metrics(VLLM_V1)
    assert (m.num_running, m.num_waiting, m.kv_usage) == (7, 2, 0.415)
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.num_preemptions) == (1200, 300, 4)


def test_vllm_v0_names() -> None:
    m = parse_engine_metrics(VLLM_V0)
    assert (m.num_running, m.num_waiting, m.kv_usage) == (3, 0, 0.25)


def test_sglang_names() -> None:
    m = parse_engine_metrics(SGLANG)
    assert (m.num_running, m.num_waiting, m.kv_usage) == (12, 5, 0.28)


def test_samples_of_one_replica_are_summed_and_fractions_averaged() -> None:
    text = VLLM_V0 + 'vllm:num_requests_running{model_name="lora"} 2\n'
    text += 'vllm:gpu_cache_usage_perc{model_name="lora"} 0.75\n'
    m = parse_engine_metrics(text)
    assert m.num_running == 5 and m.kv_usage == pytest.approx(0.5)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "# only comments\n",
        "process_cpu_seconds_total 3.0\n",
        "vllm:num_requests_running nan-ish\n",
    ],
)
def test_text_without_engine_gauges_is_an_error(text: str) -> None:
    with pytest.raises(ScrapeError):
        parse_engine_metrics(text)


def test_timestamps_and_unlabelled_samples() -> None:
    m = parse_engine_metrics(
        "vllm:num_requests_waiting 4 1712000000000\nvllm:num_requests_running 1\n"
    )
    assert (m.num_running, m.num_waiting, m.kv_usage) == (1, 4, 0.0)
