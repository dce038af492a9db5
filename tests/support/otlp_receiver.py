"""An OTLP/HTTP trace receiver for tests: what an OpenTelemetry collector's ``otlphttp``
receiver does with ``POST /v1/traces``, and nothing else.

No collector binary installs here (it ships neither in Debian nor on PyPI), so this server
speaks the real wire format instead: each body is decoded as the protobuf
``ExportTraceServiceRequest`` (``opentelemetry-proto``, the exporter's own package) and
answered with an empty ``ExportTraceServiceResponse``; a body that does not decode is a
400, as a collector answers it. The spans it got are kept as plain ``ReceivedSpan``\\ s.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: int  # the protobuf's SpanKind: 2 SERVER, 3 CLIENT
    trace_id: str  # hex, as traceparent writes it
    span_id: str
    parent_span_id: str  # "" for a root span
    status_code: int  # 0 unset, 1 ok, 2 error
    attributes: dict[str, Any] = field(default_factory=dict)


class OtlpReceiver:
    """``with OtlpReceiver() as receiver``: listening on 127.0.0.1 at ``receiver.url``."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces":
                    self._answer(404, b"")
                    return
                try:
                    export = ExportTraceServiceRequest.FromString(body)
                except DecodeError:
                    self._answer(400, b"")
                    return
                receiver._take(export)
                self._answer(200, ExportTraceServiceResponse().SerializeToString())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening (a collector gone)."""
        self._server.shutdown()
        self._server.server_close()

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def _take(self, export: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in export.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            status_code=span.status.code,
                            attributes=_attributes(span.attributes),
                        )
                    )
        with self._lock:
            self.exports += 1
            self.spans.extend(spans)


def _attributes(pairs: Any) -> dict[str, Any]:
    """OTLP ``KeyValue``\\ s as a dict of plain values."""
    out: dict[str, Any] = {}
    for pair in pairs:
        value = pair.value
        which = value.WhichOneof("value")
        out[pair.key] = getattr(value, which) if which else None
    return out
