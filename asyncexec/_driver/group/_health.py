"""Hang and death detection, in one place: the pending call per worker that fails when its
process dies, health checks, the step deadline, and the probe that finds a dead peer.

Death is noticed at once: each worker holds a call (``wait_closed``) that fails the moment its
process dies or its node is lost. Hangs are noticed by health checks (a worker whose actor does
not answer a ping within ``health_check_timeout_s``, for example blocked in C code holding the
GIL) and by the optional step deadline (a rank that has credit but reports nothing for
``step_timeout_s``). A hang is declared with every rank's stack, read from outside the
processes (see ``_stacks``) before anything is killed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio

from ..._errors import (
    AsyncExecError,
    NodeLostError,
    WorkerCrashedError,
    WorkerError,
    WorkerHungError,
)
from .._taskgroups import task_group
from ..cluster import proxy, result_of, worker_error
from ._group import WorkerGroup
from ._members import WorkerInfo

__all__ = ["FailureSink", "declare_hung", "find_dead", "watch", "watch_steps"]

FailureSink = Callable[[AsyncExecError], None]

#: How often the step deadline is checked, as a share of the deadline (and at most every second).
_DEADLINE_CHECKS_PER_PERIOD = 4
_DEADLINE_CHECK_MAX_S = 1.0
#: How long the probe after a failure waits for each worker's answer.
PROBE_TIMEOUT_S = 2.0


class StepClock(Protocol):
    """What the step deadline reads of the run's credit window."""

    def silent_ranks(self, now: float, timeout_s: float) -> list[int]:
        """Ranks that could report (they have credit, their function runs) and have not for
        ``timeout_s``."""
        ...


async def watch(group: WorkerGroup, fail: FailureSink, ranks: Sequence[int] | None = None) -> None:
    """Report every failure of the workers of ``ranks`` (every rank by default) to ``fail``:
    their deaths, and health checks that they do not answer. Runs until cancelled."""
    ranks = range(len(group.workers)) if ranks is None else ranks
    workers = [group.workers[r] for r in ranks]
    async with task_group() as tg:
        for rank, worker in zip(ranks, workers, strict=True):
            tg.start_soon(_watch_death, group, worker, group.deaths[rank], fail)
        if group.config.health_check_interval_s is not None:
            tg.start_soon(_health_loop, group, workers, fail)


async def _watch_death(
    group: WorkerGroup, worker: WorkerInfo, death: object, fail: FailureSink
) -> None:
    try:
        await result_of(group, worker, death)
    except AsyncExecError as exc:
        if not group.closed:
            fail(exc)


async def _health_loop(
    group: WorkerGroup, workers: Sequence[WorkerInfo], fail: FailureSink
) -> None:
    interval = group.config.health_check_interval_s
    assert interval is not None
    timeout = group.config.health_check_timeout_s
    while True:
        await anyio.sleep(interval)
        silent: list[WorkerInfo] = []
        async with task_group() as tg:
            for worker in workers:
                tg.start_soon(_check, group, worker, timeout, fail, silent)
        if silent:  # one dump of the stacks for every rank that hung in this round
            silent.sort(key=lambda w: w.rank)
            await declare_hung(group, silent, _no_answer(timeout), fail)


def _no_answer(timeout: float) -> str:
    return f"no answer to a health check within {timeout:g} s"


async def _answers(
    group: WorkerGroup, worker: WorkerInfo, timeout: float, fail: FailureSink
) -> bool:
    """Whether ``worker`` answers a ping within ``timeout``; a failed call (a dead worker) goes
    to ``fail`` and counts as an answer."""
    try:
        with anyio.move_on_after(timeout):
            await proxy(group, worker).ping()
            return True
    except AsyncExecError as exc:
        fail(exc)
        return True
    return False


async def _check(
    group: WorkerGroup,
    worker: WorkerInfo,
    timeout: float,
    fail: FailureSink,
    silent: list[WorkerInfo],
) -> None:
    if not await _answers(group, worker, timeout, fail):
        silent.append(worker)


async def declare_hung(
    group: WorkerGroup, hung: Sequence[WorkerInfo], detail: str, fail: FailureSink
) -> None:
    """Fail each of ``hung`` with a :class:`WorkerHungError` that holds every rank's stack, read
    now, while every process is still there (bounded by ``_stacks.DUMP_TIMEOUT_S``)."""
    declared = time.time()
    stacks = await group.stacks()
    for worker in hung:
        error = worker_error(
            WorkerHungError, worker, group.attempt, detail, stacks=stacks, time_s=declared
        )
        fail(error)


async def watch_steps(
    group: WorkerGroup, clock: StepClock, timeout_s: float, fail: FailureSink
) -> None:
    """Fail the first rank that has credit and reports nothing for ``timeout_s``."""
    period = min(timeout_s / _DEADLINE_CHECKS_PER_PERIOD, _DEADLINE_CHECK_MAX_S)
    while True:
        await anyio.sleep(period)
        silent = clock.silent_ranks(time.monotonic(), timeout_s)
        if silent:
            detail = f"no report for {timeout_s:g} s (step deadline)"
            await declare_hung(group, [group.workers[silent[0]]], detail, fail)
            return


async def find_dead(group: WorkerGroup) -> WorkerError | None:
    """Probe every worker at once; return the error of the first one found dead, if any.

    A rank's error can be the echo of another's death (a collective fails with "connection reset
    by peer" before Ray reports the dead peer); the run asks this before it blames the user's
    function."""
    found: list[WorkerError] = []

    async def probe(worker: WorkerInfo) -> None:
        try:
            with anyio.move_on_after(PROBE_TIMEOUT_S):
                await proxy(group, worker).ping()
        except (WorkerCrashedError, NodeLostError) as exc:
            found.append(exc)
        except AsyncExecError:
            pass  # alive: the run's own error stands

    async with task_group() as tg:
        for worker in group.workers:
            tg.start_soon(probe, worker)
    found.sort(key=lambda e: e.rank)
    return found[0] if found else None
