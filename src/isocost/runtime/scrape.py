"""Read the load figures of a replica's Prometheus ``/metrics`` text (gateway and agent).

Understands vLLM's names (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` and the older ``vllm:gpu_cache_usage_perc``, both fractions
in [0, 1] despite the name; ``vllm:num_preemptions_total``) and SGLang's
(``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``,
``sglang:cache_hit_rate``), plus the prefix-cache counters (vLLM V1
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` with or without ``_total``, V0
``vllm:gpu_prefix_cache_*``), and the KV block size from the ``block_size`` label of
``vllm:cache_config_info``. Samples of one name are summed over their labels (one engine
with several model or rank labels is one replica); gauges that are fractions are averaged
(a KV usage that is not exported reads as 0).

A replica's text is untrusted: a sample that is not a finite, non-negative number (``NaN``,
``±Inf``, ``-3``) is ignored, a request gauge beyond ``MAX_REQUESTS`` is clamped to it (a
replica claiming more is as full as can be), a counter beyond 2**53 is ignored (no longer
exact as a float), a KV fraction above 1 reads as 1; each sample ignored or clamped is
named in ``Scrape.problems``. A text without any usable request gauge, or bytes that its
charset cannot decode, are a ``ScrapeError`` (so is a body over ``MAX_BODY_BYTES``: the
monitor stops reading there), so a replica that serves some other ``/metrics`` is seen as
unscrapable instead of idle.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from isocost.scheduling.contract import EngineMetrics

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_REQUESTS",
    "Scrape",
    "ScrapeError",
    "decode_exposition",
    "kv_capacity_tokens",
    "parse_engine_metrics",
]

MAX_BODY_BYTES = 16 << 20  # a vLLM /metrics with many LoRA labels is well under 1 MiB
MAX_REQUESTS = 1_000_000  # per request gauge of one replica
_MAX_COUNTER = float(1 << 53)

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
_COUNTERS = frozenset(_PREEMPTIONS + _PREFIX_QUERIES + _PREFIX_HITS)
_WANTED = frozenset(_RUNNING + _WAITING + _KV_USAGE) | _COUNTERS
_CACHE_CONFIG = "vllm:cache_config_info"
_BLOCK_SIZE = re.compile(r'[{,]\s*block_size="(\d{1,8})"')
_GPU_BLOCKS = re.compile(r'[{,]\s*num_gpu_blocks="(\d{1,12})"')


class ScrapeError(ValueError):
    """The body is not a metrics text with the engine gauges the gateway understands."""


@dataclass(frozen=True, slots=True)
class Scrape:
    """The figures of one ``/metrics`` text, and the samples that could not be used as sent."""

    metrics: EngineMetrics
    problems: tuple[str, ...] = ()


def decode_exposition(body: bytes, charset: str | None) -> str:
    """``body`` as text in ``charset`` (UTF-8, Prometheus' own, when none is named)."""
    encoding = charset or "utf-8"
    try:
        return body.decode(encoding)
    except LookupError:
        raise ScrapeError(f"/metrics charset {encoding[:40]!r} is not a text encoding") from None
    except UnicodeDecodeError as exc:
        raise ScrapeError(f"/metrics body is not {exc.encoding} text") from None


def kv_capacity_tokens(text: str) -> int | None:
    """The KV tokens an engine holds, from the ``num_gpu_blocks`` and ``block_size`` labels
    of its ``vllm:cache_config_info`` (None when it does not say)."""
    for line in text.splitlines():
        if line.startswith(_CACHE_CONFIG + "{"):
            blocks, size = _GPU_BLOCKS.search(line), _BLOCK_SIZE.search(line)
            if blocks and size and int(blocks[1]) > 0 and int(size[1]) > 0:
                return int(blocks[1]) * int(size[1])
    return None


def parse_engine_metrics(text: str) -> Scrape:
    """The running/waiting/KV figures of a Prometheus exposition text."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    problems: dict[str, str] = {}  # one per metric name, the first seen
    block_tokens: int | None = None
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=len(line))
        name = line[:end]
        if name == _CACHE_CONFIG:
            found = _BLOCK_SIZE.search(line, end)
            block_tokens = int(found[1]) if found and 0 < int(found[1]) <= 1 << 20 else None
            continue
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
        usable, problem = _usable(name, value)
        if problem is not None:
            problems.setdefault(name, f"{name}: {problem}")
        if usable is None:
            continue
        sums[name] = sums.get(name, 0.0) + usable
        counts[name] = counts.get(name, 0) + 1
    running = _first(sums, _RUNNING)
    waiting = _first(sums, _WAITING)
    if running is None and waiting is None:
        detail = "; ".join(problems.values())
        raise ScrapeError(
            f"no usable request gauges in /metrics ({detail})"
            if detail
            else "no vLLM or SGLang request gauges in /metrics"
        )
    kv_name = next((n for n in _KV_USAGE if n in sums), None)
    kv_usage = 0.0 if kv_name is None else sums[kv_name] / counts[kv_name]
    metrics = EngineMetrics(
        num_running=int(running or 0),
        num_waiting=int(waiting or 0),
        kv_usage=min(1.0, kv_usage),
        prefix_cache_queries=int(_first(sums, _PREFIX_QUERIES) or 0),
        prefix_cache_hits=int(_first(sums, _PREFIX_HITS) or 0),
        num_preemptions=int(_first(sums, _PREEMPTIONS) or 0),
        kv_block_tokens=block_tokens,
    )
    return Scrape(metrics, tuple(problems.values()))


def _usable(name: str, value: float) -> tuple[float | None, str | None]:
    """The value to use for one sample of ``name`` (None: ignore it), and why it changed."""
    if not math.isfinite(value):
        return None, f"{value} sample ignored"
    if value < 0:
        return None, f"negative sample {value:g} ignored"
    if name in _COUNTERS:
        if value > _MAX_COUNTER:
            return None, f"counter {value:g} out of range, ignored"
    elif name not in _KV_USAGE and value > MAX_REQUESTS:
        return MAX_REQUESTS, f"{value:g} clamped to {MAX_REQUESTS}"
    return value, None


def _first(sums: dict[str, float], names: tuple[str, ...]) -> float | None:
    return next((sums[n] for n in names if n in sums), None)
