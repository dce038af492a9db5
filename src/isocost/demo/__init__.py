"""``isocost demo``: a heterogeneous local cluster, round-robin vs equal-cost, side by side;
with ``--discovery etcd``, replicas joining and leaving through etcd while traffic runs.

A CLI-level module: it starts ``isocost engine`` and ``isocost serve`` as child processes
and drives them with the load generator (``isocost.bench``), so it sits above both.
"""

from isocost.demo._cluster import DEFAULT_LAYOUT, DemoReplica
from isocost.demo._discovery import DiscoveryDemoOptions, run_discovery_demo
from isocost.demo._main import DEFAULT_POLICIES, DemoInterrupted, DemoOptions, run_demo

__all__ = [
    "DEFAULT_LAYOUT",
    "DEFAULT_POLICIES",
    "DemoInterrupted",
    "DemoOptions",
    "DemoReplica",
    "DiscoveryDemoOptions",
    "run_demo",
    "run_discovery_demo",
]
