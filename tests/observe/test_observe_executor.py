"""The executor's observer (no Ray): each event of its groups, runs and calls, emitted once,
reaches every sink that handles it (the statistics ``Executor.statistics()`` reads, the
Prometheus metrics, the timeline); a span-shaped event is emitted when what it times ends, and
costs nothing when no sink handles it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import asyncexec
from asyncexec._driver._events import (
    ONE_CALL_SENT,
    AttemptFailed,
    CallEnded,
    CallResent,
    CallsSent,
    FunctionStarted,
    PhaseEnded,
    Preemption,
    RankChosen,
    RankRenewed,
    RankRestarting,
    Restarting,
    RunEnded,
    RunStarted,
    SlotWaited,
    StepsQueued,
    StepsTaken,
    StragglerFound,
    TornDown,
)
from asyncexec._driver._metrics import RunMeter
from asyncexec._driver._observe import Observer
from asyncexec._driver._sinks import (
    ExecutorCounts,
    ExecutorMetrics,
    ExecutorTimeline,
    RunLog,
    executor_observer,
    run_observer,
)
from asyncexec._driver.group import observed
from asyncexec._driver.run._steps import StepBatch
from asyncexec._timeline._timeline import DRIVER, Timeline
from asyncexec.testing import metrics_enabled

pytestmark = pytest.mark.timeout(30)


def _sample(registry: Any, name: str, **labels: str) -> float | None:
    value: float | None = registry.get_sample_value(name, {"executor": "ex", **labels})
    return value


def test_the_executors_observer_holds_statistics_metrics_then_the_timeline() -> None:
    counts = ExecutorCounts()
    kinds = [type(s) for s in executor_observer(counts, "ex", Timeline()).sinks]
    assert kinds == [ExecutorCounts, ExecutorMetrics, ExecutorTimeline]
    # Without a timeline, nothing handles the events only the timeline draws.
    bare = executor_observer(counts, "ex", None)
    assert not bare.handles(CallEnded) and not bare.handles(SlotWaited)
    assert bare.handles(CallsSent) and bare.handles(RunStarted)


def test_one_emit_reaches_the_statistics_the_metrics_and_the_timeline() -> None:
    counts = ExecutorCounts()
    timeline = Timeline()
    with metrics_enabled() as registry:
        observer = executor_observer(counts, "ex", timeline)
        observer.emit(CallsSent(4))
        observer.emit(ONE_CALL_SENT)
        observer.emit(CallResent())
        observer.emit(RankRenewed(1))
        observer.emit(RunStarted(previous_steps=3))
        observer.emit(Preemption("noticed"))  # not charged: no statistic
        observer.emit(Preemption("restarted"))
        observer.emit(RunEnded("failed"))
        observer.emit(RankChosen(2))
        observer.emit(PhaseEnded("placement", 1.0, 0.25))
        assert _sample(registry, "asyncexec_calls_total") == 5
        assert _sample(registry, "asyncexec_call_resends_total") == 1
        assert _sample(registry, "asyncexec_ranks_renewed_total") == 1
        assert _sample(registry, "asyncexec_runs_total", outcome="started") == 1
        assert _sample(registry, "asyncexec_runs_total", outcome="failed") == 1
        assert _sample(registry, "asyncexec_preemptions_total", stage="noticed") == 1
        assert _sample(registry, "asyncexec_preemptions_total", stage="restarted") == 1
        startup = "asyncexec_startup_seconds_count"
        assert _sample(registry, startup, phase="placement") == 1
    assert counts.counts == {
        "runs_started": 1,
        "runs_finished": 0,
        "runs_failed": 1,
        "runs_cancelled": 0,
        "steps_delivered": 3,
        "preemptions": 1,
        "calls": 5,
        "resends": 1,
        "renewed_ranks": 1,
    }
    names = [(track, name, kind) for _, track, name, kind, *_ in timeline.events()]
    assert names == [
        (DRIVER, "preemption noticed", "preemption"),
        (DRIVER, "preemption restarted", "preemption"),
        (DRIVER, "least loaded: rank 2", "call"),
        (2, "chosen by load", "call"),
        (DRIVER, "place", "startup"),
    ]


def test_a_restart_reaches_the_metrics_and_the_timeline_and_its_time_ends_at_the_next_steps() -> (
    None
):
    timeline = Timeline()

    class Batch:  # a StepBatch's length, ranks and report times (none), aligned
        num_ranks, times, ranks = 2, None, None

        def __len__(self) -> int:
            return 3

    with metrics_enabled() as registry:
        observer = executor_observer(ExecutorCounts(), "ex", timeline)
        error = asyncexec.WorkerCrashedError(1, attempt=1, detail="crashed")
        observer.emit(AttemptFailed(error))
        observer.emit(Restarting(error, 0.5, 2, None))
        observer.emit(StepsQueued(Batch()))
        observer.emit(StepsTaken(Batch()))
        observer.emit(StragglerFound(0, "abc", 7, 1, 9, 10, 0.5, 0.1, 5.0, None))
        restarts = "asyncexec_restarts_total"
        assert _sample(registry, restarts, cause="WorkerCrashedError") == 1
        assert _sample(registry, "asyncexec_restart_seconds_count") == 1
        assert _sample(registry, "asyncexec_steps_total") == 3
        assert _sample(registry, "asyncexec_reports_total") == 6
        assert _sample(registry, "asyncexec_stragglers_total") == 1
    observer.emit(RunEnded("cancelled"))  # during the policy's wait: it ends there
    spans = [(e[1], e[2]) for e in timeline.events()]
    assert timeline.events()[-1][5] <= time.monotonic()
    assert spans == [
        (DRIVER, "failed: WorkerCrashedError"),
        (1, "failed: WorkerCrashedError"),
        (DRIVER, "wait (policy)"),
    ]


def test_an_independent_ranks_restart_time_ends_at_its_own_next_report_not_another_ranks() -> None:
    """The other ranks of a run of independent ranks go on while one restarts: their reports
    end no restart time; each restarted rank's first report ends its own."""

    def batch(rank: int, first: int) -> StepBatch:  # one report of one rank, unaligned
        return StepBatch(first, 1, [({"i": first},)], {}, ranks=[rank])

    count = "asyncexec_restart_seconds_count"
    with metrics_enabled() as registry:
        observer = executor_observer(ExecutorCounts(), "ex", None)
        observer.emit(RunStarted(0))
        error = asyncexec.WorkerCrashedError(1, attempt=1, detail="crashed")
        observer.emit(RankRestarting(1, error, 2, 0.0))
        observer.emit(StepsQueued(batch(0, 0)))
        assert _sample(registry, count) == 0  # rank 0 went on: rank 1 has not restarted yet
        observer.emit(StepsQueued(batch(1, 1)))
        assert _sample(registry, count) == 1
        observer.emit(RankRestarting(0, error, 2, 0.0))  # two ranks restart: two times
        observer.emit(RankRestarting(1, error, 3, 0.0))
        observer.emit(StepsQueued(batch(0, 2)))
        observer.emit(StepsQueued(batch(1, 3)))
        assert _sample(registry, count) == 3


def test_a_scrape_asks_the_workers_of_every_name_and_loop_at_once() -> None:
    """Defect: a scrape asked the workers of one executor name, and of one event loop, after
    another, waiting up to ``SCRAPE_WAIT_S`` for each: a scrape of ten names whose workers do
    not answer took 15 s, past Prometheus' scrape timeout. Here each run's workers answer only
    once every run's have been asked: asked in turn, none answers (their last counts, 0)."""
    asked: list[str] = []
    everyone_asked: dict[asyncio.AbstractEventLoop, asyncio.Event] = {}  # one a loop

    def counts(name: str) -> Callable[[], Awaitable[int]]:
        async def buffered() -> int:
            asked.append(name)
            if len(asked) == 4:
                for loop, event in everyone_asked.items():
                    loop.call_soon_threadsafe(event.set)
            await everyone_asked[asyncio.get_running_loop()].wait()
            return 5

        return buffered

    async def watch(meter: RunMeter) -> None:
        everyone_asked.setdefault(asyncio.get_running_loop(), asyncio.Event())
        meter.watch()

    loops = [asyncio.new_event_loop() for _ in range(2)]
    threads = [threading.Thread(target=loop.run_forever) for loop in loops]
    for thread in threads:
        thread.start()
    placed = [("a", 0), ("b", 0), ("c", 0), ("a", 1)]  # two loops, three names
    meters = [RunMeter(name, lambda: 1, counts(f"{name}{i}")) for name, i in placed]
    try:
        with metrics_enabled(backlog_refresh_s=0) as registry:
            for meter, (_, i) in zip(meters, placed, strict=True):
                asyncio.run_coroutine_threadsafe(watch(meter), loops[i]).result(5)
            backlog = registry.get_sample_value("asyncexec_backlog_reports", {"executor": "a"})
            assert sorted(asked) == ["a0", "a1", "b0", "c0"]
            assert backlog == 2 * (1 + 5)
            for meter in meters:
                meter.unwatch()
    finally:
        for loop, thread in zip(loops, threads, strict=True):
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)
            loop.close()


async def test_a_span_shaped_event_is_emitted_when_its_awaitable_ends_also_when_it_raises() -> None:
    timeline = Timeline()
    observer = executor_observer(ExecutorCounts(), "ex", timeline)

    async def work() -> int:
        await anyio.lowlevel.checkpoint()
        return 7

    async def broken() -> None:
        raise ValueError("no")

    before = time.monotonic()
    assert await observer.timed(work(), TornDown) == 7
    with pytest.raises(ValueError, match="no"):
        await observer.timed(broken(), FunctionStarted, 2)  # drawn only when it started
    [torn] = timeline.events()
    assert torn[1:4] == (DRIVER, "tear down", "restart")
    assert before <= torn[4] <= torn[5] <= time.monotonic()


async def test_a_span_shaped_event_nobody_handles_is_not_made() -> None:
    made: list[Any] = []

    class Spy(tuple):  # a record whose making is seen
        def __new__(cls, *fields: Any) -> Spy:
            made.append(fields)
            return super().__new__(cls, fields)

    async def work() -> str:
        return "done"

    assert await Observer().timed(work(), Spy) == "done"
    assert made == []


async def test_an_observed_call_is_emitted_once_however_often_it_is_awaited() -> None:
    timeline = Timeline()
    observer = executor_observer(ExecutorCounts(), "ex", timeline)

    class Call:  # a pending call: awaitable more than once, as ``cluster.Call`` is
        def __init__(self) -> None:
            self.done = anyio.Event()

        def __await__(self) -> Any:
            yield from self.done.wait().__await__()
            return "answer"

        def cancel(self) -> None:
            pass

    call = Call()
    wrapped = observed(observer, 3, "Worker.work", call, None, time.monotonic())
    call.done.set()
    assert await wrapped == "answer"
    assert await wrapped == "answer"
    events = timeline.events()
    assert [(e[1], e[2], e[3]) for e in events] == [(3, "Worker.work", "call")]
    # Without a sink for it, the wrapper emits nothing (a traced call is still wrapped).
    quiet = executor_observer(ExecutorCounts(), "ex", None)
    assert await observed(quiet, 0, "Worker.work", call, None, time.monotonic()) == "answer"


def test_an_executors_statistics_are_its_statistics_sinks_counts() -> None:
    """``Executor.statistics()`` reads its observer's statistics sink: an event emitted to the
    executor's observer is in the next snapshot (no Ray: the executor is never entered)."""
    ex = asyncexec.Executor(2, name="ex")
    before = ex.statistics()
    observer = ex._life.observer
    assert observer is ex._slot.observer  # its groups emit to it too
    observer.emit(CallsSent(2))
    observer.emit(RunStarted(0))
    observer.emit(RunEnded("cancelled"))
    observer.emit(Preemption("moved"))
    after = ex.statistics()
    assert (before.calls, before.runs_started, before.preemptions) == (0, 0, 0)
    assert (after.calls, after.runs_started, after.runs_cancelled, after.preemptions) == (
        2,
        1,
        1,
        1,
    )
    assert after.in_flight == () and after.num_workers == 2


def test_a_runs_event_reaches_the_executors_sinks_and_the_runs_log() -> None:
    """A run's observer holds its executor's sinks (the same objects: what the run counts is in
    the executor's statistics) and the run's log, last."""
    import structlog

    counts, timeline = ExecutorCounts(), Timeline()
    executor = executor_observer(counts, "ex", timeline)
    with structlog.testing.capture_logs() as logs, metrics_enabled() as registry:
        observer = run_observer(executor, structlog.get_logger().bind(run_id="r"))
        assert observer.sinks[:-1] == executor.sinks and isinstance(observer.sinks[-1], RunLog)
        error = asyncexec.WorkerCrashedError(0, attempt=1, detail="crashed")
        observer.emit(Restarting(error, 0.25, 2, "/ckpt/3"))
        observer.emit(StragglerFound(1, "abc", 7, 2, 19, 10, 0.5, 0.1, 5.0, "stack"))
        observer.emit(Preemption("moved"))
        assert _sample(registry, "asyncexec_restarts_total", cause="WorkerCrashedError") == 1
        assert _sample(registry, "asyncexec_stragglers_total") == 1
    assert counts.counts["preemptions"] == 1
    timeline.run_ended()  # (the policy's wait is recorded when it is over)
    assert [(e[1], e[2]) for e in timeline.events()] == [
        (DRIVER, "preemption moved"),
        (DRIVER, "wait (policy)"),
    ]
    restarting, straggler, moved = logs
    assert moved["event"] == "moving_before_preemption"
    assert restarting == {
        "event": "restarting",
        "log_level": "warning",
        "run_id": "r",
        "attempt": 2,
        "wait_s": 0.25,
        "checkpoint": "/ckpt/3",
    }
    assert straggler["event"] == "straggler" and straggler["factor"] == 5.0
    assert (straggler["rank"], straggler["node_id"], straggler["stack"]) == (1, "abc", "stack")


def _steps_then_fail(config: dict[str, Any]) -> None:
    for i in range(config["steps"]):
        asyncexec.report({"i": i})
    if config.get("fail"):
        raise ValueError("the last batch is bad")


async def test_a_runs_start_and_end_are_one_event_each_logged_once_and_counted_once() -> None:
    """A run's start and end are one event each, which reaches its log line and the
    statistics once, whichever way the run ends."""
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        async with asyncexec.Executor(2, local=True) as ex:  # a user's error: not retried
            [_ async for _ in ex.run(_steps_then_fail, {"steps": 3})]
            async for _ in ex.run(_steps_then_fail, {"steps": 3}):
                break
            with pytest.raises(asyncexec.WorkerRaisedError):
                [_ async for _ in ex.run(_steps_then_fail, {"steps": 1, "fail": True})]
            stats = ex.statistics()
    ends = [(e["event"], e.get("steps")) for e in logs if e["event"].startswith("run_")]
    assert [e for e, _ in ends if e == "run_started"] == ["run_started"] * 3
    (finished, cancelled, failed) = [e for e in ends if e[0] != "run_started"]
    assert finished == ("run_finished", 3) and failed == ("run_failed", None)
    assert cancelled[0] == "run_cancelled" and cancelled[1] >= 1  # the steps handed over
    counts = (stats.runs_started, stats.runs_finished, stats.runs_cancelled, stats.runs_failed)
    assert counts == (3, 1, 1, 1)


async def test_a_log_processor_that_raises_at_a_runs_end_leaves_no_worker_behind() -> None:
    """A sink that raises at the run's end (here the application's structlog processor, under
    the run's log line) raises out of the executor, after the run's teardown: its workers'
    session was left running (their threads, in local mode), its iterator open."""
    import structlog

    def refuse_run_finished(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("event") == "run_finished":
            raise RuntimeError("the application's processor failed")
        return event

    structlog.configure(processors=[refuse_run_finished, structlog.testing.LogCapture()])
    steps = []
    with pytest.raises(RuntimeError, match="the application's processor failed"):
        async with asyncexec.Executor(2, local=True) as ex:
            async for step in ex.run(_steps_then_fail, {"steps": 2}):
                steps.append(step)
            with anyio.fail_after(10):  # the run task's error ends the executor's block
                await anyio.sleep_forever()
    assert len(steps) == 2
    deadline = time.monotonic() + 5
    while left := [t.name for t in threading.enumerate() if t.name.startswith("asyncexec-")]:
        assert time.monotonic() < deadline, f"threads left running: {left}"
        await anyio.sleep(0.05)


@pytest.mark.timeout(30)
async def test_a_log_processor_that_raises_at_a_runs_start_leaves_the_executor_usable() -> None:
    """Defect: a sink that raised at a run's start (the application's structlog processor,
    under the ``run_started`` line) made ``run()`` raise with the run left in progress and its
    task never started: the next run waited for it for ever (a hang). Now ``run()`` raises it,
    that run ends as cancelled, and the next run runs."""
    import structlog

    refused = []

    def refuse_first_run_started(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("event") == "run_started" and not refused:
            refused.append(event)
            raise RuntimeError("the application's processor failed")
        return event

    structlog.configure(processors=[refuse_first_run_started, structlog.testing.LogCapture()])
    async with asyncexec.Executor(2, local=True) as ex:
        with pytest.raises(RuntimeError, match="the application's processor failed"):
            ex.run(_steps_then_fail, {"steps": 2})
        with anyio.fail_after(10):
            steps = [step async for step in ex.run(_steps_then_fail, {"steps": 2})]
        stats = ex.statistics()
    assert len(steps) == 2 and refused
    counts = (stats.runs_started, stats.runs_finished, stats.runs_cancelled, stats.runs_failed)
    assert counts == (2, 1, 1, 0) and stats.steps_delivered == 2


def _one() -> int:
    return 1


@pytest.mark.timeout(30)
async def test_a_call_to_no_rank_counts_no_call_sent() -> None:
    """Defect: ``execute_single()`` to a rank the group does not have counted a call sent in
    ``statistics().calls`` (and ``asyncexec_calls_total``) before it raised its
    ``ConfigurationError``: nothing was sent."""
    async with asyncexec.Executor(2, local=True) as ex:
        for rank in (2, -1):
            with pytest.raises(asyncexec.ConfigurationError, match=r"rank must be in 0\.\.1"):
                await ex.execute_single(rank, _one)
        assert ex.statistics().calls == 0
        assert await ex.execute_single(1, _one) == 1
        assert ex.statistics().calls == 1


def test_a_runs_events_are_logged_by_its_observer_with_what_it_counts() -> None:
    """The run's log lines of its start, end and preemptions are a sink of the run's observer,
    beside the executor's counts: one emit writes both (the run logged them and emitted the
    events apart)."""
    from structlog.testing import capture_logs

    from asyncexec._logging import get_logger

    counts = ExecutorCounts()
    with capture_logs() as logs:
        observer = run_observer(executor_observer(counts, "ex", None), get_logger(run_id="r"))
        observer.emit(RunStarted(previous_steps=0))
        observer.emit(Preemption("moved", {"preemptions": 1, "node_ids": ["ab12"]}))
        observer.emit(RunEnded("finished", steps=3, attempts=2, seconds=0.5))
    assert [(e["event"], e.get("steps"), e.get("attempts")) for e in logs] == [
        ("run_started", None, None),
        ("moving_before_preemption", None, None),
        ("run_finished", 3, 2),
    ]
    assert logs[1]["node_ids"] == ["ab12"] and logs[1]["log_level"] == "warning"
    counts = counts.counts
    assert (counts["runs_started"], counts["runs_finished"], counts["preemptions"]) == (1, 1, 1)
