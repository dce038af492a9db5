"""``isocost engine --kv-events-port``: vLLM's KV-cache events from the engine simulator.

A real engine process with an exact tokenizer (a word-level ``tokenizer.json`` written
here), a ZMQ SUB socket on its publisher, and the gateway's own decoder and tracker
(``isocost.prefix.kvevents``) applying what comes: the prefix hit the events predict for a
prompt is the hit the engine then reports in ``vllm:prefix_cache_hits_total``, before and
after evictions.

A SUB socket misses what its PUB sent before the subscription was live, and nothing tells
it when that was: each subscriber here joins with warm-up prompts until one's events come
(``_join``). An answer and its step's events travel apart (ZMQ's I/O threads, a gateway's
event loop), so an answer is no sign its events have come: what depends on them waits for
them, with a deadline fit for a loaded machine (``EVENTS_S``).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import zmq
from gateway_harness import gateway_config, http, wait_for
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
JOIN_WAIT_S = 5.0  # a warm-up prompt's events, when the subscription is live, come sooner
EVENTS_S = 60.0  # events that must come (the subscription is live), on a loaded machine
FULL = 192  # a prompt's full blocks, in tokens: what the engine holds of it once answered
BATCHES = "isocost_kv_event_batches_total"


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
        self.socket.connect(endpoint)
        self.index = PrefixIndex()
        self.index.add_replica(0, 100_000)
        self.tracker = KvEventTracker(self.index, 0, INDEX_BLOCK)
        self.sequences: list[int] = []
        self.batches: list[EventBatch] = []

    def receive(self, deadline: float) -> EventBatch:
        """One batch, applied; ``zmq.Again`` when none comes by ``deadline`` (monotonic)."""
        if not self.socket.poll(max(0, round((deadline - time.monotonic()) * 1000))):
            raise zmq.Again()
        frames = self.socket.recv_multipart()
        assert len(frames) == 3, frames
        sequence, batch = decode_sequence(frames[1]), decode_batch(frames[2])
        assert self.tracker.apply(sequence, batch) or not self.sequences  # no gap after 1st
        self.sequences.append(sequence)
        self.batches.append(batch)
        return batch

    def receive_until(self, *, stored: list[int], timeout_s: float = EVENTS_S) -> None:
        """Batches until every hash of ``stored`` was reported stored (``zmq.Again`` when
        they have not in ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        wanted = set(stored)
        while wanted:
            for event in self.receive(deadline).events:
                if isinstance(event, BlockStored):
                    wanted -= set(map(int, event.block_hashes))

    def receive_holding(self, ids: list[int]) -> None:
        """Batches until the index holds every full block of ``ids``, as the engine does
        once it has answered that prompt (the answer may come before its events)."""
        deadline = time.monotonic() + EVENTS_S
        while self.matched(ids) < FULL:
            self.receive(deadline)

    def got(self, ids: list[int]) -> bool:
        """Whether the events of a prompt of ``ids`` just answered come (``_join``)."""
        first = token_block_hashes(ids, INDEX_BLOCK)[:1]
        try:
            self.receive_until(stored=first, timeout_s=JOIN_WAIT_S)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self.socket.close(linger=0)

    def matched(self, ids: list[int]) -> int:
        return self.index.match_replica(0, token_block_hashes(ids, INDEX_BLOCK)) * INDEX_BLOCK


def _join(send: Callable[[str], object], *subscribers: Callable[[list[int]], bool]) -> None:
    """Warm-up prompts (``send``) until each subscriber says it got one's events: it is
    live from then on. ``subscriber(ids)`` waits up to ``JOIN_WAIT_S`` for that prompt's;
    False: sent before it was live (or late: its wait for the next prompt takes them)."""
    waiting = list(subscribers)
    for attempt in range(20):
        text, ids = _prompt(1000 + attempt * 20)  # 12 blocks each, evicting each other
        send(text)
        waiting = [subscriber for subscriber in waiting if not subscriber(ids)]
        if not waiting:
            return
    pytest.fail("no KV event batch in 20 prompts")


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

    _join(send, following.got)
    a_text, a_ids = _prompt(1)
    b_text, b_ids = _prompt(201)
    send(a_text)
    following.receive_until(stored=token_block_hashes(a_ids, INDEX_BLOCK))
    assert following.matched(a_ids) == FULL  # every full block of the prompt
    predicted = engine_cached_tokens(following.matched(a_ids), len(a_ids), INDEX_BLOCK)
    assert send(a_text) == predicted == FULL

    # B fills the cache: A's oldest free blocks (its tail first) are evicted for it.
    seen = len(following.batches)
    send(b_text)
    following.receive_until(stored=token_block_hashes(b_ids, INDEX_BLOCK))
    for_b = following.batches[seen:]
    assert any(isinstance(e, BlockRemoved) for b in for_b for e in b.events), "no eviction"
    left = following.matched(a_ids)
    assert left < FULL
    assert send(a_text) == engine_cached_tokens(left, len(a_ids), INDEX_BLOCK)
    # Its evicted tail, computed again, is stored after the blocks kept (their parent).
    following.receive_until(stored=token_block_hashes(a_ids, INDEX_BLOCK)[left // INDEX_BLOCK :])
    assert following.matched(a_ids) == FULL


def test_a_gateway_following_the_engine_predicts_every_hit(tmp_path: Path) -> None:
    """The loop of ``make test-real``'s KV-events test with ``isocost engine`` as the
    engine: the gateway (pool tokenizer, ``kv_events:``) predicts each answer's cached
    tokens, the engine reports them (``--enable-prompt-tokens-details``), evictions
    included, and ``isocost_prefix_predictions_total`` counts them all exact. Each prompt
    is sent once the gateway's prefix hit for it (``POST /v1/route``) is the one the events
    so far give (the test follows them too): the prompt sent on B's answer could otherwise
    be routed before B's eviction reached the gateway, and be predicted over."""
    tokenizer = _write_tokenizer(tmp_path)
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
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
            f" kv_events: '{endpoint}'}}\n",
        )  # fmt: skip
        (tmp_path / "gateway.yaml").write_text(config)
        serve = ["serve", "--config", str(tmp_path / "gateway.yaml"), "--port", "0"]
        gateway = start_isocost(serve, "isocost serve")
        following = Following(endpoint)
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
        with client, contextlib.closing(following):
            _check_gateway_predictions(gateway, following, client)
    finally:
        if gateway is not None:
            gateway.stop()
        engine.stop()


def _check_gateway_predictions(gateway: Proc, following: Following, client: openai.OpenAI) -> None:

    def complete(text: str) -> int:
        answer = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
        details = answer.usage.prompt_tokens_details if answer.usage else None
        assert details is not None and details.cached_tokens is not None
        return details.cached_tokens

    def gateway_got(_: list[int]) -> bool:
        """Whether the gateway has received a batch (of that prompt or one before)."""
        try:
            wait_for(lambda: _metric(gateway, BATCHES) > 0, JOIN_WAIT_S, "a batch")
        except AssertionError:
            return False
        return True

    _join(complete, following.got, gateway_got)
    before = _predictions(gateway)
    cached: list[int] = []
    for text, ids in (a := _prompt(1), a, _prompt(201), a, a):  # A, A, B (evicting), A, A
        _wait_routed_on_events(gateway, following, text, ids)
        cached.append(complete(text))
        following.receive_holding(ids)  # all its events: the engine holds all of it now
    after = _predictions(gateway)
    assert cached[1] == FULL and 0 < cached[3] < FULL, cached  # B evicted A's tail
    counted = {k: after.get(k, 0) - before.get(k, 0) for k in ("exact", "over", "under")}
    assert counted == {"exact": 5, "over": 0, "under": 0}, (counted, cached)


def _wait_routed_on_events(gateway: Proc, following: Following, text: str, ids: list[int]) -> None:
    """Until the gateway's prefix hit for ``text`` is what the events received give."""
    body = json.dumps({"model": MODEL, "prompt": text, "max_tokens": 1}).encode()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = gateway.url + "/v1/route?kind=completion"
    expected = following.matched(ids)

    def routed() -> int:
        status, _, answer = http("POST", url, body, headers=headers)
        assert status == 200, answer
        return int(answer["cached_tokens"])

    wait_for(lambda: routed() == expected, EVENTS_S, f"{expected} cached", state=routed)


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
