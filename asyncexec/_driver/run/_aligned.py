"""A run of aligned steps: its attempts under the restart policy, each on a whole group whose
every rank reports every step.

Each attempt starts the function on every rank, pumps every rank's reports into one assembly
(``_window``), hands complete steps over and watches the group's health while it does; the first
failure, after a short settling time in which the failures of ranks that failed with it are
collected, ends the attempt, and the policy decides whether another starts. An elastic group that
could grow ends its attempt at a safe point too: that is a planned resize, not counted by the
policy. Workers lost to a preemption (see ``_preemption``) restart under the preemption budget,
not the policy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import tenacity

from ..._errors import (
    AsyncExecError,
    ConfigurationError,
    RestartsExhaustedError,
    StartupTimeoutError,
    WorkerRaisedError,
    describe,
)
from ..._wire._tracing import in_span
from .._events import AttemptFailed, FunctionStarted, Restarting, TornDown
from .._restart import PreemptionsSpent
from .._taskgroups import task_group
from ..cluster import make_shards
from ..group import Resize, WorkerGroup, find_dead, watch, watch_steps, with_others
from ._context import RunContext
from ._iterator import RunState
from ._preemption import Moving, Preempted, exhausted
from ._window import Window

__all__ = ["DEATH_SETTLE_S", "RAISED_SETTLE_S", "AlignedRun"]

#: After a first failure, how long other ranks' failures are still collected before the attempt
#: is torn down, so that ranks that fail together (in one collective, on one bad batch) are all
#: recorded. Short after a death (a restart should not wait), longer after the user's function
#: raised (the ranks' own errors, which end the run by default, arrive within scheduling jitter).
DEATH_SETTLE_S = 0.02
RAISED_SETTLE_S = 0.2
#: The OpenTelemetry span of a restart (the failed group's recovery).
RESTART = "asyncexec.restart"


class _Attempt:
    """What ends one attempt: the failures collected, and an elastic group's growth."""

    def __init__(self) -> None:
        self.failures: list[AsyncExecError] = []
        self.failed = anyio.Event()
        self.grown: list[int] = []  # an elastic group's size once more workers would fit
        self.moving = False  # off nodes about to be preempted, from a checkpoint taken on notice
        self.scope = anyio.CancelScope()

    def fail(self, exc: AsyncExecError) -> None:
        rank = getattr(exc, "rank", None)
        if rank is None or all(getattr(f, "rank", None) != rank for f in self.failures):
            self.failures.append(exc)
        self.failed.set()

    def grow(self, size: int) -> None:
        self.grown.append(size)
        self.scope.cancel()

    def move(self) -> None:
        self.moving = True
        self.scope.cancel()

    async def settle_then_end(self, flush: Callable[[], None]) -> None:
        """After the first failure, end the attempt once its settling time has passed;
        meanwhile every rank is polled while it has any credit (``flush``: see
        ``Window.flush``), so that the steps every rank reported are delivered."""
        await self.failed.wait()
        flush()
        raised = isinstance(self.failures[0], WorkerRaisedError)
        await anyio.sleep(RAISED_SETTLE_S if raised else DEATH_SETTLE_S)
        self.scope.cancel()


class AlignedRun:
    """Runs the attempts of an aligned run (see the module's docstring)."""

    def __init__(self, ctx: RunContext, attempt_base: int) -> None:
        self.ctx = ctx
        #: Attempts of this run before this driver's (a resumed run's dead drivers').
        self.attempt_base = attempt_base
        # Planned resizes and moves after a preemption: attempts the restart policy does not count.
        self.resizes = 0

    async def main(self) -> list[Any]:
        """Every rank's return value, once an attempt has finished."""
        ctx, run = self.ctx, self.ctx.run
        progressed = False  # whether the attempt that failed last completed a step
        retrying = ctx.policy.retrying(
            before_sleep=self._before_sleep, progressed=lambda: progressed
        )
        try:
            async for attempt in retrying:
                with attempt:
                    number = self.attempt_base + attempt.retry_state.attempt_number
                    number += self.resizes
                    run.attempt = number
                    steps_before = ctx.handover.steps
                    try:
                        return await self._resizing(number)
                    except AsyncExecError as exc:
                        progressed = ctx.handover.steps > steps_before
                        run.record_failure(exc)
                        ctx.observer.emit(AttemptFailed(exc))
                        # The roles' instances the restart makes are restored from it.
                        ctx.slot.restore_from = ctx.checkpoint
                        # bounded: each way to recover has its deadlines (start, stop, shutdown)
                        with anyio.CancelScope(shield=True):
                            state = attempt.retry_state
                            if ctx.policy._ends_after(exc, state.attempt_number, state):
                                # No restart comes: no spare swapped in, no restart counted.
                                recovered = ctx.slot.discard(force=True)
                            else:
                                recovered = ctx.slot.recover(
                                    exc, reuse_survivors=ctx.policy.reuse_survivors
                                )
                            spanned = in_span(RESTART, recovered)
                            await ctx.observer.timed(spanned, TornDown)
                        ctx.session_live = False
                        ctx.sweep(run.attempt)  # what its ranks saved beyond its steps
                        # Steps every rank completed before the failure are still delivered.
                        await ctx.handover.drain()
                        raise
        except tenacity.RetryError:
            last = run.failures[-1] if run.failures else None
            raise RestartsExhaustedError(run.attempt, run.failures) from last
        except PreemptionsSpent as spent:
            raise exhausted(spent, run.attempt, run.failures) from spent.failure
        raise AssertionError("unreachable: tenacity ended without an outcome")  # pragma: no cover

    def _before_sleep(self, state: tenacity.RetryCallState) -> None:
        ctx = self.ctx
        ctx.run.state = RunState.RESTARTING
        outcome = state.outcome
        error = outcome.exception() if outcome is not None and outcome.failed else None
        wait = state.next_action.sleep if state.next_action else 0.0
        latest = ctx.checkpoint
        attempt = self.attempt_base + state.attempt_number + self.resizes + 1
        ctx.observer.emit(Restarting(error, wait, attempt, latest.path if latest else None))

    async def _resizing(self, number: int) -> list[Any]:
        """Attempt ``number``, and after each planned resize of an elastic group, or move off
        nodes about to be preempted, the next attempt, on the new group: neither is a failure,
        so the restart policy does not count them (nor waits before them)."""
        ctx = self.ctx
        while True:
            try:
                return await in_span("asyncexec.attempt", self._attempt(number), attempt=number)
            except (Resize, Moving) as planned:
                ctx.run.state = RunState.RESTARTING
                group = ctx.group
                assert group is not None
                latest = ctx.checkpoint
                path = latest.path if latest else None
                if isinstance(planned, Moving):
                    ctx.preemption.moving(attempt=number + 1, checkpoint=path)
                else:
                    ctx.log.info(
                        "resizing",
                        from_workers=len(group.workers),
                        fitting=planned.size,
                        attempt=number + 1,
                        checkpoint=path,
                    )
                # bounded: the stop by stop_timeout_s, resize() by the group's close
                with anyio.CancelScope(shield=True):
                    timeout = ctx.config.stop_timeout_s
                    stopped = await group.stop_functions(group.workers, timeout)
                    ctx.session_live = False
                    ctx.slot.restore_from = latest
                    await ctx.slot.resize(force=not stopped)
                ctx.sweep(number)
                await ctx.handover.drain()
                self.resizes += 1
                number += 1
                ctx.run.attempt = number
            except Preempted as preempted:
                await self._move(preempted.error, number + 1)
                await ctx.handover.drain()
                self.resizes += 1
                number += 1
                ctx.run.attempt = number

    async def _move(self, error: AsyncExecError, attempt: int) -> None:
        """After workers were lost to a preemption: count it against ``max_preemptions`` and
        put the group aside; the next attempt (``attempt``) starts at once, on a new group, from
        the latest checkpoint (the one taken on notice), as a planned start that the restart
        policy does not count. Draining nodes take no new work: the new group lands elsewhere.

        Raises:
            PreemptionsSpent: one preemption beyond ``max_preemptions`` (the group is discarded
                and the steps completed before the loss are delivered first).
        """
        ctx = self.ctx
        ctx.run.failures.append(error)
        ctx.run.state = RunState.RESTARTING
        latest = ctx.checkpoint
        ctx.slot.restore_from = latest  # the roles' instances the restart makes
        path = latest.path if latest else None
        try:
            ctx.preemption.charge(error, attempt=attempt, checkpoint=path)
        except PreemptionsSpent:
            # bounded by the group's close
            with anyio.CancelScope(shield=True):
                await ctx.slot.discard(force=True)
            ctx.session_live = False
            ctx.sweep(attempt - 1)
            await ctx.handover.drain()
            raise
        # bounded by the group's close
        with anyio.CancelScope(shield=True):
            await ctx.slot.resize(force=True)
        ctx.session_live = False
        ctx.sweep(attempt - 1)

    async def _attempt(self, number: int) -> list[Any]:
        ctx = self.ctx
        try:
            group = await ctx.slot.acquire(number)
        except AsyncExecError as exc:  # the group did not start: logged like a worker's failure
            ctx.log_failure(exc)
            raise
        ctx.group = group
        ctx.run.state = RunState.RUNNING
        window = ctx.window = Window(ctx.run, group, ctx.spec.buffer_size, ctx.handover.steps)
        attempt = _Attempt()
        finished = False
        async with task_group() as tg:
            with attempt.scope:
                tg.start_soon(attempt.settle_then_end, window.flush)
                # Health is watched from the first call on: a worker can die or hang (blocked
                # in C code holding the GIL) while its function is being started.
                tg.start_soon(watch, group, attempt.fail)
                tg.start_soon(ctx.preemption.watch, group)
                tg.start_soon(ctx.preemption.move_when_saved, group, attempt.move)
                try:
                    started = self._start(group, number)
                    await ctx.observer.timed(started, FunctionStarted, number)
                    await self._follow(tg, group, window, attempt)
                    finished = True
                except AsyncExecError as exc:
                    attempt.fail(exc)
            tg.cancel_scope.cancel()
        # The attempt is over: what its window holds beyond its complete steps (queued below) is
        # never delivered, nor counted in the backlog while the next attempt starts.
        ctx.window = None
        if attempt.failures:
            ctx.handover.queue(window.asm.take(window.asm.ready))
            error = await self._blame(group, attempt.failures)
            if await ctx.preemption.is_preemption(attempt.failures):
                raise Preempted(error)
            raise error
        if (attempt.grown or attempt.moving) and not finished:  # a safe point: restart from
            ctx.handover.queue(window.asm.take(window.asm.ready))  # the latest checkpoint
            raise Moving() if attempt.moving else Resize(attempt.grown[0])
        ctx.session_live = False
        return window.asm.values()

    async def _start(self, group: WorkerGroup, number: int) -> None:
        """Start the function on every rank of ``group`` for attempt ``number`` (the backend's
        hook, then a channel's joining ranks, then the function), within the start deadline."""
        ctx = self.ctx
        shards = await self._dataset_shards(group)
        payload = await ctx.payload()
        latest = ctx.checkpoint
        ctx.session_live = True
        with _startup_deadline(ctx.config.start_timeout_s):
            await group.run_backend_hook("on_training_start")
            for join in ctx.slot.joiners:  # a channel's latest version, first
                await join(group)
            steps = ctx.handover.steps
            starts = [
                ctx.run_start(w, number, latest, steps, shards[w.rank], ctx.storage)
                for w in group.workers
            ]
            await group.start_runs(payload, starts)
        ctx.slot.start_refills()

    async def _follow(self, tg: Any, group: WorkerGroup, window: Window, attempt: _Attempt) -> None:
        """Pump every rank, watch the step deadline and an elastic group's growth, and hand the
        complete steps over until every rank's function has ended."""
        config = self.ctx.config
        for rank in range(len(group.workers)):
            tg.start_soon(window.pump, rank, attempt.fail)
        if config.step_timeout_s is not None:
            tg.start_soon(watch_steps, group, window, config.step_timeout_s, attempt.fail)
        if self.ctx.slot.sizer is not None:
            tg.start_soon(self.ctx.slot.sizer.watch_growth, group, attempt.grow)
        if window.stragglers is not None:
            tg.start_soon(window.stragglers.serve, group, self.ctx.observer)
        await window.assemble(self.ctx.handover)

    async def _blame(self, group: WorkerGroup, failures: list[AsyncExecError]) -> AsyncExecError:
        """The attempt's error: the first failure (a dead peer rather than the survivor's failed
        collective that echoes its death), with the others attached; each is logged."""
        first = failures[0]
        if isinstance(first, WorkerRaisedError):
            # A peer's death surfaces first as an error in the survivors' collectives.
            # bounded by find_dead's probe timeout
            with anyio.CancelScope(shield=True):
                dead = await find_dead(group)
            if dead is not None:
                dead.__context__ = first
                # The dead rank first, once (its death may have been seen already).
                others = [f for f in failures if getattr(f, "rank", None) != dead.rank]
                failures[:] = [dead, *others]
        for failure in failures:
            self.ctx.log_failure(failure)
        return with_others(failures)

    async def _dataset_shards(self, group: WorkerGroup) -> list[dict[str, Any]]:
        """Each rank's dataset shards, made anew for every attempt (for the new workers' nodes)."""
        spec = self.ctx.spec
        if not spec.datasets:
            return [{} for _ in group.workers]
        datasets, data_config = spec.datasets
        handles = [w.handle for w in group.workers]
        nodes = [w.metadata.node_id for w in group.workers]
        try:
            return await make_shards(datasets, data_config, handles, nodes)
        except AsyncExecError:
            raise
        except Exception as exc:
            name = type(data_config).__name__
            raise ConfigurationError(f"{name}.configure() failed: {describe(exc)}") from exc


@contextlib.contextmanager
def _startup_deadline(timeout_s: float) -> Iterator[None]:
    """The deadline of starting an attempt's functions: a :class:`StartupTimeoutError` when it
    passes (and only then: a ``TimeoutError`` raised by anything after the start is not one)."""
    scope = anyio.CancelScope(deadline=anyio.current_time() + timeout_s)
    with scope:
        yield
    if scope.cancelled_caught:
        raise StartupTimeoutError("starting the function on the workers", timeout_s)
