"""The worker's end of a run's credit window: the reports its function makes, queued until the
driver's poll takes them.

Backpressure is a credit window: a rank may have at most ``buffer_size`` reports that the driver's
consumer has not taken. Each poll from the driver carries how many steps the consumer has taken
(the acknowledgement); ``report()`` waits while ``reported - acknowledged >= buffer_size``. A poll
waits for reports on the actor's event loop; ``report()`` runs in the function's thread: one plain
lock guards the queue and the counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from array import array
from collections.abc import Mapping
from typing import Any

from .._errors import ExecutorStateError, describe
from .._wire._checkpoint import Checkpoint, join_path, persist_directory
from .._wire._protocol import Outcome, Poll, ReportTimes, WorkerContext, checkpoint_name
from ._place import Place

__all__ = ["BATCH_LINGER_S", "Reports", "RunStopped"]

#: The longest a poll waits for a batch from a function that was held back by credit.
BATCH_LINGER_S = 0.002


class RunStopped(BaseException):
    """Raised inside ``report()`` when the driver stops the run; a BaseException so that a
    user's ``except Exception`` does not swallow it."""


class Reports:
    """One attempt's reports on this worker (see the module's docstring)."""

    def __init__(
        self,
        context: WorkerContext,
        bound: int,
        offset: int,
        loop: asyncio.AbstractEventLoop,
        place: Place,
    ) -> None:
        self.context = context
        self._bound = bound
        self._offset = offset
        self._loop = loop
        self._place = place
        # One plain lock (a Condition's default RLock costs twice as much per report) guards
        # the buffer and the counters; the condition on it is where report() waits for credit.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._credit_waiting = False
        self._buffer: list[dict[str, Any]] = []
        self._checkpoints: dict[int, str] = {}
        # Weight versions as (sequence number of the first report that holds it, version),
        # not yet sent: a change costs one entry, the hot path nothing.
        self._versions: list[tuple[int, int]] = []
        #: The version the last report held (a mark goes out only when it changes).
        self._version: int | None = None
        self.reported = 0
        self._sent = 0
        self._ack = 0
        #: ``report()`` queues no more: the driver stopped the run, or the function ended.
        self.stopped = False
        self._outcome: Outcome | None = None
        self._poll_waiting = False
        #: The last poll's answer and the sequence number of its first report, until the next
        #: poll: when Ray cannot send it (a report that does not pickle), ``salvage`` finds why.
        self._inflight: tuple[Poll, int] | None = None
        #: How many queued reports wake the waiting poll: 1, or a batch (see ``poll``).
        self._poll_wants = 1
        self._wake = asyncio.Event()
        # When each queued report was made, and how long the function ran before it (see
        # ``ReportTimes``): two floats a report, in lists (a list's append costs a third of an
        # array's on the hot path), packed into arrays' bytes by the poll.
        self._calls: list[float] = []
        self._busy: list[float] = []
        #: When the function last left ``report()`` (its start, before the first report).
        self._free = time.monotonic()

    def finish(self, outcome: Outcome) -> None:
        """The function has ended: the poll that takes the last report carries ``outcome``, and
        ``report()`` raises :class:`~asyncexec.ExecutorStateError` from now on (from a thread
        the function left behind: what it queued now would come after the outcome, and
        nothing would poll it or give it credit)."""
        with self._lock:
            self._outcome = outcome
            self.stopped = True
            self._cond.notify_all()
            self._wake_poll()

    def report(self, metrics: Mapping[str, Any], checkpoint: Checkpoint | None) -> None:
        # The hot path of a run: one lock, no allocation but the metrics' copy and the buffer's
        # slot, and no wake-up of the actor's loop unless a poll waits for this very report
        # (once per batch).
        called = time.monotonic()
        # A shallow copy: the report waits in the buffer (and is pickled, on Ray, only when a
        # poll takes it), and the caller may fill the same dict again for its next step.
        if type(metrics) is dict:
            metrics = metrics.copy()
        elif isinstance(metrics, Mapping):
            metrics = dict(metrics)
        else:
            raise TypeError(f"report() takes a mapping of metrics, got {type(metrics).__name__}")
        # The weight version this report was made with: the one held when report() is called,
        # not when it has waited for credit (a version installed meanwhile came after it).
        version = self._place.version
        if checkpoint is not None:
            self._report_checkpoint(metrics, checkpoint, version, called)
            return
        with self._lock:
            free = self._free
            self._free = called
            if self.stopped or self.reported - self._ack >= self._bound:
                self._wait_credit()
                self._free = time.monotonic()
            if version != self._version:
                self._mark_version(version)
            buffer = self._buffer
            buffer.append(metrics)
            self._calls.append(called)
            self._busy.append(called - free)
            self.reported += 1
            if self._poll_waiting and len(buffer) >= self._poll_wants:
                self._poll_waiting = False
                self._loop.call_soon_threadsafe(self._wake.set)

    def _report_checkpoint(
        self, metrics: dict[str, Any], checkpoint: Checkpoint, version: int | None, called: float
    ) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                "report(checkpoint=...) takes an asyncexec.Checkpoint, "
                f"got {type(checkpoint).__name__}"
            )
        with self._lock:
            self._wait_credit()
            seq = self.reported
        # Persisted outside the lock: a poll meanwhile sends the reports before this one.
        storage = self.context.storage_path or os.getcwd()
        name = checkpoint_name(self._offset + seq, self.context.attempt)
        path = persist_directory(checkpoint.path, join_path(storage, name))
        with self._lock:
            if self._outcome is not None:
                raise _ended()
            if version != self._version:
                self._mark_version(version)
            self._buffer.append(metrics)
            self._calls.append(called)
            self._busy.append(called - self._free)
            self._free = time.monotonic()
            self._checkpoints[seq] = path
            self.reported += 1
            self._wake_poll()

    def _mark_version(self, version: int | None) -> None:
        """The next report (and those after it) holds weight ``version``. With the lock held."""
        self._version = version
        if version is None:
            return
        marks = self._versions
        if marks and marks[-1][0] == self.reported:
            marks[-1] = (self.reported, version)
        else:
            marks.append((self.reported, version))

    def _wait_credit(self) -> None:
        # Called with the lock held: wait while the window is full; raise once the run stops or
        # the function has ended. A poll that waits for a batch gets what there is: nothing more
        # comes until it returns.
        while self.reported - self._ack >= self._bound and not self.stopped:
            self._credit_waiting = True
            if self._buffer:
                self._wake_poll()
            self._cond.wait()
        if self.stopped:
            if self._outcome is not None:
                raise _ended()
            raise RunStopped

    def _wake_poll(self) -> None:
        # Called with the lock held; wakes a poll that is waiting on the actor's loop.
        if self._poll_waiting:
            self._poll_waiting = False
            with contextlib.suppress(RuntimeError):  # a local worker's loop has closed
                self._loop.call_soon_threadsafe(self._wake.set)

    # The actor's loop -----------------------------------------------------------------------

    async def poll(self, ack: int, max_items: int) -> Poll:
        """Acknowledge what the consumer took, then return the queued reports (at most
        ``max_items``), waiting until there is one or the function has ended.

        When the acknowledgement lets a function go on that was waiting for credit (a fast
        producer held back by the consumer), the poll waits for a batch instead of the first
        report: until ``max_items`` are queued, the function waits for credit again or ends,
        or ``BATCH_LINGER_S`` has passed. A poll per report or two would cost both processes
        a round trip per report; a slow producer's reports still go at once."""
        batch = False
        self._inflight = None  # the driver received the previous answer
        while True:
            with self._lock:
                if ack > self._ack:
                    self._ack = ack
                    if self._credit_waiting:
                        self._credit_waiting = False
                        self._cond.notify_all()
                        batch = True
                buffer = self._buffer
                if self._outcome is not None or (
                    buffer and (not batch or len(buffer) >= max_items or self._credit_waiting)
                ):
                    self._poll_waiting = False
                    return self._take(max_items)
                self._wake.clear()
                self._poll_waiting = True
                self._poll_wants = max_items if batch else 1
            if batch:
                timer = self._loop.call_later(BATCH_LINGER_S, self._wake.set)
                await self._wake.wait()
                timer.cancel()
                batch = False  # lingered once: what is queued now goes
            else:
                await self._wake.wait()

    def _take(self, max_items: int) -> Poll:
        # Called with the lock held.
        buffer = self._buffer
        if len(buffer) <= max_items:
            items, self._buffer = buffer, []
            calls, self._calls = self._calls, []
            busy, self._busy = self._busy, []
        else:
            items = buffer[:max_items]
            del buffer[:max_items]
            calls, busy = self._calls[:max_items], self._busy[:max_items]
            del self._calls[:max_items], self._busy[:max_items]
        self._sent += len(items)
        ckpts = None
        if self._checkpoints:
            ckpts = {s: p for s, p in self._checkpoints.items() if s < self._sent}
            for s in ckpts:
                del self._checkpoints[s]
        outcome = self._outcome if not self._buffer else None
        versions = None
        if self._versions:
            versions, self._versions = self._versions, []
        times = None
        if items:
            times = ReportTimes(array("d", calls), array("d", busy), time.monotonic()).pack()
        poll = Poll(items, ckpts, outcome, versions, times)
        self._inflight = (poll, self._sent - len(items))
        return poll

    def salvage(self) -> Poll | None:
        """After the last poll's answer could not be sent to the driver: when a report in it does
        not pickle, stop the function and return what can be sent (the reports before that one)
        with an error that names the report, its step and its key; else None (something else
        failed)."""
        with self._lock:
            inflight, self._inflight = self._inflight, None
        if inflight is None:
            return None
        poll, first = inflight
        found = _unpicklable(poll.reports)
        if found is None:
            return None
        index, what = found
        self.stop()
        seq = first + index
        ctx = self.context
        error = TypeError(
            f"report() #{seq + 1} of rank {ctx.world_rank} (step {self._offset + seq}) cannot be "
            f"sent to the driver: {what}"
        )
        kept = {s: p for s, p in (poll.checkpoints or {}).items() if s < seq}
        outcome = Outcome("error", error=error)
        times = poll.times
        if times is not None:
            calls, busy, now = ReportTimes.unpack(times)
            times = ReportTimes(calls[:index], busy[:index], now).pack()
        return Poll(poll.reports[:index], kept or None, outcome, poll.versions, times)

    def buffered(self) -> int:
        """Reports this rank has made that no poll has taken yet (the worker's part of the
        consumer's backlog); from any thread."""
        with self._lock:
            return len(self._buffer)

    def stop(self) -> None:
        """From now on ``report()`` raises :class:`RunStopped` (also one waiting for credit);
        from any thread."""
        with self._lock:
            self.stopped = True
            self._cond.notify_all()


def _ended() -> ExecutorStateError:
    return ExecutorStateError(
        "report() must be called inside the function given to run(): this run's function has ended"
    )


def _unpicklable(reports: list[dict[str, Any]]) -> tuple[int, str] | None:
    """The first report that does not pickle, and what in it does not (its key), or None."""
    from ray import cloudpickle

    for index, metrics in enumerate(reports):
        try:
            cloudpickle.dumps(metrics)
        except Exception as exc:
            for key, value in metrics.items():
                try:
                    cloudpickle.dumps(value)
                except Exception as inner:
                    return index, f"the value of {key!r} cannot be pickled ({describe(inner)})"
            return index, f"its metrics cannot be pickled ({describe(exc)})"
    return None
