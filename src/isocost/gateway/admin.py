"""The admin API under ``/admin/``, behind the admin token (constant-time comparison).

Routes (token as ``Authorization: Bearer <token>`` or ``X-Admin-Token``):

* ``GET  /admin/replicas``                       replicas with state, load and last scores
* ``POST /admin/replicas``                       add ``{"model", "replica": {"url", ...}}``
  (the config file's checks of a replica entry; 400 with ``param`` naming the field)
* ``DELETE /admin/replicas/{name}``              drain, then remove once idle
* ``POST /admin/replicas/{name}/drain``          stop new work (in-flight requests finish);
  ``{"by"?}`` names who drained it (``drained_by``), so that an autoscaler restarted after
  a kill can tell its predecessor's drains from an operator's
* ``POST /admin/replicas/{name}/undrain``
* ``POST /admin/policy``                         ``{"policy", "model"?}`` switch the policy
* ``GET  /admin/snapshot``                       everything a dashboard polls, one JSON (with
  ``serve --workers``: requests in flight and queued summed over every worker)
* ``GET  /admin/changes``                        ``serve --workers``: this worker's admin
  changes, in order (what a restarted sibling repeats)
* ``GET  /admin/recording``                      whether traffic is recorded, where, counts
* ``POST /admin/recording/start``                ``{"dir"?}`` record (default: ``--record``)
* ``POST /admin/recording/stop``                 write what is queued, then stop
* ``POST /admin/autoscaler``                     ``isocost autoscale``'s status each interval
  (desired, ready, pending, draining, forecast, instance); the snapshot shows it with its
  age, stale after ``_STALE_INTERVALS`` intervals without a newer one, and the instances
  that posted within theirs (``live_instances``: whose drains are still their own)

Without a configured admin token the API answers 403; a missing or wrong token, 401.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
from aiohttp import web

from isocost.core.errors import ConfigError, IsocostError
from isocost.core.slo import SloTargets
from isocost.gateway.auth import bearer_token
from isocost.gateway.intake import Rejection, defer_continue
from isocost.gateway.lifecycle import Gateway
from isocost.gateway.upstreams import Upstream
from isocost.gateway.workers import SIBLING_HEADER
from isocost.openai.errors import ApiError
from isocost.openai.http import read_whole, send_continue
from isocost.openai.responses import json_response
from isocost.runtime.config import ReplicaConfig

__all__ = ["add_admin_routes", "snapshot"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_RELAYED = frozenset({"authorization", "x-admin-token", "content-type"})  # to sibling workers
_T = TypeVar("_T")


class _AddReplica(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    model: str
    replica: ReplicaConfig


class _StartRecording(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    dir: str | None = None


# Who a caller says it is (a drain's ``by``, an autoscaler's ``instance``): one short word.
_Who = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")]


class _Drain(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    by: _Who | None = None


class _AutoscalerStatus(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    desired: int
    ready: int
    pending: int
    draining: int
    forecast_rps: float
    interval_s: float
    dry_run: bool = False
    ejected: int = 0  # an autoscaler older than this field sends none
    instance: _Who | None = None  # likewise


_STALE_INTERVALS = 3


def _stale(age_s: float, interval_s: float) -> bool:
    """An autoscaler's status older than ``_STALE_INTERVALS`` of its intervals."""
    return age_s > _STALE_INTERVALS * interval_s


_QUEUE_FLOWS_SHOWN = 20  # flows named per pool in the snapshot (header flows are many)
# Replica counts in an autoscaler status.
_COUNTS = ("desired", "ready", "pending", "draining", "ejected")


class _SwitchPolicy(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    policy: str
    model: str | None = None


def _decode(body: bytes, kind: type[_T]) -> _T:
    try:
        return msgspec.json.decode(body, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ApiError(400, str(exc), code="invalid_request") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply", code="invalid_request") from None


def _p50_ms(samples: Any) -> float | None:
    values = list(samples)
    return round(statistics.median(values) * 1000, 2) if values else None


def replica_row(
    gateway: Gateway, replica: Upstream, now: float, decisions: list[dict[str, Any]]
) -> dict[str, Any]:
    """One replica as the admin API and the dashboard show it."""
    router = gateway.router
    state = router.replicas.get(replica.name) if replica.name in router.replicas else None
    scraped = replica.last_scrape
    config = replica.config
    return {
        "name": replica.name,
        "url": replica.url,
        "pool": replica.pool,
        "state": replica.health_state(now),
        "drained_by": replica.drained_by,
        "breaker": replica.breaker.state(now).value,
        "success_rate": round(replica.breaker.success_rate(), 3),
        "last_error": replica.breaker.last_error,
        "gpu": config.gpu,
        "tensor_parallel": config.tp,
        "weight": config.weight,
        "usd_per_hour": state.spec.price_usd_per_hour if state else config.usd_per_hour,
        "in_flight": replica.num_in_flight,
        "shadow_in_flight": len(state.in_flight) if state else 0,  # with state-bus peers'
        "shadow_waiting": state.num_waiting if state else 0,
        "shadow_running": state.num_running if state else 0,
        "engine_running": scraped.num_running if scraped else None,
        "engine_waiting": scraped.num_waiting if scraped else None,
        "kv_usage": scraped.kv_usage if scraped else None,
        "scrape_age_s": replica.scrape_age_s(now),
        "scrape_error": replica.scrape_error,
        "ttft_factor": round(state.ttft_factor, 4) if state else None,
        "itl_factor": round(state.itl_factor, 4) if state else None,
        "ttft_error": round(state.ttft_error, 4) if state else None,
        "prefill_terms_ms": {k: round(v * 1e3, 4) for k, v in state.prefill_terms_s.items()}
        if state
        else None,
        "itl_error": round(state.itl_error, 4) if state else None,
        "prefill_duty": round(state.prefill_duty(now), 4) if state else None,
        "recent_ttft_p50_ms": _p50_ms(replica.recent_ttft_s),
        "recent_itl_p50_ms": _p50_ms(replica.recent_itl_s),
        "last_ttft_ms": round(replica.recent_ttft_s[-1] * 1000, 2)
        if replica.recent_ttft_s
        else None,
        "last_score": _last_score(decisions, replica.name),
        "view_divergence": gateway.view_divergence.get(replica.name),
    }


def _last_score(decisions: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    for decision in reversed(decisions):
        for row in decision["scores"]:
            if row["replica_id"] == name:
                return dict(row)
    return None


def snapshot(gateway: Gateway) -> dict[str, Any]:
    """Everything the dashboard shows, in one JSON-able dict."""
    now = time.monotonic()
    decisions = gateway.router.recent_decisions()
    bus = gateway.router.bus
    rows = [replica_row(gateway, r, now, decisions) for r in gateway.replicas.values()]
    pools = []
    for pool in gateway.pools.values():
        members = [row for row in rows if row["pool"] == pool.model]
        pools.append(
            {
                "model": pool.model,
                "policy": pool.policy,
                "replicas": len(members),
                "healthy": sum(row["state"] == "healthy" for row in members),
                "in_flight": sum(row["in_flight"] for row in members),
                "queue_depth": gateway.router.queue_depth(pool.model),
                "queue_held": gateway.router.queue_held(pool.model),
                # who fills it: the most waiting flows (API keys), "" for requests of none
                "queue_flows": {
                    flow or "": waiting
                    for flow, waiting in gateway.router.queue_flows(pool.model).most_common(
                        _QUEUE_FLOWS_SHOWN
                    )
                },
                "slo": None if pool.slo is None else _targets_ms(pool.slo),
                "slo_verdicts": {v: pool.verdicts[v] for v in ("met", "missed", "failed")},
            }
        )
    return {
        "time_unix_s": time.time(),
        "uptime_s": now - gateway.started_at,
        "pools": pools,
        "replicas": rows,
        "decisions": decisions,
        "rejections": dict(gateway.rejections),
        "shadow": gateway.shadow.status(now),
        "state_bus": None if bus is None else {"up": bus.up, "peers": len(bus.views.peers)},
        "worker": None if gateway.workers is None else gateway.workers.worker_id,
        "pid": os.getpid(),
        "autoscaler": _autoscaler(gateway, now),
    }


def _autoscaler(gateway: Gateway, now: float) -> dict[str, Any] | None:
    """The autoscaler's last status with its age (None: none was ever posted)."""
    if gateway.autoscaler is None:
        return None
    received, status = gateway.autoscaler
    age = now - received
    return status | {
        "age_s": round(age, 3),
        "stale": _stale(age, status["interval_s"]),
        "live_instances": sorted(
            instance
            for instance, (seen, interval_s) in gateway.autoscaler_instances.items()
            if not _stale(now - seen, interval_s)
        ),
    }


def _targets_ms(slo: SloTargets) -> dict[str, float | None]:
    """A pool's SLO in the config's terms (None: no such target)."""

    def ms(seconds: float) -> float | None:
        return None if math.isinf(seconds) else round(seconds * 1000, 3)

    return {
        "ttft_ms": ms(slo.ttft_s),
        "tpot_ms": ms(slo.tpot_s),
        "ttft_per_1k_ms": round(slo.ttft_per_1k_s * 1000, 3),
    }


def add_admin_routes(app: web.Application, gateway: Gateway) -> None:
    """Register the ``/admin/`` routes of ``gateway`` on ``app``."""

    async def read_body(request: web.Request) -> bytes:
        """The body whole, within the limits' body deadline (408), decoded (else 400)."""
        return await read_whole(request, gateway.config.limits.body_timeout_ms / 1000)

    def check_token(request: web.Request) -> None:
        auth = gateway.intake.auth
        if not auth.admin_enabled:
            raise ApiError(
                403, "the admin API is disabled: set auth.admin_token", code="admin_disabled"
            )
        token = bearer_token(request.headers.get("Authorization")) or request.headers.get(
            "X-Admin-Token"
        )
        if not auth.is_admin(token):
            raise Rejection(
                "admin_unauthorized",
                401,
                "missing or invalid admin token",
                code="invalid_admin_token",
            )

    def guarded(handler: Handler, *, kept: bool = True) -> Handler:
        """``handler`` behind the admin token; with ``serve --workers`` a change it made is
        made on every sibling too, and ``kept`` for a restarted one (a status report is
        relayed, not kept: only its latest matters)."""

        async def check(request: web.Request) -> web.StreamResponse:
            check_token(request)
            await send_continue(request)  # Expect: 100-continue only once the token passed
            response = await handler(request)
            workers = gateway.workers
            if workers is None or request.method == "GET" or response.status >= 300:
                return response
            body = await request.read()
            if kept:
                workers.made(request.method, request.path_qs, body)
            if SIBLING_HEADER not in request.headers:  # the same change on every other worker
                headers = {k: v for k, v in request.headers.items() if k.lower() in _RELAYED}
                failed = await workers.fan_out(request.method, request.path_qs, body, headers)
                if failed:
                    response.headers["x-isocost-workers-failed"] = ",".join(map(str, failed))
            return response

        return check

    def rows(*only: Upstream) -> list[dict[str, Any]]:
        now, decisions = time.monotonic(), gateway.router.recent_decisions()
        return [replica_row(gateway, r, now, decisions) for r in only or gateway.replicas.values()]

    def find(name: str) -> Upstream:
        for replica in gateway.replicas.values():
            if replica.name == name:
                return replica
        raise ApiError(404, f"no replica named {name!r}", code="replica_not_found")

    async def list_replicas(request: web.Request) -> web.StreamResponse:
        return json_response({"replicas": rows()})

    async def add(request: web.Request) -> web.StreamResponse:
        body = _decode(await read_body(request), _AddReplica)
        try:
            replica = gateway.add_replica(body.model, body.replica)
        except ConfigError as exc:
            raise ApiError(400, str(exc), code="invalid_replica", param=exc.key) from None
        return json_response(rows(replica)[0], 201)

    async def remove(request: web.Request) -> web.StreamResponse:
        replica = find(request.match_info["name"])
        gateway.remove_replica(replica.url)
        return json_response(
            {"name": replica.name, "state": replica.health_state(time.monotonic())}
        )

    async def drain(request: web.Request) -> web.StreamResponse:
        raw = await read_body(request)
        body = _decode(raw, _Drain) if raw.strip() else _Drain()
        replica = find(request.match_info["name"])
        gateway.router.set_draining(replica, True)
        replica.drained_by = body.by  # the latest drain's: an operator's takes it over
        return json_response(rows(replica)[0])

    async def undrain(request: web.Request) -> web.StreamResponse:
        replica = find(request.match_info["name"])
        gateway.router.set_draining(replica, False)
        return json_response(rows(replica)[0])

    async def switch_policy(request: web.Request) -> web.StreamResponse:
        body = _decode(await read_body(request), _SwitchPolicy)
        if body.model is not None and body.model not in gateway.pools:
            raise ApiError(404, f"no pool for model {body.model!r}", code="model_not_found")
        pools = [gateway.pools[body.model]] if body.model else list(gateway.pools.values())
        try:
            for pool in pools:
                gateway.router.set_policy(pool, body.policy)
        except IsocostError as exc:
            raise ApiError(400, str(exc), code="unknown_policy", param="policy") from None
        return json_response({"pools": {pool.model: pool.policy for pool in pools}})

    async def changes(request: web.Request) -> web.StreamResponse:
        if gateway.workers is None:
            raise ApiError(
                404, "admin changes are kept by the workers of serve --workers only",
                code="not_found",
            )  # fmt: skip
        return json_response(gateway.workers.changes_view())

    async def post_autoscaler(request: web.Request) -> web.StreamResponse:
        body = _decode(await read_body(request), _AutoscalerStatus)
        checks = [(name, getattr(body, name) >= 0) for name in _COUNTS]
        checks += [
            ("forecast_rps", body.forecast_rps >= 0 and math.isfinite(body.forecast_rps)),
            ("interval_s", body.interval_s > 0 and math.isfinite(body.interval_s)),
        ]
        for name, valid in checks:
            if not valid:
                raise ApiError(
                    400,
                    f"{name} must be {'> 0' if name == 'interval_s' else '>= 0'}",
                    code="invalid_request",
                    param=name,
                )
        now = time.monotonic()
        gateway.autoscaler = (now, msgspec.structs.asdict(body))
        seen = gateway.autoscaler_instances
        for instance, (at, interval_s) in list(seen.items()):  # only the live are kept
            if _stale(now - at, interval_s):
                del seen[instance]
        if body.instance is not None:
            seen[body.instance] = (now, body.interval_s)
        return json_response(gateway.autoscaler[1])

    async def get_snapshot(request: web.Request) -> web.StreamResponse:
        view = snapshot(gateway)
        if gateway.workers is not None and SIBLING_HEADER not in request.headers:
            headers = {k: v for k, v in request.headers.items() if k.lower() in _RELAYED}
            view = await gateway.workers.gather_snapshot(view, headers)
        return json_response(view)

    async def recording(request: web.Request) -> web.StreamResponse:
        return json_response(gateway.recording.status())

    async def start_recording(request: web.Request) -> web.StreamResponse:
        if gateway.workers is not None:  # every worker would write the same directory
            raise ApiError(
                409, "recording is not supported with serve --workers", code="unsupported"
            )
        raw = await read_body(request)
        body = _decode(raw, _StartRecording) if raw.strip() else _StartRecording()
        try:
            await gateway.recording.start(Path(body.dir) if body.dir else None)
        except ValueError as exc:
            raise ApiError(400, str(exc), code="invalid_request", param="dir") from None
        return json_response(gateway.recording.status())

    async def stop_recording(request: web.Request) -> web.StreamResponse:
        await gateway.recording.stop()
        return json_response(gateway.recording.status())

    app.router.add_get("/admin/replicas", guarded(list_replicas))
    app.router.add_post("/admin/replicas", guarded(add), expect_handler=defer_continue)
    app.router.add_delete("/admin/replicas/{name}", guarded(remove))
    app.router.add_post(
        "/admin/replicas/{name}/drain", guarded(drain), expect_handler=defer_continue
    )
    app.router.add_post(
        "/admin/replicas/{name}/undrain", guarded(undrain), expect_handler=defer_continue
    )
    app.router.add_post("/admin/policy", guarded(switch_policy), expect_handler=defer_continue)
    app.router.add_get("/admin/snapshot", guarded(get_snapshot))
    app.router.add_get("/admin/changes", guarded(changes))
    app.router.add_post(
        "/admin/autoscaler", guarded(post_autoscaler, kept=False), expect_handler=defer_continue
    )
    app.router.add_get("/admin/recording", guarded(recording))
    for path, handler in (("start", start_recording), ("stop", stop_recording)):
        app.router.add_post(
            f"/admin/recording/{path}", guarded(handler), expect_handler=defer_continue
        )
