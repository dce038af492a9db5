"""The gateway's adapter over the scheduling brain (``isocost.scheduling``).

The gateway keeps one ``ReplicaSet`` (the shadow state of every replica of every pool)
and one ``Policy`` per pool; it never scores replicas itself. For each attempt it builds a
``RequestView`` and calls ``policy.schedule``; the decision's outcome maps to HTTP:

* ADMIT: ``on_dispatch``, the attempt is forwarded; the forwarder reports streamed tokens
  (the first of them is the first token) and completion back through ``on_tokens`` and
  ``release`` (which calls ``on_complete``). A request not streamed shows no first token:
  the shadow state takes it to start at its predicted prefill end, when a timer wakes the
  queue.
* QUEUE: every eligible replica is at its queue cap; the request waits in the pool's
  ``dispatch.Dispatcher`` (the simulator's discipline: priority, then deadline, then its
  flow's fair turn, then arrival) and is scheduled again, in that order, when a replica
  frees a slot, comes back or a scrape shows room (late binding); an admitted one passes
  the turn to the next, so a freed burst of capacity drains the queue, and one that still
  finds every replica full keeps its place. It waits until its deadline (429) or
  ``limits.queue_timeout_ms`` (503, both ``queue_timeout``; 429 ``deadline`` when a wake
  finds its deadline passed); a full queue refuses the least urgent request (429
  ``queue_full``). The dispatcher binds the request (``on_dispatch``) inside the wake and
  resolves the waiting attempt's future with its ``Grant``; a client that leaves cancels
  that future, which leaves the queue at once.
  A request that SLO admission holds (QUEUE with ``held``: it would meet its deadline,
  but no replica can take it yet without pushing the streams there past the TPOT
  target) waits the same way, apart from the queue proper, and is scheduled again at
  every wake: it leaves admitted, or refused (429 ``deadline``) once no replica can meet
  its deadline any more.
* REJECT: ``no_replica`` 404, ``unavailable``/``shed`` 503, ``deadline``/``queue_full``
  429, with ``Retry-After`` from the decision's ``retry_after_s``.

Retries avoid the replicas already tried by passing their names as ``schedule``'s
``exclude`` (they count as unavailable for that request only, not for the global shed).

With a state bus (``isocost.runtime.bus``) every dispatch, first token and end is also
published, and the peers' arrive through ``foreign_dispatch``, ``foreign_first_token``,
``foreign_tokens`` and ``foreign_end``: the same hooks and queue wakes as this gateway's
own requests.

Circuit-breaker state is mirrored into ``ReplicaSet.set_health`` and drains into
``set_draining``, so the brain's eligibility is the data plane's health.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from random import Random
from typing import TYPE_CHECKING, Any

from isocost.core.catalog import Catalog
from isocost.core.errors import IsocostError
from isocost.core.slo import SloTargets
from isocost.gateway.auth import ApiKey
from isocost.gateway.body import RoutingView
from isocost.gateway.metrics import GatewayMetrics
from isocost.gateway.upstreams import Pool, Upstream
from isocost.openai.errors import ApiError
from isocost.prefix.hashing import BLOCK_TOKENS
from isocost.prefix.kvevents import KvEventTracker, engine_cached_tokens
from isocost.runtime.config import (
    GENERIC_PRIOR_MODEL,
    GatewayConfig,
    ReplicaConfig,
    check_references,
    priced_as_generic,
    replica_cost_model,
)
from isocost.scheduling.contract import EngineMetrics, InFlight, ReplicaSpec, RequestView
from isocost.scheduling.decision import Decision, Outcome, RejectReason
from isocost.scheduling.disagg import DisaggMode, PairDecision, choose_pair
from isocost.scheduling.dispatch import Dispatcher
from isocost.scheduling.framework import Policy
from isocost.scheduling.policies import SchedulingConfig, build_policy
from isocost.scheduling.state import ReplicaSet

if TYPE_CHECKING:
    from isocost.runtime.bus import StateBus

__all__ = ["FAIRNESS_HEADER", "GatewayRequest", "Grant", "Handoff", "Router"]

FAIRNESS_HEADER = "x-gateway-inference-fairness-id"  # GAIE's flow id, without API keys

log = logging.getLogger("isocost.gateway")

_RECENT_DECISIONS = 50
_NO_CANDIDATES: Mapping[str, Policy] = {}
_REJECT_STATUS = {
    RejectReason.NO_REPLICA: 404,
    RejectReason.UNAVAILABLE: 503,
    RejectReason.SHED: 503,
    RejectReason.DEADLINE: 429,
    RejectReason.QUEUE_FULL: 429,
}
_REJECT_MESSAGE = {
    RejectReason.NO_REPLICA: "no replica serves this model or route class",
    RejectReason.UNAVAILABLE: "no healthy replica is available",
    RejectReason.SHED: "too few replicas are available; shedding load",
    RejectReason.DEADLINE: "the deadline cannot be met at the current load",
    RejectReason.QUEUE_FULL: "the gateway queue is full",
}


_ID_RANDOM = Random()  # this process's own, seeded from the system
os.register_at_fork(after_in_child=_ID_RANDOM.seed)  # a forked child draws its own


def _new_id() -> str:
    """A request or attempt id, 32 random hex digits like a uuid4's. Why not uuid4: two
    per request on the hot path, each a system call and an object, 2 µs against 0.3."""
    return f"{_ID_RANDOM.getrandbits(128):032x}"


@dataclass(frozen=True, slots=True)
class GatewayRequest:
    """One client request as the gateway routes it."""

    request_id: str  # the client's x-request-id, else generated; for logs
    view: RoutingView
    pool: Pool
    arrived_at: float  # monotonic seconds
    session_key: str | None  # x-session-id header, else the body's user field
    priority: int
    deadline_at: float | None  # monotonic seconds by which the first token is due
    tpot_target_s: float | None  # x-tpot-ms: mean time per output token wanted
    route_class: str | None  # x-isocost-class, else classified by the policy's routes
    key_name: str | None
    flow: str | None = None  # queued fairly against other flows (``RequestView.flow``)

    @classmethod
    def from_headers(
        cls,
        headers: Mapping[str, str],
        view: RoutingView,
        pool: Pool,
        *,
        arrived_at: float,
        key: ApiKey | None,
    ) -> GatewayRequest:
        """Read ``x-session-id``, ``x-priority``, ``x-deadline-ms``, ``x-tpot-ms`` and
        ``x-isocost-class``; llm-d's ``x-llm-d-slo-ttft-ms`` and ``x-llm-d-slo-tpot-ms``
        mean the same as ours and are read when ours are absent. The fairness flow is the
        API key; without keys, GAIE's ``x-gateway-inference-fairness-id`` (set by a trusted
        layer in front: a client with a key could otherwise open flows at will). With a
        key, the priority defaults to the key's and may not exceed its ``max_priority``
        (403): a tenant cannot jump the queue by asking."""
        priority = 0 if key is None else key.priority
        if "x-priority" in headers:
            try:
                priority = int(headers["x-priority"])
            except ValueError:
                raise ApiError(400, "x-priority must be an integer", code="bad_header") from None
            if key is not None and priority > key.max_priority:
                raise ApiError(
                    403,
                    f"x-priority {priority} is above the highest key {key.name} may ask,"
                    f" {key.max_priority}",
                    code="priority_not_allowed",
                    param="x-priority",
                )
        key_name = None if key is None else key.name
        deadline_ms = _positive_ms(headers, "x-deadline-ms", "x-llm-d-slo-ttft-ms")
        tpot_ms = _positive_ms(headers, "x-tpot-ms", "x-llm-d-slo-tpot-ms")
        return cls(
            request_id=headers.get("x-request-id") or _new_id(),
            view=view,
            pool=pool,
            arrived_at=arrived_at,
            session_key=headers.get("x-session-id") or view.user,
            priority=priority,
            deadline_at=None if deadline_ms is None else arrived_at + deadline_ms / 1000,
            tpot_target_s=None if tpot_ms is None else tpot_ms / 1000,
            route_class=headers.get("x-isocost-class"),
            key_name=key_name,
            flow=key_name or headers.get(FAIRNESS_HEADER) or None,
        )

    def slo(self) -> SloTargets | None:
        """What its answer is judged by: the pool's ``slo`` with this request's own deadline
        and TPOT target in place of its TTFT and TPOT targets; None when neither sets one."""
        pool = self.pool.slo
        if pool is None and self.deadline_at is None and self.tpot_target_s is None:
            return None
        if self.deadline_at is not None:
            ttft_s, per_1k_s = self.deadline_at - self.arrived_at, 0.0
        else:
            ttft_s, per_1k_s = (
                (math.inf, 0.0) if pool is None else (pool.ttft_s, pool.ttft_per_1k_s)
            )
        tpot_s = self.tpot_target_s or (math.inf if pool is None else pool.tpot_s)
        return SloTargets(ttft_s, tpot_s, per_1k_s)


# The least target a header may set: anything shorter is lost in the monotonic clock's
# rounding once added to it (a deadline equal to its arrival) or divides by zero.
_LEAST_MS = 0.001


def _positive_ms(headers: Mapping[str, str], *names: str) -> float | None:
    """The first of the headers ``names`` present, as a finite number of milliseconds no
    less than ``_LEAST_MS``; None when none is."""
    name = next((n for n in names if n in headers), None)
    if name is None:
        return None
    try:
        value = float(headers[name])
    except ValueError:
        value = math.nan
    if not (value >= _LEAST_MS and math.isfinite(value)):
        raise ApiError(
            400, f"{name} must be a number of milliseconds >= {_LEAST_MS:g}", code="bad_header"
        )
    return value


@dataclass(slots=True)
class Grant:
    """A replica granted to one attempt of a request."""

    replica: Upstream
    attempt_id: str  # the brain's request id for this attempt
    decision: Decision
    matched_tokens: int = 0  # the prompt's tokens the prefix index held on the replica
    prompt_tokens: int = 0
    streaming: bool = False  # its first token has arrived
    released: bool = False

    @property
    def predicted_ttft_s(self) -> float | None:
        return self.decision.predicted_ttft_s


@dataclass(frozen=True, slots=True)
class Handoff:
    """One request split in two (``Router.plan_handoff``): both legs dispatched."""

    prefill: Grant  # its prompt, computed on P (one output token)
    decode: Grant  # the request itself on D, its prompt's KV pulled from P
    predicted_transfer_s: float
    prefill_queue: int  # requests waiting at P when the pair was chosen
    decode_queue: int  # ... at D


class Router:
    """Pools' policies over one shared ``ReplicaSet``; see the module docstring."""

    def __init__(
        self,
        catalog: Catalog,
        metrics: GatewayMetrics,
        on_idle: Callable[[Upstream], None],
        on_reject: Callable[[str], None],
        *,
        queue_size: int,
        queue_timeout_s: float,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.catalog = catalog
        self.metrics = metrics
        self.on_idle = on_idle  # a removed replica's last request ended
        self.on_reject = on_reject  # counts a refusal by reason
        self.clock = clock  # monotonic seconds, the clock of every ``now`` it is given
        self.replicas = ReplicaSet(block_tokens=BLOCK_TOKENS)
        self.block_tokens = BLOCK_TOKENS
        self.kv_trackers: dict[str, KvEventTracker] = {}  # by replica name
        self.policies: dict[str, Policy] = {}  # by pool model
        # candidates evaluated beside a pool's policy (``gateway.shadow``): by pool model,
        # then policy name; fed the same hooks, so their state is the real cluster's
        self.candidates: dict[str, dict[str, Policy]] = {}
        self.agreement: Counter[tuple[str, str, bool]] = Counter()  # (pool, candidate, agrees)
        self.replicas.add_listener(_PolicyHooks(self.policies, self.candidates))
        # (time, prompt tokens, decision): described only when someone asks (admin API).
        self._recent: deque[tuple[float, int, Decision]] = deque(maxlen=_RECENT_DECISIONS)
        self._by_id: dict[str, Upstream] = {}
        self._generic_models: set[str] = set()  # pool models priced as the generic prior
        self._seed = seed
        self.scheduling = SchedulingConfig()
        self._queue_size = queue_size
        self._queue_timeout_s = queue_timeout_s
        self._dispatchers: dict[str, Dispatcher[_Waiter]] = {}  # by pool model
        self.bus: StateBus | None = None  # tells the peers what this gateway dispatches

    # -- configuration ------------------------------------------------------------------

    @property
    def queue_size(self) -> int:
        return self._queue_size

    @queue_size.setter
    def queue_size(self, value: int) -> None:
        self._queue_size = value
        for dispatcher in self._dispatchers.values():
            dispatcher.max_size = value

    @property
    def queue_timeout_s(self) -> float:
        return self._queue_timeout_s

    @queue_timeout_s.setter
    def queue_timeout_s(self, value: float) -> None:
        self._queue_timeout_s = value
        for dispatcher in self._dispatchers.values():
            dispatcher.queue_timeout_s = value

    def build(self, name: str, scheduling: SchedulingConfig | None = None) -> Policy:
        return build_policy(
            name,
            config=scheduling or self.scheduling,
            rng=Random(self._seed),
            source="scheduling",
        )

    def check_config(self, config: GatewayConfig) -> None:
        """Raise IsocostError if ``config`` names an unknown policy, plugin or cost model."""
        check_references(config, self.catalog)

    def install_policies(
        self, scheduling: SchedulingConfig, policies: Mapping[str, Policy]
    ) -> None:
        """Take new scheduling profiles and the policies (by pool model) built under them
        (``build``); pools not named keep theirs."""
        self.scheduling = scheduling
        self.policies.update(policies)

    def set_policy(self, pool: Pool, name: str) -> None:
        if pool.model in self.policies and pool.policy == name:
            return
        self.policies[pool.model] = self.build(name)
        pool.policy = name

    def remove_pool(self, model: str) -> None:
        """Forget a pool's policy and queue (its replicas are gone already)."""
        self.policies.pop(model, None)
        self.candidates.pop(model, None)
        dispatcher = self._dispatchers.pop(model, None)
        for waiter in dispatcher.clear() if dispatcher else ():
            self.on_reject("model_not_found")
            waiter.set_exception(ApiError(404, "model removed", code="model_not_found"))

    def replica_spec(self, model: str, name: str, config: ReplicaConfig) -> ReplicaSpec:
        """The brain's description of replica ``name`` of pool ``model`` (one in no catalog
        is priced as the generic prior, said once per model in the log)."""
        if model not in self._generic_models and priced_as_generic(config, model, self.catalog):
            self._generic_models.add(model)
            log.warning(
                "model %r is in no catalog: priced as %s until calibration learns it",
                model,
                GENERIC_PRIOR_MODEL,
                extra={"event": "generic_prior", "model": model},
            )
        return ReplicaSpec(
            replica_id=name,
            model=model,
            cost_model=replica_cost_model(config, model, self.catalog),
            weight=config.weight,
            usd_per_hour=config.usd_per_hour,
            max_queue=config.max_queue,
            groups=frozenset(config.groups),
            role=config.role,
        )

    def add_replica(self, pool: Pool, replica: Upstream, spec: ReplicaSpec | None = None) -> None:
        """Add ``replica`` to ``pool``, described by ``spec`` (default: from its config)."""
        if replica.name in self._by_id:
            raise IsocostError(f"a replica named {replica.name!r} already exists")
        self.replicas.add(spec or self.replica_spec(pool.model, replica.name, replica.config))
        self._by_id[replica.name] = replica

    def remove_replica(self, replica: Upstream) -> None:
        if self._by_id.get(replica.name) is replica:
            del self._by_id[replica.name]
            self.replicas.remove(replica.name)

    def set_draining(self, replica: Upstream, draining: bool) -> None:
        replica.drained = draining
        if not draining:
            replica.drained_by = None
        self.replicas.set_draining(replica.name, draining or replica.removing)

    def sync_health(self, replica: Upstream, now: float) -> None:
        """Mirror the breaker into the brain's eligibility."""
        if self._by_id.get(replica.name) is not replica:
            return
        healthy = replica.breaker.allows_traffic(now)
        state = self.replicas.get(replica.name)
        if state.healthy != healthy:
            self.replicas.set_health(replica.name, healthy)
            if healthy:
                self._wake(replica.pool)

    def apply_scrape(self, replica: Upstream, metrics: EngineMetrics, now: float) -> None:
        if self._by_id.get(replica.name) is replica:
            self.replicas.apply_scrape(replica.name, metrics, now)

    # -- scheduling ---------------------------------------------------------------------

    def _view(self, request: GatewayRequest, attempt_id: str, now: float) -> RequestView:
        view = request.view
        return RequestView(
            request_id=attempt_id,
            model=view.model,
            prompt_tokens=view.prompt_tokens,
            block_hashes=view.block_hashes,
            max_tokens=view.max_tokens,
            session_key=request.session_key,
            priority=request.priority,
            deadline_s=request.deadline_at,
            tpot_target_s=request.tpot_target_s,
            route_class=request.route_class,
            stream=view.stream,
            arrival_s=request.arrived_at,
            prompt_tokens_exact=view.prompt_tokens_exact,
            flow=request.flow,
        )

    def _schedule(self, request: RequestView, exclude: Collection[str], now: float) -> Decision:
        """``policy.schedule`` of the request's pool, recorded (metrics, admin API); a final
        decision (not QUEUE: that one is scheduled again) is shadowed by the candidates."""
        policy = self.policies[request.model]
        decision = policy.schedule(request, self.replicas, now, exclude=exclude)
        self._record(decision, request, now)
        candidates = self.candidates.get(request.model)
        if candidates and decision.outcome is not Outcome.QUEUE:
            self._shadow(candidates, request, exclude, now, decision)
        return decision

    def _shadow(
        self,
        candidates: Mapping[str, Policy],
        request: RequestView,
        exclude: Collection[str],
        now: float,
        decision: Decision,
    ) -> None:
        """Each candidate's decision on the request and the replica states the real one
        saw, never acted on: counted as agreeing (same outcome, same replica) or not.
        It runs before the real dispatch, not after: that dispatch changes the state."""
        counter = self.metrics.shadow_decisions
        for name, candidate in candidates.items():
            if name == decision.policy:  # switched to it (admin API): nothing to compare
                continue
            shadowed = candidate.schedule(request, self.replicas, now, exclude=exclude)
            agrees = (
                shadowed.outcome is decision.outcome and shadowed.replica_id == decision.replica_id
            )
            self.agreement[request.model, name, agrees] += 1
            counter.labels(request.model, name, "yes" if agrees else "no").inc()

    def has_candidate(self, request: GatewayRequest, exclude: frozenset[str]) -> bool:
        now = self.clock()
        exclude |= request.pool.prefill_only
        return any(
            r.routable(now) and r.name not in exclude for r in request.pool.replicas.values()
        )

    def _pair(self, request: GatewayRequest, exclude: frozenset[str]) -> PairDecision | None:
        """The brain's pair choice (``scheduling.disagg.choose_pair``, the pool's
        ``disaggregation`` mode) when it splits ``request`` now; None when its pool has no
        replica of a split role, or the choice is to serve it whole."""
        pool = request.pool
        now = self.clock()
        if (
            not pool.split_roles
            or pool.disaggregation is DisaggMode.COLOCATED
            or not any(
                r.config.role != "both" and r.routable(now) and r.name not in exclude
                for r in pool.replicas.values()
            )
        ):
            return None
        pair = choose_pair(
            self.policies[pool.model],
            self._view(request, _new_id(), now),
            self.replicas,
            now,
            mode=pool.disaggregation,
            link=pool.kv_link,
            exclude=exclude,
        )
        if pair.prefill is None:
            return None
        self._record(pair.decision, pair.decode_request, now)
        return pair

    def plan_handoff(self, request: GatewayRequest, exclude: frozenset[str]) -> Handoff | None:
        """Both legs of ``request``, split into a prefill on P and its decode on D, when
        the brain splits it (``_pair``), dispatched into the shadow state. None: serve it
        whole (``acquire``)."""
        pair = self._pair(request, exclude)
        if pair is None or pair.prefill is None or pair.prefill_request is None:
            return None
        now = self.clock()
        assert pair.prefill.replica_id is not None and pair.decision.replica_id is not None
        prefill = self._grant(
            pair.prefill_request, self._by_id[pair.prefill.replica_id], pair.prefill, now
        )
        decode = self._grant(
            pair.decode_request, self._by_id[pair.decision.replica_id], pair.decision, now
        )
        depth = self.metrics.pd_queue_depth
        depth.labels(request.pool.model, "prefill").set(pair.prefill_queue)
        depth.labels(request.pool.model, "decode").set(pair.decode_queue)
        return Handoff(prefill, decode, pair.transfer_s, pair.prefill_queue, pair.decode_queue)

    def decide_only(self, request: GatewayRequest) -> dict[str, Any]:
        """The decision for ``request`` without dispatching it (``POST /v1/route``); a
        split names its prefill replica too."""
        pair = self._pair(request, frozenset())
        if pair is None:
            now = self.clock()
            view = self._view(request, _new_id(), now)
            decision = self._schedule(view, request.pool.prefill_only, now)
        else:
            decision = pair.decision
        body = self._describe(decision)
        if decision.replica_id is not None:
            body["replica_url"] = self._by_id[decision.replica_id].url
        body["disaggregated"] = pair is not None
        if pair is not None and pair.prefill is not None and pair.prefill.replica_id:
            body["prefill_replica"] = pair.prefill.replica_id
            body["prefill_replica_url"] = self._by_id[pair.prefill.replica_id].url
            body["predicted_transfer_ms"] = _ms(pair.transfer_s)
        return body

    async def acquire(
        self, request: GatewayRequest, exclude: frozenset[str], timeout_s: float | None = None
    ) -> Grant:
        """A replica for one attempt, waiting in the pool queue if the policy says so; a
        wait longer than ``timeout_s`` raises TimeoutError. The timer is set only when the
        request waits: most are bound at once."""
        attempt_id = _new_id()
        now = self.clock()
        loop = asyncio.get_running_loop()
        dispatcher = self._dispatcher(request.pool.model)
        waiter = _Waiter(dispatcher, attempt_id, loop)
        view = self._view(request, attempt_id, now)
        limit = dispatcher.submit(waiter, view, now, exclude | request.pool.prefill_only)
        if limit is None:  # bound or refused at once
            return waiter.result()
        self._show_depth(request.pool.model, dispatcher)
        timer = loop.call_at(loop.time() + (limit - self.clock()), dispatcher.time_out, attempt_id)
        try:
            if timeout_s is None:
                return await waiter
            async with asyncio.timeout(timeout_s):
                return await waiter
        except (asyncio.CancelledError, TimeoutError):
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # bound, but the client left or the time ran out before the attempt began
                self.release(waiter.result(), self.clock(), ok=False, output_tokens=0)
            raise
        finally:
            timer.cancel()
            dispatcher.cancel(attempt_id)
            self._show_depth(request.pool.model, dispatcher)

    def _show_depth(self, pool: str, dispatcher: Dispatcher[_Waiter]) -> None:
        self.metrics.queue_depth.labels(pool).set(len(dispatcher))
        self.metrics.queue_held.labels(pool).set(len(dispatcher.held))

    def _dispatcher(self, pool: str) -> Dispatcher[_Waiter]:
        dispatcher = self._dispatchers.get(pool)
        if dispatcher is None:
            dispatcher = self._dispatchers[pool] = Dispatcher(
                self.queue_size,
                self.queue_timeout_s,
                schedule=self._schedule,
                bind=self._bind,
                reject=self._refuse,
            )
        return dispatcher

    def _bind(self, waiter: _Waiter, view: RequestView, decision: Decision, now: float) -> None:
        """The dispatcher admitted the attempt: dispatch it to the decision's replica."""
        assert decision.replica_id is not None
        waiter.set_result(self._grant(view, self._by_id[decision.replica_id], decision, now))

    def _grant(self, view: RequestView, replica: Upstream, decision: Decision, now: float) -> Grant:
        """Dispatch ``view`` to ``replica`` (shadow state, state bus): the attempt's grant."""
        record = self._dispatch(view, replica, now, decision)
        if self.bus is not None:
            self.bus.dispatched(view, record)
        replica.num_in_flight += 1
        return Grant(replica, view.request_id, decision, record.cached_tokens, view.prompt_tokens)

    def _dispatch(
        self, view: RequestView, replica: Upstream, now: float, decision: Decision | None
    ) -> InFlight:
        """``on_dispatch``, and a wake of the queue when one not streamed should start."""
        record = self.replicas.on_dispatch(view, replica.name, now, decision=decision)
        if record.predicted_start_s is not None:
            # Not streamed: no first token frees its place in the replica's waiting queue;
            # the shadow state starts it at its predicted prefill end, and this wakes the queue.
            delay = max(record.predicted_start_s - now, 0.0)
            asyncio.get_running_loop().call_later(delay, self._wake, replica.pool)
        return record

    def _refuse(
        self,
        waiter: _Waiter,
        view: RequestView,
        reason: RejectReason,
        decision: Decision | None,
    ) -> None:
        """The attempt is refused: by the policy (``decision``) or by the queue itself."""
        self.on_reject(str(reason))
        if decision is not None:
            error = ApiError(
                _REJECT_STATUS.get(reason, 503),
                _REJECT_MESSAGE.get(reason, str(reason)),
                code=str(reason),
                retry_after_s=decision.retry_after_s,
            )
        elif reason is RejectReason.QUEUE_FULL:
            error = ApiError(429, _REJECT_MESSAGE[reason], code=str(reason), retry_after_s=1.0)
        elif reason is RejectReason.DEADLINE:
            error = ApiError(
                429, "deadline passed in the queue", code=str(reason), retry_after_s=1.0
            )
        else:  # QUEUE_TIMEOUT
            error = ApiError(
                503 if view.deadline_s is None else 429,
                "no replica freed up in time",
                code=str(reason),
                retry_after_s=1.0,
            )
        waiter.set_exception(error)

    def _wake(self, pool: str) -> None:
        """A replica of ``pool`` freed capacity: queued requests try again, in order."""
        dispatcher = self._dispatchers.get(pool)
        if dispatcher:
            dispatcher.wake(self.clock())
            self._show_depth(pool, dispatcher)

    def queue_depth(self, pool: str) -> int:
        dispatcher = self._dispatchers.get(pool)
        return len(dispatcher) if dispatcher else 0

    def queue_flows(self, pool: str) -> Counter[str | None]:
        """Of ``queue_depth``, how many of each flow (API key) wait."""
        dispatcher = self._dispatchers.get(pool)
        return dispatcher.flows() if dispatcher else Counter()

    def queue_held(self, pool: str) -> int:
        """Of ``queue_depth``, the requests held by SLO admission."""
        dispatcher = self._dispatchers.get(pool)
        return len(dispatcher.held) if dispatcher else 0

    def wake_all(self) -> None:
        """Give queued requests a chance after fresh load figures (scrapes) arrive."""
        for pool in self._dispatchers:
            self._wake(pool)

    def _record(self, decision: Decision, view: RequestView, now: float) -> None:
        self.metrics.decisions.labels(decision.policy).inc()
        self._recent.append((now, view.prompt_tokens, decision))

    def recent_decisions(self) -> list[dict[str, Any]]:
        """The latest decisions, oldest first, with every plugin's scores."""
        return [
            {**self._describe(decision), "at_s": at_s, "prompt_tokens": prompt_tokens}
            for at_s, prompt_tokens, decision in self._recent
        ]

    @staticmethod
    def _describe(decision: Decision) -> dict[str, Any]:
        explanation = decision.explanation
        return {
            "outcome": str(decision.outcome),
            "policy": decision.policy,
            "replica": decision.replica_id,
            "reason": None if decision.reason is None else str(decision.reason),
            "retry_after_s": decision.retry_after_s,
            "route_class": decision.route_class,
            "predicted_ttft_ms": _ms(decision.predicted_ttft_s),
            "predicted_e2e_ms": _ms(decision.predicted_e2e_s),
            "predicted_output_tokens": decision.predicted_output_tokens,
            "cached_tokens": decision.cached_tokens,
            "scores": explanation.top() if explanation else [],
        }

    # -- progress of an admitted attempt ------------------------------------------------

    def on_tokens(self, grant: Grant, num_tokens: int, now: float) -> None:
        """Streamed tokens arrived; the first call also marks the first token."""
        self.replicas.on_tokens(grant.attempt_id, num_tokens, now)
        if self.bus is not None:
            self.bus.streamed(grant.attempt_id, num_tokens, first=not grant.streaming)
        if not grant.streaming:
            grant.streaming = True
            self._wake(grant.replica.pool)  # it left the replica's waiting queue

    def follow_kv_events(self, replica: Upstream) -> KvEventTracker:
        """A tracker applying ``replica``'s engine KV events to its prefix entries."""
        slot = self.replicas.get(replica.name).slot
        tracker = KvEventTracker(self.replicas.prefix, slot, self.block_tokens)
        self.kv_trackers[replica.name] = tracker
        return tracker

    def unfollow_kv_events(self, replica: Upstream, tracker: KvEventTracker) -> None:
        if self.kv_trackers.get(replica.name) is tracker:
            del self.kv_trackers[replica.name]

    def check_prefix_hit(self, grant: Grant, cached_tokens: int) -> int | None:
        """The hit predicted for ``grant``'s replica in the engine's terms (whole engine
        blocks, never the last prompt token), counted against the ``cached_tokens`` the
        engine reported; None while the engine's block size is unknown (from its KV
        events, else its ``vllm:cache_config_info``)."""
        replica = grant.replica
        tracker = self.kv_trackers.get(replica.name)
        scraped = replica.last_scrape
        block_tokens = (tracker and tracker.engine_block_tokens) or (
            scraped and scraped.kv_block_tokens
        )
        if not block_tokens:
            return None
        predicted = engine_cached_tokens(grant.matched_tokens, grant.prompt_tokens, block_tokens)
        outcome = (
            "exact"
            if predicted == cached_tokens
            else "over"
            if predicted > cached_tokens
            else "under"
        )
        self.metrics.prefix_predictions.labels(grant.replica.name, outcome).inc()
        return predicted

    def reassign(self, grant: Grant, request: GatewayRequest, replica: Upstream) -> Grant:
        """The data plane served ``grant``'s attempt on ``replica`` instead (one of the
        picker's fallbacks): the shadow state holds the request there from now on."""
        now = self.clock()
        self.release(grant, now, ok=False, output_tokens=0)
        return self._grant(self._view(request, _new_id(), now), replica, grant.decision, now)

    def release(self, grant: Grant, now: float, *, ok: bool, output_tokens: int | None) -> None:
        """The attempt ended; frees its place and maybe the replica's last hold (once).
        ``output_tokens``: from the usage; None when the data plane never saw it."""
        if grant.released:
            return
        grant.released = True
        self.replicas.on_complete(
            grant.attempt_id, now, ok=ok, output_tokens=output_tokens if ok else None
        )
        if self.bus is not None:
            self.bus.ended(grant.attempt_id, ok=ok, output_tokens=output_tokens)
        replica = grant.replica
        replica.num_in_flight -= 1
        self.sync_health(replica, now)
        if replica.removing and replica.num_in_flight == 0:
            self.on_idle(replica)
        self._wake(replica.pool)

    # -- peers' requests (the state bus, ``isocost.runtime.bus.ForeignSink``) -----------

    def foreign_dispatch(self, view: RequestView, replica_id: str) -> bool:
        replica = self._by_id.get(replica_id)
        if replica is None:
            return False
        self._dispatch(view, replica, self.clock(), None)
        return True

    def foreign_first_token(self, request_id: str) -> None:
        if self.replicas.on_first_token(request_id, self.clock()):
            self.wake_all()

    def foreign_tokens(self, request_id: str, count: int) -> None:
        self.replicas.on_tokens(request_id, count, self.clock())

    def foreign_end(self, request_id: str, *, ok: bool, output_tokens: int | None) -> None:
        if self.replicas.on_complete(request_id, self.clock(), ok=ok, output_tokens=output_tokens):
            self.wake_all()

    def foreign_rejected(self, reason: str) -> None:
        self.metrics.state_bus_rejected.labels(reason).inc()

    def foreign_gap(self) -> None:
        self.metrics.state_bus_gaps.inc()


class _PolicyHooks:
    """Passes the brain's shadow hooks on to the policy of the request's pool and to its
    candidates (``Router.candidates``): they see the real dispatches and ends."""

    def __init__(
        self, policies: dict[str, Policy], candidates: dict[str, dict[str, Policy]]
    ) -> None:
        self.policies = policies
        self.candidates = candidates

    def on_dispatch(self, record: InFlight, now: float) -> None:
        policy = self.policies.get(record.model)
        if policy is not None:
            policy.on_dispatch(record, now)
        for candidate in self.candidates.get(record.model, _NO_CANDIDATES).values():
            candidate.on_dispatch(record, now)

    def on_first_token(self, record: InFlight, now: float) -> None:
        policy = self.policies.get(record.model)
        if policy is not None:
            policy.on_first_token(record, now)
        for candidate in self.candidates.get(record.model, _NO_CANDIDATES).values():
            candidate.on_first_token(record, now)

    def on_complete(self, record: InFlight, now: float, ok: bool) -> None:
        policy = self.policies.get(record.model)
        if policy is not None:
            policy.on_complete(record, now, ok)
        for candidate in self.candidates.get(record.model, _NO_CANDIDATES).values():
            candidate.on_complete(record, now, ok)


class _Waiter(asyncio.Future[Grant]):
    """The future of one queued attempt: the dispatcher resolves it with its ``Grant`` or
    an ``ApiError``. Cancelling it (the client went away) takes the attempt out of the
    queue at once, so that no wake binds an attempt nobody awaits any more."""

    def __init__(
        self, dispatcher: Dispatcher[_Waiter], attempt_id: str, loop: asyncio.AbstractEventLoop
    ) -> None:
        super().__init__(loop=loop)
        self._dispatcher = dispatcher
        self._attempt_id = attempt_id

    def cancel(self, msg: Any | None = None) -> bool:
        self._dispatcher.cancel(self._attempt_id)
        return super().cancel(msg)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)
