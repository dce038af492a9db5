"""The prefill fit: each replica's prefill terms learned from its TTFTs (``prefillfit``)."""

from __future__ import annotations

import math
import random

import pytest
from conftest import MODEL, Factory, cost_model

from isocost.scheduling.contract import ReplicaSpec, RequestView
from isocost.scheduling.prefillfit import PrefillFit, features
from isocost.scheduling.state import ReplicaSet
from isocost.scheduling.timing import StepCoefficients

# An engine whose costs have another shape than the roofline's (CPU vLLM of a tiny model
# is like this): 40 ms per request and 10 ms per chunk whatever their size, 0.02 ms per
# token, 8 ms per sequence decoding beside the prefill, no attention term (the roofline of
# an 8B model on an A100: 5 ms per chunk, 0.1 ms per token, nothing per request or
# running sequence).
PER_REQUEST_S, PER_CHUNK_S, PER_TOKEN_S, PER_RUNNING_S = 0.040, 0.010, 0.02e-3, 0.008
ANALYTIC = StepCoefficients.fit(cost_model("a100-80g"))
CHUNK = ANALYTIC.prefill_chunk_tokens


def _terms(fit: PrefillFit, slot: int, now: float) -> tuple[float, ...]:
    """``slot``'s priced (s per chunk, per token, per attention pair, per request, per
    running sequence)."""
    c = fit.coefficients(slot, now)
    assert c is not None
    return (
        c.prefill_per_chunk_s,
        c.prefill_per_token_s,
        c.prefill_per_pair_s,
        c.prefill_per_request_s,
        c.prefill_per_running_s,
    )


def _engine_ttft_s(waiting: float, queued: float, new: float, running: float) -> float:
    """Behind ``waiting`` requests of ``queued`` tokens, ``new`` tokens to compute beside
    ``running`` sequences."""
    chunks = math.ceil(queued / CHUNK) + math.ceil(new / CHUNK)
    per_requests = PER_REQUEST_S * (waiting + 1) + PER_RUNNING_S * running
    return per_requests + PER_CHUNK_S * chunks + PER_TOKEN_S * (queued + new)


def _teach(fit: PrefillFit, slot: int, count: int, rng: random.Random) -> None:
    """``count`` first tokens of mixed requests (cached or not, queued or not, beside 0 to
    4 running sequences), 10% noise."""
    for i in range(count):
        queued = rng.choice([0.0, 0.0, 600.0, 3000.0])
        cached = rng.choice([0.0, 512.0])
        running = float(rng.randint(0, 4))
        new = 620.0 - cached
        waiting = queued / 620.0
        observed = _engine_ttft_s(waiting, queued, new, running) * rng.lognormvariate(0.0, 0.1)
        x = features(ANALYTIC, waiting, queued, new, cached, running)
        fit.observe(slot, x, observed, float(i))


def test_the_fit_learns_terms_of_another_shape_and_shrugs_off_a_stall() -> None:
    fit = PrefillFit()
    fit.join(0, "cpu", ANALYTIC)
    assert _terms(fit, 0, 0.0) == pytest.approx(
        (
            ANALYTIC.prefill_per_chunk_s,
            ANALYTIC.prefill_per_token_s,
            ANALYTIC.prefill_per_pair_s,
            0.0,
            0.0,
        )
    )
    shapes = [(0, 0.0, 620.0, 0.0, 0.0), (0, 0.0, 108.0, 512.0, 0.0)]
    shapes += [(2, 1240.0, 620.0, 0.0, 3.0), (5, 3000.0, 108.0, 512.0, 1.0)]

    def worst_error(now: float) -> float:
        priced = fit.coefficients(0, now)
        assert priced is not None
        return max(
            abs(_predicted_s(priced, w, q, n, c, b) / _engine_ttft_s(w, q, n, b) - 1.0)
            for w, q, n, c, b in shapes
        )

    assert worst_error(0.0) > 0.5  # the roofline is far off this engine
    _teach(fit, 0, 100, random.Random(1))
    # The worst is a cached request alone (-27%): when every prompt is one chunk, the
    # per-chunk and per-request terms are nearly one, and the prior splits them.
    assert worst_error(100.0) < 0.3
    # One 3-s stall (a pause the terms do not explain) moves the predictions little.
    fit.observe(0, features(ANALYTIC, 0.0, 0.0, 620.0, 0.0, 0.0), 3.0, 101.0)
    assert worst_error(101.0) < 0.35
    # What each stream decoding beside it adds is learnt: 8 ms here.
    assert _terms(fit, 0, 101.0)[4] == pytest.approx(PER_RUNNING_S, rel=0.4)


def _predicted_s(
    c: StepCoefficients, waiting: float, queued: float, new: float, cached: float, running: float
) -> float:
    """The TTFT ``predict`` gives with ``c``, no KV wait."""
    per_request = c.prefill_per_request_s * (waiting + 1) + c.prefill_per_running_s * running
    return c.prefill_s(queued, 0.0) + c.prefill_s(new, cached) + per_request


def test_terms_stay_physical_however_fast_the_observations() -> None:
    fit = PrefillFit()
    fit.join(0, "a100", ANALYTIC)
    x = features(ANALYTIC, 0.0, 0.0, 4096.0, 0.0, 0.0)
    for i in range(100):  # 1,000x faster than the roofline allows
        fit.observe(0, x, 1e-3 * ANALYTIC.prefill_s(4096, 0), float(i))
    terms = _terms(fit, 0, 100.0)
    lowest = (ANALYTIC.prefill_per_chunk_s, ANALYTIC.prefill_per_token_s, 0.0, 0.0, 0.0)
    assert all(t >= 0.1 * low * (1 - 1e-9) for t, low in zip(terms, lowest, strict=True))


def test_a_replica_starts_from_its_class_and_an_idle_one_is_priced_as_it() -> None:
    fit = PrefillFit()
    fit.join(0, "cpu", ANALYTIC)
    fit.join(1, "cpu", ANALYTIC)
    _teach(fit, 0, 100, random.Random(2))
    learned, idle = _terms(fit, 0, 100.0), _terms(fit, 1, 100.0)
    # Slot 1 saw nothing: it is priced as its class, which learnt what slot 0 did.
    assert idle == pytest.approx(learned, rel=0.05)
    assert idle[0] > 1.5 * ANALYTIC.prefill_per_chunk_s and idle[3] > 0.01
    fit.join(2, "cpu", ANALYTIC)  # added to the warm pool
    assert _terms(fit, 2, 100.0) == pytest.approx(idle, rel=1e-9)
    fit.join(3, "other", ANALYTIC)  # another class starts from the analytic terms
    assert _terms(fit, 3, 100.0) == pytest.approx(_terms(fit, 3, 0.0))
    assert _terms(fit, 3, 100.0)[1] == pytest.approx(ANALYTIC.prefill_per_token_s)


def _serve(replicas: ReplicaSet, names: list[str], prompt: int, now: float) -> float:
    """Dispatch ``names`` to r0 together and answer each one's first token when the engine
    would, in order; the predicted TTFT the last was dispatched with."""
    records = []
    for name in names:
        replicas.on_dispatch(RequestView(name, MODEL, prompt, max_tokens=8), "r0", now)
        records.append(replicas.get("r0").in_flight[name])
    for record in records:
        new = prompt - record.cached_tokens
        ttft = _engine_ttft_s(
            record.queued_requests, record.queued_prefill_tokens, new, record.running_sequences
        )
        replicas.on_first_token(record.request_id, now + ttft)
    for record in records:
        replicas.on_complete(record.request_id, now + 1.0, output_tokens=8)
    return records[-1].predicted_ttft_s


def test_a_replica_set_with_the_fit_prices_what_the_engine_does(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"])
    replicas.set_prefill_fit(True)
    first = _serve(replicas, ["q0"], 620, 0.0)
    assert first == pytest.approx(ANALYTIC.prefill_s(620, 0))  # the analytic prior at first
    for i in range(1, 30):  # one to three at a time, of 320 to 900 tokens
        _serve(replicas, [f"q{i}.{j}" for j in range(1 + i % 3)], 300 + 20 * i, 2.0 * i)
    predicted = _serve(replicas, ["last"], 620, 100.0)
    assert predicted == pytest.approx(_engine_ttft_s(0, 0.0, 620.0, 0.0), rel=0.1)
    assert replicas.get("r0").ttft_factor == 1.0  # the terms learnt it, not a factor
    # A queue ahead is priced by its requests and tokens: four of 620 tokens ahead.
    for i in range(4):
        replicas.on_dispatch(RequestView(f"w{i}", MODEL, 620, max_tokens=8), "r0", 200.0)
    behind = replicas.predict_one(replicas.get("r0").slot, 200.0, 620, 0, 8).ttft_s
    assert behind == pytest.approx(_engine_ttft_s(4, 4 * 620.0, 620.0, 0.0), rel=0.15)
    # Off again: the analytic terms and the factor.
    replicas.set_prefill_fit(False)
    assert replicas.get("r0").coefficients == ANALYTIC


def test_a_replica_added_after_the_fit_started_joins_it() -> None:
    replicas = ReplicaSet()
    replicas.set_prefill_fit(True)
    replicas.add(ReplicaSpec("r0", MODEL, cost_model("a100-80g")))
    for i in range(30):
        _serve(replicas, [f"q{i}.{j}" for j in range(1 + i % 3)], 620, 2.0 * i)
    replicas.add(ReplicaSpec("r1", MODEL, cost_model("a100-80g")))
    learned = replicas.get("r0").prefill_terms_s["1k_tokens"]
    assert replicas.get("r1").prefill_terms_s["1k_tokens"] == pytest.approx(learned, rel=0.05)
