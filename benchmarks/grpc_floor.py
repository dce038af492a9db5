"""What Python gRPC alone costs an ext_proc server per request: the floor under any picker.

``isocost picker`` answers each request over one ext_proc gRPC stream (request headers,
body, response headers: three messages each way). This serves that exchange from a
server that decides nothing (each message answered with an empty response of its kind) and
measures the server's CPU per stream (Linux ``/proc``, steadier than a rate on a shared
machine), for the picker's grpc.aio server (uvloop, as the picker runs) with 3, 2 or 1
messages per stream, and for grpc's thread-pool server with 3. ``--rounds`` alternates
the variants and keeps each one's lowest figure.

The last row is what Python pays behind the native relay (``isocost picker --relay``),
which speaks gRPC to Envoy and passes each stream's messages on as bytes: the same three
messages and answers, decoded and encoded with the same protobuf classes, as frames
(stream id, kind, length) over one Unix socket to an asyncio server (uvloop), one task per
stream, the client's half-close and the server's end of stream one frame each (the frames
of ``picker.relay``, served by this benchmark's own server, without the relay process).

    .venv/bin/python benchmarks/grpc_floor.py --streams 6000 --json grpc_floor.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import uvloop
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from rich.console import Console
from rich.table import Table

from isocost.picker.relay import FINISH, FRAME, HALF_CLOSE, MESSAGE
from isocost.runtime.processes import run_script

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from isocost_procs import cpu_seconds, ready_urls

_MESSAGES = (
    ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")]
            )
        )
    ),
    ext_proc.ProcessingRequest(
        request_body=ext_proc.HttpBody(
            body=b'{"model":"m","prompt":"hello world","max_tokens":16}', end_of_stream=True
        )
    ),
    ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders()),
)
_VARIANTS = (("aio", 3), ("aio", 2), ("aio", 1), ("threads", 3), ("unix", 3))
_OK = bytes(4)  # FINISH's payload: status code 0, no details


def _answer(request: ext_proc.ProcessingRequest) -> ext_proc.ProcessingResponse:
    kind = request.WhichOneof("request")
    if kind == "request_body":
        return ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse())
    if kind == "response_headers":
        return ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())
    return ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())


class _AioServicer(ext_proc_grpc.ExternalProcessorServicer):
    async def Process(
        self, requests: AsyncIterator[ext_proc.ProcessingRequest], context: Any
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        async for request in requests:
            yield _answer(request)


class _ThreadServicer(ext_proc_grpc.ExternalProcessorServicer):
    def Process(
        self, requests: Iterator[ext_proc.ProcessingRequest], context: Any
    ) -> Iterator[ext_proc.ProcessingResponse]:
        for request in requests:
            yield _answer(request)


async def _serve_frames(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The Unix socket variant's server: each stream's frames to a task of its own, which
    answers each message and ends the stream once the client's end has come."""
    streams: dict[int, asyncio.Queue[bytes | None]] = {}

    async def stream(stream_id: int, inbox: asyncio.Queue[bytes | None]) -> None:
        while (raw := await inbox.get()) is not None:
            answer = _answer(ext_proc.ProcessingRequest.FromString(raw)).SerializeToString()
            writer.write(FRAME.pack(stream_id, MESSAGE, len(answer)) + answer)
        writer.write(FRAME.pack(stream_id, FINISH, len(_OK)) + _OK)
        del streams[stream_id]

    while True:
        try:
            stream_id, kind, size = FRAME.unpack(await reader.readexactly(FRAME.size))
            payload = await reader.readexactly(size)
        except asyncio.IncompleteReadError:
            return
        inbox = streams.get(stream_id)
        if inbox is None:
            inbox = streams[stream_id] = asyncio.Queue()
            asyncio.get_running_loop().create_task(stream(stream_id, inbox))
        inbox.put_nowait(payload if kind == MESSAGE else None)


def _serve(kind: str) -> None:
    """The server side: ready line with its address, then serve until killed."""
    if kind == "unix":

        async def serve_unix() -> None:
            path = Path(tempfile.mkdtemp(prefix="isocost-floor-")) / "frames.sock"
            server = await asyncio.start_unix_server(_serve_frames, path)
            print(f"grpc floor: ready at {path}", flush=True)
            await server.serve_forever()

        uvloop.run(serve_unix())
        return
    if kind == "threads":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(_ThreadServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        print(f"grpc floor: ready at 127.0.0.1:{port}", flush=True)
        server.wait_for_termination()
        return

    async def serve_aio() -> None:
        aio = grpc.aio.server()
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(_AioServicer(), aio)
        port = aio.add_insecure_port("127.0.0.1:0")
        await aio.start()
        print(f"grpc floor: ready at 127.0.0.1:{port}", flush=True)
        await aio.wait_for_termination()

    uvloop.run(serve_aio())


async def _drive(address: str, messages: int, streams: int, concurrency: int) -> None:
    """``streams`` ext_proc streams, ``concurrency`` at a time, each message answered
    before the next is sent (as Envoy does for headers, body and response headers)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        left = streams

        async def client() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                call = stub.Process()
                for message in _MESSAGES[:messages]:
                    await call.write(message)
                    await call.read()
                await call.done_writing()
                await call.read()

        await asyncio.gather(*(client() for _ in range(concurrency)))


async def _drive_frames(path: str, streams: int, concurrency: int) -> None:
    """``_drive`` for the Unix socket variant: the three messages of each stream, each
    answered before the next, then its end, answered by the server's."""
    reader, writer = await asyncio.open_unix_connection(path)
    waiting: dict[int, asyncio.Future[int]] = {}

    async def receive() -> None:
        while True:
            stream_id, kind, size = FRAME.unpack(await reader.readexactly(FRAME.size))
            await reader.readexactly(size)
            waiting.pop(stream_id).set_result(kind)

    async def exchange(stream_id: int, kind: int, payload: bytes) -> int:
        waiting[stream_id] = asyncio.get_running_loop().create_future()
        writer.write(FRAME.pack(stream_id, kind, len(payload)) + payload)
        return await waiting[stream_id]

    ids = iter(range(streams))
    encoded = [message.SerializeToString() for message in _MESSAGES]

    async def client() -> None:
        for stream_id in ids:
            for raw in encoded:
                await exchange(stream_id, MESSAGE, raw)
            await exchange(stream_id, HALF_CLOSE, b"")

    receiver = asyncio.create_task(receive())
    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        receiver.cancel()
        writer.close()


def _measure(kind: str, messages: int, streams: int, concurrency: int) -> float:
    """The server's CPU µs per stream, after a warm-up of a fifth as many."""
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind], stdout=subprocess.PIPE, text=True
    )
    address = ""
    try:
        (address,) = ready_urls(server, "grpc floor")

        def drive(count: int) -> None:
            if kind == "unix":
                asyncio.run(_drive_frames(address, count, concurrency))
            else:
                asyncio.run(_drive(address, messages, count, concurrency))

        drive(max(streams // 5, 100))
        before = cpu_seconds(server.pid)
        drive(streams)
        return 1e6 * (cpu_seconds(server.pid) - before) / streams
    finally:
        server.kill()
        server.wait()
        if kind == "unix" and address:  # the socket's own directory
            shutil.rmtree(Path(address).parent, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=6000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--serve", choices=("aio", "threads", "unix"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve)
        return 0
    if args.streams < 1 or args.concurrency < 1 or args.rounds < 1:
        parser.error("--streams, --concurrency and --rounds must be at least 1")
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for kind, messages in _VARIANTS:
            cost = _measure(kind, messages, args.streams, args.concurrency)
            best[(kind, messages)] = min(best.get((kind, messages), cost), cost)
    table = Table(title=f"ext_proc server CPU per stream ({args.streams} streams)")
    for column in ("server", "messages each way", "CPU µs/stream", "× aio, 3"):
        table.add_column(column, justify="right")
    base = best[("aio", 3)]
    for (kind, messages), cost in best.items():
        table.add_row(kind, str(messages), f"{cost:.0f}", f"{cost / base:.2f}")
    Console().print(table)
    if args.json:
        rows = [
            {"server": kind, "messages": messages, "cpu_us_per_stream": round(cost, 1)}
            for (kind, messages), cost in best.items()
        ]
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    run_script(main)
