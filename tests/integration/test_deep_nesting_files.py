"""Files `isocost` reads, nested deeper than a decoder follows: one line and exit 2.

msgspec, ``json`` and PyYAML raise RecursionError on such input (here a hundred thousand
``[``), neither a ValueError nor a ``msgspec.DecodeError`` nor a ``yaml.YAMLError``: it
got past the ``except`` that turns every other malformed file into one error line, and the
command printed a traceback. A typed decoder only recurses where it skips a value (a key
its type does not name), so the JSON cases put the nesting there; the bare ``[`` cases
are kept so that they stay one line too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_bad_input import _recording, refused, run

DEEP = "[" * 100_000
SKIPPED = '{"deep": ' + DEEP  # in a key a typed decoder does not know, so skips
RECURSION = "maximum recursion depth"


@pytest.mark.parametrize(
    ("text", "words"), [(SKIPPED, (":1", RECURSION)), (DEEP, ())], ids=["skipped_key", "bare"]
)
def test_a_deep_trace_is_one_line(tmp_path: Path, text: str, words: tuple[str, ...]) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(text + "\n")
    refused(run("sim", "--trace", str(trace), "--replicas", "1", "--jobs", "1"), str(trace), *words)


def test_a_deep_line_in_a_recording_is_one_line(tmp_path: Path) -> None:
    record = _recording(tmp_path / "rec")
    segment = record / "trace-000000.jsonl"
    with segment.open("a") as f:
        f.write(SKIPPED + "\n")
    lines = len(segment.read_text().splitlines())
    refused(
        run("sim", "--from-record", str(record), "--jobs", "1"), f"{segment}:{lines}", RECURSION
    )


@pytest.mark.parametrize("text", [SKIPPED, DEEP], ids=["skipped_key", "bare"])
def test_a_deep_fleet_file_is_one_line(tmp_path: Path, text: str) -> None:
    """FleetFile names every key it takes, so no nesting reaches a skip today; the
    catch stays in case it grows a free-form field."""
    record = _recording(tmp_path / "rec")
    (record / "fleet.json").write_text(text)
    refused(run("sim", "--from-record", str(record), "--jobs", "1"), str(record / "fleet.json"))


@pytest.mark.parametrize(
    ("text", "words"), [(SKIPPED, (RECURSION,)), (DEEP, ())], ids=["skipped_key", "bare"]
)
def test_a_deep_bench_summary_is_one_line(
    tmp_path: Path, text: str, words: tuple[str, ...]
) -> None:
    (tmp_path / "a.json").write_text(text)
    done = run("bench", "compare", "a.json", "a.json", cwd=tmp_path)
    refused(done, "a.json", "not an isocost bench --json summary", *words)


@pytest.mark.parametrize(
    "flags",
    [("--cluster",), ("--replicas", "1", "--rate", "2", "--autoscale")],
    ids=["cluster", "autoscale"],
)
def test_a_deep_yaml_file_of_sim_is_one_line(tmp_path: Path, flags: tuple[str, ...]) -> None:
    config = tmp_path / "deep.yaml"
    config.write_text(DEEP)
    done = run("sim", "--workload", "mix", "--max-requests", "5", *flags, str(config))
    refused(done, str(config), "not valid YAML", RECURSION)


def test_a_deep_scheduling_yaml_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "deep.yaml"
    config.write_text(DEEP)
    refused(run("policies", "--config", str(config)), str(config), "not valid YAML", RECURSION)
