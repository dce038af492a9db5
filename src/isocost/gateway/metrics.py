"""The gateway's own Prometheus metrics, in a registry per gateway instance."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["GatewayMetrics"]

# The *_created series would double the exposition for nothing a dashboard uses.
disable_created_metrics()  # type: ignore[no-untyped-call]

_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64,
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0,
)  # fmt: skip

_BUS_LAG_BUCKETS_S = (
    0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 1.0,
)  # fmt: skip


class GatewayMetrics:
    """Every series ``isocost serve`` exports under ``/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "isocost_requests",
            "Requests answered, by HTTP status, pool and replica ('' when none was chosen).",
            ["status", "pool", "replica"],
            registry=r,
        )
        self.ttft = Histogram(
            "isocost_ttft_seconds",
            "Time from arrival at the gateway to the first streamed token, per replica.",
            ["replica"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.itl = Histogram(
            "isocost_itl_seconds",
            "Time between consecutive streamed chunks, per replica.",
            ["replica"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "isocost_e2e_seconds",
            "Time from arrival to the end of the answer, per replica.",
            ["replica"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.slo_requests = Counter(
            "isocost_slo_requests",
            "Requests judged by their SLO (the pool's slo or their own deadline / TPOT"
            " headers), by verdict: met, missed (answered late) or failed (refused by the"
            " queue, or an error).",
            ["pool", "verdict"],
            registry=r,
        )
        self.decisions = Counter(
            "isocost_decisions", "Scheduling decisions, by policy.", ["policy"], registry=r
        )
        self.shadow_decisions = Counter(
            "isocost_shadow_decisions",
            "Decisions of a pool's candidate policies (shadow: computed, never acted on), by"
            " whether they agree with the running policy's (same outcome and replica).",
            ["pool", "policy", "agrees"],
            registry=r,
        )
        self.shadow_change = Gauge(
            "isocost_shadow_predicted_change_ratio",
            "A candidate policy's predicted change against the running policy, both replayed"
            " in the twin on the recent window: candidate / running - 1 (-0.31: 31% lower),"
            " by metric: ttft_p99 or goodput.",
            ["pool", "policy", "metric"],
            registry=r,
        )
        self.shadow_replays = Counter(
            "isocost_shadow_replays",
            "Twin replays of the recent window, by outcome: ok, failed (the simulator failed"
            " or ran past its time limit) or skipped (too few requests in the window).",
            ["outcome"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "isocost_queue_depth", "Requests waiting in the gateway queue.", ["pool"], registry=r
        )
        self.queue_held = Gauge(
            "isocost_queue_held",
            "Of the requests waiting, those held by SLO admission: they would meet their"
            " deadline, but no replica can take them yet without pushing the streams there"
            " past the TPOT target.",
            ["pool"],
            registry=r,
        )
        self.api_key_requests = Counter(
            "isocost_api_key_requests",
            "Requests by API key and final HTTP status, the intake's refusals included.",
            ["key", "status"],
            registry=r,
        )
        self.api_key_tokens = Counter(
            "isocost_api_key_tokens",
            "Tokens by API key: prompt (as the gateway counted it, of requests a replica"
            " took) and completion (as the replica reported it; the picker knows it for the"
            " requests it meters: without max_tokens, of a key with a token budget).",
            ["key", "kind"],
            registry=r,
        )
        # Read at scrape time (the keys change with the config, a bucket refills between
        # scrapes, a queue is counted by flow only when asked); the gateway sets ``rows``.
        self.key_budgets = _ScrapedGauge(
            "isocost_api_key_budget_remaining",
            "What an API key's requests_per_minute or tokens_per_minute bucket holds now"
            " (below 0 while spends made after the fact or by peer gateways are repaid).",
            ["key", "budget"],
        )
        self.queue_by_key = _ScrapedGauge(
            "isocost_queue_depth_by_key",
            "Requests waiting in the gateway queue, by API key (requests of no key are in"
            " isocost_queue_depth only).",
            ["pool", "key"],
        )
        self.key_in_flight = _ScrapedGauge(
            "isocost_api_key_in_flight",
            "Requests of an API key in flight through this gateway and, with a state bus,"
            " its peers (what max_in_flight is held against).",
            ["key"],
        )
        r.register(self.key_budgets)
        r.register(self.queue_by_key)
        r.register(self.key_in_flight)
        self.rejections = Counter(
            "isocost_rejections", "Requests refused, by reason.", ["reason"], registry=r
        )
        self.retries = Counter(
            "isocost_retries",
            "Attempts repeated on another replica, by the failure that caused them.",
            ["reason"],
            registry=r,
        )
        self.stream_resumes = Counter(
            "isocost_stream_resumes",
            "Streams broken mid-way, by outcome: resumed on another replica, failed (no"
            " replica could continue it) or not_resumable (see the README).",
            ["outcome"],
            registry=r,
        )
        self.disaggregated = Counter(
            "isocost_disaggregated_requests",
            "Requests answered, by pool and whether they were split into a prefill on one"
            " replica and a decode on another (yes) or served whole (no).",
            ["pool", "disaggregated"],
            registry=r,
        )
        self.pd_prefill = Histogram(
            "isocost_pd_prefill_seconds",
            "Time of a split request's prefill step, from sending it to P to P's answer with"
            " the KV hand-off, per prefill replica.",
            ["replica"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.kv_transfer = Histogram(
            "isocost_kv_transfer_seconds",
            "KV transfer time of a split request, P to D, as the decode replica reports it"
            " (x-isocost-kv-transfer-ms), per decode replica.",
            ["replica"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.pd_handoff_failures = Counter(
            "isocost_pd_handoff_failures",
            "Split requests prefilled again elsewhere, by the step that failed: prefill (P"
            " failed or gave no hand-off) or transfer (D could not pull the KV).",
            ["pool", "stage"],
            registry=r,
        )
        self.pd_queue_depth = Gauge(
            "isocost_pd_queue_depth",
            "Requests waiting at the prefill and the decode replica of the latest split,"
            " as the brain's shadow state saw them when it chose the pair.",
            ["pool", "role"],
            registry=r,
        )
        self.config_reloads = Counter(
            "isocost_config_reloads",
            "Config file reloads, by result: ok (applied) or rejected (the running config stays).",
            ["result"],
            registry=r,
        )
        self.state_bus_rejected = Counter(
            "isocost_state_bus_rejected",
            "State-bus messages or events dropped unapplied, by reason: undecodable (not"
            " MessagePack), invalid (not a batch, or a value out of bounds), duplicate (a"
            " request already in flight) or too_many_peers (a new peer beyond the cap).",
            ["reason"],
            registry=r,
        )
        self.state_bus_gaps = Counter(
            "isocost_state_bus_gaps",
            "Sequence gaps in a state-bus peer's messages: some were lost, and the peer's"
            " in-flight was left to the scrapes.",
            registry=r,
        )
        self.task_failures = Counter(
            "isocost_task_failures",
            "Failures of the gateway's long-lived background tasks (each restarted), and"
            " failed rounds of a replica monitor, by task.",
            ["task"],
            registry=r,
        )
        self.replica_checks = Counter(
            "isocost_replica_checks",
            "Active checks sent to replicas (health probes, live probes, /metrics scrapes),"
            " by pool and check.",
            ["pool", "check"],
            registry=r,
        )
        self.discovery_up = Gauge(
            "isocost_discovery_up",
            "1 while the discovery provider's source answers; 0 while it does not (the last"
            " known replicas stay).",
            ["provider"],
            registry=r,
        )
        self.discovery_replicas = Gauge(
            "isocost_discovery_replicas",
            "Replicas the discovery provider has registered and the gateway accepted.",
            ["provider"],
            registry=r,
        )
        self.discovery_dropped = Gauge(
            "isocost_discovery_dropped",
            "Registrations the discovery provider lists past discovery.max_replicas, ignored"
            " while they last (the replicas already routed to stay).",
            ["provider"],
            registry=r,
        )
        self.discovery_rejected = Counter(
            "isocost_discovery_rejected",
            "Registrations skipped (malformed, unknown GPU or model, URL or name taken).",
            ["provider"],
            registry=r,
        )
        self.kv_event_batches = Counter(
            "isocost_kv_event_batches",
            "KV-cache event batches received from replicas' engines (vLLM --kv-events-config).",
            ["pool", "replica"],
            registry=r,
        )
        self.kv_event_resyncs = Counter(
            "isocost_kv_event_resyncs",
            "Times a replica's prefix entries were dropped for a sequence gap or an unplaceable"
            " or undecodable event, to be rebuilt from later events.",
            ["pool", "replica"],
            registry=r,
        )
        self.kv_event_dropped = Counter(
            "isocost_kv_event_dropped",
            "KV-event messages not applied: not a batch (frames, msgpack, shape), a frame over"
            " the bound (the connection ZMQ dropped for it), a repeated sequence number, or"
            " another gap right after one (the entries were rebuilt at"
            " the first; until the stream is in order the index runs on dispatches alone).",
            ["pool", "replica"],
            registry=r,
        )
        self.ejections = Counter(
            "isocost_replica_ejections",
            "Times the replica's circuit opened from closed: taken out of service by failed"
            " requests or checks (its last_error in /admin/replicas and the replica_ejected"
            " log line say why).",
            ["pool", "replica"],
            registry=r,
        )
        self.prefix_predictions = Counter(
            "isocost_prefix_predictions",
            "Answers whose engine reported its prefix-cache hit, by how the gateway's"
            " prediction for the chosen replica compared: exact, over or under.",
            ["replica", "outcome"],
            registry=r,
        )

        def per_replica(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, ["pool", "replica"], registry=r)

        self.replica_healthy = per_replica(
            "isocost_replica_healthy",
            "1 when the replica's circuit is closed and it is not drained.",
        )
        self.in_flight = per_replica(
            "isocost_replica_in_flight", "Requests this gateway has in flight on the replica."
        )
        self.scrape_age = per_replica(
            "isocost_replica_scrape_age_seconds",
            "Seconds since the replica's /metrics was last read successfully.",
        )
        self.ttft_factor = per_replica(
            "isocost_replica_ttft_factor",
            "Learned observed / predicted TTFT of the replica (1: as its spec; 3: 3x slower).",
        )
        self.itl_factor = per_replica(
            "isocost_replica_itl_factor",
            "Learned observed / predicted inter-token time of the replica.",
        )
        self.prefill_term = Gauge(
            "isocost_replica_prefill_term_seconds",
            "Prefill terms the replica is priced with: seconds per chunk, per 1k tokens, per "
            "1M attention pairs, per request, per sequence decoding there (fitted with "
            "calibration.prefill_fit, else the analytic ones).",
            ["pool", "replica", "term"],
            registry=r,
        )
        self.ttft_error = per_replica(
            "isocost_replica_ttft_prediction_error",
            "Recent mean absolute percentage error of the replica's predicted TTFT (0.1: 10%).",
        )
        self.itl_error = per_replica(
            "isocost_replica_itl_prediction_error",
            "Recent mean absolute percentage error of the replica's predicted inter-token time.",
        )
        self.prefill_duty = per_replica(
            "isocost_replica_prefill_duty",
            "Share of the replica's time that prefill recently sent there will take.",
        )
        self.view_divergence = per_replica(
            "isocost_view_divergence",
            "Largest difference, in requests, between this gateway's in-flight count on the"
            " replica and a state-bus peer's (its latest heartbeat).",
        )

    def state_bus_lag(self) -> Histogram:
        """The histogram of the state bus's message lag (only gateways that have one)."""
        return Histogram(
            "isocost_state_bus_lag_seconds",
            "Time from a state-bus peer's send to its message's arrival here (wall clocks).",
            buckets=_BUS_LAG_BUCKETS_S,
            registry=self.registry,
        )

    def track_recording(self, active: Callable[[], float], total: Callable[[str], float]) -> None:
        """Export the recorder's state (``isocost serve --record``, the admin API)."""
        r = self.registry
        Gauge(
            "isocost_recording_active",
            "1 while finished requests are being recorded; 0 when off or stopped by an error.",
            registry=r,
        ).set_function(active)
        for name, meaning in (
            ("recorded", "Requests written to the recording"),
            ("dropped", "Requests not recorded: the recorder's queue was full"),
            ("errors", "Recordings stopped by a write error, or refused at start (bad dir)"),
        ):
            Gauge(
                f"isocost_recording_{name}",
                f"{meaning}, since the gateway started.",
                registry=r,
            ).set_function(functools.partial(total, name))

    def track_state_bus(self, up: Callable[[], float], peers: Callable[[], float]) -> None:
        """Export the state bus's health (only gateways that have one)."""
        r = self.registry
        Gauge(
            "isocost_state_bus_up",
            "1 while the state bus is connected; 0 while the gateway serves on scrapes alone.",
            registry=r,
        ).set_function(up)
        Gauge(
            "isocost_state_bus_peers",
            "Other gateways heard on the state bus within its peer timeout.",
            registry=r,
        ).set_function(peers)


class _ScrapedGauge(Collector):
    """A labelled gauge whose samples ``rows`` gives at each scrape: (*labels, value)."""

    def __init__(self, name: str, documentation: str, labels: list[str]) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.rows: Callable[[], Iterable[tuple[str | float, ...]]] = tuple

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [self._family()]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        for *labels, value in self.rows():
            family.add_metric([str(label) for label in labels], float(value))
        yield family

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self.name, self.documentation, labels=self.labels)
