"""Runs of independent ranks: a failed rank is replaced on its own while the others go on, and
the stream is unaligned (each report as soon as it arrives, with its rank).

Rollout workers, evaluation and data generation do not talk to each other, so one rank's crash
is no reason to stop the others. In such a run (``run(..., independent=True)``):

- each rank lives under the restart policy of its own: when it crashes, hangs or is lost (or
  raises, when the policy restarts on user errors), a standby spare on its node, or else a fresh
  process in its bundle, takes its place, and only its function starts again, from the rank's own
  latest checkpoint; the other ranks' functions are never stopped; a rank lost to a preemption
  (see ``_preemption``) is renewed under the preemption budget instead, once per rank;
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

The pump, the health watch and the hand-over are the aligned run's (``_window``, the group's
``watch``); what differs is the assembly (none: each report is a step) and the credit, which
the consumer gives back in the order of the stream (:class:`StreamCredit`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import anyio
import tenacity

from ..._errors import (
    AsyncExecError,
    ExecutorStateError,
    RestartsExhaustedError,
    StartupError,
    describe,
)
from ..._wire._checkpoint import Checkpoint, CheckpointBook, join_path
from ..._wire._protocol import Poll
from .._events import RankFailed, RankReplaced, RankReported, RankRestarting
from .._restart import PreemptionsSpent
from .._taskgroups import task_group
from ..cluster import at_attempt, outcome_error, proxy
from ..group import WorkerGroup, watch
from ._context import RunContext
from ._iterator import RunCore, RunState
from ._preemption import exhausted
from ._steps import StepBatch
from ._window import min_poll, pump, versions_of

__all__ = ["IndependentRun", "StreamCredit"]

Key = tuple[int, int]  # (rank, generation): one worker's reports


class StreamCredit:
    """The credit of each rank's worker in an unaligned stream: what it reported, and what of it
    the consumer took, given back in the order the stream delivered it."""

    def __init__(self, run: RunCore, buffer_size: int) -> None:
        self.run = run
        self.buffer_size = buffer_size
        self.received: dict[Key, int] = {}
        self.consumed: dict[Key, int] = {}
        self.arrivals: deque[list[int]] = deque()  # [rank, generation, count] in stream order
        self.accounted = 0
        self._changed = anyio.Event()

    def open(self, key: Key) -> None:
        self.received[key] = self.consumed[key] = 0

    def credit(self, key: Key) -> int:
        return self.buffer_size - (self.received[key] - self.consumed[key])

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def arrived(self, key: Key, count: int) -> None:
        self.received[key] += count
        self.arrivals.append([key[0], key[1], count])

    async def account(self) -> None:
        """Credit each worker with the reports the consumer took, in stream order (runs until
        cancelled)."""
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


class IndependentRun:
    """Drives one run of independent ranks (see the module's docstring)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.run = ctx.run
        self.handover = ctx.handover
        ckpt = ctx.config.checkpoint
        # Checkpoints are kept per rank here: the hand-over's book (rank 0's) prunes none.
        self.handover.book = CheckpointBook(None, None, "max")
        n = ctx.config.num_workers
        self.books = [
            CheckpointBook(ckpt.num_to_keep, ckpt.score_attribute, ckpt.score_order)
            for _ in range(n)
        ]
        self.latest: list[Checkpoint | None] = [ctx.latest] * n
        self.values: list[Any] = [None] * n
        self.attempts = [1] * n
        self.generation = [0] * n  # the worker of each rank: 0, then 1 after its replacement ...
        self.delivered = [0] * n  # reports of each rank, over its generations
        self.credit = StreamCredit(ctx.run, ctx.spec.buffer_size)
        self.credit.accounted = self.handover.steps
        self.marks: dict[Key, list[tuple[int, int]]] = {}
        self.error: AsyncExecError | None = None
        self._drain_lock = anyio.Lock()

    async def main(self) -> list[Any]:
        """Start every rank, keep each alive under the policy; each rank's return value."""
        group = await self.ctx.slot.acquire(1)
        self.ctx.group = group
        self.run.state = RunState.RUNNING
        payload = await self.ctx.payload()
        async with task_group() as tg:
            tg.start_soon(self.credit.account)
            tg.start_soon(self.ctx.preemption.watch, group)
            async with task_group() as lives:
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
        ctx = self.ctx

        def before_sleep(state: tenacity.RetryCallState) -> None:
            wait = state.next_action.sleep if state.next_action else 0.0
            outcome = state.outcome
            error = outcome.exception() if outcome is not None and outcome.failed else None
            ctx.observer.emit(RankRestarting(rank, error, state.attempt_number + 1, wait))

        retrying = ctx.policy.retrying(before_sleep, lambda: progressed[0])
        moves = 0  # renewals after a preemption: attempts the restart policy does not count
        try:
            try:
                async for attempt in retrying:
                    with attempt:
                        moved = False
                        while True:
                            number = attempt.retry_state.attempt_number + moves
                            before = self.delivered[rank]
                            try:
                                self.values[rank] = await self._attempt(
                                    rank, number, group, payload, moved
                                )
                                return
                            except AsyncExecError as exc:
                                progressed[0] = self.delivered[rank] > before
                                failures.append(exc)
                                self.run.record_failure(exc)
                                ctx.observer.emit(RankFailed(rank, exc))
                                ctx.log_failure(exc)
                                if not await ctx.preemption.is_preemption([exc]):
                                    raise
                                ctx.preemption.charge(exc, rank=rank, attempt=number + 1)
                            moves, moved = moves + 1, True
            except tenacity.RetryError:
                last = failures[-1] if failures else None
                raise RestartsExhaustedError(self.attempts[rank], failures) from last
            except PreemptionsSpent as spent:
                raise exhausted(spent, self.attempts[rank], failures) from spent.failure
        except AsyncExecError as exc:
            if self.error is None:
                self.error = exc
            lives.cancel()

    async def _attempt(
        self, rank: int, number: int, group: WorkerGroup, payload: Any, preempted: bool = False
    ) -> Any:
        ctx = self.ctx
        if number > 1:
            # Counted first: a renewal that fails is this attempt's failure.
            self.attempts[rank] = number
            self.run.attempt = 1 + sum(a - 1 for a in self.attempts)
            await self._renew(rank, group, preempted)
        worker = group.workers[rank]
        key = (rank, self.generation[rank])
        self.credit.open(key)
        storage = join_path(ctx.storage, f"rank_{rank}")
        start = ctx.run_start(worker, number, self.latest[rank], self.delivered[rank], {}, storage)
        failed: list[AsyncExecError] = []

        def fail(exc: AsyncExecError) -> None:
            if not failed:
                failed.append(exc)
            tg.cancel_scope.cancel()

        value: list[Any] = [None]
        async with task_group() as tg:
            tg.start_soon(watch, group, fail, [rank])
            try:
                with anyio.fail_after(ctx.config.start_timeout_s):
                    for join in ctx.slot.joiners:  # a channel's latest version, first
                        await join(group)
                    await proxy(group, worker).start_run(payload, start)
                ctx.session_live = True
                value[0] = await self._pump(rank, key, number, group)
            except AsyncExecError as exc:
                fail(exc)
            except TimeoutError:
                fail(StartupError(f"starting rank {rank}'s function timed out"))
            tg.cancel_scope.cancel()
        if failed:
            raise failed[0]
        return value[0]

    async def _renew(self, rank: int, group: WorkerGroup, preempted: bool) -> None:
        """Put a spare or a fresh process in ``rank``'s place; the others keep running. A
        renewal after a preemption is counted as one, not as a restart."""
        slot = self.ctx.slot
        group.restore_from = self.latest[rank]  # the new worker's roles restore from it
        try:
            renewal = slot.renew(group, rank)
            freed = await self.ctx.observer.timed(renewal, RankReplaced, rank)
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
        if not preempted:
            slot.restarts += 1

    # Reports -----------------------------------------------------------------------------------

    async def _pump(self, rank: int, key: Key, attempt: int, group: WorkerGroup) -> Any:
        worker = group.workers[rank]
        credit = self.credit
        least = min_poll(self.ctx.spec.buffer_size)

        async def take(poll: Poll) -> None:
            if poll.reports:
                self._queue(rank, key, attempt, poll)
                async with self._drain_lock:
                    await self.handover.drain()

        outcome = await pump(
            worker,
            at_attempt(group, attempt),
            lambda: credit.credit(key),
            lambda: credit.consumed[key],
            credit.wait_changed,
            lambda: least,
            take,
        )
        if outcome.kind != "ok":
            raise outcome_error(outcome, worker, attempt)
        return outcome.value

    def _queue(self, rank: int, key: Key, attempt: int, poll: Poll) -> None:
        """Hand a poll's reports to the stream, in arrival order (no await: the stream index is
        the hand-over's count)."""
        first_seq = self.credit.received[key]
        count = len(poll.reports)
        self.ctx.observer.emit(RankReported(rank, self.handover.steps, poll.times))
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
            versions = [(v,) for v in versions_of(marks, first_seq, count)]
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
        self.credit.arrived(key, count)
