"""Trace parsers on excerpts of the real traces, and their errors on broken input."""

from __future__ import annotations

from pathlib import Path

import pytest

from isocost.core.errors import ConfigError
from isocost.files import load_trace, read_text
from isocost.workload import TRACE_BLOCK_TOKENS, detect_trace_format, parse_trace

TRACES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"


def _load(name: str) -> list[str]:
    return read_text(TRACES / name).splitlines()


def test_mooncake_keeps_lengths_times_and_shared_blocks() -> None:
    lines = _load("mooncake_conversation_head.jsonl")
    requests = parse_trace(lines, "mooncake.jsonl")
    assert len(requests) == len(lines)
    first, second = requests[0], requests[1]
    assert (first.prompt_tokens, first.output_tokens) == (6758, 500)
    # hash_ids [0, 1, ...] and [0, 14, ...]: one shared 512-token block, then different.
    assert first.segments[0] == second.segments[0]
    assert first.segments[0].num_tokens == TRACE_BLOCK_TOKENS
    assert first.segments[1] != second.segments[1]
    assert first.segments[-1].num_tokens == 6758 - 13 * TRACE_BLOCK_TOKENS
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    last_ms = int(lines[-1].split('"timestamp": ')[1].split(",")[0])
    assert requests[-1].arrival_s == pytest.approx(last_ms / 1000)


def test_azure_times_are_seconds_from_the_first_request() -> None:
    requests = parse_trace(_load("azure_code_head.csv"), "azure.csv")
    assert len(requests) == 120
    # 18:17:03.9799600 then 18:17:04.0319600
    assert requests[1].arrival_s == pytest.approx(0.052, abs=1e-6)
    assert (requests[0].prompt_tokens, requests[0].output_tokens) == (4808, 10)
    seeds = {r.segments[0].seed for r in requests}
    assert len(seeds) == len(requests), "no prefix information: nothing may be shared"


def test_lengths_only_rows_all_arrive_at_zero() -> None:
    requests = parse_trace(_load("vidur_arxiv_head.csv"), "arxiv.csv")
    assert len(requests) == 120
    assert {r.arrival_s for r in requests} == {0.0}
    assert (requests[0].prompt_tokens, requests[0].output_tokens) == (3772, 54)


def test_burstgpt_skips_failed_rows_and_keeps_sessions() -> None:
    text = [
        "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,"
        "Total tokens,Log Type",
        "5,abc,1.2,ChatGPT,472,18,490,Conversation log",
        "7,abc,0.4,ChatGPT,300,0,300,Conversation log",
        "45,,2.0,GPT-4,1087,230,1317,API log",
    ]
    requests = parse_trace(text, "burst.csv")
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in requests] == [
        (0.0, 472, 18),
        (40.0, 1087, 230),
    ]
    assert [r.session_id for r in requests] == ["abc", None]
    more = parse_trace([*text, "50,abc,1.0,GPT-4,10,2,12,Conversation log"], "burst.csv")
    assert [(r.session_id, r.turn_index) for r in more] == [("abc", 0), (None, 0), ("abc", 1)]


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ('{"timestamp": 0}', "mooncake"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens", "azure"),
        ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type", "burstgpt"),
        ("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio", "lengths"),
    ],
)
def test_format_detection(header: str, expected: str) -> None:
    assert detect_trace_format(header, "t") == expected


def test_a_named_format_skips_detection() -> None:
    lines = ["Timestamp,Model,Request tokens,Response tokens", "1.5,GPT-4,10,2"]
    assert parse_trace(lines, "b.csv", "burstgpt")[0].prompt_tokens == 10
    with pytest.raises(ConfigError, match=r"^b\.csv:2: bad row \(missing column 'TIMESTAMP'"):
        parse_trace(lines, "b.csv", "azure")


def test_load_trace_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n'
    path.write_text(good)
    assert load_trace(path)[0].prompt_tokens == 3
    path.write_text(good + "{")
    with pytest.raises(ConfigError, match=rf"^{path}:2: "):
        load_trace(path)


def test_broken_jsonl_names_file_and_line() -> None:
    lines = _load("mooncake_conversation_head.jsonl")[:3]
    lines.insert(2, '{"timestamp": 5, "input_length": "many"}')
    with pytest.raises(ConfigError, match=r"^trace\.jsonl:3: "):
        parse_trace(lines, "trace.jsonl")


def test_too_few_blocks_for_the_prompt_is_an_error() -> None:
    line = '{"timestamp": 0, "input_length": 1025, "output_length": 3, "hash_ids": [1, 2]}'
    with pytest.raises(ConfigError, match=r"^t:1: 2 blocks of 512 tokens cannot hold 1025"):
        parse_trace([line], "t")


def test_broken_csv_row_names_file_and_line() -> None:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:17:03.97,10,2", "x,y"]
    with pytest.raises(ConfigError, match=r"^a\.csv:3: bad row"):
        parse_trace(lines, "a.csv")


def test_negative_lengths_are_rejected_with_the_line() -> None:
    lines = ["num_prefill_tokens,num_decode_tokens", "10,2", "5,-1"]
    with pytest.raises(ConfigError, match=r"^l\.csv:3: .*token counts must be positive"):
        parse_trace(lines, "l.csv")


def test_unknown_and_empty_traces() -> None:
    with pytest.raises(ConfigError, match=r"^x\.csv:1: unknown trace format"):
        parse_trace(["a,b,c", "1,2,3"], "x.csv")
    with pytest.raises(ConfigError, match="empty trace"):
        parse_trace([], "e.csv")
    with pytest.raises(ConfigError, match="no requests"):
        parse_trace(["num_prefill_tokens,num_decode_tokens"], "h.csv")
