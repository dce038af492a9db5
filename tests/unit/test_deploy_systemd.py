"""deploy/systemd checked offline (no systemd runs here): each unit's ExecStart, with its
example environment file, is an isocost command that takes every flag given, the example
config is one the gateway accepts, reload is SIGHUP, stop is SIGTERM, and systemd waits
past the drain the command is given before it SIGKILLs."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer

from isocost.cli import app
from isocost.runtime.config import parse_config

SYSTEMD = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
DRAIN_FLAGS = {"serve": "--shutdown-timeout", "agent": "--drain-timeout"}
PORT = "8000"  # the instance of a templated unit


def _service(name: str) -> dict[str, str]:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys keep their case
    parser.read_string((SYSTEMD / name).read_text())
    return dict(parser["Service"])


def _environment(service: dict[str, str]) -> dict[str, str]:
    """The variables of the unit's EnvironmentFile, from its example here (``%i``: 8000)."""
    path = Path(service["EnvironmentFile"].lstrip("-").replace("%i", PORT))
    variables = {}
    for line in (SYSTEMD / path.name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            variables[name] = value
    return variables


def _command(service: dict[str, str]) -> tuple[Any, list[str]]:
    """The isocost subcommand ExecStart runs and its arguments, as systemd gives them:
    ``%i`` the instance, an unbraced ``$VAR`` the variable split on spaces."""
    argv = []
    for word in shlex.split(service["ExecStart"].replace("%i", PORT)):
        if word.startswith("$"):
            argv += _environment(service)[word[1:]].split()
        else:
            argv.append(word)
    assert Path(argv[0]).name == "isocost", argv
    command = typer.main.get_command(app).commands[argv[1]]  # type: ignore[attr-defined]
    return command, argv[2:]


@pytest.mark.parametrize("unit", ["isocost-gateway.service", "isocost-agent@.service"])
def test_exec_start_parses_as_the_command_it_names(unit: str) -> None:
    command, args = _command(_service(unit))
    context = command.make_context(command.name, args, resilient_parsing=False)
    assert context.params  # every flag known, every value of its type


@pytest.mark.parametrize("unit", ["isocost-gateway.service", "isocost-agent@.service"])
def test_systemd_waits_past_the_drain_before_it_kills(unit: str) -> None:
    service = _service(unit)
    command, args = _command(service)
    assert command.name is not None and service["KillSignal"] == "SIGTERM"
    flag = DRAIN_FLAGS[command.name]
    drain_s = float(args[args.index(flag) + 1])
    assert float(service["TimeoutStopSec"]) > drain_s


def test_reload_is_sighup_to_the_gateway() -> None:
    assert _service("isocost-gateway.service")["ExecReload"] == "/bin/kill -HUP $MAINPID"


def test_the_example_config_is_one_the_gateway_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    gateway = _service("isocost-gateway.service")
    for name, value in _environment(gateway).items():
        monkeypatch.setenv(name, value)
    _, args = _command(gateway)
    assert Path(args[args.index("--config") + 1]).name == "gateway.yaml"
    config = parse_config((SYSTEMD / "gateway.yaml").read_text(), "gateway.yaml")
    assert config.discovery.etcd is not None
    assert config.auth.admin_token_env == "ISOCOST_ADMIN_TOKEN"
