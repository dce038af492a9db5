"""``discovery.max_replicas``: the members one provider may add, whatever its source lists.
Who stays is who wins a clash (the incumbents, then the first registered), so a flood
never evicts a replica already routed to; what lies past the bound is not even checked."""

from __future__ import annotations

import pytest

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError
from isocost.gateway.lifecycle import Gateway
from isocost.runtime.config import MAX_DISCOVERED_REPLICAS, GatewayConfig, parse_config
from isocost.runtime.discovery import membership as membership_module
from isocost.runtime.discovery.membership import Membership
from isocost.runtime.discovery.records import Malformed, Registration

MODEL = "llama-3.1-8b"


def record(name: str, **fields: object) -> Registration:
    """A replica at a URL of its own: no two clash."""
    return Registration(name=name, url=f"http://{name}:8000", models=[MODEL], **fields)  # type: ignore[arg-type]


def registrations(*names: str) -> dict[str, Registration | Malformed]:
    """One record per name, keyed by it, in the order given (the order they registered)."""
    return {name: record(name) for name in names}


def members(membership: Membership) -> list[str]:
    membership.merge(GatewayConfig())
    return [m.key for m in membership.members]


def test_each_provider_adds_its_first_registered_up_to_the_bound() -> None:
    membership = Membership(Catalog.builtin(), max_replicas=3)
    membership.replace("etcd", registrations("e5", "e1", "e4", "e2", "e3"))
    membership.replace("kubernetes", registrations("k1", "k2"))
    assert members(membership) == ["e5", "e1", "e4", "k1", "k2"]  # not the keys' sort order
    assert membership.dropped == {"etcd": 2}  # the bound is per provider
    assert members(membership) == ["e5", "e1", "e4", "k1", "k2"]  # merged again: the same


def test_a_flood_listed_before_the_incumbents_never_evicts_them() -> None:
    membership = Membership(Catalog.builtin(), max_replicas=2)
    membership.replace("kubernetes", registrations("z-serving-1", "z-serving-2"))
    assert members(membership) == ["z-serving-1", "z-serving-2"]
    # a re-list in name order puts a selector's flood of new endpoints first
    flood = registrations(*(f"a-{i:05d}" for i in range(5000)))
    membership.replace("kubernetes", {**flood, **registrations("z-serving-1", "z-serving-2")})
    assert members(membership) == ["z-serving-1", "z-serving-2"]
    assert membership.dropped == {"kubernetes": 5000}
    del flood["a-00000"]  # one leaves, and one incumbent: the first registered newcomer
    membership.replace("kubernetes", {**flood, **registrations("z-serving-2")})
    assert members(membership) == ["z-serving-2", "a-00001"]
    assert membership.dropped == {"kubernetes": 4998}
    membership.replace("kubernetes", registrations("a-00001"))
    assert members(membership) == ["a-00001"]
    assert membership.dropped == {}


def test_only_accepted_members_take_a_place_and_the_rest_is_not_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checked: list[str] = []
    check = membership_module.check_registration

    def counting(record: Registration, catalog: Catalog, *, source: str = "") -> str:
        checked.append(record.name)
        return check(record, catalog, source=source)

    monkeypatch.setattr(membership_module, "check_registration", counting)
    membership = Membership(Catalog.builtin(), max_replicas=2)
    records: dict[str, Registration | Malformed] = {
        "broken": Malformed("not JSON"),
        "bad-gpu": record("bad-gpu", gpu="abacus-1"),
        **registrations("good-1", "good-2"),
        **registrations(*(f"flood-{i}" for i in range(10_000))),
    }
    membership.replace("etcd", records)
    _, refused = membership.merge(GatewayConfig())
    assert [m.key for m in membership.members] == ["good-1", "good-2"]
    assert sorted(r.key for r in refused) == ["bad-gpu", "broken"]  # still said, once
    assert membership.dropped == {"etcd": 10_000}
    assert checked == ["bad-gpu", "good-1", "good-2"]  # a flood costs no checks


def test_the_bound_is_configured_per_gateway_and_must_be_positive() -> None:
    catalog = Catalog.builtin()
    assert GatewayConfig().discovery.max_replicas == MAX_DISCOVERED_REPLICAS == 1024
    assert Gateway(GatewayConfig(), catalog).membership.max_replicas == 1024
    config = parse_config("discovery: {max_replicas: 2}", "g.yaml")
    assert Gateway(config, catalog).membership.max_replicas == 2
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match="must be >= 1") as info:
            parse_config(f"discovery: {{max_replicas: {bad}}}", "g.yaml")
        assert info.value.key == "discovery.max_replicas"
    with pytest.raises(ConfigError) as info:
        parse_config("discovery: {max_replicas: many}", "g.yaml")
    assert info.value.key == "discovery.max_replicas"
