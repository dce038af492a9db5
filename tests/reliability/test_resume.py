"""Streams resumed on another replica when theirs dies mid-generation, through real processes.

Two ``isocost engine`` processes behind a gateway; the official openai client streams a
long answer (``ignore_eos``, so its length is exactly ``max_tokens``), and once some text
has arrived the replica serving it is crashed (its ``crash`` fault ends the process). The
engine's filler answer goes on from the word its prompt ends with, as a model continues
its own text, so the client's text must be exactly the filler cycle from its start: any
token duplicated or lost at the seam shows. The usage must add up over both replicas.
A request that cannot be resumed exactly ends with an error event, as before; one not
streamed is retried whole.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from cluster import API_KEY, MODEL, Cluster, http, start_cluster
from gateway_harness import wait_for

from isocost.engine.tokens import filler_start, filler_text, render_chat

MAX_TOKENS = 300
CRASH_AFTER = 20  # text chunks received before the serving replica is crashed


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Cluster]:
    cluster = start_cluster(tmp_path, 2, policy="round_robin")
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def api(pair: Cluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=pair.gateway.url + "/v1", api_key=API_KEY, max_retries=0) as client:
        yield client


def crash(cluster: Cluster, replica: str) -> None:
    """Crash the engine the gateway names ``replica`` (its ``host:port``)."""
    (url,) = [u for u in cluster.engine_urls if u.endswith(replica)]
    status, _, _ = http("POST", url + "/admin/fault", json.dumps({"crash": True}).encode())
    assert status == 200


def chunk_text(chunk: Any) -> str:
    choice = chunk.choices[0]
    return (choice.delta.content if hasattr(choice, "delta") else choice.text) or ""


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_stream_whose_replica_dies_goes_on_elsewhere_without_a_seam(
    pair: Cluster, api: openai.OpenAI, chat: bool
) -> None:
    prompt = "Tell me a long story about routers"
    common: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }
    if chat:
        raw: Any = api.chat.completions.with_raw_response.create(
            messages=[{"role": "user", "content": prompt}], **common
        )
        expected_start = filler_start(render_chat([("user", prompt)]))
    else:
        raw = api.completions.with_raw_response.create(prompt=prompt, **common)
        expected_start = filler_start(prompt)
    first_replica = raw.headers["x-isocost-replica"]
    text, ids, finishes, usage = [], set(), [], None
    for chunk in raw.parse():
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        text.append(chunk_text(chunk))
        if chunk.choices[0].finish_reason:
            finishes.append(chunk)
        if sum(map(bool, text)) == CRASH_AFTER:
            crash(pair, first_replica)
    assert "".join(text) == filler_text(expected_start, MAX_TOKENS)  # the seam is exact
    assert len(ids) == 1  # one stream id, the first replica's
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + MAX_TOKENS
    (finish,) = finishes
    assert finish.choices[0].finish_reason == "length"
    (resume,) = finish.model_extra["isocost"]["resumed"]
    second = next(r for r in pair.engine_urls if not r.endswith(first_replica))
    assert resume["from"] == first_replica and second.endswith(resume["to"])
    assert CRASH_AFTER <= resume["after_tokens"] < MAX_TOKENS


def test_a_request_that_cannot_be_resumed_exactly_ends_with_an_error_event(
    pair: Cluster, api: openai.OpenAI
) -> None:
    """``logprobs`` (one of the README's list): the continuation's would restart."""
    raw: Any = api.completions.with_raw_response.create(
        model=MODEL,
        prompt="Tell me a long story",
        max_tokens=MAX_TOKENS,
        stream=True,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    first_replica = raw.headers["x-isocost-replica"]
    received = 0
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        for _ in raw.parse():
            received += 1
            if received == CRASH_AFTER:
                crash(pair, first_replica)
    assert received >= CRASH_AFTER


def test_requests_not_streamed_in_flight_on_a_dead_replica_are_retried_whole(
    pair: Cluster, api: openai.OpenAI
) -> None:
    """Nothing of a whole answer reached the client, so each is sent again elsewhere."""
    victim = pair.engine_urls[0]
    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = [
            pool.submit(
                api.completions.create,
                model=MODEL,
                prompt=f"request {i}",
                max_tokens=MAX_TOKENS * 4,
                extra_body={"ignore_eos": True},
            )
            for i in range(6)
        ]
        wait_for(lambda: engine_running(victim) >= 2, what="requests running on the victim")
        crash(pair, victim.rsplit("/", 1)[-1])
        results = [answer.result(timeout=60) for answer in answers]
    assert all(r.usage is not None and r.usage.completion_tokens == MAX_TOKENS * 4 for r in results)
    assert all(r.choices[0].text == filler_text(0, MAX_TOKENS * 4) for r in results)


def engine_running(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0
