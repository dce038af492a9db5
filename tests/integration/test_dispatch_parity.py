"""The gateway's router and the simulator's queue loop bind the same requests in the same
order when fed the same arrivals, completions, cancels and clock.

Gateway side: the real ``Router`` on an asyncio loop whose clock is the script's (its
timers fire in script time), no HTTP. Simulator side: the ``Dispatcher`` driven as
``sim.Simulator`` drives it (bind: ``on_dispatch``; completion: ``on_complete`` then a
wake; the queue timeout: a timer at the time ``submit`` names). Two replicas take one
waiting request each (``max_queue: 1``, streamed requests, no first tokens), so every arrival
past two waits.
The script covers a head that must wait again (it keeps its place ahead of an equal-key
twin), a deadline that passes in the queue, a queue timeout, a cancel, and eviction when
the queue is full.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Collection
from dataclasses import dataclass
from random import Random

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.files import resolve_model
from isocost.gateway.body import RoutingView
from isocost.gateway.metrics import GatewayMetrics
from isocost.gateway.routing import GatewayRequest, Grant, Router
from isocost.gateway.upstreams import Pool, Upstream
from isocost.openai.errors import ApiError
from isocost.prefix.hashing import BLOCK_TOKENS
from isocost.runtime.config import HealthConfig, ReplicaConfig
from isocost.scheduling.contract import ReplicaSpec, RequestView
from isocost.scheduling.decision import Decision, RejectReason
from isocost.scheduling.dispatch import Dispatcher
from isocost.scheduling.policies import build_policy
from isocost.scheduling.state import ReplicaSet

MODEL = "llama-3.1-8b"
POLICY = "round_robin"  # no tie-break by request id (the router draws its own ids)
QUEUE_SIZE = 4
QUEUE_TIMEOUT_S = 5.0
REPLICAS = ("r0", "r1")
OUTPUT_TOKENS = 8


@dataclass(frozen=True)
class Arrive:
    name: str
    priority: int = 0
    deadline_s: float | None = None  # relative to the arrival


@dataclass(frozen=True)
class Complete:
    name: str


@dataclass(frozen=True)
class Cancel:
    name: str


@dataclass(frozen=True)
class Wake:
    """Fresh load figures (a scrape): queued requests try again, without new room."""


@dataclass(frozen=True)
class Tick:
    """Only the clock moves: due timers fire."""


Step = Arrive | Complete | Cancel | Wake | Tick

SCRIPT: list[tuple[float, Step]] = [
    (0.0, Arrive("a")),
    (0.0, Arrive("b")),
    (0.1, Arrive("c")),
    (0.1, Arrive("d", deadline_s=0.4)),  # due at 0.5, still queued when a wake comes at 0.7
    (0.2, Arrive("e1", priority=1)),
    (0.2, Arrive("e2", priority=1)),  # e1's twin: same priority, deadline and arrival
    (0.3, Arrive("f", priority=2)),  # the queue is full: evicts c, the least urgent
    (0.3, Arrive("g")),  # full, and g is the least urgent: refused
    (0.4, Wake()),  # f tries again and keeps its place
    (0.7, Complete("a")),  # d's deadline has passed; f binds; e1 must wait again
    (0.75, Arrive("h")),
    (0.8, Complete("b")),  # e1 binds ahead of its twin: it kept its place
    (0.85, Cancel("h")),  # the client went away
    (0.9, Arrive("k")),
    (1.0, Complete("f")),  # e2 binds; h is gone, k waits
    (6.0, Tick()),  # k's queue timeout (0.9 + 5 s)
]

EXPECTED = [
    ("a", "r0"),
    ("b", "r1"),
    ("c", "queue_full"),
    ("g", "queue_full"),
    ("d", "deadline"),
    ("f", "r0"),
    ("e1", "r1"),  # the gateway before the dispatcher re-queued e1 behind e2 here
    ("e2", "r0"),
    ("k", "queue_timeout"),
]


def _cost_model(catalog: Catalog) -> CostModel:
    return CostModel(resolve_model(MODEL, catalog), catalog.gpu("a100-80g"), 1)


# -- the gateway: the real Router on a loop that runs on the script's clock ---------------


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class _ScriptLoop(asyncio.SelectorEventLoop):
    """An event loop whose time is the script's: its timers fire when the script says."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self._script_clock = clock

    def time(self) -> float:
        return self._script_clock.now


STATUSES = {"c": 429, "g": 429, "d": 429, "k": 503}  # the gateway's answers to the refused


def run_gateway() -> list[tuple[str, str]]:
    clock = _Clock()
    loop = _ScriptLoop(clock)
    try:
        return loop.run_until_complete(_gateway(clock))
    finally:
        loop.close()


async def _gateway(clock: _Clock) -> list[tuple[str, str]]:
    router = Router(
        Catalog.builtin(),
        GatewayMetrics(),
        on_idle=lambda replica: None,
        on_reject=lambda reason: None,
        queue_size=QUEUE_SIZE,
        queue_timeout_s=QUEUE_TIMEOUT_S,
        clock=clock,
    )
    pool = Pool(MODEL, POLICY)
    router.set_policy(pool, POLICY)
    for port, name in enumerate(REPLICAS, start=9):
        config = ReplicaConfig(url=f"http://127.0.0.1:{port}", name=name, max_queue=1)
        replica = Upstream(config, MODEL, HealthConfig())
        router.add_replica(pool, replica)
        pool.replicas[replica.url] = replica
    log: list[tuple[str, str]] = []
    grants: dict[str, Grant] = {}
    tasks: dict[str, asyncio.Task[None]] = {}

    async def attempt(name: str, request: GatewayRequest) -> None:
        try:
            grant = await router.acquire(request, frozenset())
        except ApiError as error:
            log.append((name, str(error.code)))
            assert error.status == STATUSES[name]
            return
        grants[name] = grant
        log.append((name, grant.replica.name))

    async def settle() -> None:
        for _ in range(8):
            await asyncio.sleep(0)

    for at_s, step in SCRIPT:
        clock.now = at_s
        if isinstance(step, Arrive):
            view = RoutingView(MODEL, True, OUTPUT_TOKENS, None, 100, False, ())
            request = GatewayRequest(
                request_id=step.name,
                view=view,
                pool=pool,
                arrived_at=at_s,
                session_key=None,
                priority=step.priority,
                deadline_at=None if step.deadline_s is None else at_s + step.deadline_s,
                tpot_target_s=None,
                route_class=None,
                key_name=None,
            )
            tasks[step.name] = asyncio.create_task(attempt(step.name, request))
        elif isinstance(step, Complete):
            router.release(grants[step.name], at_s, ok=True, output_tokens=OUTPUT_TOKENS)
        elif isinstance(step, Cancel):
            tasks[step.name].cancel()
        elif isinstance(step, Wake):
            router.wake_all()
        await settle()
    assert router.queue_depth(MODEL) == 0
    for name, task in tasks.items():
        assert task.cancelled() == (name == "h")
        if not task.cancelled():
            task.result()  # raises what failed inside
    return log


# -- the simulator: the dispatcher driven as ``sim.Simulator`` drives it ------------------


class _SimQueueLoop:
    def __init__(self) -> None:
        catalog = Catalog.builtin()
        self.policy = build_policy(POLICY, rng=Random(0), source="scheduling")
        self.shadow = ReplicaSet(block_tokens=BLOCK_TOKENS)
        self.shadow.add_listener(self.policy)
        for name in REPLICAS:
            self.shadow.add(ReplicaSpec(name, MODEL, _cost_model(catalog), max_queue=1))
        self.dispatcher: Dispatcher[str] = Dispatcher(
            QUEUE_SIZE,
            QUEUE_TIMEOUT_S,
            schedule=self._schedule,
            bind=self._bind,
            reject=self._reject,
        )
        self.timers: list[tuple[float, int, str]] = []  # the simulator's HOOK/_TIMEOUT events
        self.log: list[tuple[str, str]] = []

    def _schedule(self, view: RequestView, exclude: Collection[str], now: float) -> Decision:
        return self.policy.schedule(view, self.shadow, now, exclude=exclude)

    def _bind(self, name: str, view: RequestView, decision: Decision, now: float) -> None:
        assert decision.replica_id is not None
        self.shadow.on_dispatch(view, decision.replica_id, now, decision=decision)
        self.log.append((name, decision.replica_id))

    def _reject(
        self, name: str, view: RequestView, reason: RejectReason, decision: Decision | None
    ) -> None:
        self.log.append((name, str(reason)))

    def run(self) -> list[tuple[str, str]]:
        for at_s, step in SCRIPT:
            if isinstance(step, Arrive):
                view = RequestView(
                    step.name,
                    MODEL,
                    100,
                    max_tokens=OUTPUT_TOKENS,
                    priority=step.priority,
                    deadline_s=None if step.deadline_s is None else at_s + step.deadline_s,
                    arrival_s=at_s,
                    prompt_tokens_exact=False,
                )
                limit = self.dispatcher.submit(step.name, view, at_s)
                if limit is not None:
                    heapq.heappush(self.timers, (limit, len(self.timers), step.name))
            elif isinstance(step, Complete):
                self.shadow.on_complete(step.name, at_s, ok=True, output_tokens=OUTPUT_TOKENS)
                self.dispatcher.wake(at_s)
            elif isinstance(step, Cancel):
                assert self.dispatcher.cancel(step.name)
            elif isinstance(step, Wake):
                self.dispatcher.wake(at_s)
            while self.timers and self.timers[0][0] <= at_s:
                self.dispatcher.time_out(heapq.heappop(self.timers)[2])
        assert len(self.dispatcher) == 0
        return self.log


def test_gateway_and_simulator_bind_the_same_requests_in_the_same_order() -> None:
    simulated = _SimQueueLoop().run()
    assert simulated == EXPECTED
    assert run_gateway() == simulated
