"""``isocost serve`` following a replica's KV-cache events over a real ZMQ socket.

The test plays the engine's publisher: a ZMQ PUB socket bound on 127.0.0.1, as vLLM binds
its ``--kv-events-config`` endpoint, sending batches in vLLM's wire format (topic, 8-byte
sequence, msgpack batch). The replicas are ``isocost engine`` processes; the pool has a
``tokenizer`` (a word-level one built here, BOS added as Llama's is), so the gateway hashes
a completion's prompt from the same token ids the events carry. What the gateway then
believes is read from ``POST /v1/route`` (the chosen replica and its predicted cached
tokens) and ``/metrics``; the real-vLLM suite checks the same against vLLM itself.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from gateway_harness import gateway_config, http, wait_for
from isocost_procs import Proc, free_port, start_gateway_with, start_isocost
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, models, pre_tokenizers, processors

MODEL = "llama-3.1-8b"
ADMIN = {"Authorization": "Bearer admin-kv-3f1e"}
KEY = "key-kv-a91c"
ENGINE_BLOCK = 32
WORDS = [f"w{i}" for i in range(200)]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    vocab = {"<s>": 0, "[UNK]": 1} | {word: i + 2 for i, word in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


class Publisher:
    """The engine side of vLLM's KV-event stream: PUB bound, sequence numbers from 0."""

    def __init__(self) -> None:
        self.port = free_port()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.bind(f"tcp://127.0.0.1:{self.port}")
        self.sequence = 0

    def send(self, *events: dict[str, Any], sequence: int | None = None) -> None:
        self.sequence = self.sequence if sequence is None else sequence
        payload = msgspec.msgpack.encode([time.time(), list(events), None])
        self.socket.send_multipart([b"", self.sequence.to_bytes(8, "big"), payload])
        self.sequence += 1

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    yield pub
    pub.close()


def stored(hashes: list[int], tokens: list[int], parent: int | None = None) -> dict[str, Any]:
    return {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
        "token_ids": tokens, "block_size": ENGINE_BLOCK, "lora_id": None, "medium": "GPU",
        "lora_name": None,
    }  # fmt: skip


def metric(gateway: Proc, name: str, replica: str) -> float:
    with urllib.request.urlopen(gateway.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("replica") == replica:
                return float(sample.value)
    return 0.0


def route(gateway: Proc, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    status, _, answer = http(
        "POST", gateway.url + "/v1/route?kind=completion", body, headers=headers
    )
    assert status == 200, answer
    result: dict[str, Any] = answer
    return result


def start_following_gateway(
    tmp_path: Path,
    procs: list[Proc],
    publisher: Publisher,
    tokenizer_path: Path,
    *,
    plain: bool,
) -> Proc:
    """A gateway over an engine ``events`` that follows the publisher and, with ``plain``,
    a second engine ``plain`` without events."""
    engines = []
    for _ in range(2 if plain else 1):
        args = ["engine", "--port", "0", "--model", MODEL, "--gpu", "a100-80g"]
        engines.append(start_isocost(args, "isocost engine"))
        procs.append(engines[-1])
    replicas = (
        f"      - {{url: '{engines[0].url}', name: events,"
        f" kv_events: 'tcp://127.0.0.1:{publisher.port}'}}\n"
    )
    if plain:
        replicas += f"      - {{url: '{engines[1].url}', name: plain}}\n"
    config = gateway_config(
        [],
        model=MODEL,
        admin_token=ADMIN["Authorization"].split()[1],
        api_key=KEY,
        policy="prefix",
        pool_fields=f"    tokenizer: {tokenizer_path}",
    ).replace("    replicas:\n", "    replicas:\n" + replicas)
    return start_gateway_with(config, tmp_path, procs)


@pytest.fixture
def gateway(tmp_path: Path, procs: list[Proc], publisher: Publisher, tokenizer_path: Path) -> Proc:
    """Two engines, ``events`` (following the publisher) and ``plain`` (no events)."""
    return start_following_gateway(tmp_path, procs, publisher, tokenizer_path, plain=True)


def connected(gateway: Proc, publisher: Publisher) -> None:
    """Send empty batches until the gateway counts one (a SUB socket joins a moment after
    it connects, and misses what was sent before)."""

    def received() -> bool:
        publisher.send()
        return metric(gateway, "isocost_kv_event_batches_total", "events") > 0

    wait_for(received, 10, "the gateway to receive KV events", interval_s=0.05)


def token_ids(tokenizer_path: Path, text: str) -> list[int]:
    ids: list[int] = Tokenizer.from_file(str(tokenizer_path)).encode(text).ids
    return ids


def test_blocks_an_engine_stores_and_evicts_steer_routing(
    gateway: Proc, publisher: Publisher, tokenizer_path: Path
) -> None:
    prompt = " ".join(WORDS[:70])  # BOS + 70 words: two whole 32-token engine blocks
    ids = token_ids(tokenizer_path, prompt)
    assert len(ids) == 71
    connected(gateway, publisher)
    assert route(gateway, prompt)["cached_tokens"] == 0  # nothing dispatched, nothing stored

    publisher.send(stored([101, 102], ids[: 2 * ENGINE_BLOCK]))
    wait_for(
        lambda: route(gateway, prompt)["cached_tokens"] == 2 * ENGINE_BLOCK,
        5,
        "the stored blocks to be matched",
    )
    assert route(gateway, prompt)["replica"] == "events"
    # a prompt that shares only the first block matches only that block
    other = " ".join(WORDS[:31] + WORDS[100:140])
    assert route(gateway, other)["cached_tokens"] == ENGINE_BLOCK

    publisher.send({"type": "BlockRemoved", "block_hashes": [102], "medium": "GPU"})
    wait_for(
        lambda: route(gateway, prompt)["cached_tokens"] == ENGINE_BLOCK,
        5,
        "the evicted block to be forgotten",
    )
    publisher.send({"type": "AllBlocksCleared"})
    wait_for(lambda: route(gateway, prompt)["cached_tokens"] == 0, 5, "a cleared cache")


def test_lost_batches_and_garbage_resync_without_failing_a_request(
    gateway: Proc, publisher: Publisher, tokenizer_path: Path
) -> None:
    prompt = " ".join(WORDS[:40])
    ids = token_ids(tokenizer_path, prompt)
    connected(gateway, publisher)
    publisher.send(stored([7], ids[:ENGINE_BLOCK]))
    wait_for(lambda: route(gateway, prompt)["cached_tokens"] == ENGINE_BLOCK, 5, "a stored block")

    publisher.send(sequence=publisher.sequence + 5)  # five batches lost
    wait_for(
        lambda: metric(gateway, "isocost_kv_event_resyncs_total", "events") == 1,
        5,
        "a resync for the gap",
    )
    assert route(gateway, prompt)["cached_tokens"] == 0  # what it held is unknown now
    publisher.socket.send_multipart([b"", b"\x00\x01", b"not msgpack"])
    wait_for(
        lambda: metric(gateway, "isocost_kv_event_resyncs_total", "events") == 2,
        5,
        "a resync for the garbage",
    )
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 3}).encode()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    status, _, answer = http("POST", gateway.url + "/v1/completions", body, headers=headers)
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] > 0
