"""The RL pipeline on its servers' executor's timeline (``Executor(timeline=True)``): a track
of its own (:data:`~asyncexec._timeline._timeline.PIPELINE`) with each weight update (the
pause, with its mode and the generations in flight when it began; the push; the resume), each
batch handed to the learner (with its staleness, and the learner's wait for it as a span), each
request expired or aborted (marked), and two counters (Chrome trace ``"C"`` events, drawn by
Perfetto as counter tracks): the requests in flight and the samples buffered, at each admission
and each return.

The pipeline's timeline sink (``_driver/pipeline/_sinks.py``) calls the functions here, one per
event; with the timeline off the pipeline has no such sink, and they are not called.
"""

from __future__ import annotations

import time
from typing import Any

from ._timeline import PIPELINE, Timeline

__all__ = [
    "PipelineTrack",
    "batch_handed",
    "counted",
    "request_ended",
    "pipeline_track",
    "update_ended",
    "update_paused",
]


class PipelineTrack:
    """What the pipeline records on ``timeline``: see the module's docstring."""

    __slots__ = ("_began", "_pushing", "timeline")

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self._began: float | None = None  # the update under way: when it began
        self._pushing: float | None = None  # and when its push began

    def __repr__(self) -> str:
        return f"<PipelineTrack {self.timeline!r}>"


def pipeline_track(timeline: Timeline | None) -> PipelineTrack | None:
    """The pipeline's track on ``timeline`` (None: no timeline, nothing recorded)."""
    return None if timeline is None else PipelineTrack(timeline)


def counted(track: PipelineTrack | None, in_flight: int, buffered: int) -> None:
    """The requests in flight and the samples buffered now (one counter event)."""
    if track is not None:
        now = time.monotonic()
        counts = {"in flight": in_flight, "buffered": buffered}
        track.timeline.counter(PIPELINE, "rollouts", "pipeline", now, counts)


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
