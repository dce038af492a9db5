"""The one host check behind replica URLs and KV pull addresses."""

from __future__ import annotations

import pytest

from isocost.core.hosts import is_host


@pytest.mark.parametrize(
    "text",
    ["127.0.0.1", "::1", "vllm-0.vllm.default.svc.cluster.local", "engine_a", "h100-7", "a."],
)
def test_hosts(text: str) -> None:
    assert is_host(text)


@pytest.mark.parametrize(
    "text",
    [
        "127.1",  # shorthand IPv4: some resolvers take it, the HTTP client does not
        "2130706433",
        "0",
        "127.0.0.1:8000",  # a port
        "127.0.0.1:18001/admin/fault?",  # a path: once the engine's own admin API
        "user@host",
        "fe80::1%eth0",  # a zone may hold any character
        "-h-",
        "a..b",
        "h\r\nx",
        "",
        "a" * 254,
    ],
)
def test_not_hosts(text: str) -> None:
    assert not is_host(text)
