"""Admission audit: would the requests SLO admission turned away have met their SLOs?

A policy with SLO admission rejects a request (REJECT ``deadline`` from
``Policy.schedule``) when it predicts that on no candidate replica would the request meet
its TTFT deadline and TPOT target, and the requests running there keep their TPOT target
once its prefill joins them. ``isocost sim --audit-admission`` checks each such rejection
against what would have happened: at the moment of the rejection the simulator forks; the
child admits the request instead and runs on, everything else as it was, until the
request, every request then in flight on its replica ("beside it") and every request that
arrived anywhere while it ran ("after it") settle, and hands back how they fared through
a pipe; the parent rejects it as before and goes on. (The
queue's own expiries, full queue and timeouts are not admission decisions and are not
audited.) A request SLO admission holds (``scheduling.dispatch``) is replayed the moment
it is held first, as if refused then: admitted later after all, it is no rejection and
the replay is dropped; refused later (at a wake, or when its time ran out), it counts as a
rejection with that replay, the question being whether admitting it when it asked would
have served it.

The counterfactual replica: among the candidates the policy's pipeline left before SLO
admission (eligible, under their queue cap, past the filters), the one predicted closest
to meeting the SLO, i.e. with the least worst ratio of prediction to bound over its TTFT
(to the time left before the deadline), its TPOT (to the target) and the running streams
its prefill is expected to push past the target (to ``MAX_TPOT_VICTIMS``); ties go to the
least predicted TTFT. For a TTFT rejection that
is the least predicted TTFT; for a TPOT rejection it is a replica where the decode would
come closest to fitting, which the least TTFT need not be.

Why a fork: it copies the whole process (policy, shadow state, engine models, event
heap, records) copy-on-write, and is exact by construction. Measured on the first 2,000
Mooncake requests on 16 replicas: a fork, exit and wait costs 5-10 ms (110-320 MB
process), a ``copy.deepcopy`` of the simulator 1.0-2.8 s. The replay itself dominates:
it simulates on until those requests complete. The child returns from this call with the
decision that admits the request, so the dispatcher goes on exactly as it would (the rest
of a wake still runs), and it stops where the last of them settles (in a replay,
``Simulator.replaying``, every settle comes here), leaving through ``os._exit`` (no
buffers flushed twice, no atexit handlers), never back into its parent's callers; it
audits nothing itself and reports no progress. The parent waits for each child, so the
audit is deterministic. POSIX only.

Figures per run (``AdmissionAudit``): rejections audited; true rejections: admitted, the
request would have missed an SLO, or it would have met both but a request beside it that
met its SLOs in the run would have missed one (``true_for_others``: the rejection
protected others, as SLO admission's TPOT check means to); false rejections: neither;
admitted requests that missed (every other arrival that did not complete within both
SLOs: late, expired in the queue, or failed); precision = true / rejections; recall =
true / (true + admitted that missed), the share of SLO misses that admission turned away;
false rejections as a share of all arrivals.

The requests after it, in balance (``later_lost``, ``later_saved``): over the rejections
whose request would have met its SLOs (``would_meet``), how many of the requests after
it met their SLOs in the run and would have missed them, and the other way round. One
request admitted moves later decisions (a placement, a tie), and those differences go
either way, so no single rejection is judged by them; their balance per rejection
(``later_net_cost``) says what such rejections protect on average: the TPOT rule guards
the streams admitted after it too (each prefill admitted is one more stall for every
stream there), which the requests beside it do not show. Harm after the request settled
(a queue it left longer) is not counted. By reason (``by_reason``): the checks the
counterfactual replica was predicted to fail (``ttft``, ``tpot``, ``victims``, or several
joined by ``+``), with how many such rejections were true and how many false, so that a
rule that refuses too much shows by name.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from random import Random
from typing import TYPE_CHECKING, Any

import numpy as np
from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from isocost.core.slo import SloTargets
from isocost.runtime.processes import dies_with
from isocost.scheduling.contract import RequestView
from isocost.scheduling.decision import Decision, Outcome
from isocost.scheduling.framework import SLO_CHECKS, slo_ratios

if TYPE_CHECKING:
    from isocost.sim._core import SimRecord, Simulator

__all__ = ["AdmissionAudit", "AdmissionAuditor", "ForcedAdmission", "ReasonCount", "audit_table"]

# a replay's answer: its TTFT, E2E (nan: not completed), the checks its replica was
# predicted to fail (bits of ``SLO_CHECKS``), and how many of the others are beside it; then,
# one for each of those beside it, then one for each after it:
_HEAD = struct.Struct("<ddBI")
_OTHER = struct.Struct("<q?")  # (request id, met its SLOs in the replay)


@dataclass(frozen=True, slots=True)
class ReasonCount:
    """Audited rejections whose counterfactual replica failed the checks ``reason``."""

    reason: str
    rejections: int
    false_rejections: int


@dataclass(frozen=True, slots=True)
class AdmissionAudit:
    """One run's audit (see the module docstring); ``replay_wall_s`` and ``replays`` are not
    in the JSON."""

    arrivals: int
    rejections: int
    true_rejections: int
    true_for_others: int  # of them: it would have met its SLOs, one beside it not
    false_rejections: int
    admitted_missed: int
    replay_wall_s: float
    replays: int  # one per rejection, and one per held request admitted after all
    by_reason: tuple[ReasonCount, ...] = ()  # most rejections first
    later_lost: int = 0  # after the rejections that would have met: met, would miss
    later_saved: int = 0  # the other way round
    later_net_se: float | None = None  # standard error of ``later_net_cost``

    @property
    def precision(self) -> float | None:
        return self.true_rejections / self.rejections if self.rejections else None

    @property
    def recall(self) -> float | None:
        misses = self.true_rejections + self.admitted_missed
        return self.true_rejections / misses if misses else None

    @property
    def false_rejection_share(self) -> float:
        return self.false_rejections / self.arrivals if self.arrivals else 0.0

    @property
    def would_meet(self) -> int:
        """Rejections whose request, admitted, would have met its SLOs."""
        return self.rejections - self.true_rejections + self.true_for_others

    @property
    def later_net_cost(self) -> float | None:
        """SLOs the requests after such a rejection would have lost, net, per rejection."""
        if not self.would_meet:
            return None
        return (self.later_lost - self.later_saved) / self.would_meet

    def json_fields(self) -> dict[str, Any]:
        """The deterministic figures, as ``--json`` has them."""
        return {
            "rejections": self.rejections,
            "true_rejections": self.true_rejections,
            "true_for_others": self.true_for_others,
            "false_rejections": self.false_rejections,
            "admitted_missed": self.admitted_missed,
            "precision": self.precision,
            "recall": self.recall,
            "false_rejection_share": self.false_rejection_share,
            "would_meet": self.would_meet,
            "later_lost": self.later_lost,
            "later_saved": self.later_saved,
            "later_net_cost": self.later_net_cost,
            "later_net_se": self.later_net_se,
            "by_reason": {
                c.reason: {"rejections": c.rejections, "false_rejections": c.false_rejections}
                for c in self.by_reason
            },
        }


class AdmissionAuditor:
    """The simulator's admission hook for ``--audit-admission``: a forked replay per
    SLO-admission rejection (see the module docstring)."""

    def __init__(self, slo: SloTargets) -> None:
        self.slo = slo
        self.replays = 0
        self.replay_wall_s = 0.0
        # per audited request id: (request id, met its SLOs in the replay) of those beside
        # it, and of those after it
        self.beside: dict[int, tuple[tuple[int, bool], ...]] = {}
        self.after: dict[int, tuple[tuple[int, bool], ...]] = {}
        # per audited request id: the checks its counterfactual replica was predicted to fail
        self.reason: dict[int, str] = {}
        self._failed_checks = 0  # in a replay: those of the request it admits (bits)
        self._pipe: int | None = None  # in a replay: where its answer goes
        self._watched: list[SimRecord] = []  # in a replay: the request, beside, after
        self._beside = 0  # in a replay: how many of the watched are beside it
        self._unsettled: set[int] = set()  # in a replay: ``id`` of the watched still out
        self._simulator: Simulator | None = None  # in a replay: the one it runs in
        self._rejected_s = 0.0  # in a replay: when the run rejected the request

    def admit_instead(
        self, simulator: Simulator, record: SimRecord, view: RequestView
    ) -> Decision | None:
        """Called for each rejection: in the parent, replay and return None (reject it as
        usual); in the forked replay, the decision that admits it instead. Inside a
        replay other rejections stand, as they do in the run it replays."""
        if self._pipe is not None:
            return None
        started = time.perf_counter()
        read_end, write_end = os.pipe()
        parent, pid = os.getpid(), os.fork()
        if pid == 0:  # the replay
            if (hook := dies_with(parent)) is not None:
                hook()
            gc.disable()  # short-lived: spare the copy-on-write pages a collection touches
            os.close(read_end)
            self._pipe = write_end
            simulator.on_progress = None
            simulator.replaying = True
            decision, self._failed_checks = _counterfactual_admission(simulator, record, view)
            assert decision.replica_id is not None
            self._watched = [record, *simulator.in_flight_on(decision.replica_id)]
            self._beside = len(self._watched) - 1
            self._unsettled = {id(r) for r in self._watched}
            self._simulator, self._rejected_s = simulator, simulator.now
            return decision
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            data = pipe.read()
        os.waitpid(pid, 0)
        if len(data) < _HEAD.size:
            raise RuntimeError(f"the admission replay of request {view.request_id} failed")
        ttft_s, e2e_s, failed, beside = _HEAD.unpack_from(data)
        record.counterfactual = (ttft_s, e2e_s)
        request_id = record.request.request_id
        self.reason[request_id] = "+".join(c for i, c in enumerate(SLO_CHECKS) if failed >> i & 1)
        others = tuple((rid, met) for rid, met in _OTHER.iter_unpack(data[_HEAD.size :]))
        self.beside[request_id], self.after[request_id] = others[:beside], others[beside:]
        self.replays += 1
        self.replay_wall_s += time.perf_counter() - started
        return None

    def settled(self, record: SimRecord) -> None:
        """In a replay: once the request, those beside it and those after it settled,
        hand back how they fared and end. Those after it are known when it settles."""
        self._unsettled.discard(id(record))
        if record is self._watched[0]:
            self._watch_arrivals()
        if self._unsettled:
            return
        assert self._pipe is not None
        replayed, *others = self._watched
        answer = _HEAD.pack(*_seen(replayed), self._failed_checks, self._beside) + b"".join(
            _OTHER.pack(r.request.request_id, self._met(r, _seen(r))) for r in others
        )
        os.write(self._pipe, answer)
        os._exit(0)

    def _watch_arrivals(self) -> None:
        """Watch the requests that arrived between the rejection and now (the replayed
        request settled), settled already or not."""
        assert self._simulator is not None
        start, end = self._rejected_s, self._simulator.now
        watched = {id(r) for r in self._watched}
        for other in self._simulator.records:
            if start < other.request.arrival_s <= end and id(other) not in watched:
                self._watched.append(other)
                if not other.settled:
                    self._unsettled.add(id(other))

    def abandon(self) -> None:
        """In a replay whose run ended (or raised) before its requests settled."""
        os._exit(1)

    def summary(self, records: Sequence[SimRecord]) -> AdmissionAudit:
        """The run's audit, from its records once it ended."""
        met = {r.request.request_id: self._met(r, _seen(r)) for r in records}
        rejections = true_rejections = true_for_others = admitted_missed = 0
        later: list[tuple[int, int]] = []  # (lost, saved) after each that would meet
        by_reason: dict[str, list[int]] = {}  # reason -> [rejections, false ones]
        for record in records:
            request_id = record.request.request_id
            if record.counterfactual is None:
                admitted_missed += not met[request_id]
                continue
            rejections += 1
            count = by_reason.setdefault(self.reason[request_id], [0, 0])
            count[0] += 1
            if not self._met(record, record.counterfactual):
                true_rejections += 1
                continue
            after = self.after[request_id]
            lost = sum(met[rid] and not ok for rid, ok in after)
            saved = sum(ok and not met[rid] for rid, ok in after)
            later.append((lost, saved))
            if any(met[rid] and not ok for rid, ok in self.beside[request_id]):
                true_rejections += 1
                true_for_others += 1
            else:
                count[1] += 1
        return AdmissionAudit(
            arrivals=len(records),
            rejections=rejections,
            true_rejections=true_rejections,
            true_for_others=true_for_others,
            false_rejections=rejections - true_rejections,
            admitted_missed=admitted_missed,
            replay_wall_s=self.replay_wall_s,
            replays=self.replays,
            by_reason=tuple(
                ReasonCount(reason, n, false)
                for reason, (n, false) in sorted(by_reason.items(), key=lambda kv: -kv[1][0])
            ),
            later_lost=sum(lost for lost, _ in later),
            later_saved=sum(saved for _, saved in later),
            later_net_se=_standard_error([lost - saved for lost, saved in later]),
        )

    def _met(self, record: SimRecord, times: tuple[float, float]) -> bool:
        """Whether ``record``'s request, seen at ``times`` (TTFT, E2E), met its SLOs."""
        ttft_s, e2e_s = times
        if math.isnan(e2e_s):
            return False
        output_tokens = record.request.output_tokens
        tpot_s = (e2e_s - ttft_s) / (output_tokens - 1) if output_tokens > 1 else 0.0
        return self.slo.met(record.request.prompt_tokens, ttft_s, tpot_s)


class ForcedAdmission:
    """An admission hook that admits one request, by id, where the audit's replay would
    have, in this run itself: the independent replay tests check a fork against."""

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id

    def admit_instead(
        self, simulator: Simulator, record: SimRecord, view: RequestView
    ) -> Decision | None:
        if record.request.request_id != self.request_id:
            return None
        return _counterfactual_admission(simulator, record, view)[0]

    def settled(self, record: SimRecord) -> None:
        raise AssertionError("a forced admission replays nothing")

    def abandon(self) -> None:
        raise AssertionError("a forced admission replays nothing")


def _counterfactual_admission(
    simulator: Simulator, record: SimRecord, view: RequestView
) -> tuple[Decision, int]:
    """The ADMIT decision to the candidate closest to meeting the SLO (module docstring),
    and the checks that candidate was predicted to fail (bits of ``SLO_CHECKS``).

    The candidates are found by the policy's own first stages, without running its
    scorers and picker, which may keep state (a round-robin cursor, the random stream)
    that the rest of the run must find as it was.
    """
    policy, shadow, now = simulator.policy, simulator.shadow, simulator.now
    ctx = policy.candidates(view, shadow, now, exclude=record.failed_on, rng=Random(0))
    assert not isinstance(ctx, Decision), "SLO admission rejected a request with no candidate"
    prediction = ctx.prediction
    ratios = slo_ratios(ctx)
    worst = np.max(ratios, axis=0)
    position = int(np.lexsort((prediction.ttft_s, worst))[0])
    failed = sum(1 << i for i in range(len(SLO_CHECKS)) if ratios[i, position] > 1.0)
    slot = int(ctx.idx[position])
    decision = Decision(
        Outcome.ADMIT,
        policy.name,
        replica_id=str(shadow.slots.ids[slot]),
        route_class=ctx.route_class,
        predicted_ttft_s=float(prediction.ttft_s[position]),
        predicted_e2e_s=float(prediction.e2e_s[position]),
        predicted_output_tokens=ctx.expected_output_tokens,
        cached_tokens=min(ctx.cached_blocks_at(position) * shadow.block_tokens, view.prompt_tokens),
        raw_times=prediction.raw_at(position),
    )
    return decision, failed


def _standard_error(values: Sequence[int]) -> float | None:
    """Of the mean of ``values``; None under two."""
    if len(values) < 2:
        return None
    return statistics.stdev(values) / math.sqrt(len(values))


def _seen(record: SimRecord) -> tuple[float, float]:
    """TTFT and E2E as the gateway saw them (nan: not completed)."""
    if record.finished_s is None or record.first_token_s is None:
        return math.nan, math.nan
    arrival = record.request.arrival_s
    return record.first_token_s - arrival, record.finished_s - arrival


def audit_table(runs: Sequence[tuple[str, float | None, AdmissionAudit]]) -> Group:
    """The audited runs (policy, rate in sweeps, audit): counts, precision, recall, false
    rejections; the replays' cost."""
    table = Table(
        title="admission audit (each rejection replayed as admitted)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=0,  # the box's blank rule alone parts the columns: names stay whole
        show_edge=False,
    )
    sweep = any(rate is not None for _, rate, _ in runs)
    headers = ("policy", "rate", "rej", "true", "for\nothers", "false", "admitted\nmissed",
               "precision", "recall", "false\n% arr")  # fmt: skip
    for header in headers:
        if header != "rate" or sweep:
            table.add_column(header, justify="left" if header == "policy" else "right")
    replays = replay_s = 0.0
    for policy, rate, audit in runs:
        replays += audit.replays
        replay_s += audit.replay_wall_s
        table.add_row(
            policy,
            *_rate_cell(rate, sweep),
            str(audit.rejections),
            str(audit.true_rejections),
            str(audit.true_for_others),
            str(audit.false_rejections),
            str(audit.admitted_missed),
            _share(audit.precision),
            _share(audit.recall),
            f"{100 * audit.false_rejection_share:.1f}",
        )
    cost = f"{replays:.0f} replays took {replay_s:.1f} s"
    reasons = Text("failed: the checks its closest replica was predicted to fail")
    later = Text(
        "would meet: rejections whose request would have met its SLOs; after them,\n"
        "the requests arriving while it would have run: met in the run and missed in\n"
        "the replay (lost), or the other way round (saved); net: lost - saved, each\n"
        "(± its standard error)"
    )
    return Group(
        table,
        Text(f"{_LEGEND}\n{cost}"),
        _reason_table(runs, sweep),
        reasons,
        _later_table(runs, sweep),
        later,
    )


def _later_table(runs: Sequence[tuple[str, float | None, AdmissionAudit]], sweep: bool) -> Table:
    """Per run, what the rejections that would have met saved the requests after them."""
    headers = ("policy", "rate", "would meet", "lost", "saved", "net")
    table = _small_table("after the rejections that would meet", headers, ("policy",), sweep)
    for policy, rate, audit in runs:
        net, se = audit.later_net_cost, audit.later_net_se
        table.add_row(
            policy,
            *_rate_cell(rate, sweep),
            str(audit.would_meet),
            str(audit.later_lost),
            str(audit.later_saved),
            "-" if net is None else f"{net:.2f}" + ("" if se is None else f" ±{se:.2f}"),
        )
    return table


def _reason_table(runs: Sequence[tuple[str, float | None, AdmissionAudit]], sweep: bool) -> Table:
    """Per run, its rejections by the checks the closest replica was predicted to fail."""
    headers = ("policy", "rate", "failed", "rej", "false")
    table = _small_table("rejections by failed check", headers, ("policy", "failed"), sweep)
    for policy, rate, audit in runs:
        for count in audit.by_reason:
            table.add_row(
                policy,
                *_rate_cell(rate, sweep),
                count.reason,
                str(count.rejections),
                str(count.false_rejections),
            )
    return table


_LEGEND = (
    "true: admitted, it would have missed an SLO, or (for others) made a request\n"
    "running beside it miss one; false: neither; recall: the share of SLO misses\n"
    "that admission turned away"
)


def _small_table(title: str, headers: Sequence[str], left: Sequence[str], sweep: bool) -> Table:
    """A table under the audit's, with its ``headers`` (``left`` aligned left, the rest
    right; the rate column in sweeps only)."""
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1, 0, 0),
        show_edge=False,
    )
    for header in headers:
        if header != "rate" or sweep:
            table.add_column(header, justify="left" if header in left else "right")
    return table


def _rate_cell(rate: float | None, sweep: bool) -> list[str]:
    """The rate column's cell, in sweeps only."""
    return [f"{rate:g}" if rate is not None else ""] if sweep else []


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
