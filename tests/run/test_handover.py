"""The hand-over of complete steps to the iterator, without Ray: a step is delivered once, also
when the send that handed it over is cancelled after the iterator took it."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from asyncexec import Run
from asyncexec._driver._sinks import ExecutorCounts, executor_observer
from asyncexec._driver.run import HandOver, RunCore, StepBatch
from asyncexec._wire._checkpoint import CheckpointBook
from asyncexec.testing import metrics_enabled


def _batch(first: int) -> StepBatch:
    return StepBatch(first, 1, [({"i": first},)], {})


async def test_a_step_whose_send_is_cancelled_after_the_hand_off_is_not_sent_again() -> None:
    send, receive = anyio.create_memory_object_stream[Any](0)
    core = RunCore("run-test")
    handover = HandOver(core, send, CheckpointBook(None, None, "max"), lambda paths: None)
    run = Run(core, receive)
    handover.queue(_batch(0))
    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()

        async def drain() -> None:
            with scope:
                await handover.drain()

        tg.start_soon(drain)
        await anyio.wait_all_tasks_blocked()  # the sender waits for the iterator
        first = await run.__anext__()  # the iterator takes the step...
        scope.cancel()  # ...and the attempt fails
    assert first.index == 0
    handover.queue(_batch(1))
    async with anyio.create_task_group() as tg:
        tg.start_soon(handover.drain)
        second = await run.__anext__()
    assert second.index == 1  # step 0 was not handed over a second time
    assert core.handed == 2


async def test_a_batch_the_iterator_received_is_never_sent_again() -> None:
    """The race the chaos runner found: a failure cancels the sender, and the iterator takes the
    batch before the sender runs; the sender's send raises though the batch arrived."""
    send, receive = anyio.create_memory_object_stream[Any](0)
    core = RunCore("run-test")
    handover = HandOver(core, send, CheckpointBook(None, None, "max"), lambda paths: None)
    run = Run(core, receive)
    handover.queue(_batch(0))
    handover.queue(_batch(1))
    core.received_upto = 1  # batch 0 arrived, but its send was cancelled
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(handover.drain)
            step = await run.__anext__()
    assert step.index == 1
    assert core.handed == 2


@pytest.mark.timeout(30)
async def test_steps_count_in_the_metrics_when_the_iterator_takes_them_not_when_queued() -> None:
    """Defect: ``asyncexec_steps_total`` (and ``asyncexec_reports_total``) counted steps as they
    were queued for the iterator, so a run stopped while a batch waited for its consumer counted
    steps that were never handed over (up to a batch, or a rank's window after a failure)."""
    send, receive = anyio.create_memory_object_stream[Any](0)
    core = RunCore("run-test")
    handover = HandOver(core, send, CheckpointBook(None, None, "max"), lambda paths: None)
    with metrics_enabled() as registry:
        core.observer = handover.observer = executor_observer(ExecutorCounts(), "ex", None)
        run = Run(core, receive)
        handover.queue(StepBatch(0, 1, [({"i": 0}, {"i": 0})] * 3, {}))
        handover.queue(StepBatch(3, 1, [({"i": 3}, {"i": 3})] * 2, {}))

        def counted(name: str) -> float | None:
            value: float | None = registry.get_sample_value(name, {"executor": "ex"})
            return value

        assert counted("asyncexec_steps_total") in (None, 0.0)  # queued, not handed over
        async with anyio.create_task_group() as tg:
            tg.start_soon(handover.drain)
            step = await run.__anext__()  # the iterator takes the first batch
            await anyio.wait_all_tasks_blocked()  # the sender waits with the second
            assert counted("asyncexec_steps_total") == 3
            assert counted("asyncexec_reports_total") == 6
            tg.cancel_scope.cancel()  # the run stops: the second batch is never handed over
        assert step.index == 0
        assert counted("asyncexec_steps_total") == 3
        assert counted("asyncexec_reports_total") == 6
