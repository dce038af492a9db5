"""Every table the CLI prints, and its help, fit 80 columns (a small terminal, or a pipe)
with the policy names in full: nothing a reader needs is cut to "…"."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import typer
from rich.console import Console, RenderableType
from typer.testing import CliRunner

from isocost import cli
from isocost.bench import BenchResult
from isocost.bench._records import BenchSummary
from isocost.bench._report import compare_table, live_table, summary_table
from isocost.bench._runner import BenchProgress
from isocost.cli import _policies, planview
from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.core.planner import PlanRequest, plan, plan_disaggregation
from isocost.demo._cluster import DEFAULT_LAYOUT
from isocost.demo._report import replica_table
from isocost.drill._drill import DrillReport
from isocost.drill._report import drill_table
from isocost.scheduling.policies import BUILTIN_POLICIES
from isocost.sim._audit import AdmissionAudit, audit_table
from isocost.sim._capacity import CapacityResult, CapacitySpec, CapacityStatus, Probe
from isocost.sim._metrics import DisaggSummary, PolicySummary
from isocost.sim._report import disagg_table, print_capacity, print_results
from isocost.sim._run import CapacityOutput, RunOutput, SweepOutput

WIDTH = 80
POLICIES = ("equal_cost", "round_robin", "sglang_cache_aware", "llmd_default")


def _printed(draw: Callable[[Console], None], width: int = WIDTH) -> str:
    out = io.StringIO()
    draw(Console(file=out, width=width, color_system=None, legacy_windows=False))
    return out.getvalue()


def _assert_fits(text: str, names: tuple[str, ...] = ()) -> None:
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= WIDTH, text
    assert "…" not in text, text
    for name in names:
        assert any(name in line for line in lines), f"{name} not in full:\n{text}"


def _policy_summary(policy: str, k: float = 1.0) -> PolicySummary:
    return PolicySummary(
        policy, 12_031, 11_832, 199, {"deadline": 199}, 0.74 * k, 3.1 * k, 11.67 * k,
        0.024, 0.117, 6.2, 25.0 * k, 3.30, 0.972, 1_448.0, 0.218, 0.017, 1.23, 12, 3.4, 3_540.0,
    )  # fmt: skip


def _run(policy: str, rate: float | None) -> RunOutput:
    return RunOutput(_policy_summary(policy), rate, np.zeros(1), [], [], [], 2.0, 100, 3_540.0)


@pytest.mark.parametrize("rates", [(None,), (2.0, 40.0)], ids=["one rate", "sweep"])
def test_the_sim_results_fit_and_keep_the_headline_figures(rates: tuple[float | None]) -> None:
    output = SweepOutput(
        [_run(policy, rate) for policy in POLICIES for rate in rates],
        _policy_summary("oracle"),
        dict.fromkeys(POLICIES, 40.0) if rates != (None,) else {},
    )
    text = _printed(lambda console: print_results(console, output, 0.9))
    _assert_fits(text, POLICIES)
    for header in ("done", "rej", "TTFT", "TPOT", "goodput", "SLO"):
        assert header in text
    assert "11.67s" in text and "--json" in text  # P99 TTFT stays; the rest is in --json
    if rates != (None,):
        assert "capacity at SLO" in text
    wide = _printed(lambda console: print_results(console, output, 0.9), width=250)
    assert "TTFT p50" in wide and "sim s/s" in wide and "--json" not in wide  # all of it


def test_the_capacity_table_fits_with_the_longest_policy_names() -> None:
    spec = CapacitySpec(0.5, 20.0, 0.05)
    shapes = {
        "sglang_cache_aware_slo": CapacityResult(
            CapacityStatus.BRACKETED, 12.3456, 12.9, (Probe(12.3456, 0.9123), Probe(12.9, 0.85))
        ),
        "equal_cost": CapacityResult(CapacityStatus.AT_LEAST_HIGH, 20.0, None, (Probe(20, 0.95),)),
        "round_robin_slo": CapacityResult(CapacityStatus.BELOW_LOW, None, 0.5, (Probe(0.5, 0.2),)),
    }
    output = CapacityOutput(shapes, {policy: [] for policy in shapes})
    text = _printed(lambda console: print_capacity(console, output, spec))
    _assert_fits(text, tuple(shapes))
    for cell in ("12.3 – 12.9", "≥ 20", "< 0.5", "- – 0.5", "<peer>_slo", "91.2", "≥ 1.62x"):
        assert cell in text, text


def _bench_summary(label: str) -> BenchSummary:
    return BenchSummary(
        label=label, url="http://127.0.0.1:8080", model="llama-3.1-8b", requests=380,
        completed=332, errors=48, errors_by_kind={"timeout": 40, "http_503": 8},
        completed_by_replica={replica.name: 40 for replica in DEFAULT_LAYOUT}, duration_s=125.3,
        throughput_rps=3.04, output_tokens_per_s=1_234.5, goodput_rps=2.04, slo_ttft_ms=2000,
        slo_tpot_ms=100, ttft_p50_s=0.3018, ttft_p90_s=3.9919, ttft_p99_s=27.645,
        tpot_p50_s=0.0443, tpot_p90_s=0.1536, tpot_p99_s=0.2635, itl_p50_s=0.04,
        itl_p90_s=0.15, itl_p99_s=0.26, e2e_p50_s=10.192, e2e_p90_s=34.6, e2e_p99_s=56.22,
        send_lag_p99_s=0.001, send_lag_max_s=0.02, ttft_samples_s=[], e2e_samples_s=[],
    )  # fmt: skip


def _plan_tables(console: Console) -> None:
    catalog = Catalog.builtin()
    request = PlanRequest(
        catalog.model("llama-3.1-70b"), catalog.gpu("a100-80g"), qps=5.0, ttft_slo_s=2.0
    )
    planview.print_tables(console, plan(request), explain=True)


def _plan_split(console: Console) -> None:
    catalog = Catalog.builtin()
    cost = CostModel(catalog.model("llama-3.1-70b"), catalog.gpu("a100-80g"), 4)
    split = plan_disaggregation(cost, 64, prompt_tokens=12_000, output_tokens=343)
    planview.print_disaggregation(console, split)


def _drill_report() -> DrillReport:
    return DrillReport(
        fault="kill", gateway="http://127.0.0.1:8080", targets=["a100-2", "l20-0"], rate_rps=8,
        injected_at_s=3.0, detected_after_s=0.52, drained_after_s=0.6, cleared_after_s=None,
        recovered_after_s=None, requests=160, completed=150, lost=3, streams_cut=7,
        streams_resumed=12, resumed_exact=12, errors_by_kind={"http_502": 3, "stream_cut": 7},
        in_window=80, share_before=0.25, share_during=0.02, max_factor_ratio=3.1,
    )  # fmt: skip


def _audited(policy: str) -> tuple[str, float, AdmissionAudit]:
    return (
        policy,
        40.0,
        AdmissionAudit(12_031, 12_345, 1_234, 1_234, 11_111, 23_456, 1_234.5, 12_345),
    )


SUMMARIES = [_bench_summary(policy) for policy in POLICIES]
RUNS = [BenchResult([], summary) for summary in SUMMARIES]
TABLES: dict[str, tuple[RenderableType | Callable[[Console], None], tuple[str, ...]]] = {
    "bench": (summary_table(SUMMARIES[0]), ("equal_cost",)),
    "bench live": (live_table(BenchProgress()), ()),
    "bench compare, 2 runs": (compare_table(SUMMARIES[:2]), POLICIES[:2]),
    "bench compare, 4 runs": (compare_table(SUMMARIES), POLICIES),
    "demo replicas, 2 policies": (replica_table(RUNS[:2], DEFAULT_LAYOUT), POLICIES[:2]),
    "demo replicas, 4 policies": (replica_table(RUNS, DEFAULT_LAYOUT), POLICIES),
    "drill": (drill_table(_drill_report()), ()),
    "plan --explain": (_plan_tables, ()),
    "plan --disaggregate": (_plan_split, ()),
    "sim disaggregation": (
        disagg_table(
            [(p, 12.5, DisaggSummary(0.734, 1.2345, 12.345, 12.3, 123.4)) for p in POLICIES]
        ),
        POLICIES,
    ),
    "sim admission audit": (audit_table([_audited(policy) for policy in POLICIES]), POLICIES),
}


@pytest.mark.parametrize("name", TABLES)
def test_the_reports_fit_80_columns_with_the_names_in_full(name: str) -> None:
    table, names = TABLES[name]
    draw = table if callable(table) else lambda console: console.print(table)
    _assert_fits(_printed(draw), names)


def test_the_two_policies_of_the_demo_stay_side_by_side() -> None:
    text = _printed(lambda console: console.print(replica_table(RUNS[:2], DEFAULT_LAYOUT)))
    assert any("equal_cost" in line and "round_robin" in line for line in text.splitlines())
    text = _printed(lambda console: console.print(compare_table(SUMMARIES[:2])))
    assert any("equal_cost" in line and "round_robin" in line for line in text.splitlines())


def test_isocost_policies_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(_policies, "console", Console(file=out, width=WIDTH, color_system=None))
    _policies.policies(config=None, as_yaml=False)
    _assert_fits(out.getvalue(), tuple(BUILTIN_POLICIES))


@pytest.mark.parametrize(
    "command", [[], ["engine"], ["serve"], ["picker"], ["agent"], ["plan"], ["policies"], ["demo"],
                ["drill"], ["sim"], ["autoscale"], ["bench"], ["bench", "compare"]],
    ids=" ".join,
)  # fmt: skip
def test_help_fits_80_columns(command: list[str]) -> None:
    done = CliRunner().invoke(cli.app, [*command, "--help"], env={"COLUMNS": str(WIDTH)})
    assert done.exit_code == 0, done.output
    lines = done.output.splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    assert not any(line.rstrip().endswith("...") for line in lines if "Usage:" not in line)
    # each option's help gets most of the width: its first 30 characters on one line
    click_command: Any = typer.main.get_command(cli.app)
    for name in command:
        click_command = click_command.commands[name]
    for param in click_command.params:
        help_text = getattr(param, "help", None)
        if help_text:
            assert any(help_text[:30] in line for line in lines), (help_text, done.output)
