"""The picker's ext_proc stream (``Processor.Process``) over a fake brain, message by message.

What raw gRPC clients (or a confused Envoy) can send that Envoy itself does not: messages
after the pick, a body without end, bytes that are no ``ProcessingRequest``, a path that
is no UTF-8. The brain here counts its picks and the grants still held, so a leak shows.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping, Sequence

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from isocost.openai.errors import ApiError
from isocost.picker.extproc import Processor

LIMIT = 1000  # the fake brain's body limit, bytes
BODY = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()
EAGER = ext_proc.ProtocolConfiguration(
    request_body_mode=processing_mode_pb2.ProcessingMode.STREAMED,
    send_body_without_waiting_for_header_response=True,
)
BUFFERED = ext_proc.ProtocolConfiguration(
    request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED
)
ANSWERED = ext_proc.ProtocolConfiguration(  # STREAMED, each chunk after the headers' answer
    request_body_mode=processing_mode_pb2.ProcessingMode.STREAMED
)


class _Grant:
    endpoints = ("10.0.0.1:8000",)
    replica = "r0"
    prefill_endpoint = None

    def __init__(self, brain: _Brain) -> None:
        self.brain = brain
        self.meter = brain.shape  # its answer's, when metered

    def responded(self, status: int, served: str | None) -> None:
        pass

    def ended(self) -> None:
        self.brain.held -= 1


class _Brain:
    """Picks ``/v1/completions`` only (404 quoting the path otherwise, as the gateway's
    brain does); counts picks and grants held."""

    def __init__(self, shape: str | None = None) -> None:
        self.picks = 0
        self.held = 0
        self.shape = shape  # its grants' answers are metered, and come so
        self.meters: list[_Meter] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def reload_requested(self) -> None:
        pass

    def check_body_size(self, size: int) -> None:
        if size > LIMIT:
            raise ApiError(413, f"request body exceeds {LIMIT} bytes", code="request_too_large")

    async def pick(
        self, path: str, headers: Mapping[str, str], body: bytes, subset: frozenset[str] | None
    ) -> _Grant:
        self.picks += 1
        if path != "/v1/completions":
            raise ApiError(404, f"{path} is not routed here", code="not_found")
        self.held += 1
        return _Grant(self)

    def meter(self, shape: str, headers: Mapping[str, str]) -> _Meter | None:
        if headers.get("authorization") != "Bearer sk-budget":
            return None
        self.meters.append(_Meter(shape))
        return self.meters[-1]


class _Meter:
    def __init__(self, shape: str) -> None:
        self.shape = shape
        self.fed: list[tuple[bytes, bool]] = []
        self.ends = 0

    def feed(self, chunk: bytes, end_of_stream: bool) -> None:
        self.fed.append((chunk, end_of_stream))

    def ended(self) -> None:
        self.ends += 1


class _Context:
    """What ``Process`` tells grpc of the stream's status."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


class _Run:
    """One stream through ``Processor.Process``: its answers, its status, and how many of
    the messages it read."""

    def __init__(self, brain: _Brain, messages: Sequence[ext_proc.ProcessingRequest | bytes]):
        self.context = _Context()
        self.read = 0

        async def requests() -> AsyncIterator[bytes]:
            for message in messages:
                self.read += 1
                yield message if isinstance(message, bytes) else message.SerializeToString()

        async def answers() -> list[ext_proc.ProcessingResponse]:
            return [a async for a in Processor(brain).Process(requests(), self.context)]

        self.answers = asyncio.run(answers())

    def kinds(self) -> list[str]:
        return [str(answer.WhichOneof("response")) for answer in self.answers]


def _headers(
    protocol: ext_proc.ProtocolConfiguration | None = EAGER,
    *,
    path: bytes = b"/v1/completions",
    end: bool = False,
    extra: Sequence[tuple[str, bytes]] = (),
) -> ext_proc.ProcessingRequest:
    values = [(":method", b"POST"), (":path", path), *extra]
    headers = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in values]
    )
    return ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(headers=headers, end_of_stream=end),
        protocol_config=protocol,
    )


def _body(data: bytes = BODY, *, end: bool = True) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=data, end_of_stream=end))


_TRAILERS = ext_proc.ProcessingRequest(request_trailers=ext_proc.HttpTrailers())


@pytest.mark.parametrize(
    "messages",
    [
        [_headers(), _body(), _body(b"")],
        [_headers(BUFFERED), _body(), _body(b"")],
        [_headers(end=True), _headers(end=True)],
        [_headers(), _body(), _headers(), _body()],
        [_headers(), _body(end=False), _TRAILERS, _body(b"")],
    ],
    ids=["eager", "buffered", "headers-only", "headers-again", "after-trailers"],
)
def test_a_stream_picks_once_and_releases_its_grant(
    messages: list[ext_proc.ProcessingRequest],
) -> None:
    """Request messages after the pick are answered, not picked again: one grant per
    stream, released when the stream ends."""
    brain = _Brain()
    run = _Run(brain, messages)
    assert brain.picks == 1 and brain.held == 0
    assert run.read == len(messages) and run.context.code is None
    assert "immediate_response" not in run.kinds()


def test_extra_body_after_the_pick_gets_a_plain_answer() -> None:
    """Eager STREAMED: the pick in the headers' answer, one answer for the body chunk,
    then one for the spurious chunk, changing nothing."""
    run = _Run(_Brain(), [_headers(), _body(), _body(b"")])
    assert run.kinds() == ["request_headers", "request_body", "request_body"]
    assert not run.answers[2].request_body.HasField("response")


def _observed(message: ext_proc.ProcessingRequest) -> ext_proc.ProcessingRequest:
    """``message`` as a filter in observability mode sends it."""
    message.observability_mode = True
    return message


def _response_body(data: bytes, *, end: bool) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=data, end_of_stream=end))


@pytest.mark.parametrize("shape", ["stream", None])
def test_a_metered_pick_marks_the_request_and_a_client_cannot(shape: str | None) -> None:
    """The pick sets ``x-isocost-meter`` to the answer's shape when the grant is metered,
    and removes a client's own otherwise."""
    run = _Run(_Brain(shape), [_headers(extra=[("x-isocost-meter", b"whole")]), _body()])
    mutation = run.answers[0].request_headers.response.header_mutation
    set_headers = {h.header.key: h.header.raw_value for h in mutation.set_headers}
    if shape is None:
        assert "x-isocost-meter" not in set_headers
        assert "x-isocost-meter" in mutation.remove_headers
    else:
        assert set_headers["x-isocost-meter"] == shape.encode()
        assert "x-isocost-meter" not in mutation.remove_headers


def test_an_observing_stream_feeds_its_meter_and_is_never_answered() -> None:
    """Observability mode: Envoy does not wait, so nothing is answered; the request
    headers (the pick's mark, the caller's key) name the meter, which gets every body
    chunk and is ended with the stream, once. Unmarked, or with a key the brain meters
    nothing for, nothing is fed; no pick either way."""
    key = [("authorization", b"Bearer sk-budget")]
    chunks = [
        _observed(_response_body(b"data: {}\n\n", end=False)),
        _observed(_response_body(b"", end=True)),
    ]
    brain = _Brain()
    marked = _headers(None, end=True, extra=[("x-isocost-meter", b"stream"), *key])
    run = _Run(brain, [_observed(marked), *chunks])
    assert run.answers == [] and run.read == 3 and run.context.code is None
    (meter,) = brain.meters
    assert meter.shape == "stream" and meter.ends == 1
    assert meter.fed == [(b"data: {}\n\n", False), (b"", True)]
    for extra in ([("x-isocost-meter", b"stream")], key):  # another key; no mark
        _Run(brain, [_observed(_headers(None, end=True, extra=extra)), *chunks])
    assert len(brain.meters) == 1 and brain.picks == 0


@pytest.mark.parametrize(
    "protocol", [EAGER, ANSWERED, BUFFERED], ids=["eager", "answered", "buffered"]
)
def test_a_body_past_the_limit_is_refused_at_once(
    protocol: ext_proc.ProtocolConfiguration,
) -> None:
    """The 413 comes with the chunk that passes the limit, not at the body's end: the
    stream ends there, nothing more read, no pick."""
    brain = _Brain()
    chunk = _body(b"x" * (LIMIT // 2), end=False)
    run = _Run(brain, [_headers(protocol), chunk, chunk, chunk, chunk, _body(b"")])
    assert run.read == 4  # the headers and three chunks: the third passed the limit
    refused = run.answers[-1].immediate_response
    assert refused.status.code == 413
    assert json.loads(refused.body)["error"]["code"] == "request_too_large"
    assert brain.picks == 0 and brain.held == 0


@pytest.mark.parametrize(
    "raw", [b"\xff\xff\xff\xff garbage", _headers().SerializeToString()[:-3], b""]
)
def test_a_message_that_is_no_request_ends_the_stream_invalid(
    raw: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Undecodable bytes (or a message carrying no request): INVALID_ARGUMENT and one
    warning, no exception; a grant already held is released."""
    brain = _Brain()
    with caplog.at_level(logging.WARNING, logger="isocost.picker"):
        run = _Run(brain, [_headers(end=True), raw, _body()])
    assert run.context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert run.read == 2 and brain.held == 0
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert caplog.records[0].exc_info is None


def test_a_path_that_is_no_utf8_is_quoted_escaped() -> None:
    """The 404 quotes the path with its non-UTF-8 bytes escaped: JSON cannot carry them."""
    run = _Run(_Brain(), [_headers(path=b"/v1/\xff"), _body()])
    (refused,) = run.answers
    assert refused.immediate_response.status.code == 404
    message = json.loads(refused.immediate_response.body)["error"]["message"]
    assert message.startswith("/v1/\\xff ")
