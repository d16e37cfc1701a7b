"""The task that drives one run: its attempts under the restart policy, each attempt's start,
pumps and watchers, and the run's end.

The task belongs to the executor's task group and never raises: the run's outcome goes to the
iterator (:class:`~asyncexec._driver._run.Run`) through the memory stream and ``RunCore.end``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import anyio
import ray
import tenacity
from anyio.streams.memory import MemoryObjectSendStream

from .._checkpoint import Checkpoint, CheckpointBook, join_path
from .._config import ExecutorConfig
from .._errors import (
    AsyncExecError,
    ConfigurationError,
    RestartsExhaustedError,
    StartupTimeoutError,
    WorkerError,
    WorkerRaisedError,
    describe,
)
from .._protocol import RunStart
from ..backends._base import Backend
from ._elastic import Resize
from ._group import WorkerGroup, with_others
from ._health import declare_hung, find_dead, watch, watch_steps
from ._independent import IndependentRun
from ._interrupt import hurried_away
from ._metrics import RunMeter, metrics
from ._prune import Pruner
from ._restart import RestartPolicy
from ._resume import (
    RECORD_INTERVAL_S,
    Resume,
    RunRecord,
    decide,
    load_record,
    save_record,
    stray_checkpoints,
)
from ._run import RunCore, RunEnd, RunState
from ._slot import GroupSlot
from ._window import HandOver, Window

__all__ = ["RunDriver", "RunSpec"]

#: After a first failure, how long other ranks' failures are still collected before the attempt
#: is torn down, so that ranks that fail together (in one collective, on one bad batch) are all
#: recorded. Short after a death (a restart should not wait), longer after the user's function
#: raised (the ranks' own errors, which end the run by default, arrive within scheduling jitter).
#: The largest pickled function and config sent inline with each rank's call (Ray's own bound
#: for inlining a call's arguments is 100 KiB); a larger one goes through the object store once.
INLINE_PAYLOAD_BYTES = 64 * 1024
DEATH_SETTLE_S = 0.02
RAISED_SETTLE_S = 0.2


@dataclass(frozen=True)
class RunSpec:
    """What ``Executor.run()`` checked and prepared for the driver task."""

    payload: bytes  # the function and its config, pickled once
    checkpoint: Checkpoint | None
    buffer_size: int
    datasets: Any  # (prepared datasets, DataConfig) or None
    independent: bool = False  # ranks replaced on their own, an unaligned stream
    name: str | None = None  # a named run keeps a record to resume from (see _resume)
    resume: Resume = "auto"
    #: The config's fingerprint (then the form records written before 0.2 hold).
    fingerprints: tuple[str, ...] = ()


class RunDriver:
    """Runs one run's attempts and feeds its iterator."""

    def __init__(
        self,
        slot: GroupSlot,
        policy: RestartPolicy,
        run: RunCore,
        send: MemoryObjectSendStream[Any],
        spec: RunSpec,
        on_end: Callable[[RunCore], None],
    ) -> None:
        self.slot = slot
        self.config: ExecutorConfig = slot.config
        self.backend: Backend | None = slot.backend
        self.policy = policy
        self.run = run
        self.spec = spec
        self.latest = spec.checkpoint
        self.storage = join_path(self.config.storage_path, run.run_id)
        self.log = slot.log.bind(run_id=run.run_id)
        ckpt = self.config.checkpoint
        book = CheckpointBook(ckpt.num_to_keep, ckpt.score_attribute, ckpt.score_order)
        self.pruner = Pruner(self.log)
        self.handover = HandOver(run, send, book, self.pruner.submit)
        self._send = send
        self._on_end = on_end
        self._payload: Any = None
        self._group: WorkerGroup | None = None
        self._session_live = False
        #: Attempts of this run before this driver's (a resumed run's dead drivers').
        self._independent: IndependentRun | None = None
        self._attempt_base = 0
        self._resizes = 0  # planned resizes: attempts the restart policy does not count
        self._steps_base = 0  # and the steps they delivered
        self._record: RunRecord | None = None
        self._record_now = anyio.Event()
        self.handover.on_checkpoint = lambda: self._record_now.set()
        self.meter = RunMeter(self.config.name, self._held, self._buffered)
        self._window: Window | None = None  # the current attempt's (aligned runs)
        if metrics() is not None:
            self.handover.meter = self.meter

    async def main(self, previous: RunCore | None) -> None:
        """The driver task: never raises; the outcome goes to the iterator."""
        run = self.run
        end: RunEnd | None = None
        try:
            with run.scope:
                if previous is not None:
                    await previous.finished.wait()
                t0 = time.perf_counter()
                if self.spec.name is not None:
                    await self._resume()
                self.meter.watch()
                self.log.info("run_started")
                values = await self._recorded()
                result = self._result(values)
                run.result, run.state = result, RunState.FINISHED
                seconds = round(time.perf_counter() - t0, 3)
                self.log.info(
                    "run_finished", steps=result.steps, attempts=run.attempt, seconds=seconds
                )
                end = RunEnd(result, None)
            if end is None:
                run.state = RunState.CANCELLED
                self.log.info("run_cancelled", steps=self.handover.steps)
        except Exception as exc:
            error = exc if isinstance(exc, AsyncExecError) else _internal(exc)
            run.state, run.error = RunState.FAILED, error
            self.log.warning("run_failed", error=describe(error))
            end = RunEnd(None, error)
        finally:
            self.meter.unwatch()
            with anyio.CancelScope(shield=True):
                if self._record is not None:
                    await self._write_record(run.state.value)
                await self._stop_session()
                await self._release_datasets()
                run.end = end
                self._on_end(run)
                run.finished.set()
            self._send.close()

    def _held(self) -> int:
        """Reports the driver has received that the consumer has not taken: in complete steps,
        and those of ranks that are ahead of the others (read by a metrics scrape)."""
        if not self.run.active:
            return 0
        group, window = self._group, self._window
        width = 1 if self.spec.independent or group is None else len(group.workers)
        held = max(0, self.handover.steps - self.run.consumed) * width
        if window is not None:
            held += sum(len(queue) for queue in window.asm.queues)
        return held

    async def _buffered(self) -> int:
        """Reports waiting in the workers' buffers for a poll (asked of each live worker)."""
        group = self._group
        if group is None or not self.run.active:
            return 0
        counts = [0] * len(group.workers)

        async def count(i: int, actor: Any) -> None:
            with contextlib.suppress(Exception):  # a dead worker holds nothing
                counts[i] = await actor.buffered.remote()

        async with anyio.create_task_group() as tg:
            for i, worker in enumerate(group.workers):
                tg.start_soon(count, i, worker.actor)
        return sum(counts)

    async def _resume(self) -> None:
        """A named run: resume from its record when a dead driver left one, else start one.

        Raises:
            ConfigurationError: the run already finished, or was started with another config.
        """
        name = self.spec.name
        assert name is not None
        storage = self.config.storage_path
        record = await anyio.to_thread.run_sync(load_record, storage, name)
        fingerprints = self.spec.fingerprints
        previous = decide(record, name, fingerprints, self.spec.resume)
        run = self.run
        if previous is None:
            self._record = RunRecord(name, "running", 0, 0, None, fingerprints[0])
        else:
            # The record takes this config's fingerprint (a legacy one, or a forced resume).
            self._record = previous.advanced(status="running", fingerprint=fingerprints[0])
            self._attempt_base = previous.attempt
            run.attempt = previous.attempt
            if previous.checkpoint is not None:
                self.latest = Checkpoint(previous.checkpoint)
                run.latest_index = previous.resume_index() - 1
            # What the dead driver kept still counts (and is pruned as newer ones come); what it
            # had dropped but not yet deleted goes now.
            self.handover.book.kept = [(Checkpoint(path), m) for path, m in previous.kept]
            try:
                stray = await anyio.to_thread.run_sync(stray_checkpoints, storage, previous)
            except OSError as exc:
                self.log.warning("checkpoint_listing_failed", error=describe(exc))
            else:
                self.pruner.submit(stray)
            # The stream goes on from the step after the latest checkpoint: the work the
            # function does from there has the indices it had in the dead driver's stream.
            index = previous.resume_index()
            self.handover.steps = self._steps_base = index
            run.handed = run.consumed = run.received_upto = index
            self.log.warning(
                "run_resumed",
                index=index,
                delivered=previous.steps,
                attempt=previous.attempt,
                checkpoint=previous.checkpoint,
            )
        await self._write_record("running")

    async def _work(self) -> list[Any]:
        if self.spec.independent:
            self._independent = IndependentRun(self)
            return await self._independent.main()
        return await self._attempts()

    async def _recorded(self) -> list[Any]:
        """The run's work, with its helpers beside it: the deletion of the checkpoints it no
        longer keeps (given ``shutdown_timeout_s`` to finish after the work), and a named
        run's record."""
        values: list[Any] = []
        error: Exception | None = None
        async with anyio.create_task_group() as helpers:
            helpers.start_soon(self.pruner.serve)
            async with anyio.create_task_group() as tg:
                if self._record is not None:
                    tg.start_soon(self._keep_record)
                try:
                    values = await self._work()
                except Exception as exc:  # raised below, not wrapped in the task group's group
                    error = exc
                tg.cancel_scope.cancel()
            self.pruner.close()
            helpers.cancel_scope.deadline = anyio.current_time() + self.config.shutdown_timeout_s
        if error is not None:
            raise error
        return values

    async def _keep_record(self) -> None:
        """Write the record when a checkpoint becomes the latest, and every
        ``RECORD_INTERVAL_S`` while steps flow."""
        while True:
            with anyio.move_on_after(RECORD_INTERVAL_S):
                await self._record_now.wait()
            self._record_now = anyio.Event()
            await self._write_record("running")

    async def _write_record(self, status: str) -> None:
        record = self._record
        if record is None:
            return
        run = self.run
        latest = run.latest_checkpoint or self.latest
        updated = record.advanced(
            status=status,
            steps=self._steps_base + run.delivered,
            attempt=run.attempt,
            checkpoint=latest.path if latest is not None else None,
            checkpoint_index=run.latest_index,
            kept=self._kept(),
        )
        if (updated.steps, updated.attempt, updated.checkpoint, updated.status) == (
            record.steps,
            record.attempt,
            record.checkpoint,
            record.status,
        ) and status == "running" and record.updated:
            return
        self._record = updated
        try:
            await anyio.to_thread.run_sync(save_record, self.config.storage_path, updated)
        except OSError as exc:
            self.log.warning("run_record_failed", error=describe(exc))

    def _kept(self) -> list[list[Any]]:
        """The checkpoints the run keeps, as a record holds them: the path, and the score the
        book ranks them by (only that metric: a record is small)."""
        score = self.config.checkpoint.score_attribute
        kept = []
        for checkpoint, reported in self.handover.book.kept:
            value = reported.get(score) if score and isinstance(reported, dict) else None
            kept.append([checkpoint.path, {} if value is None else {score: value}])
        return kept

    def _result(self, values: list[Any]) -> Any:
        from ._steps import RunResult

        run = self.run
        latest = run.latest_checkpoint or self.latest
        checkpoints: list[Checkpoint | None] = []
        if self._independent is not None:
            checkpoints = self._independent.checkpoints
            latest = checkpoints[0]
        return RunResult(
            run.run_id,
            values,
            latest,
            self.handover.steps,
            run.attempt,
            list(run.failures),
            checkpoints,
        )

    async def _attempts(self) -> list[Any]:
        progressed = False  # whether the attempt that failed last completed a step

        retrying = self.policy.retrying(
            before_sleep=self._before_sleep, progressed=lambda: progressed
        )
        try:
            async for attempt in retrying:
                with attempt:
                    number = self._attempt_base + attempt.retry_state.attempt_number
                    number += self._resizes
                    self.run.attempt = number
                    steps_before = self.handover.steps
                    try:
                        return await self._resizing(number)
                    except AsyncExecError as exc:
                        progressed = self.handover.steps > steps_before
                        self.run.failures.append(exc)
                        with anyio.CancelScope(shield=True):
                            await self.slot.recover(
                                exc, reuse_survivors=self.policy.reuse_survivors
                            )
                        self._session_live = False
                        # Steps every rank completed before the failure are still delivered.
                        await self.handover.drain()
                        raise
        except tenacity.RetryError:
            failures = self.run.failures
            last = failures[-1] if failures else None
            raise RestartsExhaustedError(self.run.attempt, failures) from last
        raise AssertionError("unreachable: tenacity ended without an outcome")  # pragma: no cover

    def _before_sleep(self, state: tenacity.RetryCallState) -> None:
        self.run.state = RunState.RESTARTING
        if state.outcome is not None and state.outcome.failed:
            self.meter.failed(state.outcome.exception())
        wait = state.next_action.sleep if state.next_action else 0.0
        latest = self.run.latest_checkpoint or self.latest
        self.log.warning(
            "restarting",
            attempt=self._attempt_base + state.attempt_number + self._resizes + 1,
            wait_s=round(wait, 3),
            checkpoint=latest.path if latest else None,
        )

    async def _resizing(self, number: int) -> list[Any]:
        """Attempt ``number``, and after each planned resize of an elastic group the next
        attempt, on the new group: a resize is not a failure, so the restart policy does not
        count it (nor wait before it)."""
        while True:
            try:
                return await self._attempt(number)
            except Resize as resize:
                self.run.state = RunState.RESTARTING
                group = self._group
                assert group is not None
                latest = self.run.latest_checkpoint or self.latest
                self.log.info(
                    "resizing",
                    from_workers=len(group.workers),
                    fitting=resize.size,
                    attempt=number + 1,
                    checkpoint=latest.path if latest else None,
                )
                with anyio.CancelScope(shield=True):
                    timeout = self.config.stop_timeout_s
                    stopped = await group.stop_functions(group.workers, timeout)
                    self._session_live = False
                    await self.slot.resize(force=not stopped)
                await self.handover.drain()
                self._resizes += 1
                number += 1
                self.run.attempt = number

    async def _put_payload(self) -> Any:
        """The function and config as each rank gets them: a small payload travels inline with
        the call (a put object would cost every rank a fetch from the driver: measured 15-20 ms
        of a warm executor's 35-50 ms from run() to the first step); a large one is put in
        Ray's object store once per run (every rank and attempt reads the same object; the put
        is off the loop)."""
        if self._payload is None:
            payload = self.spec.payload
            if len(payload) <= INLINE_PAYLOAD_BYTES or self.config.local:
                self._payload = payload
            else:
                self._payload = await anyio.to_thread.run_sync(ray.put, payload)
        return self._payload

    async def _attempt(self, number: int) -> list[Any]:
        try:
            group = await self.slot.acquire(number)
        except AsyncExecError as exc:  # the group did not start: logged like a worker's failure
            self._log_failure(exc)
            raise
        self._group = group
        self.run.state = RunState.RUNNING
        window = self._window = Window(self.run, group, self.spec.buffer_size, self.handover.steps)
        shards = await self._dataset_shards(group)
        payload = await self._put_payload()
        latest = self.run.latest_checkpoint or self.latest
        function_context = self.backend.function_context() if self.backend else None
        failures: list[AsyncExecError] = []
        failed = anyio.Event()
        grown: list[int] = []  # an elastic group's size once more workers would fit
        finished = False

        def grow(size: int) -> None:
            grown.append(size)
            tg.cancel_scope.cancel()

        def fail(exc: AsyncExecError) -> None:
            rank = getattr(exc, "rank", None)
            if rank is None or all(getattr(f, "rank", None) != rank for f in failures):
                failures.append(exc)
            failed.set()

        async def settle_then_cancel() -> None:
            await failed.wait()
            raised = isinstance(failures[0], WorkerRaisedError)
            await anyio.sleep(RAISED_SETTLE_S if raised else DEATH_SETTLE_S)
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(settle_then_cancel)
            # Health is watched from the first call on: a worker can die or hang (blocked in C
            # code holding the GIL) while its function is being started.
            tg.start_soon(watch, group, fail)
            try:
                self._session_live = True
                with _startup_deadline(self.config.start_timeout_s):
                    await group.run_backend_hook("on_training_start")
                    for join in self.slot.joiners:  # a channel's latest version, first
                        await join(group)
                    starts = [
                        RunStart(
                            replace(
                                w.context,
                                run_id=self.run.run_id,
                                attempt=number,
                                storage_path=self.storage,
                            ),
                            latest,
                            self.spec.buffer_size,
                            self.handover.steps,
                            shards[w.rank],
                            function_context,
                        )
                        for w in group.workers
                    ]
                    await group.call_each("start_run", [(payload, s) for s in starts])
                self.slot.start_refills()
                for rank in range(len(group.workers)):
                    tg.start_soon(window.pump, rank, fail)
                if self.config.step_timeout_s is not None:
                    tg.start_soon(watch_steps, group, window, self.config.step_timeout_s, fail)
                if self.slot.sizer is not None:
                    tg.start_soon(self.slot.sizer.watch_growth, group, grow)
                await window.assemble(self.handover)
                finished = True
            except AsyncExecError as exc:
                fail(exc)
            tg.cancel_scope.cancel()
        if failures:
            self.handover.queue(window.asm.take(window.asm.ready))
            raise await self._blame(group, failures)
        if grown and not finished:  # a safe point: restart from the latest checkpoint
            self.handover.queue(window.asm.take(window.asm.ready))
            raise Resize(grown[0])
        self._session_live = False
        return window.asm.values()

    async def _blame(self, group: WorkerGroup, failures: list[AsyncExecError]) -> AsyncExecError:
        """The attempt's error: the first failure (a dead peer rather than the survivor's failed
        collective that echoes its death), with the others attached; each is logged."""
        first = failures[0]
        if isinstance(first, WorkerRaisedError):
            # A peer's death surfaces first as an error in the survivors' collectives.
            with anyio.CancelScope(shield=True):
                dead = await find_dead(group)
            if dead is not None:
                dead.__context__ = first
                # The dead rank first, once (its death may have been seen already).
                others = [f for f in failures if getattr(f, "rank", None) != dead.rank]
                failures[:] = [dead, *others]
        for failure in failures:
            self._log_failure(failure)
        return with_others(failures)

    def _log_failure(self, exc: AsyncExecError) -> None:
        fields: dict[str, Any] = {"attempt": self.run.attempt, "cause": type(exc).__name__}
        if isinstance(exc, WorkerError):
            fields.update(rank=exc.rank, node_id=exc.node_id, pid=exc.pid)
        self.log.warning("worker_failed", detail=describe(exc), **fields)

    async def _dataset_shards(self, group: WorkerGroup) -> list[dict[str, Any]]:
        """Each rank's dataset shards, made anew for every attempt (for the new workers' nodes)."""
        if not self.spec.datasets:
            return [{} for _ in group.workers]
        from ._data import make_shards

        datasets, data_config = self.spec.datasets
        try:
            return await make_shards(datasets, data_config, group)
        except AsyncExecError:
            raise
        except Exception as exc:
            name = type(data_config).__name__
            raise ConfigurationError(f"{name}.configure() failed: {describe(exc)}") from exc

    async def _release_datasets(self) -> None:
        if self.spec.datasets:
            from ._data import release_shards

            with anyio.move_on_after(self.config.shutdown_timeout_s):
                await release_shards(self.spec.datasets[0])

    async def _stop_session(self) -> None:
        """After a cancelled run: stop the function on every worker, or discard the group. A
        function that does not end in time is recorded as hung (in ``run.failures`` and the
        ``run_stop_timed_out`` event), with every rank's stack read before the group goes."""
        group = self._group
        if not self._session_live or group is None or group.closed:
            return
        self._session_live = False
        timeout = self.config.stop_timeout_s
        with hurried_away() as hurry:
            late = await group.stop_each(group.workers, timeout)
        if hurry.cancelled_caught:  # a second Ctrl-C: no waiting, no stacks
            self.log.warning("run_stop_hurried")
            await self.slot.discard(force=True)
        elif late:
            hung: list[AsyncExecError] = []
            detail = f"its function did not end within {timeout:g} s of the run being stopped"
            await declare_hung(group, [group.workers[r] for r in late], detail, hung.append)
            error = with_others(hung)
            self.run.failures.append(error)
            stacks = getattr(error, "stacks", {})
            self.log.warning(
                "run_stop_timed_out",
                seconds=timeout,
                ranks=late,
                error=describe(error),
                stacks=stacks,
            )
            await self.slot.discard(force=True)


@contextlib.contextmanager
def _startup_deadline(timeout_s: float) -> Iterator[None]:
    """The deadline of starting an attempt's functions: a :class:`StartupTimeoutError` when it
    passes (and only then: a ``TimeoutError`` raised by anything after the start is not one)."""
    scope = anyio.CancelScope(deadline=anyio.current_time() + timeout_s)
    with scope:
        yield
    if scope.cancelled_caught:
        raise StartupTimeoutError("starting the function on the workers", timeout_s)


def _internal(exc: Exception) -> AsyncExecError:
    """A failure that is none of asyncexec's known ones still ends the run with an asyncexec
    error (the original is its cause), never with a clean end or a foreign error."""
    error = AsyncExecError(f"the run failed: {describe(exc)}")
    error.__cause__ = exc
    return error
