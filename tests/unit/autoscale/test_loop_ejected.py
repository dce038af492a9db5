"""Replicas the gateway's breaker holds out: a blip is waited out, a replica that served
and stays ejected is replaced, one that never served is not (a broken start must not
grow the pool to its max), and an autoscaler restarted meanwhile knows which served from
the gateway's counters."""

from __future__ import annotations

import asyncio

import msgspec
from test_autoscale_loop import CONFIG, GPU, OFFERS, Clock, FakeActuator, FakeGateway

from isocost.autoscale import AutoscaleLoop, Tick
from isocost.control import Autoscaler

GRACE_S = 3.0
CONFIG_GRACE = msgspec.structs.replace(CONFIG, replace_ejected_after_s=GRACE_S)


def _loop(gateway: FakeGateway, actuator: FakeActuator, clock: Clock) -> AutoscaleLoop:
    """With a past of the steady 1 req/s ahead (no ramp to extrapolate)."""
    history = [(clock.now - s, 1.0) for s in range(600, 0, -1)]
    return AutoscaleLoop(
        Autoscaler(CONFIG_GRACE, OFFERS, history),
        CONFIG_GRACE,
        OFFERS,
        gateway,
        actuator,
        clock=clock,
        sleep=clock.sleep,
    )


async def _steady(loop: AutoscaleLoop, gateway: FakeGateway, clock: Clock, ticks: int) -> Tick:
    """1 req/s, which two replicas of 1 req/s with 20% headroom cover and one does not;
    the last tick."""
    for _ in range(ticks):
        gateway.answered += 1
        clock.now += CONFIG.interval_s
        tick = await loop.tick()
    return tick


def test_an_ejection_past_the_grace_is_replaced_and_shown() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), FakeGateway(["r0", "r1"])
        actuator = FakeActuator(gateway)
        loop = _loop(gateway, actuator, clock)
        await _steady(loop, gateway, clock, ticks=3)  # r1 seen serving
        gateway.rows["r1"]["state"] = "ejected"
        tick = await _steady(loop, gateway, clock, ticks=2)
        await loop.settle()
        assert actuator.started == []  # a blip: counted as coming back, nothing started
        assert tick.count("pending") == 1 and tick.count("ejected") == 0
        await _steady(loop, gateway, clock, ticks=2)  # held out past the grace
        await loop.settle()
        # its replacement, with the count of replicas holding machines: the ejected one
        # still holds its own, and a count of 2 would add nothing on a Deployment
        assert actuator.started == [3]
        assert ("drain", "r1") not in gateway.calls  # not a victim: its breaker decides
        ejected = loop.metrics.registry.get_sample_value(
            "isocost_autoscale_replicas", {"gpu": GPU, "state": "ejected"}
        )
        assert ejected == 1 and gateway.statuses[-1]["ejected"] == 1
        gateway.rows["r1"]["state"] = "healthy"  # it recovers: serving capacity again
        tick = await loop.tick()
        assert (tick.count("ready"), tick.count("ejected")) == (2, 0)

    asyncio.run(scenario())


def test_a_replica_that_never_served_is_not_replaced() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), FakeGateway(["r0", "r1"])
        gateway.rows["r1"]["state"] = "ejected"  # ejected since it appeared: still warming
        actuator = FakeActuator(gateway)
        loop = _loop(gateway, actuator, clock)
        tick = await _steady(loop, gateway, clock, ticks=10)
        await loop.settle()
        assert actuator.started == []
        assert tick.count("pending") == 1 and tick.count("ejected") == 0

    asyncio.run(scenario())


def test_a_restarted_autoscaler_knows_from_the_counters_which_served() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), FakeGateway(["r0", "r1"])
        gateway.rows["r0"]["state"] = "ejected"  # the fake's counters: r0 answered 200s
        gateway.answered = 40
        actuator = FakeActuator(gateway)
        loop = _loop(gateway, actuator, clock)
        await _steady(loop, gateway, clock, ticks=int(GRACE_S / CONFIG.interval_s) + 2)
        await loop.settle()
        assert actuator.started == [3]  # r0 replaced; it still holds its machine

    asyncio.run(scenario())
