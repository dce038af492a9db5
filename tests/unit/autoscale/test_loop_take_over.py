"""An autoscaler started after one that was SIGKILLed takes over what that one left of the
replicas it started (``Actuator.inherited``): a drain left half-done is finished to the
stop, a start cut short before its replica reached the gateway is stopped; a replica
drained that the actuator did not start (an operator's drain) is left as it is. And the
local actuator's pid files: what it inherits, and how it stops it."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from test_autoscale_loop import CONFIG, GPU, Clock, FakeActuator, FakeGateway, _ticks, make_loop
from test_loop_bad_input import until

from isocost.autoscale import AdminClient, AutoscaleLoop, LocalActuator


def test_a_drain_left_by_an_earlier_autoscaler_is_finished() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), FakeGateway(["r0", "r1", "r2"])
        gateway.rows["r1"]["state"] = "drained"  # the earlier autoscaler's, cut short
        gateway.rows["r2"]["state"] = "drained"  # an operator's
        actuator = FakeActuator(gateway)
        actuator.left = {"r1"}
        loop = make_loop(gateway, actuator, clock)
        await _ticks(loop, gateway, clock, rps=0, n=2)
        await loop.settle()
        assert actuator.stopped == ["r1"] and "r1" not in gateway.rows
        assert gateway.rows["r2"]["state"] == "drained"  # not the autoscaler's to stop
        assert ("drain", "r2") not in gateway.calls and ("remove", "r2") not in gateway.calls

    asyncio.run(scenario())


def test_a_start_cut_short_is_stopped_on_the_first_round_only() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), FakeGateway(["r0"])
        actuator = FakeActuator(gateway)
        actuator.left = {"autoscale-a100-80g-40001"}  # running, never added to the gateway
        loop = make_loop(gateway, actuator, clock)
        await _ticks(loop, gateway, clock, rps=0, n=1)
        await loop.settle()
        assert actuator.stopped == ["autoscale-a100-80g-40001"]
        actuator.left = {"autoscale-a100-80g-40002"}  # later: maybe a start on its way
        await _ticks(loop, gateway, clock, rps=0, n=2)
        await loop.settle()
        assert actuator.stopped == ["autoscale-a100-80g-40001"]

    asyncio.run(scenario())


def test_a_dry_run_takes_nothing_over() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), FakeGateway(["r0", "r1"])
        gateway.rows["r1"]["state"] = "drained"
        actuator = FakeActuator(gateway)
        actuator.left = {"r1", "ghost"}
        loop = make_loop(gateway, actuator, clock, dry_run=True)
        await _ticks(loop, gateway, clock, rps=0, n=3)
        await loop.settle()
        assert actuator.stopped == [] and gateway.calls == []

    asyncio.run(scenario())


def _sleeper(*args: str) -> subprocess.Popen[bytes]:
    """A process whose command line ends in ``args``, in a session of its own."""
    code = "import time; time.sleep(120)"
    return subprocess.Popen([sys.executable, "-c", code, *args], start_new_session=True)


def test_a_local_engine_is_inherited_once_its_autoscaler_is_gone(tmp_path: Path) -> None:
    """The pid file names the engine and the autoscaler that started it: while that one
    runs (two sharing a ``--log-dir`` by mistake) the engine is its; once it is gone, the
    next one's ``stop`` ends the engine's process group. A pid now another program's is
    not taken for the engine."""
    engine = _sleeper("engine", "--port", "40123")
    owner = _sleeper("autoscale")
    other = _sleeper("something", "--port", "40124")
    name = f"autoscale-{GPU}-40123"
    try:
        tmp_path.joinpath(f"{name}.pid").write_text(f"{engine.pid} {owner.pid}\n")
        tmp_path.joinpath(f"autoscale-{GPU}-40124.pid").write_text(f"{other.pid} 1\n")

        async def scenario() -> None:
            async with aiohttp.ClientSession() as session:
                admin = AdminClient(session, "http://127.0.0.1:9", "t")
                actuator = LocalActuator(admin, "m", tmp_path, [])
                assert await actuator.inherited([]) == set()  # its autoscaler still runs
                owner.kill()
                owner.wait()
                assert await actuator.inherited([]) == {name}
                await actuator.stop(name, GPU, 1)
                assert await actuator.inherited([]) == set()

        asyncio.run(scenario())
        assert engine.wait(timeout=10) == -signal.SIGTERM
        assert not tmp_path.joinpath(f"{name}.pid").exists()
        assert other.poll() is None  # never signalled
    finally:
        for proc in (engine, owner, other):
            proc.kill()
            proc.wait()


def test_a_drain_named_by_an_autoscaler_that_stopped_posting_is_finished() -> None:
    """Whatever the actuator knows (here nothing, as ``command`` knows nothing): a drain
    the gateway says an autoscaler made is finished once that autoscaler has posted no
    status for three of this loop's intervals; one whose autoscaler still posts (a
    rolling update runs two for a while) stays its own until it goes quiet; an
    operator's (named by no autoscaler) is left drained."""

    async def scenario() -> None:
        clock, gateway = Clock(), FakeGateway(["r0", "r1", "r2", "r3"])
        gateway.rows["r1"].update(state="drained", drained_by="autoscale:0000000000aa")  # gone
        gateway.rows["r2"].update(state="drained", drained_by="autoscale:0000000000bb")
        gateway.rows["r3"].update(state="drained", drained_by="operator")
        gateway.live = {"0000000000bb"}
        actuator = FakeActuator(gateway)
        loop = make_loop(gateway, actuator, clock)
        await _ticks(loop, gateway, clock, rps=0, n=3)  # 2 intervals since its first round
        await loop.settle()
        assert actuator.stopped == [] and gateway.calls == []
        await _ticks(loop, gateway, clock, rps=0, n=1)
        await loop.settle()
        assert actuator.stopped == ["r1"] and "r1" not in gateway.rows
        await _ticks(loop, gateway, clock, rps=0, n=2)
        await loop.settle()
        assert actuator.stopped == ["r1"]  # r2's autoscaler still posts
        gateway.live.clear()
        await _ticks(loop, gateway, clock, rps=0, n=1)
        await loop.settle()
        assert actuator.stopped == ["r1", "r2"]
        assert gateway.rows["r3"]["state"] == "drained"
        assert [call for call in gateway.calls if call[1] == "r3"] == []

    asyncio.run(scenario())


def _busy_pair() -> FakeGateway:
    """Two replicas with requests in flight that never end on their own."""
    gateway = FakeGateway(["r0", "r1"])
    gateway.finish_per_read = 0
    for row in gateway.rows.values():
        row["in_flight"] = 5
    return gateway


async def _first_drain(
    loop: AutoscaleLoop, gateway: FakeGateway, clock: Clock
) -> tuple[str, float]:
    """Idle rounds until a scale-in drains a replica: that replica, and when its drain
    began."""
    for _ in range(10):
        await _ticks(loop, gateway, clock, rps=0, n=1)
        began = clock.now
        await asyncio.sleep(0)  # a drain task begun runs to its first wait
        if drained := [name for action, name in gateway.calls if action == "drain"]:
            return drained[0], began
    raise AssertionError("no scale-in drained a replica")


def test_a_drain_undrained_by_someone_else_is_given_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An operator takes the victim back while its drain waits for requests to end: the
    replica serves again, so the drain stops there. Stopped once idle (or at the
    deadline), it would cut the requests sent to it since."""

    async def scenario() -> None:
        clock, gateway = Clock(), _busy_pair()
        actuator = FakeActuator(gateway)
        loop = make_loop(gateway, actuator, clock)
        victim, _ = await _first_drain(loop, gateway, clock)
        assert gateway.rows[victim]["state"] == "drained"
        gateway.rows[victim].update(state="healthy", drained_by=None)  # the operator's undrain
        await loop.settle()
        assert actuator.stopped == [] and gateway.rows[victim]["state"] == "healthy"
        assert [call for call in gateway.calls if call[1] == victim] == [
            ("draining", victim),
            ("drain", victim),
        ]  # neither stopped, undrained nor removed by the drain
        assert _drains(loop) == {"undrained": 1.0}

    with caplog.at_level(logging.INFO, logger="isocost.autoscale"):
        asyncio.run(scenario())
    assert "autoscale_drain_taken_back" in [r.__dict__.get("event") for r in caplog.records]


def test_a_drain_taken_over_while_its_autoscaler_lives_is_stopped_once() -> None:
    """The first autoscaler's status posts never reach the gateway (``live`` stays empty),
    so a second one takes it for gone and takes its drain over, in its own name. The
    first, still waiting for the victim to go idle, sees the drain is someone else's and
    gives it up: the replica is stopped and removed once, by the second."""

    async def scenario() -> None:
        clock, gateway = Clock(), _busy_pair()
        first_actuator, second_actuator = FakeActuator(gateway), FakeActuator(gateway)
        first = make_loop(gateway, first_actuator, clock)
        victim, _ = await _first_drain(first, gateway, clock)
        second = make_loop(gateway, second_actuator, clock)
        await _ticks(second, gateway, clock, rps=0, n=4)  # 3 intervals since its first
        mark = f"autoscale:{second.instance}"
        await until(lambda: gateway.rows[victim]["drained_by"] == mark)  # the second's drain
        await first.settle()  # the first's wait reads the gateway: no longer its drain
        assert _drains(first) == {"taken": 1.0} and first_actuator.stopped == []
        gateway.finish_per_read = 1
        await second.settle()
        assert second_actuator.stopped == [victim] and victim not in gateway.rows
        assert [action for action, name in gateway.calls if name == victim] == [
            "draining",
            "drain",
            "draining",
            "drain",
            "stop",
            "remove",
        ]

    asyncio.run(scenario())


class _GatewayWithoutMarks(FakeGateway):
    """A gateway older than ``drained_by``: its snapshot has no such key."""

    async def drain(self, name: str, by: str) -> None:
        self.calls.append(("drain", name))
        self.rows[name]["state"] = "drained"


def test_a_gateway_too_old_to_name_drains_has_them_finished() -> None:
    """No ``drained_by`` in its snapshot is no one else's drain: the stop goes ahead (an
    autoscaler upgraded before its gateways keeps scaling in)."""

    async def scenario() -> None:
        clock, gateway = Clock(), _GatewayWithoutMarks(["r0", "r1"])
        actuator = FakeActuator(gateway)
        loop = make_loop(gateway, actuator, clock)
        victim, _ = await _first_drain(loop, gateway, clock)
        await loop.settle()
        assert actuator.stopped == [victim] and _drains(loop) == {"idle": 1.0}

    asyncio.run(scenario())


class _StopsWhatever(FakeActuator):
    """Records every stop, requests in flight or not (at the deadline there are some)."""

    async def stop(self, name: str, gpu: str, desired: int) -> None:
        self.gateway.calls.append(("stop", name))
        self.stopped.append(name)


def _drains(loop: AutoscaleLoop) -> dict[str, float]:
    """``isocost_autoscale_drains_total`` by outcome (those counted)."""
    outcomes = ("idle", "deadline", "undrained", "taken", "shutdown")
    samples = {
        outcome: loop.metrics.registry.get_sample_value(
            "isocost_autoscale_drains_total", {"outcome": outcome}
        )
        for outcome in outcomes
    }
    return {outcome: value for outcome, value in samples.items() if value}


def test_a_drain_past_its_deadline_stops_the_replica_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Requests that never end on the victim: at ``drain_deadline_s`` it is stopped all
    the same (its machine is not held for ever), and the cut is reported: a warning and
    ``isocost_autoscale_drains_total{outcome="deadline"}``."""

    async def scenario() -> None:
        clock, gateway = Clock(), _busy_pair()
        actuator = _StopsWhatever(gateway)
        loop = make_loop(gateway, actuator, clock)
        victim, drained_at = await _first_drain(loop, gateway, clock)
        await loop.settle()
        assert actuator.stopped == [victim] and victim not in gateway.rows
        assert clock.now - drained_at >= CONFIG.drain_deadline_s
        assert _drains(loop) == {"deadline": 1.0}

    with caplog.at_level(logging.INFO, logger="isocost.autoscale"):
        asyncio.run(scenario())
    warnings = [r for r in caplog.records if r.__dict__.get("event") == "autoscale_drain_deadline"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
