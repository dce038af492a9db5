"""The live autoscale loop on bad input and on parts that fail: a gateway answering junk
(snapshot, ``/metrics``, non-JSON), restarting (its counters back to 0) or unreadable in
the middle of a drain; admin calls whose answer is lost or refused for good; starts that
never show up; scale commands that hang (a child holding their output) or print without
end; absurd config. Each round that cannot be read fails alone, reported, and no replica
is left drained but serving nothing, stopped but listed, or pending for good."""

from __future__ import annotations

import asyncio
import math
import os
import resource
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from gateway_harness import serving, wait_for
from test_autoscale_loop import CONFIG, GPU, OFFERS, Clock

from isocost.autoscale import (
    ActuatorError,
    AdminClient,
    AutoscaleLoop,
    CommandActuator,
    GatewayCounters,
    GatewayError,
    LocalActuator,
    ReplicaRow,
    read_counters,
)
from isocost.control import (
    Autoscaler,
    parse_autoscale_config,
)
from isocost.core.errors import ConfigError

Snapshot = dict[str, Any]


class Gateway:
    """Replica rows and ``isocost_requests_total``; ``junk`` rewrites the next snapshot,
    ``metrics_text`` replaces ``/metrics``; each admin call can be refused or lose its
    answer (done, then an error) a number of times."""

    def __init__(self, names: list[str]) -> None:
        self.rows: dict[str, dict[str, Any]] = {
            n: {"name": n, "gpu": GPU, "state": "healthy", "in_flight": 0} for n in names
        }
        self.answered = 0
        self.calls: list[tuple[str, str]] = []
        self.junk: Callable[[Snapshot], object] | None = None
        self.metrics_text: str | None = None
        self.unreadable = 0  # snapshot reads that fail
        self.refuse: dict[str, int] = {}  # action -> calls refused (nothing done)
        self.lose: dict[str, int] = {}  # action -> calls done whose answer is lost
        self.url = "http://gateway.test"

    async def snapshot(self) -> Any:
        if self.unreadable:
            self.unreadable -= 1
            raise GatewayError("GET /admin/snapshot: Connection refused")
        for row in self.rows.values():
            row["in_flight"] = max(0, row["in_flight"] - 1)  # one ends per read
        snapshot: Snapshot = {
            "pools": [{"model": "m", "queue_depth": 0}],
            "replicas": [{**row, "engine_waiting": 0} for row in self.rows.values()],
        }
        junk, self.junk = self.junk, None
        return snapshot if junk is None else junk(snapshot)

    async def counters(self) -> GatewayCounters:
        if self.metrics_text is not None:
            return read_counters(self.metrics_text)
        return read_counters(
            "# TYPE isocost_requests_total counter\n"
            f'isocost_requests_total{{status="200",pool="m",replica="r0"}} {self.answered}\n'
        )

    def _admin(self, action: str, name: str, change: Callable[[], object]) -> None:
        self.calls.append((action, name))
        if self.refuse.get(action, 0) > 0:
            self.refuse[action] -= 1
            raise GatewayError(f"{action}: HTTP 500")
        change()
        if self.lose.get(action, 0) > 0:
            self.lose[action] -= 1
            raise GatewayError(f"{action}: timeout")

    async def drain(self, name: str, by: str) -> None:
        self._admin("drain", name, lambda: self.rows[name].update(state="drained", drained_by=by))

    async def undrain(self, name: str) -> None:
        undrain = {"state": "healthy", "drained_by": None}
        self._admin("undrain", name, lambda: self.rows[name].update(undrain))

    async def remove(self, name: str) -> None:
        self._admin("remove", name, lambda: self.rows.pop(name))

    async def post_status(self, status: Mapping[str, Any]) -> None:
        pass


class Actuator:
    """Starts that succeed but never join the gateway; stops that are recorded (or all
    refused)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.started: list[int] = []
        self.refuse_stops = False
        self.cuts_expected = False  # a stop at the drain deadline cuts requests

    async def start(self, gpu: str, desired: int) -> None:
        self.started.append(desired)

    async def stop(self, name: str, gpu: str, desired: int) -> None:
        self.gateway.calls.append(("stop", name))
        busy = self.gateway.rows[name]["in_flight"] > 0
        assert self.cuts_expected or not busy, "stopped with requests in flight"
        if self.refuse_stops:
            raise ActuatorError("stop refused")

    async def draining(self, name: str, gpu: str) -> None:
        pass

    async def inherited(self, rows: Sequence[ReplicaRow]) -> set[str]:
        return set()

    async def close(self) -> None:
        pass


def make_loop(gateway: Gateway, clock: Clock, actuator: Actuator | None = None) -> AutoscaleLoop:
    return AutoscaleLoop(
        Autoscaler(CONFIG, OFFERS),
        CONFIG,
        OFFERS,
        gateway,
        actuator or Actuator(gateway),
        clock=clock,
        sleep=clock.sleep,
        attempts=3,
    )


def failures(loop: AutoscaleLoop, action: str) -> float:
    value = loop.metrics.registry.get_sample_value(
        "isocost_autoscale_failures_total", {"action": action}
    )
    return value or 0.0


async def scale_in(loop: AutoscaleLoop, clock: Clock) -> str:
    """Idle rounds until one decides to drain one of the two replicas (its task not yet
    begun: the fakes never yield); that replica."""
    while True:
        clock.now += CONFIG.interval_s
        if drain := (await loop.tick()).decision.drain:
            return drain[0]


async def until(done: Callable[[], bool]) -> None:
    """Let the loop's tasks run (the fakes advance at each yield) until ``done``."""
    for _ in range(1000):
        if done():
            return
        await asyncio.sleep(0)
    raise AssertionError("the loop's tasks never got there")


def _rows(change: Callable[[dict[str, Any]], object]) -> Callable[[Snapshot], Snapshot]:
    return lambda s: {**s, "replicas": [change(dict(row)) for row in s["replicas"]]}


JUNK_SNAPSHOTS: dict[str, Callable[[Snapshot], object]] = {
    "not-an-object": lambda s: ["replicas"],
    "no-replicas": lambda s: {"pools": s["pools"]},
    "replicas-a-string": lambda s: {**s, "replicas": "r0"},
    "row-not-an-object": lambda s: {**s, "replicas": [1]},
    "row-without-name": _rows(lambda r: {k: v for k, v in r.items() if k != "name"}),
    "in-flight-a-string": _rows(lambda r: r | {"in_flight": "3"}),
    "in-flight-nan": _rows(lambda r: r | {"in_flight": math.nan}),
    "in-flight-negative": _rows(lambda r: r | {"in_flight": -5}),
    "in-flight-huge": _rows(lambda r: r | {"in_flight": 10**400}),
    "queue-infinite": lambda s: {**s, "pools": [{"model": "m", "queue_depth": math.inf}]},
    "no-pools": lambda s: {"replicas": s["replicas"]},
}


@pytest.mark.parametrize("junk", JUNK_SNAPSHOTS.values(), ids=JUNK_SNAPSHOTS.keys())
def test_a_junk_snapshot_fails_its_round_alone_reported(junk: Callable[[Snapshot], object]) -> None:
    """The round is a GatewayError (the loop's reported, counted failure), not a crash of
    the loop; the next round decides as usual."""

    async def scenario() -> None:
        clock, gateway = Clock(), Gateway(["r0"])
        loop = make_loop(gateway, clock)
        await loop.tick()
        gateway.junk = junk
        with pytest.raises(GatewayError, match="/admin/snapshot"):
            await loop.tick()
        assert (await loop.tick()).count("ready") == 1

    asyncio.run(scenario())


def test_the_run_loop_counts_a_junk_round_and_goes_on_to_the_next() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), Gateway(["r0"])
        loop = make_loop(gateway, clock)
        gateway.junk = JUNK_SNAPSHOTS["row-without-name"]
        stop = asyncio.Event()
        ticks: list[int] = []

        def on_tick(tick: object) -> None:
            ticks.append(1)
            stop.set()

        await asyncio.wait_for(loop.run(stop, on_tick), 10)
        assert ticks == [1] and failures(loop, "observe") == 1

    asyncio.run(scenario())


OURS = 'isocost_requests_total{status="200",pool="m",replica="r0"}'
DECLARED = "# TYPE isocost_requests_total counter\n"
JUNK_METRICS = {
    "html": "<html><body>502 Bad Gateway</body></html>",
    "malformed-sample": f"{DECLARED}{OURS} twelve\n",
    "nan": f"{DECLARED}{OURS} NaN\n",
    "infinite": f"{DECLARED}{OURS} +Inf\n",
    "negative": f"{DECLARED}{OURS} -5\n",
    "huge": f"{DECLARED}{OURS} 1e300\n",
    "slo-nan": f'{DECLARED}isocost_slo_requests_total{{pool="m",verdict="met"}} NaN\n',
}


@pytest.mark.parametrize("text", JUNK_METRICS.values(), ids=JUNK_METRICS.keys())
def test_junk_metrics_fail_their_round_alone_reported(text: str) -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), Gateway(["r0"])
        loop = make_loop(gateway, clock)
        await loop.tick()
        gateway.metrics_text = text
        with pytest.raises(GatewayError, match="/metrics"):
            await loop.tick()
        gateway.metrics_text = None
        assert (await loop.tick()).count("ready") == 1

    asyncio.run(scenario())


def test_a_malformed_line_of_another_family_or_no_samples_yet_cost_nothing() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), Gateway(["r0"])
        loop = make_loop(gateway, clock)
        gateway.metrics_text = f"{DECLARED}{OURS} 0\n"
        await loop.tick()
        gateway.metrics_text = f"some_other_metric{{a=b}} x y z\n{DECLARED}{OURS} 7\n"
        assert (await loop.tick()).observation.arrivals == 7
        gateway.metrics_text = DECLARED  # restarted: no request yet
        assert (await loop.tick()).observation.arrivals == 0

    asyncio.run(scenario())


def test_after_a_gateway_restart_its_new_counts_are_this_rounds_arrivals() -> None:
    """Counters back to 0 and then growing: what they show is all new (as Prometheus'
    ``increase``), not lost against the old totals."""

    async def scenario() -> None:
        clock, gateway = Clock(), Gateway(["r0"])
        loop = make_loop(gateway, clock)
        gateway.answered = 500
        await loop.tick()
        gateway.answered = 3  # restarted, then answered 3
        tick = await loop.tick()
        assert tick.observation.arrivals == 3
        assert tick.observation.completions == {GPU: 3}

    asyncio.run(scenario())


def test_a_gateway_unreadable_mid_drain_is_waited_out_not_left_half_drained() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), Gateway(["r0", "r1"])
        loop = make_loop(gateway, clock)
        victim = await scale_in(loop, clock)
        gateway.rows[victim]["in_flight"] = 3
        gateway.unreadable = 4  # gone for a while, then back
        await loop.settle()
        assert [call for call, name in gateway.calls if name == victim] == [
            "drain",
            "stop",
            "remove",
        ]
        assert list(gateway.rows) != [] and victim not in gateway.rows
        assert failures(loop, "drain_poll") == 4

    asyncio.run(scenario())


def test_a_drain_deadline_passed_while_the_gateway_is_unreadable_waits_for_a_reading() -> None:
    """The stop at ``drain_deadline_s`` needs a reading that shows the drain still this
    loop's: a successor may have taken it over meanwhile (this loop's status posts fail
    too) and stopped the replica, and a second stop would set a count twice."""

    async def scenario() -> None:
        clock, gateway = Clock(), Gateway(["r0", "r1"])
        actuator = Actuator(gateway)
        actuator.cuts_expected = True
        loop = make_loop(gateway, clock, actuator)
        victim = await scale_in(loop, clock)
        gateway.rows[victim]["in_flight"] = 10**6  # busy for longer than the deadline
        outage_reads = 2 * round(CONFIG.drain_deadline_s / loop.poll_s)
        gateway.unreadable = outage_reads
        await loop.settle()
        assert [call for call, name in gateway.calls if name == victim] == [
            "drain",
            "stop",
            "remove",
        ]
        assert failures(loop, "drain_poll") == outage_reads  # none stopped it unread
        assert loop.metrics.registry.get_sample_value(
            "isocost_autoscale_drains_total", {"outcome": "deadline"}
        )

    asyncio.run(scenario())


def test_a_shutdown_during_a_drain_undrains_the_replica_at_once() -> None:
    """SIGTERM while a drain waits for its replica to go idle: the replica serves again
    and the loop ends, instead of waiting out ``drain_deadline_s`` (past any process
    manager's grace, after which SIGKILL leaves it drained for good) and then stopping a
    replica with requests in flight."""

    async def scenario() -> None:
        clock, gateway = Clock(), Gateway(["r0", "r1"])
        loop = make_loop(gateway, clock)
        victim = await scale_in(loop, clock)
        gateway.rows[victim]["in_flight"] = 10**6  # busy for longer than the deadline
        await until(lambda: ("drain", victim) in gateway.calls)
        stop = asyncio.Event()
        stop.set()
        started_s = clock.now
        await asyncio.wait_for(loop.run(stop, lambda tick: None), 10)
        assert [call for call, name in gateway.calls if name == victim] == ["drain", "undrain"]
        assert gateway.rows[victim]["state"] == "healthy"
        assert clock.now - started_s < CONFIG.drain_deadline_s

    asyncio.run(scenario())


def test_demand_back_during_a_drain_takes_the_replica_back_and_ends_the_drain() -> None:
    """The scaler wants the draining replica again: it is undrained (warm) and its drain
    task ends where it stands, never reaching the stop."""

    async def scenario() -> None:
        clock, gateway = Clock(), Gateway(["r0", "r1"])
        loop = make_loop(gateway, clock)
        victim = await scale_in(loop, clock)
        gateway.rows[victim]["in_flight"] = 10**6
        await until(lambda: ("drain", victim) in gateway.calls)
        for _ in range(20):  # traffic back: ten answers a second, a replica takes one
            gateway.answered += 10
            clock.now += CONFIG.interval_s
            await loop.tick()
            if victim not in loop._draining:
                break
        await loop.settle()
        assert [call for call, name in gateway.calls if name == victim] == ["drain", "undrain"]
        assert gateway.rows[victim]["state"] == "healthy"

    asyncio.run(scenario())


def test_a_drain_whose_answer_was_lost_is_undrained_next_round() -> None:
    """The gateway drained it but every answer was lost: the loop gives the drain up, and
    the next round, seeing it drained, undrains it before it decides again."""

    async def scenario() -> None:
        clock, gateway = Clock(), Gateway(["r0", "r1"])
        loop = make_loop(gateway, clock)
        gateway.lose["drain"] = 3
        victim = await scale_in(loop, clock)
        await until(lambda: failures(loop, "drain") == 3)
        assert gateway.rows[victim]["state"] == "drained"
        clock.now += CONFIG.interval_s
        await loop.tick()
        await loop.settle()
        mine = [call for call, name in gateway.calls if name == victim]
        assert mine[:4] == ["drain", "drain", "drain", "undrain"]
        assert mine[4:] in (["drain", "stop", "remove"], [])  # drained again, for good now
        assert all(row["state"] == "healthy" for row in gateway.rows.values())

    asyncio.run(scenario())


def test_a_refused_drain_is_not_undrained() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), Gateway(["r0", "r1"])
        loop = make_loop(gateway, clock)
        gateway.refuse["drain"] = 3
        await scale_in(loop, clock)
        await loop.settle()
        gateway.refuse["drain"] = 99
        clock.now += CONFIG.interval_s
        await loop.tick()
        assert "undrain" not in [call for call, _ in gateway.calls]

    asyncio.run(scenario())


def test_a_stopped_replica_whose_removal_fails_is_never_undrained_and_removed_later() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), Gateway(["r0", "r1"])
        loop = make_loop(gateway, clock)
        gateway.refuse["remove"] = 3
        victim = await scale_in(loop, clock)
        await until(lambda: failures(loop, "remove") == 3)
        assert gateway.rows[victim]["state"] == "drained"  # stopped, still listed
        clock.now += CONFIG.interval_s
        tick = await loop.tick()
        assert victim not in {r.replica_id for r in tick.observation.replicas}
        assert victim not in gateway.rows
        assert [c for c, n in gateway.calls if n == victim][-2:] == ["remove", "remove"]

    asyncio.run(scenario())


def test_a_stop_and_undrain_that_fail_for_good_are_undrained_next_round() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), Gateway(["r0", "r1"])
        actuator = Actuator(gateway)
        actuator.refuse_stops = True
        loop = make_loop(gateway, clock, actuator)
        gateway.refuse["undrain"] = 3
        await scale_in(loop, clock)
        await until(lambda: failures(loop, "undrain") == 3)
        assert "drained" in {row["state"] for row in gateway.rows.values()}
        await loop.settle()  # the last try before the process ends
        assert all(row["state"] == "healthy" for row in gateway.rows.values())

    asyncio.run(scenario())


def test_a_start_that_never_shows_up_is_given_up_reported_and_asked_again() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), Gateway(["r0"])
        loop = make_loop(gateway, clock)
        await loop.tick()
        gateway.answered += 10
        clock.now += CONFIG.interval_s
        assert (await loop.tick()).decision.start == {GPU: 2}
        await loop.settle()
        clock.now += 3 * CONFIG.pools[0].cold_start_s  # not yet past the wait
        assert (await loop.tick()).count("pending") == 2
        clock.now += 1
        tick = await loop.tick()
        assert tick.count("pending") == 0 and tick.decision.start  # asked again
        assert failures(loop, "routable") == 2
        await loop.settle()

    asyncio.run(scenario())


def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "scale.sh"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_a_hung_scale_command_is_killed_with_its_children_at_the_timeout(
    tmp_path: Path,
) -> None:
    """Its child holds the output pipe: killing the shell alone left the run waiting on
    that pipe for good."""
    pid_file = tmp_path / "child.pid"
    script = _script(tmp_path, f"sleep 600 &\necho $! > {pid_file}\nwait")
    actuator = CommandActuator(str(script), timeout_s=1)

    async def scenario() -> None:
        with pytest.raises(ActuatorError, match=r"no exit in 1 s"):
            await asyncio.wait_for(actuator.start(GPU, 2), 30)

    asyncio.run(scenario())
    child = int(pid_file.read_text())
    wait_for(lambda: not _alive(child), 10, "the command's child killed")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def test_a_scale_command_printing_without_end_keeps_only_its_tail(tmp_path: Path) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    script = _script(tmp_path, "head -c 268435456 /dev/zero | tr '\\0' x\necho; echo quota; exit 1")
    with pytest.raises(ActuatorError, match=r"exited 1: x+ quota$"):
        asyncio.run(CommandActuator(str(script)).start(GPU, 2))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 64, f"{grown_mib:.0f} MiB held for 256 MiB of output"


def test_scale_commands_that_cannot_run_are_actuator_errors(tmp_path: Path) -> None:
    not_executable = tmp_path / "scale.sh"
    not_executable.write_text("echo hi\n")
    with pytest.raises(ActuatorError, match="Permission denied"):
        asyncio.run(CommandActuator(str(not_executable)).start(GPU, 2))
    with pytest.raises(ActuatorError, match="No closing quotation"):
        CommandActuator("kubectl scale 'deploy")


def test_a_local_engine_that_cannot_even_be_run_is_an_actuator_error(tmp_path: Path) -> None:
    log_dir = tmp_path / "not-a-dir"
    log_dir.write_text("")

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            admin = AdminClient(session, "http://127.0.0.1:9", "t")
            actuator = LocalActuator(admin, "m", log_dir, [])
            with pytest.raises(ActuatorError, match="could not be run"):
                await actuator.start(GPU, 2)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"<html>oops", "application/json"),
        (b"\xff\xfe{", "application/json"),
        (b"[" * 100_000, "application/json"),
    ],
    ids=["not-json", "not-utf8", "nested-too-deep"],
)
def test_an_unreadable_admin_answer_is_a_gateway_error(body: bytes, content_type: str) -> None:
    async def scenario() -> None:
        async def answer(request: web.Request) -> web.Response:
            return web.Response(body=body, content_type=content_type)

        app = web.Application()
        app.router.add_get("/admin/snapshot", answer)
        async with serving(app) as url, aiohttp.ClientSession() as session:
            admin = AdminClient(session, url, "t")
            with pytest.raises(GatewayError, match="unreadable answer"):
                await admin.snapshot()

    asyncio.run(scenario())


def test_an_absurd_cold_start_is_one_line_not_a_stalled_forecast() -> None:
    raw = {"max_gpus": 4, "pools": [{"gpu": GPU, "max": 2, "cold_start_s": 1e300}]}
    with pytest.raises(ConfigError, match=r"pools\[0\]\.cold_start_s: must be <= 86400"):
        parse_autoscale_config(raw, "autoscale.yaml")
