"""The RL pipeline on its servers' executor's timeline (``Executor(timeline=True)``): a track
of its own (:data:`~asyncexec._timeline._timeline.PIPELINE`) with each weight update (the
pause, with its mode and the generations in flight when it began; the push; the resume), each
batch handed to the learner (with its staleness, and the learner's wait for it as a span), each
request expired or aborted (marked), and two counters (Chrome trace ``"C"`` events, drawn by
Perfetto as counter tracks): the requests in flight and the samples buffered, as admissions and
returns change them, at most one value a :data:`COUNTER_S` (the last of each window kept, at its
own time).

The pipeline's timeline sink (``_driver/pipeline/_sinks.py``) calls the functions here, one per
event; with the timeline off the pipeline has no such sink, and they are not called.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ._timeline import PIPELINE, Timeline

__all__ = [
    "COUNTER_S",
    "PipelineTrack",
    "batch_handed",
    "counted",
    "counts_flushed",
    "request_ended",
    "pipeline_track",
    "update_ended",
    "update_paused",
]


#: The counters' resolution, in seconds: within a window, only the last value is recorded (at
#: its own time). A pipeline of fast servers changes them at every admission and return:
#: recorded each time, they were two thirds of what the ring held (``benchmarks/observe.py
#: --pipeline``: 306,207 events through 100,000 requests, 146,143 with the window). A real
#: engine's changes are far apart: each is recorded.
COUNTER_S = 0.005


class PipelineTrack:
    """What the pipeline records on ``timeline``: see the module's docstring."""

    __slots__ = ("_began", "_due", "_pending", "_pushing", "_timer", "resolution_s", "timeline")

    def __init__(self, timeline: Timeline, resolution_s: float = COUNTER_S) -> None:
        self.timeline = timeline
        self.resolution_s = resolution_s  # the counters': see COUNTER_S
        self._began: float | None = None  # the update under way: when it began
        self._pushing: float | None = None  # and when its push began
        self._due = 0.0  # when the window of the last counter recorded ends
        self._pending: tuple[float, int, int] | None = None  # the window's latest, not recorded
        self._timer: asyncio.TimerHandle | None = None  # records it at the window's end

    def __repr__(self) -> str:
        return f"<PipelineTrack {self.timeline!r}>"


def pipeline_track(timeline: Timeline | None) -> PipelineTrack | None:
    """The pipeline's track on ``timeline`` (None: no timeline, nothing recorded)."""
    return None if timeline is None else PipelineTrack(timeline)


def counted(track: PipelineTrack | None, in_flight: int, buffered: int) -> None:
    """The requests in flight and the samples buffered now: recorded now when the window of the
    last one recorded is over, else kept until it is (a later value replaces it)."""
    if track is None:
        return
    now = time.monotonic()
    if now >= track._due:
        counts_flushed(track)
        _record(track, now, in_flight, buffered)
        track._due = now + track.resolution_s
        return
    track._pending = (now, in_flight, buffered)
    if track._timer is None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to end the window: recorded now
            counts_flushed(track)
            return
        track._timer = loop.call_later(track._due - now, counts_flushed, track)


def counts_flushed(track: PipelineTrack) -> None:
    """Record the counters' value kept in the window (at its own time), if any: at the window's
    end, and when the pipeline closes."""
    if track._timer is not None:
        track._timer.cancel()
        track._timer = None
    pending, track._pending = track._pending, None
    if pending is not None:
        _record(track, *pending)


def _record(track: PipelineTrack, at: float, in_flight: int, buffered: int) -> None:
    counts = {"in flight": in_flight, "buffered": buffered}
    track.timeline.counter(PIPELINE, "rollouts", "pipeline", at, counts)


def update_paused(track: PipelineTrack | None, mode: str, began: float, in_flight: int) -> None:
    """A weight update that began at ``began`` (``time.monotonic()``) has paused generation as
    ``mode`` says (``"wait"``: what was in flight has finished), with ``in_flight``
    generations in flight when it began: its push begins now."""
    if track is None:
        return
    now = time.monotonic()
    track._began, track._pushing = began, now
    name = f"pause ({mode}, {in_flight} in flight)"
    args = {"mode": mode, "in_flight": in_flight}
    track.timeline.span(PIPELINE, name, "pause", began, now, args)


def update_ended(track: PipelineTrack | None, mode: str, push_s: float, version: int) -> None:
    """The weight update that :func:`update_paused` saw is over (the learner's version is now
    ``version``; its push took ``push_s``): the push's span, the resume's, and the update's
    span that holds them."""
    if track is None:
        return
    now = time.monotonic()
    began, pushing = track._began, track._pushing
    track._began = track._pushing = None
    if pushing is None or began is None:  # the update failed before its push
        return
    timeline, pushed = track.timeline, min(pushing + push_s, now)
    args: dict[str, Any] = {"mode": mode, "version": version}
    timeline.span(PIPELINE, f"push v{version}", "push", pushing, pushed)
    if now > pushed:
        timeline.span(PIPELINE, "resume", "pause", pushed, now)
    timeline.span(PIPELINE, f"update v{version} ({mode})", "update", began, now, args)


def batch_handed(
    track: PipelineTrack | None,
    version: int,
    size: int,
    waited_s: float,
    staleness_max: int = 0,
    staleness_mean: float = 0.0,
) -> None:
    """The learner took a batch of ``size`` samples at ``version`` after waiting ``waited_s``
    (an instant, with the batch's staleness; and the learner's wait, a span ending now, when
    it waited)."""
    if track is None:
        return
    args = {
        "version": version,
        "size": size,
        "waited_s": round(waited_s, 6),
        "staleness_max": staleness_max,
        "staleness_mean": round(staleness_mean, 3),
    }
    name = f"batch v{version} ({size}, staleness ≤{staleness_max})"
    if waited_s > 0:
        now = time.monotonic()
        wait = {"version": version, "waited_s": round(waited_s, 6)}
        track.timeline.span(
            PIPELINE, f"learner waits (v{version})", "wait", now - waited_s, now, wait
        )
    track.timeline.instant(PIPELINE, name, "batch", args)


def request_ended(
    track: PipelineTrack | None, outcome: str, version: int, in_flight_s: float
) -> None:
    """A request was ``"expired"`` (cancelled after ``in_flight_s``, its prompt requeued) or
    ``"aborted"`` (by an update's pause) at the learner's ``version``: an instant, marked."""
    if track is not None:
        args = {"version": version, "in_flight_s": round(in_flight_s, 6)}
        track.timeline.instant(PIPELINE, outcome, outcome, args)
