"""Read the load figures the gateway needs from a replica's Prometheus ``/metrics`` text.

Understands vLLM's names (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` and the older ``vllm:gpu_cache_usage_perc``, both fractions
in [0, 1] despite the name; ``vllm:num_preemptions_total``) and SGLang's
(``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``,
``sglang:cache_hit_rate``), plus the prefix-cache counters (vLLM V1
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` with or without ``_total``, V0
``vllm:gpu_prefix_cache_*``). Samples of one name are summed over their labels (one engine
with several model or rank labels is one replica); gauges that are fractions are averaged
(a KV usage that is not exported reads as 0).
A text without any of these names is an error, so a replica that serves some other
``/metrics`` is seen as unscrapable instead of idle.
"""

from __future__ import annotations

from isocost.scheduling.contract import EngineMetrics

__all__ = ["ScrapeError", "parse_engine_metrics"]

_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
_PREFIX_QUERIES = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_queries",
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries",
)
_PREFIX_HITS = tuple(name.replace("queries", "hits") for name in _PREFIX_QUERIES)
_WANTED = frozenset(_RUNNING + _WAITING + _KV_USAGE + _PREEMPTIONS + _PREFIX_QUERIES + _PREFIX_HITS)


class ScrapeError(ValueError):
    """The text carries none of the engine metrics the gateway understands."""


def parse_engine_metrics(text: str) -> EngineMetrics:
    """The running/waiting/KV figures of a Prometheus exposition text."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=len(line))
        name = line[:end]
        if name not in _WANTED:
            continue
        value_text = line[line.rfind("}") + 1 :] if line[end : end + 1] == "{" else line[end:]
        fields = value_text.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        sums[name] = sums.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1
    running = _first(sums, _RUNNING)
    waiting = _first(sums, _WAITING)
    if running is None and waiting is None:
        raise ScrapeError("no vLLM or SGLang request gauges in /metrics")
    kv_name = next((n for n in _KV_USAGE if n in sums), None)
    kv_usage = 0.0 if kv_name is None else sums[kv_name] / counts[kv_name]
    return EngineMetrics(
        num_running=int(running or 0),
        num_waiting=int(waiting or 0),
        kv_usage=min(1.0, max(0.0, kv_usage)),
        prefix_cache_queries=int(_first(sums, _PREFIX_QUERIES) or 0),
        prefix_cache_hits=int(_first(sums, _PREFIX_HITS) or 0),
        num_preemptions=int(_first(sums, _PREEMPTIONS) or 0),
    )


def _first(sums: dict[str, float], names: tuple[str, ...]) -> float | None:
    return next((sums[n] for n in names if n in sums), None)
