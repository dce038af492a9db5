"""What Python gRPC alone costs an ext_proc server per request: the floor under any picker.

``isocost picker`` answers each request over one ext_proc gRPC stream (request headers,
body, response headers: three messages each way). This serves that exchange from a
server that decides nothing (each message answered with an empty response of its kind) and
measures the server's CPU per stream (Linux ``/proc``, steadier than a rate on a shared
machine), for the picker's grpc.aio server (uvloop, as the picker runs) with 3, 2 or 1
messages per stream, and for grpc's thread-pool server with 3. ``--rounds`` alternates
the variants and keeps each one's lowest figure.

    .venv/bin/python benchmarks/grpc_floor.py --streams 6000 --json grpc_floor.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
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
_VARIANTS = (("aio", 3), ("aio", 2), ("aio", 1), ("threads", 3))


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


def _serve(kind: str) -> None:
    """The server side: ready line with its address, then serve until killed."""
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


def _measure(kind: str, messages: int, streams: int, concurrency: int) -> float:
    """The server's CPU µs per stream, after a warm-up of a fifth as many."""
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind], stdout=subprocess.PIPE, text=True
    )
    try:
        (address,) = ready_urls(server, "grpc floor")
        asyncio.run(_drive(address, messages, max(streams // 5, 100), concurrency))
        before = cpu_seconds(server.pid)
        asyncio.run(_drive(address, messages, streams, concurrency))
        return 1e6 * (cpu_seconds(server.pid) - before) / streams
    finally:
        server.kill()
        server.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=6000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--serve", choices=("aio", "threads"), help=argparse.SUPPRESS)
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
