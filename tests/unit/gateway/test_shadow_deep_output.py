"""The shadow replay's output read back nested deeper than msgspec follows: a failed
replay (``ReplayFailed``), like any other unreadable output, not a RecursionError that
ends the shadow's task."""

from __future__ import annotations

import asyncio
import sys

import pytest
from test_shadow_policies import MODEL, _fleet, _line

from isocost.gateway.shadow import ReplayFailed, run_replay

# a stand-in simulator: writes its --json output nested 100,000 deep, in a list of
# objects (the output's type), under a key, where the decoder recurses
WRITES_DEEP = (
    sys.executable,
    "-c",
    "import sys; a = sys.argv; "
    "open(a[a.index('--json') + 1], 'w').write('[{\"deep\": ' + '[' * 100_000)",
)


def test_a_deep_replay_output_is_a_failed_replay() -> None:
    replay = run_replay([_line(0)], _fleet(), MODEL, ["round_robin"], 30.0, command=WRITES_DEEP)
    with pytest.raises(ReplayFailed, match="unreadable replay output: maximum recursion depth"):
        asyncio.run(replay)
