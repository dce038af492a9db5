"""The gateway's HTTP application: the public routes and the one error middleware.

``POST /v1/chat/completions`` and ``/v1/completions`` pass the intake, then the forwarder;
``POST /v1/route`` answers the router's decision without forwarding; ``GET /v1/models``,
``/health`` and ``/metrics`` describe the gateway; the admin API and the dashboard add
their routes. Every error, whoever raised it, becomes its HTTP answer in ``_errors``, which
also counts the gateway's own refusals (``Rejection``) under their reasons.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from isocost.gateway.admin import add_admin_routes
from isocost.gateway.dashboard import add_dashboard_routes
from isocost.gateway.intake import Rejection, defer_continue
from isocost.gateway.lifecycle import Gateway
from isocost.gateway.proxy import CLIENT_GONE_STATUS, ClientGone, ForwardResult
from isocost.gateway.routing import GatewayRequest
from isocost.gateway.tracing import RequestSpan
from isocost.gateway.workers import SIBLING_HEADER
from isocost.openai.errors import ApiError, error_response
from isocost.openai.http import close_unread
from isocost.openai.responses import json_response

__all__ = ["GATEWAY", "build_app"]

log = logging.getLogger("isocost.gateway")

_NO_ROUTE = ""

GATEWAY = web.AppKey("gateway", Gateway)
# The API key a refused request came with (its x-ratelimit-* headers go on the error)
_KEY_NAME = web.RequestKey("key_name", str)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place exceptions become HTTP answers (OpenAI-style JSON)."""
    try:
        return await handler(request)
    except ApiError as exc:
        gateway = request.app[GATEWAY]
        key_name = request.get(_KEY_NAME)
        if isinstance(exc, Rejection):
            gateway.refused(exc)
            key_name = exc.key
        response = error_response(exc, gateway.intake.rate_limit_headers(key_name))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = error_response(ApiError.from_http(exc))
    return await close_unread(request, response)


def _account(
    gateway: Gateway, request: GatewayRequest, result: ForwardResult, span: RequestSpan | None
) -> None:
    """Log, count and charge how ``request`` ended: once per request, whatever the end."""
    gateway.intake.charge_output(request, result.output_tokens, time.monotonic())
    replica = result.replica
    name = replica.name if replica else _NO_ROUTE
    gateway.metrics.requests.labels(str(result.status), request.pool.model, name).inc()
    gateway.account_key(
        request.key_name,
        result.status,
        prompt_tokens=request.view.prompt_tokens if replica is not None else 0,
        output_tokens=result.output_tokens,
    )
    split = "yes" if result.disaggregated else "no"
    gateway.metrics.disaggregated.labels(request.pool.model, split).inc()
    e2e_s = time.monotonic() - request.arrived_at
    if replica is not None and result.status < 400:
        gateway.metrics.e2e.labels(name).observe(e2e_s)
    verdict = _slo_verdict(request, result, e2e_s)
    if verdict is not None:
        request.pool.verdicts[verdict] += 1
        gateway.metrics.slo_requests.labels(request.pool.model, verdict).inc()
    record = {
        "request_id": request.request_id,
        "pool": request.pool.model,
        "replica": name,
        "status": result.status,
        "stream": request.view.stream,
        "prompt_tokens": request.view.prompt_tokens,
        "max_tokens": request.view.max_tokens,
        "output_tokens": result.output_tokens,
        "retries": result.retries,
        "resumes": result.resumes,
        "cached_tokens": result.cached_tokens,
        "predicted_cached_tokens": result.predicted_cached_tokens,
        "ttft_ms": _ms(result.ttft_s),
        "predicted_ttft_ms": _ms(result.predicted_ttft_s),
        "e2e_ms": round(e2e_s * 1000, 1),
        "key": request.key_name,
        "error": result.error,
        "disaggregated": result.disaggregated,
        "prefill_replica": result.prefill_replica.name if result.prefill_replica else None,
        "prefill_ms": _ms(result.prefill_s),
        "kv_transfer_ms": _ms(result.kv_transfer_s),
        "handoff_failures": result.handoff_failures,
        "prefill_queue": result.queues[0] if result.queues else None,
        "decode_queue": result.queues[1] if result.queues else None,
    }
    log.info("request", extra={"event": "request", **record})
    gateway.tracing.describe(span, record)
    if gateway.recording.active:
        gateway.recording.record(request, result, e2e_s)
    gateway.shadow.record(request, result, e2e_s)


def _slo_verdict(request: GatewayRequest, result: ForwardResult, e2e_s: float) -> str | None:
    """met / missed / failed for a request with an SLO; None without one, or when the client
    left or sent what no replica could serve (neither says anything about capacity)."""
    slo = request.slo()
    status = result.status
    if slo is None or status == CLIENT_GONE_STATUS or (400 <= status < 500 and status != 429):
        return None
    if status >= 400:
        return "failed"
    met = slo.met_answer(request.view.prompt_tokens, result.output_tokens, result.ttft_s, e2e_s)
    return "met" if met else "missed"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


async def _completion(http: web.Request, *, chat: bool) -> web.StreamResponse:
    """Forward one request and log and count how it ended, exactly once, however it did:
    answered, refused, or the client gone (aiohttp cancels the handler when it leaves)."""
    gateway = http.app[GATEWAY]
    with gateway.tracing.request(http.headers, chat=chat) as span:
        body, request = await gateway.intake.prepare(http, chat=chat)
        result = ForwardResult(CLIENT_GONE_STATUS)
        gateway.intake.admit(request)
        try:
            response = await gateway.forwarder.forward(http, body, request, result)
        except ApiError as exc:
            result.status = exc.status
            _account(gateway, request, result, span)
            if request.key_name is not None:
                http[_KEY_NAME] = request.key_name
            raise
        except ClientGone as exc:
            result.status, result.error = CLIENT_GONE_STATUS, exc.reason
            _account(gateway, request, result, span)
            return web.Response(status=CLIENT_GONE_STATUS)  # never sent: the connection closed
        except asyncio.CancelledError:
            result.status, result.error = CLIENT_GONE_STATUS, "client disconnected"
            _account(gateway, request, result, span)
            raise
        finally:
            gateway.intake.release(request)
        _account(gateway, request, result, span)
        return response


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=True)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=False)


async def _route(request: web.Request) -> web.StreamResponse:
    """``POST /v1/route``: the decision for a chat or completion body, without forwarding."""
    gateway = request.app[GATEWAY]
    chat = request.query.get("kind", "chat") != "completion"
    _, prepared = await gateway.intake.prepare(request, chat=chat)
    return json_response(gateway.router.decide_only(prepared))


async def _models(request: web.Request) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    gateway.intake.authenticate(request.headers)
    now = time.monotonic()
    data = [
        {
            "id": pool.model,
            "object": "model",
            "owned_by": "isocost",
            "replicas": sum(r.routable(now) for r in pool.replicas.values()),
        }
        for pool in gateway.pools.values()
    ]
    return json_response({"object": "list", "data": data})


async def _health(request: web.Request) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    now = time.monotonic()
    routable = sum(r.routable(now) for r in gateway.replicas.values())
    status = "draining" if gateway.draining else "ok"
    return json_response(
        {"status": status, "replicas": len(gateway.replicas), "routable_replicas": routable},
        status=503 if gateway.draining else 200,
    )


async def _metrics(request: web.Request) -> web.StreamResponse:
    """This gateway's series; with ``serve --workers``, every worker's, labelled."""
    gateway = request.app[GATEWAY]
    body = generate_latest(gateway.metrics.registry)
    if gateway.workers is not None and SIBLING_HEADER not in request.headers:
        body = await gateway.workers.gather_metrics(body)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(gateway: Gateway) -> web.Application:
    """The aiohttp application serving ``gateway``; starts and stops it with the app."""
    app = web.Application(
        middlewares=[_errors], client_max_size=gateway.config.limits.max_body_bytes + 1
    )
    app[GATEWAY] = gateway

    async def lifecycle(_: web.Application) -> AsyncIterator[None]:
        await gateway.start()
        yield
        await gateway.stop()

    app.cleanup_ctx.append(lifecycle)
    for path, handler in (
        ("/v1/chat/completions", _chat),
        ("/v1/completions", _completions),
        ("/v1/route", _route),
    ):  # the intake sends 100 Continue itself, once the key and length are checked
        app.router.add_post(path, handler, expect_handler=defer_continue)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    add_admin_routes(app, gateway)
    add_dashboard_routes(app)
    return app
