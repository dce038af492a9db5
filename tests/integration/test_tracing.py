"""OpenTelemetry traces of the gateway's requests, end to end: `isocost serve` with
`tracing:` exporting over OTLP/HTTP to a receiver that decodes the real protobuf
(`otlp_receiver`: no collector binary installs here), a fake upstream that records the
headers it got, and the official `openai` client.

Checked: a request sent with a W3C `traceparent` becomes a SERVER span in that trace,
child of the caller's span, named `text_completion <model>`, with the model, token
counts, replica and status; its attempt is a CLIENT span beneath it, and the replica got a
`traceparent` of the same trace whose parent is that attempt; a request without one starts
a trace of its own; with the collector gone, requests are answered as before; without
`tracing`, the caller's `traceparent` reaches the replica unchanged.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from fake_upstream import received, start_fake_upstream
from gateway_harness import wait_for
from isocost_procs import Proc, start_gateway_with
from otlp_receiver import OtlpReceiver, ReceivedSpan

SERVER, CLIENT = 2, 3  # the protobuf's SpanKind
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"


def gateway(tmp: Path, procs: list[Proc], upstream: Proc, tracing: str) -> Proc:
    config = f"""
pools:
  - model: fake-model
    replicas: [{{url: '{upstream.url}'}}]
{tracing}"""
    return start_gateway_with(config, tmp, procs)


def complete(target: Proc, headers: dict[str, str] | None = None) -> None:
    with openai.OpenAI(base_url=target.url + "/v1", api_key="none", max_retries=0) as client:
        answer = client.completions.create(
            model="fake-model", prompt="Trace me.", max_tokens=2, extra_headers=headers
        )
    assert answer.choices


def spans_of(receiver: OtlpReceiver, trace_id: str, count: int) -> list[ReceivedSpan]:
    def arrived() -> bool:
        return len([s for s in receiver.received() if s.trace_id == trace_id]) >= count

    wait_for(arrived, 10, f"{count} spans of trace {trace_id}", state=receiver.received)
    return [s for s in receiver.received() if s.trace_id == trace_id]


def test_a_request_is_a_span_in_the_callers_trace_and_the_replica_gets_its_context(
    tmp_path: Path, procs: list[Proc], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the SDK's batch period, ms
    upstream = start_fake_upstream()
    procs.append(upstream)
    with OtlpReceiver() as receiver:
        tracing = f"tracing: {{otlp_endpoint: '{receiver.url}', service_name: gw-test}}"
        target = gateway(tmp_path, procs, upstream, tracing)
        complete(target, {"traceparent": TRACEPARENT})
        spans = spans_of(receiver, TRACE_ID, 2)
        (server,) = [s for s in spans if s.kind == SERVER]
        (attempt,) = [s for s in spans if s.kind == CLIENT]
        assert server.service == "gw-test"
        assert server.name == "text_completion fake-model"
        assert server.parent_span_id == CALLER_SPAN
        assert attempt.parent_span_id == server.span_id
        replica = upstream.url.removeprefix("http://")
        assert server.attributes["isocost.replica"] == replica
        assert server.attributes["gen_ai.request.model"] == "fake-model"
        assert server.attributes["gen_ai.usage.output_tokens"] == 2
        assert server.attributes["gen_ai.usage.input_tokens"] > 0
        assert server.attributes["http.response.status_code"] == 200
        assert attempt.name == f"POST {replica}"
        sent = received(upstream.url)[-1]["headers"]
        assert sent["traceparent"] == f"00-{TRACE_ID}-{attempt.span_id}-01"

        complete(target)  # no traceparent: a trace of its own, the gateway's span its root

        def own() -> list[ReceivedSpan]:
            return [s for s in receiver.received() if s.trace_id != TRACE_ID and s.kind == SERVER]

        wait_for(lambda: bool(own()), 10, "the second request's span")
        assert own()[0].parent_span_id == ""

    # The collector is gone: spans are dropped, requests are not (8 clients at once)
    with ThreadPoolExecutor(8) as clients:
        list(clients.map(lambda _: complete(target, {"traceparent": TRACEPARENT}), range(32)))


def test_without_tracing_the_callers_context_reaches_the_replica(
    tmp_path: Path, procs: list[Proc]
) -> None:
    upstream = start_fake_upstream()
    procs.append(upstream)
    target = gateway(tmp_path, procs, upstream, "")
    complete(target, {"traceparent": TRACEPARENT, "tracestate": "vendor=1"})
    sent = received(upstream.url)[-1]["headers"]
    assert (sent["traceparent"], sent["tracestate"]) == (TRACEPARENT, "vendor=1")
