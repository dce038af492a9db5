"""Trace parsers: text in, ``WorkloadRequest`` out; every error names the file and line.

Formats (detected from the first line, or named):

- ``mooncake``: JSON lines ``{"timestamp": ms, "input_length", "output_length",
  "hash_ids": [...]}``; each hash id is a 512-token block, equal ids = shared prefix; an
  optional ``session_id`` (isocost's recordings) numbers a session's turns.
- ``azure``: CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` with ISO date-times
  (Azure LLM inference traces, Splitwise).
- ``burstgpt``: CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log
  Type`` (seconds; newer files add ``Session ID`` and ``Elapsed time``). Rows with 0
  response tokens are requests that failed in production and are skipped.
- ``lengths``: CSV with ``num_prefill_tokens,num_decode_tokens`` and no times (Vidur's
  processed traces); every arrival is 0 until an arrival process is applied
  (``with_arrivals``).

Times are rebased so the first request arrives at 0; requests of one session are numbered
as turns in arrival order. Traces without prefix information
give each request its own segment seed (its row index), so nothing is shared.
"""

from __future__ import annotations

import csv
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Literal

import msgspec

from isocost.core.errors import ConfigError
from isocost.core.jsontext import UNDECODABLE
from isocost.workload._request import Segment, WorkloadRequest, segments_for_blocks

__all__ = ["TRACE_FORMATS", "TraceFormat", "detect_trace_format", "parse_trace"]

TraceFormat = Literal["mooncake", "azure", "burstgpt", "lengths"]
TRACE_FORMATS: tuple[TraceFormat, ...] = ("mooncake", "azure", "burstgpt", "lengths")


class _MooncakeRow(msgspec.Struct, forbid_unknown_fields=False):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int] = []
    session_id: str | None = None  # isocost's recordings add it (isocost.runtime.recording)


_mooncake_decoder = msgspec.json.Decoder(_MooncakeRow)


def detect_trace_format(first_line: str, source: str) -> TraceFormat:
    """The format of a trace from its first line, or a ConfigError naming the file."""
    head = first_line.strip().lstrip("\ufeff")
    if head.startswith("{"):
        return "mooncake"
    columns = {c.strip() for c in head.split(",")}
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= columns:
        return "azure"
    if {"Timestamp", "Request tokens", "Response tokens"} <= columns:
        return "burstgpt"
    if {"num_prefill_tokens", "num_decode_tokens"} <= columns:
        return "lengths"
    raise ConfigError(
        f"{source}:1",
        "unknown trace format (expected Mooncake JSONL or an Azure, BurstGPT or "
        "lengths-only CSV header)",
    )


def parse_trace(
    lines: Iterable[str], source: str, trace_format: TraceFormat | None = None
) -> list[WorkloadRequest]:
    """All requests of a trace, sorted by arrival; ``source`` names the file in errors."""
    it = iter(lines)
    first = next(it, None)
    if first is None:
        raise ConfigError(source, "empty trace")
    fmt = trace_format or detect_trace_format(first, source)
    rows = itertools.chain([first], it)
    parsed = _mooncake(rows, source) if fmt == "mooncake" else _csv(rows, source, fmt)
    requests = list(parsed)
    if not requests:
        raise ConfigError(source, "trace has no requests")
    start = min(r.arrival_s for r in requests)
    requests.sort(key=lambda r: (r.arrival_s, r.request_id))
    turns: Counter[str] = Counter()
    rebased = []
    for r in requests:
        turn_index = 0
        if r.session_id is not None:
            turn_index = turns[r.session_id]
            turns[r.session_id] += 1
        rebased.append(replace(r, arrival_s=r.arrival_s - start, turn_index=turn_index))
    return rebased


def _mooncake(lines: Iterable[str], source: str) -> Iterator[WorkloadRequest]:
    index = 0
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            row = _mooncake_decoder.decode(line)
            segments = segments_for_blocks(row.hash_ids, row.input_length)
            yield WorkloadRequest(
                index,
                row.timestamp / 1000.0,
                row.input_length,
                row.output_length,
                segments,
                row.session_id,
            )
        except (*UNDECODABLE, msgspec.ValidationError, ValueError) as exc:  # too deep included
            raise ConfigError(where, str(exc)) from None
        index += 1


_Row = dict[str, str]


def _csv(lines: Iterable[str], source: str, fmt: TraceFormat) -> Iterator[WorkloadRequest]:
    reader = csv.DictReader(lines)
    convert = _CSV_ROW[fmt]
    index = 0
    for row in reader:
        where = f"{source}:{reader.line_num}"
        try:
            parsed = convert(row)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(where, f"bad row ({_reason(exc)})") from None
        if parsed is None:
            continue
        arrival_s, prompt_tokens, output_tokens, session_id = parsed
        try:
            yield WorkloadRequest(
                index,
                arrival_s,
                prompt_tokens,
                output_tokens,
                (Segment(index, prompt_tokens),),
                session_id,
            )
        except ValueError as exc:
            raise ConfigError(where, str(exc)) from None
        index += 1


def _reason(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"missing column {exc.args[0]!r}"
    if isinstance(exc, TypeError):
        return "too few columns"
    return str(exc)


_Parsed = tuple[float, int, int, str | None] | None


def _azure_row(row: _Row) -> _Parsed:
    at = datetime.fromisoformat(row["TIMESTAMP"].strip()).replace(tzinfo=UTC)
    return at.timestamp(), int(row["ContextTokens"]), int(row["GeneratedTokens"]), None


def _burstgpt_row(row: _Row) -> _Parsed:
    output_tokens = int(row["Response tokens"])
    if output_tokens == 0:  # failed in production: nothing to replay
        return None
    session = (row.get("Session ID") or "").strip() or None
    return float(row["Timestamp"]), int(row["Request tokens"]), output_tokens, session


def _lengths_row(row: _Row) -> _Parsed:
    return 0.0, int(row["num_prefill_tokens"]), int(row["num_decode_tokens"]), None


_CSV_ROW: dict[TraceFormat, Callable[[_Row], _Parsed]] = {
    "azure": _azure_row,
    "burstgpt": _burstgpt_row,
    "lengths": _lengths_row,
}
