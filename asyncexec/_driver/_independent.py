"""Runs of independent ranks: a failed rank is replaced on its own while the others go on, and
the stream is unaligned (each report as soon as it arrives, with its rank).

Rollout workers, evaluation and data generation do not talk to each other, so one rank's crash
is no reason to stop the others. In such a run (``run(..., independent=True)``):

- each rank lives under the restart policy of its own: when it crashes, hangs or is lost (or
  raises, when the policy restarts on user errors), a standby spare on its node, or else a fresh
  process in its bundle, takes its place, and only its function starts again, from the rank's own
  latest checkpoint; the other ranks' functions are never stopped;
- the stream yields each report as soon as it arrives, as a :class:`Step` with one report:
  ``Step.index`` is the report's position in the run's stream (arrival order, over every rank),
  ``Step.rank`` its rank, ``Step.attempt`` the rank's attempt (1, then 2 after its first
  replacement, ...), ``Step.checkpoint`` the rank's checkpoint if the report carried one;
- each rank's checkpoints are its own (persisted under ``<run>/rank_<r>/``, kept by
  ``CheckpointConfig`` per rank) and a replaced rank's function starts from its rank's latest;
- the credit window is per rank: a rank may have ``buffer_size`` reports the consumer has not
  taken, counted in the order the stream delivers them;
- the result's ``return_values`` are each rank's last function's, ``checkpoints`` each rank's
  latest, ``checkpoint`` rank 0's, ``attempts`` 1 plus the replacements, ``failures`` every rank
  failure in order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import anyio
import tenacity

from .._checkpoint import Checkpoint, CheckpointBook, join_path
from .._errors import (
    AsyncExecError,
    ExecutorStateError,
    RestartsExhaustedError,
    StartupError,
    describe,
)
from .._protocol import Poll, RunStart
from ._boundary import call_error, outcome_error
from ._group import WorkerGroup
from ._health import _ping
from ._run import RunState
from ._steps import StepBatch
from ._window import POLL_CREDIT_SHARE, _versions_of, poll_rank

if TYPE_CHECKING:
    from ._attempts import RunDriver

__all__ = ["IndependentRun"]


class IndependentRun:
    """Drives one run of independent ranks (see the module's docstring)."""

    def __init__(self, driver: RunDriver) -> None:
        self.d = driver
        self.run = driver.run
        self.config = driver.config
        self.handover = driver.handover
        ckpt = self.config.checkpoint
        # Checkpoints are kept per rank here: the hand-over's book (rank 0's) prunes none.
        self.handover.book = CheckpointBook(None, None, "max")
        n = self.config.num_workers
        self.books = [
            CheckpointBook(ckpt.num_to_keep, ckpt.score_attribute, ckpt.score_order)
            for _ in range(n)
        ]
        self.latest: list[Checkpoint | None] = [driver.latest] * n
        self.values: list[Any] = [None] * n
        self.attempts = [1] * n
        self.generation = [0] * n  # the worker of each rank: 0, then 1 after its replacement ...
        self.delivered = [0] * n  # reports of each rank, over its generations
        self.received: dict[tuple[int, int], int] = {}
        self.consumed: dict[tuple[int, int], int] = {}
        self.marks: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.arrivals: deque[list[int]] = deque()  # [rank, generation, count] in stream order
        self.accounted = self.handover.steps
        self.error: AsyncExecError | None = None
        self._changed = anyio.Event()
        self._drain_lock = anyio.Lock()
        self._min_poll = 1

    async def main(self) -> list[Any]:
        """Start every rank, keep each alive under the policy; each rank's return value."""
        group = await self.d.slot.acquire(1)
        self.d._group = group
        self.run.state = RunState.RUNNING
        payload = await self.d._put_payload()
        self._min_poll = max(1, int(self.d.spec.buffer_size * POLL_CREDIT_SHARE))
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._account)
            async with anyio.create_task_group() as lives:
                for rank in range(len(group.workers)):
                    lives.start_soon(self._life, rank, group, payload, lives.cancel_scope)
            tg.cancel_scope.cancel()
        if self.error is not None:
            raise self.error
        return self.values

    @property
    def checkpoints(self) -> list[Checkpoint | None]:
        return list(self.latest)

    # One rank's life ---------------------------------------------------------------------------

    async def _life(
        self, rank: int, group: WorkerGroup, payload: Any, lives: anyio.CancelScope
    ) -> None:
        progressed = [False]
        failures: list[BaseException] = []

        def before_sleep(state: tenacity.RetryCallState) -> None:
            wait = state.next_action.sleep if state.next_action else 0.0
            if state.outcome is not None and state.outcome.failed:
                self.d.meter.failed(state.outcome.exception())
            self.d.log.warning(
                "rank_restarting", rank=rank, attempt=state.attempt_number + 1, wait_s=wait
            )

        retrying = self.d.policy.retrying(before_sleep, lambda: progressed[0])
        try:
            try:
                async for attempt in retrying:
                    with attempt:
                        number = attempt.retry_state.attempt_number
                        before = self.delivered[rank]
                        try:
                            self.values[rank] = await self._attempt(rank, number, group, payload)
                            return
                        except AsyncExecError as exc:
                            progressed[0] = self.delivered[rank] > before
                            failures.append(exc)
                            self.run.failures.append(exc)
                            self.d._log_failure(exc)
                            raise
            except tenacity.RetryError:
                last = failures[-1] if failures else None
                raise RestartsExhaustedError(self.attempts[rank], failures) from last
        except AsyncExecError as exc:
            if self.error is None:
                self.error = exc
            lives.cancel()

    async def _attempt(self, rank: int, number: int, group: WorkerGroup, payload: Any) -> Any:
        if number > 1:
            await self._renew(rank, group)
            self.attempts[rank] = number
            self.run.attempt = 1 + sum(a - 1 for a in self.attempts)
        worker = group.workers[rank]
        key = (rank, self.generation[rank])
        self.received[key] = self.consumed[key] = 0
        function_context = self.d.backend.function_context() if self.d.backend else None
        start = RunStart(
            replace(
                worker.context,
                run_id=self.run.run_id,
                attempt=number,
                storage_path=join_path(self.d.storage, f"rank_{rank}"),
            ),
            self.latest[rank],
            self.d.spec.buffer_size,
            self.delivered[rank],
            {},
            function_context,
        )
        failed: list[AsyncExecError] = []

        def fail(exc: AsyncExecError) -> None:
            if not failed:
                failed.append(exc)
            tg.cancel_scope.cancel()

        value: list[Any] = [None]
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch, group, rank, fail)
            try:
                with anyio.fail_after(self.config.start_timeout_s):
                    for join in self.d.slot.joiners:  # a channel's latest version, first
                        await join(group)
                    await group.gather([worker.actor.start_run.remote(payload, start)], [worker])
                self.d._session_live = True
                value[0] = await self._pump(rank, key, number, group, fail)
            except AsyncExecError as exc:
                fail(exc)
            except TimeoutError:
                fail(StartupError(f"starting rank {rank}'s function timed out"))
            tg.cancel_scope.cancel()
        if failed:
            raise failed[0]
        return value[0]

    async def _renew(self, rank: int, group: WorkerGroup) -> None:
        """Put a spare or a fresh process in ``rank``'s place; the others keep running."""
        spares = len(group.spares)
        try:
            freed = await group.renew_rank(rank)
        except Exception as exc:
            error = StartupError(f"replacing rank {rank}: {describe(exc)}")
            error.__cause__ = exc
            raise error from exc
        if freed is None:
            raise ExecutorStateError(
                f"rank {rank} cannot be replaced on its own: no standby spare fits and it has no "
                "bundle of its own (leased from a pool, or in a parent placement group)"
            )
        self.generation[rank] += 1
        self.d.slot.restarts += 1
        if len(group.spares) < spares and self.d.slot.tg is not None:
            self.d.slot.tg.start_soon(group.refill_spare, freed.bundle)

    async def _watch(self, group: WorkerGroup, rank: int, fail: Any) -> None:
        """The rank's death (its pending ``wait_closed`` call) and health checks."""
        worker = group.workers[rank]

        async def death() -> None:
            try:
                await group.deaths[rank]
            except Exception as exc:
                fail(await call_error(exc, worker, group.attempt))

        async with anyio.create_task_group() as tg:
            tg.start_soon(death)
            interval = self.config.health_check_interval_s
            if interval is not None:
                while True:
                    await anyio.sleep(interval)
                    await _ping(group, worker, self.config.health_check_timeout_s, fail)

    # Reports -----------------------------------------------------------------------------------

    def _credit(self, key: tuple[int, int]) -> int:
        return self.d.spec.buffer_size - (self.received[key] - self.consumed[key])

    async def _pump(
        self, rank: int, key: tuple[int, int], attempt: int, group: WorkerGroup, fail: Any
    ) -> Any:
        worker = group.workers[rank]
        while True:
            while (credit := self._credit(key)) < self._min_poll:
                await self._changed.wait()
            try:
                poll = await poll_rank(worker, self.consumed[key], credit)
            except Exception as exc:
                raise await call_error(exc, worker, attempt) from None
            if poll.reports:
                self._queue(rank, key, attempt, poll)
                async with self._drain_lock:
                    await self.handover.drain()
            if poll.outcome is not None:
                if poll.outcome.kind != "ok":
                    raise outcome_error(poll.outcome, worker, attempt)
                return poll.outcome.value

    def _queue(self, rank: int, key: tuple[int, int], attempt: int, poll: Poll) -> None:
        """Hand a poll's reports to the stream, in arrival order (no await: the stream index is
        the hand-over's count)."""
        first_seq = self.received[key]
        count = len(poll.reports)
        self.received[key] += count
        self.delivered[rank] += count
        checkpoints: dict[int, tuple[Checkpoint, tuple[int, ...]]] = {}
        pruned: list[str] = []
        for seq, path in sorted((poll.checkpoints or {}).items()):
            checkpoint = Checkpoint(path)
            row = seq - first_seq
            checkpoints[row] = (checkpoint, (rank,))
            self.latest[rank] = checkpoint
            pruned += self.books[rank].add(checkpoint, poll.reports[row])
        versions: list[tuple[int | None, ...]] | None = None
        if poll.versions or key in self.marks:
            marks = self.marks.setdefault(key, [])
            marks.extend(poll.versions or [])
            versions = [(v,) for v in _versions_of(marks, first_seq, count)]
        batch = StepBatch(
            self.handover.steps,
            attempt,
            [(metrics,) for metrics in poll.reports],
            checkpoints,
            versions,
            ranks=[rank] * count,
        )
        self.handover.queue(batch)
        self.handover.prune_after(pruned)
        self.arrivals.append([rank, key[1], count])

    async def _account(self) -> None:
        """Credit each rank with the reports the consumer took, in stream order."""
        while True:
            await self.run.wait_consumed()
            taken = self.run.consumed - self.accounted
            while taken > 0 and self.arrivals:
                entry = self.arrivals[0]
                n = min(taken, entry[2])
                key = (entry[0], entry[1])
                self.consumed[key] = self.consumed.get(key, 0) + n
                entry[2] -= n
                taken -= n
                self.accounted += n
                if entry[2] == 0:
                    self.arrivals.popleft()
            changed, self._changed = self._changed, anyio.Event()
            changed.set()


