"""Recording live traffic as a trace the simulator replays (the digital twin, #25).

A recording directory holds ``trace-NNNNNN.jsonl`` segments and ``fleet.json``. Each
segment line is one finished request in Mooncake's form (``timestamp``: arrival in Unix
ms, ``input_length``, ``output_length``, ``hash_ids``: one id per 512-token
block, equal ids at equal positions = shared prefix), so ``isocost sim --trace`` reads a
segment as it reads any Mooncake trace, plus what a replay or an audit needs: the
session, route class, priority, deadline and TPOT target, and the outcome (status,
replica, TTFT, end-to-end time). Nothing private: no text, no keys, no URLs; block ids
and sessions are salted hashes, stable within one recording only. ``fleet.json`` is the
fleet the traffic met: each pool's policy and replicas (GPU, tensor parallelism, cost
model, price) with the calibration factors the router learned for them.

Off the hot path: ``record`` appends to a bounded queue (a full queue drops the record
and counts it, never waits); a writer thread batches the queue into the current segment,
starts a new one past ``segment_bytes`` and deletes the oldest while the directory holds
more than ``max_bytes``. The fleet is handed in by the data plane (``set_fleet``, from its
own loop) and written when it changes and at each new segment. Any write error (a full
disk, a directory that cannot be written) stops the recording: one log line, ``active``
false, ``errors`` counted; requests never see it.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import msgspec

__all__ = [
    "FLEET_FILE",
    "TRACE_BLOCK_TOKENS",
    "FleetFile",
    "FleetPool",
    "FleetReplica",
    "RecordedRequest",
    "Recorder",
    "directory_problem",
    "monotonic_epoch_s",
    "recorded_hash_ids",
    "segment_paths",
    "unix_timestamp_ms",
    "usable_directory",
    "write_recording",
]

log = logging.getLogger("isocost.recording")

FLEET_FILE = "fleet.json"
TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids granularity
_SEGMENT = re.compile(r"trace-(\d{6})\.jsonl")
_HASH_MASK = (1 << 63) - 1
_FLUSH_S = 0.2  # how long a record waits in the queue at most


class RecordedRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One finished request: Mooncake's four fields first, then isocost's (those at their
    default are left out, the outcome never)."""

    timestamp: float  # arrival, ms since the Unix epoch (the trace loader rebases)
    input_length: int
    output_length: int
    hash_ids: list[int]
    model: str = ""
    session_id: str | None = None  # salted hash of the client's session key
    route_class: str | None = None
    priority: int = 0
    deadline_ms: float | None = None
    tpot_ms: float | None = None
    stream: bool = True
    max_tokens: int | None = None
    status: int
    replica: str | None = None
    output_tokens: int  # what the replica made (output_length is >= 1 for Mooncake)
    ttft_ms: float | None = None
    e2e_ms: float


class FleetReplica(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    gpu: str
    cost_model: str
    tp: int = 1
    weight: float = 1.0
    max_queue: int = 128
    usd_per_hour: float | None = None
    groups: list[str] = []
    ttft_factor: float = 1.0  # learned observed / predicted TTFT (calibration)
    itl_factor: float = 1.0  # learned observed / predicted inter-token time


class FleetPool(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    model: str
    policy: str
    replicas: list[FleetReplica]


class FleetFile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``fleet.json``: the fleet a recording's traffic met, with its gateway settings (a key
    it does not know is an error: a replay must not silently ignore part of a fleet)."""

    pools: list[FleetPool]
    scrape_interval_ms: float = 200.0
    queue_size: int = 1024
    queue_timeout_ms: float = 30_000.0
    max_retries: int = 2
    # catalog YAML of the GPUs the replicas name that isocost does not ship as they are
    # (a --catalog entry, an ``isocost profile`` one): a replay elsewhere prices them so
    catalog: str | None = None


def recorded_hash_ids(
    block_hashes: tuple[int, ...], block_tokens: int, prompt_tokens: int, salt: int, unique: int
) -> list[int]:
    """Mooncake block ids for a prompt from the router's chained ``block_tokens`` hashes:
    the chained hash closing each whole 512-token block (it names the whole prefix up to
    there), salted; blocks the hashes do not cover (the partial last one) get ids of
    their own, derived from ``unique``, so they share nothing."""
    step = TRACE_BLOCK_TOKENS // block_tokens
    wanted = -(-prompt_tokens // TRACE_BLOCK_TOKENS)
    ids = [hash((salt, h)) & _HASH_MASK for h in block_hashes[step - 1 :: step][:wanted]]
    ids.extend(hash((salt, unique, i)) & _HASH_MASK for i in range(len(ids), wanted))
    return ids


def monotonic_epoch_s() -> float:
    """The offset that, added to monotonic seconds, gives Unix seconds (as of now)."""
    return time.time() - time.monotonic()


def unix_timestamp_ms(monotonic_s: float, epoch_s: float) -> float:
    """A request's ``timestamp``: its monotonic arrival as Unix milliseconds."""
    return round((monotonic_s + epoch_s) * 1000, 1)


def write_recording(
    directory: Path, requests: Sequence[RecordedRequest], fleet: FleetFile, timeout_s: float
) -> None:
    """Write ``requests`` and ``fleet`` as a recording in ``directory``, through the same
    ``Recorder`` as ``serve --record`` (blocking: call it off the event loop); OSError
    when the recorder failed or did not finish within ``timeout_s``."""
    recorder = Recorder(directory, queue_size=max(1, len(requests)))
    recorder.set_fleet(fleet)
    recorder.start()
    for request in requests:
        recorder.record(request)
    recorder.stop(timeout_s)
    if recorder.error is not None:
        raise OSError(recorder.error)
    if recorder.recorded != len(requests):
        raise OSError(f"wrote {recorder.recorded} of {len(requests)} requests")


def segment_paths(directory: Path) -> list[Path]:
    """A recording's segments, oldest first."""
    try:
        names = sorted(p.name for p in directory.iterdir() if _SEGMENT.fullmatch(p.name))
    except OSError:
        return []
    return [directory / name for name in names]


def usable_directory(directory: Path) -> None:
    """Make ``directory`` if it is missing; ValueError, saying why, when it cannot be made
    or written: checked before a recording is said to start, so that a bad ``--record``
    or admin start is refused then rather than found by the writer."""
    problem = directory_problem(directory)
    if problem is not None:
        raise ValueError(f"cannot record into {str(directory)!r}: {problem}")


def directory_problem(directory: Path) -> str | None:
    """Make ``directory`` if it is missing; why it cannot be made or written, else None.
    Shared by ``--record`` and the CLI's other output folders (``demo --out``)."""
    try:
        if directory.exists() and not directory.is_dir():
            return "not a folder"
        directory.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        return _reason(exc)
    if not os.access(directory, os.W_OK | os.X_OK):
        return "not writable"
    return None


def _reason(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or str(exc)


class Recorder:
    """Appends finished requests to a recording directory from a writer thread."""

    def __init__(
        self,
        directory: Path,
        *,
        segment_bytes: int = 64 << 20,
        max_bytes: int = 1 << 30,
        queue_size: int = 65536,
    ) -> None:
        if segment_bytes <= 0 or max_bytes < segment_bytes or queue_size <= 0:
            raise ValueError("need 0 < segment_bytes <= max_bytes and queue_size > 0")
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.max_bytes = max_bytes
        self.queue_size = queue_size
        self.salt = int.from_bytes(secrets.token_bytes(8))  # ids stable in this recording
        self._epoch_s = monotonic_epoch_s()
        self.active = False
        self.recorded = 0  # written to a segment
        self.dropped = 0  # refused by a full queue, or pending when the recording stopped
        self.errors = 0
        self.error: str | None = None
        self._queue: deque[RecordedRequest] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._fleet: bytes | None = None
        self._fleet_written: bytes | None = None
        self._encoder = msgspec.json.Encoder()

    # -- the data plane's side (its event loop) --------------------------------------

    def start(self) -> None:
        """Start writing; a directory that cannot be made stops the recording at once."""
        self.active = True
        self._thread = threading.Thread(target=self._run, name="isocost-recorder", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then stop."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.active = False

    def timestamp_ms(self, monotonic_s: float) -> float:
        """A request's ``timestamp``: Unix milliseconds, so that recordings appended to one
        directory across gateway restarts keep one time line."""
        return unix_timestamp_ms(monotonic_s, self._epoch_s)

    def record(self, request: RecordedRequest) -> None:
        """Queue one finished request; never blocks (a full queue drops and counts it)."""
        if not self.active:
            return
        if len(self._queue) >= self.queue_size:
            self.dropped += 1
            return
        self._queue.append(request)

    def set_fleet(self, fleet: FleetFile) -> None:
        """The fleet as it is now; written by the writer when it changed."""
        self._fleet = msgspec.json.format(self._encoder.encode(fleet), indent=2)

    # -- the writer thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            segments = segment_paths(self.directory)
            number = _segment_number(segments[-1]) + 1 if segments else 0  # after a restart
            while not (self._stopping and not self._queue):
                self._write_segment(number)
                number += 1
        except (OSError, ValueError) as exc:  # ValueError: a path the OS cannot take
            self._fail(exc)

    def _write_segment(self, number: int) -> None:
        """Fill segment ``number`` until it holds ``segment_bytes`` (one line more at most)
        or the recording stops with nothing queued."""
        path = self.directory / f"trace-{number:06d}.jsonl"
        self._write_fleet(force=True)
        self._trim(keep=path)
        with path.open("ab", buffering=0) as out:
            size = out.tell()
            while size < self.segment_bytes:
                if self._queue:
                    batch = self._take(self.segment_bytes - size)
                    out.write(batch)
                    size += len(batch)
                    continue
                self._write_fleet()
                if self._stopping:
                    return
                self._wake.wait(_FLUSH_S)
                self._wake.clear()

    def _take(self, room: int) -> bytes:
        """Encoded queued records, as many as fill ``room`` bytes (at least one)."""
        lines: list[bytes] = []
        size = 0
        while self._queue and size < room:
            line = self._encoder.encode(self._queue.popleft()) + b"\n"
            lines.append(line)
            size += len(line)
        self.recorded += len(lines)
        return b"".join(lines)

    def _write_fleet(self, *, force: bool = False) -> None:
        fleet = self._fleet
        if fleet is None or (fleet == self._fleet_written and not force):
            return
        temporary = self.directory / f".{FLEET_FILE}.tmp"
        temporary.write_bytes(fleet)
        os.replace(temporary, self.directory / FLEET_FILE)
        self._fleet_written = fleet

    def _trim(self, keep: Path) -> None:
        """Delete the oldest segments while the recording holds more than ``max_bytes``
        (counting a whole segment for the one about to be written)."""
        segments = [p for p in segment_paths(self.directory) if p != keep]
        sizes = [p.stat().st_size for p in segments]
        while segments and sum(sizes) + self.segment_bytes > self.max_bytes:
            segments.pop(0).unlink(missing_ok=True)
            sizes.pop(0)

    def _fail(self, exc: OSError | ValueError) -> None:
        self.active = False
        self.errors += 1
        self.error = f"{type(exc).__name__}: {_reason(exc)}"
        self.dropped += len(self._queue)
        self._queue.clear()
        log.error(
            "recording stopped",
            extra={"event": "recording_failed", "dir": str(self.directory), "error": self.error},
        )


def _segment_number(path: Path) -> int:
    match = _SEGMENT.fullmatch(path.name)
    assert match is not None, "segment_paths lists segments only"
    return int(match[1])
