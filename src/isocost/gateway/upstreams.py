"""The gateway's live view of its replicas: health, drain state, scrapes, recent latencies.

An ``Upstream`` (one engine replica as the data plane sees it) is created from its config
entry and lives until it is removed (by a config reload or the admin API); removal first
drains it, and it leaves its pool once its last in-flight request ends, so no request is
dropped. Scheduling state (the shadow of what
runs there) belongs to the brain; this object holds what only the data plane knows.
"""

from __future__ import annotations

import os
import ssl
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp

from isocost.core.links import Link, link
from isocost.core.slo import SloTargets
from isocost.gateway.health import Breaker, BreakerState
from isocost.runtime.config import HealthConfig, ReplicaConfig, normalize_replica_url, replica_name
from isocost.scheduling.contract import EngineMetrics
from isocost.scheduling.disagg import DisaggMode

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["Pool", "Upstream", "connect_failure"]

_RECENT = 64  # latency samples kept per replica for the admin snapshot


class Upstream:
    """One engine endpoint as the data plane sees it."""

    def __init__(self, config: ReplicaConfig, pool: str, health: HealthConfig) -> None:
        self.url = normalize_replica_url(config.url)
        self.name = replica_name(config)
        self.pool = pool
        self.config = config
        self.breaker = Breaker(
            failure_threshold=health.failure_threshold,
            min_success_rate=health.min_success_rate,
            window_size=health.window_size,
            open_s=health.open_ms / 1000,
        )
        self.drained = False
        self.drained_by: str | None = None  # who drained it, as an admin drain named itself
        self.removing = False
        self.num_in_flight = 0
        self.last_scrape: EngineMetrics | None = None
        self.scraped_at: float | None = None
        self.scrape_error: str | None = None
        self.recent_ttft_s: deque[float] = deque(maxlen=_RECENT)
        self.recent_itl_s: deque[float] = deque(maxlen=_RECENT)
        self.upstream_headers = _upstream_headers(config)

    def reconfigure(self, config: ReplicaConfig) -> None:
        """Take an edited config entry in place: in-flight count, breaker and scrapes stay."""
        self.config = config
        self.name = replica_name(config)
        self.upstream_headers = _upstream_headers(config)

    def configure_health(self, health: HealthConfig) -> None:
        """Take reloaded breaker settings (its recent outcomes and state stay)."""
        self.breaker.configure(
            failure_threshold=health.failure_threshold,
            min_success_rate=health.min_success_rate,
            window_size=health.window_size,
            open_s=health.open_ms / 1000,
        )

    def routable(self, now: float) -> bool:
        """May new work be sent here: circuit closed, not drained, not being removed."""
        return not self.drained and not self.removing and self.breaker.allows_traffic(now)

    def health_state(self, now: float) -> str:
        if self.removing:
            return "removing"
        if self.drained:
            return "drained"
        return "healthy" if self.breaker.state(now) is BreakerState.CLOSED else "ejected"

    def scrape_age_s(self, now: float) -> float | None:
        return None if self.scraped_at is None else now - self.scraped_at


def connect_failure(exc: aiohttp.ClientConnectorError) -> str:
    """Why a connection to a replica failed, for ``last_error`` and logs: a TLS failure
    (a certificate the gateway cannot verify, a handshake the replica refused) by its
    own reason, which "refused" would hide from whoever has to fix the certificates."""
    error = exc.os_error
    if isinstance(error, ssl.SSLCertVerificationError):
        return f"TLS: certificate verify failed: {error.verify_message}"
    if isinstance(error, ssl.SSLError):
        return f"TLS: {error.reason or error}"
    return "refused"


def _upstream_headers(config: ReplicaConfig) -> dict[str, str]:
    """The bearer token the replica expects, read from its ``api_key_env``."""
    key = os.environ.get(config.api_key_env) if config.api_key_env else None
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(slots=True)
class Pool:
    """The replicas serving one model name, and the policy that routes among them."""

    model: str
    policy: str
    replicas: dict[str, Upstream] = field(default_factory=dict)  # by normalized URL
    resume: bool = True  # continue broken streams on another replica (``resume: off``)
    tokenizer: Tokenizer | None = None  # the pool's ``tokenizer``: exact prompt token ids
    slo: SloTargets | None = None  # the pool's ``slo``: what each answer is judged by
    verdicts: Counter[str] = field(default_factory=Counter)  # met / missed / failed so far
    disaggregation: DisaggMode = DisaggMode.CONDITIONAL  # P/D split with prefill replicas
    kv_link: Link = field(default_factory=lambda: link("tcp"))  # what hand-offs travel

    # The names of the replicas that only prefill (never given a whole request), and
    # whether any replica has a split role at all (else the pool is never split): not
    # recomputed per request, but on the first read after ``roles_changed`` (a replica
    # added, removed or edited), so a thousand replicas joining or leaving at once cost
    # one pass over the pool, not one per replica.
    _roles: tuple[frozenset[str], bool] | None = field(default=None, init=False, repr=False)

    def roles_changed(self) -> None:
        self._roles = None

    @property
    def prefill_only(self) -> frozenset[str]:
        return self._role_sets()[0]

    @property
    def split_roles(self) -> bool:
        return self._role_sets()[1]

    def _role_sets(self) -> tuple[frozenset[str], bool]:
        if self._roles is None:
            replicas = self.replicas.values()
            self._roles = (
                frozenset(r.name for r in replicas if r.config.role == "prefill"),
                any(r.config.role != "both" for r in replicas),
            )
        return self._roles
