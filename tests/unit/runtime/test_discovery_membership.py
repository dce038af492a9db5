"""What one registration can do to the merge: refuse itself, never the others; and who
wins a clash (the incumbent, then the first registered), as the audit of etcd discovery
found them broken."""

from __future__ import annotations

import pytest

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError
from isocost.gateway.lifecycle import Gateway
from isocost.runtime.config import (
    GatewayConfig,
    PoolConfig,
    ReplicaConfig,
    check_references,
    parse_config,
)
from isocost.runtime.discovery import membership as membership_module
from isocost.runtime.discovery.membership import Membership
from isocost.runtime.discovery.records import MAX_MODEL_NAME, Registration, check_registration

MODEL = "llama-3.1-8b"
TOO_LONG_FOR_A_FILE_NAME = "m" * 300  # a path component over 255 bytes: ENAMETOOLONG


def record(name: str, port: int, **fields: object) -> Registration:
    fields.setdefault("models", [MODEL])
    return Registration(name=name, url=f"http://10.0.0.1:{port}", **fields)  # type: ignore[arg-type]


def merged(membership: Membership, base: GatewayConfig | None = None) -> list[str]:
    """The names of the members after a merge onto ``base``."""
    membership.merge(base or GatewayConfig())
    return [m.record.name for m in membership.members]


@pytest.mark.parametrize(
    "bad",
    [
        record("long-model", 8001, models=[TOO_LONG_FOR_A_FILE_NAME]),
        record("megabyte-model", 8002, models=["M" * 1_000_000]),
        record("long-path", 8003, cost_model="/" + TOO_LONG_FOR_A_FILE_NAME),
    ],
    ids=["300-char-model", "1MB-model", "300-byte-path-component"],
)
def test_a_name_too_long_for_the_file_system_refuses_its_record_alone(bad: Registration) -> None:
    membership = Membership(Catalog.builtin())
    membership.replace("etcd", {"k/bad": bad, "k/good": record("good", 8000)})
    _, refused = membership.merge(GatewayConfig())
    assert [m.record.name for m in membership.members] == ["good"]
    assert [r.key for r in refused] == ["k/bad"]
    assert "longer than" in refused[0].reason or "too long" in refused[0].reason
    membership.replace(
        "etcd", {"k/bad": bad, "k/good": record("good", 8000), "k/new": record("new", 8004)}
    )
    _, again = membership.merge(GatewayConfig())
    assert again == []  # refused once: no second log line, no second count
    assert [m.record.name for m in membership.members] == ["good", "new"]  # later ones join


def test_model_names_are_bounded_and_must_be_given() -> None:
    catalog = Catalog.builtin()
    assert check_registration(record("a", 1, models=["x" * MAX_MODEL_NAME]), catalog)
    for models in [["x" * (MAX_MODEL_NAME + 1)], [], [""]]:
        with pytest.raises(ConfigError) as info:
            check_registration(record("a", 1, models=models), catalog)
        assert info.value.key == "registration.models"


def test_a_config_file_naming_such_a_path_is_refused_in_one_line() -> None:
    text = (
        f"pools: [{{model: {MODEL}, replicas: [{{url: 'http://h:1',"
        f" cost_model: /{TOO_LONG_FOR_A_FILE_NAME}}}]}}]"
    )
    with pytest.raises(ConfigError) as info:
        check_references(parse_config(text, "g.yaml"), Catalog.builtin(), "g.yaml")
    assert info.value.key == "pools[0].replicas[0].cost_model"
    assert "File name too long" in str(info.value)


def test_whatever_one_record_raises_refuses_it_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    checked = membership_module.check_registration

    def check(record: Registration, catalog: Catalog, *, source: str = "") -> str:
        if record.name == "cursed":
            raise OSError(36, "File name too long")
        return checked(record, catalog, source=source)

    monkeypatch.setattr(membership_module, "check_registration", check)
    membership = Membership(Catalog.builtin())
    membership.replace("etcd", {"a": record("cursed", 8000), "b": record("fine", 8001)})
    _, refused = membership.merge(GatewayConfig())
    assert [m.record.name for m in membership.members] == ["fine"]
    assert [(r.key, r.reason) for r in refused] == [("a", "OSError: [Errno 36] File name too long")]


@pytest.mark.parametrize("tp", [65, 2**70])
def test_a_tp_past_64_is_refused_by_discovery_the_file_and_the_admin_api(tp: int) -> None:
    catalog = Catalog.builtin()
    with pytest.raises(ConfigError, match="must be <= 64"):
        check_registration(record("huge", 8000, tp=tp), catalog)
    with pytest.raises(ConfigError, match="must be <= 64"):
        parse_config(f"pools: [{{model: m, replicas: [{{url: 'http://h:1', tp: {tp}}}]}}]", "g")
    gateway = Gateway(GatewayConfig(), catalog)
    with pytest.raises(ConfigError, match="must be <= 64"):
        gateway.add_replica(MODEL, ReplicaConfig(url="http://10.0.0.1:1", tp=tp))
    assert check_registration(record("big", 8000, tp=64), catalog)


def test_an_incumbent_keeps_its_url_and_name_against_a_later_duplicate() -> None:
    membership = Membership(Catalog.builtin())
    serving = record("r1", 8000)
    membership.replace("etcd", {"/replicas/r1": serving})
    assert merged(membership) == ["r1"]
    same_url = record("dupurl", 8000)  # keys that sort before the incumbent's
    same_name = record("r1", 8001)
    membership.replace(
        "etcd",
        {"/replicas/r1": serving, "/replicas/bad-url": same_url, "/replicas/bad-name": same_name},
    )
    _, refused = membership.merge(GatewayConfig())
    assert [(m.key, m.record.name) for m in membership.members] == [("/replicas/r1", "r1")]
    reasons = {r.key: r.reason for r in refused}
    assert "already a replica" in reasons["/replicas/bad-url"]
    assert "named 'r1' already exists" in reasons["/replicas/bad-name"]
    membership.replace("etcd", {"/replicas/bad-url": same_url, "/replicas/bad-name": same_name})
    assert merged(membership) == ["dupurl", "r1"]  # the incumbent gone, its URL and name free


def test_among_newcomers_the_first_registered_wins_whatever_the_key() -> None:
    membership = Membership(Catalog.builtin())
    first, second = record("first", 8000), record("second", 8000)
    membership.replace("etcd", {"z/first": first, "a/second": second})  # registration order
    assert merged(membership) == ["first"]


def test_the_file_wins_over_an_incumbent_member() -> None:
    membership = Membership(Catalog.builtin())
    membership.replace("etcd", {"k": record("m", 8000)})
    assert merged(membership) == ["m"]
    listed = ReplicaConfig(url="http://10.0.0.1:8000", name="listed")
    base = GatewayConfig(pools=[PoolConfig(model=MODEL, replicas=[listed])])
    assert merged(membership, base) == []


def test_loopback_names_are_compared_as_written() -> None:
    membership = Membership(Catalog.builtin())
    local = Registration(name="a", url="http://localhost:8000", models=[MODEL])
    loopback = Registration(name="b", url="http://127.0.0.1:8000", models=[MODEL])
    membership.replace("etcd", {"a": local, "b": loopback})
    assert merged(membership) == ["a", "b"]  # no DNS: possibly ::1 and 127.0.0.1, two listeners
