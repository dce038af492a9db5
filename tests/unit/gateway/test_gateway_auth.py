"""API keys, budgets and the admin token."""

from __future__ import annotations

import pytest

from isocost.gateway.auth import Authenticator, TokenBucket, bearer_token
from isocost.runtime.config import ApiKeyConfig, AuthConfig


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
