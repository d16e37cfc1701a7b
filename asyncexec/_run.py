"""A run: the async iterator the caller reads, and the driver task that feeds it.

The driver task belongs to the executor's task group; the iterator only reads from a memory
stream that the driver writes to. So the caller's ``async for`` never yields from inside one of
our task groups or cancel scopes, and closing the iterator (``break``, ``aclose()``, garbage
collection) only has to cancel the driver's scope.

Steps travel in batches; consumption is acknowledged when the iterator asks for the next batch,
and each rank's pump asks its worker for reports only while that rank has credit left in the
window of ``buffer_size`` unconsumed reports.
"""

from __future__ import annotations

import enum
import inspect
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import tenacity
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._checkpoint import Checkpoint, join_path, remove_directory
from ._errors import (
    AsyncExecError,
    ExecutorStateError,
    RestartsExhaustedError,
    StartupTimeoutError,
    WorkerError,
    WorkerHungError,
    WorkerRaisedError,
)
from ._group import WorkerGroup
from ._reports import Assembly, RunResult, Step, StepBatch
from ._session import with_run

if TYPE_CHECKING:
    from ._executor import Executor

__all__ = ["Run", "RunCore", "RunDriver", "RunState"]

#: The most steps assembled and handed over at once; bounds the time the event loop is held.
_BATCH = 256


class RunState(enum.Enum):
    """Where a run is."""

    RUNNING = "running"
    RESTARTING = "restarting"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


class _End:
    __slots__ = ("error", "result")

    def __init__(self, result: RunResult | None, error: BaseException | None) -> None:
        self.result = result
        self.error = error


def takes_config(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is called with the run's config (it has a positional parameter)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params
    )


class RunCore:
    """A run's shared state: what the driver task and the executor hold. The iterator that the
    caller holds (:class:`Run`) refers to it, not the other way round, so dropping the iterator
    lets it be collected, which stops the run."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.state = RunState.RUNNING
        self.attempt = 1
        self.latest_checkpoint: Checkpoint | None = None
        self.result: RunResult | None = None
        self.error: BaseException | None = None
        self.failures: list[BaseException] = []
        self.end: _End | None = None
        self.closed = False
        self.scope = anyio.CancelScope()
        self.finished = anyio.Event()
        # Credit accounting between the iterator and the pumps (one event loop, no locks).
        self.handed = 0
        self.consumed = 0
        self._consumed_changed = anyio.Event()

    def mark_consumed(self) -> None:
        """Everything handed to the iterator so far has been taken by the consumer."""
        if self.consumed != self.handed:
            self.consumed = self.handed
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
    Breaking out of the loop and calling :meth:`aclose` (or ``async with run:``), cancelling the
    task that reads it, or dropping the iterator stops the run.
    """

    def __init__(self, core: RunCore, receive: MemoryObjectReceiveStream[Any]) -> None:
        self._core = core
        self._receive = receive
        self._batch: StepBatch | None = None
        self._pos = 0
        self._len = 0

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

    def __aiter__(self) -> Run:
        return self

    async def __anext__(self) -> Step:
        if self._pos < self._len:
            assert self._batch is not None
            step = self._batch.step(self._pos)
            self._pos += 1
            return step
        core = self._core
        if core.closed and core.end is None:
            raise StopAsyncIteration
        core.mark_consumed()
        try:
            item = await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            core.closed = True
            end = core.end
            if end is not None and end.error is not None:
                raise end.error from end.error.__cause__
            raise StopAsyncIteration from None
        batch: StepBatch = item
        self._batch, self._pos, self._len = batch, 1, len(batch)
        return batch.step(0)

    async def aclose(self) -> None:
        """Stop the run and wait until its workers have stopped (bounded by the executor's
        stop and shutdown deadlines)."""
        self._core.cancel()
        self._receive.close()
        with anyio.CancelScope(shield=True):
            await self._core.finished.wait()

    async def wait_finished(self) -> None:
        """Wait until the run has ended (finished, failed or cancelled), without consuming it."""
        await self._core.finished.wait()

    async def __aenter__(self) -> Run:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        core = self._core
        if not core.finished.is_set():
            core.cancel()


class RunDriver:
    """The task that runs one run's attempts and feeds its iterator."""

    def __init__(
        self,
        executor: Executor,
        run: RunCore,
        send: MemoryObjectSendStream[Any],
        fn: Callable[..., Any],
        config: Any,
        checkpoint: Checkpoint | None,
        buffer_size: int,
        datasets: Any,
    ) -> None:
        self.executor = executor
        self.run = run
        self.send = send
        self.fn = fn
        self.takes_config = takes_config(fn)
        self.config = config
        self.buffer_size = buffer_size
        self.datasets = datasets
        self.failures = run.failures  # shared with the iterator
        self.checkpoints: list[tuple[Checkpoint, Any]] = []
        self.latest = checkpoint
        self.steps = 0
        self.storage = join_path(executor.config.storage_path, run.run_id)
        self.log = executor.log.bind(run_id=run.run_id)
        self._group: WorkerGroup | None = None
        self._session_live = False
        self._unsent: list[StepBatch] = []
        self._pruned: list[str] = []

    async def main(self, previous: RunCore | None) -> None:
        """The driver task: never raises; the outcome goes to the iterator."""
        run = self.run
        end: _End | None = None
        try:
            with run.scope:
                if previous is not None:
                    await previous.finished.wait()
                t0 = time.perf_counter()
                self.log.info("run_started")
                values = await self._attempts()
                result = RunResult(
                    run.run_id, values, self.latest, self.steps, run.attempt, list(self.failures)
                )
                run.result = result
                run.state = RunState.FINISHED
                self.log.info(
                    "run_finished",
                    steps=self.steps,
                    attempts=run.attempt,
                    seconds=round(time.perf_counter() - t0, 3),
                )
                end = _End(result, None)
            if end is None:
                run.state = RunState.CANCELLED
                self.log.info("run_cancelled", steps=self.steps)
        except Exception as exc:
            run.state = RunState.FAILED
            run.error = exc
            self.log.warning(
                "run_failed", error=type(exc).__name__, detail=str(exc).splitlines()[0]
            )
            end = _End(None, exc)
        finally:
            with anyio.CancelScope(shield=True):
                await self._stop_session()
                if self.datasets:
                    from ._data import release_shards

                    with anyio.move_on_after(self.executor.config.shutdown_timeout_s):
                        await release_shards(self.datasets[0])
                self.executor._run_ended(run)
                run.finished.set()
            run.end = end
            self.send.close()

    async def _attempts(self) -> list[Any]:
        policy = self.executor.restart_policy
        retrying = policy.retrying(before_sleep=self._before_sleep)
        try:
            async for attempt in retrying:
                with attempt:
                    number = attempt.retry_state.attempt_number
                    self.run.attempt = number
                    try:
                        return await self._attempt(number)
                    except AsyncExecError as exc:
                        self.failures.append(exc)
                        self._log_failure(number, exc)
                        with anyio.CancelScope(shield=True):
                            await self.executor._recover_group(exc)
                        self._session_live = False
                        # Steps every rank completed before the failure are still delivered.
                        await self._drain()
                        raise
        except tenacity.RetryError:
            last = self.failures[-1] if self.failures else None
            raise RestartsExhaustedError(self.run.attempt, self.failures) from last
        raise AssertionError("unreachable: tenacity ended without an outcome")  # pragma: no cover

    def _log_failure(self, attempt: int, exc: AsyncExecError) -> None:
        fields: dict[str, Any] = {"attempt": attempt, "cause": type(exc).__name__}
        if isinstance(exc, WorkerError):
            fields.update(rank=exc.rank, node_id=exc.node_id, pid=exc.pid)
        self.log.warning("worker_failed", detail=str(exc).splitlines()[0], **fields)

    def _before_sleep(self, state: tenacity.RetryCallState) -> None:
        self.run.state = RunState.RESTARTING
        wait = state.next_action.sleep if state.next_action else 0.0
        self.log.warning(
            "restarting",
            attempt=state.attempt_number + 1,
            wait_s=round(wait, 3),
            checkpoint=self.latest.path if self.latest else None,
        )

    async def _attempt(self, number: int) -> list[Any]:
        group = await self.executor._acquire_group(number)
        self._group = group
        self.run.state = RunState.RUNNING
        n = len(group.workers)
        asm = Assembly(n, self.buffer_size, number, self.steps)
        consumed_base = self.run.handed
        shards = await self._dataset_shards(group)
        storage = str(self.storage)
        backend = self.executor.backend
        function_context = backend.function_context() if backend is not None else None
        failure: list[BaseException] = []

        def fail(exc: BaseException) -> None:
            if not failure:
                failure.append(exc)
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            # Health is watched from the first call on: a worker can die or hang (blocked in C
            # code holding the GIL) while its function is being started.
            tg.start_soon(group.watch, fail)
            try:
                self._session_live = True
                with anyio.fail_after(self.executor.config.start_timeout_s):
                    await group.run_backend_hook("on_training_start")
                    await group.call_each(
                        "start_run",
                        [
                            (
                                self.fn,
                                self.takes_config,
                                self.config,
                                with_run(w.context, self.run.run_id, number, storage),
                                self.latest,
                                self.buffer_size,
                                self.steps,
                                shards[w.rank],
                                function_context,
                            )
                            for w in group.workers
                        ],
                    )
                for rank in range(n):
                    tg.start_soon(self._pump, group, asm, rank, consumed_base, fail)
                if self.executor.config.step_timeout_s is not None:
                    tg.start_soon(self._deadline, group, asm, consumed_base, fail)
                await self._assemble(group, asm)
            except AsyncExecError as exc:
                fail(exc)
            except TimeoutError:
                fail(
                    StartupTimeoutError(
                        "starting the function on the workers", self.executor.config.start_timeout_s
                    )
                )
            tg.cancel_scope.cancel()
        if failure:
            self._queue(asm.take(asm.ready))
            error = failure[0]
            if isinstance(error, WorkerRaisedError):
                # A peer's death surfaces first as an error in the survivors' collectives.
                with anyio.CancelScope(shield=True):
                    dead = await group.find_dead()
                if dead is not None:
                    dead.__context__ = error
                    error = dead
            raise error
        self._session_live = False
        return [o[1] for o in asm.outcomes if o is not None]

    async def _dataset_shards(self, group: WorkerGroup) -> list[dict[str, Any]]:
        """Each rank's dataset shards, made anew for every attempt (for the new workers' nodes)."""
        if not self.datasets:
            return [{} for _ in group.workers]
        from ._data import make_shards

        datasets, data_config = self.datasets
        return await make_shards(datasets, data_config, group)

    def _credit(self, asm: Assembly, rank: int, consumed_base: int) -> int:
        consumed = max(0, self.run.consumed - consumed_base)
        return self.buffer_size - (asm.received[rank] - consumed)

    async def _pump(
        self,
        group: WorkerGroup,
        asm: Assembly,
        rank: int,
        consumed_base: int,
        fail: Callable[[BaseException], None],
    ) -> None:
        actor = group.workers[rank].actor
        try:
            while True:
                while (credit := self._credit(asm, rank, consumed_base)) <= 0:
                    await self.run.wait_consumed()
                ack = max(0, self.run.consumed - consumed_base)
                result = await actor.poll.remote(ack, credit)
                asm.add(rank, result)
                outcome = result[3]
                if outcome is not None:
                    if outcome[0] != "ok":
                        fail(self._outcome_error(group, rank, outcome))
                    return
        except Exception as exc:
            fail(await group.classify(rank, exc))

    def _outcome_error(
        self, group: WorkerGroup, rank: int, outcome: tuple[Any, ...]
    ) -> WorkerError:
        if outcome[0] == "error":
            error, remote_tb = outcome[1], outcome[2]
            return group.worker_error(
                WorkerRaisedError,
                rank,
                f"{type(error).__name__}: {error}",
                error=error,
                remote_traceback=remote_tb,
            )
        return group.worker_error(WorkerRaisedError, rank, "the function was stopped")

    async def _deadline(
        self,
        group: WorkerGroup,
        asm: Assembly,
        consumed_base: int,
        fail: Callable[[BaseException], None],
    ) -> None:
        timeout = self.executor.config.step_timeout_s
        assert timeout is not None
        while True:
            await anyio.sleep(min(timeout / 4, 1.0))
            now = time.monotonic()
            for rank in range(len(group.workers)):
                if asm.outcomes[rank] is not None:
                    continue
                if self._credit(asm, rank, consumed_base) <= 0:
                    asm.last_report[rank] = now  # waiting for our consumer, not hung
                    continue
                if now - asm.last_report[rank] > timeout:
                    fail(
                        group.worker_error(
                            WorkerHungError, rank, f"no report for {timeout:g} s (step deadline)"
                        )
                    )
                    return

    async def _assemble(self, group: WorkerGroup, asm: Assembly) -> None:
        while True:
            asm.check()
            while asm.ready:
                self._queue(asm.take(_BATCH))
                await self._drain()
            if asm.finished:
                asm.check()
                return
            await asm.wait_changed()

    def _queue(self, steps: StepBatch) -> None:
        """Take complete steps into the run: they count, their checkpoints become the latest,
        and they wait in ``_unsent`` until the iterator has them (see :meth:`_drain`)."""
        for batch in steps.split(_BATCH):
            if len(batch):
                self._pruned.extend(self._track_checkpoints(batch))
                self.steps += len(batch)
                self._unsent.append(batch)

    async def _drain(self) -> None:
        """Hand the queued steps to the iterator, waiting for the consumer. A batch leaves the
        queue only once the iterator has it: when a failure cancels the wait, the steps stay
        queued and are handed over after the failed group is gone."""
        while self._unsent:
            await self.send.send(self._unsent[0])
            self.run.handed += len(self._unsent.pop(0))
            if self._pruned:
                pruned, self._pruned = self._pruned, []
                await anyio.to_thread.run_sync(_remove_dirs, pruned)

    def _track_checkpoints(self, batch: StepBatch) -> list[str]:
        """Record the batch's checkpoints; return the directories the retention policy drops.

        The latest checkpoint is always kept (a restart resumes from it), beside the
        ``num_to_keep`` most recent, or best by ``score_attribute`` (rank 0's metric)."""
        if not batch.checkpoints:
            return []
        policy = self.executor.config.checkpoint
        for i in sorted(batch.checkpoints):
            checkpoint = batch.checkpoints[i][0]
            self.latest = checkpoint
            self.run.latest_checkpoint = checkpoint
            self.checkpoints.append((checkpoint, batch.rows[i][0]))
        keep = policy.num_to_keep
        if keep is None or len(self.checkpoints) <= keep:
            return []
        if policy.score_attribute is None:
            kept = self.checkpoints[-keep:]
        else:
            sign = 1.0 if policy.score_order == "max" else -1.0
            attribute = policy.score_attribute
            ranked = sorted(
                self.checkpoints, key=lambda c: _score(c[1], attribute, sign), reverse=True
            )
            kept = ranked[:keep]
            if self.checkpoints[-1] not in kept:
                kept.append(self.checkpoints[-1])
        dropped = [c[0].path for c in self.checkpoints if c not in kept]
        self.checkpoints = [c for c in self.checkpoints if c in kept]
        return dropped

    async def _stop_session(self) -> None:
        """After a cancelled run: stop the function on every worker, or discard the group."""
        group = self._group
        if not self._session_live or group is None or group.closed:
            return
        self._session_live = False
        timeout = self.executor.config.stop_timeout_s
        stopped = False
        with anyio.move_on_after(timeout + 5):
            try:
                stopped = all(await group.call_each("stop_run", [(timeout,)] * len(group.workers)))
            except AsyncExecError:
                stopped = False
        if not stopped:
            self.log.warning("run_stop_timed_out", seconds=timeout)
            await self.executor._discard_group(force=True)


def _score(metrics: Any, attribute: str, sign: float) -> float:
    """Higher is better; a missing or non-numeric score is the worst."""
    value = metrics.get(attribute) if isinstance(metrics, dict) else None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return sign * float(value)
    return float("-inf")


def _remove_dirs(paths: list[str]) -> None:
    for path in paths:
        remove_directory(path)


def new_run_id() -> str:
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
