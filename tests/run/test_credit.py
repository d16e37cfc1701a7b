"""The credit window's two ends, without Ray: what the driver counts as consumed, and how a
worker's session answers a poll."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any

import anyio
import pytest

from asyncexec import ExecutorStateError, Run, WorkerContext
from asyncexec._driver.run import HandOver, RunCore, StepBatch
from asyncexec._wire._checkpoint import CheckpointBook
from asyncexec._wire._protocol import RunStart
from asyncexec._worker import _place, _session


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


@pytest.mark.timeout(30)
async def test_once_the_function_has_ended_report_raises_and_the_context_is_the_groups() -> None:
    """Also from a thread the function left running, and for a report that held the session
    from before: it was queued after the outcome, where no poll took it and no credit came."""
    group = WorkerContext(0, 0, 0, 1, 1, "node", "127.0.0.1")
    place = _place.Place()
    place.context = group
    token = _place.PLACE.set(place)  # this test's worker: the process's own stays untouched
    ended = threading.Event()
    threads: list[threading.Thread] = []
    late: list[BaseException | None] = []

    def left_running() -> None:
        ended.wait(10)
        try:
            _session.report({"late": 0})
        except BaseException as exc:
            late.append(exc)
        else:
            late.append(None)

    def fn() -> None:
        # A thread that carries the function's context, as asyncio.to_thread's do.
        threads.append(
            threading.Thread(target=contextvars.copy_context().run, args=(left_running,))
        )
        threads[0].start()
        _session.report({"i": 0})
        _session.report({"i": 1})
        assert _session.get_context().run_id == "run-test"

    try:
        session = _start(fn, 2)
        with anyio.fail_after(10):
            received: list[dict[str, Any]] = []
            while (poll := await session.poll(len(received), 2)).outcome is None:
                received += poll.reports
            received += poll.reports
        assert poll.outcome.kind == "ok"
        assert [r["i"] for r in received] == [0, 1]
        assert _session.get_context() is group
        with pytest.raises(ExecutorStateError, match="inside the function given to run"):
            _session.report({"late": 0})
        with pytest.raises(ExecutorStateError, match="has ended"):
            session.reports.report({"late": 0}, None)
        ended.set()
        await anyio.to_thread.run_sync(threads[0].join, 10)
        assert len(late) == 1 and isinstance(late[0], ExecutorStateError), late
    finally:
        ended.set()
        _place.PLACE.reset(token)


@pytest.mark.timeout(30)
async def test_a_failed_attempt_still_takes_the_reports_that_complete_steps_every_rank_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: after a failure, a rank ahead of the others was still polled only once a share of
    its window was free: the reports its worker held that completed steps every rank had
    reported (a slower rank's came in one poll) stayed there while the consumer took nothing,
    and went with the attempt (steps 3-7 here, lost). Window of 8: rank 0's first 3 reports
    leave it 5 of credit (under 6), its worker holds 5 more; rank 1's 8 came in one poll."""
    from types import SimpleNamespace

    from asyncexec._driver.run import _window
    from asyncexec._wire._protocol import Poll

    def reports(first: int, n: int) -> list[dict[str, Any]]:
        return [{"i": i} for i in range(first, first + n)]

    answers = {0: [reports(0, 3), reports(3, 5)], 1: [reports(0, 8)]}
    polled: list[tuple[int, int]] = []  # (rank, room)

    async def submit(calls: Any, ack: int, room: int) -> Poll:
        rank = calls._who.rank
        polled.append((rank, room))
        if not answers[rank]:
            await anyio.sleep_forever()  # a long poll: nothing more comes
        return Poll(answers[rank].pop(0), None, None)

    monkeypatch.setattr(_window, "submit", submit)
    workers = [SimpleNamespace(rank=0), SimpleNamespace(rank=1)]
    group = SimpleNamespace(
        workers=workers, attempt=1, config=SimpleNamespace(straggler_factor=None)
    )
    send, receive = anyio.create_memory_object_stream[Any](0)
    core = RunCore("run-test")
    handover = HandOver(core, send, CheckpointBook(None, None, "max"), lambda paths: None)
    run = Run(core, receive)
    window = _window.Window(core, group, 8, 0)  # type: ignore[arg-type]
    failures: list[Exception] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for rank in (0, 1):
                tg.start_soon(window.pump, rank, failures.append)
            tg.start_soon(window.assemble, handover)
            first = await run.__anext__()  # steps 0-2; the consumer takes no more for now
            await anyio.wait_all_tasks_blocked()
            assert [rank for rank, _ in polled].count(0) == 1  # 5 of credit: not polled
            window.flush()  # the attempt failed (rank 1 died, say)
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()  # the attempt ends
    assert first.index == 0
    assert window.asm.assembled == 8  # steps 3-7 complete too: they are handed over
    assert (0, 5) in polled  # polled with the credit it had
    assert failures == []
