"""The gateway process: state, background loops, and the public HTTP routes.

One ``Gateway`` owns the pools and replicas, the client session to them, the router (the
brain's adapter), auth, metrics and the background tasks: per replica one monitor that
scrapes ``/metrics`` every ``scrape_interval_ms`` and probes ``/health`` every
``health.interval_ms``, and, with ``--config``, a watcher that reloads the file when its
content changes. Requests flow: auth -> body limits -> routing view -> pool -> key budget
-> router (admission, queue, decision) -> forwarder (attempts, retries, relay).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from isocost.core.catalog import Catalog
from isocost.core.errors import IsocostError
from isocost.files import read_text
from isocost.gateway.admin import add_admin_routes
from isocost.gateway.auth import ApiKey, Authenticator, bearer_token
from isocost.gateway.body import routing_view
from isocost.gateway.config import (
    GatewayConfig,
    LimitsConfig,
    ReplicaConfig,
    normalize_replica_url,
    parse_config,
)
from isocost.gateway.dashboard import add_dashboard_routes
from isocost.gateway.health import BreakerState
from isocost.gateway.metrics import GatewayMetrics
from isocost.gateway.proxy import Forwarder, ForwardSettings, Outcome
from isocost.gateway.replicas import Pool, Replica
from isocost.gateway.routing import GatewayRequest, Router
from isocost.gateway.scrape import ScrapeError, parse_engine_metrics
from isocost.openai.errors import ApiError, error_response
from isocost.openai.requests import RequestError

__all__ = ["GATEWAY", "Gateway", "build_app"]

log = logging.getLogger("isocost.gateway")

_RELOAD_POLL_S = 0.5
_NO_ROUTE = ""


class Gateway:
    """Everything one ``isocost serve`` process holds."""

    def __init__(
        self, config: GatewayConfig, catalog: Catalog, config_path: Path | None = None
    ) -> None:
        self.config = config
        self.catalog = catalog
        self.config_path = config_path
        self._config_digest = _digest(config_path) if config_path else None
        self.metrics = GatewayMetrics()
        self.auth = Authenticator(config.auth, time.monotonic())
        self.pools: dict[str, Pool] = {}
        self.replicas: dict[str, Replica] = {}
        self.rejections: Counter[str] = Counter()
        self.router = Router(
            catalog,
            self.metrics,
            self.finalize_removal,
            self.reject,
            queue_size=config.limits.max_queue,
            queue_timeout_s=config.limits.queue_timeout_ms / 1000,
        )
        self.started_at = time.monotonic()
        self._monitors: dict[str, asyncio.Task[None]] = {}
        self._watcher: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._forwarder: Forwarder | None = None

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
        )
        self._forwarder = Forwarder(
            self._session, self.router, _forward_settings(self.config.limits)
        )
        self.apply_config(self.config)
        if self.config_path is not None:
            self._watcher = asyncio.create_task(self._watch_config())

    async def stop(self) -> None:
        tasks = [*self._monitors.values(), *([self._watcher] if self._watcher else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._monitors.clear()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Gateway.start() not called"
        return self._session

    # -- replicas and config ------------------------------------------------------------

    def apply_config(self, config: GatewayConfig) -> None:
        """Make the live pools match ``config``; removed replicas drain, then leave."""
        self.config = config
        self.router.set_scheduling(config.scheduling)
        self.router.queue_size = config.limits.max_queue
        self.router.queue_timeout_s = config.limits.queue_timeout_ms / 1000
        if self._forwarder is not None:
            self._forwarder.settings = _forward_settings(config.limits)
        wanted: dict[str, tuple[str, ReplicaConfig]] = {}
        for pool_config in config.pools:
            pool = self.pools.get(pool_config.model)
            policy = pool_config.policy or config.policy
            if pool is None:
                pool = self.pools[pool_config.model] = Pool(pool_config.model, policy)
            self.router.set_policy(pool, policy)
            for replica_config in pool_config.replicas:
                wanted[normalize_replica_url(replica_config.url)] = (
                    pool_config.model,
                    replica_config,
                )
        for url, replica in list(self.replicas.items()):
            if url not in wanted or wanted[url][0] != replica.pool:
                self.remove_replica(url)
            elif wanted[url][1] != replica.config:
                self.remove_replica(url, finalize_now=True)
            elif replica.removing:  # listed again before its drain ended: keep it
                replica.removing = False
                self.router.set_draining(replica, replica.drained)
        for url, (model, replica_config) in wanted.items():
            if url not in self.replicas:
                self.add_replica(model, replica_config)
        for pool in list(self.pools.values()):
            self._drop_if_unused(pool)
        if config.auth != self.auth.config:  # unchanged keys keep their budgets
            self.auth = Authenticator(config.auth, time.monotonic())

    def add_replica(self, model: str, replica_config: ReplicaConfig) -> Replica:
        pool = self.pools.get(model)
        if pool is None:
            pool = self.pools[model] = Pool(model, self.config.policy)
            self.router.set_policy(pool, self.config.policy)
        replica = Replica(replica_config, model, self.config.health)
        if replica.url in self.replicas:
            raise IsocostError(f"replica {replica.url} already exists")
        self.router.add_replica(pool, replica)
        pool.replicas[replica.url] = replica
        self.replicas[replica.url] = replica
        self._monitors[replica.url] = asyncio.create_task(self._monitor(replica))
        log.info("replica added", extra={"event": "replica_added", "replica": replica.name})
        return replica

    def remove_replica(self, url: str, *, finalize_now: bool = False) -> None:
        """Stop new work to ``url``; it leaves once its in-flight requests end."""
        replica = self.replicas.get(url)
        if replica is None:
            return
        replica.removing = True
        self.router.set_draining(replica, replica.drained)
        if finalize_now or replica.num_in_flight == 0:
            self.finalize_removal(replica)

    def finalize_removal(self, replica: Replica) -> None:
        if self.replicas.get(replica.url) is not replica:
            return
        del self.replicas[replica.url]
        pool = self.pools[replica.pool]
        pool.replicas.pop(replica.url, None)
        self.router.remove_replica(replica)
        task = self._monitors.pop(replica.url, None)
        if task is not None:
            task.cancel()
        for gauge in (
            self.metrics.replica_healthy,
            self.metrics.in_flight,
            self.metrics.scrape_age,
        ):
            with contextlib.suppress(KeyError):  # never published
                gauge.remove(replica.pool, replica.name)
        log.info("replica removed", extra={"event": "replica_removed", "replica": replica.name})
        self._drop_if_unused(pool)

    def _drop_if_unused(self, pool: Pool) -> None:
        """Forget a pool that lost its last replica and is no longer configured."""
        if not pool.replicas and all(p.model != pool.model for p in self.config.pools):
            del self.pools[pool.model]
            self.router.remove_pool(pool.model)

    async def _watch_config(self) -> None:
        """Reload the file once new content has held still for one poll.

        A file caught mid-write (truncated by ``>`` or an editor, not yet refilled) must
        not be applied: an empty file is a valid config with no pools and no admin token.
        """
        assert self.config_path is not None
        settling: bytes | None = None
        while True:
            await asyncio.sleep(_RELOAD_POLL_S)
            digest = _digest(self.config_path)
            if digest == self._config_digest or digest != settling:
                settling = None if digest == self._config_digest else digest
                continue
            self._config_digest = digest
            settling = None
            try:
                config = parse_config(read_text(self.config_path), str(self.config_path))
                self.router.check_config(config)
            except IsocostError as exc:
                log.error("config rejected", extra={"event": "reload_failed", "error": str(exc)})
                continue
            self.apply_config(config)
            log.info("config reloaded", extra={"event": "reloaded"})

    async def _monitor(self, replica: Replica) -> None:
        """Scrape ``/metrics`` and probe ``/health`` until the replica is removed."""
        health = self.config.health
        timeout = aiohttp.ClientTimeout(total=health.timeout_ms / 1000)
        next_probe = 0.0
        while True:
            now = time.monotonic()
            if now >= next_probe:
                next_probe = now + health.interval_ms / 1000
                await self._probe(replica, timeout)
            await self._scrape(replica, timeout)
            self.router.sync_health(replica, time.monotonic())
            self.router.wake_all()
            self._publish(replica)
            await asyncio.sleep(self.config.scrape_interval_ms / 1000)

    async def _probe(self, replica: Replica, timeout: aiohttp.ClientTimeout) -> None:
        """``GET /health``, or a one-token completion when live requests opened the breaker."""
        breaker = replica.breaker
        started_at = time.monotonic()
        state = breaker.state(started_at)
        if state is BreakerState.OPEN:
            return  # cooling down: nothing a probe could change
        live = breaker.needs_live_probe and state is BreakerState.HALF_OPEN
        try:
            if live:
                body = msgspec.json.encode(
                    {"model": replica.pool, "prompt": "ping", "max_tokens": 1}
                )
                request = self.session.post(
                    replica.url + "/v1/completions",
                    data=body,
                    headers={"Content-Type": "application/json", **replica.upstream_headers},
                    timeout=timeout,
                )
            else:
                request = self.session.get(replica.url + "/health", timeout=timeout)
            async with request as resp:
                await resp.read()
                ok = resp.status == 200
                reason = f"probe status {resp.status}"
        except aiohttp.ClientConnectorError:
            breaker.record_failure(time.monotonic(), "probe refused", hard=True, probe=True)
            return
        except (TimeoutError, aiohttp.ClientError) as exc:
            ok, reason = False, f"probe {type(exc).__name__}"
        if ok:
            breaker.record_success(time.monotonic(), probe_started_at=started_at)
        else:
            breaker.record_failure(time.monotonic(), reason, probe=True)

    async def _scrape(self, replica: Replica, timeout: aiohttp.ClientTimeout) -> None:
        try:
            async with self.session.get(replica.url + "/metrics", timeout=timeout) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise ScrapeError(f"/metrics status {resp.status}")
            scraped = parse_engine_metrics(text)
        except aiohttp.ClientConnectorError:
            replica.scrape_error = "refused"
            replica.breaker.record_failure(
                time.monotonic(), "/metrics refused", hard=True, probe=True
            )
            return
        except (TimeoutError, aiohttp.ClientError, ScrapeError, UnicodeDecodeError) as exc:
            replica.scrape_error = str(exc) or type(exc).__name__
            return
        now = time.monotonic()
        replica.last_scrape = scraped
        replica.scraped_at = now
        replica.scrape_error = None
        self.router.apply_scrape(replica, scraped, now)

    def _publish(self, replica: Replica) -> None:
        if self.replicas.get(replica.url) is not replica:
            return
        now = time.monotonic()
        labels = (replica.pool, replica.name)
        self.metrics.replica_healthy.labels(*labels).set(1 if replica.routable(now) else 0)
        self.metrics.in_flight.labels(*labels).set(replica.num_in_flight)
        age = replica.scrape_age_s(now)
        if age is not None:
            self.metrics.scrape_age.labels(*labels).set(age)
        if replica.name in self.router.replicas:
            state = self.router.replicas.get(replica.name)
            self.metrics.ttft_factor.labels(*labels).set(state.ttft_factor)
            self.metrics.itl_factor.labels(*labels).set(state.itl_factor)
            self.metrics.prefill_duty.labels(*labels).set(state.prefill_duty(now))

    # -- requests -----------------------------------------------------------------------

    def reject(self, reason: str) -> None:
        self.rejections[reason] += 1
        self.metrics.rejections.labels(reason).inc()

    def authenticate(self, http: web.Request) -> ApiKey | None:
        """The caller's API key; None when keys are off; 401 when missing or wrong."""
        if not self.auth.enabled:
            return None
        token = bearer_token(http.headers.get("Authorization"))
        key = self.auth.key_for(token)
        if key is None:
            self.reject("unauthorized")
            message = "missing API key" if token is None else "invalid API key"
            raise ApiError(401, message, code="invalid_api_key")
        return key

    async def prepare(self, http: web.Request, *, chat: bool) -> tuple[bytes, GatewayRequest]:
        """Auth, limits and the routing view; ApiError for anything refused here."""
        arrived_at = time.monotonic()
        key = self.authenticate(http)
        if key is not None and key.requests is not None:
            wait_s = key.requests.take(1, arrived_at)
            if wait_s:
                self.reject("key_requests_per_minute")
                raise ApiError(
                    429,
                    f"requests per minute exceeded for key {key.name}",
                    code="rate_limit_exceeded",
                    retry_after_s=wait_s,
                )
        limits = self.config.limits
        length = http.content_length
        if length is not None and length > limits.max_body_bytes:
            self.reject("body_too_large")
            raise _too_large(limits.max_body_bytes)
        try:
            async with asyncio.timeout(limits.body_timeout_ms / 1000):
                body = await _read_body(http, limits.max_body_bytes)
        except TimeoutError:
            self.reject("body_timeout")
            raise ApiError(
                408, "the request body arrived too slowly", code="body_timeout"
            ) from None
        except aiohttp.ClientError:
            raise ApiError(400, "request body could not be read", code="bad_body") from None
        if len(body) > limits.max_body_bytes:
            self.reject("body_too_large")
            raise _too_large(limits.max_body_bytes)
        try:
            view = routing_view(body, chat=chat, block_tokens=self.router.block_tokens)
        except RequestError as exc:
            self.reject("invalid_body")
            raise ApiError(400, exc.message, code="invalid_request", param=exc.param) from None
        pool = self.pools.get(view.model)
        if pool is None:
            self.reject("unknown_model")
            raise ApiError(
                404,
                f"model {view.model!r} is not served here; see GET /v1/models",
                code="model_not_found",
                param="model",
            )
        if view.prompt_tokens > limits.max_prompt_tokens:
            self.reject("prompt_too_long")
            raise ApiError(
                400,
                f"prompt of ~{view.prompt_tokens} tokens exceeds the limit of "
                f"{limits.max_prompt_tokens}",
                code="context_length_exceeded",
                param="messages" if chat else "prompt",
            )
        if view.max_tokens is not None and view.max_tokens > limits.max_tokens:
            self.reject("max_tokens_too_large")
            raise ApiError(
                400,
                f"max_tokens {view.max_tokens} exceeds the limit of {limits.max_tokens}",
                code="max_tokens_exceeded",
                param="max_tokens",
            )
        if key is not None and key.tokens is not None:
            wait_s = key.tokens.take(view.prompt_tokens + (view.max_tokens or 0), arrived_at)
            if wait_s:
                self.reject("key_tokens_per_minute")
                raise ApiError(
                    429,
                    f"tokens per minute exceeded for key {key.name}",
                    code="rate_limit_exceeded",
                    retry_after_s=wait_s,
                )
        request = GatewayRequest.from_http(
            http,
            view,
            pool,
            arrived_at=arrived_at,
            key_name=key.name if key else None,
        )
        return body, request

    def log_outcome(self, request: GatewayRequest, outcome: Outcome) -> None:
        replica = outcome.replica
        name = replica.name if replica else _NO_ROUTE
        self.metrics.requests.labels(str(outcome.status), request.pool.model, name).inc()
        e2e_s = time.monotonic() - request.arrived_at
        if replica is not None and outcome.status < 400:
            self.metrics.e2e.labels(name).observe(e2e_s)
        log.info(
            "request",
            extra={
                "event": "request",
                "request_id": request.request_id,
                "pool": request.pool.model,
                "replica": name,
                "status": outcome.status,
                "stream": request.view.stream,
                "prompt_tokens": request.view.prompt_tokens,
                "output_tokens": outcome.output_tokens,
                "retries": outcome.retries,
                "ttft_ms": None if outcome.ttft_s is None else round(outcome.ttft_s * 1000, 1),
                "e2e_ms": round(e2e_s * 1000, 1),
                "key": request.key_name,
            },
        )

    async def handle_completion(self, http: web.Request, *, chat: bool) -> web.StreamResponse:
        body, request = await self.prepare(http, chat=chat)
        assert self._forwarder is not None
        try:
            response, outcome = await self._forwarder.forward(http, body, request)
        except ApiError as exc:
            self.log_outcome(request, Outcome(exc.status, None))
            raise
        self.log_outcome(request, outcome)
        return response


GATEWAY = web.AppKey("gateway", Gateway)


async def _read_body(http: web.Request, limit: int) -> bytes:
    """The whole body, or its first ``limit + 1`` bytes when it is longer."""
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = await http.content.read(limit + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _forward_settings(limits: LimitsConfig) -> ForwardSettings:
    return ForwardSettings(
        connect_timeout_s=limits.connect_timeout_ms / 1000,
        idle_timeout_s=limits.idle_timeout_ms / 1000,
        total_timeout_s=limits.total_timeout_ms / 1000,
        max_retries=limits.max_retries,
        retry_backoff_s=limits.retry_backoff_ms / 1000,
    )


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"request body exceeds {limit} bytes", code="request_too_large", param=None
    )


def _digest(path: Path) -> bytes | None:
    try:
        return hashlib.sha256(path.read_bytes()).digest()
    except OSError:
        return None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place exceptions become HTTP answers (OpenAI-style JSON)."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(ApiError.from_http(exc))


async def _chat(request: web.Request) -> web.StreamResponse:
    return await request.app[GATEWAY].handle_completion(request, chat=True)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await request.app[GATEWAY].handle_completion(request, chat=False)


async def _route(request: web.Request) -> web.StreamResponse:
    """``POST /v1/route``: the decision for a chat or completion body, without forwarding."""
    gateway = request.app[GATEWAY]
    chat = request.query.get("kind", "chat") != "completion"
    _, prepared = await gateway.prepare(request, chat=chat)
    return web.Response(
        body=msgspec.json.encode(gateway.router.decide_only(prepared)),
        content_type="application/json",
    )


async def _models(request: web.Request) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    gateway.authenticate(request)
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
    return web.Response(
        body=msgspec.json.encode({"object": "list", "data": data}),
        content_type="application/json",
    )


async def _health(request: web.Request) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    now = time.monotonic()
    routable = sum(r.routable(now) for r in gateway.replicas.values())
    return web.Response(
        body=msgspec.json.encode(
            {"status": "ok", "replicas": len(gateway.replicas), "routable_replicas": routable}
        ),
        content_type="application/json",
    )


async def _metrics(request: web.Request) -> web.StreamResponse:
    registry = request.app[GATEWAY].metrics.registry
    return web.Response(
        body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


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
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/route", _route)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    add_admin_routes(app, gateway)
    add_dashboard_routes(app)
    return app
