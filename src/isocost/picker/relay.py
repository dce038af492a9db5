"""The picker's side of ``isocost-extproc-relay`` (``native/extproc_relay.cc``).

Python's gRPC costs the picker about 470 µs of CPU per ext_proc stream before it decides
anything (``benchmarks/grpc_floor.py``). With ``isocost picker --relay BINARY`` a native
process speaks gRPC to Envoy instead and passes every call on, as frames on one Unix
socket, to the same handlers: ``Processor.Process`` for ext_proc and the health servicer's
``Check`` and ``Watch``; the same frames cost Python about 30 µs a stream.

A frame is a header (``FRAME``: stream id, kind, payload length, little-endian) and its
payload. The relay sends ``OPEN`` (the method path), ``MESSAGE`` (a request message as
Envoy sent it), ``HALF_CLOSE`` and ``CANCEL`` (the call is gone: its handler is
cancelled); this side answers ``MESSAGE`` (a response message) and ``FINISH`` (the status
code as u32, then the details). A method neither service has is ``UNIMPLEMENTED``.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from isocost.picker.extproc import PROCESS_METHOD, Processor

__all__ = ["FRAME", "RelayServer"]

log = logging.getLogger("isocost.picker")

FRAME = struct.Struct("<QBI")
OPEN, MESSAGE, HALF_CLOSE, CANCEL, FINISH = 1, 2, 3, 4, 5
_HEALTH = "/grpc.health.v1.Health/"
_CODE = struct.Struct("<I")
_HealthMethod = Callable[[health_pb2.HealthCheckRequest, "Call"], Awaitable[object]]


class _Aborted(Exception):
    """A handler ended its call with a status (``Call.abort``)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class Call:
    """One relayed gRPC call, as its handler sees it: the request messages, and the
    parts of a servicer context the picker's handlers use."""

    def __init__(self, stream_id: int, send: Callable[[int, int, bytes], None]) -> None:
        self.stream_id = stream_id
        self.inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.code = grpc.StatusCode.OK
        self.details = ""
        self._send = send

    async def requests(self) -> AsyncIterator[bytes]:
        """The request messages until the client's half-close."""
        while (raw := await self.inbox.get()) is not None:
            yield raw

    async def request(self) -> bytes | None:
        """The one request message of a unary or server-streaming call (None: none)."""
        return await self.inbox.get()

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise _Aborted(code, details)

    async def write(self, message: Message) -> None:
        self._send(self.stream_id, MESSAGE, message.SerializeToString())


class RelayServer:
    """Serves the relay's connection: each call to a task of its own (module docstring)."""

    def __init__(self, processor: Processor, health: HealthServicer) -> None:
        self.processor = processor
        self.health = health
        self._health_methods: dict[str, _HealthMethod] = {
            _HEALTH + "Check": self._check,
            _HEALTH + "Watch": health.Watch,
        }
        self._calls: dict[int, tuple[Call, asyncio.Task[None]]] = {}
        self._writer: asyncio.StreamWriter | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The relay's connection, until it closes (a second one is refused)."""
        if self._writer is not None:
            writer.close()
            return
        self._writer = writer
        try:
            while True:
                try:
                    header = await reader.readexactly(FRAME.size)
                    stream_id, kind, size = FRAME.unpack(header)
                    payload = await reader.readexactly(size)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                self._received(stream_id, kind, payload)
        finally:
            for _, task in self._calls.values():
                task.cancel()
            writer.close()

    def _received(self, stream_id: int, kind: int, payload: bytes) -> None:
        if kind == OPEN:
            call = Call(stream_id, self._send)
            method = payload.decode("utf-8", "replace")
            task = asyncio.get_running_loop().create_task(self._run(call, method))
            self._calls[stream_id] = (call, task)
            return
        entry = self._calls.get(stream_id)
        if entry is None:  # finished here already
            return
        call, task = entry
        if kind == MESSAGE:
            call.inbox.put_nowait(payload)
        elif kind == HALF_CLOSE:
            call.inbox.put_nowait(None)
        elif kind == CANCEL:
            task.cancel()

    def _send(self, stream_id: int, kind: int, payload: bytes) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(FRAME.pack(stream_id, kind, len(payload)) + payload)

    async def _run(self, call: Call, method: str) -> None:
        """Run the call's handler; answer its status, unless the call is gone."""
        try:
            await self._handle(call, method)
        except _Aborted as exc:
            call.code, call.details = exc.code, exc.details
        except asyncio.CancelledError:
            return  # the relay finished the call itself
        except Exception:  # a bug: answered as grpc.aio answers it, and logged
            log.exception("relayed call failed", extra={"event": "relay_call_failed"})
            call.code, call.details = grpc.StatusCode.UNKNOWN, "unexpected error"
        finally:
            self._calls.pop(call.stream_id, None)
        status = _CODE.pack(call.code.value[0]) + call.details.encode()
        self._send(call.stream_id, FINISH, status)

    async def _handle(self, call: Call, method: str) -> None:
        if method == PROCESS_METHOD:
            async for response in self.processor.Process(call.requests(), call):
                await call.write(response)
            return
        handler = self._health_methods.get(method)
        if handler is None:
            raise _Aborted(grpc.StatusCode.UNIMPLEMENTED, f"no method {method}")
        raw = await call.request()
        try:
            request = health_pb2.HealthCheckRequest.FromString(raw or b"")
        except DecodeError:
            raise _Aborted(grpc.StatusCode.INVALID_ARGUMENT, "not a HealthCheckRequest") from None
        await handler(request, call)

    async def _check(self, request: health_pb2.HealthCheckRequest, call: Call) -> None:
        await call.write(await self.health.Check(request, call))
