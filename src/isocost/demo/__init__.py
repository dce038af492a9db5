"""``isocost demo``: a heterogeneous local cluster, round-robin vs equal-cost, side by side.

A CLI-level module: it starts ``isocost engine`` and ``isocost serve`` as child processes
and drives them with the load generator (``isocost.bench``), so it sits above both.
"""

from isocost.demo._cluster import DEFAULT_LAYOUT, DemoReplica
from isocost.demo._main import DEFAULT_POLICIES, DemoInterrupted, DemoOptions, run_demo
from isocost.demo._processes import DemoError

__all__ = [
    "DEFAULT_LAYOUT",
    "DEFAULT_POLICIES",
    "DemoError",
    "DemoInterrupted",
    "DemoOptions",
    "DemoReplica",
    "run_demo",
]
