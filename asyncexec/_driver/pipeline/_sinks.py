"""The sinks of the pipeline's and the router's events (``_events``): each turns an event into
its own form. The statistics' sinks are the counters themselves (``_stats.Meter``, the router's
``RouterCounts``); here: the pipeline's timeline track, its metrics and its log lines, and the
router's metrics and log lines. An observer made by :func:`pipeline_observer` or
:func:`router_observer` holds them in that order (statistics first)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._logging import Logger
from ..._timeline._pipeline import (
    PipelineTrack,
    batch_handed,
    counted,
    counts_flushed,
    request_ended,
    update_ended,
    update_paused,
)
from ..._wire import _tracing
from .._metrics import PipelineMeters
from .._observe import Handler, Observer
from ._events import (
    Admitted,
    AnswerDropped,
    BatchHanded,
    PipelineClosed,
    RequestAnswered,
    RequestExpired,
    RequestReceived,
    RequestRetried,
    RequestTimedOut,
    SampleReturned,
    ServerLoad,
    ServerReplaced,
    ServerTakenOut,
    UpdateEnded,
    UpdatePaused,
)
from ._router_metrics import RouterMeters
from ._stats import Meter

__all__ = [
    "PipelineLog",
    "PipelineMetrics",
    "PipelineSpans",
    "PipelineTimeline",
    "RouterCounts",
    "RouterLog",
    "RouterMetrics",
    "pipeline_observer",
    "router_observer",
]

# The pipeline ---------------------------------------------------------------------------------


class PipelineTimeline:
    """The pipeline's track on its servers' timeline (``_timeline._pipeline``)."""

    def __init__(self, track: PipelineTrack) -> None:
        self.track = track
        self.version = 0  # the learner's, at the latest batch

    def handlers(self) -> Mapping[type, Handler]:
        return {
            Admitted: self._counted,
            SampleReturned: self._returned,
            RequestExpired: self._expired,
            BatchHanded: self._batch,
            UpdatePaused: self._paused,
            UpdateEnded: self._ended,
            PipelineClosed: self._closed,
        }

    def _counted(self, event: Admitted | SampleReturned | RequestExpired) -> None:
        counted(self.track, event.in_flight, event.buffered)

    def _returned(self, event: SampleReturned) -> None:
        counted(self.track, event.in_flight, event.buffered)
        if event.outcome == "aborted":
            request_ended(self.track, "aborted", self.version, 0.0)

    def _expired(self, event: RequestExpired) -> None:
        counted(self.track, event.in_flight, event.buffered)
        request_ended(self.track, "expired", event.version, event.in_flight_s)

    def _batch(self, event: BatchHanded) -> None:
        self.version = event.version
        size, staleness = len(event.staleness), event.staleness
        mean = sum(staleness) / size if size else 0.0
        batch_handed(self.track, event.version, size, event.waited_s, event.staleness_max, mean)

    def _paused(self, event: UpdatePaused) -> None:
        update_paused(self.track, event.mode, event.began, event.in_flight)

    def _ended(self, event: UpdateEnded) -> None:
        update_ended(self.track, event.mode, event.push_s, event.version)

    def _closed(self, event: PipelineClosed) -> None:
        counts_flushed(self.track)


class PipelineMetrics:
    """The pipeline's metrics (``_metrics.PipelineMeters``: nothing while metrics are off): the
    sample events tallied here, synced to the counters at each batch and at the close (when
    the requests in flight go to 0)."""

    def __init__(self, meters: PipelineMeters) -> None:
        self.meters = meters
        meters.zero()
        self.counts = dict.fromkeys(
            ("admitted", "consumed", "aborted", "requeued", "duplicates", "expired"), 0
        )
        self.in_flight = 0  # the requests in flight, at the latest sample event

    def handlers(self) -> Mapping[type, Handler]:
        return {
            Admitted: self._admitted,
            SampleReturned: self._returned,
            RequestExpired: self._expired,
            BatchHanded: self._batch,
            UpdateEnded: self._ended,
            PipelineClosed: self._closed,
        }

    def _admitted(self, event: Admitted) -> None:
        self.counts["admitted"] += 1
        self.in_flight = event.in_flight

    def _returned(self, event: SampleReturned) -> None:
        self.in_flight = event.in_flight
        if event.outcome == "aborted":
            self.counts["aborted"] += 1
            self.counts["requeued"] += 1
        elif event.outcome == "duplicate":
            self.counts["duplicates"] += 1

    def _expired(self, event: RequestExpired) -> None:
        self.in_flight = event.in_flight
        for name in ("expired", "aborted", "requeued"):
            self.counts[name] += 1

    def _batch(self, event: BatchHanded) -> None:
        self.counts["consumed"] += len(event.staleness)
        self.meters.batch(
            event.staleness, event.waited_s, event.buffered, self.counts, self.in_flight
        )

    def _ended(self, event: UpdateEnded) -> None:
        self.meters.paused(event.mode, event.pause_s, self.in_flight)

    def _closed(self, event: PipelineClosed) -> None:
        self.in_flight = 0
        self.meters.closed(self.counts)


class PipelineLog:
    """The pipeline's log lines of its batches and updates."""

    def __init__(self, log: Logger) -> None:
        self.log = log

    def handlers(self) -> Mapping[type, Handler]:
        return {BatchHanded: self._batch, UpdateEnded: self._ended}

    def _batch(self, event: BatchHanded) -> None:
        self.log.debug(
            "pipeline_batch",
            version=event.version,
            size=len(event.staleness),
            staleness_max=event.staleness_max,
            waited_s=round(event.waited_s, 6),
            buffered=event.buffered,
        )

    def _ended(self, event: UpdateEnded) -> None:
        self.log.info(
            "pipeline_update",
            version=event.version,
            mode=event.mode,
            pause_s=round(event.pause_s, 6),
            push_s=round(event.push_s, 6),
            in_flight=event.in_flight,
        )


class PipelineSpans:
    """Each batch handed to the learner as an OpenTelemetry span (``asyncexec.pipeline.batch``:
    from when the learner began to wait for it to when it had it; nothing while tracing is
    off). The updates' spans are opened where the update runs (``_updates``), so that the
    calls and pushes it makes are their children."""

    def handlers(self) -> Mapping[type, Handler]:
        return {BatchHanded: self._batch}

    def _batch(self, event: BatchHanded) -> None:
        _tracing.record(
            "asyncexec.pipeline.batch",
            event.waited_s,
            version=event.version,
            size=len(event.staleness),
            staleness_max=event.staleness_max,
            waited_s=event.waited_s,
        )


def pipeline_observer(
    meter: Meter, meters: PipelineMeters, log: Logger, track: PipelineTrack | None
) -> Observer:
    """A pipeline's observer: its statistics (``meter``), metrics, log, spans, and its
    timeline track when its servers keep a timeline."""
    observer = Observer(meter, PipelineMetrics(meters), PipelineLog(log), PipelineSpans())
    if track is not None:
        observer.add(PipelineTimeline(track))
    return observer


# The router -----------------------------------------------------------------------------------

#: The router's counters (``RouterStatistics``' names) each event counts in.
_COUNTED: dict[type, str] = {
    RequestReceived: "requests",
    RequestRetried: "retries",
    RequestAnswered: "answered",
    RequestTimedOut: "timeouts",
    ServerTakenOut: "taken_out",
}


def _counter(event: object) -> str | None:
    """The counter ``event`` counts in (None: none)."""
    if isinstance(event, AnswerDropped):
        return "duplicates_dropped" if event.duplicate else "late_dropped"
    if isinstance(event, ServerReplaced):
        return "replaced" if event.fresh else None
    return _COUNTED[type(event)]


class RouterCounts:
    """The router's counters (``RouterStatistics``, less what its servers' records say)."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(
            ("requests", "answered", "retries", "duplicates_dropped", "late_dropped", "timeouts"),
            0,
        ) | {"taken_out": 0, "replaced": 0}

    def handlers(self) -> Mapping[type, Handler]:
        return dict.fromkeys((*_COUNTED, AnswerDropped, ServerReplaced), self._count)

    def _count(self, event: object) -> None:
        name = _counter(event)
        if name is not None:
            self.counts[name] += 1


class RouterMetrics:
    """The router's metrics (``_router_metrics.RouterMeters``: nothing while metrics are off)."""

    def __init__(self, meters: RouterMeters) -> None:
        self.meters = meters
        meters.zero()

    def handlers(self) -> Mapping[type, Handler]:
        found: dict[type, Handler] = dict.fromkeys(
            (*_COUNTED, AnswerDropped, ServerReplaced), self._count
        )
        found[ServerLoad] = self._load
        return found

    def _count(self, event: object) -> None:
        name = _counter(event)
        if name is not None:
            self.meters.count(name)

    def _load(self, event: ServerLoad) -> None:
        self.meters.in_flight(event.rank, event.in_flight)


class RouterLog:
    """The router's log lines of dropped answers, timeouts, servers out and back."""

    def __init__(self, log: Logger) -> None:
        self.log = log

    def handlers(self) -> Mapping[type, Handler]:
        return {
            AnswerDropped: self._dropped,
            RequestTimedOut: self._timed_out,
            ServerTakenOut: self._taken_out,
            ServerReplaced: self._replaced,
        }

    def _dropped(self, event: AnswerDropped) -> None:
        name = "duplicate_dropped" if event.duplicate else "late_answer_dropped"
        self.log.info(name, rank=event.rank)

    def _timed_out(self, event: RequestTimedOut) -> None:
        ranks: Any = list(event.ranks)
        self.log.warning("request_timed_out", ranks=ranks, deadline_s=event.deadline_s)

    def _taken_out(self, event: ServerTakenOut) -> None:
        self.log.warning("server_taken_out", rank=event.rank, error=event.error)

    def _replaced(self, event: ServerReplaced) -> None:
        name = "server_replaced" if event.fresh else "server_back"
        self.log.info(name, rank=event.rank, version=event.version)


def router_observer(counts: RouterCounts, meters: RouterMeters, log: Logger) -> Observer:
    """A router's observer: its counters, metrics and log."""
    return Observer(counts, RouterMetrics(meters), RouterLog(log))
