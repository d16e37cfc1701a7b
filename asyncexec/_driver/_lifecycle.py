"""An executor's life: entering starts (or joins) the cluster and the worker group; leaving stops
any run and tears the group down, also on error or cancellation. The tasks that drive runs, and
what runs in the background (a spare being started), belong to a task group that this life
owns.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable
from types import TracebackType
from typing import Any

import anyio
import anyio.abc

from .._errors import ExecutorStateError
from .._timeline._timeline import Timeline
from ..backends._base import Backend
from ._config import LOCAL_ENV, ExecutorConfig, local_default
from ._interrupt import defer_interrupts, restore_interrupts
from ._observe import Observer
from ._taskgroups import task_group
from .cluster import DUMP_TIMEOUT_S, Cluster
from .group import Claim, GroupSlot, Reservation, WorkerPool
from .run import RunCore

__all__ = ["LOCAL_ENV", "ExecutorState", "Lifecycle", "local_default"]

#: Beyond the stop and shutdown bounds, what closing the executor gives a run to end.
_RUN_END_MARGIN_S = 10.0


class ExecutorState(enum.Enum):
    """Where an executor is in its life."""

    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    RUNNING = "running"
    RESTARTING = "restarting"
    CLOSING = "closing"
    CLOSED = "closed"


class Lifecycle:
    """One executor's life (see the module's docstring); an executor may live more than once
    (entered again after it closed: a fresh group)."""

    def __init__(
        self,
        config: ExecutorConfig,
        backend: Backend | None,
        log: Any,
        cluster: Cluster,
        pool: WorkerPool | None,
        reservation: Reservation | None,
        timeline: Timeline | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.log = log
        self.pool = pool
        self.reservation = reservation
        #: Where the workers live (decided by the executor: the one handed to it, its pool's
        #: or reservation's, or the default).
        self.cluster = cluster
        self.state = ExecutorState.NEW
        self.tg: anyio.abc.TaskGroup | None = None
        self._stack: contextlib.AsyncExitStack | None = None  # holds ``tg`` open
        #: The run in progress (or the last one).
        self.run: RunCore | None = None
        #: What runs before a run's functions start on a group (see WeightChannel).
        self.joiners: list[Any] = []
        #: The end of a renewal of a rank under way (one a call found dead: the dispatcher's),
        #: or None; a run's attempt waits for it (see ``GroupSlot.acquire``).
        self.renewing: Callable[[], anyio.Event | None] = lambda: None
        #: The executor's timeline, or None (given to each slot).
        self.timeline: Timeline | None = timeline
        #: The executor's observer (given to each slot, and by it to each group).
        self.observer = observer if observer is not None else Observer()
        self.slot = self._new_slot()
        #: The group starts, restarts and resizes of the slots of its lives before this one
        #: (``statistics()`` adds the slot's own: an executor's counters are its lifetime's).
        self.earlier = (0, 0, 0)
        self._claim: Claim | None = None
        self._closed = anyio.Event()
        #: Set when a start (``enter``) has ended, started or not: what aclose() waits for
        #: when it comes during the start.
        self._start_ended = anyio.Event()
        self._interrupts = False  # whether this executor defers SIGINT (see _interrupt)

    def _new_slot(self) -> GroupSlot:
        slot = GroupSlot(
            self.config, self.backend, self.cluster, self.log, self.pool, self.reservation
        )
        slot.joiners = self.joiners
        slot.renewing = lambda: self.renewing()
        slot.timeline = self.timeline
        slot.observer = self.observer
        return slot

    async def enter(self) -> None:
        """Start: the cluster (off the loop), a claim on the reservation, the group."""
        if self.state is ExecutorState.CLOSED:
            # A closed executor may be entered again: it starts a fresh group.
            # (The last run stays: the next one counts its steps, as after any run.)
            self._closed = anyio.Event()
            starts, restarts, resizes = self.earlier
            old = self.slot
            self.earlier = (starts + old.starts, restarts + old.restarts, resizes + old.resizes)
            self.slot = self._new_slot()
        elif self.state is not ExecutorState.NEW:
            raise ExecutorStateError(f"the executor is already {self.state.value}")
        self.state = ExecutorState.STARTING
        self._start_ended = anyio.Event()
        self._interrupts = defer_interrupts()
        try:
            async with contextlib.AsyncExitStack() as stack:
                self.tg = await stack.enter_async_context(task_group())
                self.slot.tg = self.tg
                try:
                    await self._start()
                except BaseException:
                    self.tg = None
                    raise  # (the group, with no task yet, left by the stack)
                self._stack = stack.pop_all()  # left in exit(), with the body's exception
        except BaseException:
            self._restore_interrupts()
            raise

    async def _start(self) -> None:
        try:
            await self.cluster.connect(self.config.address)
            if self.reservation is not None:
                self._claim = self.reservation.claim(
                    f"executor {self.config.name!r}",
                    self.config.num_workers + self.config.spares,
                    self.config.resources_per_worker,
                )
            await self.slot.acquire()
            if self.slot.closing:  # aclose() came while the group started: it is not kept
                # bounded by the group's close
                with anyio.CancelScope(shield=True):
                    await self.slot.discard(force=True)
                raise ExecutorStateError("the executor was closed while it started")
            self.state = ExecutorState.READY
        except BaseException:
            self._release_claim()
            self.state = ExecutorState.CLOSED
            self._closed.set()
            raise
        finally:
            self._start_ended.set()

    async def exit(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        """Leave: close, then cancel what is left in the task group and leave it with the
        body's exception (``exc``)."""
        try:
            await self.aclose()
        finally:
            stack, self._stack = self._stack, None
            tg, self.tg = self.tg, None
            if stack is not None and tg is not None:
                # What is left (a spare still starting in the background, a run task that
                # outlived aclose()'s bound) is cancelled: leaving never waits without a bound.
                tg.cancel_scope.cancel()
                try:
                    await stack.__aexit__(exc_type, exc, tb)
                finally:
                    self._restore_interrupts()

    async def aclose(self, *, force: bool = False) -> None:
        """Stop any run and tear the group down (see ``Executor.aclose``)."""
        if self.state in (ExecutorState.CLOSING, ExecutorState.CLOSED):
            # bounded by the first aclose(), whose every step is
            with anyio.CancelScope(shield=True):
                await self._closed.wait()
            return
        starting = self.state is ExecutorState.STARTING
        self.state = ExecutorState.CLOSING
        self.slot.closing = True
        try:
            # bounded: the run's end by the bound below, discard() by the group's close, the
            # start by its own deadlines (the bound below)
            with anyio.CancelScope(shield=True):
                if starting:  # a group being started is closed by the start (see _start)
                    config = self.config
                    bound = config.placement_timeout_s + config.start_timeout_s
                    with anyio.move_on_after(bound + config.shutdown_timeout_s):
                        await self._start_ended.wait()
                run = self.run
                if run is not None:
                    run.cancel()
                    bound = self.config.stop_timeout_s + self.config.shutdown_timeout_s
                    bound += DUMP_TIMEOUT_S  # the stacks of functions that did not stop
                    with anyio.move_on_after(bound + _RUN_END_MARGIN_S):
                        await run.finished.wait()
                await self.slot.discard(force=force)
        finally:  # (also when the teardown raised: no other closer waits on it for ever)
            self._release_claim()
            self.state = ExecutorState.CLOSED
            self._closed.set()
            # Here, not only in exit(): an executor entered by hand and closed with aclose()
            # alone is never left, and its handler stayed (a later loop's Ctrl-C then broke
            # into whatever ran, and asyncio.run's own handler was never installed).
            self._restore_interrupts()
        self.log.info("executor_closed")

    def check_open(self) -> anyio.abc.TaskGroup:
        """The task group runs belong to.

        Raises:
            ExecutorStateError: the executor is not started, or is closed.
        """
        if self.state is ExecutorState.NEW:
            raise ExecutorStateError("the executor is not started: use `async with Executor(...)`")
        if self.state in (ExecutorState.CLOSING, ExecutorState.CLOSED) or self.tg is None:
            raise ExecutorStateError("the executor is closed")
        return self.tg

    def _restore_interrupts(self) -> None:
        if self._interrupts:
            self._interrupts = False
            restore_interrupts()

    def _release_claim(self) -> None:
        if self._claim is not None and self.reservation is not None:
            self.reservation.release(self._claim)
        self._claim = None
