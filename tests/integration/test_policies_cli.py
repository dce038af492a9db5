"""`isocost policies`: lists profiles and plugin types, checks a user YAML, exits 2 on bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from isocost.scheduling.plugins import PLUGIN_TYPES
from isocost.scheduling.policies import BUILTIN_POLICIES, SLO_BASELINES, parse_scheduling_yaml

ISOCOST = Path(sys.executable).with_name("isocost")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ISOCOST), "policies", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "250", "PATH": "/usr/bin:/bin"},
    )


def test_lists_every_policy_and_plugin_type() -> None:
    result = _run()
    assert result.returncode == 0, result.stderr
    for name in [*BUILTIN_POLICIES, *PLUGIN_TYPES]:
        assert name in result.stdout


def test_each_peer_is_listed_with_its_slo_twin() -> None:
    table, as_yaml = _run(), _run("--yaml")
    assert table.returncode == 0 and as_yaml.returncode == 0, table.stderr + as_yaml.stderr
    listed = {p.name: p for p in parse_scheduling_yaml(as_yaml.stdout, "stdout").policies}
    assert SLO_BASELINES and set(SLO_BASELINES) <= set(listed)
    for twin in SLO_BASELINES:
        assert twin in table.stdout and listed[twin].admission.slo
        assert listed[twin].scorers == listed[twin.removesuffix("_slo")].scorers
    assert "llmd_default_slo" in SLO_BASELINES and "SLO admission" in table.stdout


def test_yaml_output_includes_user_policies_and_parses_back(tmp_path: Path) -> None:
    config = tmp_path / "sched.yaml"
    config.write_text(
        "plugins:\n  - {name: soft, type: equal-cost-scorer, parameters: {lambda_delay: 0.3}}\n"
        "policies:\n  - {name: soft_cost, scorers: [{plugin: soft}]}\n"
    )
    result = _run("--config", str(config), "--yaml")
    assert result.returncode == 0, result.stderr
    parsed = parse_scheduling_yaml(result.stdout, "stdout")
    assert [p.name for p in parsed.policies] == [*BUILTIN_POLICIES, "soft_cost"]
    assert parsed.plugins[0].parameters == {"lambda_delay": 0.3}


def test_bad_config_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("policies:\n  - {name: p, picker: nearest-picker}\n")
    result = _run("--config", str(config))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "policies[0].picker" in lines[0] and "max-score-picker" in lines[0]
    assert "Traceback" not in result.stderr
