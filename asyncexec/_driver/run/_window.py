"""The credit window, in one place: the pump that polls a rank while it has credit (both kinds of
run use it), the assembly of complete steps of an aligned run, and the hand-over of steps to the
run's iterator.

Each rank's reports arrive in batches, in order, through one long poll per rank. Step k of an
attempt is complete when every rank has delivered its k-th report. A rank may have at most
``buffer_size`` reports that the consumer has not taken: each poll asks for no more than the
rank's credit and carries how many steps the consumer has taken (the worker's ``report()`` waits
on that acknowledgement), so memory stays bounded however long the run.
"""

from __future__ import annotations

import contextlib
import math
import time
from array import array
from collections import deque
from collections.abc import Awaitable, Callable
from itertools import repeat
from operator import delitem, itemgetter, not_
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from ..._errors import AsyncExecError, ReportMismatchError, WorkerRaisedError
from ..._wire._checkpoint import Checkpoint, CheckpointBook
from ..._wire._protocol import Outcome, Poll, ReportTimes
from .._events import StepsQueued
from .._observe import Observer
from ..cluster import Caller, WorkerProxy, at_attempt, outcome_error, proxy
from ..group import WorkerGroup, WorkerInfo
from ._iterator import RunCore
from ._steps import StepBatch, StepTimes
from ._stragglers import StragglerWatch

__all__ = [
    "Assembly",
    "HandOver",
    "Window",
    "min_poll",
    "pump",
    "salvage",
    "versions_of",
]

#: The most steps assembled and handed over at once; bounds the time the event loop is held.
BATCH = 256
#: A rank's poll, ``submit(worker_calls, ack, room)`` (a name of the module's: the report
#: path's tests and benchmark stand in for it).
submit = WorkerProxy.poll
#: A rank is polled once its credit is this share of its window, not as soon as it has any: a
#: round trip costs the driver and the worker far more than the reports it carries, so a poll
#: should carry a large batch; the quarter of the
#: window not yet taken is what the consumer takes while the poll travels.
POLL_CREDIT_SHARE = 0.75
#: Once a rank has that share of its window, it is polled after the consumer has taken the rest
#: too, or after this many seconds, whichever comes first, when the rest is at least a batch of
#: steps (a large window, where throughput counts more than a poll's latency). A consumer that
#: keeps up takes its last batch in well under this, and the poll then carries the whole
#: window rather than three quarters of it. A
#: slower consumer's poll goes this much later, while it still has a quarter of the window to
#: take.
CONSUMER_LINGER_S = 0.0005


class Assembly:
    """One attempt's reports, per rank, until every rank has reported a step.

    What is asked of it after each poll costs the same whatever the number of ranks: it counts
    the ranks with nothing queued (a step is ready once none is left), the most reports a rank
    has sent, the fewest of a rank whose function returned, and the ranks that ended. Only a
    take touches every rank (once per batch of steps, not per poll)."""

    def __init__(self, num_ranks: int, attempt: int, index_offset: int) -> None:
        self.num_ranks = num_ranks
        self.attempt = attempt
        self.index_offset = index_offset
        self.queues: list[list[dict[str, Any]]] = [[] for _ in range(num_ranks)]
        self.checkpoints: list[dict[int, str]] = [{} for _ in range(num_ranks)]
        self.received = [0] * num_ranks
        self.outcomes: list[Outcome | None] = [None] * num_ranks
        self.last_report = [time.monotonic()] * num_ranks
        #: Per rank, when its queued reports were made and how long its function ran before
        #: each, on its worker's clock (see ``ReportTimes``), and the offset from that clock to
        #: the driver's, as its latest poll measured it.
        self.calls: list[array[float]] = [array("d") for _ in range(num_ranks)]
        self.busy: list[array[float]] = [array("d") for _ in range(num_ranks)]
        self.offsets = [0.0] * num_ranks
        #: Per rank, the weight versions its reports hold: (first sequence number, version).
        self.versions: list[list[tuple[int, int]]] | None = None
        self.assembled = 0
        self._changed = anyio.Event()
        self._empty = num_ranks  # ranks with nothing queued
        self._most = 0  # the most reports a rank has sent
        self._fewest_done: int | None = None  # the fewest reports of a rank that returned
        self._done: list[int] = []  # the ranks whose function returned
        self._ended = 0  # the ranks with an outcome
        self._pending_checkpoints = 0  # checkpoints not yet taken with their step

    def add(self, rank: int, poll: Poll) -> None:
        """Take one poll's answer from ``rank``."""
        reports = poll.reports
        if reports:
            queue = self.queues[rank]
            if not queue:
                self._empty -= 1
            queue.extend(reports)
            received = self.received[rank] = self.received[rank] + len(reports)
            if received > self._most:
                self._most = received
            now = self.last_report[rank] = time.monotonic()
            if poll.times is not None:
                sent = ReportTimes.unpack_into(poll.times, self.calls[rank], self.busy[rank])
                self.offsets[rank] = now - sent
            else:  # a worker that does not time its reports
                unknown = array("d", [math.nan]) * len(reports)
                self.calls[rank].extend(unknown)
                self.busy[rank].extend(unknown)
        if poll.checkpoints:
            self.checkpoints[rank].update(poll.checkpoints)
            self._pending_checkpoints += len(poll.checkpoints)
        outcome = poll.outcome
        if outcome is not None:
            if self.outcomes[rank] is None:
                self._ended += 1
                if outcome.kind == "ok":
                    self._done.append(rank)
                    n = self.received[rank]
                    if self._fewest_done is None or n < self._fewest_done:
                        self._fewest_done = n
            self.outcomes[rank] = outcome
        if poll.versions:
            if self.versions is None:
                self.versions = [[] for _ in range(self.num_ranks)]
            self.versions[rank].extend(poll.versions)
        self._changed.set()

    async def wait_changed(self) -> None:
        await self._changed.wait()
        self._changed = anyio.Event()

    def check(self) -> None:
        """Raise ReportMismatchError when ranks cannot reach the same number of reports: a rank
        that returned sent fewer than another rank has, or every rank returned and their counts
        differ."""
        fewest = self._fewest_done
        if fewest is None:
            return
        all_done = len(self._done) == self.num_ranks
        if self._most > fewest or (all_done and min(self.received) != self._most):
            raise ReportMismatchError(dict(enumerate(self.received)), sorted(self._done))

    @property
    def ready(self) -> int:
        """How many complete steps can be taken now."""
        if self._empty:
            return 0
        return min(map(len, self.queues))

    def take(self, limit: int) -> StepBatch:
        """Take up to ``limit`` complete steps, as a compact batch.

        It makes one object a step and a few a batch, not one a rank: the objects the driver
        makes in quantity decide how often Python's garbage collector runs, and with thousands
        of ranks each of its runs moves every pending call's objects to an older generation."""
        n = min(self.ready, limit)
        queues = self.queues
        cut = repeat(slice(0, n))
        rows: list[tuple[dict[str, Any], ...]] | None = None
        columns: list[list[dict[str, Any]]] | None = None
        if n < self.num_ranks:  # a few steps of many ranks: a row at a time, in C
            rows = [tuple(map(itemgetter(i), queues)) for i in range(n)]
        else:  # many steps of a few ranks: a list per rank, no object per step
            columns = [queue[:n] for queue in queues]
        # The times, rank after rank, copied as bytes (no float object per report).
        calls = array("d", b"".join(map(_head_bytes, self.calls, repeat(n))))
        busy = array("d", b"".join(map(_head_bytes, self.busy, repeat(n))))
        for column in (queues, self.calls, self.busy):
            deque(map(delitem, column, cut), maxlen=0)
        self._empty = sum(map(not_, queues))
        first = self.assembled
        checkpoints = self._take_checkpoints(first, n) if self._pending_checkpoints else {}
        self.assembled += n
        versions = None
        if self.versions is not None:
            held = [versions_of(marks, first, n) for marks in self.versions]
            versions = list(zip(*held, strict=True))
        return StepBatch(
            self.index_offset + first,
            self.attempt,
            rows,
            checkpoints,
            versions,
            None,
            StepTimes(calls, busy, list(self.offsets), n),
            columns=columns,
        )

    def _take_checkpoints(
        self, first: int, n: int
    ) -> dict[int, tuple[Checkpoint, tuple[int, ...]]]:
        """The checkpoints of steps ``first .. first + n - 1``, by step in the batch, each with
        the ranks that reported it."""
        checkpoints: dict[int, tuple[Checkpoint, tuple[int, ...]]] = {}
        for rank, pending in enumerate(self.checkpoints):
            for seq in [s for s in pending if s < first + n]:
                path = pending.pop(seq)
                self._pending_checkpoints -= 1
                ckpt, ranks = checkpoints.get(seq - first, (Checkpoint(path), ()))
                checkpoints[seq - first] = (ckpt, (*ranks, rank))
        return checkpoints

    @property
    def finished(self) -> bool:
        """Every rank's function returned and every step has been taken."""
        return self._ended == self.num_ranks and self._empty == self.num_ranks

    def values(self) -> list[Any]:
        """Each rank's return value, in rank order (after every rank finished)."""
        return [o.value for o in self.outcomes if o is not None]


def _head_bytes(times: array[float], n: int) -> bytes:
    """The first ``n`` entries of ``times``, as bytes."""
    return memoryview(times)[:n].tobytes()


def versions_of(marks: list[tuple[int, int]], first: int, n: int) -> list[int | None]:
    """The version held by each of reports ``first .. first + n - 1`` of a rank, from its
    marks (which are pruned to what later reports still need)."""
    out: list[int | None] = []
    current: int | None = None
    i = 0
    for seq in range(first, first + n):
        while i < len(marks) and marks[i][0] <= seq:
            current = marks[i][1]
            i += 1
        out.append(current)
    if i > 1:
        del marks[: i - 1]  # the last mark before the next report still applies to it
    return out


async def salvage(caller: Caller, worker: WorkerInfo, exc: WorkerRaisedError) -> Poll:
    """After a poll of ``worker`` raised ``exc`` (not a death: the call itself failed on the
    worker): when its answer could not be sent (Ray failed to pickle it: a report that does
    not), the worker says what it held instead: the reports before the bad one, and an error
    that names that report and its key.

    Raises:
        WorkerRaisedError: ``exc``, when nothing was salvaged.
    """
    salvaged: Poll | None = None
    with contextlib.suppress(AsyncExecError):  # a worker that cannot say: the poll's error
        salvaged = await proxy(caller, worker).salvage()
    if salvaged is None:
        raise exc
    return salvaged


def min_poll(buffer_size: int) -> int:
    """The credit a rank must have before it is polled (see :data:`POLL_CREDIT_SHARE`)."""
    return max(1, int(buffer_size * POLL_CREDIT_SHARE))


async def pump(
    worker: WorkerInfo,
    caller: Caller,
    credit: Callable[[], int],
    acked: Callable[[], int],
    changed: Callable[[], Awaitable[None]],
    least: Callable[[], int],
    take: Callable[[Poll], Awaitable[None]],
    full: int | None = None,
) -> Outcome:
    """Poll ``worker`` whenever it has at least ``least()`` of credit (``credit()``; waiting on
    ``changed()`` meanwhile), acknowledging ``acked()`` reports taken by the consumer, and hand
    each answer to ``take``; return the function's outcome once it has ended and every report
    was taken. ``caller``: whose attempt the call's errors carry (a group, or one rank's).
    ``full``: the whole window; when what is left of it beyond ``least()`` is at least a batch,
    the poll waits up to :data:`CONSUMER_LINGER_S` for the consumer to free it all.

    Raises:
        AsyncExecError: a call on the worker failed (mapped by the seam: it died, or Ray
            failed).
    """
    window = full if full is not None and full - least() >= BATCH else None
    calls = proxy(caller, worker)
    while True:
        while (room := credit()) < least():
            await changed()
        if window is not None and room < window:
            with anyio.move_on_after(CONSUMER_LINGER_S):
                while credit() < window:
                    await changed()
            room = credit()
        try:
            # Awaited here, not in a helper: a coroutine less per poll (each pending one is an
            # object that lives as long as its rank takes to report).
            poll: Poll = await submit(calls, acked(), room)
        except WorkerRaisedError as exc:  # not a death: perhaps an answer that did not pickle
            poll = await salvage(caller, worker, exc)
        await take(poll)
        if poll.outcome is not None:
            return poll.outcome


class Window:
    """One aligned attempt's pumps over its assembly: each rank is polled while it has
    credit."""

    def __init__(self, run: RunCore, group: WorkerGroup, buffer_size: int, index_offset: int):
        self.run = run
        self.group = group
        self.buffer_size = buffer_size
        self.asm = Assembly(len(group.workers), group.attempt, index_offset)
        # Steps handed over before this attempt do not count against its credit.
        self._consumed_base = run.handed
        self._min_poll = min_poll(buffer_size)
        #: The credit a rank must have to be polled: its share of the window, or any once the
        #: attempt has failed (see :meth:`flush`).
        self._least = self._min_poll
        #: Finds the ranks the others wait for (None: not watched); its ``serve`` task reports
        #: them.
        self.stragglers = StragglerWatch.of(group.config, len(group.workers))

    def _consumed(self) -> int:
        return max(0, self.run.consumed - self._consumed_base)

    def credit(self, rank: int) -> int:
        """Reports ``rank`` may still send before the consumer takes more."""
        return self.buffer_size - (self.asm.received[rank] - self._consumed())

    def flush(self) -> None:
        """The attempt has failed: from now on every rank is polled while it has any credit, not
        only a share of its window, until the attempt ends. A rank ahead of the others may hold
        reports on its worker that complete steps every rank has reported (a slower rank's came
        in one poll); polled as usual, it would keep them until the consumer took more, and
        they would go with the attempt."""
        self._least = 1
        self.run.wake()

    def silent_ranks(self, now: float, timeout_s: float) -> list[int]:
        """Ranks whose function runs, that have credit, and have not reported for ``timeout_s``
        (a rank held back by the consumer is waiting, not hung)."""
        asm, silent = self.asm, []
        for rank in range(asm.num_ranks):
            if asm.outcomes[rank] is not None:
                continue
            if self.credit(rank) < self._min_poll:  # waiting for the consumer
                asm.last_report[rank] = now
            elif now - asm.last_report[rank] > timeout_s:
                silent.append(rank)
        return silent

    async def pump(self, rank: int, fail: Callable[[AsyncExecError], None]) -> None:
        """Poll ``rank`` until its function has ended, feeding the assembly."""
        worker = self.group.workers[rank]
        attempt = self.group.attempt

        async def take(poll: Poll) -> None:
            self.asm.add(rank, poll)

        try:
            outcome = await pump(
                worker,
                at_attempt(self.group, attempt),
                lambda: self.credit(rank),
                self._consumed,
                self.run.wait_consumed,
                lambda: self._least,
                take,
                self.buffer_size,
            )
        except AsyncExecError as exc:
            fail(exc)
            return
        if outcome.kind != "ok":
            fail(outcome_error(outcome, worker, attempt))

    async def assemble(self, handover: HandOver) -> None:
        """Hand complete steps over until every rank has finished."""
        asm = self.asm
        while True:
            asm.check()
            while asm.ready:
                batch = asm.take(BATCH)
                if self.stragglers is not None and batch.times is not None:
                    self.stragglers.observe(batch.first, batch.times)
                handover.queue(batch)
                await handover.drain()
            if asm.finished:
                asm.check()
                return
            await asm.wait_changed()


class HandOver:
    """Complete steps on their way to the iterator, across attempts.

    A batch counts (its checkpoints become the latest, it is numbered in the stream) when it is
    queued, and leaves the queue only once the iterator has it: when a failure cancels the wait,
    the steps stay queued and are handed over after the failed group is gone, so no completed
    step is lost."""

    def __init__(
        self,
        run: RunCore,
        send: MemoryObjectSendStream[Any],
        book: CheckpointBook,
        prune: Callable[[list[str]], None],
    ):
        self.run = run
        self.book = book
        self.steps = 0
        self._send = send
        self._unsent: list[StepBatch] = []
        #: Checkpoints no longer kept, deleted (by ``prune``) once the steps queued with them
        #: have been handed to the iterator.
        self._pruned: list[str] = []
        #: Where those go: the run's pruner, or a named run's recorder, which holds each back
        #: while its record may still resume from it (see ``Recorder.hold``).
        self.prune = prune
        #: The checkpoints queued, with the stream index of the step that carried each, while
        #: a named run's record has not moved past them (None: not kept, an unnamed run).
        self.carried: list[tuple[int, Checkpoint]] | None = None
        #: Called when a checkpoint becomes the latest (a named run records it).
        self.on_checkpoint: Callable[[], None] | None = None
        #: The executor's observer (each batch of steps queued: the metrics count them).
        self.observer = Observer()

    def prune_after(self, paths: list[str]) -> None:
        """Delete ``paths`` once the steps queued so far have been handed to the iterator."""
        self._pruned.extend(paths)

    def queue(self, batch: StepBatch) -> None:
        for part in batch.split(BATCH):
            if len(part):
                for i in sorted(part.checkpoints):
                    checkpoint = part.checkpoints[i][0]
                    self.run.latest_checkpoint = checkpoint
                    self.run.latest_index = part.first + i
                    if self.carried is not None:
                        self.carried.append((part.first + i, checkpoint))
                    self._pruned.extend(self.book.add(checkpoint, part.first_metrics(i)))
                if part.checkpoints and self.on_checkpoint is not None:
                    self.on_checkpoint()
                self.steps += len(part)
                self._unsent.append(part)
                self.observer.emit(StepsQueued(part))

    async def drain(self) -> None:
        """Hand the queued steps to the iterator, waiting for the consumer."""
        while self._unsent:
            batch = self._unsent[0]
            # A send cancelled by a failure just after the iterator took its batch (the iterator
            # ran between the cancellation and the sender) raises, though the batch arrived:
            # what the iterator has received is never sent again.
            if batch.first >= self.run.received_upto:
                await self._send.send(batch)
            self.run.handed += len(self._unsent.pop(0))
            if self._pruned:
                pruned, self._pruned = self._pruned, []
                self.prune(pruned)
