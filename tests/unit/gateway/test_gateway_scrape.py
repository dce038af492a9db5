"""Reading vLLM and SGLang /metrics text into the brain's EngineMetrics."""

from __future__ import annotations

import pytest

from isocost.runtime.scrape import (
    MAX_REQUESTS,
    ScrapeError,
    decode_exposition,
    kv_capacity_tokens,
    parse_engine_metrics,
)

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
    m = parse_engine_metrics(VLLM_V1).metrics
    assert (m.num_running, m.num_waiting, m.kv_usage) == (7, 2, 0.415)
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.num_preemptions) == (1200, 300, 4)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0"} 1.0', 128),
        ('vllm:cache_config_info{engine="0",block_size="16"} 1.0', 16),
        ('vllm:cache_config_info{block_size="0"} 1.0', None),
        ('vllm:cache_config_info{block_size="x"} 1.0', None),
        ('vllm:cache_config_info{engine="0"} 1.0', None),
    ],
)
def test_the_kv_block_size_from_vllms_cache_config(line: str, expected: int | None) -> None:
    assert parse_engine_metrics(f"{VLLM_V1}{line}\n").metrics.kv_block_tokens == expected
    assert parse_engine_metrics(VLLM_V1).metrics.kv_block_tokens is None


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('vllm:cache_config_info{block_size="128",num_gpu_blocks="64",engine="0"} 1.0', 8192),
        ('vllm:cache_config_info{num_gpu_blocks="2000",block_size="16"} 1.0', 32000),
        ('vllm:cache_config_info{num_gpu_blocks="None",block_size="16"} 1.0', None),
        ('vllm:cache_config_info{num_gpu_blocks="0",block_size="16"} 1.0', None),
        ('vllm:cache_config_info{block_size="16"} 1.0', None),
        ('vllm:cache_config_infox{num_gpu_blocks="9",block_size="16"} 1.0', None),
    ],
)
def test_the_kv_capacity_from_vllms_cache_config(line: str, expected: int | None) -> None:
    assert kv_capacity_tokens(f"{VLLM_V1}{line}\n") == expected


def test_vllm_v0_names() -> None:
    m = parse_engine_metrics(VLLM_V0).metrics
    assert (m.num_running, m.num_waiting, m.kv_usage) == (3, 0, 0.25)


def test_sglang_names() -> None:
    m = parse_engine_metrics(SGLANG).metrics
    assert (m.num_running, m.num_waiting, m.kv_usage) == (12, 5, 0.28)


def test_samples_of_one_replica_are_summed_and_fractions_averaged() -> None:
    text = VLLM_V0 + 'vllm:num_requests_running{model_name="lora"} 2\n'
    text += 'vllm:gpu_cache_usage_perc{model_name="lora"} 0.75\n'
    m = parse_engine_metrics(text).metrics
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
    scrape = parse_engine_metrics(
        "vllm:num_requests_waiting 4 1712000000000\nvllm:num_requests_running 1\n"
    )
    m = scrape.metrics
    assert scrape.problems == ()
    assert (m.num_running, m.num_waiting, m.kv_usage) == (1, 4, 0.0)


@pytest.mark.parametrize("bad", ["NaN", "nan", "+Inf", "-Inf", "inf", "1e400", "-1e400"])
def test_a_non_finite_sample_is_ignored_with_its_reason(bad: str) -> None:
    text = VLLM_V0 + f'vllm:num_requests_running{{model_name="lora"}} {bad}\n'
    text += f"vllm:gpu_cache_usage_perc {bad}\nvllm:prefix_cache_hits_total {bad}\n"
    scrape = parse_engine_metrics(text)
    assert (scrape.metrics.num_running, scrape.metrics.kv_usage) == (3, 0.25)
    assert scrape.metrics.prefix_cache_hits == 0
    assert len(scrape.problems) == 3
    assert all("sample ignored" in p for p in scrape.problems)


def test_negative_samples_are_ignored_and_huge_ones_clamped_or_ignored() -> None:
    scrape = parse_engine_metrics(
        "vllm:num_requests_running -2\n"
        "vllm:num_requests_waiting 1e300\n"
        "vllm:kv_cache_usage_perc 7.5\n"
        "vllm:prefix_cache_queries_total 1e30\n"
        "vllm:num_preemptions_total -1\n"
    )
    m = scrape.metrics
    assert (m.num_running, m.num_waiting, m.kv_usage) == (0, MAX_REQUESTS, 1.0)
    assert (m.prefix_cache_queries, m.num_preemptions) == (0, 0)
    assert [p.split(":")[1] for p in scrape.problems] == [
        "num_requests_running",
        "num_requests_waiting",
        "prefix_cache_queries_total",
        "num_preemptions_total",
    ]
    assert "clamped" in scrape.problems[1] and "ignored" in scrape.problems[2]


def test_one_reason_per_metric_however_many_bad_samples() -> None:
    lines = "".join(f'vllm:num_requests_running{{rank="{i}"}} NaN\n' for i in range(1000))
    scrape = parse_engine_metrics(lines + "vllm:num_requests_waiting 1\n")
    assert scrape.problems == ("vllm:num_requests_running: nan sample ignored",)


@pytest.mark.parametrize(
    "text",
    [
        "vllm:num_requests_running NaN\n",
        "vllm:num_requests_waiting -1\nsglang:num_running_reqs inf\n",
    ],
)
def test_no_usable_request_gauge_is_an_error_that_says_why(text: str) -> None:
    with pytest.raises(ScrapeError, match=r"no usable request gauges.*ignored"):
        parse_engine_metrics(text)


def test_decoding_follows_the_charset_and_refuses_what_is_not_text() -> None:
    assert decode_exposition("é 1".encode("latin-1"), "iso-8859-1") == "é 1"
    assert decode_exposition(b"vllm 1", None) == "vllm 1"
    for body, charset in [
        (b"x 1", "x-no-such-charset"),
        (b"x 1", "rot13"),  # a codec, but not a text encoding
        (b"x 1", "base64"),
        ("x 1".encode("utf-16"), "utf-8"),
        (b"\xff\xfe\x00", None),
    ]:
        with pytest.raises(ScrapeError):
            decode_exposition(body, charset)
