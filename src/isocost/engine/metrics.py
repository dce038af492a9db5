"""Prometheus ``/metrics`` for one replica, in vLLM V1's names, labels and buckets.

Every series carries ``model_name`` (the served name) and ``engine="0"``, like vLLM.
Gauges and counters are read from the engine model at scrape time; the latency histograms
are filled by the replica as requests progress. Latencies are in served (wall-clock)
seconds: modelled seconds times ``--time-scale``, what a client of this replica observes.

Exported: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` and its older name ``vllm:gpu_cache_usage_perc`` (0..1),
``vllm:num_preemptions_total``, ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:prefix_cache_queries_total`` and
``vllm:prefix_cache_hits_total`` (tokens), ``vllm:request_success_total{finished_reason}``,
``http_requests_total{handler, method, status}`` (status classes, as vLLM's API server),
the info gauge ``vllm:cache_config_info{block_size, num_gpu_blocks, ...}``,
and the histograms ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``
(also under its older name ``vllm:time_per_output_token_seconds``) and
``vllm:e2e_request_latency_seconds``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from isocost.engine.model import EngineModel

__all__ = [
    "E2E_BUCKETS_S",
    "INTER_TOKEN_BUCKETS_S",
    "TTFT_BUCKETS_S",
    "Histogram",
    "ReplicaMetrics",
]

# vLLM's default bucket boundaries (vllm/v1/metrics).
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_LABELS = ["model_name", "engine"]


class Histogram:
    """A Prometheus histogram that takes many equal observations at once."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.count = 0
        self.total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.count += times
        self.total += value * times

    def family(self, name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=_LABELS)
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        family.add_metric(labels, buckets, self.total)
        return family


class ReplicaMetrics:
    """The histograms and finish counts of one replica, rendered with its model's state."""

    def __init__(self, model: EngineModel, model_name: str) -> None:
        self.model = model
        self.labels = [model_name, "0"]
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.inter_token = Histogram(INTER_TOKEN_BUCKETS_S)
        self.e2e = Histogram(E2E_BUCKETS_S)
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.http: dict[tuple[str, str, str], int] = {}  # (handler, method, "2xx") -> count
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)

    def _cache_config(self) -> GaugeMetricFamily:
        """vLLM's info gauge (value 1, labels carry the cache settings, no model name):
        routers read ``num_gpu_blocks`` and ``block_size`` from it."""
        cost = self.model.cost
        config = {
            "block_size": str(self.model.block_size),
            "cache_dtype": cost.kv_dtype,
            "enable_prefix_caching": "True",
            "engine": "0",
            "gpu_memory_utilization": str(cost.limits.gpu_memory_utilization),
            "num_gpu_blocks": str(self.model.pool.num_blocks),
        }
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(config),
        )
        info.add_metric(list(config.values()), 1.0)
        return info

    def count_http(self, handler: str, method: str, status: int) -> None:
        """One answer of an OpenAI route, by its status class."""
        key = (handler, method, f"{status // 100}xx")
        self.http[key] = self.http.get(key, 0) + 1

    def render(self) -> bytes:
        return generate_latest(self._registry)

    def collect(self) -> Iterator[Metric]:
        model, labels = self.model, self.labels
        counters = model.counters
        usage = model.kv_usage
        gauges = (
            (
                "vllm:num_requests_running",
                "Requests in model execution batches.",
                model.num_running,
            ),
            ("vllm:num_requests_waiting", "Requests waiting to be processed.", model.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
            ("vllm:gpu_cache_usage_perc", "GPU KV-cache usage (older name).", usage),
        )
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=_LABELS)
            gauge.add_metric(labels, value)
            yield gauge
        yield self._cache_config()
        totals = (
            ("vllm:num_preemptions", "Cumulative preemptions.", counters.num_preemptions),
            ("vllm:prompt_tokens", "Prefill tokens processed.", counters.num_prompt_tokens),
            (
                "vllm:generation_tokens",
                "Generation tokens processed.",
                counters.num_generation_tokens,
            ),
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in tokens.",
                counters.prefix_cache_queries,
            ),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", counters.prefix_cache_hits),
        )
        for name, doc, total in totals:
            counter = CounterMetricFamily(name, doc, labels=_LABELS)
            counter.add_metric(labels, total)
            yield counter
        success = CounterMetricFamily(
            "vllm:request_success",
            "Finished requests by reason.",
            labels=[*_LABELS, "finished_reason"],
        )
        for reason, count in self.finished.items():
            success.add_metric([*labels, reason], count)
        yield success
        answers = CounterMetricFamily(
            "http_requests",
            "HTTP answers of the OpenAI routes, by handler, method and status class.",
            labels=[*_LABELS, "handler", "method", "status"],
        )
        for key, count in sorted(self.http.items()):
            answers.add_metric([*labels, *key], count)
        yield answers
        yield self.ttft.family(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.", labels
        )
        for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
            yield self.inter_token.family(name, "Inter-token latency in seconds.", labels)
        yield self.e2e.family(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", labels
        )
