"""Envoy's ``ext_proc`` protocol as GAIE's endpoint picker speaks it (proposal 004, v1).

One gRPC stream is one HTTP request. Envoy sends its headers, then its body; the picker
answers, once the body is whole, with the chosen ``ip:port`` (then its fallbacks, comma
separated: GAIE v0.4) in header ``x-gateway-destination-endpoint`` and the same value in
``envoy.lb`` dynamic metadata, and clears the route cache so that Envoy routes on it.
The first message's ``protocol_config`` tells how the body comes: ``STREAMED`` with
``send_body_without_waiting_for_header_response`` (the chunks come at once and are held;
the pick answers the headers once the body is whole, then each chunk gets its answer: one
round trip), ``FULL_DUPLEX_STREAMED`` (the same, and the body is streamed back), or
``BUFFERED`` (the whole body after the headers' answer, the pick in the body's: two). A
request refused or that nothing can take is answered by Envoy as an ImmediateResponse
(OpenAI-style JSON, ``Retry-After`` on 429 and 503). The response headers carry
``x-gateway-destination-endpoint-served`` (a header or ``envoy.lb`` metadata) and get
``x-isocost-replica`` and, for an API key with budgets, OpenAI's ``x-ratelimit-*`` (a
refusal too); the end of the stream is the end of the request. A grant whose answer is
to be metered (``Granted.meter``) has the pick set ``x-isocost-meter`` to its shape; the
data plane's route for it runs a second ext_proc filter in observability mode, whose
stream (``observability_mode`` set) passes the answer's body on without waiting for an
answer, and is answered with nothing: the brain's meter counts it and charges the key
as the body ends. Every other answer's body goes by without the picker. The subset hint
(``envoy.lb.subset_hint`` filter metadata) bounds the choice. A body that grows past the
brain's limit is refused (413) as soon as it does, not held to its end. One stream picks
at most once: what Envoy sends for the request after the pick is answered, never picked
again, so one stream never holds two grants. A message that is no ``ProcessingRequest``
ends the stream with ``INVALID_ARGUMENT``. A request the brain splits
into a prefill and a decode (P/D disaggregation) goes to the decode replica with the
prefill replica's ``ip:port`` in ``x-prefiller-host-port`` (llm-d's convention: the
decode side's sidecar runs the prefill step there); any other request has a client's
own ``x-prefiller-host-port`` removed.

The decisions are the brain's (``Brain``): this module knows the wire, nothing of policies.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Protocol

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError
from multidict import CIMultiDict

from isocost.openai.errors import ApiError, retry_after

__all__ = [
    "DESTINATION_HEADER",
    "METER_HEADER",
    "PREFILLER_HEADER",
    "PROCESS_METHOD",
    "REPLICA_HEADER",
    "SERVED_KEY",
    "SUBSET_KEY",
    "Brain",
    "CallStatus",
    "Granted",
    "Meter",
    "Processor",
    "add_processor",
]

log = logging.getLogger("isocost.picker")

DESTINATION_HEADER = "x-gateway-destination-endpoint"
PREFILLER_HEADER = "x-prefiller-host-port"  # llm-d: where the decode's prefill step goes
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
REPLICA_HEADER = "x-isocost-replica"
METER_HEADER = "x-isocost-meter"  # set by a pick whose answer is metered: its shape
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_STREAMED = processing_mode_pb2.ProcessingMode.STREAMED
_SERVICE = ext_proc.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
PROCESS_METHOD = f"/{_SERVICE}/Process"  # the gRPC method path a relay names
# The answer that changes nothing, for each kind of message Envoy sends.
_PLAIN = {
    "request_headers": ext_proc.HeadersResponse,
    "request_body": ext_proc.BodyResponse,
    "request_trailers": ext_proc.TrailersResponse,
    "response_headers": ext_proc.HeadersResponse,
    "response_body": ext_proc.BodyResponse,
    "response_trailers": ext_proc.TrailersResponse,
}
_REQUEST_SIDE = frozenset({"request_headers", "request_body", "request_trailers"})


class Granted(Protocol):
    """A replica granted to one request, told how the request goes on."""

    @property
    def endpoints(self) -> tuple[str, ...]: ...  # ip:port, the choice first

    @property
    def replica(self) -> str: ...  # its name, for ``x-isocost-replica``

    @property
    def key_headers(self) -> Mapping[str, str]: ...  # its API key's x-ratelimit-*, now

    @property
    def prefill_endpoint(self) -> str | None: ...  # ip:port of P when split, else None

    @property
    def meter(self) -> str | None: ...  # the answer's shape when it is to be metered

    def responded(self, status: int, served: str | None) -> None: ...

    def ended(self) -> None: ...


class Brain(Protocol):
    """What decides: the gateway's runtime (``isocost.gateway.picking``)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def ready(self) -> bool: ...

    def reload_requested(self) -> None: ...  # SIGHUP: the config file read again now

    def check_body_size(self, size: int) -> None: ...  # ApiError (413) past the body limit

    def meter(self, shape: str, headers: Mapping[str, str]) -> Meter | None: ...

    async def pick(
        self,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        subset: frozenset[str] | None,
    ) -> Granted: ...


class Meter(Protocol):
    """Counts one answer's output as its body passes (an observing stream's)."""

    def feed(self, chunk: bytes, end_of_stream: bool) -> None: ...

    def ended(self) -> None: ...


class CallStatus(Protocol):
    """What ``Processor.Process`` sets of its call's status: a grpc.aio servicer
    context, or a relayed call's (``picker.relay``)."""

    def set_code(self, code: grpc.StatusCode) -> None: ...

    def set_details(self, details: str) -> None: ...


class Processor:
    """The ``ExternalProcessor`` service over one brain (served by ``add_processor``, or
    through a relay)."""

    def __init__(self, brain: Brain) -> None:
        self.brain = brain

    async def Process(  # the gRPC method's name
        self, requests: AsyncIterator[bytes], context: CallStatus
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        """One request's stream; its messages come as bytes, decoded here so that one
        that is no ``ProcessingRequest`` is answered, not left to grpc's traceback."""
        exchange = _Exchange(self.brain)
        try:
            async for raw in requests:
                message = _decoded(raw)
                if message is None:
                    context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                    context.set_details("not an ext_proc ProcessingRequest")
                    return
                for response in await exchange.answer(message):
                    yield response
                    if response.HasField("immediate_response"):
                        return
        finally:
            exchange.close()


def add_processor(processor: Processor, server: grpc.aio.Server) -> None:
    """Serve ``processor`` on ``server`` with the requests left as bytes: grpc's own
    decoding of a corrupt message fails outside any handler (an error log with a traceback,
    status UNKNOWN)."""
    method = grpc.stream_stream_rpc_method_handler(
        processor.Process, response_serializer=ext_proc.ProcessingResponse.SerializeToString
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(_SERVICE, {"Process": method}),)
    )


def _decoded(raw: bytes) -> ext_proc.ProcessingRequest | None:
    """``raw`` as Envoy's message; None, with a warning, when it is none: undecodable, or
    carrying no request of a kind this side knows."""
    try:
        message = ext_proc.ProcessingRequest.FromString(raw)
    except DecodeError as exc:
        log.warning(
            "undecodable ext_proc message", extra={"event": "bad_message", "error": str(exc)}
        )
        return None
    if message.WhichOneof("request") is None:
        log.warning("ext_proc message without a request", extra={"event": "bad_message"})
        return None
    return message


class _Exchange:
    """One HTTP request's conversation: its headers, its body, its response."""

    def __init__(self, brain: Brain) -> None:
        self.brain = brain
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.body = bytearray()
        self.subset: frozenset[str] | None = None
        self.granted: Granted | None = None
        self.full_duplex = False  # the body comes back to Envoy through us, streamed
        self.eager_body = False  # Envoy sends the body without waiting for our headers' answer
        self.chunks_held = 0  # eager STREAMED body chunks not answered yet: one answer each
        self.meter: Meter | None = None  # an observing stream's, for a metered answer

    async def answer(
        self, message: ext_proc.ProcessingRequest
    ) -> list[ext_proc.ProcessingResponse]:
        """The answers ``message`` calls for: none while a body sent eagerly is still
        arriving; when it completes, the pick and whatever else is owed."""
        kind = message.WhichOneof("request")
        if message.observability_mode:  # nothing to answer: Envoy does not wait
            self._observe(kind, message)
            return []
        if kind in _REQUEST_SIDE and self.granted is not None:
            return [_plain(kind)]  # past the pick: answered, never picked again
        if kind == "request_headers":
            self.headers = _header_map(message.request_headers.headers.headers)
            self.subset = _subset_hint(message.metadata_context)
            protocol = message.protocol_config
            self.full_duplex = protocol.request_body_mode == _FULL_DUPLEX
            self.eager_body = self.full_duplex or (
                protocol.request_body_mode == _STREAMED
                and protocol.send_body_without_waiting_for_header_response
            )
            if message.request_headers.end_of_stream:
                return [await self._pick(body_follows=False)]
            return [] if self.eager_body else [_plain(kind)]
        if kind == "request_body":
            self.body += message.request_body.body
            try:
                self.brain.check_body_size(len(self.body))
            except ApiError as exc:  # refused now, before more of it is held
                return [_immediate(exc)]
            if self.eager_body and not self.full_duplex:
                self.chunks_held += 1
            if message.request_body.end_of_stream:
                return await self._body_complete(trailers_follow=False)
            return [] if self.eager_body else [_plain(kind)]
        if kind == "request_trailers" and self.eager_body:  # the trailers end the body
            return [*await self._body_complete(trailers_follow=True), _plain(kind)]
        if kind == "response_headers":
            return [self._responded(message)]
        return [_plain(kind)]

    def _observe(self, kind: str | None, message: ext_proc.ProcessingRequest) -> None:
        """An observing stream's message: its request headers name the meter (a pick's
        ``x-isocost-meter`` and the caller's key), its response body feeds it."""
        if kind == "request_headers" and self.meter is None:
            headers = _header_map(message.request_headers.headers.headers)
            shape = headers.get(METER_HEADER)
            if shape is not None:
                self.meter = self.brain.meter(shape, headers)
        elif kind == "response_body" and self.meter is not None:
            self.meter.feed(message.response_body.body, message.response_body.end_of_stream)

    async def _body_complete(self, *, trailers_follow: bool) -> list[ext_proc.ProcessingResponse]:
        """The pick once the body is whole, then what else is owed: the body streamed back
        (full duplex) or one answer per body chunk held back (streamed, sent eagerly)."""
        picked = await self._pick(body_follows=not self.eager_body)
        if picked.HasField("immediate_response"):
            return [picked]
        if self.full_duplex:
            echo = ext_proc.BodyMutation(
                streamed_response=ext_proc.StreamedBodyResponse(
                    body=bytes(self.body), end_of_stream=not trailers_follow
                )
            )
            body = ext_proc.BodyResponse(response=ext_proc.CommonResponse(body_mutation=echo))
            return [picked, ext_proc.ProcessingResponse(request_body=body)]
        return [picked, *([_plain("request_body")] * self.chunks_held)]  # none when buffered

    async def _pick(self, *, body_follows: bool) -> ext_proc.ProcessingResponse:
        """The decision, in the answer that may still change the request's headers: the
        body's when the headers were answered already (``body_follows``), else the
        headers' (a body sent eagerly, or a request without one)."""
        path = _quotable(self.headers.get(":path", ""))
        try:
            self.granted = await self.brain.pick(path, self.headers, bytes(self.body), self.subset)
        except ApiError as exc:
            return _immediate(exc)
        endpoints = ",".join(self.granted.endpoints)
        prefill = self.granted.prefill_endpoint
        chosen = {DESTINATION_HEADER: endpoints}  # the same value as the metadata's
        if prefill is not None:
            chosen[PREFILLER_HEADER] = prefill
        if self.granted.meter is not None:
            chosen[METER_HEADER] = self.granted.meter
        mutation = _set_headers(chosen)
        for name in (PREFILLER_HEADER, METER_HEADER):  # a client's own: not trusted
            if name not in chosen:
                mutation.remove_headers.append(name)
        common = ext_proc.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: endpoints}})
        if body_follows:
            return ext_proc.ProcessingResponse(
                request_body=ext_proc.BodyResponse(response=common), dynamic_metadata=metadata
            )
        return ext_proc.ProcessingResponse(
            request_headers=ext_proc.HeadersResponse(response=common),
            dynamic_metadata=metadata,
        )

    def _responded(self, message: ext_proc.ProcessingRequest) -> ext_proc.ProcessingResponse:
        headers = _header_map(message.response_headers.headers.headers)
        granted = self.granted
        if granted is None:  # no pick on this stream: Envoy sent no body (body mode NONE)
            return _plain("response_headers")
        served = headers.get(SERVED_KEY) or _served(message.metadata_context)
        try:
            status = int(headers.get(":status", "0"))
        except ValueError:
            status = 0
        granted.responded(status, served)
        common = ext_proc.CommonResponse(
            header_mutation=_set_headers({REPLICA_HEADER: granted.replica, **granted.key_headers})
        )
        return ext_proc.ProcessingResponse(
            response_headers=ext_proc.HeadersResponse(response=common)
        )

    def close(self) -> None:
        """The stream ended: Envoy is done with the request, answered or not."""
        if self.meter is not None:
            self.meter.ended()
            self.meter = None
        if self.granted is not None:
            self.granted.ended()
            self.granted = None


def _header_map(headers: Iterable[base_pb2.HeaderValue]) -> CIMultiDict[str]:
    """Envoy's headers (``raw_value`` bytes, or the older ``value``), as text; bytes
    that are no UTF-8 stay surrogates, which the intake refuses as unprintable."""
    out: CIMultiDict[str] = CIMultiDict()
    for header in headers:
        value = (
            header.raw_value.decode("utf-8", "surrogateescape")
            if header.raw_value
            else header.value
        )
        out.add(header.key, value)
    return out


def _quotable(text: str) -> str:
    """``text`` with the bytes that were no UTF-8 (surrogates, see ``_header_map``) written
    as ``\\xff``: an error may quote it (the 404 for an unknown path), and JSON cannot
    carry surrogates."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _plain(kind: str) -> ext_proc.ProcessingResponse:
    """The answer to a message of ``kind`` that changes nothing."""
    return ext_proc.ProcessingResponse(**{kind: _PLAIN[kind]()})


def _set_headers(values: Mapping[str, str]) -> ext_proc.HeaderMutation:
    return ext_proc.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
                append_action=_OVERWRITE,
            )
            for name, value in values.items()
        ]
    )


def _subset_hint(context: base_pb2.Metadata) -> frozenset[str] | None:
    """GAIE's subset hint: the only endpoints the request may go to; None: any."""
    namespace = context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return frozenset(item.string_value for item in value.list_value.values)
    return frozenset(part.strip() for part in value.string_value.split(",") if part.strip())


def _served(context: base_pb2.Metadata) -> str | None:
    namespace = context.filter_metadata.get(LB_NAMESPACE)
    if namespace is None or SERVED_KEY not in namespace.fields:
        return None
    return namespace.fields[SERVED_KEY].string_value or None


def _immediate(error: ApiError) -> ext_proc.ProcessingResponse:
    """``error`` as Envoy's local reply: OpenAI-style JSON with its status."""
    headers = {"content-type": "application/json", **error.headers}
    seconds = retry_after(error)
    if seconds is not None:
        headers["retry-after"] = seconds
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),
            headers=_set_headers(headers),
            body=error.encode(),
            details=error.code or "isocost_picker",
        )
    )
