"""The recorder: trace lines the Mooncake loader reads, rotation, the disk bound, and a
recording that stops (never blocks, never raises) when its directory cannot be written."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from isocost.runtime.recording import (
    FLEET_FILE,
    FleetFile,
    FleetPool,
    FleetReplica,
    RecordedRequest,
    Recorder,
    recorded_hash_ids,
    segment_paths,
)
from isocost.workload import parse_trace


def _request(i: int, *, session: str | None = None, prompt: int = 1000) -> RecordedRequest:
    return RecordedRequest(
        timestamp=10.0 * i,
        input_length=prompt,
        output_length=5 + i,
        hash_ids=[7, 1000 + i],
        session_id=session,
        status=200,
        replica="r0",
        output_tokens=5 + i,
        e2e_ms=20.0,
    )


def _fleet(factor: float = 1.0) -> FleetFile:
    replica = FleetReplica("r0", "a100-80g", "llama-3.1-8b", itl_factor=factor)
    return FleetFile(pools=[FleetPool("m", "equal_cost", [replica])])


def _lines(directory: Path) -> list[str]:
    return [line for p in segment_paths(directory) for line in p.read_text().splitlines()]


def _wait_until(condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the writer thread did not get there"
        time.sleep(0.01)


def test_a_recording_is_a_mooncake_trace_with_its_fleet(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path / "rec")
    recorder.set_fleet(_fleet(1.5))
    recorder.start()
    for i in range(5):
        recorder.record(_request(i, session="s" if i % 2 else None))
    recorder.stop()
    lines = _lines(tmp_path / "rec")
    assert len(lines) == 5 and recorder.recorded == 5 and recorder.dropped == 0
    requests = parse_trace(lines, "rec")
    assert [r.output_tokens for r in requests] == [5, 6, 7, 8, 9]
    assert [r.arrival_s for r in requests] == pytest.approx([0, 0.01, 0.02, 0.03, 0.04])
    assert [r.turn_index for r in requests] == [0, 0, 0, 1, 0]  # the session's two turns
    assert requests[0].segments[0].seed == requests[1].segments[0].seed == 7
    fleet = msgspec.json.decode((tmp_path / "rec" / FLEET_FILE).read_bytes(), type=FleetFile)
    assert fleet.pools[0].replicas[0].itl_factor == 1.5


def test_segments_rotate_and_the_oldest_go_past_the_bound(tmp_path: Path) -> None:
    line_bytes = len(msgspec.json.encode(_request(10))) + 1
    recorder = Recorder(tmp_path, segment_bytes=4 * line_bytes, max_bytes=12 * line_bytes)
    recorder.start()
    for i in range(10, 50):
        recorder.record(_request(i))
    recorder.stop()
    segments = segment_paths(tmp_path)
    sizes = [p.stat().st_size for p in segments]
    assert len(segments) >= 3
    assert sum(sizes) <= 12 * line_bytes + line_bytes
    assert all(size <= 4 * line_bytes + line_bytes for size in sizes)
    kept = parse_trace(_lines(tmp_path), "rec")
    assert kept[-1].output_tokens == 5 + 49  # the newest survive, the oldest went
    assert len(kept) < 40


def test_a_full_queue_drops_and_counts_without_waiting(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, queue_size=3)
    recorder.active = True  # accepting, but no writer draining the queue
    for i in range(10):
        recorder.record(_request(i))
    assert recorder.dropped == 7


def test_an_unwritable_directory_stops_the_recording(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    recorder = Recorder(blocker / "rec")
    recorder.start()
    _wait_until(lambda: not recorder.active)
    recorder.record(_request(0))  # a stopped recorder takes nothing and raises nothing
    assert recorder.errors == 1 and recorder.error is not None
    assert recorder.dropped == 0 and recorder.recorded == 0


def test_a_directory_gone_mid_recording_stops_it_at_the_next_segment(tmp_path: Path) -> None:
    directory = tmp_path / "rec"
    line_bytes = len(msgspec.json.encode(_request(10))) + 1
    recorder = Recorder(directory, segment_bytes=2 * line_bytes, max_bytes=100 * line_bytes)
    recorder.start()
    _wait_until(lambda: bool(segment_paths(directory)))
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()
    directory.write_text("now a file")
    for i in range(10, 20):
        recorder.record(_request(i))
    _wait_until(lambda: not recorder.active)
    assert recorder.errors == 1
    recorder.stop()


def test_hash_ids_follow_the_prefix_one_per_512_tokens() -> None:
    shared = tuple(range(1, 65))  # 64 blocks of 16 tokens: two whole 512-token blocks
    a = recorded_hash_ids((*shared, 900), 16, 1100, salt=5, unique=1)
    b = recorded_hash_ids(shared[:32] + (77,) * 40, 16, 1100, salt=5, unique=2)
    assert len(a) == len(b) == 3  # ceil(1100 / 512)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    assert a[0] != recorded_hash_ids(shared, 16, 1100, salt=6, unique=1)[0]  # salted


def test_a_restarted_recording_appends_on_one_time_line(tmp_path: Path) -> None:
    arrivals = []
    for _ in range(2):  # the gateway restarted with the same --record DIR
        recorder = Recorder(tmp_path)
        recorder.start()
        arrivals.append(recorder.timestamp_ms(time.monotonic()))
        recorder.record(msgspec.structs.replace(_request(0), timestamp=arrivals[-1]))
        recorder.stop()
        time.sleep(0.002)  # the second arrives later, on the wall clock too
    assert [p.name for p in segment_paths(tmp_path)] == ["trace-000000.jsonl", "trace-000001.jsonl"]
    first, second = parse_trace(_lines(tmp_path), "rec")
    assert first.arrival_s == 0
    assert second.arrival_s == pytest.approx((arrivals[1] - arrivals[0]) / 1000, abs=1e-4)
    assert second.arrival_s > 0
