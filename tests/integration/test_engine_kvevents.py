"""``isocost engine --kv-events-port``: vLLM's KV-cache events from the engine simulator.

A real engine process with an exact tokenizer (a word-level ``tokenizer.json`` written
here), a ZMQ SUB socket on its publisher, and the gateway's own decoder and tracker
(``isocost.prefix.kvevents``) applying what comes: the prefix hit the events predict for a
prompt is the hit the engine then reports in ``vllm:prefix_cache_hits_total``, before and
after evictions.
"""

from __future__ import annotations

import contextlib
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import zmq
from gateway_harness import gateway_config
from isocost_procs import Proc, free_port, start_isocost
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from tokenizers import Tokenizer, models, pre_tokenizers

from isocost.prefix.hashing import token_block_hashes
from isocost.prefix.index import PrefixIndex
from isocost.prefix.kvevents import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventTracker,
    decode_batch,
    decode_sequence,
    engine_cached_tokens,
)

MODEL = "llama-3.1-8b"
KEY = "key-kv-engine"
INDEX_BLOCK = 16  # the gateway's index block; the engine's is 16 too
WORDS = 2000
KV_BLOCKS = 20  # room for one prompt of 14 blocks (12 full, a part, its answer), not two
_HITS = re.compile(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", re.M)


def _prompt(first: int) -> tuple[str, list[int]]:
    """200 distinct words (12 full blocks and a part) and their token ids."""
    ids = list(range(first, first + 200))
    return " ".join(f"w{i}" for i in ids), ids


class Following:
    """The engine's event stream, applied as a gateway applies it."""

    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.RCVTIMEO, 5000)
        self.socket.connect(endpoint)
        self.index = PrefixIndex()
        self.index.add_replica(0, 100_000)
        self.tracker = KvEventTracker(self.index, 0, INDEX_BLOCK)
        self.sequences: list[int] = []
        self.batches: list[EventBatch] = []

    def receive(self) -> EventBatch:
        """One batch (raises ``zmq.Again`` after 5 s without one), applied."""
        frames = self.socket.recv_multipart()
        assert len(frames) == 3, frames
        sequence, batch = decode_sequence(frames[1]), decode_batch(frames[2])
        assert self.tracker.apply(sequence, batch) or not self.sequences  # no gap after 1st
        self.sequences.append(sequence)
        self.batches.append(batch)
        return batch

    def receive_until(self, *, stored: list[int]) -> None:
        """Batches until every hash of ``stored`` was reported stored."""
        wanted = set(stored)
        while wanted:
            for event in self.receive().events:
                if isinstance(event, BlockStored):
                    wanted -= set(map(int, event.block_hashes))

    def close(self) -> None:
        self.socket.close(linger=0)

    def matched(self, ids: list[int]) -> int:
        return self.index.match_replica(0, token_block_hashes(ids, INDEX_BLOCK)) * INDEX_BLOCK


def _write_tokenizer(directory: Path) -> Path:
    """A word-level ``tokenizer.json``: word ``w<i>`` is token ``i``."""
    vocab = {"[UNK]": 0} | {f"w{i}": i for i in range(1, WORDS)}
    exact = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    exact.pre_tokenizer = pre_tokenizers.Whitespace()
    path = directory / "tokenizer.json"
    exact.save(str(path))
    return path


def _engine_args(tokenizer: Path, events_port: int) -> list[str]:
    return [
        "engine", "--port", "0", "--model", MODEL, "--gpu", "a100-80g",
        "--output-dist", "max", "--tokenizer", str(tokenizer),
        "--num-gpu-blocks-override", str(KV_BLOCKS), "--kv-events-port", str(events_port),
    ]  # fmt: skip


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Proc, str]]:
    port = free_port()
    proc = start_isocost(_engine_args(_write_tokenizer(tmp_path), port), "isocost engine")
    try:
        yield proc, f"tcp://127.0.0.1:{port}"
    finally:
        proc.stop()


def _hits(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        return sum(float(v) for v in _HITS.findall(response.read().decode()))


def test_events_predict_the_engine_s_own_prefix_hits(engine: tuple[Proc, str]) -> None:
    proc, endpoint = engine
    following = Following(endpoint)
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
    with client, contextlib.closing(following):
        _check_predictions(proc, following, client)


def _check_predictions(proc: Proc, following: Following, client: openai.OpenAI) -> None:

    def send(text: str) -> float:
        """The engine's prefix-cache hit for ``text``, in tokens (its own counter)."""
        before = _hits(proc.url)
        client.completions.create(model=MODEL, prompt=text, max_tokens=1)
        return _hits(proc.url) - before

    # The subscription is live once a prompt's events come (ZMQ drops what a subscriber
    # not yet connected would have got): warm-up prompts until one's do.
    for attempt in range(20):
        text, ids = _prompt(1000 + attempt * 20)  # 12 blocks each, evicting each other
        send(text)
        try:
            following.receive_until(stored=token_block_hashes(ids, INDEX_BLOCK)[:1])
            break
        except zmq.Again:
            continue
    else:
        pytest.fail("no KV event batch in 20 prompts")

    a_text, a_ids = _prompt(1)
    b_text, b_ids = _prompt(201)
    send(a_text)
    following.receive_until(stored=token_block_hashes(a_ids, INDEX_BLOCK))
    assert following.matched(a_ids) == 192  # every full block of the prompt
    predicted = engine_cached_tokens(following.matched(a_ids), len(a_ids), INDEX_BLOCK)
    assert send(a_text) == predicted == 192

    # B fills the cache: A's oldest free blocks (its tail first) are evicted for it.
    send(b_text)
    following.receive_until(stored=token_block_hashes(b_ids, INDEX_BLOCK))
    removed = [e for b in following.batches for e in b.events if isinstance(e, BlockRemoved)]
    assert removed, "no eviction reported"
    left = following.matched(a_ids)
    assert left < 192
    assert send(a_text) == engine_cached_tokens(left, len(a_ids), INDEX_BLOCK)
    # Its evicted tail, computed again, is stored after the blocks kept (their parent).
    following.receive_until(stored=token_block_hashes(a_ids, INDEX_BLOCK)[left // INDEX_BLOCK :])
    assert following.matched(a_ids) == 192


def test_a_gateway_following_the_engine_predicts_every_hit(tmp_path: Path) -> None:
    """The loop of ``make test-real``'s KV-events test with ``isocost engine`` as the
    engine: the gateway (pool tokenizer, ``kv_events:``) predicts each answer's cached
    tokens, the engine reports them (``--enable-prompt-tokens-details``), evictions
    included, and ``isocost_prefix_predictions_total`` counts them all exact."""
    tokenizer = _write_tokenizer(tmp_path)
    port = free_port()
    engine = start_isocost(
        [*_engine_args(tokenizer, port), "--enable-prompt-tokens-details"], "isocost engine"
    )
    gateway: Proc | None = None
    try:
        config = gateway_config(
            [], model=MODEL, admin_token="admin-kv-engine", api_key=KEY, policy="prefix",
            pool_fields=f"    tokenizer: {tokenizer}",
        ).replace(
            "    replicas:\n",
            f"    replicas:\n      - {{url: '{engine.url}', name: engine,"
            f" kv_events: 'tcp://127.0.0.1:{port}'}}\n",
        )  # fmt: skip
        (tmp_path / "gateway.yaml").write_text(config)
        serve = ["serve", "--config", str(tmp_path / "gateway.yaml"), "--port", "0"]
        gateway = start_isocost(serve, "isocost serve")
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
        with client:

            def complete(text: str) -> int:
                answer = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
                details = answer.usage.prompt_tokens_details if answer.usage else None
                assert details is not None and details.cached_tokens is not None
                return details.cached_tokens

            # Joined once a prompt's batch is counted (a SUB socket misses what came first).
            for attempt in range(20):
                complete(_prompt(1000 + attempt * 20)[0])
                if _metric(gateway, "isocost_kv_event_batches_total") > 0:
                    break
            else:
                pytest.fail("the gateway received no KV event batch in 20 prompts")
            before = _predictions(gateway)
            a_text, b_text = _prompt(1)[0], _prompt(201)[0]
            cached = [complete(text) for text in (a_text, a_text, b_text, a_text, a_text)]
            after = _predictions(gateway)
        assert cached[1] == 192 and 0 < cached[3] < 192, cached  # B evicted A's tail
        counted = {k: after.get(k, 0) - before.get(k, 0) for k in ("exact", "over", "under")}
        assert counted == {"exact": 5, "over": 0, "under": 0}, (counted, cached)
    finally:
        if gateway is not None:
            gateway.stop()
        engine.stop()


def _samples(proc: Proc, name: str) -> list[Sample]:
    """``proc``'s samples of ``name`` from its ``/metrics``."""
    with urllib.request.urlopen(f"{proc.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    families = text_string_to_metric_families(text)
    return [sample for family in families for sample in family.samples if sample.name == name]


def _metric(proc: Proc, name: str) -> float:
    return sum(sample.value for sample in _samples(proc, name))


def _predictions(proc: Proc) -> dict[str, float]:
    counts: dict[str, float] = {}
    for sample in _samples(proc, "isocost_prefix_predictions_total"):
        outcome = sample.labels["outcome"]
        counts[outcome] = counts.get(outcome, 0.0) + sample.value
    return counts
