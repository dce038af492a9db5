"""``isocost drill``: fault drills against a running gateway and its replicas.

Talks HTTP only (the gateway's admin API, each engine's ``/admin/fault``, and the load
generator's requests), so the same drill runs against a staging cluster.
"""

from isocost.drill._drill import FAULTS, DrillError, DrillOptions, DrillReport, Fault, run_drill
from isocost.drill._report import drill_command, drill_table

__all__ = [
    "FAULTS",
    "DrillError",
    "DrillOptions",
    "DrillReport",
    "Fault",
    "drill_command",
    "drill_table",
    "run_drill",
]
