"""The worker side of a run: its session (the user's function in a thread of its own), and what
the function calls: ``report()``, ``get_context()``, ``get_checkpoint()``, ``get_dataset_shard()``,
``get_preemption_info()``.

A worker holds at most one session at a time, in its :class:`~._place.Place`. The user's function
runs in a thread of its own (an ``async def`` on an event loop of its own in that thread), so that
``report()`` can block when the buffer is full without freezing the actor's event loop, which must
keep answering the driver's polls, health checks and ``execute()`` calls. What the function
reports waits for the driver's polls in the session's :class:`~._reports.Reports`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import ExecutorStateError
from .._wire._checkpoint import Checkpoint
from .._wire._protocol import Outcome, Poll, PreemptionNotice, RunStart, WorkerContext
from .._wire._tracing import attached
from . import _place
from ._outcomes import error_outcome, takes_config, value_outcome
from ._place import current_place
from ._reports import Reports, RunStopped

__all__ = [
    "Session",
    "end_session",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "get_preemption_info",
    "report",
]

_log = logging.getLogger("asyncexec.worker")

#: The session whose function runs in this context: set in the function's thread, and carried
#: (as contextvars are) into its tasks and ``asyncio.to_thread()`` threads. One of them left
#: running after its session ended must not take the next run on the worker for its own.
_OWN: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "asyncexec_session", default=None
)


def _session_of(place: _place.Place) -> _place.Session | None:
    """The run's session on ``place`` if the caller belongs to it (or cannot be told apart: a
    plain ``threading.Thread`` carries no context); None when the caller's own session ended."""
    session = place.session
    own = _OWN.get()
    if own is not None and own is not session:
        return None
    return session


def get_context() -> WorkerContext:
    """Return this worker's context: ranks, sizes, node, devices, and the run and attempt.

    While a run's function is running on this worker, the context of the run's attempt;
    otherwise (before a run, or once its function has ended, as in an ``execute()`` call after
    the run) the group's, whose ``run_id``, ``attempt`` and ``storage_path`` are None.

    Raises:
        ExecutorStateError: called outside an asyncexec worker.
    """
    place = current_place()
    session = _session_of(place)
    if session is not None:
        return session.context
    if place.context is None:
        raise ExecutorStateError("get_context() must be called inside an asyncexec worker")
    return place.context


def _require_session(what: str) -> _place.Session:
    session = _session_of(current_place())
    if session is None:
        raise ExecutorStateError(f"{what} must be called inside the function given to run()")
    return session


def report(metrics: Mapping[str, Any], *, checkpoint: Checkpoint | None = None) -> None:
    """Report one step's metrics (and optionally a checkpoint) from this rank.

    Every rank must report the same number of times: step k is complete when every rank has made
    its k-th report. Blocks while this rank already has ``buffer_size`` reports that the driver's
    consumer has not taken (backpressure). A checkpoint is persisted under the run's storage path
    before the report is queued.

    ``metrics`` is copied when ``report()`` is called, so the same dict may be filled again for
    the next step; the copy is shallow: a value changed in place afterwards (an array, a tensor,
    a list) may reach the consumer changed, since the report waits in this rank's buffer until
    the driver's poll takes it (and local mode never pickles it). Report a copy of such a value.

    Raises:
        TypeError: ``metrics`` is not a mapping, or ``checkpoint`` is not a Checkpoint.
        ExecutorStateError: called outside a run: no run's function is running on this worker
            (before a run, or once its function has ended: in an ``execute()`` call after the
            run, or in a thread the function left running, also once the next run is on the
            worker).
    """
    session = _session_of(current_place())
    if session is None:
        raise ExecutorStateError("report() must be called inside the function given to run()")
    session.reports.report(metrics, checkpoint)


def get_checkpoint() -> Checkpoint | None:
    """The checkpoint this attempt starts from: the latest one any completed step carried (or the
    one passed to ``run()``), or None."""
    checkpoint: Checkpoint | None = _require_session("get_checkpoint()").checkpoint
    return checkpoint


def get_preemption_info() -> PreemptionNotice | None:
    """The notice that nodes of this group are about to be taken away (a spot or preemptible
    node drained by the cluster): the deadline and the ranks that will go; None when there is
    none. Cheap (a local read): call it at every step, and save a checkpoint (``report(...,
    checkpoint=...)``) when it is not None; the run then goes on from that checkpoint after the
    nodes are gone, and the restart counts against ``RestartPolicy.max_preemptions``, not
    ``max_restarts``.

    Every rank of the group gets the notice (about a poll interval after the cluster marks the
    node, 1 s by default), at a slightly different step: a function whose ranks must agree on
    the step that checkpoints decides it together (rank 0's view, broadcast).

    Raises:
        ExecutorStateError: called outside an asyncexec worker.
    """
    place = current_place()
    if place.session is None and place.context is None:
        raise ExecutorStateError("get_preemption_info() must be called inside an asyncexec worker")
    return place.preemption


def get_dataset_shard(name: str) -> Any:
    """This rank's part of the dataset passed to ``run(datasets=...)`` under ``name``.

    Raises:
        KeyError: no dataset of that name was given to the run.
    """
    session = _require_session("get_dataset_shard()")
    try:
        return session.shards[name]
    except KeyError:
        known = ", ".join(sorted(session.shards)) or "none"
        raise KeyError(f"no dataset named {name!r} in this run (datasets: {known})") from None


class Session:
    """One attempt of a run of the user's function on this worker."""

    def __init__(
        self,
        fn: Callable[..., Any],
        config: Any,
        start: RunStart,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.context = start.context
        self.checkpoint: Checkpoint | None = start.checkpoint
        self.shards = dict(start.shards)
        self._function_context = start.function_context
        self._trace_context = start.trace_context
        self._fn = fn
        self._args = (config,) if takes_config(fn) else ()
        self._loop = loop
        self._place = current_place()
        self.reports = Reports(
            self.context, start.buffer_size, start.step_offset, loop, self._place
        )
        self._finished = loop.create_future()
        self._fn_loop: asyncio.AbstractEventLoop | None = None
        self._fn_task: asyncio.Task[Any] | None = None
        # Its name tells whose function this is in a stack dump (``asyncexec stack``).
        name = f"asyncexec-fn {self.context.executor_name} rank {self.context.world_rank}"
        # The thread carries this worker's place (a thread starts with an empty context).
        here = contextvars.copy_context()
        self.thread = threading.Thread(target=here.run, args=(self._main,), name=name, daemon=True)

    def start(self) -> None:
        self._place.session = self
        self.thread.start()

    # The function's thread ------------------------------------------------------------------

    def _call(self) -> Any:
        factory = self._function_context
        with (
            attached(self._trace_context),  # the driver's attempt span, when traced
            factory() if factory is not None else contextlib.nullcontext(),
        ):
            if inspect.iscoroutinefunction(self._fn):
                with asyncio.Runner() as runner:  # as ``asyncio.run``
                    # A thread the function left running (an ``asyncio.to_thread()`` it stopped
                    # waiting for) does not hold its end, as it does not a plain function's:
                    # ``asyncio.run`` waits for the default executor's threads when it closes.
                    runner.get_loop().set_default_executor(
                        _LeftBehind(thread_name_prefix="asyncio")
                    )
                    return runner.run(self._run_async())
            return self._fn(*self._args)

    async def _run_async(self) -> Any:
        self._fn_loop = asyncio.get_running_loop()
        self._fn_task = asyncio.current_task()
        if self.reports.stopped:
            raise RunStopped
        return await self._fn(*self._args)

    def _main(self) -> None:
        ctx = self.context
        # Worker-side events go through the standard library's logging (structlog is not
        # imported on workers: it would cost every worker process several MiB); each carries the
        # run id, the attempt and the rank. Ray forwards worker logs to the driver.
        bound = {"run_id": ctx.run_id, "attempt": ctx.attempt, "rank": ctx.world_rank}
        _OWN.set(self)  # in the thread's own context (``here``), and what it hands on
        _log.debug("fn_started %s", _fields(bound), extra=bound)
        t0 = time.perf_counter()
        try:
            outcome = value_outcome(self._call())
        except RunStopped:
            outcome = Outcome("stopped")
        except asyncio.CancelledError as exc:
            # The driver's stop cancels an ``async def``; a CancelledError the function raised
            # of its own (it awaited a task that was cancelled) is its error, with its traceback.
            outcome = Outcome("stopped") if self.reports.stopped else error_outcome(exc)
        except BaseException as exc:  # the user's error, shipped to the driver
            outcome = error_outcome(exc)
        # Before the driver can see the outcome: from now on report() raises and get_context()
        # is the group's, in an execute() call or a thread the function left behind.
        end_session(self)
        self.reports.finish(outcome)
        seconds = round(time.perf_counter() - t0, 3)
        reported = self.reports.reported
        _log.debug(
            "fn_ended %s",
            _fields({**bound, "outcome": outcome.kind, "reports": reported, "s": seconds}),
            extra=bound,
        )
        with contextlib.suppress(RuntimeError):  # a local worker's loop has closed
            self._loop.call_soon_threadsafe(_set_result, self._finished)

    # The actor's loop -----------------------------------------------------------------------

    async def poll(self, ack: int, max_items: int) -> Poll:
        return await self.reports.poll(ack, max_items)

    def salvage(self) -> Poll | None:
        """What the last poll held when Ray could not send it (see ``Reports.salvage``); the
        function is stopped when a report in it was the cause."""
        poll = self.reports.salvage()
        if poll is not None:
            self.halt()
        return poll

    def halt(self) -> None:
        """Tell the function to stop (``report()`` raises inside it, an ``async def`` is
        cancelled) without waiting; from any thread."""
        self.reports.stop()
        if self._fn_loop is not None and self._fn_task is not None:
            with contextlib.suppress(RuntimeError):  # its loop has already closed
                self._fn_loop.call_soon_threadsafe(self._fn_task.cancel)

    async def stop(self, timeout_s: float) -> bool:
        """Stop the function: ``report()`` raises inside it, an ``async def`` is cancelled.
        Return whether it ended within ``timeout_s``."""
        self.halt()
        try:
            await asyncio.wait_for(asyncio.shield(self._finished), timeout_s)
        except TimeoutError:
            return False
        return True

    @property
    def finished(self) -> bool:
        return self._finished.done()


class _LeftBehind(concurrent.futures.ThreadPoolExecutor):
    """The default executor of an ``async def`` function's event loop: closing the loop does not
    wait for its threads (they are left running, as the threads a plain function starts are)."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=cancel_futures)


def _fields(values: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items())


def _set_result(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def end_session(session: Session) -> None:
    """Forget ``session`` if it is its worker's current one."""
    place = session._place
    if place.session is session:
        place.session = None
