"""The router over the brain: late binding, priorities, eviction and deadlines in the queue.

One replica that takes one waiting request at a time (``max_queue: 1``); the requests
stream and no first token comes, so a dispatched one waits until it ends. No network is
involved, the router is driven directly on an asyncio loop.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from isocost.core.catalog import Catalog
from isocost.gateway.auth import ApiKey
from isocost.gateway.body import RoutingView
from isocost.gateway.metrics import GatewayMetrics
from isocost.gateway.routing import GatewayRequest, Grant, Router, _new_id
from isocost.gateway.upstreams import Pool, Upstream
from isocost.openai.errors import ApiError
from isocost.runtime.config import HealthConfig, ReplicaConfig

MODEL = "llama-3.1-8b"


def setup(queue_size: int = 4) -> tuple[Router, Pool, Upstream, list[str]]:
    rejected: list[str] = []
    router = Router(
        Catalog.builtin(),
        GatewayMetrics(),
        on_idle=lambda replica: None,
        on_reject=rejected.append,
        queue_size=queue_size,
        queue_timeout_s=5.0,
    )
    pool = Pool(MODEL, "round_robin")
    router.set_policy(pool, "round_robin")
    replica = Upstream(ReplicaConfig(url="http://127.0.0.1:9", max_queue=1), MODEL, HealthConfig())
    router.add_replica(pool, replica)
    pool.replicas[replica.url] = replica
    return router, pool, replica, rejected


def request(
    pool: Pool, name: str, priority: int = 0, deadline_s: float | None = None
) -> GatewayRequest:
    now = time.monotonic()
    view = RoutingView(MODEL, True, 8, None, 100, False, ())
    return GatewayRequest(
        request_id=name,
        view=view,
        pool=pool,
        arrived_at=now,
        session_key=None,
        priority=priority,
        deadline_at=None if deadline_s is None else now + deadline_s,
        tpot_target_s=None,
        route_class=None,
        key_name=None,
    )


def test_queued_requests_bind_late_by_priority() -> None:
    async def scenario() -> list[str]:
        router, pool, replica, _ = setup()
        first = await router.acquire(request(pool, "first"), frozenset())
        low = asyncio.create_task(router.acquire(request(pool, "low", 0), frozenset()))
        high = asyncio.create_task(router.acquire(request(pool, "high", 5), frozenset()))
        await asyncio.sleep(0)  # both run up to their wait in the queue
        assert router.queue_depth(MODEL) == 2 and replica.num_in_flight == 1
        router.release(first, time.monotonic(), ok=True, output_tokens=8)
        granted: Grant = await high
        order = ["high"]
        assert not low.done()
        router.release(granted, time.monotonic(), ok=True, output_tokens=8)
        await low
        order.append("low")
        assert router.queue_depth(MODEL) == 0
        return order

    assert asyncio.run(scenario()) == ["high", "low"]


def test_full_queue_evicts_the_least_urgent() -> None:
    async def scenario() -> None:
        router, pool, _, rejected = setup(queue_size=1)
        await router.acquire(request(pool, "first"), frozenset())
        low = asyncio.create_task(router.acquire(request(pool, "low", 0), frozenset()))
        await asyncio.sleep(0)
        high = asyncio.create_task(router.acquire(request(pool, "high", 5), frozenset()))
        await asyncio.sleep(0)
        with pytest.raises(ApiError) as info:
            await low
        assert info.value.status == 429 and info.value.code == "queue_full"
        with pytest.raises(ApiError) as again:
            await router.acquire(request(pool, "later", 0), frozenset())
        assert again.value.code == "queue_full"
        assert rejected == ["queue_full", "queue_full"]
        high.cancel()

    asyncio.run(scenario())


def test_deadline_ends_the_wait() -> None:
    async def scenario() -> None:
        router, pool, _, rejected = setup()
        await router.acquire(request(pool, "first"), frozenset())
        with pytest.raises(ApiError) as info:
            await router.acquire(request(pool, "late", deadline_s=0.05), frozenset())
        assert info.value.status == 429 and info.value.retry_after_s
        assert router.queue_depth(MODEL) == 0 and "queue_timeout" in rejected

    asyncio.run(scenario())


def test_unhealthy_replica_is_not_chosen_and_exclusion_is_temporary() -> None:
    async def scenario() -> None:
        router, pool, replica, _ = setup()
        replica.breaker.record_failure(time.monotonic(), "refused", hard=True)
        router.sync_health(replica, time.monotonic())
        with pytest.raises(ApiError) as info:
            await router.acquire(request(pool, "a"), frozenset())
        assert info.value.status == 503 and info.value.code == "unavailable"
        replica.breaker = type(replica.breaker)(
            failure_threshold=3, min_success_rate=0.5, window_size=10, open_s=1.0
        )
        router.sync_health(replica, time.monotonic())
        with pytest.raises(ApiError):
            await router.acquire(request(pool, "b"), frozenset({replica.name}))
        grant = await router.acquire(request(pool, "c"), frozenset())
        assert grant.replica is replica and not router.replicas.get(replica.name).draining

    asyncio.run(scenario())


def test_a_leaving_client_leaves_the_queue_at_once_and_a_late_grant_is_released() -> None:
    async def scenario() -> None:
        router, pool, replica, _ = setup()
        first = await router.acquire(request(pool, "first"), frozenset())
        gone = asyncio.create_task(router.acquire(request(pool, "gone"), frozenset()))
        late = asyncio.create_task(router.acquire(request(pool, "late"), frozenset()))
        await asyncio.sleep(0)
        assert router.queue_depth(MODEL) == 2
        gone.cancel()  # the client went away: out of the queue before its task even runs
        assert router.queue_depth(MODEL) == 1
        router.release(first, time.monotonic(), ok=True, output_tokens=8)  # binds "late"
        assert replica.num_in_flight == 1 and router.queue_depth(MODEL) == 0
        late.cancel()  # its client leaves before the granted attempt could start
        for task in (gone, late):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert replica.num_in_flight == 0 and router.replicas.get(replica.name).num_waiting == 0

    asyncio.run(scenario())


def test_a_wait_past_its_timeout_leaves_the_queue_and_a_grant_bound_then_is_released() -> None:
    async def scenario() -> None:
        router, pool, replica, _ = setup()
        first = await router.acquire(request(pool, "first"), frozenset(), timeout_s=0.01)
        with pytest.raises(TimeoutError):  # nothing frees the replica in time
            await router.acquire(request(pool, "slow"), frozenset(), timeout_s=0.01)
        assert router.queue_depth(MODEL) == 0 and replica.num_in_flight == 1
        late = asyncio.create_task(router.acquire(request(pool, "late"), frozenset(), 0.02))
        await asyncio.sleep(0)  # queued, its timer set
        free = lambda: router.release(first, time.monotonic(), ok=True, output_tokens=8)  # noqa: E731
        asyncio.get_running_loop().call_soon(free)  # binds "late" ...
        time.sleep(0.05)  # ... in the loop turn where its timer fires, before it resumes
        with pytest.raises(TimeoutError):
            await late
        assert replica.num_in_flight == 0 and router.queue_depth(MODEL) == 0

    asyncio.run(scenario())


def test_ids_are_unique_and_drawn_again_in_a_forked_child() -> None:
    ids = {_new_id() for _ in range(10_000)}
    assert len(ids) == 10_000 and all(len(i) == 32 for i in ids)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        os.write(write, _new_id().encode())
        os._exit(0)
    os.waitpid(child, 0)
    from_child = os.read(read, 64).decode()
    assert len(from_child) == 32 and from_child not in ids | {_new_id()}


@pytest.mark.parametrize(
    ("headers", "deadline_ms", "tpot_ms"),
    [
        ({"x-deadline-ms": "500", "x-tpot-ms": "40"}, 500, 40),
        ({"x-llm-d-slo-ttft-ms": "300", "x-llm-d-slo-tpot-ms": "25"}, 300, 25),
        ({"x-deadline-ms": "500", "x-llm-d-slo-ttft-ms": "300"}, 500, None),  # ours first
        ({}, None, None),
    ],
)
def test_slo_headers_ours_or_llm_d(
    headers: dict[str, str], deadline_ms: float | None, tpot_ms: float | None
) -> None:
    _, pool, _, _ = setup()
    view = RoutingView(MODEL, True, 8, None, 100, False, ())
    made = GatewayRequest.from_headers(headers, view, pool, arrived_at=10.0, key=None)
    assert made.deadline_at == (None if deadline_ms is None else 10.0 + deadline_ms / 1000)
    assert made.tpot_target_s == (None if tpot_ms is None else tpot_ms / 1000)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("x-llm-d-slo-ttft-ms", "-1"),
        # once added to a monotonic clock a day up, lost in its rounding: a deadline equal
        # to the arrival, which SloTargets refused with a 500
        ("x-deadline-ms", "1e-300"),
        ("x-llm-d-slo-ttft-ms", "1e-20"),
        ("x-tpot-ms", "5e-324"),  # 0.0 s once divided: a division by zero
        ("x-tpot-ms", "nan"),
        ("x-deadline-ms", "inf"),
    ],
)
def test_slo_headers_must_be_a_usable_number_of_milliseconds(name: str, value: str) -> None:
    _, pool, _, _ = setup()
    view = RoutingView(MODEL, True, 8, None, 100, False, ())
    with pytest.raises(ApiError, match=f"{name} must be a number of milliseconds >= 0.001"):
        GatewayRequest.from_headers({name: value}, view, pool, arrived_at=86_400.0, key=None)


def test_a_keys_priority_is_its_default_and_its_ceiling() -> None:
    _, pool, _, _ = setup()
    view = RoutingView(MODEL, True, 8, None, 100, False, ())
    batch = ApiKey("batch", b"s", None, None, priority=-1, max_priority=0)

    def priority(headers: dict[str, str], key: ApiKey | None) -> int:
        return GatewayRequest.from_headers(headers, view, pool, arrived_at=1.0, key=key).priority

    assert priority({}, batch) == -1
    assert priority({"x-priority": "0"}, batch) == 0
    assert priority({"x-priority": "-5"}, batch) == -5  # lower is always allowed
    with pytest.raises(ApiError, match="above the highest key batch may ask, 0") as refused:
        priority({"x-priority": "1"}, batch)
    assert (refused.value.status, refused.value.code) == (403, "priority_not_allowed")
    assert priority({"x-priority": "99"}, None) == 99  # no keys: a trusted network's header
    made = GatewayRequest.from_headers({}, view, pool, arrived_at=1.0, key=batch)
    assert (made.key_name, made.flow) == ("batch", "batch")


def test_a_prompt_held_for_the_streams_it_would_stall_goes_once_one_ends() -> None:
    """SLO admission holds a long prompt that one replica could prefill in time but only by
    pushing both streams there past the TPOT target; the end of one of them admits it."""

    async def scenario() -> None:
        router, pool, replica, rejected = setup()
        router.set_policy(pool, "equal_cost")
        streams = []
        for name in ("s0", "s1"):  # two streams decode (the replica queues one at a time)
            streams.append(await router.acquire(request(pool, name), frozenset()))
            router.on_tokens(streams[-1], 1, time.monotonic())
        slot = router.replicas.get(replica.name).slot
        alone = router.replicas.predict_one(slot, time.monotonic(), 30_000, 0, 8)
        now = time.monotonic()
        long_prompt = GatewayRequest(
            request_id="long",
            view=RoutingView(MODEL, True, 8, None, 30_000, False, ()),
            pool=pool,
            arrived_at=now,
            session_key=None,
            priority=0,
            deadline_at=now + 60.0 + alone.ttft_s,
            tpot_target_s=1.2 * alone.step_s,  # its own; the streams' only unstalled
            route_class=None,
            key_name=None,
        )
        held = asyncio.create_task(router.acquire(long_prompt, frozenset()))
        await asyncio.sleep(0)
        assert not held.done() and router.queue_held(MODEL) == router.queue_depth(MODEL) == 1
        assert router.metrics.queue_held.labels(MODEL)._value.get() == 1
        router.release(streams[0], time.monotonic(), ok=True, output_tokens=8)
        grant = await asyncio.wait_for(held, 1.0)
        assert grant.replica is replica and router.queue_depth(MODEL) == 0 and not rejected
        assert router.metrics.queue_held.labels(MODEL)._value.get() == 0

    asyncio.run(scenario())
