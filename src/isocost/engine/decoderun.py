"""Decode runs in closed form: the steps of one fixed pure-decode batch, priced and
counted without stepping them.

With a fixed batch of ``B`` the total context grows by ``B`` a step, so a step costs
``max(F + f*C, M + m*C) + K`` (``CostModel.decode_lines``) and ``k`` steps cost two
arithmetic series: the end of step ``k`` is O(1), the number of steps ending by ``t`` a
short search on it, and the blocks taken in ``k`` steps O(1) from a histogram of each
request's free slots in its last block.

This is arithmetic on a run, apart from the scheduler: ``isocost.engine.model`` decides
when a run follows (every running request decodes and no one can be admitted) and
applies the steps it counts.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from itertools import accumulate

from isocost.core.costmodel import CostModel, DecodeLines

__all__ = ["DecodeRun", "decode_run"]


def decode_run(
    start_s: float,
    context_tokens: int,
    token_steps: int,
    rooms: list[int],
    free_blocks: int,
    lines: DecodeLines,
    slowdown: float,
    cost: CostModel,
) -> DecodeRun | None:
    """The run of ``lines.batch_size`` decodes from ``start_s`` at ``context_tokens``
    total context, as long as the free blocks allow and at most ``token_steps`` steps (the
    last before a request's last token); None when not one step's blocks are free.

    ``rooms[r]`` counts the requests with ``r`` free slots in their last block
    (``len(rooms)`` is the block size).
    """
    batch_size = lines.batch_size
    block_size = len(rooms)
    below = tuple(accumulate(rooms[:-1], initial=0))
    # the most steps whose blocks fit: q full rounds of one block each, then p steps
    rounds = free_blocks // batch_size
    block_steps = rounds * block_size + bisect_right(below, free_blocks - rounds * batch_size) - 1
    if block_steps < 1:
        return None
    return DecodeRun(
        start_s,
        context_tokens,
        min(token_steps, block_steps),
        lines,
        slowdown,
        below,
        cost if block_steps > token_steps else None,
    )


class DecodeRun:
    """The run of identical pure-decode steps that starts at ``start_s``: step ``k`` of
    it (from 1) ends at ``end_s(k)``; at most ``max_steps`` steps, the last one before a
    request's last token or a step that would lack a block.

    Mutable and private to one model: ``advance`` moves its start past the steps applied,
    in O(1), so that its times are always the closed form's from its latest start.
    """

    __slots__ = (
        "_below",
        "_closing_cost",
        "_closing_s",
        "_last_end_s",
        "_quiet_end_s",
        "_series",
        "_skipped",
        "_taken",
        "context_tokens",
        "lines",
        "max_steps",
        "slowdown",
        "start_s",
    )

    def __init__(
        self,
        start_s: float,
        context_tokens: int,
        max_steps: int,
        lines: DecodeLines,
        slowdown: float,
        below: tuple[int, ...],
        closing_cost: CostModel | None,
    ) -> None:
        self.start_s = start_s
        self.context_tokens = context_tokens
        self.max_steps = max_steps
        self.lines = lines
        self.slowdown = slowdown
        # [p]: requests with fewer than p free slots in their last block at the first step
        # (of the run as found, before any ``advance``; ``_skipped`` steps ago)
        self._below = below
        self._skipped = self._taken = 0  # steps advanced past, blocks they took
        self._series = lines.series(context_tokens)
        # prices the step after the run when that step surely starts (None: it may not)
        self._closing_cost = closing_cost
        self._closing_s: float | None = None  # its price, the same after any ``advance``
        self._last_end_s: float | None = None
        self._quiet_end_s: float | None = None

    def end_s(self, steps: int) -> float:
        return self.start_s + self._series.time_s(steps) * self.slowdown

    @property
    def last_end_s(self) -> float:
        """``end_s(max_steps)``, computed once."""
        end = self._last_end_s
        if end is None:
            end = self._last_end_s = self.end_s(self.max_steps)
        return end

    @property
    def closes(self) -> bool:
        """Whether the step after the run surely starts as the same batch's decode (no
        preemption, no admission): the run ends a token before a request's last."""
        return self._closing_cost is not None

    @property
    def quiet_end_s(self) -> float:
        """Where the model's next event may be: the end of the step after the run when
        it is the step in which a request emits its last token and nothing else can
        happen (enough blocks, no admission), else the end of the run. Computed once."""
        end = self._quiet_end_s
        if end is None:
            end = self.last_end_s
            cost = self._closing_cost
            if cost is not None:
                closing = self._closing_s
                if closing is None:
                    batch = self.lines.batch_size
                    context = self.context_tokens + self.max_steps * batch
                    closing = cost.step_time_s(0, 0, batch, context) * self.slowdown
                    self._closing_s = closing
                end += closing
            self._quiet_end_s = end
        return end

    def new_blocks(self, steps: int) -> int:
        """Blocks the batch takes in its next ``steps`` steps: those it takes in its
        first ``_skipped + steps`` steps as found, less those already taken. In the run as
        found, a request with ``r`` free slots takes one at step ``r + 1``, then one every
        ``block_size`` steps."""
        below = self._below
        rounds, rest = divmod(self._skipped + steps, len(below))
        return rounds * self.lines.batch_size + below[rest] - self._taken

    def advance(self, steps: int, end_s: float) -> bool:
        """Start the run after its first ``steps`` steps, which end at ``end_s``; False
        when none is left."""
        if steps >= self.max_steps:
            return False
        self.start_s = end_s
        self.context_tokens += steps * self.lines.batch_size
        self.max_steps -= steps
        self._taken += self.new_blocks(steps)
        self._skipped += steps
        self._series = self.lines.series(self.context_tokens)
        self._last_end_s = self._quiet_end_s = None
        return True

    def steps_by(self, t: float) -> tuple[int, float, float]:
        """``(k, end_s(k), end_s(k + 1))`` for the most steps ``k`` (<= ``max_steps``)
        that end by ``t`` (``t >= start_s``); the last is inf when ``k == max_steps``.

        ``end_s`` grows with ``k``, nearly in a straight line (steps of one batch cost
        almost the same), so the search interpolates between two steps that bracket
        ``t``: the first guess is usually the answer or one off, and bisection takes over
        should interpolation be slow. The answer is exact for the closed form.
        """
        start, slowdown, time_s = self.start_s, self.slowdown, self._series.time_s
        if t <= start:
            return 0, start, start + time_s(1) * slowdown
        last, end_last = self.max_steps, self.last_end_s
        if end_last <= t:
            return last, end_last, math.inf
        low, end_low, high, end_high = 0, start, last, end_last
        tries = 0
        while high - low > 1:  # end_s(low) <= t < end_s(high)
            if tries < 3:
                guess = low + int((t - end_low) / (end_high - end_low) * (high - low))
                guess = low + 1 if guess <= low else high - 1 if guess >= high else guess
            else:
                guess = (low + high) // 2
            tries += 1
            end_guess = start + time_s(guess) * slowdown
            if end_guess <= t:
                low, end_low = guess, end_guess
            else:
                high, end_high = guess, end_guess
        return low, end_low, end_high
