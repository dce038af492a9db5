"""Synthetic workloads: the scenario mix, shared-prefix groups, multi-turn sessions.

Every generator takes an injected ``random.Random`` and an arrival process (an iterator
of absolute times, see ``_arrivals``), so a seed fixes the whole workload.

Lengths are lognormal with the stated mean (mu = ln(mean) - sigma²/2), rounded and at
least 1 token: lognormal is the usual fit for prompt and reply lengths in production
traces (long right tail, no negative values).

Scenario mix (``SCENARIO_MIX``), one class drawn per request:

=====  ======  ==========  ===========  ==================================
class  share   mean input  mean output  stands for
=====  ======  ==========  ===========  ==================================
A      65 %    327         200          chat turns (ShareGPT-like replies)
B      30 %    4,218       250          retrieval-augmented answers
C      5 %     12,842      400          long-document summaries
=====  ======  ==========  ===========  ==================================

Input sigma 0.5, output sigma 0.7 (replies vary more than prompts). Each request's prompt
is its own segment: the mix has no shared prefix.

Shared-prefix groups: ``num_groups`` system prompts, each followed by
``prompts_per_group`` distinct questions; requests are shuffled, so a group's requests
interleave with the others' as they would from many users of a few applications.

Multi-turn sessions: one system prompt shared by every session; turn k's prompt is turn
k-1's prompt + turn k-1's reply + a new user message, so each turn's prompt extends the
previous one. Turn k arrives a think time (exponential, mean ``think_time_s``) after turn
k-1 *arrives*; a replayer must still hold turn k until turn k-1 has finished, as a user
cannot answer a reply not yet received.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from random import Random
from typing import Literal

from isocost.workload._request import Segment, WorkloadRequest

__all__ = [
    "MAX_SYNTHETIC_REQUESTS",
    "SCENARIO_MIX",
    "SYNTHETIC_WORKLOADS",
    "ScenarioClass",
    "SyntheticName",
    "SyntheticSpec",
    "multi_turn",
    "scenario_mix",
    "shared_prefix",
    "synthetic_workload",
]

INPUT_SIGMA = 0.5
OUTPUT_SIGMA = 0.7
MAX_SYNTHETIC_REQUESTS = 1_000_000  # shared-prefix and multi-turn are made whole, up front


@dataclass(frozen=True, slots=True)
class ScenarioClass:
    """One class of the scenario mix: its share of requests and mean lengths."""

    name: str
    share: float
    mean_input_tokens: float
    mean_output_tokens: float


SCENARIO_MIX: tuple[ScenarioClass, ...] = (
    ScenarioClass("A", 0.65, 327, 200),
    ScenarioClass("B", 0.30, 4218, 250),
    ScenarioClass("C", 0.05, 12842, 400),
)


def lognormal_tokens(rng: Random, mean: float, sigma: float, max_tokens: int | None) -> int:
    """A lognormal token count with the given mean, at least 1 and at most ``max_tokens``."""
    value = max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))
    return value if max_tokens is None else min(value, max_tokens)


def scenario_mix(
    rng: Random,
    arrivals: Iterator[float],
    mix: tuple[ScenarioClass, ...] = SCENARIO_MIX,
    max_prompt_tokens: int | None = None,
) -> Iterator[WorkloadRequest]:
    """Endless requests of the scenario mix; ``max_prompt_tokens`` caps long prompts."""
    weights = [c.share for c in mix]
    for request_id in itertools.count():
        cls = rng.choices(mix, weights)[0]
        prompt = lognormal_tokens(rng, cls.mean_input_tokens, INPUT_SIGMA, max_prompt_tokens)
        output = lognormal_tokens(rng, cls.mean_output_tokens, OUTPUT_SIGMA, None)
        yield WorkloadRequest(
            request_id, next(arrivals), prompt, output, (Segment(request_id, prompt),)
        )


def shared_prefix(
    rng: Random,
    arrivals: Iterator[float],
    num_groups: int,
    prompts_per_group: int,
    system_prompt_tokens: int,
    question_tokens: int,
    output_tokens: int,
) -> list[WorkloadRequest]:
    """``num_groups`` x ``prompts_per_group`` requests; a group shares its system prompt."""
    if num_groups <= 0 or prompts_per_group <= 0:
        raise ValueError("num_groups and prompts_per_group must be positive")
    pairs = [(g, q) for g in range(num_groups) for q in range(prompts_per_group)]
    rng.shuffle(pairs)
    requests: list[WorkloadRequest] = []
    for request_id, (group, question) in enumerate(pairs):
        question_seed = num_groups + group * prompts_per_group + question
        segments = (Segment(group, system_prompt_tokens), Segment(question_seed, question_tokens))
        requests.append(
            WorkloadRequest(
                request_id,
                next(arrivals),
                system_prompt_tokens + question_tokens,
                output_tokens,
                segments,
            )
        )
    return requests


def multi_turn(
    rng: Random,
    session_starts: Iterator[float],
    num_sessions: int,
    turns_per_session: int,
    system_prompt_tokens: int,
    mean_user_tokens: float,
    mean_output_tokens: float,
    think_time_s: float,
) -> list[WorkloadRequest]:
    """Sessions of ``turns_per_session`` turns, each resending the whole history."""
    if num_sessions <= 0 or turns_per_session <= 0:
        raise ValueError("num_sessions and turns_per_session must be positive")
    if think_time_s < 0:
        raise ValueError("think_time_s must be >= 0")
    system = Segment(0, system_prompt_tokens)
    seeds = itertools.count(1)
    turns: list[tuple[float, int, int, int, tuple[Segment, ...]]] = []
    for session in range(num_sessions):
        arrival_s = next(session_starts)
        history: tuple[Segment, ...] = (system,)
        for turn in range(turns_per_session):
            user = lognormal_tokens(rng, mean_user_tokens, INPUT_SIGMA, None)
            output = lognormal_tokens(rng, mean_output_tokens, OUTPUT_SIGMA, None)
            history = (*history, Segment(next(seeds), user))
            turns.append((arrival_s, session, turn, output, history))
            history = (*history, Segment(next(seeds), output))
            if think_time_s > 0:
                arrival_s += rng.expovariate(1.0 / think_time_s)
    turns.sort(key=lambda t: (t[0], t[1], t[2]))
    return [
        WorkloadRequest(
            request_id,
            arrival_s,
            sum(s.num_tokens for s in segments),
            output,
            segments,
            session_id=f"session-{session}",
            turn_index=turn,
        )
        for request_id, (arrival_s, session, turn, output, segments) in enumerate(turns)
    ]


SyntheticName = Literal["mix", "shared-prefix", "multi-turn"]
SYNTHETIC_WORKLOADS: tuple[SyntheticName, ...] = ("mix", "shared-prefix", "multi-turn")


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """A named synthetic workload and its shape, as the CLIs of bench and sim take it.

    ``max_prompt_tokens`` caps the mix; the group, session and length fields shape
    ``shared-prefix`` (system prompt + question) and ``multi-turn`` (system prompt + user
    turns of mean ``question_tokens``, replies of mean ``output_tokens``).
    """

    name: SyntheticName = "mix"
    max_prompt_tokens: int | None = None
    num_groups: int = 8
    prompts_per_group: int = 16
    sessions: int = 16
    turns: int = 4
    system_tokens: int = 2048
    question_tokens: int = 128
    output_tokens: int = 128
    think_time_s: float = 5.0

    def __post_init__(self) -> None:
        """A ValueError naming the flags when the workload would hold more requests than
        ``MAX_SYNTHETIC_REQUESTS``: every one is made before the first is sent."""
        sizes = {
            "shared-prefix": (
                "--groups x --prompts-per-group",
                self.num_groups * self.prompts_per_group,
            ),
            "multi-turn": ("--sessions x --turns", self.sessions * self.turns),
        }
        flags, count = sizes.get(self.name, ("", 0))
        if count > MAX_SYNTHETIC_REQUESTS:
            raise ValueError(
                f"{flags}: {count:,} requests, beyond the limit of {MAX_SYNTHETIC_REQUESTS:,}"
            )


def synthetic_workload(
    spec: SyntheticSpec, rng: Random, arrivals: Iterator[float]
) -> Iterator[WorkloadRequest]:
    """The requests of ``spec`` in arrival order: endless for the mix, finite otherwise.

    ``arrivals`` times each request (mix, shared-prefix) or each session's start.
    """
    if spec.name == "shared-prefix":
        return iter(
            shared_prefix(
                rng,
                arrivals,
                spec.num_groups,
                spec.prompts_per_group,
                spec.system_tokens,
                spec.question_tokens,
                spec.output_tokens,
            )
        )
    if spec.name == "multi-turn":
        return iter(
            multi_turn(
                rng,
                arrivals,
                spec.sessions,
                spec.turns,
                spec.system_tokens,
                spec.question_tokens,
                spec.output_tokens,
                spec.think_time_s,
            )
        )
    return scenario_mix(rng, arrivals, max_prompt_tokens=spec.max_prompt_tokens)
