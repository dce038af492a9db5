"""Peers and etcd records nested deeper than msgspec follows: msgspec raises RecursionError
there, no DecodeError, which got past the ``except`` for every other undecodable input.
Such a message must take the path of any other undecodable one."""

from __future__ import annotations

import msgspec
import pytest
from test_bus import dispatch, in_flight
from test_bus_robustness import ENCODE, Heard, logged, rejected

from isocost.runtime.bus import Batch
from isocost.runtime.discovery.records import Malformed, decode_registration

# A batch whose fifth element, past the four fields msgspec reads, is nested 100,000 deep:
# msgspec skips it, recursively. (100,000 ``\x91`` alone is no Batch at the first level.)
DEEP_BATCH = b"\x95" + ENCODE("a") + ENCODE(1) + ENCODE(0.0) + b"\x90" + b"\x91" * 100_000


def test_the_deep_message_is_nested_past_msgspec() -> None:
    with pytest.raises(RecursionError):
        msgspec.msgpack.decode(DEEP_BATCH, type=Batch)


def test_a_peer_message_nested_too_deep_is_dropped_and_counted_as_undecodable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: RecursionError out of ``receive``, which stopped the subscriber (the bus
    down, every peer's view dropped) until supervise restarted it."""
    heard = Heard()
    target, bus = heard.target, heard.bus
    bus.receive(DEEP_BATCH, now=0.0)
    assert rejected(target, "undecodable") == 1
    assert len(logged(caplog, "bus_rejected")) == 1
    bus.receive(ENCODE(Batch("a", 1, 0.0, [dispatch("r1")])), now=0.1)  # it goes on
    assert in_flight(target) == ["a/r1"]


@pytest.mark.parametrize(
    "value",
    [
        b'{"url": "http://10.0.0.1:8000", "x": ' + b"[" * 100_000,
        b'{"url": "http://10.0.0.1:8000", "extra": ' + b'{"a": ' * 50_000,
    ],
)
def test_an_etcd_record_nested_too_deep_is_malformed(value: bytes) -> None:
    """Before: RecursionError out of ``decode_registration``, past the etcd provider's
    handling of a malformed record."""
    decoded = decode_registration(value)
    assert isinstance(decoded, Malformed) and decoded.reason.startswith("not JSON:"), decoded
