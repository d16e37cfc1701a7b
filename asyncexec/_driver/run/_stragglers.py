"""Stragglers: the rank an aligned run waits for.

A run of aligned steps goes as fast as its slowest rank. Every report carries how long its rank's
function ran for that step (``Step.durations``: the rank's own progress, on its own clock,
without the time ``report()`` waited for credit, so that a rank held back by a slower one still
shows its own speed). :class:`StragglerWatch` reads them in windows of ``straggler_steps`` steps:
a rank whose shortest step in a window took more than ``straggler_factor`` times the typical
rank's shortest (the lower median over the ranks), and at least :data:`MIN_LAG_S` more, was
slower than the others in every step of the window: a straggler. Each one is logged
(``straggler``: rank, node, pid, its and the typical step time, their ratio, and its threads'
stacks, read from outside as a hang's are, when they can be read), counted in the metrics, and
logged again only after a window in which it was not slow.

Fast steps come to the watch in batches of many windows (up to 256 steps): of those, the last
whole window of each batch is judged, so a rank that stays slow is named within a batch, and the
watch costs a pass over the ranks per batch, not per window.

The shortest step, not the mean: a rank that paused once (a collection, a checkpoint) is not
slow; one that is slow in every step of the window is. Watching costs a pass over the ranks
per window and a sort, in C (``map``), and nothing per report.

Ranks that wait for one another inside a collective (``all_reduce``) all spend the collective's
time, so their step times are alike and no straggler shows: there, time what a rank does before
the collective and report it.
"""

from __future__ import annotations

import math
from array import array
from typing import NamedTuple

import anyio

from ..._errors import short_node
from .._config import ExecutorConfig
from .._events import StragglerFound
from .._observe import Observer
from ..cluster import NOT_TAKEN
from ..group import WorkerGroup
from ._steps import StepTimes

__all__ = ["MIN_LAG_S", "Straggler", "StragglerWatch"]

#: A straggler's shortest step is at least this much longer than the typical rank's: below it,
#: the difference is the machine's noise (a thread scheduled late), not a slow rank.
MIN_LAG_S = 0.001


class Straggler(NamedTuple):
    """A rank found slower than the others in every step of a window."""

    rank: int
    step: int  # the window's last step (its index in the run's stream)
    step_s: float  # the rank's shortest step in the window
    typical_s: float  # the typical rank's shortest step (the lower median over the ranks)

    @property
    def factor(self) -> float:
        return self.step_s / self.typical_s if self.typical_s > 0 else math.inf


class StragglerWatch:
    """Finds one attempt's stragglers in the steps handed over, and reports them (see the
    module's docstring)."""

    def __init__(self, num_ranks: int, factor: float, steps: int) -> None:
        self.num_ranks = num_ranks
        self.factor = factor
        self.steps = steps
        #: Each rank's shortest step in the window so far.
        self._shortest = [math.inf] * num_ranks
        self._filled = 0  # steps of the window seen so far
        self._slow: set[int] = set()  # the ranks found slow in the last window
        self._found: list[Straggler] = []  # not reported yet
        self._wake = anyio.Event()

    @classmethod
    def of(cls, config: ExecutorConfig, num_ranks: int) -> StragglerWatch | None:
        """The watch ``config`` asks for over ``num_ranks`` ranks, or None (off, or one rank)."""
        factor = config.straggler_factor
        if factor is None or num_ranks < 2:
            return None
        return cls(num_ranks, factor, config.straggler_steps)

    def observe(self, first: int, times: StepTimes) -> None:
        """Take the step times of a batch of steps from stream index ``first`` on: the window
        in progress is completed and judged, and of the whole windows in the batch the last."""
        n, busy, w = times.steps, times.busy, self.steps
        ranks = range(0, len(times.offsets) * n, n)  # where each rank's times start
        start = 0
        if self._filled:  # the window begun in an earlier batch
            start = min(n, w - self._filled)
            self._take(busy, ranks, 0, start)
            if self._filled == w:
                self._end(first + start - 1)
        whole = (n - start) // w
        if whole:
            # Of the whole windows in the batch, the last is judged (fast steps come in batches
            # of many windows: one a batch is enough to name a rank that stays slow, and costs
            # one pass in C over the ranks, a rank's times being contiguous).
            last = start + (whole - 1) * w
            cuts = [slice(r + last, r + last + w) for r in ranks]
            self._shortest = list(map(min, map(busy.__getitem__, cuts)))
            self._end(first + last + w - 1)
            start += whole * w
        if start < n:
            self._take(busy, ranks, start, n)

    def _take(self, busy: array[float], ranks: range, start: int, stop: int) -> None:
        """Steps ``start .. stop - 1`` of a batch join the window in progress."""
        part = map(min, map(busy.__getitem__, [slice(r + start, r + stop) for r in ranks]))
        self._shortest = list(map(min, self._shortest, part))
        self._filled += stop - start

    def _end(self, step: int) -> None:
        """The window ends at ``step``: judge it, and start the next."""
        self._judge(step)
        self._shortest = [math.inf] * self.num_ranks
        self._filled = 0

    def _judge(self, step: int) -> None:
        """Find the ranks slow in the window that ended at ``step``."""
        shortest = self._shortest
        low, high = min(shortest), max(shortest)
        if low == low and high < math.inf and high <= max(low * self.factor, low + MIN_LAG_S):
            self._slow = set()  # every rank known and none slow, whatever the typical one: the
            return  # common case, two passes in C
        known = sorted(s for s in shortest if s < math.inf)  # a rank's times may be unknown
        if len(known) < 2:
            return
        typical = known[(len(known) - 1) // 2]
        threshold = max(typical * self.factor, typical + MIN_LAG_S)
        if known[-1] <= threshold:  # nobody slow: the common case, no pass in Python
            self._slow = set()
            return
        slow = {rank for rank, s in enumerate(shortest) if threshold < s < math.inf}
        new = sorted(slow - self._slow)
        self._slow = slow
        for rank in new:
            self._found.append(Straggler(rank, step, shortest[rank], typical))
        if new:
            self._wake.set()

    async def serve(self, group: WorkerGroup, observer: Observer) -> None:
        """Report the stragglers as they are found (one read of their stacks for those found
        together); runs until cancelled."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            found, self._found = self._found, []
            stacks: dict[int, str] = {}
            try:
                stacks = await group.cluster.stacks(
                    [(s.rank, w.handle, w.metadata) for s in found for w in [group.workers[s.rank]]]
                )
            finally:  # each is emitted, with or without its stack (the attempt may end now)
                for straggler in found:
                    observer.emit(_found(group, straggler, self.steps, stacks.get(straggler.rank)))


def _found(
    group: WorkerGroup, straggler: Straggler, steps: int, stack: str | None
) -> StragglerFound:
    worker = group.workers[straggler.rank]
    return StragglerFound(
        straggler.rank,
        short_node(worker.metadata.node_id),
        worker.metadata.pid,
        group.attempt,
        straggler.step,
        steps,
        straggler.step_s,
        straggler.typical_s,
        straggler.factor,
        None if stack is None or stack.startswith(NOT_TAKEN) else stack,
    )
