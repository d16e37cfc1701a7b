"""The sinks of an executor's events (``_events``): its statistics (the counters
``Executor.statistics()`` reads), its Prometheus metrics and its timeline. An observer made by
:func:`executor_observer` holds them in that order (statistics first); the executor's groups and
calls emit to it. A run emits to its own (:func:`run_observer`): the executor's sinks, and the
run's log lines (its logger is bound to the run's id).

Each handler does what the separate calls did before, in the same form: the timeline's spans
and instants keep their names, tracks and kinds; the metrics their names and labels."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from .._errors import describe
from .._timeline._timeline import DRIVER, Timeline
from ._events import (
    AttemptFailed,
    CallEnded,
    CallResent,
    CallsSent,
    FunctionStarted,
    PhaseEnded,
    Preemption,
    RankChosen,
    RankFailed,
    RankRenewed,
    RankReplaced,
    RankReported,
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
from ._metrics import metrics
from ._observe import Handler, Observer

__all__ = [
    "ExecutorCounts",
    "ExecutorMetrics",
    "ExecutorTimeline",
    "RunLog",
    "executor_observer",
    "run_observer",
]


class ExecutorCounts:
    """The executor's counters, as ``Executor.statistics()`` reports them (by its fields'
    names)."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(
            (
                "runs_started",
                "runs_finished",
                "runs_failed",
                "runs_cancelled",
                "steps_delivered",
                "preemptions",
                "calls",
                "resends",
                "renewed_ranks",
            ),
            0,
        )

    def handlers(self) -> Mapping[type, Handler]:
        return {
            CallsSent: self._sent,
            CallResent: self._resent,
            RankRenewed: self._renewed,
            RunStarted: self._started,
            RunEnded: self._ended,
            Preemption: self._preempted,
        }

    def _started(self, event: RunStarted) -> None:
        self.counts["runs_started"] += 1
        self.counts["steps_delivered"] += event.previous_steps

    def _ended(self, event: RunEnded) -> None:
        self.counts[f"runs_{event.outcome}"] += 1

    def _preempted(self, event: Preemption) -> None:
        if event.stage != "noticed":  # a move or a restart: charged to max_preemptions
            self.counts["preemptions"] += 1

    def _sent(self, event: CallsSent) -> None:
        self.counts["calls"] += event.calls

    def _resent(self, event: CallResent) -> None:
        self.counts["resends"] += 1

    def _renewed(self, event: RankRenewed) -> None:
        self.counts["renewed_ranks"] += 1


class ExecutorMetrics:
    """The executor's Prometheus metrics (``_metrics``: nothing while metrics are off), by its
    name. The restart time runs from a failure (or a move, or a restart after a preemption) to
    the next steps queued for the run's iterator: of the group's next step, or for one rank of
    a run of independent ranks, of that rank's next report (the others go on meanwhile).
    Steps and reports count when the run's iterator takes them (handed over)."""

    def __init__(self, executor: str) -> None:
        self.executor = executor
        #: When the run in progress last failed (``time.perf_counter()``), until its next steps:
        #: the group's failure under None, an independent rank's under its rank.
        self.failed_at: dict[int | None, float] = {}

    def handlers(self) -> Mapping[type, Handler]:
        return {
            CallsSent: self._sent,
            CallResent: self._resent,
            RankRenewed: self._renewed,
            PhaseEnded: self._phase,
            RunStarted: self._started,
            RunEnded: self._ended,
            Restarting: self._restarting,
            RankRestarting: self._restarting,
            StepsQueued: self._queued,
            StepsTaken: self._taken,
            StragglerFound: self._straggler,
            Preemption: self._preempted,
        }

    def _phase(self, event: PhaseEnded) -> None:
        if (m := metrics()) is not None:
            m.startup.labels(self.executor, event.phase).observe(event.seconds)

    def _started(self, event: RunStarted) -> None:
        self.failed_at.clear()  # a new run: the last one's failures are no restarts of this one
        if (m := metrics()) is not None:
            m.runs.labels(self.executor, "started").inc()

    def _ended(self, event: RunEnded) -> None:
        if (m := metrics()) is not None:
            m.runs.labels(self.executor, event.outcome).inc()

    def _restarting(self, event: Restarting | RankRestarting) -> None:
        m = metrics()
        if m is not None and event.error is not None:
            m.restarts.labels(self.executor, type(event.error).__name__).inc()
            rank = event.rank if isinstance(event, RankRestarting) else None
            self.failed_at[rank] = time.perf_counter()

    def _taken(self, event: StepsTaken) -> None:
        # Counted as the iterator takes them, not as they are queued: the steps of a stopped
        # run that were queued and never handed over were not delivered.
        if (m := metrics()) is not None:
            batch = event.batch
            m.steps.labels(self.executor).inc(len(batch))
            m.reports.labels(self.executor).inc(len(batch) * batch.num_ranks)

    def _queued(self, event: StepsQueued) -> None:
        m = metrics()
        if m is None:
            return
        batch = event.batch
        if self.failed_at:
            now = time.perf_counter()
            # An aligned step is every rank's; an unaligned batch holds one rank's reports.
            for rank in (None,) if batch.ranks is None else (None, *set(batch.ranks)):
                failed_at = self.failed_at.pop(rank, None)
                if failed_at is not None:
                    m.restart_time.labels(self.executor).observe(now - failed_at)
        if batch.times is not None:  # one sample a batch: its last step's
            m.skew.labels(self.executor).observe(batch.times.skew(len(batch) - 1))

    def _straggler(self, event: StragglerFound) -> None:
        if (m := metrics()) is not None:
            m.stragglers.labels(self.executor).inc()

    def _preempted(self, event: Preemption) -> None:
        if (m := metrics()) is not None:
            m.preemptions.labels(self.executor, event.stage).inc()
            if event.stage != "noticed":
                # an independent rank's restart says its rank (the log line's ``rank``)
                rank = (event.details or {}).get("rank")
                self.failed_at[rank if isinstance(rank, int) else None] = time.perf_counter()

    def _sent(self, event: CallsSent) -> None:
        if (m := metrics()) is not None:
            m.calls.labels(self.executor).inc(event.calls)

    def _resent(self, event: CallResent) -> None:
        if (m := metrics()) is not None:
            m.call_resends.labels(self.executor).inc()

    def _renewed(self, event: RankRenewed) -> None:
        if (m := metrics()) is not None:
            m.ranks_renewed.labels(self.executor).inc()


class ExecutorTimeline:
    """The executor's timeline (added only when it keeps one: a call site that must do work to
    make an event asks whether any sink handles it)."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline

    def handlers(self) -> Mapping[type, Handler]:
        return {
            RunStarted: self._run_started,
            RunEnded: self._run_ended,
            RankChosen: self._chosen,
            SlotWaited: self._waited,
            CallEnded: self._call,
            PhaseEnded: self._phase,
            AttemptFailed: self._failed,
            Restarting: self._restarting,
            TornDown: self._torn_down,
            FunctionStarted: self._function,
            RankFailed: self._rank_failed,
            RankReplaced: self._rank_replaced,
            RankReported: self._reported,
            StepsTaken: self._steps,
            Preemption: self._preempted,
        }

    def _run_started(self, event: RunStarted) -> None:
        self.timeline.run_started()

    def _run_ended(self, event: RunEnded) -> None:
        self.timeline.run_ended()

    def _chosen(self, event: RankChosen) -> None:
        rank = event.rank
        self.timeline.instant(DRIVER, f"least loaded: rank {rank}", "call", {"rank": rank})
        self.timeline.instant(rank, "chosen by load", "call")

    def _waited(self, event: SlotWaited) -> None:
        self.timeline.span(DRIVER, "wait for a free rank", "call", event.start, event.end)

    def _call(self, event: CallEnded) -> None:
        self.timeline.span(event.rank, event.name, "call", event.start, event.end)

    def _phase(self, event: PhaseEnded) -> None:
        self.timeline.startup_phase(event.phase, event.t0, event.seconds)

    def _failed(self, event: AttemptFailed) -> None:
        self.timeline.failed(event.error)

    def _restarting(self, event: Restarting) -> None:
        if event.wait_s > 0:
            self.timeline.policy_wait(event.wait_s)

    def _torn_down(self, event: TornDown) -> None:
        self.timeline.span(DRIVER, "tear down", "restart", event.start, event.end)

    def _function(self, event: FunctionStarted) -> None:
        if event.error is None:
            self.timeline.function_started(event.start, event.end, event.attempt)

    def _rank_failed(self, event: RankFailed) -> None:
        name = type(event.error).__name__
        self.timeline.instant(event.rank, f"failed: {name}", "failure", {"error": name})

    def _rank_replaced(self, event: RankReplaced) -> None:
        self.timeline.span(event.rank, "replace rank", "restart", event.start, event.end)

    def _reported(self, event: RankReported) -> None:
        if event.packed is not None:
            self.timeline.reports(event.rank, event.first, event.packed)

    def _steps(self, event: StepsTaken) -> None:
        self.timeline.steps(event.batch)

    def _preempted(self, event: Preemption) -> None:
        self.timeline.preempted(event.stage)


def executor_observer(counts: ExecutorCounts, executor: str, timeline: Timeline | None) -> Observer:
    """An executor's observer: its counters (``counts``), its metrics (by its name
    ``executor``), and its timeline when it keeps one."""
    observer = Observer(counts, ExecutorMetrics(executor))
    if timeline is not None:
        observer.add(ExecutorTimeline(timeline))
    return observer


#: The run's log line of each stage of a preemption.
_PREEMPTION_LINES = {
    "noticed": "preemption_noticed",
    "moved": "moving_before_preemption",
    "restarted": "restarting_after_preemption",
}


class RunLog:
    """A run's log lines of its start, end, restarts and stragglers (``log``: the run's
    logger)."""

    def __init__(self, log: Any) -> None:
        self.log = log

    def handlers(self) -> Mapping[type, Handler]:
        return {
            RunStarted: self._started,
            RunEnded: self._ended,
            Restarting: self._restarting,
            RankRestarting: self._rank_restarting,
            StragglerFound: self._straggler,
            Preemption: self._preempted,
        }

    def _started(self, event: RunStarted) -> None:
        self.log.info("run_started")

    def _preempted(self, event: Preemption) -> None:
        self.log.warning(_PREEMPTION_LINES[event.stage], **(event.details or {}))

    def _ended(self, event: RunEnded) -> None:
        if event.outcome == "finished":
            self.log.info(
                "run_finished", steps=event.steps, attempts=event.attempts, seconds=event.seconds
            )
        elif event.outcome == "cancelled":
            self.log.info("run_cancelled", steps=event.steps)
        else:
            error = event.error
            self.log.warning("run_failed", error=None if error is None else describe(error))

    def _restarting(self, event: Restarting) -> None:
        self.log.warning(
            "restarting",
            attempt=event.attempt,
            wait_s=round(event.wait_s, 3),
            checkpoint=event.checkpoint,
        )

    def _rank_restarting(self, event: RankRestarting) -> None:
        self.log.warning(
            "rank_restarting", rank=event.rank, attempt=event.attempt, wait_s=event.wait_s
        )

    def _straggler(self, event: StragglerFound) -> None:
        self.log.warning(
            "straggler",
            rank=event.rank,
            node_id=event.node_id,
            pid=event.pid,
            attempt=event.attempt,
            step=event.step,
            steps=event.steps,
            step_s=round(event.step_s, 6),
            typical_s=round(event.typical_s, 6),
            factor=round(event.factor, 2),
            stack=event.stack,
        )


def run_observer(executor: Observer, log: Any) -> Observer:
    """A run's observer: its executor's sinks (``executor``'s, as they are when the run starts),
    then the run's log (``log``: its logger)."""
    return Observer(*executor.sinks, RunLog(log))
