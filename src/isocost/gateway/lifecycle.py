"""The gateway process: its state, its replicas' lifecycle and config reloads.

One ``Gateway`` owns the pools and upstreams, the client session to them, the router (the
brain's adapter), the intake (auth and limits), metrics, the forwarder and the background
tasks: the replica monitor (``isocost.gateway.monitor``) and, with ``--config``, a watcher
that reloads the file when its content changes. A reload is all or nothing: planned
whole (``_plan``: every policy, replica spec and name clash) before the first change, and
refused, with the running config kept, when the file is bad or would switch the gateway
off (no pool or replica left, no admin token, API-key auth gone). Requests flow: auth ->
body limits -> routing view -> pool -> key budget (``intake``) -> router (admission, queue,
decision) -> forwarder (attempts, retries, relay); the HTTP routes are in
``isocost.gateway.app``.

Discovery (``isocost.runtime.discovery``) reports here: each provider's membership is merged
into the file's config (with the replicas the admin API added) and applied through the same
plan as a reload, so a registration that goes drains, then leaves, like a replica the file
no longer lists. With ``state_bus`` the router shares its in-flight with the other
gateways on the bus (``isocost.runtime.bus``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec

from isocost.core.catalog import Catalog, gpus_catalog_yaml
from isocost.core.errors import ConfigError, IsocostError
from isocost.core.links import link
from isocost.files import read_text, read_tokenizer
from isocost.gateway.auth import Authenticator
from isocost.gateway.intake import Intake, Rejection
from isocost.gateway.metrics import GatewayMetrics
from isocost.gateway.monitor import Monitor
from isocost.gateway.proxy import Forwarder, ForwardSettings
from isocost.gateway.recording import Recording, RecordingSettings
from isocost.gateway.routing import Router
from isocost.gateway.shadow import Shadow
from isocost.gateway.supervise import supervise
from isocost.gateway.tracing import Tracing
from isocost.gateway.upstreams import Pool, Upstream
from isocost.gateway.workers import WorkerGroup
from isocost.runtime.config import (
    AuthConfig,
    DiscoveryConfig,
    GatewayConfig,
    LimitsConfig,
    ReplicaConfig,
    StateBusConfig,
    TlsConfig,
    check_references,
    check_replica,
    normalize_replica_url,
    parse_config,
    replica_name,
)
from isocost.runtime.discovery import DiscoveryProvider, Malformed, Registration
from isocost.runtime.discovery.etcd import EtcdDiscovery
from isocost.runtime.discovery.membership import Membership, with_replicas
from isocost.runtime.recording import FleetFile, FleetPool, FleetReplica
from isocost.runtime.tls import client_ssl
from isocost.scheduling.contract import ReplicaSpec
from isocost.scheduling.disagg import DisaggMode
from isocost.scheduling.framework import Policy

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["Gateway"]

log = logging.getLogger("isocost.gateway")

_RELOAD_POLL_S = 0.5
_DISCOVERY_SETTLE_S = 0.02  # changes arriving this close together are applied as one
_ADMIN_SOURCE = "POST /admin/replicas"
# A plan looks up every listed replica by its normalized URL, and discovery makes one plan
# per change: parsing a thousand URLs each time would make a change cost the whole fleet.
_normalized_url = functools.lru_cache(maxsize=1 << 16)(normalize_replica_url)


class Gateway:
    """Everything one ``isocost serve`` process holds."""

    def __init__(
        self,
        config: GatewayConfig,
        catalog: Catalog,
        config_path: Path | None = None,
        recording: RecordingSettings | None = None,
    ) -> None:
        self.config = config  # the file's (or --replica's), plus what discovery found
        self.file_config = config
        self.catalog = catalog
        self.config_path = config_path
        self._config_digest = _digest(config_path) if config_path else None
        self.metrics = GatewayMetrics()
        self.pools: dict[str, Pool] = {}
        self.replicas: dict[str, Upstream] = {}
        self.rejections: Counter[str] = Counter()
        self.view_divergence: dict[str, float] = {}  # by replica, from the state bus
        self.workers: WorkerGroup | None = None  # one of ``serve --workers``: its siblings
        # (monotonic time received, status): what ``isocost autoscale`` last posted
        self.autoscaler: tuple[float, dict[str, Any]] | None = None
        # instance -> (monotonic time of its last status, its interval): who posts still
        self.autoscaler_instances: dict[str, tuple[float, float]] = {}
        self.router = Router(
            catalog,
            self.metrics,
            self.finalize_removal,
            self.reject,
            queue_size=config.limits.max_queue,
            queue_timeout_s=config.limits.queue_timeout_ms / 1000,
        )
        self.intake = Intake(config, self.pools, self.router.block_tokens, time.monotonic())
        self.metrics.key_budgets.rows = lambda: self.intake.budget_levels(time.monotonic())
        self.metrics.queue_by_key.rows = self._queued_by_key
        self.metrics.key_in_flight.rows = self.intake.keys_in_flight
        self.started_at = time.monotonic()
        self.draining = False  # shutting down: readiness fails, in-flight requests finish
        self._watcher: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._forwarder: Forwarder | None = None
        self._monitor: Monitor | None = None
        self.membership = Membership(catalog, config.discovery.max_replicas)
        self._admin_added: dict[str, tuple[str, ReplicaConfig]] = {}  # by URL, kept on apply
        self._member_draining: dict[str, bool] = {}  # by URL, as last applied
        self._discovery: list[asyncio.Task[None]] = []
        self._providers: list[str] = []
        self._running_discovery = config.discovery  # read at start only
        self._running_state_bus = config.state_bus  # read at start only
        self._running_upstream_tls = config.upstream_tls  # read at start only
        self.tracing = Tracing(config.tracing)  # read at start only
        source = str(config_path or "--replica")
        self._upstream_ssl = client_ssl(config.upstream_tls, source, "upstream_tls.{}".format)
        etcd = config.discovery.etcd
        etcd_tls = etcd.tls if etcd else TlsConfig()
        self._etcd_ssl = client_ssl(etcd_tls, source, "discovery.etcd.tls.{}".format)
        self._discovery_pending: asyncio.TimerHandle | None = None
        self._bus_tasks: list[asyncio.Task[None]] = []
        self.recording = Recording(
            recording or RecordingSettings(), self.fleet, self.router.block_tokens
        )
        self.metrics.track_recording(lambda: float(self.recording.active), self.recording.total)
        self.shadow = Shadow(self.router, self.metrics, self.fleet, self.router.block_tokens)

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=30, ssl=self._upstream_ssl
        )
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
        )
        self._forwarder = Forwarder(
            self._session, self.router, _forward_settings(self.config.limits)
        )
        self._forwarder.key_headers = self.intake.rate_limit_headers
        self._forwarder.tracing = self.tracing
        self._monitor = Monitor(self._session, self.router, self.metrics, self.config)
        self.apply_config(self.config)
        self._start_discovery(self.config.discovery)
        if self.config.state_bus is not None:
            self._start_state_bus(self.config.state_bus)
        if self.config_path is not None:
            self._watcher = supervise(
                "config_watcher", self._watch_config, self.metrics.task_failures
            )
        if self.recording.settings.directory is not None:
            try:
                await self.recording.start()
            except ValueError as exc:  # checked by the CLI; gone since: serve, unrecorded
                log.error(str(exc), extra={"event": "recording_failed"})

    async def stop(self) -> None:
        await self.recording.stop()
        await self.shadow.stop()
        if self._discovery_pending is not None:
            self._discovery_pending.cancel()
        tasks = [*self._discovery, *self._bus_tasks, *([self._watcher] if self._watcher else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.router.bus is not None:
            await self.router.bus.close()
        if self._monitor is not None:
            await self._monitor.stop()
        if self._session is not None:
            await self._session.close()
        await asyncio.to_thread(self.tracing.shutdown)  # flushes: bounded by its timeout

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

    def _queued_by_key(self) -> Iterator[tuple[str, str, int]]:
        """(pool, key, requests waiting) for ``isocost_queue_depth_by_key``: configured keys
        only (a header's flows are unbounded labels)."""
        keys = {key.name for key in self.intake.auth.keys}
        for model in self.pools:
            for flow, waiting in self.router.queue_flows(model).items():
                if flow in keys:
                    yield model, flow, waiting

    def refused(self, rejection: Rejection) -> None:
        """Count a request the intake refused: its reason, and its key's answer."""
        self.reject(rejection.reason)
        self.account_key(rejection.key, rejection.status)

    def account_key(
        self, key: str | None, status: int, *, prompt_tokens: int = 0, output_tokens: int = 0
    ) -> None:
        """Count one answer, and the tokens it took, to API key ``key`` (None: no keys)."""
        if key is None:
            return
        metrics = self.metrics
        metrics.api_key_requests.labels(key, str(status)).inc()
        if prompt_tokens:
            metrics.api_key_tokens.labels(key, "prompt").inc(prompt_tokens)
        if output_tokens:
            metrics.api_key_tokens.labels(key, "completion").inc(output_tokens)

    def fleet(self) -> FleetFile:
        """The fleet as a recording describes it: each pool's policy and replicas, with
        what calibration learned of them (no URLs, no keys), and the GPUs they name that
        only this gateway's catalog describes."""
        pools = []
        for pool in self.pools.values():
            replicas = []
            for upstream in pool.replicas.values():
                config = upstream.config
                known = upstream.name in self.router.replicas
                state = self.router.replicas.get(upstream.name) if known else None
                replicas.append(
                    FleetReplica(
                        name=upstream.name,
                        gpu=config.gpu,
                        cost_model=config.cost_model or pool.model,
                        tp=config.tp,
                        weight=config.weight,
                        max_queue=config.max_queue,
                        usd_per_hour=state.spec.price_usd_per_hour if state else None,
                        groups=config.groups,
                        ttft_factor=round(state.ttft_factor, 4) if state else 1.0,
                        itl_factor=round(state.itl_factor, 4) if state else 1.0,
                    )
                )
            pools.append(FleetPool(pool.model, pool.policy, replicas))
        shipped = Catalog.builtin().gpus
        ids = sorted({r.gpu.lower() for p in pools for r in p.replicas})
        own = [spec for spec in map(self.catalog.gpu, ids) if spec != shipped.get(spec.id)]
        comment = ["GPUs this gateway's catalog describes, not isocost's built-in one"]
        limits = self.config.limits
        return FleetFile(
            pools=pools,
            scrape_interval_ms=self.config.scrape_interval_ms,
            queue_size=limits.max_queue,
            queue_timeout_ms=limits.queue_timeout_ms,
            max_retries=limits.max_retries,
            catalog=gpus_catalog_yaml(own, comment) if own else None,
        )

    # -- replicas and config ------------------------------------------------------------

    def apply_config(self, config: GatewayConfig) -> None:
        """Make the live gateway match ``config``, all or nothing: everything that can fail
        (policies, cost models, name clashes, the auth it turns on) is checked here or
        built by ``_plan`` before the first change; removed replicas drain, then leave."""
        check_references(config, self.catalog)
        self._commit(self._plan(config))

    def _plan(self, config: GatewayConfig) -> _Plan:
        """What applying ``config`` would change, touching nothing; IsocostError when any
        part of it cannot be applied. Its references (``check_references``) are the
        caller's to have checked."""
        now = time.monotonic()
        Authenticator(config.auth, now)  # the intake builds the same from it in _commit
        scheduling_changed = config.scheduling != self.router.scheduling
        plan = _Plan(config)
        wanted: dict[str, tuple[str, ReplicaConfig]] = {}
        for pool_config in config.pools:
            if pool_config.tokenizer is not None:
                plan.tokenizers[pool_config.model] = read_tokenizer(pool_config.tokenizer)
            name = pool_config.policy or config.policy
            pool = self.pools.get(pool_config.model)
            if pool is None or scheduling_changed or pool.policy != name:
                plan.policies[pool_config.model] = (
                    name,
                    self.router.build(name, config.scheduling),
                )
            shadowed = pool_config.shadow.policies if pool_config.shadow else []
            built = self.router.candidates.get(pool_config.model, {})
            if scheduling_changed or list(built) != shadowed:  # kept ones keep their state
                plan.candidates[pool_config.model] = {
                    c: built[c]
                    if c in built and not scheduling_changed
                    else self.router.build(c, config.scheduling)
                    for c in shadowed
                }
            for replica_config in pool_config.replicas:
                url = _normalized_url(replica_config.url)
                wanted[url] = (pool_config.model, replica_config)
        configured = {pool.model for pool in config.pools}
        for model, pool in self.pools.items():  # unlisted, but replicas still drain there
            if model not in configured and scheduling_changed:
                plan.policies[model] = self._policy_for_draining(pool, config)
        held: dict[str, Upstream] = {}  # name -> an unlisted replica still draining
        for url, replica in self.replicas.items():
            if url not in wanted:
                plan.leaving.append(replica)
                held[replica.name] = replica
                continue
            model, replica_config = wanted[url]
            if model != replica.pool:  # moved to another pool: a new replica there
                plan.evicted.append(replica)
            elif replica_config == replica.config:
                plan.kept.append(replica)
            else:
                plan.edited.append((replica, replica_config, None))
        for i, (replica, replica_config, _) in enumerate(plan.edited):
            if _needs_new_spec(replica.config, replica_config):
                name = replica_name(replica_config)
                spec = self.router.replica_spec(replica.pool, name, replica_config)
                plan.edited[i] = (replica, replica_config, spec)
        for url, (model, replica_config) in wanted.items():
            current = self.replicas.get(url)
            if current is None or current in plan.evicted:
                upstream = Upstream(replica_config, model, config.health)
                spec = self.router.replica_spec(model, upstream.name, replica_config)
                plan.added.append((upstream, spec))
        names = [replica_name(c) for _, c, _ in plan.edited] + [u.name for u, _ in plan.added]
        for name in names:  # listed names are unique (parse_config); drains give theirs up
            holder = held.get(name)
            if holder is not None and holder not in plan.evicted:
                plan.leaving.remove(holder)
                plan.evicted.append(holder)
        return plan

    def _policy_for_draining(self, pool: Pool, config: GatewayConfig) -> tuple[str, Policy]:
        """The policy of a pool the file no longer lists, under new scheduling profiles:
        its own when they still define it, else the file's default."""
        try:
            return pool.policy, self.router.build(pool.policy, config.scheduling)
        except IsocostError:
            return config.policy, self.router.build(config.policy, config.scheduling)

    def _commit(self, plan: _Plan) -> None:
        """Apply ``plan``; nothing here raises (``_plan`` built or checked it all)."""
        config, now = plan.config, time.monotonic()
        health_changed = config.health != self.config.health
        self.config = config
        self.router.replicas.set_prefill_fit(config.calibration.prefill_fit)
        for model in plan.policies:
            if model not in self.pools:
                self.pools[model] = Pool(model, plan.policies[model][0])
        self.router.install_policies(
            config.scheduling, {model: policy for model, (_, policy) in plan.policies.items()}
        )
        for model, (name, _) in plan.policies.items():
            self.pools[model].policy = name
        self.router.candidates.update(plan.candidates)
        shadowed = {pool.model for pool in config.pools if pool.shadow is not None}
        for model in [m for m in self.router.candidates if m not in shadowed]:
            del self.router.candidates[model]
        self.shadow.configure(config)
        for pool_config in config.pools:
            pool = self.pools[pool_config.model]
            pool.resume = pool_config.resume
            pool.disaggregation = DisaggMode(pool_config.disaggregation)
            pool.kv_link = link(pool_config.kv_link)
            pool.tokenizer = plan.tokenizers.get(pool_config.model)
            pool.slo = None if pool_config.slo is None else pool_config.slo.targets()
        self.router.queue_size = config.limits.max_queue
        self.router.queue_timeout_s = config.limits.queue_timeout_ms / 1000
        if self._forwarder is not None:
            self._forwarder.settings = _forward_settings(config.limits)
        self.monitor.configure(config)
        for replica in plan.evicted:  # frees its URL and name; its requests finish untracked
            replica.removing = True
            self.finalize_removal(replica)
        for replica in plan.leaving:
            self.remove_replica(replica.url)
        respecced = [(r, c, spec) for r, c, spec in plan.edited if spec is not None]
        for replica, _, _ in respecced:  # all old names go before any new one comes
            self.monitor.unwatch(replica)
            self.router.remove_replica(replica)
        for replica, replica_config, _ in plan.edited:
            replica.reconfigure(replica_config)
        for replica, _, spec in respecced:
            assert spec is not None
            self.router.add_replica(self.pools[replica.pool], replica, spec)
            self.router.set_draining(replica, replica.drained)
            self.router.sync_health(replica, now)
            self.monitor.watch(replica)
        for replica in [r for r, _, _ in plan.edited] + plan.kept:
            if replica.removing:  # listed again before its drain ended: keep it
                replica.removing = False
                self.router.set_draining(replica, replica.drained)
        for upstream, spec in plan.added:
            self._add(upstream, spec)
        if health_changed:  # new thresholds for every breaker, new periods for every probe
            for replica in list(self.replicas.values()):
                replica.configure_health(config.health)
                self.monitor.unwatch(replica)
                self.monitor.watch(replica)
        for pool in list(self.pools.values()):
            pool.roles_changed()  # edited replicas may have changed role or name
            self._drop_if_unused(pool)
        self.intake.configure(config, now)

    def add_replica(self, model: str, replica_config: ReplicaConfig) -> Upstream:
        """Add one replica at run time (the admin API): the config file's checks of a
        replica entry, not this gateway's own address, then unique URL and name; a
        ConfigError names the field."""
        check_replica(replica_config, model, self.catalog, source=_ADMIN_SOURCE, key="replica")
        upstream = Upstream(replica_config, model, self.config.health)
        try:
            self.intake.listen.check(upstream.url)
        except ValueError as exc:
            raise ConfigError(_ADMIN_SOURCE, str(exc), key="replica.url") from None
        if upstream.url in self.replicas:
            raise ConfigError(
                _ADMIN_SOURCE, f"replica {upstream.url} already exists", key="replica.url"
            )
        if upstream.name in self.router.replicas:
            raise ConfigError(
                _ADMIN_SOURCE,
                f"a replica named {upstream.name!r} already exists",
                key="replica.name",
            )
        if model not in self.pools:
            self.router.install_policies(
                self.router.scheduling, {model: self.router.build(self.config.policy)}
            )
            self.pools[model] = Pool(model, self.config.policy)
        self._add(upstream, self.router.replica_spec(model, upstream.name, replica_config))
        self._admin_added[upstream.url] = (model, replica_config)
        return upstream

    def _add(self, replica: Upstream, spec: ReplicaSpec) -> None:
        pool = self.pools[replica.pool]
        self.router.add_replica(pool, replica, spec)
        pool.replicas[replica.url] = replica
        pool.roles_changed()
        self.replicas[replica.url] = replica
        self.monitor.watch(replica)
        log.info("replica added", extra={"event": "replica_added", "replica": replica.name})

    def remove_replica(self, url: str, *, finalize_now: bool = False) -> None:
        """Stop new work to ``url``; it leaves once its in-flight requests end."""
        self._admin_added.pop(url, None)
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
        pool.roles_changed()
        self.router.remove_replica(replica)
        self.monitor.unwatch(replica)
        log.info("replica removed", extra={"event": "replica_removed", "replica": replica.name})
        self._drop_if_unused(pool)

    def _drop_if_unused(self, pool: Pool) -> None:
        """Forget a pool that lost its last replica and is no longer configured."""
        if not pool.replicas and all(p.model != pool.model for p in self.config.pools):
            del self.pools[pool.model]
            self.router.remove_pool(pool.model)

    # -- discovery (isocost.runtime.discovery) -----------------------------------------

    def _start_discovery(self, discovery: DiscoveryConfig) -> None:
        """One supervised task per configured provider; each reports here (a
        ``DiscoverySink``)."""
        providers: list[DiscoveryProvider] = []
        if discovery.etcd is not None:
            providers.append(EtcdDiscovery(discovery.etcd, self, self._etcd_ssl))
        if discovery.kubernetes is not None:  # its client takes half a second to import
            from isocost.runtime.discovery.kubernetes import KubernetesDiscovery

            providers.append(KubernetesDiscovery(discovery.kubernetes, self))
        for provider in providers:
            self._providers.append(provider.name)
            self.metrics.discovery_up.labels(provider.name).set(0)
            self._discovery.append(
                supervise(
                    f"discovery {provider.name}",
                    provider.run,
                    self.metrics.task_failures,
                    kind="discovery",
                )
            )

    # -- the state bus (isocost.runtime.bus) -------------------------------------------

    def _start_state_bus(self, config: StateBusConfig) -> None:
        """Share in-flight with the other gateways on the bus: the router publishes and
        takes the peers' requests; the bus's loops run supervised. Imported here: its Redis
        client takes longer to import than the rest of the gateway's start."""
        from isocost.runtime.bus import StateBus

        lag = self.metrics.state_bus_lag()
        bus = StateBus(
            config,
            self.router,
            on_divergence=self._show_divergence,
            on_lag=lag.observe,
            on_spend=self._peer_spent,
            holding=lambda: self.intake.in_flight,
        )
        self.router.bus = bus
        self.intake.peers = bus
        self.metrics.track_state_bus(lambda: float(bool(bus.up)), lambda: len(bus.views.peers))
        for name, loop in bus.loops():
            self._bus_tasks.append(supervise(name, loop, self.metrics.task_failures))

    def _peer_spent(self, key_name: str, requests: int, tokens: int) -> bool:
        """A peer gateway charged ``key_name``: so does this one (one budget across them)."""
        return self.intake.charge_peer(key_name, requests, tokens, time.monotonic())

    def _show_divergence(self, divergence: Mapping[str, float]) -> None:
        self.view_divergence = dict(divergence)
        gauge, replicas = self.metrics.view_divergence, self.router.replicas
        for name, requests in divergence.items():
            gauge.labels(replicas.get(name).spec.model, name).set(requests)

    def replace(self, provider: str, records: Mapping[str, Registration | Malformed]) -> None:
        """A provider's whole membership now; applied after a short settling delay, so a
        burst of registrations is one config change, not hundreds."""
        self.membership.replace(provider, records)
        if self._discovery_pending is None:
            loop = asyncio.get_running_loop()
            self._discovery_pending = loop.call_later(_DISCOVERY_SETTLE_S, self._apply_discovered)

    def set_up(self, provider: str, up: bool) -> None:
        self.metrics.discovery_up.labels(provider).set(1 if up else 0)

    def _apply_discovered(self) -> None:
        """Apply the merged config as a reload would: new members join, edited ones change
        in place, those gone drain and then leave (``remove_replica``, as the admin API).
        Its references are not checked again: the file's were at its load, the admin API's
        replicas' as they were added, and each member's by ``Membership`` once per version,
        so a change costs what changed, not a pass over every replica's cost model."""
        self._discovery_pending = None
        try:
            self._commit(self._plan(self._merged(self.file_config)))
        except IsocostError as exc:  # members are checked one by one: not expected
            log.error(
                "discovered replicas not applied",
                extra={"event": "discovery_failed", "error": str(exc)},
            )
            return
        self._sync_member_draining()

    def _merged(self, file_config: GatewayConfig) -> GatewayConfig:
        """``file_config``, plus the replicas the admin API added (those whose URL or name
        the file now lists are the file's), plus every acceptable member; each refused
        record logged (once per reason) and counted, and registrations past
        ``discovery.max_replicas`` shown (``_show_dropped``)."""
        listed = [r for pool in file_config.pools for r in pool.replicas]
        taken = {normalize_replica_url(r.url) for r in listed} | {replica_name(r) for r in listed}
        admin = [
            (model, replica)
            for url, (model, replica) in self._admin_added.items()
            if url not in taken and replica_name(replica) not in taken
        ]
        base = with_replicas(file_config, admin)
        dropped_before = self.membership.dropped
        config, refused = self.membership.merge(base, self.intake.listen.check)
        for skip in refused:
            log.warning(
                "registration skipped",
                extra={
                    "event": "registration_skipped",
                    "provider": skip.provider,
                    "key": skip.key,
                    "error": skip.reason,
                },
            )
            self.metrics.discovery_rejected.labels(skip.provider).inc()
        counts = Counter(member.provider for member in self.membership.members)
        for name in self._providers:
            self.metrics.discovery_replicas.labels(name).set(counts[name])
            self._show_dropped(name, dropped_before.get(name, 0))
        return config

    def _show_dropped(self, provider: str, before: int) -> None:
        """``provider``'s registrations past ``discovery.max_replicas`` on the gauge, and
        one log line when their number changes: a flood is a warning per step, not one
        per watch event or re-list, and its end is said once."""
        dropped = self.membership.dropped.get(provider, 0)
        self.metrics.discovery_dropped.labels(provider).set(dropped)
        if dropped == before:
            return
        extra = {
            "provider": provider,
            "dropped": dropped,
            "max_replicas": self.membership.max_replicas,
        }
        if dropped:
            log.warning(
                "registrations past discovery.max_replicas ignored",
                extra={"event": "discovery_over_limit", **extra},
            )
        else:
            log.info(
                "registrations within discovery.max_replicas again",
                extra={"event": "discovery_within_limit", **extra},
            )

    def _sync_member_draining(self) -> None:
        """Drain or undrain members whose registered state changed (an admin drain of a
        member stays until its record's state changes)."""
        draining: dict[str, bool] = {}
        for member in self.membership.members:
            replica = self.replicas.get(member.url)
            wanted = member.record.draining
            draining[member.url] = wanted
            if replica is not None and self._member_draining.get(member.url) != wanted:
                self.router.set_draining(replica, wanted)
        self._member_draining = draining

    def reload(self) -> None:
        """Read the config file and apply it, all or nothing. A bad file (unreadable,
        invalid, or one that would switch the gateway off, see ``_refuse_lockout``) is
        logged in one line, counted as rejected, and the running config stays."""
        assert self.config_path is not None
        source = str(self.config_path)
        try:
            file_config = parse_config(read_text(self.config_path), source)
            _refuse_lockout(self.file_config, file_config, source)
            config = self._merged(file_config)
            self.intake.listen.check_config(config, source)
            self.apply_config(config)
            self.file_config = file_config
            self._sync_member_draining()
        except Exception as exc:  # no file may end the watcher
            error = str(exc) if isinstance(exc, IsocostError) else f"{type(exc).__name__}: {exc}"
            log.error(
                "config rejected",
                extra={"event": "reload_failed", "file": source, "error": error},
            )
            self.metrics.config_reloads.labels("rejected").inc()
            return
        self.metrics.config_reloads.labels("ok").inc()
        log.info("config reloaded", extra={"event": "reloaded", "file": source})
        for section, running, read in (
            ("discovery", self._running_discovery, file_config.discovery),
            ("state_bus", self._running_state_bus, file_config.state_bus),
            ("upstream_tls", self._running_upstream_tls, file_config.upstream_tls),
            ("tracing", self.tracing.config, file_config.tracing),
        ):
            if read != running:
                log.warning(
                    f"{section} settings changed: they take effect at the next start",
                    extra={"event": f"{section}_unchanged", "file": source},
                )

    def reload_requested(self) -> None:
        """SIGHUP: reload the config file now, not at the watcher's next poll (as nginx
        does); without one (``--replica``) there is nothing to reload, and the gateway
        goes on."""
        if self.config_path is None:
            log.warning(
                "SIGHUP: no config file to reload (started with --replica); still serving",
                extra={"event": "reload_unavailable"},
            )
            return
        log.info(
            "reload requested (SIGHUP)",
            extra={"event": "reload_requested", "file": str(self.config_path)},
        )
        self._config_digest = _digest(self.config_path)  # the watcher takes it as applied
        self.reload()

    async def _watch_config(self) -> None:
        """Reload the file once new content has held still for one poll.

        A file caught mid-write (truncated by ``>`` or an editor, not yet refilled) must
        not be applied; a deleted file is rejected once, and applied again when restored.
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
            self.reload()


@dataclass(slots=True)
class _Plan:
    """What applying ``config`` changes, with everything that could fail already built."""

    config: GatewayConfig
    policies: dict[str, tuple[str, Policy]] = field(default_factory=dict)  # by pool model
    candidates: dict[str, dict[str, Policy]] = field(default_factory=dict)  # shadow, by pool
    tokenizers: dict[str, Tokenizer] = field(default_factory=dict)  # by pool model
    kept: list[Upstream] = field(default_factory=list)  # listed again as they are
    edited: list[tuple[Upstream, ReplicaConfig, ReplicaSpec | None]] = field(
        default_factory=list
    )  # changed in place; a spec when the router's view of it changes
    leaving: list[Upstream] = field(default_factory=list)  # unlisted: drain, then leave
    evicted: list[Upstream] = field(default_factory=list)  # URL or name taken: leave now
    added: list[tuple[Upstream, ReplicaSpec]] = field(default_factory=list)


def _needs_new_spec(old: ReplicaConfig, new: ReplicaConfig) -> bool:
    """Whether the router must see the edited replica anew (all but its key changed)."""
    return msgspec.structs.replace(old, api_key_env=new.api_key_env) != new


def _refuse_lockout(running: GatewayConfig, new: GatewayConfig, source: str) -> None:
    """A reload may change anything but may not switch the gateway off: remove every
    pool or every replica, the admin token, or API-key auth while they are on. (Start the
    gateway with such a file to mean it.)"""
    if running.pools and not new.pools:
        raise ConfigError(source, "refused: the reload would remove every pool", key="pools")
    listed = sum(len(pool.replicas) for pool in running.pools)
    if listed and not any(pool.replicas for pool in new.pools):
        raise ConfigError(source, "refused: the reload would remove every replica", key="pools")
    auth, new_auth = running.auth, new.auth
    if _has_admin_token(auth) and not _has_admin_token(new_auth):
        raise ConfigError(
            source, "refused: the reload would turn the admin API off", key="auth.admin_token"
        )
    if auth.api_keys and not new_auth.api_keys:
        raise ConfigError(
            source, "refused: the reload would turn API-key auth off", key="auth.api_keys"
        )


def _has_admin_token(auth: AuthConfig) -> bool:
    return bool(auth.admin_token) or auth.admin_token_env is not None


def _forward_settings(limits: LimitsConfig) -> ForwardSettings:
    return ForwardSettings(
        connect_timeout_s=limits.connect_timeout_ms / 1000,
        idle_timeout_s=limits.idle_timeout_ms / 1000,
        total_timeout_s=limits.total_timeout_ms / 1000,
        max_retries=limits.max_retries,
        retry_backoff_s=limits.retry_backoff_ms / 1000,
        max_response_bytes=limits.max_response_bytes,
    )


def _digest(path: Path) -> bytes | None:
    try:
        return hashlib.sha256(path.read_bytes()).digest()
    except OSError:
        return None
