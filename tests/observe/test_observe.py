"""The observer: an event emitted once reaches every sink that handles its type, in order; the
pipeline's and the router's events become their statistics, metrics and log lines."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import structlog

from asyncexec._driver._metrics import pipeline_meters
from asyncexec._driver._observe import Handler, Observer
from asyncexec._driver.pipeline._events import (
    Admitted,
    AnswerDropped,
    BatchHanded,
    GenerationEnded,
    RequestAnswered,
    RequestExpired,
    RequestReceived,
    RequestTimedOut,
    SampleReturned,
    ServerLoad,
    ServerReplaced,
    UpdateEnded,
)
from asyncexec._driver.pipeline._router_metrics import RouterMeters
from asyncexec._driver.pipeline._sinks import (
    PipelineMetrics,
    RouterCounts,
    pipeline_observer,
    router_observer,
)
from asyncexec._driver.pipeline._stats import Meter


@dataclass(frozen=True, slots=True)
class _Ping:
    n: int


@dataclass(frozen=True, slots=True)
class _Other:
    pass


class _Recorder:
    def __init__(self, name: str, seen: list[tuple[str, Any]]) -> None:
        self.name, self.seen = name, seen

    def handlers(self) -> Mapping[type, Handler]:
        return {_Ping: lambda event: self.seen.append((self.name, event))}


def test_an_event_reaches_every_sink_of_its_type_in_order_and_no_other() -> None:
    seen: list[tuple[str, Any]] = []
    observer = Observer(_Recorder("a", seen), _Recorder("b", seen))
    observer.emit(_Ping(1))
    observer.emit(_Other())  # no sink handles it: nothing happens
    assert seen == [("a", _Ping(1)), ("b", _Ping(1))]
    assert "_Recorder, _Recorder" in repr(observer)


def test_a_sink_that_raises_makes_emit_raise() -> None:
    """Nothing is logged and dropped."""

    class Broken:
        def handlers(self) -> Mapping[type, Handler]:
            return {_Ping: lambda event: 1 / 0}

    with pytest.raises(ZeroDivisionError):
        Observer(Broken()).emit(_Ping(0))


def test_pipeline_events_become_its_statistics_metrics_and_log() -> None:
    meter = Meter()
    with structlog.testing.capture_logs() as logs:
        log = structlog.get_logger()
        observer = pipeline_observer(meter, pipeline_meters("ex"), log, None)
        observer.emit(Admitted(1, 0))
        observer.emit(Admitted(2, 0))
        observer.emit(GenerationEnded(0.5))
        observer.emit(SampleReturned("finished", 1, 1))
        observer.emit(SampleReturned("aborted", 0, 1))
        observer.emit(RequestExpired(0, 0.25, 0, 1))
        observer.emit(BatchHanded(1, (0, 2), 2, 0.1, 0, bound=1))
        observer.emit(UpdateEnded("keep", 1, 0.01, 0.02, 3))
    stats = meter.snapshot(1, 0, 0)
    assert (stats.admitted, stats.consumed, stats.aborted, stats.requeued) == (2, 2, 2, 2)
    assert (stats.expired, stats.expired_s, stats.generation_s) == (1, 0.25, 0.5)
    assert (stats.staleness_max, stats.beyond_bound, stats.buffer_depth_max) == (2, 1, 1)
    assert stats.pauses["keep"].updates == 1
    metrics = next(s for s in observer.sinks if isinstance(s, PipelineMetrics))
    assert metrics.counts == {
        "admitted": 2,
        "consumed": 2,
        "aborted": 2,
        "requeued": 2,
        "duplicates": 0,
        "expired": 1,
    }
    assert [e["event"] for e in logs] == ["pipeline_batch", "pipeline_update"]


def test_router_events_become_its_counters_and_log() -> None:
    counts = RouterCounts()
    with structlog.testing.capture_logs() as logs:
        observer = router_observer(counts, RouterMeters("ex"), structlog.get_logger())
        observer.emit(RequestReceived())
        observer.emit(ServerLoad(0, 1))
        observer.emit(RequestAnswered(0))
        observer.emit(AnswerDropped(0, duplicate=True))
        observer.emit(AnswerDropped(1, duplicate=False))
        observer.emit(RequestTimedOut((0, 1), 1.0))
        observer.emit(ServerReplaced(1, 3, fresh=True))
        observer.emit(ServerReplaced(1, 3, fresh=False))  # came back: not a replacement
    assert counts.counts == {
        "requests": 1,
        "answered": 1,
        "retries": 0,
        "duplicates_dropped": 1,
        "late_dropped": 1,
        "timeouts": 1,
        "taken_out": 0,
        "replaced": 1,
    }
    assert [e["event"] for e in logs] == [
        "duplicate_dropped",
        "late_answer_dropped",
        "request_timed_out",
        "server_replaced",
        "server_back",
    ]
    assert logs[2]["ranks"] == [0, 1]
