"""API keys, budgets and the admin token."""

from __future__ import annotations

import asyncio
import json

import pytest

from isocost.gateway.auth import (
    ApiKey,
    Authenticator,
    TokenBucket,
    bearer_token,
    go_duration,
    rate_limit_headers,
)
from isocost.gateway.intake import Intake, Rejection
from isocost.gateway.routing import GatewayRequest
from isocost.gateway.upstreams import Pool
from isocost.runtime.config import ApiKeyConfig, AuthConfig, GatewayConfig


def test_bucket_refuses_with_the_wait_then_refills() -> None:
    bucket = TokenBucket(60, now=0.0)  # one per second
    for _ in range(60):
        assert bucket.take(1, 0.0) == 0.0
    assert bucket.take(1, 0.0) == pytest.approx(1.0)
    assert bucket.take(1, 0.5) == pytest.approx(0.5)
    assert bucket.take(1, 1.0) == 0.0


def test_request_larger_than_the_bucket_waits_for_a_full_bucket() -> None:
    bucket = TokenBucket(100, now=0.0)
    assert bucket.take(500, 0.0) == 0.0  # capped at the capacity: never refused forever
    assert bucket.take(500, 30.0) == pytest.approx(30.0)


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (None, None),
        ("", None),
        ("Bearer abc", "abc"),
        ("bearer  abc ", "abc"),
        ("Basic abc", None),
        ("Bearer", None),
    ],
)
def test_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


def test_keys_and_admin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEY_B", "secret-b")
    auth = Authenticator(
        AuthConfig(
            admin_token="adm",
            api_keys=[
                ApiKeyConfig(name="a", key="secret-a", requests_per_minute=10),
                ApiKeyConfig(name="b", key_env="KEY_B"),
            ],
        ),
        now=0.0,
    )
    assert auth.enabled and auth.admin_enabled
    key_a, key_b = auth.key_for("secret-a"), auth.key_for("secret-b")
    assert key_a is not None and key_a.name == "a" and key_a.requests is not None
    assert key_b is not None and key_b.name == "b" and key_b.requests is None
    assert auth.key_for("secret-") is None and auth.key_for(None) is None
    assert auth.is_admin("adm") and not auth.is_admin("secret-a") and not auth.is_admin(None)


def test_no_keys_means_open_and_no_admin() -> None:
    auth = Authenticator(AuthConfig(), now=0.0)
    assert not auth.enabled and not auth.admin_enabled and not auth.is_admin("")


def test_spending_after_the_fact_goes_below_empty_and_delays_the_next_take() -> None:
    bucket = TokenBucket(per_minute=60, now=0.0)  # one token a second
    bucket.spend(100, now=0.0)  # an uncapped answer's output, charged once known
    assert bucket.take(1, now=0.0) == pytest.approx(41.0)  # 40 below empty, then 1 more
    assert bucket.take(1, now=41.0) == 0.0


def test_a_bucket_level_refills_to_the_capacity_without_being_taken() -> None:
    bucket = TokenBucket(per_minute=60, now=0.0)
    bucket.spend(90, now=0.0)
    assert bucket.level_at(10.0) == pytest.approx(-20.0)
    assert bucket.level_at(10.0) == pytest.approx(-20.0)  # reading it takes nothing
    assert bucket.level_at(1000.0) == 60.0


class Spends:
    """The state bus's side of the intake: what it was told this gateway charged, how
    often its in-flight changed (``changes``), and what the peers hold (``peer_holding``)."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, int, int]] = []
        self.changes = 0
        self.peer_holding: dict[str, int] = {}

    def spent(self, key: str, *, requests: int = 0, tokens: int = 0) -> None:
        self.heard.append((key, requests, tokens))

    def holding_changed(self) -> None:
        self.changes += 1

    def held_by_peers(self, key: str) -> int:
        return self.peer_holding.get(key, 0)


MODEL = "llama-3.1-8b"
KEYED = {"Authorization": "Bearer secret-a"}


def keyed_intake(**budgets: int) -> Intake:
    config = GatewayConfig(
        auth=AuthConfig(api_keys=[ApiKeyConfig(name="team-a", key="secret-a", **budgets)])
    )
    return Intake(config, {MODEL: Pool(MODEL, "round_robin")}, block_tokens=16, now=0.0)


def completion(intake: Intake, max_tokens: int | None) -> GatewayRequest:
    """One chat completion through the intake's checks, as the gateway makes them."""
    key = intake.check_headers(KEYED, 0.0)
    body: dict[str, object] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return asyncio.run(
        intake.routing_request(json.dumps(body).encode(), KEYED, chat=True, key=key, arrived_at=0.0)
    )


def test_what_the_intake_charges_a_key_is_told_to_the_peers() -> None:
    intake = keyed_intake(requests_per_minute=60, tokens_per_minute=600)
    spends = intake.peers = Spends()
    request = completion(intake, max_tokens=100)
    prompt = request.view.prompt_tokens
    assert spends.heard == [("team-a", 1, 0), ("team-a", 0, prompt + 100)]
    with pytest.raises(Rejection, match="tokens per minute"):
        completion(intake, max_tokens=550)  # over what is left: charged nothing
    assert spends.heard[-1] == ("team-a", 1, 0)  # the request budget it did pass
    uncapped = completion(intake, max_tokens=None)
    intake.charge_output(uncapped, 70, now=0.0)  # its output, once known
    assert spends.heard[-3:] == [("team-a", 1, 0), ("team-a", 0, prompt), ("team-a", 0, 70)]


def test_a_request_over_the_bucket_charges_and_tells_the_capacity() -> None:
    intake = keyed_intake(tokens_per_minute=50)
    spends = intake.peers = Spends()
    completion(intake, max_tokens=1000)
    assert spends.heard == [("team-a", 0, 50)]  # what the peers must take: what was taken


def test_a_peer_spend_delays_this_gateway_and_shows_in_the_levels() -> None:
    intake = keyed_intake(requests_per_minute=4, tokens_per_minute=10_000)
    assert intake.charge_peer("team-a", 4, 2_000, now=0.0)
    assert not intake.charge_peer("team-z", 1, 1, now=0.0)  # not a key here
    with pytest.raises(Rejection, match="requests per minute") as refused:
        intake.check_headers(KEYED, 0.0)
    assert refused.value.retry_after_s == pytest.approx(15.0)  # one request's refill
    assert dict(((k, b), v) for k, b, v in intake.budget_levels(0.0)) == {
        ("team-a", "requests"): pytest.approx(0.0),
        ("team-a", "tokens"): pytest.approx(8_000.0),
    }


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.0004, "0s"), (0.02, "20ms"), (1.5, "1.5s"), (59.9996, "1m0s"),
     (360, "6m0s"), (3723.25, "1h2m3.25s")],
)  # fmt: skip
def test_durations_read_as_go_writes_them(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


def test_rate_limit_headers_say_the_limit_what_is_left_and_when_it_is_full() -> None:
    key = ApiKey("a", b"s", TokenBucket(60, now=0.0), TokenBucket(6000, now=0.0))
    assert key.requests is not None and key.tokens is not None
    key.requests.take(3, now=0.0)
    key.tokens.spend(9000, now=0.0)  # below empty: nothing left, a minute and a half
    assert rate_limit_headers(key, now=1.0) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "58",
        "x-ratelimit-reset-requests": "2s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "1m29s",
    }
    assert rate_limit_headers(ApiKey("b", b"t", None, None), now=1.0) == {}


def test_a_keys_places_in_flight_count_its_peers_and_free_at_the_end() -> None:
    intake = keyed_intake(max_in_flight=3)
    peers = intake.peers = Spends()
    first, second = completion(intake, 5), completion(intake, 5)
    intake.admit(first)
    peers.peer_holding["team-a"] = 1  # another gateway holds one of the three
    intake.admit(second)
    assert intake.in_flight == {"team-a": 2} and peers.changes == 2  # what the bus reads
    with pytest.raises(Rejection, match="3 requests in flight") as refused:
        intake.admit(completion(intake, 5))
    assert (refused.value.status, refused.value.reason, refused.value.key) == (
        429,
        "key_in_flight",
        "team-a",
    )
    intake.release(first)
    assert intake.in_flight == {"team-a": 1} and peers.changes == 3
    intake.admit(first)  # its place is free again
    for request in (first, second):
        intake.release(request)
    assert not intake.in_flight and peers.changes == 6
