"""One protocol suite, run against ``isocost engine`` and a real vLLM replica alike.

It pins down what the gateway and OpenAI clients rely on: SSE framing ending in
``data: [DONE]``, the usage chunk of ``stream_options.include_usage``, ``finish_reason``,
error status codes and the error object's shape, ``/v1/models``, and the ``/metrics``
names, types and movements the gateway reads. Where vLLM and the simulator deliberately
differ, the test says so in one place:

* error objects: both carry ``message``, ``type``, ``param`` and ``code``; the simulator
  fills ``type``/``code`` the OpenAI way (``invalid_request_error``, ``"model_not_found"``),
  vLLM puts its exception class in ``type`` and the HTTP status in ``code``; vLLM names
  pydantic-checked fields ``body.<field>``;
* ``vllm:gpu_cache_usage_perc``: vLLM V1 dropped it, the simulator still exports it next to
  ``vllm:kv_cache_usage_perc`` so that gateways reading the older name can be tested;
* tokenizers: the simulator counts tokens approximately unless given ``--tokenizer``, so
  token counts are compared with each engine's own usage figures, never across engines.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from gateway_harness import wait_for
from processes import Endpoint, IsocostProcess
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from isocost.runtime.scrape import parse_engine_metrics

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture
def client(endpoint: Endpoint) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{endpoint.url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as opened:
        yield opened


def _body(path: str, model: str, text: str, **fields: Any) -> dict[str, Any]:
    if path == CHAT:
        return {"model": model, "messages": [{"role": "user", "content": text}], **fields}
    return {"model": model, "prompt": text, **fields}


def _post(url: str, body: bytes | dict[str, Any]) -> tuple[int, str, bytes]:
    """Status, content type and raw body of one POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


def _text_of(choice: dict[str, Any]) -> str:
    return str(choice["delta"].get("content") or "" if "delta" in choice else choice["text"])


# -- streaming ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_sse_framing_finish_reason_usage_and_done(endpoint: Endpoint, path: str) -> None:
    body = _body(
        path, endpoint.model, "Count to ten.", max_tokens=12, stream=True, ignore_eos=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    status, content_type, raw = _post(endpoint.url + path, body)
    assert status == 200 and content_type.startswith("text/event-stream")
    text = raw.decode()
    assert text.endswith("data: [DONE]\n\n") and text.count("[DONE]") == 1
    events = text.split("\n\n")[:-2]  # the [DONE] event, then the empty tail
    assert events and all(e.startswith("data: ") and "\n" not in e for e in events)
    chunks = [json.loads(e.removeprefix("data: ")) for e in events]
    kind = "chat.completion.chunk" if path == CHAT else "text_completion"
    assert {c["object"] for c in chunks} == {kind} and len({c["id"] for c in chunks}) == 1
    assert {c["model"] for c in chunks} == {endpoint.model}
    *choice_chunks, usage_chunk = chunks
    finishes = [c["choices"][0]["finish_reason"] for c in choice_chunks]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert all(len(c["choices"]) == 1 and c.get("usage") is None for c in choice_chunks)
    assert "".join(_text_of(c["choices"][0]) for c in choice_chunks)
    if path == CHAT:
        assert choice_chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage = usage_chunk["usage"]
    assert usage_chunk["choices"] == [] and usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12 and usage["prompt_tokens"] > 0


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_continuous_usage_counts_every_chunk(endpoint: Endpoint, path: str) -> None:
    """``continuous_usage_stats``: the usage so far in every chunk (the gateway counts the
    tokens of a resumable stream from it)."""
    body = _body(
        path, endpoint.model, "Count to ten.", max_tokens=12, stream=True, ignore_eos=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    status, _, raw = _post(endpoint.url + path, body)
    assert status == 200
    events = raw.decode().split("\n\n")[:-2]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events]
    with_text = [c for c in chunks if c["choices"] and _text_of(c["choices"][0])]
    assert with_text and all(c.get("usage") for c in with_text)
    counts = [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")]
    assert counts == sorted(counts) and counts[-1] == 12
    prompts = {c["usage"]["prompt_tokens"] for c in chunks if c.get("usage")}
    assert len(prompts) == 1 and prompts.pop() > 0


def test_a_chat_continues_its_final_assistant_message(endpoint: Endpoint) -> None:
    """vLLM's ``continue_final_message`` (with ``add_generation_prompt: false``): the
    partial answer is prompt, continued in place; both switches on at once is a 400."""
    messages = [{"role": "user", "content": "Count to ten."}]
    fresh = _body(CHAT, endpoint.model, "", max_tokens=4, ignore_eos=True)
    fresh["messages"] = messages
    status, _, raw = _post(endpoint.url + CHAT, fresh)
    assert status == 200
    fresh_prompt = json.loads(raw)["usage"]["prompt_tokens"]
    partial = {"role": "assistant", "content": " one two three four five six"}
    continued = {
        **fresh, "messages": [*messages, partial], "continue_final_message": True,
        "add_generation_prompt": False,
    }  # fmt: skip
    status, _, raw = _post(endpoint.url + CHAT, continued)
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["usage"]["prompt_tokens"] > fresh_prompt
    assert answer["usage"]["completion_tokens"] == 4
    status, _, raw = _post(endpoint.url + CHAT, {**continued, "add_generation_prompt": True})
    assert status == 400, raw


def test_no_usage_chunk_unless_asked(client: openai.OpenAI, endpoint: Endpoint) -> None:
    chunks = list(
        client.completions.create(
            model=endpoint.model, prompt="Once upon a time", max_tokens=6, stream=True
        )
    )
    assert chunks and all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_stream_through_the_openai_client(client: openai.OpenAI, endpoint: Endpoint) -> None:
    chunks = list(
        client.chat.completions.create(
            model=endpoint.model,
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


# -- whole answers and finish_reason -----------------------------------------------------


def test_finish_reason_agrees_with_usage(client: openai.OpenAI, endpoint: Endpoint) -> None:
    """``length`` exactly when max_tokens were produced, ``stop`` when the model ended."""
    forced = client.completions.create(
        model=endpoint.model, prompt="Hello", max_tokens=20, extra_body={"ignore_eos": True}
    )
    assert forced.object == "text_completion" and forced.choices[0].finish_reason == "length"
    assert forced.usage is not None and forced.usage.completion_tokens == 20
    for _ in range(5):
        free = client.chat.completions.create(
            model=endpoint.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=40
        )
        assert free.object == "chat.completion" and free.choices[0].message.role == "assistant"
        assert free.usage is not None and 1 <= free.usage.completion_tokens <= 40
        expected = "length" if free.usage.completion_tokens == 40 else "stop"
        assert free.choices[0].finish_reason == expected


def test_max_tokens_beyond_the_room_left_is_cut_to_fit(
    client: openai.OpenAI, endpoint: Endpoint
) -> None:
    """vLLM >= 0.11 clamps max_tokens to the context left after the prompt (no 400)."""
    prompt = "alpha beta gamma " * 100
    probe = client.completions.create(model=endpoint.model, prompt=prompt, max_tokens=1)
    assert probe.usage is not None
    room = 1024 - probe.usage.prompt_tokens
    assert room > 0
    reply = client.completions.create(
        model=endpoint.model, prompt=prompt, max_tokens=1000, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None and reply.usage.completion_tokens == room
    assert reply.choices[0].finish_reason == "length"


# -- errors ------------------------------------------------------------------------------


_TOO_LONG = "word " * 1500  # > 1,024 tokens in either tokenizer
_LLAMA = "tiny-llama"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (COMPLETIONS, b"{not json", 400, None),
        (COMPLETIONS, {"model": _LLAMA}, 400, "prompt"),
        (CHAT, {"model": _LLAMA}, 400, "messages"),
        (COMPLETIONS, {"model": _LLAMA, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
        (COMPLETIONS, {"model": _LLAMA, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        (COMPLETIONS, {"model": _LLAMA, "prompt": "hi", "max_tokens": 2000}, 400, "max_tokens"),
        (COMPLETIONS, {"model": "gpt-5", "prompt": "hi"}, 404, "model"),
        (CHAT, {"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        (COMPLETIONS, {"model": _LLAMA, "prompt": _TOO_LONG}, 400, None),
        (CHAT, {"model": _LLAMA, "messages": [{"role": "user", "content": _TOO_LONG}]}, 400, None),
    ],
    ids=[
        "bad-json", "no-prompt", "no-messages", "negative-max-tokens", "zero-max-tokens",
        "max-tokens-over-context", "unknown-model", "unknown-model-chat", "prompt-too-long",
        "chat-too-long",
    ],
)  # fmt: skip
def test_errors_have_the_status_and_shape(
    endpoint: Endpoint,
    path: str,
    body: bytes | dict[str, Any],
    status: int,
    param: str | None,
) -> None:
    got, content_type, raw = _post(endpoint.url + path, body)
    assert got == status and content_type.startswith("application/json")
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert str(error["param"]).removeprefix("body.") == param, error


def test_the_openai_client_maps_the_errors(client: openai.OpenAI, endpoint: Endpoint) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
        client.chat.completions.create(
            model=endpoint.model, messages=[{"role": "user", "content": _TOO_LONG}]
        )


# -- /v1/models and /health --------------------------------------------------------------


def test_models_and_health(client: openai.OpenAI, endpoint: Endpoint) -> None:
    (model,) = client.models.list().data
    assert model.id == endpoint.model and model.object == "model"
    assert model.created > 1_600_000_000 and model.owned_by
    with urllib.request.urlopen(f"{endpoint.url}/v1/models", timeout=10) as response:
        listing = json.loads(response.read())
    assert listing["object"] == "list" and listing["data"][0]["max_model_len"] == 1024
    assert listing["data"][0]["root"]
    with urllib.request.urlopen(f"{endpoint.url}/health", timeout=10) as response:
        assert response.status == 200


# -- /metrics ----------------------------------------------------------------------------

_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}


def _scrape(url: str) -> tuple[str, dict[str, tuple[str, list[Sample]]]]:
    """The /metrics text and its families by name: (type, samples)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return text, {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def _value(families: dict[str, tuple[str, list[Sample]]], sample_name: str, **labels: str) -> float:
    family = sample_name.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    _, samples = families[family]
    return sum(
        s.value
        for s in samples
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_metric_names_types_and_labels(endpoint: Endpoint) -> None:
    _, families = _scrape(endpoint.url)
    for name, kind in _TYPES.items():
        assert families[name][0] == kind, name
        assert {s.labels["model_name"] for s in families[name][1]} == {endpoint.model}, name
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        names = {s.name for s in families[name][1]}
        assert names >= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
        assert any(s.labels.get("le") == "+Inf" for s in families[name][1])
    assert ("vllm:gpu_cache_usage_perc" in families) == (endpoint.kind == "isocost-engine")


def _stream_fully(client: openai.OpenAI, model: str, max_tokens: int) -> int:
    """One streamed completion of exactly ``max_tokens``, read to the end; its chunks."""
    stream = client.completions.create(
        model=model, prompt="a long story", max_tokens=max_tokens, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return sum(1 for _ in stream)


def test_gauges_follow_running_requests_and_the_gateway_reads_them(
    client: openai.OpenAI, endpoint: Endpoint
) -> None:
    """Four workers keep long streams going; one scrape taken while they run shows them
    running with KV in use, and the gateway's parser reads that text exactly as
    prometheus_client does. (vLLM on a CPU can finish a stream between two scrapes, and
    its API server lags its engine, so the load lasts until such a scrape is seen.)"""
    seen: list[str] = []
    stop = threading.Event()

    def busy() -> bool:
        seen.append(_scrape(endpoint.url)[0])
        figures = parse_engine_metrics(seen[-1]).metrics
        return figures.num_running >= 1 and figures.kv_usage > 0

    def keep_streaming() -> int:
        streamed = 0
        while not stop.is_set():
            streamed += _stream_fully(client, endpoint.model, 500)
        return streamed

    with ThreadPoolExecutor(4) as pool:
        workers = [pool.submit(keep_streaming) for _ in range(4)]
        try:
            wait_for(busy, 30, "a scrape with requests running and KV in use", interval_s=0.02)
        finally:
            stop.set()
        assert all(f.result() > 0 for f in workers)
    families = {f.name: f for f in text_string_to_metric_families(seen[-1])}
    during = parse_engine_metrics(seen[-1]).metrics  # the gateway's own parser
    for name, value in (
        ("vllm:num_requests_running", during.num_running),
        ("vllm:num_requests_waiting", during.num_waiting),
        ("vllm:kv_cache_usage_perc", during.kv_usage),
    ):
        assert families[name].samples[0].value == value, name
    assert 0 < during.kv_usage <= 1

    def drained() -> bool:
        after = parse_engine_metrics(_scrape(endpoint.url)[0]).metrics
        return (after.num_running, after.num_waiting, after.kv_usage) == (0, 0, 0.0)

    wait_for(drained, 30, "running, waiting and KV usage back to 0", interval_s=0.02)


def test_counters_and_histograms_move_per_request(
    client: openai.OpenAI, endpoint: Endpoint
) -> None:
    prompt = " ".join(f"unique{n}" for n in range(150)) + f" {time.time_ns()}"
    _, before = _scrape(endpoint.url)
    first = client.completions.create(
        model=endpoint.model, prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True}
    )
    _, middle = _scrape(endpoint.url)
    client.completions.create(
        model=endpoint.model, prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True}
    )
    _, after = _scrape(endpoint.url)
    assert first.usage is not None
    num_prompt = first.usage.prompt_tokens

    def delta(a: Any, b: Any, name: str, **labels: str) -> float:
        return _value(b, name, **labels) - _value(a, name, **labels)

    for name in (
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert delta(before, middle, name) == 1, name
    assert delta(before, middle, "vllm:request_success_total", finished_reason="length") == 1
    assert delta(before, middle, "vllm:generation_tokens_total") == 8
    assert delta(before, middle, "vllm:prompt_tokens_total") == num_prompt
    assert delta(before, middle, "vllm:prefix_cache_queries_total") == num_prompt
    assert delta(before, middle, "vllm:prefix_cache_hits_total") == 0  # a prompt never seen
    hits = delta(middle, after, "vllm:prefix_cache_hits_total")
    assert num_prompt - 128 <= hits < num_prompt  # whole blocks (16 or 128 tokens) of it
    assert delta(middle, after, "vllm:prefix_cache_queries_total") == num_prompt
    text, _ = _scrape(endpoint.url)
    scraped = parse_engine_metrics(text).metrics
    assert scraped.prefix_cache_hits == _value(after, "vllm:prefix_cache_hits_total")
    assert scraped.prefix_cache_queries == _value(after, "vllm:prefix_cache_queries_total")


def test_the_older_kv_usage_name_reads_the_same(sim_engine: IsocostProcess) -> None:
    """The simulator exports ``vllm:gpu_cache_usage_perc`` too; a text with only that name
    (vLLM before V1) gives the gateway the same KV usage."""
    with openai.OpenAI(base_url=f"{sim_engine.url}/v1", api_key="unused") as sim:
        stream = sim.completions.create(
            model="tiny-llama", prompt="x " * 300, max_tokens=600, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert next(iter(stream)).choices
        text, _ = _scrape(sim_engine.url)
        stream.close()
    older = "\n".join(line for line in text.splitlines() if "kv_cache_usage_perc" not in line)
    assert "vllm:gpu_cache_usage_perc{" in older
    assert (
        parse_engine_metrics(older).metrics.kv_usage
        == parse_engine_metrics(text).metrics.kv_usage
        > 0
    )
