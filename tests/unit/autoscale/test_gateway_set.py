"""Several gateways in front of one fleet, read and acted on as one (``GatewaySet``),
found by name (``GatewayAddresses``: one gateway per address, as they come and go): the
merge of their snapshots, counters summed across restarts and late first readings,
actions on every gateway (one that does not list the replica has nothing to do; an
addition one refuses is taken back from the others), and the loop on such a set:
arrivals through any gateway count, a scale-in drains on each and waits for each one's
requests, and a gateway down leaves the others to decide on but holds every stop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from test_autoscale_loop import CONFIG, GPU, Clock
from test_loop_bad_input import Actuator, Gateway, failures, make_loop, scale_in, until

from isocost.autoscale import (
    AdminClient,
    FleetSnapshot,
    GatewayAddresses,
    GatewayCounters,
    GatewayError,
    GatewaySet,
    ReplicaRow,
    merge_snapshots,
    read_snapshot,
)
from isocost.core.catalog import Catalog
from isocost.gateway.app import build_app
from isocost.gateway.server import load_gateway
from isocost.runtime.config import parse_config

ADMIN_TOKEN = "admin-set-5d1"


class Member(Gateway):
    """One of several gateways: ``down`` refuses every call as an unreachable one does;
    a replica it does not list is a 404, as the admin API answers."""

    def __init__(self, url: str, names: list[str]) -> None:
        super().__init__(names)
        self.url = url
        self.down = False
        self.posted: list[dict[str, Any]] = []
        self.workers_missing: list[int] = []  # serve --workers: workers that did not answer

    def _admin(self, action: str, name: str, change: Callable[[], object]) -> None:
        if self.down:
            raise GatewayError(f"{action}: Connection refused")
        if name not in self.rows:
            self.calls.append((action, name))
            raise GatewayError(f"{action}: HTTP 404 no replica named {name!r}", 404)
        super()._admin(action, name, change)

    async def snapshot(self) -> Any:
        if self.down:
            raise GatewayError("GET /admin/snapshot: Connection refused")
        answer = await super().snapshot()
        return {**answer, "workers": {"answered": [0], "missing": self.workers_missing}}

    async def counters(self) -> GatewayCounters:
        if self.down:
            raise GatewayError("GET /metrics: Connection refused")
        return await super().counters()

    async def add(self, model: str, replica: dict[str, Any]) -> None:
        name = replica["name"]
        row = {"name": name, "gpu": GPU, "state": "healthy", "in_flight": 0}
        if self.down:
            raise GatewayError("add: Connection refused")
        Gateway._admin(self, "add", name, lambda: self.rows.setdefault(name, row))

    async def post_status(self, status: Any) -> None:
        if self.down:
            raise GatewayError("POST /admin/autoscaler: Connection refused")
        self.posted.append(dict(status))


def row(name: str, state: str = "healthy", in_flight: int = 0, **fields: Any) -> ReplicaRow:
    return ReplicaRow(name, state, in_flight, gpu=GPU, **fields)


def snapshot(*rows: ReplicaRow, queue: int = 0, live: list[str] | None = None) -> FleetSnapshot:
    raw: dict[str, Any] = {
        "pools": [{"model": "m", "queue_depth": queue}],
        "replicas": [msgspec.to_builtins(r) for r in rows],
    }
    if live is not None:
        raw["autoscaler"] = {"live_instances": live}
    return msgspec.convert(raw, FleetSnapshot)


# -- the merge ---------------------------------------------------------------------------


def test_a_replica_several_gateways_list_is_one_row_with_their_requests_summed() -> None:
    a = snapshot(row("r0", in_flight=2, engine_waiting=3), row("r1"), queue=4, live=["x"])
    b = snapshot(row("r0", in_flight=5, engine_waiting=1), row("r2"), queue=1, live=["y"])
    merged = merge_snapshots([a, b], {})
    assert [r.name for r in merged.replicas] == ["r0", "r1", "r2"]
    r0 = merged.replicas[0]
    assert (r0.in_flight, r0.engine_waiting) == (7, 3)  # each counts its own; one engine
    assert [(p.model, p.queue_depth) for p in merged.pools] == [("m", 5)]
    assert merged.autoscaler is not None and merged.autoscaler.live_instances == ["x", "y"]


@pytest.mark.parametrize(
    ("states", "merged"),
    [
        (["drained", "healthy"], "healthy"),  # routed to by one: it serves
        (["drained", "ejected"], "ejected"),
        (["ejected", "healthy"], "healthy"),
        (["drained", "removing"], "removing"),
        (["drained", "drained"], "drained"),
    ],
)
def test_a_replica_serves_if_any_gateway_routes_to_it(states: list[str], merged: str) -> None:
    readings = [snapshot(row("r0", state)) for state in states]
    (replica,) = merge_snapshots(readings, {}).replicas
    assert replica.state == merged
    serving = {"healthy", "ejected"}
    assert replica.partly_drained == (merged in serving and not set(states) <= serving)


@pytest.mark.parametrize(
    ("marks", "merged"),
    [
        (["autoscale:a", "autoscale:a"], "autoscale:a"),
        (["autoscale:a", "autoscale:b"], None),  # drained again in another name somewhere
        (["autoscale:a", msgspec.UNSET], "autoscale:a"),  # a gateway too old to say
        ([msgspec.UNSET, msgspec.UNSET], msgspec.UNSET),
    ],
)
def test_a_drain_mark_is_the_one_the_gateways_agree_on(marks: list[Any], merged: Any) -> None:
    readings = [snapshot(row("r0", "drained", drained_by=mark)) for mark in marks]
    assert merge_snapshots(readings, {}).replicas[0].drained_by == merged


# -- counters ----------------------------------------------------------------------------


def test_counters_sum_each_gateways_growth_across_its_restart_and_a_late_first_reading() -> None:
    async def scenario() -> None:
        a, b = Member("http://a", ["r0"]), Member("http://b", ["r0"])
        a.answered, b.answered = 100, 40
        b.down = True
        gateways = GatewaySet([a, b])
        first = await gateways.counters()
        assert first.answered["r0"] == (100, 100)  # a's history: the baseline
        a.answered, b.answered, b.down = 110, 900, False
        second = await gateways.counters()
        assert second.since(first).answered["r0"] == (10, 10)  # b's history is no arrival
        a.answered, b.answered = 3, 905  # a restarted: its 3 are new
        third = await gateways.counters()
        assert third.since(second).answered["r0"] == (8, 8)
        a.down = True
        b.answered = 915
        fourth = await gateways.counters()
        assert fourth.since(third).answered["r0"] == (10, 10)
        a.down, a.answered = False, 9  # its growth while unread counts now
        assert (await gateways.counters()).since(fourth).answered["r0"] == (6, 6)
        b.down = True
        with pytest.raises(GatewayError, match=r"http://a: .*http://b: "):
            a.down = True
            await gateways.counters()

    asyncio.run(scenario())


# -- actions -----------------------------------------------------------------------------


def test_a_drain_goes_to_every_gateway_that_lists_the_replica() -> None:
    async def scenario() -> None:
        a, b = Member("http://a", ["r0", "r1"]), Member("http://b", ["r0"])
        gateways = GatewaySet([a, b])
        await gateways.drain("r1", "autoscale:x")  # b does not list it: nothing to do there
        assert a.rows["r1"]["state"] == "drained" and ("drain", "r1") in b.calls
        with pytest.raises(GatewayError) as none_lists:
            await gateways.drain("r9", "autoscale:x")
        assert none_lists.value.status == 404
        b.down = True
        with pytest.raises(GatewayError, match=r"^http://b: drain: Connection refused$"):
            await gateways.drain("r0", "autoscale:x")
        assert a.rows["r0"]["state"] == "drained"  # done where it could be: retried on all

    asyncio.run(scenario())


def test_an_addition_one_gateway_refuses_is_taken_back_from_the_others() -> None:
    async def scenario() -> None:
        a, b = Member("http://a", []), Member("http://b", [])
        b.refuse["add"] = 1
        gateways = GatewaySet([a, b])
        with pytest.raises(GatewayError, match="http://b"):
            await gateways.add("m", {"url": "http://e", "name": "e"})
        assert a.rows == {} and ("remove", "e") in a.calls  # no gateway routes to it
        await gateways.add("m", {"url": "http://e", "name": "e"})
        assert "e" in a.rows and "e" in b.rows

    asyncio.run(scenario())


def test_status_posted_to_every_gateway_and_a_down_one_reported() -> None:
    async def scenario() -> None:
        a, b = Member("http://a", []), Member("http://b", [])
        b.down = True
        with pytest.raises(GatewayError, match=r"^http://b: POST /admin/autoscaler"):
            await GatewaySet([a, b]).post_status({"instance": "x"})
        assert a.posted == [{"instance": "x"}]  # each dashboard that can be reached shows it

    asyncio.run(scenario())


def _gateway_app(listing: list[tuple[str, str]]) -> web.Application:
    """A real gateway's app listing these (name, URL) replicas (closed ports: nothing is
    routed here)."""
    replicas = "".join(
        f"      - {{url: '{url}', name: {name}, gpu: {GPU}, cost_model: llama-3.1-8b}}\n"
        for name, url in listing
    )
    text = f"""
pools:
  - model: m
    replicas:
{replicas}
auth:
  admin_token: {ADMIN_TOKEN}
"""
    return build_app(load_gateway(parse_config(text, "test"), Catalog.builtin(), None))


@asynccontextmanager
async def _real_gateways(*listings: list[tuple[str, str]]) -> AsyncIterator[GatewaySet]:
    """A GatewaySet of AdminClients on real gateway apps (in process), one per listing."""
    servers = [TestServer(_gateway_app(listing)) for listing in listings]
    async with aiohttp.ClientSession() as session:
        for server in servers:
            await server.start_server()
        try:
            urls = [str(server.make_url("")).rstrip("/") for server in servers]
            yield GatewaySet([AdminClient(session, url, ADMIN_TOKEN) for url in urls])
        finally:
            for server in servers:
                await server.close()


def test_real_gateways_drain_where_listed_and_answer_404_where_not() -> None:
    async def scenario() -> None:
        only_a = ("r1", "http://127.0.0.1:9")
        both = ("r0", "http://127.0.0.1:11")
        async with _real_gateways([both, only_a], [both]) as gateways:
            await gateways.drain("r1", "autoscale:x")
            merged = read_snapshot(await gateways.snapshot())
            states = {r.name: (r.state, r.drained_by) for r in merged.replicas}
            assert states["r1"] == ("drained", "autoscale:x")
            assert states["r0"][0] in ("healthy", "ejected")  # not drained: no engine here
            with pytest.raises(GatewayError) as none_lists:
                await gateways.undrain("r9")
            assert none_lists.value.status == 404
            await gateways.remove("r1")

    asyncio.run(scenario())


class Addresses(GatewayAddresses):
    """Host names resolved from ``table`` (a name missing from it does not resolve)."""

    def __init__(self, urls: list[str], make: Any) -> None:
        super().__init__(urls, make)
        self.table: dict[str, list[str]] = {}

    async def lookup(self, host: str, port: int) -> list[str]:
        if host not in self.table:
            raise OSError(f"{host}: Name or service not known")
        return self.table[host]


def test_a_name_with_several_addresses_is_a_gateway_per_address_as_they_come_and_go() -> None:
    """A headless Service names each gateway Pod: every address is read (each one's
    replicas merged), with the name as the Host header; a Pod gone is no longer read,
    and a failed lookup keeps the last addresses."""

    async def scenario() -> None:
        seen_hosts: list[str] = []

        @web.middleware
        async def host_seen(request: web.Request, handler: Any) -> web.StreamResponse:
            seen_hosts.append(request.host)
            return await handler(request)

        apps = [
            _gateway_app([("r0", "http://127.0.0.1:9")]),
            _gateway_app([("r1", "http://127.0.0.1:11")]),
        ]
        for app in apps:
            app.middlewares.append(host_seen)
        first = TestServer(apps[0], host="127.0.0.1")
        await first.start_server()
        second = TestServer(apps[1], host="127.0.0.2", port=first.port)
        await second.start_server()
        try:
            async with aiohttp.ClientSession() as session:
                url = f"http://gateways.inference:{first.port}"
                addresses = Addresses(
                    [url], lambda u, host: AdminClient(session, u, ADMIN_TOKEN, host)
                )
                addresses.table["gateways.inference"] = ["127.0.0.1", "127.0.0.2"]
                gateways = GatewaySet(await addresses.resolve())
                assert [m.url for m in gateways.members] == [
                    f"http://127.0.0.1:{first.port}",
                    f"http://127.0.0.2:{first.port}",
                ]
                names = [r.name for r in read_snapshot(await gateways.snapshot()).replicas]
                assert names == ["r0", "r1"]
                assert set(seen_hosts) == {f"gateways.inference:{first.port}"}
                addresses.table["gateways.inference"] = ["127.0.0.2"]  # the first Pod gone
                gateways.set_members(await addresses.resolve())
                names = [r.name for r in read_snapshot(await gateways.snapshot()).replicas]
                assert names == ["r1"]
                del addresses.table["gateways.inference"]  # DNS down: the last addresses
                assert [m.url for m in await addresses.resolve()] == [
                    f"http://127.0.0.2:{first.port}"
                ]
        finally:
            await first.close()
            await second.close()

    asyncio.run(scenario())


def test_real_lookups_an_ip_is_itself_and_a_name_never_resolved_is_read_as_given() -> None:
    async def scenario() -> None:
        too_long = "x" * 64  # a DNS label of 64: IDNA refuses it (UnicodeError)
        urls = ["http://localhost:8080", "http://10.1.2.3:8080", "http://nope.invalid:8080"]
        urls.append(f"http://{too_long}.inference:8080")
        addresses = GatewayAddresses(urls, lambda url, host: Member(url, []))
        resolved = [member.url for member in await addresses.resolve()]
        assert "http://127.0.0.1:8080" in resolved
        assert resolved[-3:] == urls[-3:]  # an IP is itself; a name never resolved, as given

    asyncio.run(scenario())


# -- the loop on several gateways -----------------------------------------------------------


class EveryGatewayActuator(Actuator):
    """Stops that assert no gateway has a request in flight on the victim."""

    def __init__(self, members: list[Member]) -> None:
        super().__init__(members[0])
        self.members = members

    async def stop(self, name: str, gpu: str, desired: int) -> None:
        busy = {m.url: m.rows[name]["in_flight"] for m in self.members if name in m.rows}
        assert not any(busy.values()), f"stopped with requests in flight: {busy}"
        await super().stop(name, gpu, desired)


def test_arrivals_through_any_gateway_start_replicas() -> None:
    async def scenario() -> None:
        clock = Clock()
        a, b = Member("http://a", ["r0"]), Member("http://b", ["r0"])
        actuator = EveryGatewayActuator([a, b])
        loop = make_loop(GatewaySet([a, b]), clock, actuator)  # type: ignore[arg-type]
        for answered in (0, 10):  # the first reading, then 10 requests through b only
            b.answered = answered
            clock.now += CONFIG.interval_s
            await loop.tick()
        await loop.settle()
        assert actuator.started == [3, 3]  # read through a alone, none would start

    asyncio.run(scenario())


def test_a_scale_in_drains_on_every_gateway_and_waits_for_each_ones_requests() -> None:
    async def scenario() -> None:
        clock = Clock()
        a, b = Member("http://a", ["r0", "r1"]), Member("http://b", ["r0", "r1"])
        loop = make_loop(GatewaySet([a, b]), clock, EveryGatewayActuator([a, b]))  # type: ignore[arg-type]
        victim = await scale_in(loop, clock)
        b.rows[victim]["in_flight"] = 5  # b's requests only: a alone would say idle
        await loop.settle()
        assert [c for c, n in a.calls if n == victim] == ["drain", "stop", "remove"]
        assert [c for c, n in b.calls if n == victim] == ["drain", "remove"]
        assert victim not in a.rows | b.rows

    asyncio.run(scenario())


def test_a_gateway_down_leaves_the_others_to_decide_and_holds_the_stop_until_read() -> None:
    async def scenario() -> None:
        clock = Clock()
        a, b = Member("http://a", ["r0", "r1"]), Member("http://b", ["r0", "r1"])
        loop = make_loop(GatewaySet([a, b]), clock, EveryGatewayActuator([a, b]))  # type: ignore[arg-type]
        victim = await scale_in(loop, clock)
        a.rows[victim]["in_flight"] = 10**6  # a's requests, past the drain deadline
        await until(lambda: ("drain", victim) in a.calls and ("drain", victim) in b.calls)
        a.down = True
        clock.now += CONFIG.interval_s
        tick = await loop.tick()  # decided on b's reading alone
        assert tick.count("draining") == 1 and failures(loop, "observe") == 1
        for _ in range(3):
            await asyncio.sleep(0)
        clock.now += 2 * CONFIG.drain_deadline_s  # past the deadline, a still unread
        for _ in range(50):
            await asyncio.sleep(0)
        assert ("stop", victim) not in a.calls and failures(loop, "drain_poll") > 0
        a.rows[victim]["in_flight"] = 0
        a.down = False
        await loop.settle()
        assert ("stop", victim) in a.calls and victim not in a.rows | b.rows

    asyncio.run(scenario())


def test_a_workers_gateway_whose_worker_did_not_answer_holds_the_stop_until_it_does() -> None:
    """``serve --workers``: a snapshot without one worker's requests cannot say idle."""

    async def scenario() -> None:
        clock = Clock()
        a = Member("http://a", ["r0", "r1"])
        loop = make_loop(GatewaySet([a]), clock, EveryGatewayActuator([a]))  # type: ignore[arg-type]
        victim = await scale_in(loop, clock)
        a.workers_missing = [1]
        for _ in range(50):
            await asyncio.sleep(0)
        assert ("drain", victim) in a.calls and ("stop", victim) not in a.calls
        assert failures(loop, "drain_poll") > 0
        clock.now += CONFIG.interval_s
        await loop.tick()
        assert failures(loop, "observe") == 1  # reported; the round went on
        a.workers_missing = []
        await loop.settle()
        assert ("stop", victim) in a.calls

    asyncio.run(scenario())


def test_a_drain_taken_back_through_one_gateway_is_undrained_on_all() -> None:
    """An operator undrains the victim through one gateway (or a gateway Pod that joins
    lists it serving): the drain is given up, and the replica serves through every
    gateway again, not drained for good on the others while counted as ready."""

    async def scenario() -> None:
        clock = Clock()
        a, b = Member("http://a", ["r0", "r1"]), Member("http://b", ["r0", "r1"])
        loop = make_loop(GatewaySet([a, b]), clock, EveryGatewayActuator([a, b]))  # type: ignore[arg-type]
        victim = await scale_in(loop, clock)
        a.rows[victim]["in_flight"] = 10**6
        await until(lambda: ("drain", victim) in a.calls and ("drain", victim) in b.calls)
        b.rows[victim].update(state="healthy", drained_by=None)  # taken back through b
        await until(lambda: victim not in loop._draining)
        clock.now += CONFIG.interval_s
        await loop.tick()
        await loop.settle()
        assert ("stop", victim) not in a.calls
        assert a.rows[victim]["state"] == "healthy" and ("undrain", victim) in a.calls
        drains = loop.metrics.registry.get_sample_value(
            "isocost_autoscale_drains_total", {"outcome": "undrained"}
        )
        assert drains == 1

    asyncio.run(scenario())
