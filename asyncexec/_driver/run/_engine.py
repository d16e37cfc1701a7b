"""The task that drives one run: its start (a named run's resume), its work (aligned attempts or
independent ranks, under the restart policy), its helpers (the checkpoint pruner, the record) and
its end.

The task belongs to the executor's task group and never raises: the run's outcome goes to the
iterator (:class:`~._iterator.Run`) through the memory stream and ``RunCore.end``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from ..._errors import AsyncExecError, describe
from ..._wire._checkpoint import Checkpoint, CheckpointBook
from ..._wire._tracing import Opened, begin, finish
from .._events import RunEnded
from .._interrupt import hurried_away
from .._metrics import RunMeter
from .._restart import RestartPolicy
from .._sinks import run_observer
from .._taskgroups import task_group
from ..cluster import proxy, release_shards
from ..group import GroupSlot, PerRank, WorkerInfo, declare_hung, with_others
from ._aligned import AlignedRun
from ._context import RunContext
from ._independent import IndependentRun
from ._iterator import RunCore, RunEnd, RunState
from ._preemption import NoticedHandOver, PreemptionWatch
from ._prune import Pruner
from ._recorder import Recorder
from ._spec import RunSpec
from ._steps import RunResult

__all__ = ["RunDriver"]


class RunDriver:
    """Runs one run and feeds its iterator."""

    def __init__(
        self,
        slot: GroupSlot,
        policy: RestartPolicy,
        run: RunCore,
        send: MemoryObjectSendStream[Any],
        spec: RunSpec,
        on_end: Callable[[RunCore], None],
    ) -> None:
        """``on_end`` is called with the run when it has ended."""
        config = slot.config
        log = slot.log.bind(run_id=run.run_id)
        ckpt = config.checkpoint
        book = CheckpointBook(ckpt.num_to_keep, ckpt.score_attribute, ckpt.score_order)
        self.pruner = Pruner(log)
        meter = RunMeter(config.name, self._held, self._buffered)
        observer = run.observer = run_observer(slot.observer, log)
        watch = PreemptionWatch(slot.cluster, policy, observer, log)
        handover = NoticedHandOver(run, send, book, self.pruner.submit, watch)
        handover.observer = observer
        self.ctx = RunContext(slot, policy, run, spec, handover, meter, log, watch, observer)
        self.ctx.pruner = self.pruner
        self.recorder = Recorder(self.ctx, self.pruner) if spec.name is not None else None
        self._send = send
        self._on_end = on_end
        self._independent: IndependentRun | None = None

    async def main(self, previous: RunCore | None) -> None:
        """The driver task: never raises; the outcome goes to the iterator."""
        ctx = self.ctx
        run = ctx.run
        end: RunEnd | None = None
        ended: RunEnded | None = None
        traced: Opened | None = None
        try:
            with run.scope:
                if previous is not None:
                    await previous.finished.wait()
                    # Not held on: this frame stays in the traceback of the error that may end
                    # this run, and the run's state keeps that error, so every run that failed
                    # kept the one before it (an executor kept all its failed runs).
                    previous = None
                t0 = time.perf_counter()
                if self.recorder is not None:
                    await self.recorder.resume()
                ctx.meter.watch()
                traced = begin("asyncexec.run", run_id=run.run_id, executor=ctx.config.name)
                result = self._result(await self._work())
                run.result, run.state = result, RunState.FINISHED
                seconds = round(time.perf_counter() - t0, 3)
                ended = RunEnded("finished", result.steps, run.attempt, seconds)
                end = RunEnd(result, None)
            if end is None:
                run.state = RunState.CANCELLED
        except Exception as exc:
            error = exc if isinstance(exc, AsyncExecError) else _internal(exc)
            run.state, run.error = RunState.FAILED, error
            ended = RunEnded("failed", ctx.handover.steps, run.attempt, error=error)
            end = RunEnd(None, error)
        finally:
            if ended is None:  # cancelled, from the run's scope or from outside
                ended = RunEnded("cancelled", ctx.handover.steps, run.attempt)
            try:
                # A sink that raises (a processor of the application's logging) raises here,
                # after the run's span has ended and the teardown below has run.
                ctx.observer.emit(ended)
            finally:
                finish(traced, run.error)
                await self._end(end)

    async def _end(self, end: RunEnd | None) -> None:
        """The run's teardown, shielded and bounded."""
        ctx, run = self.ctx, self.ctx.run
        ctx.meter.unwatch()
        # bounded: the stop by stop_timeout_s, the datasets by shutdown_timeout_s (the record
        # is a small file written in a thread)
        with anyio.CancelScope(shield=True):
            if self.recorder is not None:
                await self.recorder.write(run.state.value)
            await self._stop_session()
            await self._release_datasets()
            run.end = end
            self._keep_restore_point()
            self._on_end(run)
            run.finished.set()
        self._send.close()
        self.pruner.release()

    async def _work(self) -> list[Any]:
        """The run's work, with its helpers beside it: the deletion of the checkpoints it no
        longer keeps (given ``shutdown_timeout_s`` to finish after the work), and a named run's
        record."""
        values: list[Any] = []
        error: Exception | None = None
        async with task_group() as helpers:
            helpers.start_soon(self.pruner.serve)
            async with task_group() as tg:
                if self.recorder is not None:
                    tg.start_soon(self.recorder.keep)
                try:
                    if self.ctx.spec.independent:
                        self._independent = IndependentRun(self.ctx)
                        values = await self._independent.main()
                    else:
                        base = self.recorder.attempt_base if self.recorder else 0
                        values = await AlignedRun(self.ctx, base).main()
                    if self.recorder is not None:
                        await self.recorder.taken()  # (its record kept meanwhile)
                except Exception as exc:  # raised below, not wrapped in the task group's group
                    error = exc
                tg.cancel_scope.cancel()
            if error is None and self.recorder is not None:
                await self.recorder.finish()  # (what it held back goes before the pruner ends)
            self.pruner.close()
            deadline = anyio.current_time() + self.ctx.config.shutdown_timeout_s
            helpers.cancel_scope.deadline = deadline
        if error is not None:
            raise error
        return values

    def _keep_restore_point(self) -> None:
        """Where this run left the roles' instances, for a rank replaced after it (a call that
        finds a dead rank outside a run) or a group started afresh: the run's latest
        checkpoint (each rank's own, for independent ranks), as a restart would restore them.
        A run that knew no checkpoint leaves the previous one."""
        ctx = self.ctx
        latest: Any = ctx.checkpoint
        if self._independent is not None:
            checkpoints = self._independent.checkpoints
            latest = PerRank(tuple(checkpoints)) if any(checkpoints) else None
        if latest is None:
            return
        ctx.slot.restore_from = latest
        group = ctx.slot.group
        if group is not None and not group.closed:
            group.restore_from = latest

    def _result(self, values: list[Any]) -> RunResult:
        run = self.ctx.run
        latest = self.ctx.checkpoint
        checkpoints: list[Checkpoint | None] = []
        if self._independent is not None:
            checkpoints = self._independent.checkpoints
            latest = checkpoints[0]
        return RunResult(
            run.run_id,
            values,
            latest,
            self.ctx.handover.steps,
            run.attempt,
            list(run.failures),
            checkpoints,
            list(self.ctx.preemption.notices),
        )

    # Metrics ----------------------------------------------------------------------------------

    def _held(self) -> int:
        """Reports the driver has received that the consumer has not taken: in complete steps,
        and those of ranks that are ahead of the others (read by a metrics scrape)."""
        ctx = self.ctx
        if not ctx.run.active:
            return 0
        group, window = ctx.group, ctx.window
        width = 1 if ctx.spec.independent or group is None else len(group.workers)
        held = max(0, ctx.handover.steps - ctx.run.consumed) * width
        if window is not None:
            held += sum(len(queue) for queue in window.asm.queues)
        return held

    async def _buffered(self) -> int:
        """Reports waiting in the workers' buffers for a poll (asked of each live worker)."""
        group = self.ctx.group
        if group is None or not self.ctx.run.active:
            return 0
        counts = [0] * len(group.workers)

        async def count(i: int, worker: WorkerInfo) -> None:
            with contextlib.suppress(AsyncExecError):  # a dead worker holds nothing
                counts[i] = await proxy(group, worker).buffered()

        async with task_group() as tg:
            for i, worker in enumerate(group.workers):
                tg.start_soon(count, i, worker)
        return sum(counts)

    # The end ----------------------------------------------------------------------------------

    async def _release_datasets(self) -> None:
        if self.ctx.spec.datasets:
            with anyio.move_on_after(self.ctx.config.shutdown_timeout_s):
                await release_shards(self.ctx.spec.datasets[0])

    async def _stop_session(self) -> None:
        """After a cancelled run: stop the function on every worker, or discard the group. A
        function that does not end in time is recorded as hung (in ``run.failures`` and the
        ``run_stop_timed_out`` event), with every rank's stack read before the group goes (in
        the error, and one ``run_stop_stack`` debug event a rank); a rank found dead is not."""
        ctx = self.ctx
        group = ctx.group
        if not ctx.session_live or group is None or group.closed:
            return
        ctx.session_live = False
        timeout = ctx.config.stop_timeout_s
        with hurried_away() as hurry:
            late = await group.stop_each(group.workers, timeout)
        if hurry.cancelled_caught:  # a second Ctrl-C: no waiting, no stacks
            ctx.log.warning("run_stop_hurried")
            await ctx.slot.discard(force=True)
        elif late:
            hung: list[AsyncExecError] = []
            detail = f"its function did not end within {timeout:g} s of the run being stopped"
            await declare_hung(group, [group.workers[r] for r in late], detail, hung.append)
            error = with_others(hung)
            ctx.run.failures.append(error)
            # The stacks (kilobytes each) go one rank an event, at debug, never in this line (a
            # log line is read by people and by log pipelines with line limits); it names them.
            ctx.log.warning(
                "run_stop_timed_out",
                seconds=timeout,
                ranks=late,
                error=describe(error),
                stacks_event="run_stop_stack",
            )
            for rank, stack in getattr(error, "stacks", {}).items():
                ctx.log.debug("run_stop_stack", rank=rank, stack=stack)
            await ctx.slot.discard(force=True)


def _internal(exc: Exception) -> AsyncExecError:
    """A failure that is none of asyncexec's known ones still ends the run with an asyncexec
    error (the original is its cause), never with a clean end or a foreign error."""
    error = AsyncExecError(f"the run failed: {describe(exc)}")
    error.__cause__ = exc
    return error
