"""``isocost policies``: the scheduling policies and plugin types, as tables or YAML."""

from __future__ import annotations

import typer

from isocost.cli._app import app, console


@app.command()
def policies(
    config: str | None = typer.Option(None, "--config", help="Scheduling YAML to check and add."),
    as_yaml: bool = typer.Option(False, "--yaml", help="Print the profiles as scheduling YAML."),
) -> None:
    """List the scheduling policies and the plugin types.

    A policy is a canned profile of plugins.
    """
    from rich.table import Table
    from rich.text import Text

    from isocost.files import read_text
    from isocost.scheduling.plugins import PLUGIN_TYPES
    from isocost.scheduling.policies import (
        BUILTIN_POLICIES,
        SchedulingConfig,
        config_to_yaml,
        parse_scheduling_yaml,
    )

    user = parse_scheduling_yaml(read_text(config), config) if config else SchedulingConfig()
    profiles = {**BUILTIN_POLICIES, **{p.name: p for p in user.policies}}
    if as_yaml:
        merged = SchedulingConfig(user.plugins, list(profiles.values()), user.routes)
        console.print(config_to_yaml(merged), end="", markup=False, highlight=False, soft_wrap=True)
        return
    table = Table(title="policies")
    table.add_column("policy", no_wrap=True)
    table.add_column("what, then its plugins")
    for p in profiles.values():
        plugins = [f"filters {', '.join(p.filters)}"] if p.filters else []
        if p.scorers:
            plugins.append("scorers " + ", ".join(f"{s.plugin} ({s.weight:g})" for s in p.scorers))
        plugins += [f"picker {p.picker}", *(["admission slo"] if p.admission.slo else [])]
        table.add_row(p.name, Text(f"{p.description}\n") + Text("; ".join(plugins), "dim"))
    console.print(table)
    types = Table(title="plugin types")
    for column in ("type", "kind", "what"):
        types.add_column(column)
    for entry in PLUGIN_TYPES.values():
        types.add_row(entry.type_name, entry.kind, entry.summary)
    console.print(types)
