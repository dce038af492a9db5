"""OpenTelemetry traces of the gateway's requests (``tracing:`` in the config).

Why: a platform team follows a slow request from its client, through the gateway's queue
and routing decision, to the replica that served it. With ``tracing`` each client request
is a SERVER span (named as GenAI's conventions name it, ``chat <model>`` or
``text_completion <model>``), continued from the client's W3C ``traceparent`` when it sent
one; each attempt on a replica is a CLIENT span beneath it, whose context goes to the
replica in ``traceparent``, so a vLLM started with ``--otlp-traces-endpoint`` joins the same
trace. The spans carry what the gateway knows of the request: the model, the API key's
name, token counts, the replica chosen, the prediction and the prefix hit, retries and
resumes, the status.

Spans leave through the SDK's batch processor (a thread of its own; the ``OTEL_BSP_*``
environment variables tune it) to an OTLP/HTTP collector, encoded as OTLP's JSON (the
protobuf exporter's ``opentelemetry-proto`` module files clash with ``xds-protos``'s, the
picker's, and whichever installs last wins): a collector that is down or slow
costs dropped spans and the SDK's log lines, never a request's time. Without ``tracing``
nothing is imported and each request pays for two empty context managers; the client's
``traceparent`` and ``tracestate`` are then passed to the replica as they came.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, NamedTuple

from isocost.openai.errors import ApiError
from isocost.runtime.config import TracingConfig, redacted

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

__all__ = ["RequestSpan", "Tracing"]

log = logging.getLogger("isocost.gateway")

_EXPORT_TIMEOUT_S = 5.0  # one export's HTTP timeout, and the flush's at shutdown
# The request log's fields that OpenTelemetry's conventions name (GenAI, HTTP, errors)
_CONVENTIONAL = {
    "pool": "gen_ai.request.model",
    "max_tokens": "gen_ai.request.max_tokens",
    "prompt_tokens": "gen_ai.usage.input_tokens",
    "output_tokens": "gen_ai.usage.output_tokens",
    "status": "http.response.status_code",
    "error": "error.type",
}


class RequestSpan(NamedTuple):
    """A client request's span and its GenAI operation (``chat``, ``text_completion``)."""

    span: Span
    operation: str


class Tracing:
    """The gateway's tracer, or nothing when ``config`` is None (see module docstring)."""

    def __init__(self, config: TracingConfig | None) -> None:
        self.config = config
        self._provider: TracerProvider | None = None
        self._tracer: Tracer | None = None
        if config is not None:
            self._provider, self._tracer = _tracer(config)
            log.info(
                "tracing: spans go to the OTLP collector",
                extra={"event": "tracing_on", "endpoint": redacted(config.otlp_endpoint)},
            )

    @contextlib.contextmanager
    def request(self, headers: Mapping[str, str], *, chat: bool) -> Iterator[RequestSpan | None]:
        """The SERVER span of one client request, current while it runs (None when off);
        an ApiError leaving it sets the span's status code."""
        if self._tracer is None:
            yield None
            return
        from opentelemetry import propagate, trace

        operation = "chat" if chat else "text_completion"
        with self._tracer.start_as_current_span(
            operation,
            context=propagate.extract(headers),
            kind=trace.SpanKind.SERVER,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            span.set_attribute("gen_ai.operation.name", operation)
            try:
                yield RequestSpan(span, operation)
            except ApiError as exc:
                span.set_attribute("http.response.status_code", exc.status)
                span.set_attribute("error.type", exc.code or str(exc.status))
                if exc.status >= 500:
                    span.set_status(trace.StatusCode.ERROR, exc.message)
                raise

    @contextlib.contextmanager
    def attempt(self, replica: str) -> Iterator[None]:
        """A CLIENT span for one attempt on ``replica``, current while it runs."""
        if self._tracer is None:
            yield
            return
        from opentelemetry import trace

        with self._tracer.start_as_current_span(
            f"POST {replica}", kind=trace.SpanKind.CLIENT
        ) as span:
            span.set_attribute("isocost.replica", replica)
            yield

    def inject(self, incoming: Mapping[str, str], outgoing: MutableMapping[str, str]) -> None:
        """The trace context for a request to a replica: the current span's when tracing,
        else the client's own ``traceparent`` and ``tracestate``, passed on."""
        if self._tracer is None:
            for name in ("traceparent", "tracestate"):
                if name in incoming:
                    outgoing[name] = incoming[name]
            return
        from opentelemetry import propagate

        propagate.inject(outgoing)

    def describe(self, traced: RequestSpan | None, record: Mapping[str, Any]) -> None:
        """The request's log ``record`` onto its span, once it ended: the fields GenAI's
        and HTTP's conventions name under their names, the others as ``isocost.<field>``
        (those without a value left out)."""
        if traced is None:
            return
        from opentelemetry import trace

        span, model = traced.span, record["pool"]
        span.update_name(f"{traced.operation} {model}")
        attributes = {
            _CONVENTIONAL.get(field, f"isocost.{field}"): value
            for field, value in record.items()
            if value is not None
        }
        span.set_attributes(attributes)
        if record["status"] >= 500:
            span.set_status(trace.StatusCode.ERROR, record.get("error") or str(record["status"]))

    def shutdown(self) -> None:
        """Send what is still queued (bounded by the export timeout) and stop."""
        if self._provider is not None:
            self._provider.force_flush(int(_EXPORT_TIMEOUT_S * 1000))
            self._provider.shutdown()


def _tracer(config: TracingConfig) -> tuple[TracerProvider, Tracer]:
    """A provider exporting to ``config``'s collector in batches; imported only here."""
    from opentelemetry.exporter.otlp.json.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        resource=Resource.create({"service.name": config.service_name}),
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
    )
    endpoint = config.otlp_endpoint.rstrip("/") + "/v1/traces"
    exporter = OTLPSpanExporter(endpoint=endpoint, timeout=_EXPORT_TIMEOUT_S)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider, provider.get_tracer("isocost.gateway")
