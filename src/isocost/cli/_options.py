"""Options and helpers that several subcommands share, declared once."""

from __future__ import annotations

from typing import Annotated, TypeVar

import typer

from isocost.cli._app import fail
from isocost.workload import SYNTHETIC_WORKLOADS, SyntheticSpec

TraceOption = Annotated[str | None, typer.Option("--trace", help="Trace file to replay.")]
TraceFormatOption = Annotated[
    str | None,
    typer.Option("--trace-format", help="mooncake|azure|burstgpt|lengths (default: detected)."),
]
WorkloadOption = Annotated[
    str | None, typer.Option("--workload", help="mix|shared-prefix|multi-turn.")
]
SpeedupOption = Annotated[
    float, typer.Option("--speedup", help="Compress trace time by this factor.")
]
GroupsOption = Annotated[int, typer.Option("--groups", help="shared-prefix: groups.")]
PromptsPerGroupOption = Annotated[int, typer.Option("--prompts-per-group", help="shared-prefix.")]
SessionsOption = Annotated[int, typer.Option("--sessions", help="multi-turn: sessions.")]
TurnsOption = Annotated[int, typer.Option("--turns", help="multi-turn: turns per session.")]
SystemTokensOption = Annotated[int, typer.Option("--system-tokens", help="Shared system prompt.")]
QuestionTokensOption = Annotated[int, typer.Option("--question-tokens", help="Question/user turn.")]
MaxPromptTokensOption = Annotated[
    int | None, typer.Option("--max-prompt-tokens", help="mix: cap prompt lengths.")
]
CatalogOption = Annotated[list[str] | None, typer.Option("--catalog", help="Extra catalog YAML.")]
# The SLO that goodput and capacity at SLO count against (isocost.core.slo), in sim, bench
# and demo alike.
# bench measures any endpoint and may be given no target at all (its Optional variants).
_SLO_TTFT = typer.Option("--slo-ttft-ms", help="TTFT target (goodput).")
_SLO_TPOT = typer.Option("--slo-tpot-ms", help="TPOT target (goodput).")
SloTtftOption = Annotated[float, _SLO_TTFT]
SloTpotOption = Annotated[float, _SLO_TPOT]
OptionalSloTtftOption = Annotated[float | None, _SLO_TTFT]
OptionalSloTpotOption = Annotated[float | None, _SLO_TPOT]
SloTtftPer1kOption = Annotated[
    float,
    typer.Option("--slo-ttft-per-1k-ms", help="Added to the TTFT target per 1,000 prompt tokens."),
]


_Choice = TypeVar("_Choice", bound=str)


def one_of(flag: str, value: str | None, valid: tuple[_Choice, ...]) -> _Choice | None:
    """``value`` as one of ``valid`` (None stays None); one line and exit 2 otherwise."""
    if value is None:
        return None
    for option in valid:
        if value == option:
            return option
    fail(f"unknown {flag} {value!r}; valid: {', '.join(valid)}")


def synthetic_workload(
    workload: str | None,
    max_prompt_tokens: int | None,
    groups: int,
    prompts_per_group: int,
    sessions: int,
    turns: int,
    system_tokens: int,
    question_tokens: int,
    output_tokens: int,
    think_time_s: float = 5.0,
) -> SyntheticSpec | None:
    """The synthetic workload ``--workload`` names, shaped by its options (bench and sim
    share them); None when no workload is named (a trace is replayed)."""
    name = one_of("workload", workload, SYNTHETIC_WORKLOADS)
    if name is None:
        return None
    return SyntheticSpec(
        name,
        max_prompt_tokens=max_prompt_tokens,
        num_groups=groups,
        prompts_per_group=prompts_per_group,
        sessions=sessions,
        turns=turns,
        system_tokens=system_tokens,
        question_tokens=question_tokens,
        output_tokens=output_tokens,
        think_time_s=think_time_s,
    )
