"""The loop every long-running command serves on: engine, gateway, picker, agent.

uvloop where it is installed (it is not on Windows), and one event that SIGINT or SIGTERM
sets, so that each server stops the same way: it waits for the event, then drains.

SIGHUP's default would end the process on the spot, nothing drained (an agent's lease left
to expire, a gateway's streams cut). A server with a config file reloads it instead, as
nginx and HAProxy do (``hangup``); the others stop as for SIGTERM: the terminal they ran
in is gone.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["run_serving", "stop_requested"]


def run_serving(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` to its end on a fresh (uvloop) event loop."""
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # uvloop is not available on Windows
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main)


def stop_requested(hangup: Callable[[], None] | None = None) -> asyncio.Event:
    """An event of the running loop that SIGINT or SIGTERM sets, and SIGHUP unless
    ``hangup`` is given: then SIGHUP calls it (a reload) and the server goes on."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, hangup or stop.set)
    return stop
