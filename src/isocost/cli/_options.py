"""Options and helpers that several subcommands share, declared once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, TypeVar

import typer

from isocost.cli._app import fail
from isocost.core.bounds import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Bounds
from isocost.workload import SYNTHETIC_WORKLOADS, SyntheticSpec

_Number = TypeVar("_Number", int, float)


def checked(bounds: Bounds) -> Callable[[typer.CallbackParam, _Number | None], _Number | None]:
    """An option callback that passes a number within ``bounds`` on and refuses any other
    (NaN and inf included) in one line, while the command line is read: every numeric
    flag gets the same check and the same wording."""

    def check(param: typer.CallbackParam, value: _Number | None) -> _Number | None:
        if value is not None and (problem := bounds.problem(value)) is not None:
            shown = f"{value:g}" if isinstance(value, float) else value
            fail(f"{param.opts[0]} {shown}: {problem}")
        return value

    return check


TraceOption = Annotated[str | None, typer.Option("--trace", help="Trace file to replay.")]
TraceFormatOption = Annotated[
    str | None,
    typer.Option("--trace-format", help="mooncake|azure|burstgpt|lengths (default: detected)."),
]
WorkloadOption = Annotated[
    str | None, typer.Option("--workload", help="mix|shared-prefix|multi-turn.")
]
SpeedupOption = Annotated[
    float,
    typer.Option(
        "--speedup", callback=checked(POSITIVE), help="Compress trace time by this factor."
    ),
]
# The synthetic workloads' shape, in bench and sim alike (isocost.workload.SyntheticSpec).
_COUNT = checked(AT_LEAST_ONE)
GroupsOption = Annotated[
    int, typer.Option("--groups", callback=_COUNT, help="shared-prefix: groups.")
]
PromptsPerGroupOption = Annotated[
    int, typer.Option("--prompts-per-group", callback=_COUNT, help="shared-prefix.")
]
SessionsOption = Annotated[
    int, typer.Option("--sessions", callback=_COUNT, help="multi-turn: sessions.")
]
TurnsOption = Annotated[
    int, typer.Option("--turns", callback=_COUNT, help="multi-turn: turns per session.")
]
SystemTokensOption = Annotated[
    int, typer.Option("--system-tokens", callback=_COUNT, help="Shared system prompt.")
]
QuestionTokensOption = Annotated[
    int, typer.Option("--question-tokens", callback=_COUNT, help="Question/user turn.")
]
OutputTokensOption = Annotated[
    int,
    typer.Option(
        "--output-tokens", callback=_COUNT, help="shared-prefix, multi-turn: output length."
    ),
]
MaxPromptTokensOption = Annotated[
    int | None,
    typer.Option("--max-prompt-tokens", callback=_COUNT, help="mix: cap prompt lengths."),
]
CatalogOption = Annotated[list[str] | None, typer.Option("--catalog", help="Extra catalog YAML.")]


def _log_level(value: str) -> str:
    from isocost.runtime.logs import check_log_level

    return check_log_level(value)


# Checked as the command line is read, before a server's slow start-up.
LogLevelOption = Annotated[
    str, typer.Option("--log-level", callback=_log_level, help="debug|info|warning|error")
]
# The SLO that goodput and capacity at SLO count against (isocost.core.slo), in sim, bench
# and demo alike.
# bench measures any endpoint and may be given no target at all (its Optional variants).
_SLO_TTFT = typer.Option("--slo-ttft-ms", callback=checked(POSITIVE), help="TTFT target (goodput).")
_SLO_TPOT = typer.Option("--slo-tpot-ms", callback=checked(POSITIVE), help="TPOT target (goodput).")
SloTtftOption = Annotated[float, _SLO_TTFT]
SloTpotOption = Annotated[float, _SLO_TPOT]
OptionalSloTtftOption = Annotated[float | None, _SLO_TTFT]
OptionalSloTpotOption = Annotated[float | None, _SLO_TPOT]
SloTtftPer1kOption = Annotated[
    float,
    typer.Option(
        "--slo-ttft-per-1k-ms",
        callback=checked(NON_NEGATIVE),
        help="Added to the TTFT target per 1,000 prompt tokens.",
    ),
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


def policy_names(text: str) -> tuple[str, ...]:
    """The comma-separated ``--policies``, in order: at least one, none named twice (a
    second run of the same policy only doubles the time)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        fail(f"--policies {text!r}: name at least one policy")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        fail(f"--policies {text}: {', '.join(twice)} named more than once")
    return names


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
    try:
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
    except ValueError as exc:
        fail(str(exc))
