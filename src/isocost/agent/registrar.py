"""The agent's life: wait for the engine, register under a lease, keep it, drain, leave.

``Agent.run`` until ``stop`` is set (SIGTERM):

1. wait until the engine is ready (and, with a warm-up prompt, has answered one
   completion), logging once what it waits for (and again when that changes); check the
   record as every gateway will (``check_registration``: a record they would refuse ends
   the agent with a ConfigError instead of a registration nobody routes to), then write it
   under ``<prefix>/replicas/<name>`` with a fresh lease of ``ttl_s`` (a SIGKILLed agent's
   key goes when the lease expires);
2. every tick: renew the lease when a third of the TTL has passed (a lease etcd no longer
   has, e.g. after a long outage, is granted and the record written anew), probe the
   engine (a refused connection, or ``dead_after`` failed probes in a row: the engine is
   dead, so the lease is revoked at once and the agent waits for it again), and judge its
   success rate (``health.SuccessWindow``: ``draining`` in the record while it is failing);
3. on ``stop``: the record says ``draining`` at once; once the engine has had no running
   or waiting request for two reads in a row (at least ``_DRAIN_GRACE_S`` after the mark,
   so that gateways have seen it), or after ``drain_timeout_s``, the key is deleted and
   the lease revoked.

etcd being unreachable is no reason to stop: the agent logs it once, keeps its engine
registered as it was, and retries each tick. etcd refusing a request (``EtcdRefused``: a
4xx, e.g. a permission) is: the same request would be refused forever, so it ends the
agent; a lease etcd no longer has is granted anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import msgspec

from isocost.agent.engine import EngineDown, engine_facts, engine_load, not_ready, warm_up
from isocost.agent.health import SuccessWindow
from isocost.core.catalog import Catalog
from isocost.core.jsontext import UNDECODABLE
from isocost.runtime.discovery.etcd import replicas_prefix
from isocost.runtime.discovery.records import Registration, check_registration
from isocost.runtime.etcd import EtcdClient, EtcdError, LeaseNotFound
from isocost.runtime.scrape import ScrapeError

__all__ = ["MAX_TTL_S", "Agent", "AgentSettings"]

log = logging.getLogger("isocost.agent")

# The lease is how long a SIGKILLed agent's replica keeps its traffic: an hour is already
# far from a liveness signal (the default is 10 s), and etcd refuses a TTL past 9e9 s.
MAX_TTL_S = 3600

_TICK_S = 0.25
_DRAIN_GRACE_S = 0.5
_ENGINE_ERRORS = (aiohttp.ClientError, TimeoutError, ScrapeError, *UNDECODABLE)


@dataclass(frozen=True, slots=True)
class AgentSettings:
    engine_url: str  # where the agent reaches its engine
    advertise_url: str  # what gateways are told
    name: str
    etcd: list[str]
    etcd_tls: ssl.SSLContext | bool = True  # https:// etcd (runtime.tls.client_ssl)
    gpu: str = "a100-80g"
    tp: int = 1
    groups: list[str] = field(default_factory=list)
    weight: float = 1.0
    usd_per_hour: float | None = None
    cost_model: str | None = None
    ttl_s: int = 10
    prefix: str = "/isocost"
    warmup_prompt: str | None = None
    drain_timeout_s: float = 60.0
    health_window_s: float = 30.0
    min_success_rate: float = 0.5
    dead_after: int = 3

    def record(self, models: list[str], engine: str = "unknown", release: str = "") -> Registration:
        """The record these settings register for an engine serving ``models``."""
        return Registration(
            name=self.name,
            url=self.advertise_url,
            models=models,
            gpu=self.gpu,
            tp=self.tp,
            groups=list(self.groups),
            weight=self.weight,
            usd_per_hour=self.usd_per_hour,
            cost_model=self.cost_model,
            engine=engine,
            release=release,
        )


class Agent:
    def __init__(
        self,
        settings: AgentSettings,
        catalog: Catalog,
        on_registered: Callable[[Registration], None],
    ) -> None:
        self.settings = settings
        self.catalog = catalog  # the gateways' (``--catalog``): what they can price
        self.key = replicas_prefix(settings.prefix) + settings.name
        self.etcd = EtcdClient(settings.etcd, tls=settings.etcd_tls)
        self.on_registered = on_registered
        self.record: Registration | None = None
        self.lease = 0
        self._renewed_at = 0.0
        self._etcd_ok: bool | None = None
        self._unwritten = False  # the record changed while etcd was away

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop`` (then drain and leave), or until the engine's record turns out to
        be one gateways refuse (ConfigError) or etcd refuses a request (EtcdRefused)."""
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.settings.ttl_s / 3))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            try:
                while not stop.is_set():
                    if not await self._wait_ready(session, stop):
                        return
                    try:
                        if not await self._register(session, stop):
                            return
                    except (EngineDown, *_ENGINE_ERRORS):
                        continue  # the engine went away meanwhile: wait for it again
                    if await self._serve(session, stop):
                        await self._drain(session)
                        return
            finally:
                await self.etcd.close()

    async def _wait_ready(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> bool:
        """Until the engine is ready and warmed up; False when stopped first. What it waits
        for is logged once, and again only when that changes."""
        s = self.settings
        logged: str | None = None
        while not stop.is_set():
            try:
                reason = await not_ready(session, s.engine_url)
                if reason is None:
                    if s.warmup_prompt:
                        facts = await engine_facts(session, s.engine_url)
                        await warm_up(session, s.engine_url, facts.models[0], s.warmup_prompt)
                    return True
            except (EngineDown, *_ENGINE_ERRORS) as exc:
                reason = str(exc) or type(exc).__name__  # a timeout's text is empty
            if reason != logged:
                log.warning(
                    "waiting for the engine",
                    extra={"event": "engine_waiting", "engine": s.engine_url, "reason": reason},
                )
                logged = reason
            await _wait(stop, _TICK_S)
        return False

    async def _register(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> bool:
        """Write the record under a new lease, retrying while etcd is away; False when
        stopped first."""
        s = self.settings
        facts = await engine_facts(session, s.engine_url)
        self.record = s.record(facts.models, facts.kind, facts.release)
        check_registration(self.record, self.catalog, source="the engine's record")
        while not await self._write(new_lease=True):
            await _wait(stop, _TICK_S)
            if stop.is_set():
                return False
        log.info(
            "registered",
            extra={
                "event": "registered",
                "key": self.key,
                "engine": facts.kind,
                "release": facts.release,
                "lease_ttl_s": s.ttl_s,
            },
        )
        self.on_registered(self.record)
        return True

    async def _write(self, *, new_lease: bool = False) -> bool:
        """Put the record (under a fresh lease when asked); False when etcd is away, or the
        lease expired meanwhile (the next write takes a new one)."""
        assert self.record is not None
        try:
            if new_lease or not self.lease:
                self.lease = await self.etcd.grant(self.settings.ttl_s)
            await self.etcd.put(self.key, self.record.encode(), self.lease)
        except LeaseNotFound:
            log.warning("lease lost, registering again", extra={"event": "lease_lost"})
            self.lease = 0
            self._unwritten = True
            return False
        except EtcdError as exc:
            self._etcd_state(False, exc)
            self._unwritten = True
            return False
        self._unwritten = False
        self._renewed_at = time.monotonic()
        self._etcd_state(True)
        return True

    async def _renew(self) -> None:
        """Renew the lease if a third of its TTL has passed; re-register a lost one."""
        if self._unwritten:
            await self._write()
            return
        if time.monotonic() - self._renewed_at < self.settings.ttl_s / 3:
            return
        try:
            ttl = await self.etcd.keepalive(self.lease)
        except EtcdError as exc:
            self._etcd_state(False, exc)
            return
        if ttl > 0:
            self._renewed_at = time.monotonic()
            self._etcd_state(True)
            return
        log.warning("lease lost, registering again", extra={"event": "lease_lost"})
        await self._write(new_lease=True)

    async def _serve(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> bool:
        """Keep the registration while the engine lives: True when stopped, False when
        the engine died (its lease is revoked by then)."""
        s = self.settings
        window = SuccessWindow(s.health_window_s, s.min_success_rate)
        failures = 0
        while not stop.is_set():
            await self._renew()
            try:
                load = await engine_load(session, s.engine_url)
                failures = 0
                now = time.monotonic()
                window.observe(now, load.ok, load.failed)
                await self._set_state("draining" if window.failing(now) else "serving")
            except EngineDown:
                failures = s.dead_after
            except _ENGINE_ERRORS:
                failures += 1
            if failures >= s.dead_after:
                await self._engine_died()
                return False
            await _wait(stop, _TICK_S)
        return True

    async def _set_state(self, state: str) -> None:
        assert self.record is not None
        if self.record.state != state:
            self.record = msgspec.structs.replace(self.record, state=state)
            log.warning(
                "state changed", extra={"event": "state_changed", "state": state, "key": self.key}
            )
            await self._write()

    async def _engine_died(self) -> None:
        log.error("engine down, lease revoked", extra={"event": "engine_down", "key": self.key})
        try:
            await self.etcd.revoke(self.lease)
        except EtcdError as exc:
            self._etcd_state(False, exc)  # the lease expires on its own
        self.lease = 0

    async def _drain(self, session: aiohttp.ClientSession) -> None:
        """Mark draining, wait for the engine to be idle (or the timeout), then leave."""
        s = self.settings
        await self._set_state("draining")
        started = time.monotonic()
        idle_reads = 0
        while time.monotonic() - started < s.drain_timeout_s:
            await self._renew()
            try:
                load = await engine_load(session, s.engine_url)
            except EngineDown:
                break
            except _ENGINE_ERRORS:
                load = None
            idle = load is not None and load.running + load.waiting == 0
            idle_reads = idle_reads + 1 if idle else 0
            if idle_reads >= 2 and time.monotonic() - started >= _DRAIN_GRACE_S:
                break
            await asyncio.sleep(_TICK_S)
        else:
            log.warning("drain timed out", extra={"event": "drain_timeout", "key": self.key})
        try:
            await self.etcd.delete(self.key)
            await self.etcd.revoke(self.lease)
        except EtcdError as exc:
            log.warning(
                "not deregistered: etcd unreachable; the key goes when its lease expires",
                extra={
                    "event": "deregister_failed",
                    "key": self.key,
                    "lease_ttl_s": s.ttl_s,
                    "error": str(exc),
                },
            )
            return
        log.info("deregistered", extra={"event": "deregistered", "key": self.key})

    def _etcd_state(self, ok: bool, error: BaseException | None = None) -> None:
        """Log etcd's reachability once per change."""
        if ok == self._etcd_ok:
            return
        self._etcd_ok = ok
        if ok:
            log.info("etcd reachable", extra={"event": "etcd_up"})
        else:
            log.warning(
                "etcd unreachable, retrying", extra={"event": "etcd_down", "error": str(error)}
            )


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less when ``stop`` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
