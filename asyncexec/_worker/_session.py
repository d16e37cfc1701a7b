"""The worker side of a run: context, ``report()``, checkpoints, dataset shards.

A worker holds at most one session at a time. Its state (the group's context, the session, the
weight version it holds) is a :class:`Place`: one per worker process, or one per worker thread in
local mode, where several workers share the driver's process (the current place is a context
variable that each local worker's calls, and the threads they start, carry). The user's function
runs in a thread of its
own (an ``async def`` on an event loop of its own in that thread), so that ``report()`` can block
when the buffer is full without freezing the actor's event loop, which must keep answering the
driver's polls, health checks and ``execute()`` calls.

Backpressure is a credit window: a rank may have at most ``buffer_size`` reports that the driver's
consumer has not taken. Each poll from the driver carries how many steps the consumer has taken
(the acknowledgement); ``report()`` waits while ``reported - acknowledged >= buffer_size``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .._checkpoint import Checkpoint, join_path, persist_directory
from .._errors import ExecutorStateError, describe
from .._protocol import Outcome, Poll, RunStart, WorkerContext, checkpoint_name

if TYPE_CHECKING:
    from ._roles import Roles

__all__ = [
    "Session",
    "WorkerContext",
    "error_outcome",
    "takes_config",
    "value_outcome",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "report",
]


class _RunStopped(BaseException):
    """Raised inside ``report()`` when the driver stops the run; a BaseException so that a
    user's ``except Exception`` does not swallow it."""


_log = logging.getLogger("asyncexec.worker")
#: The longest a poll waits for a batch from a function that was held back by credit.
BATCH_LINGER_S = 0.002
_WORKER_DIR = os.path.dirname(os.path.abspath(__file__))


class Place:
    """One worker's state: the group's context, the run's session, the weight version held,
    the instances of its roles."""

    __slots__ = ("context", "roles", "session", "version")

    def __init__(self) -> None:
        self.context: WorkerContext | None = None
        self.session: Session | None = None
        #: The weight version this worker holds (of the channel it receives from), tagged on
        #: reports.
        self.version: int | None = None
        #: The instances of the group's roles (see ``_roles``), once made.
        self.roles: Roles | None = None


#: The current worker's place when a local worker's call set it (see
#: ``asyncexec._driver._local``); else the process's own, ``_PROCESS``.
PLACE: contextvars.ContextVar[Place] = contextvars.ContextVar("asyncexec_place")
_PROCESS = Place()


def current_place() -> Place:
    """The current worker's state."""
    return PLACE.get(_PROCESS)


def current_session() -> Session | None:
    """The current worker's session, if a run is on it."""
    return PLACE.get(_PROCESS).session


def set_group_context(context: WorkerContext | None) -> None:
    """Install the group's context in this worker (called at set-up; None when a pooled worker
    is returned)."""
    PLACE.get(_PROCESS).context = context


def set_report_version(version: int | None) -> None:
    """This worker holds weight ``version`` (a weight channel installed it): reports made from
    now on carry it (``report()`` reads it when it is called)."""
    PLACE.get(_PROCESS).version = version


def get_context() -> WorkerContext:
    """Return this worker's context: ranks, sizes, node, devices, and the run and attempt.

    Raises:
        ExecutorStateError: called outside an asyncexec worker.
    """
    place = PLACE.get(_PROCESS)
    if place.session is not None:
        return place.session.context
    if place.context is None:
        raise ExecutorStateError("get_context() must be called inside an asyncexec worker")
    return place.context


def _require_session(what: str) -> Session:
    session = PLACE.get(_PROCESS).session
    if session is None:
        raise ExecutorStateError(f"{what} must be called inside the function given to run()")
    return session


def report(metrics: Mapping[str, Any], *, checkpoint: Checkpoint | None = None) -> None:
    """Report one step's metrics (and optionally a checkpoint) from this rank.

    Every rank must report the same number of times: step k is complete when every rank has made
    its k-th report. Blocks while this rank already has ``buffer_size`` reports that the driver's
    consumer has not taken (backpressure). A checkpoint is persisted under the run's storage path
    before the report is queued.

    Raises:
        TypeError: ``metrics`` is not a mapping, or ``checkpoint`` is not a Checkpoint.
        ExecutorStateError: called outside a run.
    """
    session = PLACE.get(_PROCESS).session
    if session is None:
        raise ExecutorStateError("report() must be called inside the function given to run()")
    session.report(metrics, checkpoint)


def get_checkpoint() -> Checkpoint | None:
    """The checkpoint this attempt starts from: the latest one any completed step carried (or the
    one passed to ``run()``), or None."""
    return _require_session("get_checkpoint()").checkpoint


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


def takes_config(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is called with the run's config (it has a positional parameter)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params
    )


def error_outcome(exc: BaseException) -> Outcome:
    """The outcome of a call that raised ``exc``: the error (when it pickles, else a
    RuntimeError that keeps its type and text) and its traceback as text, without colours."""
    from ray import cloudpickle

    # The traceback from the user's code on: asyncexec's own frames above it say nothing.
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_WORKER_DIR):
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        cloudpickle.loads(cloudpickle.dumps(exc))
        portable = exc
    except Exception:
        portable = RuntimeError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")
    return Outcome("error", error=portable, traceback=text)


def value_outcome(value: Any) -> Outcome:
    """The outcome of a call that returned ``value``; an error when it cannot be pickled."""
    from ray import cloudpickle

    try:
        cloudpickle.dumps(value)
    except Exception as exc:
        message = f"the return value cannot be pickled ({type(value).__name__}): {exc}"
        return Outcome("error", error=TypeError(message))
    return Outcome("ok", value)


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
        self._fn = fn
        self._args = (config,) if takes_config(fn) else ()
        self._bound = start.buffer_size
        self._offset = start.step_offset
        self._loop = loop
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
        self._place = PLACE.get(_PROCESS)
        #: The version the last report held (a mark goes out only when it changes).
        self._version: int | None = None
        self._reported = 0
        self._sent = 0
        self._ack = 0
        self._stop = False
        self._outcome: Outcome | None = None
        self._poll_waiting = False
        #: The last poll's answer and the sequence number of its first report, until the next
        #: poll: when Ray cannot send it (a report that does not pickle), ``salvage`` finds why.
        self._inflight: tuple[Poll, int] | None = None
        #: How many queued reports wake the waiting poll: 1, or a batch (see ``poll``).
        self._poll_wants = 1
        self._wake = asyncio.Event()
        self._finished = loop.create_future()
        self._fn_loop: asyncio.AbstractEventLoop | None = None
        self._fn_task: asyncio.Task[Any] | None = None
        # Its name tells whose function this is in a stack dump (``asyncexec stack``).
        name = f"asyncexec-fn {self.context.executor_name} rank {self.context.world_rank}"
        # The thread carries this worker's place (a thread starts with an empty context).
        here = contextvars.copy_context()
        self._thread = threading.Thread(target=here.run, args=(self._main,), name=name, daemon=True)

    def start(self) -> None:
        self._place.session = self
        self._thread.start()

    # The function's thread ------------------------------------------------------------------

    def _call(self) -> Any:
        factory = self._function_context
        with factory() if factory is not None else contextlib.nullcontext():
            if inspect.iscoroutinefunction(self._fn):
                return asyncio.run(self._run_async())
            return self._fn(*self._args)

    async def _run_async(self) -> Any:
        self._fn_loop = asyncio.get_running_loop()
        self._fn_task = asyncio.current_task()
        if self._stop:
            raise _RunStopped
        return await self._fn(*self._args)

    def _main(self) -> None:
        ctx = self.context
        # Worker-side events go through the standard library's logging (structlog is not
        # imported on workers: it would cost every worker process several MiB); each carries the
        # run id, the attempt and the rank. Ray forwards worker logs to the driver.
        bound = {"run_id": ctx.run_id, "attempt": ctx.attempt, "rank": ctx.world_rank}
        _log.debug("fn_started %s", _fields(bound), extra=bound)
        t0 = time.perf_counter()
        try:
            outcome = value_outcome(self._call())
        except (_RunStopped, asyncio.CancelledError):
            outcome = Outcome("stopped")
        except BaseException as exc:  # the user's error, shipped to the driver
            outcome = error_outcome(exc)
        with self._lock:
            self._outcome = outcome
            self._wake_poll()
        seconds = round(time.perf_counter() - t0, 3)
        _log.debug(
            "fn_ended %s",
            _fields({**bound, "outcome": outcome.kind, "reports": self._reported, "s": seconds}),
            extra=bound,
        )
        with contextlib.suppress(RuntimeError):  # a local worker's loop has closed
            self._loop.call_soon_threadsafe(_set_result, self._finished)

    def report(self, metrics: Mapping[str, Any], checkpoint: Checkpoint | None) -> None:
        # The hot path of a run: one lock, no allocation but the buffer's slot, and no wake-up
        # of the actor's loop unless a poll waits for this very report (once per batch).
        if type(metrics) is not dict:
            if not isinstance(metrics, Mapping):
                raise TypeError(
                    f"report() takes a mapping of metrics, got {type(metrics).__name__}"
                )
            metrics = dict(metrics)
        # The weight version this report was made with: the one held when report() is called,
        # not when it has waited for credit (a version installed meanwhile came after it).
        version = self._place.version
        if checkpoint is not None:
            self._report_checkpoint(metrics, checkpoint, version)
            return
        with self._lock:
            if self._stop or self._reported - self._ack >= self._bound:
                self._wait_credit()
            if version != self._version:
                self._mark_version(version)
            buffer = self._buffer
            buffer.append(metrics)
            self._reported += 1
            if self._poll_waiting and len(buffer) >= self._poll_wants:
                self._poll_waiting = False
                self._loop.call_soon_threadsafe(self._wake.set)

    def _report_checkpoint(
        self, metrics: dict[str, Any], checkpoint: Checkpoint, version: int | None
    ) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                "report(checkpoint=...) takes an asyncexec.Checkpoint, "
                f"got {type(checkpoint).__name__}"
            )
        with self._lock:
            self._wait_credit()
            seq = self._reported
        # Persisted outside the lock: a poll meanwhile sends the reports before this one.
        storage = self.context.storage_path or os.getcwd()
        name = checkpoint_name(self._offset + seq, self.context.attempt)
        path = persist_directory(checkpoint.path, join_path(storage, name))
        with self._lock:
            if version != self._version:
                self._mark_version(version)
            self._buffer.append(metrics)
            self._checkpoints[seq] = path
            self._reported += 1
            self._wake_poll()

    def _mark_version(self, version: int | None) -> None:
        """The next report (and those after it) holds weight ``version``. With the lock held."""
        self._version = version
        if version is None:
            return
        marks = self._versions
        if marks and marks[-1][0] == self._reported:
            marks[-1] = (self._reported, version)
        else:
            marks.append((self._reported, version))

    def _wait_credit(self) -> None:
        # Called with the lock held: wait while the window is full; raise once the run stops.
        # A poll that waits for a batch gets what there is: nothing more comes until it returns.
        while self._reported - self._ack >= self._bound and not self._stop:
            self._credit_waiting = True
            if self._buffer:
                self._wake_poll()
            self._cond.wait()
        if self._stop:
            raise _RunStopped

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
        else:
            items = buffer[:max_items]
            del buffer[:max_items]
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
        poll = Poll(items, ckpts, outcome, versions)
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
        self.halt()
        seq = first + index
        ctx = self.context
        error = TypeError(
            f"report() #{seq + 1} of rank {ctx.world_rank} (step {self._offset + seq}) cannot be "
            f"sent to the driver: {what}"
        )
        kept = {s: p for s, p in (poll.checkpoints or {}).items() if s < seq}
        outcome = Outcome("error", error=error)
        return Poll(poll.reports[:index], kept or None, outcome, poll.versions)

    def buffered(self) -> int:
        """Reports this rank has made that no poll has taken yet (the worker's part of the
        consumer's backlog); from any thread."""
        with self._lock:
            return len(self._buffer)

    def halt(self) -> None:
        """Tell the function to stop (``report()`` raises inside it, an ``async def`` is
        cancelled) without waiting; from any thread."""
        with self._lock:
            self._stop = True
            self._cond.notify_all()
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
