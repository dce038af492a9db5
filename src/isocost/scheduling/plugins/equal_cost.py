"""``equal-cost-scorer``: predicted completion cost of the request on each replica (DESIGN §4).

For request ``q`` (``n`` prompt tokens, ``m`` expected output tokens: the online
estimate per (model, route class), capped by ``max_tokens``) and candidate replica ``r``,
from r's shadow state (``scheduling.predict`` has the timing formulas)::

    own_r     = ttft_r + decode_r
                ttft_r   = f_ttft_r * (wait_r + T_pre_r(n - c_r, c_r))
                           wait_r: queued prefill work ahead of q, plus waiting for KV room
                           c_r: q's prefix blocks the prefix index holds on r
                decode_r = f_itl_r * m * T_step_r(b_r + 1, K_r + n + m/2) / (1 - rho_r)
                           rho_r: r's prefill duty, the share of its time prefill chunks
                           recently dispatched there will take from its streams
    delay_r   = b_r * (prefill_r + f_itl_r * min(m, R_r / b_r) * dstep_r)
                the slowdown q inflicts on r's b_r running requests: its prefill stalls
                their steps, then each shared step is dstep_r = T_step(b+1) - T_step(b)
                longer (R_r: their remaining output tokens)
    preempt_r = f_ttft_r * T_pre_r(clip(kv_used_r + n + m - kv_cap_r, 0, m), 0)
                KV pressure: tokens that will not fit once q's decode grows are preempted
                and recomputed
    price_r   = mu * busy * occupy_r * usd_r / mean(usd)
                occupy_r = prefill_r + f_itl_r * m * (T_step(b+1) - T_step(b) if b > 0
                           else T_step(1)): replica time q consumes beyond what r spends
                           anyway; busy = mean over candidates of
                           min(1, max(kv_usage, wait / busy_wait_s)) in [0, 1]
    scarce_r  = sigma * S_r * (prefill_r + decode_r)
                S_r: exclusive demand on r, the prefill seconds per second of recent
                requests that only r and some others could serve in time (below);
                q's stay on r is time those lose: a prefill, then one more stream
                that a long prefill there would stall
    headroom_r = eta * H_r * decode_r
                H_r: the long prompts q's stream on r would shut out of r while it
                runs, as their completion seconds per second (below)
    cost_r    = (own_r + lambda * delay_r + preempt_r + price_r + scarce_r
                 + headroom_r) / weight_r

``f_ttft_r``, ``f_itl_r`` are r's learned correction factors (EWMA of observed /
predicted TTFT and inter-token time), so a slow node or an unexpectedly fast GPU is priced
as measured; ``f_ttft_r`` is raised to what r's oldest request still awaiting its first
token proves (elapsed / predicted, ``Calibration.ttft_factor_at``), so a replica that
slowed down stops looking cheap before it answers. ``price_r`` makes cache reuse count
under load: on a busy cluster, GPU time spent recomputing a prefix that another replica
holds is capacity taken from everyone.

Soft affinity: with a session key, the ``affinity_replicas`` candidates with the highest
rendezvous hash of the key are preferred; a preferred replica that is not overloaded
(waiting < ``overload_queue_fraction * max_queue`` and KV usage < ``overload_kv_usage``)
has its cost divided by ``1 + affinity_slack``: it wins unless some replica is cheaper by
more than that slack. Its cached prefix usually makes it cheapest anyway.

Within the prediction's error, what is certain: the candidates holding the request's
longest cached prefix (when some candidate holds less), and those with the fewest queued
requests (when some have more), each have their cost divided by
``1 + min(e_r, max_error_slack)`` if not overloaded, ``e_r`` their recent TTFT prediction
error (MAPE, ``Calibration.ttft_error``); one that is both is divided twice. Why: a cost
gap smaller than the prediction's own error says nothing, while a cached prefix is a
certain saving (prefill the cluster need not do again, KV not held twice, the document's
next requests kept where it is), and a short queue is a certain head start (llm-d's
queue scorer, fewest waiting, is what carries long prompts at SLO best, README "On equal
terms"). The more the model errs (the queue model: ~40% in the simulator under load; CPU
vLLM: 40-140%), the larger the gap these may close. Measured there: capacity at SLO +5%
to +16% on the long-prompt fleets.

Scarcity: a replica's time is worth more when some requests can be served in time only
there. A request with a deadline whose isolated prefill (an empty replica, nothing
cached, its correction factor) fits its TTFT budget on some eligible replicas and not on
others is *exclusive* demand for those: its prefill seconds, shared among them, feed an
EWMA per replica over ``DEMAND_TAU_S`` (each request counted once, at its first
pricing), read as seconds per second, ``S_r``. Placing q on r costs ``sigma * S_r`` times
q's stay there (its prefill and decode): time the requests only r can serve lose. So
short prompts go to the L20s of an A100 + L20 fleet, where they still meet their SLOs,
and the A100s keep room for the long prompts no L20 prefills in time; on a homogeneous
fleet nothing is exclusive and nothing changes. Measured on 6,000 Mooncake requests
(``--sweep-rate``, attainment at five rates against ``scarcity_weight: 0``): A100 + L20
+0.2 to +1.1 points, 14 A100 + 2 slowed 4x +0.1 to +0.8, the Azure code trace on H100 +
A100 + L20 -0.2 to +0.8, Mooncake on H100 + A100 + L20 (held out) -0.3 to +0.6; 16 x A100
-0.4 to +0.1. sigma was set to 3 on the first two (1 gave half the gain on A100 + L20 and
none with two slowed; 10 less than 3).

Headroom: a stream takes more than the time it adds. SLO admission lets a prefill onto a
replica only while it is expected to push at most one of the streams there past their
TPOT target (``scheduling.predict``, ``max_stall_s``): with ``b`` streams, each ``h``
under its target, the longest prefill it lets on is ``S(b) = -mean_m * h * ln(1 - 1/b)``
(no bound for one stream). One more stream lowers that bound from ``S(b)`` to
``S(b + 1)``, a little where many streams run and much where few do, and the prompts
whose prefill falls between the two cannot go to r while q's stream runs there: they
wait for another replica or are refused. ``H_r`` is their arrival rate (the prompt
lengths of the requests with a TPOT target this scorer prices, each once, counted in
quarter-octave buckets over ``DEMAND_TAU_S``) times what each would have taken there (its
prefill and a mean reply at the inter-token time q's stream leaves), so ``headroom_r``,
that times q's stay, is in seconds like every other term. Only prompts at least
``headroom_ratio`` times as long as q's are counted: a request nearly as long as the
prompts it would shut out needs the same headroom itself, and pricing those too packed
arXiv's mid-length prompts together (SLO attainment 89.4 / 90.3 / 85.2% at 42 / 43.3 /
44.8 req/s on 16 x A100 with ratio 1; 94.1 / 90.2 / 88.7% with 4; 93.6 / 91.0 / 89.5%
without the price). So short replies gather on replicas that already run many streams,
and the others keep room for long prompts: on the scenario mix (65% chat turns, 30%
retrieval answers, 5% long documents, no shared prefix), capacity at SLO 38.1 -> 42.6
req/s on 8 x A100 and 51.5 -> 57.7 on A100 + L20; README "On equal terms" has every
regime. eta = 3 and ratio 4 were chosen on the mix on 8 x A100 (one rate, eta 0.3 to 10)
and on arXiv lengths on 16 x A100 (three rates).

Exploration: a replica sent nothing for ``FRESHNESS_TAU_S`` (``Calibration.stale``) has
its cost divided by ``1 + explore_slack``, so that one request goes there when it costs at
most that much more than the best, and its factors are measured again instead of frozen at
whatever made it look dear. Under steady traffic no replica goes stale and this costs
nothing; at worst, one request per idle replica per ``FRESHNESS_TAU_S`` is placed up to
``1 + explore_slack`` times dearer than the best.

Score: ``min(cost) / cost_r`` in (0, 1]; with the max-score picker the least cost wins,
ties by a stable hash.

Parameters (range, default): ``lambda_delay`` (0..10, 1.0); ``gpu_price_weight`` mu
(0..10, 1.0); ``busy_wait_s`` (> 0, 1.0); ``affinity_replicas`` (0..8, 2; 0 disables
affinity); ``affinity_slack`` (0..10, 0.25); ``overload_queue_fraction`` (0..1, 0.5);
``overload_kv_usage`` (0..1, 0.95); ``explore_slack`` (0..10, 0.5; 0 disables exploration);
``max_error_slack`` (0..10, 1.0; 0 disables the preferences within the error);
``scarcity_weight`` sigma (0..10, 3.0; 0 disables the scarcity price);
``headroom_weight`` eta (0..10, 3.0; 0 disables the headroom price); ``headroom_ratio``
(1..100, 4.0).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, ClassVar

import msgspec
import numpy as np

from isocost.scheduling.interface import Context
from isocost.scheduling.plugins._base import PluginKind, rendezvous, session_hash
from isocost.scheduling.predict import IndexArray, max_stall_s
from isocost.scheduling.slots import BoolArray, SlotArrays, SlotStore
from isocost.scheduling.timing import FloatArray, prefill_s

TYPE = "equal-cost-scorer"
DEMAND_TAU_S = 60.0  # memory of exclusive and long-prompt demand: a minute of arrivals
_SEEN_REQUESTS = 4096  # request ids remembered so that a request is counted once
# Prompt lengths the long-prompt demand is counted in: buckets a quarter octave wide,
# centred on 64 to 256k tokens; bucket i spans _EDGES[2i] .. _EDGES[2i + 2].
_EDGES = 2.0 ** np.arange(5.875, 18.126, 0.125)
_PROMPT_TOKENS = _EDGES[1::2]


class Params(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    lambda_delay: float = 1.0
    gpu_price_weight: float = 1.0
    busy_wait_s: float = 1.0
    affinity_replicas: int = 2
    affinity_slack: float = 0.25
    overload_queue_fraction: float = 0.5
    overload_kv_usage: float = 0.95
    explore_slack: float = 0.5
    max_error_slack: float = 1.0
    scarcity_weight: float = 3.0
    headroom_weight: float = 3.0
    headroom_ratio: float = 4.0


def _check(p: Params) -> None:
    checks = (
        ("lambda_delay", 0.0 <= p.lambda_delay <= 10.0, "0..10"),
        ("gpu_price_weight", 0.0 <= p.gpu_price_weight <= 10.0, "0..10"),
        ("busy_wait_s", p.busy_wait_s > 0.0, "> 0"),
        ("affinity_replicas", 0 <= p.affinity_replicas <= 8, "0..8"),
        ("affinity_slack", 0.0 <= p.affinity_slack <= 10.0, "0..10"),
        ("overload_queue_fraction", 0.0 <= p.overload_queue_fraction <= 1.0, "0..1"),
        ("overload_kv_usage", 0.0 <= p.overload_kv_usage <= 1.0, "0..1"),
        ("explore_slack", 0.0 <= p.explore_slack <= 10.0, "0..10"),
        ("max_error_slack", 0.0 <= p.max_error_slack <= 10.0, "0..10"),
        ("scarcity_weight", 0.0 <= p.scarcity_weight <= 10.0, "0..10"),
        ("headroom_weight", 0.0 <= p.headroom_weight <= 10.0, "0..10"),
        ("headroom_ratio", 1.0 <= p.headroom_ratio <= 100.0, "1..100"),
    )
    for name, ok, valid in checks:
        if not ok:
            raise ValueError(f"{name} must be in {valid}")


class EqualCostScorer:
    type_name: ClassVar[str] = TYPE
    kind: ClassVar[PluginKind] = "scorer"

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or Params()
        _check(self.params)
        self._exclusive = _ExclusiveDemand()
        self._prompts = _PromptDemand()

    def cost_s(self, ctx: Context) -> FloatArray:
        """``cost_r`` of the module docstring for every candidate, in seconds."""
        p, slots, key = self.params, ctx.replicas.slots, ctx.key
        load, pred = ctx.load, ctx.prediction
        n, m = float(ctx.request.prompt_tokens), pred.output_tokens
        calibration = ctx.replicas.calibration
        ttft_factor = calibration.ttft_factor_at(ctx.now, key)
        itl_factor = calibration.itl_factor[key]
        wait, prefill = (
            ttft_factor * pred.uncorrected_wait_s,
            ttft_factor * pred.uncorrected_prefill_s,
        )
        b = load.running
        dstep = pred.step_s - np.where(b > 0, pred.base_step_s, 0.0)
        own = wait + prefill + pred.decode_s
        shared_steps = np.minimum(m, load.remaining_decode_tokens / np.maximum(b, 1.0))
        delay = b * (prefill + itl_factor * shared_steps * (pred.step_s - pred.base_step_s))
        cost = own + p.lambda_delay * delay
        overflow = load.kv_used_tokens + n + m - load.kv_capacity_tokens
        if (overflow > 0.0).any():  # KV pressure: priced only where there is some
            overflow = np.minimum(np.maximum(overflow, 0.0), m)
            cost = cost + ttft_factor * prefill_s(slots.coef, overflow, 0.0, key)
        if p.gpu_price_weight > 0.0:
            busy_r = np.minimum(np.maximum(load.kv_usage, wait / p.busy_wait_s), 1.0)
            usd = slots.usd_per_hour[key]
            occupy = prefill + itl_factor * m * dstep
            mean_usd = _mean(usd) or 1.0
            cost = cost + p.gpu_price_weight * _mean(busy_r) * occupy * usd / mean_usd
        if p.scarcity_weight > 0.0:
            scarce = self._exclusive.observe(ctx)
            if scarce is not None:  # q's stay on r: its prefill, then a stream there
                cost = cost + p.scarcity_weight * scarce * (prefill + pred.decode_s)
        target = ctx.request.tpot_target_s
        if p.headroom_weight > 0.0 and target is not None:
            self._prompts.observe(ctx)
            shut = self._prompts.shut_out(ctx, target, p.headroom_ratio)
            if shut is not None:  # while q's stream stays on r, those prompts cannot go
                cost = cost + p.headroom_weight * shut * pred.decode_s
        return np.asarray(cost / slots.weight[key], dtype=np.float64)

    def score(self, ctx: Context) -> FloatArray:
        p = self.params
        cost = self.cost_s(ctx)
        fine: BoolArray | None = None  # which may be preferred, once asked
        if ctx.request.session_key is not None and p.affinity_replicas > 0:
            fine = self._not_overloaded(ctx)
            cost = self._apply_affinity(ctx, cost, fine)
        if p.max_error_slack > 0.0:
            cost = self._apply_error_slack(ctx, cost, fine)
        if p.explore_slack > 0.0:
            stale = ctx.replicas.calibration.stale(ctx.now, ctx.key)
            if stale.any() and not stale.all():
                cost = np.where(stale, cost / (1.0 + p.explore_slack), cost)
        best = float(cost.min())
        if best <= 0.0:
            return np.asarray(cost <= best, dtype=np.float64)
        return np.asarray(best / cost, dtype=np.float64)

    def _apply_affinity(self, ctx: Context, cost: FloatArray, fine: BoolArray) -> FloatArray:
        p, slots, idx = self.params, ctx.replicas.slots, ctx.idx
        weights = rendezvous(slots.salt[ctx.key], session_hash(ctx))
        k = min(p.affinity_replicas, idx.size)
        preferred = np.argpartition(weights, idx.size - k)[idx.size - k :]
        adjusted = cost.copy()
        adjusted[preferred[fine[preferred]]] /= 1.0 + p.affinity_slack
        return adjusted

    def _apply_error_slack(
        self, ctx: Context, cost: FloatArray, fine: BoolArray | None
    ) -> FloatArray:
        cached, waiting = ctx.cached_blocks, ctx.load.waiting
        longest, least = float(cached.max()), float(waiting.min())
        preferred = []
        if longest > 0.0 and float(cached.min()) < longest:  # some hold less of the prefix
            preferred.append(cached >= longest)
        if float(waiting.max()) > least:  # some have more queued
            preferred.append(waiting <= least)
        if not preferred:
            return cost
        error = ctx.replicas.calibration.ttft_error[ctx.key]
        slack = 1.0 + np.minimum(error, self.params.max_error_slack)
        if fine is None:
            fine = self._not_overloaded(ctx)
        for certain in preferred:  # one that is both is divided twice
            cost = np.where(certain & fine, cost / slack, cost)
        return np.asarray(cost, dtype=np.float64)

    def _not_overloaded(self, ctx: Context) -> BoolArray:
        """Which candidates may be preferred: queue under ``overload_queue_fraction`` of
        its bound and KV usage under ``overload_kv_usage``."""
        p, load = self.params, ctx.load
        bound = p.overload_queue_fraction * ctx.replicas.slots.max_queue[ctx.idx]
        fine = (load.waiting < bound) & (load.kv_usage < p.overload_kv_usage)
        return np.asarray(fine, dtype=np.bool_)


def _mean(values: FloatArray) -> float:
    """``values.mean()`` to the bit, without its Python-level wrapper (per decision)."""
    return float(np.add.reduce(values)) / values.size


class _ExclusiveDemand(SlotArrays):
    """Exclusive demand per slot (module docstring, "Scarcity"): prefill seconds of
    requests only some eligible replicas could serve in time, decayed over
    ``DEMAND_TAU_S``."""

    FRESH: ClassVar[Mapping[str, float]] = {"seconds": 0.0, "at_s": 0.0}
    seconds: FloatArray  # per slot, decayed to ...
    at_s: FloatArray  # ... this time

    def __init__(self) -> None:
        super().__init__()
        self._once = _FirstSight()
        self._store: SlotStore[Any] | None = None  # whose slots these are

    def _follow(self, store: SlotStore[Any]) -> None:
        """Be grown with ``store`` and reset where a replica takes a slot, so that a
        replica added in a removed one's slot starts with no demand."""
        if self._store is not store:
            if self._store is not None:
                self._store.detach(self)
            store.attach(self)
            self._store = store

    def observe(self, ctx: Context) -> FloatArray | None:
        """Count ``ctx``'s request once if it is exclusive demand; the demand on each
        candidate now, in seconds per second (None: none anywhere)."""
        self._follow(ctx.replicas.slots)
        request = ctx.request
        if request.deadline_s is not None and self._once.first(request.request_id):
            self._count(ctx, request.deadline_s - request.arrival_s)
        if not self.seconds.any():
            return None
        at = ctx.idx
        seconds = self.seconds[at] * np.exp((self.at_s[at] - ctx.now) / DEMAND_TAU_S)
        return np.asarray(seconds / DEMAND_TAU_S, dtype=np.float64)

    def _count(self, ctx: Context, budget_s: float) -> None:
        eligible: IndexArray = ctx.eligible
        slots = ctx.replicas.slots
        n = float(ctx.request.prompt_tokens)
        alone = (
            prefill_s(slots.coef, n, 0.0, eligible) + slots.coef.per_request_s[eligible]
        ) * ctx.replicas.calibration.ttft_factor[eligible]
        fits = alone <= budget_s
        if not fits.any() or fits.all():
            return
        able = eligible[fits]
        decay = np.exp((self.at_s[able] - ctx.now) / DEMAND_TAU_S)
        self.seconds[able] = self.seconds[able] * decay + float(alone[fits].mean()) / able.size
        self.at_s[able] = ctx.now


class _FirstSight:
    """The request ids seen lately, so that a request priced again (held, retried) is
    counted once."""

    def __init__(self) -> None:
        self._seen: OrderedDict[str, None] = OrderedDict()

    def first(self, request_id: str) -> bool:
        """Whether ``request_id`` is new (it is remembered from now on)."""
        if request_id in self._seen:
            return False
        self._seen[request_id] = None
        if len(self._seen) > _SEEN_REQUESTS:
            self._seen.popitem(last=False)
        return True


class _PromptDemand:
    """Arrivals per prompt length (module docstring, "Headroom"): a count per bucket of
    ``_PROMPT_TOKENS``, decayed over ``DEMAND_TAU_S``."""

    def __init__(self) -> None:
        self.counts = np.zeros(_PROMPT_TOKENS.size)
        self.at_s = 0.0  # when ``counts`` were decayed to
        self._once = _FirstSight()

    def observe(self, ctx: Context) -> None:
        """Count ``ctx``'s request once."""
        request = ctx.request
        if self._once.first(request.request_id):
            self.counts *= math.exp((self.at_s - ctx.now) / DEMAND_TAU_S)
            self.at_s = ctx.now
            bucket = int(np.searchsorted(_PROMPT_TOKENS, request.prompt_tokens))
            self.counts[min(bucket, _PROMPT_TOKENS.size - 1)] += 1.0

    def shut_out(self, ctx: Context, target_s: float, ratio: float) -> FloatArray | None:
        """Per candidate, the prompts at least ``ratio`` times as long as the request's
        that its stream there would shut out, as their completion seconds per second
        (None: no such prompts arrive)."""
        counted = np.flatnonzero(
            (self.counts > 0.0) & (ratio * ctx.request.prompt_tokens <= _PROMPT_TOKENS)
        )
        if not counted.size:
            return None
        decay = math.exp((self.at_s - ctx.now) / DEMAND_TAU_S)
        rates = self.counts[counted] * (decay / DEMAND_TAU_S)
        key, pred, slots = ctx.key, ctx.prediction, ctx.replicas.slots
        mean_output = ctx.mean_output_tokens
        running = ctx.load.running
        before = max_stall_s(running, target_s - pred.others_itl_s, mean_output)
        after = max_stall_s(running + 1.0, target_s - pred.tpot_s, mean_output)
        first = 2 * int(counted[0])  # each edge's prefill once, from the first bucket's low
        tokens = _EDGES[first : 2 * int(counted[-1]) + 3, None]
        alone = prefill_s(slots.coef, tokens, 0.0, key) + slots.coef.per_request_s[key]
        alone = alone * ctx.replicas.calibration.ttft_factor[key]
        at = 2 * counted - first
        low, centre, high = alone[at], alone[at + 1], alone[at + 2]
        # the share of each bucket whose prefill fits the stall bound before q, not after
        overlap = np.maximum(np.minimum(high, before) - np.maximum(low, after), 0.0)
        width = high - low
        share = np.where(
            width > 0.0, overlap / np.maximum(width, 1e-12), (centre > after) & (centre <= before)
        )
        completion = centre + mean_output * pred.tpot_s
        return np.asarray((rates[:, None] * share * completion).sum(axis=0), dtype=np.float64)
