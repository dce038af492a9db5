"""The ``isocost`` command: one Typer app, each subcommand a thin shell over a package.

Errors that isocost raises on purpose (unknown names, bad files, models that do not fit)
become one line on stderr and exit code 2, never a traceback.

``_app`` holds the app, its consoles and ``fail``; ``_options`` the options several
subcommands share and ``checked``, the range check of every numeric flag; ``_outputs`` the
check of every output path before a command starts; ``_listening`` a server's address
refused in one line; each subcommand has a module of its own (``_engine``, ``_serve``,
``_picker``, ``_agent``, ``_plan`` with ``planview`` for its tables, ``_profile``,
``_policies``, ``_demo``, ``_drill``, ``_sim``, ``_autoscale``, ``_bench``), imported here in
the order ``--help`` lists them.
"""

# Importing a subcommand's module registers it; --help lists them in this order.
from isocost.cli import _engine, _serve, _picker, _agent, _plan, _profile  # noqa: F401, I001
from isocost.cli import _policies, _demo, _drill, _sim, _autoscale, _bench  # noqa: F401
from isocost.cli._app import app, main

__all__ = ["app", "main"]
