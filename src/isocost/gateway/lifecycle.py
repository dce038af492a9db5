"""The gateway process: its state, its replicas' lifecycle and config reloads.

One ``Gateway`` owns the pools and upstreams, the client session to them, the router (the
brain's adapter), the intake (auth and limits), metrics, the forwarder and the background
tasks: the replica monitor (``isocost.gateway.monitor``) and, with ``--config``, a watcher
that reloads the file when its content changes. Requests flow: auth -> body limits ->
routing view -> pool -> key budget (``intake``) -> router (admission, queue, decision) ->
forwarder (attempts, retries, relay); the HTTP routes are in ``isocost.gateway.app``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from pathlib import Path

import aiohttp

from isocost.core.catalog import Catalog
from isocost.core.errors import IsocostError
from isocost.files import read_text
from isocost.gateway.intake import Intake
from isocost.gateway.metrics import GatewayMetrics
from isocost.gateway.monitor import Monitor
from isocost.gateway.proxy import Forwarder, ForwardSettings
from isocost.gateway.routing import Router
from isocost.gateway.upstreams import Pool, Upstream
from isocost.runtime.config import (
    GatewayConfig,
    LimitsConfig,
    ReplicaConfig,
    normalize_replica_url,
    parse_config,
)

__all__ = ["Gateway"]

log = logging.getLogger("isocost.gateway")

_RELOAD_POLL_S = 0.5


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
        self.pools: dict[str, Pool] = {}
        self.replicas: dict[str, Upstream] = {}
        self.rejections: Counter[str] = Counter()
        self.router = Router(
            catalog,
            self.metrics,
            self.finalize_removal,
            self.reject,
            queue_size=config.limits.max_queue,
            queue_timeout_s=config.limits.queue_timeout_ms / 1000,
        )
        self.intake = Intake(config, self.pools, self.router.block_tokens, time.monotonic())
        self.started_at = time.monotonic()
        self._watcher: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._forwarder: Forwarder | None = None
        self._monitor: Monitor | None = None

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
        )
        self._forwarder = Forwarder(
            self._session, self.router, _forward_settings(self.config.limits)
        )
        self._monitor = Monitor(self._session, self.router, self.metrics, self.config)
        self.apply_config(self.config)
        if self.config_path is not None:
            self._watcher = asyncio.create_task(self._watch_config())

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        if self._monitor is not None:
            await self._monitor.stop()
        if self._session is not None:
            await self._session.close()

    @property
    def forwarder(self) -> Forwarder:
        assert self._forwarder is not None, "Gateway.start() not called"
        return self._forwarder

    @property
    def monitor(self) -> Monitor:
        assert self._monitor is not None, "Gateway.start() not called"
        return self._monitor

    def reject(self, reason: str) -> None:
        """Count one refused request under ``reason``."""
        self.rejections[reason] += 1
        self.metrics.rejections.labels(reason).inc()

    # -- replicas and config ------------------------------------------------------------

    def apply_config(self, config: GatewayConfig) -> None:
        """Make the live pools match ``config``; removed replicas drain, then leave."""
        self.config = config
        self.router.set_scheduling(config.scheduling)
        self.router.queue_size = config.limits.max_queue
        self.router.queue_timeout_s = config.limits.queue_timeout_ms / 1000
        if self._forwarder is not None:
            self._forwarder.settings = _forward_settings(config.limits)
        self.monitor.configure(config)
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
        self.intake.configure(config, time.monotonic())

    def add_replica(self, model: str, replica_config: ReplicaConfig) -> Upstream:
        pool = self.pools.get(model)
        if pool is None:
            pool = self.pools[model] = Pool(model, self.config.policy)
            self.router.set_policy(pool, self.config.policy)
        replica = Upstream(replica_config, model, self.config.health)
        if replica.url in self.replicas:
            raise IsocostError(f"replica {replica.url} already exists")
        self.router.add_replica(pool, replica)
        pool.replicas[replica.url] = replica
        self.replicas[replica.url] = replica
        self.monitor.watch(replica)
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

    def finalize_removal(self, replica: Upstream) -> None:
        if self.replicas.get(replica.url) is not replica:
            return
        del self.replicas[replica.url]
        pool = self.pools[replica.pool]
        pool.replicas.pop(replica.url, None)
        self.router.remove_replica(replica)
        self.monitor.unwatch(replica)
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
                self.intake.listen.check_config(config, str(self.config_path))
            except IsocostError as exc:
                log.error("config rejected", extra={"event": "reload_failed", "error": str(exc)})
                continue
            self.apply_config(config)
            log.info("config reloaded", extra={"event": "reloaded"})


def _forward_settings(limits: LimitsConfig) -> ForwardSettings:
    return ForwardSettings(
        connect_timeout_s=limits.connect_timeout_ms / 1000,
        idle_timeout_s=limits.idle_timeout_ms / 1000,
        total_timeout_s=limits.total_timeout_ms / 1000,
        max_retries=limits.max_retries,
        retry_backoff_s=limits.retry_backoff_ms / 1000,
    )


def _digest(path: Path) -> bytes | None:
    try:
        return hashlib.sha256(path.read_bytes()).digest()
    except OSError:
        return None
