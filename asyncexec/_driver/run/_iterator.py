"""A run as its caller holds it: the async iterator, and the state it shares with the task that
feeds it.

The driver task (``_attempts``) belongs to the executor's task group; the iterator only reads
from a memory stream that the driver writes to. So the caller's ``async for`` never yields from
inside one of our task groups or cancel scopes, and stopping the run (``break`` then
``aclose()``, a cancellation delivered while the iterator waits, garbage collection) only has to
cancel the driver's scope.

Steps travel in batches; consumption is acknowledged when the iterator asks for the next batch
(see ``_window``).
"""

from __future__ import annotations

import asyncio
import enum
import os
import time
import uuid
import weakref
from collections.abc import Coroutine
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from ..._errors import ExecutorStateError
from ..._wire._checkpoint import Checkpoint
from .._events import StepsTaken
from .._observe import Observer
from ._steps import RunResult, Step, StepBatch

__all__ = ["Run", "RunCore", "RunEnd", "RunState", "new_run_id"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_WORKER = os.path.join(_PACKAGE, "_worker")


class RunState(enum.Enum):
    """Where a run is."""

    RUNNING = "running"
    RESTARTING = "restarting"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


class RunEnd:
    """How the driver task ended a run: its result, or its error."""

    __slots__ = ("error", "result")

    def __init__(self, result: RunResult | None, error: BaseException | None) -> None:
        self.result = result
        self.error = error


def new_run_id() -> str:
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


class RunCore:
    """A run's shared state: what the driver task and the executor hold. The iterator that the
    caller holds (:class:`Run`) refers to it, not the other way round, so dropping the iterator
    lets it be collected, which stops the run."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.state = RunState.RUNNING
        self.attempt = 1
        self.latest_checkpoint: Checkpoint | None = None
        #: The stream index of the step that carried it (a resumed run goes on after it).
        self.latest_index: int | None = None
        self.result: RunResult | None = None
        self.error: BaseException | None = None
        self.failures: list[BaseException] = []
        self.end: RunEnd | None = None
        self.closed = False
        self.scope = anyio.CancelScope()
        self.finished = anyio.Event()
        # Credit accounting between the iterator and the pumps (one event loop, no locks).
        self.handed = 0
        self.consumed = 0
        #: Steps the iterator has yielded to the consumer.
        self.delivered = 0
        #: The stream index after the last batch the iterator received (see HandOver.drain).
        self.received_upto = 0
        #: The executor's observer (the steps' spans are recorded as the iterator gets them).
        self.observer = Observer()
        self._consumed_changed = anyio.Event()

    def record_failure(self, exc: BaseException) -> None:
        """Keep ``exc`` in ``failures`` (what ended an attempt, or a rank's), for the run's life.

        Without the tracebacks the driver's code made for it and for the errors it chains
        (cause, context): their frames held what the attempt held (its group, the workers'
        handles, its window and the reports buffered in it), and each frame its caller's, so
        under an unbounded policy every failure kept one more attempt alive. The error's
        message, notes and chained errors stay; a traceback that reaches the user's code (a
        local worker's error, raised in the function) stays too."""
        self.failures.append(exc)
        seen: set[int] = set()
        todo: list[BaseException | None] = [exc]
        while todo:
            error = todo.pop()
            if error is None or id(error) in seen:
                continue
            seen.add(id(error))
            tb = error.__traceback__
            if tb is not None:
                where = tb.tb_frame.f_code.co_filename  # where it was caught, last
                if where.startswith(_PACKAGE) and not where.startswith(_WORKER):
                    error.__traceback__ = None
            todo += (error.__cause__, error.__context__)

    def mark_consumed(self) -> None:
        """Everything the iterator has received so far has been taken by the consumer.

        Counted from what the iterator received, not from ``handed``: the sender of the batch
        just consumed may not have run again yet (a consumer that never yields takes a whole
        batch without letting it), and credit counted from ``handed`` would then lag by that
        batch, which can hold a pump that waits for a share of its window forever."""
        if self.consumed != self.received_upto:
            self.consumed = self.received_upto
            self.wake()

    def wake(self) -> None:
        """Wake what waits for the consumer to take more (``wait_consumed``), to look at its
        credit again."""
        changed, self._consumed_changed = self._consumed_changed, anyio.Event()
        changed.set()

    async def wait_consumed(self) -> None:
        await self._consumed_changed.wait()

    def cancel(self) -> None:
        """Ask the run to stop (idempotent, does not wait)."""
        self.closed = True
        self.scope.cancel()

    @property
    def active(self) -> bool:
        return not self.finished.is_set()


class Run:
    """An async iterator over a run's :class:`Step`\\ s.

    ``async for step in run`` yields each step once every rank has reported it. The iterator ends
    when the function has returned on every rank; :attr:`result` then holds each rank's return
    value and the latest checkpoint. It raises the error that ended the run, if one did.
    Leaving the ``async for`` early (``break``, an exception), :meth:`aclose` (or
    ``async with run:``), cancelling the task that reads it, or dropping the run stops the run;
    :meth:`aclose` also waits until its workers have stopped.
    """

    def __init__(self, core: RunCore, receive: MemoryObjectReceiveStream[Any]) -> None:
        self._core = core
        self._receive = receive
        self._batch = StepBatch(0, 0, [], {})
        self._pos = 0
        self._len = 0
        # Dropping the iterator stops the run. The finalizer may run in any thread and in the
        # middle of any code: it only asks the event loop to cancel, at a safe point. It holds
        # the run's state weakly (the run's task holds it while there is a run to stop): the
        # error that ended a run holds the iterator in its traceback, and the run's state holds
        # that error, so a strong hold from the finalizers' registry kept all three for ever.
        # The finalizer closes the stream too (a run made and never read, or read to its end,
        # left it open: Python warned of an unclosed stream when the run was collected).
        self._loop = asyncio.get_running_loop()
        stop = weakref.finalize(self, _stop_dropped, weakref.ref(core), self._loop, receive)
        stop.atexit = False

    def __repr__(self) -> str:
        core = self._core
        return f"<Run {core.run_id} {core.state.value} attempt={core.attempt} steps={core.handed}>"

    @property
    def run_id(self) -> str:
        """The run's id; also the folder of its checkpoints under the storage path."""
        return self._core.run_id

    @property
    def state(self) -> RunState:
        """Running, restarting, finished, failed or cancelled."""
        return self._core.state

    @property
    def attempt(self) -> int:
        """The current (or last) attempt, 1 for the first."""
        return self._core.attempt

    @property
    def latest_checkpoint(self) -> Checkpoint | None:
        """The latest checkpoint a completed step carried."""
        return self._core.latest_checkpoint

    @property
    def failures(self) -> tuple[BaseException, ...]:
        """The errors that ended attempts so far, in order."""
        return tuple(self._core.failures)

    @property
    def result(self) -> RunResult:
        """The finished run's result.

        Raises:
            ExecutorStateError: the run has not finished successfully.
        """
        core = self._core
        if core.result is None:
            raise ExecutorStateError(f"run {core.run_id} has no result: it is {core.state.value}")
        return core.result

    def __aiter__(self) -> _Loop:
        # Each ``async for`` gets an iterator of its own: when the loop is left early (break, an
        # exception), it is dropped and the run stops, also while the Run is held in a variable.
        if self._core.closed:
            # Stopped (a loop left early, aclose()): the rest of the batch at hand belongs to
            # no one, and a new loop over the stopped run must not be yielded it.
            self._pos = self._len
        return _Loop(self, self._loop)

    async def __anext__(self) -> Step:
        pos = self._pos
        if pos < self._len:  # the hot path: the next step of the batch at hand
            self._pos = pos + 1
            self._core.delivered += 1
            return self._batch.step(pos)
        core = self._core
        if core.closed and core.end is None:
            raise StopAsyncIteration
        core.mark_consumed()
        try:
            item = await self._receive.receive()
        except anyio.get_cancelled_exc_class() as exc:
            # The consumer was cancelled while it waited for a step (its task cancelled, a
            # timeout around the loop): nobody will read the rest, so the run stops now.
            core.cancel()
            # The stream's receive waits inside its own ``except WouldBlock``: that internal
            # error is no context of the cancellation (it doubled a Ctrl-C's traceback).
            exc.__suppress_context__ = True
            raise
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            core.closed = True
            self._receive.close()
            end = core.end
            if end is not None and end.error is not None:
                raise end.error from end.error.__cause__
            raise StopAsyncIteration from None
        batch: StepBatch = item
        core.observer.emit(StepsTaken(batch))
        self._batch, self._pos, self._len = batch, 1, len(batch)
        core.received_upto = batch.first + len(batch)
        core.delivered += 1
        return batch.step(0)

    async def aclose(self) -> None:
        """Stop the run and wait until its workers have stopped (bounded by the executor's
        stop and shutdown deadlines)."""
        self._core.cancel()
        self._receive.close()
        # The rest of the batch at hand is not yielded either: after aclose() the iterator
        # ends, as an async generator's does (the hot path of __anext__ does not look at
        # ``closed``).
        self._pos = self._len
        # bounded by the run's end: its task's teardown steps have deadlines (_engine)
        with anyio.CancelScope(shield=True):
            await self._core.finished.wait()

    async def wait_finished(self) -> None:
        """Wait until the run has ended (finished, failed or cancelled), without consuming it."""
        await self._core.finished.wait()

    async def __aenter__(self) -> Run:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _Loop:
    """One ``async for`` over a run. It is dropped when the loop ends: early (``break``, an
    exception leaving the loop), that stops the run; after the last step, nothing is left to
    stop. ``await run.__anext__()`` reads the run without one."""

    __slots__ = ("__weakref__", "_run")

    def __init__(self, run: Run, loop: asyncio.AbstractEventLoop) -> None:
        self._run = run
        weakref.finalize(self, _stop_dropped, weakref.ref(run._core), loop, None).atexit = False

    def __aiter__(self) -> _Loop:
        return self

    def __anext__(self) -> Coroutine[Any, Any, Step]:
        return self._run.__anext__()


def _stop_dropped(
    held: weakref.ref[RunCore],
    loop: asyncio.AbstractEventLoop,
    receive: MemoryObjectReceiveStream[Any] | None,
) -> None:
    """Stop a run whose iterator was dropped, and close the run's stream (``receive``, given
    by the :class:`Run`'s finalizer). A finalizer: it may run in any thread and in the middle
    of any code. The run counts as closed at once (a new ``run()`` right after a ``break`` is
    accepted, and waits for this one to stop); the cancellation and the close are made on the
    run's loop: here when this is that loop's thread (the usual ``break``), else soon."""
    core = held()
    if core is not None and core.finished.is_set():  # (gone: its task, which held it, ended)
        core = None
    if core is None and receive is None:
        return
    if core is not None:
        core.closed = True

    def stop() -> None:
        if core is not None:
            core.cancel()
        if receive is not None:
            receive.close()

    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:
        here = False
    if here:
        stop()
        return
    try:
        loop.call_soon_threadsafe(stop)
    except RuntimeError:  # the loop has closed: the run ended with it, nothing waits on it
        if receive is not None:
            receive.close()
