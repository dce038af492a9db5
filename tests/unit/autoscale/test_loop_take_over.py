"""An autoscaler started after one that was SIGKILLed takes over what that one left of the
replicas it started (``Actuator.inherited``): a drain left half-done is finished to the
stop, a start cut short before its replica reached the gateway is stopped; a replica
drained that the actuator did not start (an operator's drain) is left as it is."""

from __future__ import annotations

import asyncio

from test_autoscale_loop import Clock, FakeActuator, FakeGateway, _ticks, make_loop


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
