"""A timeline as Chrome trace events (what ui.perfetto.dev and chrome://tracing read): a process
per executor that recorded into it, a thread (track) per rank, one for the driver and one for
the RL pipeline, and lanes: spans that overlap without one holding the other (a server's
concurrent ``generate`` calls, an install during a call) are each put on a lane of their own, a
thread beside their track's, since the importer can only nest the slices of one thread.

A lane is found for each span when the timeline is read, never when it is recorded: the lowest
lane whose open spans all end by the span's start or hold it whole (a driver's restart holds its
phases: they stay on one lane).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

__all__ = ["LANE_TIDS", "lanes", "thread_id", "trace_events", "track_name"]

#: How far apart a track's lanes' thread ids are (lane k of track t: ``t + 1 + k * LANE_TIDS``;
#: of the pipeline's track, ``LANE_TIDS - 1 + k * LANE_TIDS``: see :func:`thread_id`).
LANE_TIDS = 1_000_000


def track_name(track: int) -> str:
    """A track's name: ``driver``, ``pipeline`` or ``rank N``."""
    return "driver" if track == -1 else "pipeline" if track == -2 else f"rank {track}"


def thread_id(track: int, lane: int) -> int:
    """The thread id of ``track``'s lane ``lane``: the driver's lane 0 is 0, rank r's is
    ``r + 1``, each lane ``LANE_TIDS`` further. The pipeline's track (-2) would be -1 by that
    rule, and Perfetto's importer reads a tid that is not a uint32 as none given, then takes
    the pid for it: the pipeline's slices and its name landed on the thread whose tid equals
    the process's pid (rank 0's in the first process, rank 1's in the second), over that rank's
    calls. It takes the last id of each lane's block instead (``LANE_TIDS - 1``, which no rank
    below ``LANE_TIDS - 2`` reaches)."""
    base = LANE_TIDS - 1 if track == -2 else track + 1
    return base + lane * LANE_TIDS


def lanes(events: list[Any]) -> list[int]:
    """Each event's lane on its track (0 for an instant or a counter; a span's as the module's
    docstring says), in the order of ``events``."""
    found = [0] * len(events)
    order = sorted(
        (i for i, e in enumerate(events) if e[0] == "X"),
        key=lambda i: (events[i][1], events[i][4], -events[i][5]),
    )
    open_ends: dict[int, list[list[float]]] = defaultdict(list)  # track -> each lane's stack
    for i in order:
        _, track, _, _, start, end, _ = events[i]
        stacks = open_ends[track]
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                found[i] = lane
                break
        else:
            found[i] = len(stacks)
            stacks.append([end])
    return found


def trace_events(processes: list[tuple[str, list[Any]]], origin: float) -> list[dict[str, Any]]:
    """``processes`` (each a name and its timeline's events, on one clock) as Chrome trace
    events, in microseconds from ``origin``: process ``p + 1`` for the ``p``-th."""
    out: list[dict[str, Any]] = []
    for p, (name, events) in enumerate(processes):
        pid = p + 1
        out.append(
            {"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": name}}
        )
        out.append(
            {
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "name": "process_sort_index",
                "args": {"sort_index": p},
            }
        )
        found = lanes(events)
        threads = {(e[1], lane) for e, lane in zip(events, found, strict=True)} | {(-1, 0)}
        for track, lane in sorted(threads):
            tid = thread_id(track, lane)
            label = track_name(track) if not lane else f"{track_name(track)} · {lane + 1}"
            out.append(
                {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": label}}
            )
            sort = (track + 3) * 1000 + lane  # each track's lanes under it
            out.append(
                {
                    "ph": "M",
                    "pid": pid,
                    "tid": tid,
                    "name": "thread_sort_index",
                    "args": {"sort_index": sort},
                }
            )
        for (ph, track, title, kind, start, end, args), lane in zip(events, found, strict=True):
            event: dict[str, Any] = {
                "ph": ph,
                "pid": pid,
                "tid": thread_id(track, lane),
                "name": title,
                "cat": kind,
                "ts": (ts := round((start - origin) * 1e6, 3)),
            }
            if ph == "X":
                # The end rounded as the start is, the duration the difference: slices that
                # meet, or a child that ends with its parent, still do to the nanosecond
                # (rounded apart, one could overlap the next by 1 ns, which Perfetto drops).
                end_us = round((max(start, end) - origin) * 1e6, 3)
                event["dur"] = round(end_us - ts, 3)
            elif ph == "i":
                event["s"] = "t"
            if args:
                event["args"] = args
            out.append(event)
    return out
