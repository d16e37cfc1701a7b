"""The credit window's two ends, without Ray: what the driver counts as consumed, and how a
worker's session answers a poll."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import pytest

from asyncexec import Run, WorkerContext
from asyncexec._driver.run import HandOver, RunCore, StepBatch
from asyncexec._wire._checkpoint import CheckpointBook
from asyncexec._wire._protocol import RunStart
from asyncexec._worker import _session


def _batch(first: int, size: int) -> StepBatch:
    return StepBatch(first, 1, [({"i": first + i},) for i in range(size)], {})


async def test_a_batch_counts_as_consumed_once_the_iterator_moves_past_it() -> None:
    """Also before its sender has run again: a consumer that never yields takes a whole batch
    without letting it, and credit that lags by that batch could hold a pump for good."""
    send, receive = anyio.create_memory_object_stream[Any](0)
    core = RunCore("run-test")
    handover = HandOver(core, send, CheckpointBook(None, None, "max"), lambda paths: None)
    run = Run(core, receive)
    handover.queue(_batch(0, 3))
    handover.queue(_batch(3, 2))
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(handover.drain)
            await anyio.wait_all_tasks_blocked()  # the sender waits with the first batch
            for _ in range(3):
                await run.__anext__()
            step = await run.__anext__()  # the next batch: the first one was consumed
            assert core.consumed == 3
            await run.__anext__()
    assert step.index == 3
    assert step.metrics == {"i": 3}
    assert [r.metrics for r in step.reports] == [{"i": 3}]


def _start(fn: Any, buffer_size: int) -> _session.Session:
    context = WorkerContext(0, 0, 0, 1, 1, "node", "127.0.0.1", run_id="run-test", attempt=1)
    start = RunStart(context, None, buffer_size, 0, {})
    session = _session.Session(fn, None, start, asyncio.get_running_loop())
    session.start()
    return session


async def test_a_poll_that_frees_a_function_held_back_by_credit_returns_a_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not the first report of it: a poll per report would cost a round trip per report."""
    from asyncexec._worker import _reports

    monkeypatch.setattr(_reports, "BATCH_LINGER_S", 30.0)
    done = threading.Event()

    def fn() -> None:
        for i in range(8):
            _session.report({"i": i})
        done.wait(10)

    session = _start(fn, 4)
    try:
        with anyio.fail_after(10):
            received: list[dict[str, Any]] = []
            while len(received) < 4:
                received += (await session.poll(0, 4)).reports
            # The function's thread waits for credit: no event of this loop says when.
            while not session.reports._credit_waiting:  # noqa: ASYNC110
                await anyio.sleep(0.001)
            batch = await session.poll(4, 4)
    finally:
        done.set()
        await session.stop(5)
        _session.end_session(session)  # this process's session: later tests must see none
    assert [r["i"] for r in received] == [0, 1, 2, 3]
    assert [r["i"] for r in batch.reports] == [4, 5, 6, 7]
    assert batch.outcome is None


async def test_a_slow_functions_report_is_sent_at_once() -> None:
    step = threading.Event()
    done = threading.Event()

    def fn() -> None:
        _session.report({"i": 0})
        step.wait(10)
        _session.report({"i": 1})
        done.wait(10)

    session = _start(fn, 4)
    try:
        with anyio.fail_after(10):
            first = await session.poll(0, 4)
            step.set()
            second = await session.poll(1, 4)  # answered by the one report, not a batch
    finally:
        done.set()
        await session.stop(5)
        _session.end_session(session)  # this process's session: later tests must see none
    assert [r["i"] for r in first.reports] == [0]
    assert [r["i"] for r in second.reports] == [1]
