"""An OTLP/HTTP trace receiver for tests: what an OpenTelemetry collector's ``otlphttp``
receiver does with ``POST /v1/traces`` in OTLP's JSON encoding, and nothing else.

No collector binary installs here (it ships neither in Debian nor on PyPI), so this server
speaks the real wire format instead (the OTLP specification's JSON mapping of
``ExportTraceServiceRequest``: ``resourceSpans`` / ``scopeSpans`` / ``spans``, ids in hex,
attribute values tagged by type, a gzip body when ``Content-Encoding`` says so); a body
that is not such a request is a 400, as a collector answers it, and an accepted one gets
the empty ``ExportTraceServiceResponse``, ``{}``. The spans it got are kept as plain
``ReceivedSpan``\\ s.
"""

from __future__ import annotations

import gzip
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SPAN_KINDS = {"SPAN_KIND_SERVER": 2, "SPAN_KIND_CLIENT": 3}  # the enum's JSON names


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
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces":
                    self._answer(404, b"")
                    return
                try:
                    if self.headers.get("Content-Encoding") == "gzip":
                        body = gzip.decompress(body)
                    spans = _spans(json.loads(body))
                except (OSError, ValueError, KeyError, TypeError):
                    self._answer(400, b"")
                    return
                with receiver._lock:
                    receiver.spans.extend(spans)
                self._answer(200, b"{}")

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
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


def _spans(export: dict[str, Any]) -> list[ReceivedSpan]:
    """The spans of one ``ExportTraceServiceRequest`` in OTLP/JSON."""
    spans = []
    for resource_spans in export["resourceSpans"]:
        resource = _attributes(resource_spans.get("resource", {}).get("attributes", []))
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                kind = span.get("kind", 0)
                spans.append(
                    ReceivedSpan(
                        service=str(resource.get("service.name", "")),
                        name=span["name"],
                        kind=SPAN_KINDS.get(kind, kind) if isinstance(kind, str) else kind,
                        trace_id=_hex(span["traceId"], 32),
                        span_id=_hex(span["spanId"], 16),
                        parent_span_id=span.get("parentSpanId") or "",
                        status_code=span.get("status", {}).get("code", 0),
                        attributes=_attributes(span.get("attributes", [])),
                    )
                )
    return spans


def _hex(value: str, digits: int) -> str:
    """An id as OTLP/JSON writes it: ``digits`` lowercase hex digits, else ValueError."""
    if len(value) != digits or int(value, 16) < 0:
        raise ValueError(f"not a {digits}-digit hex id: {value!r}")
    return value.lower()


def _attributes(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """OTLP ``KeyValue``\\ s as a dict of plain values (64-bit ints come as strings)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        ((kind, value),) = pair["value"].items()
        out[pair["key"]] = int(value) if kind == "intValue" else value
    return out
