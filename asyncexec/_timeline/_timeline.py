"""A timeline of an executor's life: what each rank and the driver did, and when, in a ring of
fixed size, exported as Chrome trace events (Perfetto) or drawn as a PNG.

Off by default (``Executor(timeline=True)`` turns it on) and free when off: an executor's
groups, runs and calls emit their events to its observer, whose timeline sink
(``_driver._sinks.ExecutorTimeline``, there only when the timeline is on) records them; the
weight channel's and the pipeline's sinks record theirs (the helpers below). What is recorded:

- steps: each rank's span of each step, from the end of its previous ``report()`` to this one
  (the time its function ran for the step, on the driver's clock: the report times the workers
  send with their reports, placed on the driver's clock), derived from the batches of steps the
  run hands to its iterator;
- dispatched calls (``call()``, ``stream()``): each rank's span from the send to the result; a
  call chosen by load, the choice (an instant) and the wait for a free slot;
- weight pushes: the read of the source (on the source executor's timeline), the delivery (the
  target's driver track) and each target rank's fetch and install;
- restarts and their phases on the driver's track: the failure, tearing the group down, the
  policy's wait, placing the new group, starting its workers, setting them up (devices, roles'
  instances restored), the backend, starting the function from the checkpoint, and the first
  step after it; one ``restart`` span holds them;
- preemption notices, moves and the restarts after a lost node, as instants.

Every time is ``time.monotonic()`` (the clock the report times are placed on). The ring keeps
the last ``capacity`` events; older ones are dropped and counted.
"""

from __future__ import annotations

import collections
import json
import math
import os
import time
import weakref
from array import array
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from .._wire import _tracing
from .._wire._protocol import ReportTimes
from ._export import trace_events, track_name

__all__ = [
    "DRIVER",
    "PIPELINE",
    "Timeline",
    "TimelineStatistics",
    "installed",
    "new_timeline",
    "timed",
    "timed_delivery",
    "track_name",
]

T = TypeVar("T")
#: The driver's track (ranks are 0, 1, ...).
DRIVER = -1
#: The RL pipeline's track (see ``_timeline_pipeline``).
PIPELINE = -2
#: The default number of events a timeline keeps.
CAPACITY = 100_000
#: The start-up phases as the timeline names them.
_PHASES = {
    "placement": "place",
    "workers": "start workers",
    "set_up": "set up (restore roles)",
    "ready": "backend ready",
    "leased": "lease",
}

# An event: (phase 'X' span, 'i' instant or 'C' counter, track, name, category, start, end, args
# or None; a counter's args are its values).
Event = tuple[str, int, str, str, float, float, "dict[str, Any] | None"]


@dataclass(frozen=True)
class TimelineStatistics:
    """A timeline's counts: the events it holds, the most it holds, and the ones dropped (the
    oldest, when it was full: a batch of steps' spans goes at once, so it may hold a batch's
    fewer than ``capacity``)."""

    events: int
    capacity: int
    dropped: int


class _Ring:
    """The events of a timeline and of every timeline that joined it (:meth:`Timeline.joined`),
    oldest first, with the process each was recorded for, on one clock."""

    __slots__ = (
        "capacity",
        "entries",
        "gone",
        "held",
        "names",
        "next_pid",
        "origin",
        "pids",
        "prune_at",
        "recorded",
        "wall_origin",
    )

    def __init__(self, capacity: int, name: str) -> None:
        self.capacity = capacity
        #: The entries: an event, or a batch of steps (its spans made when they are read).
        self.entries: collections.deque[Any] = collections.deque()
        self.pids: collections.deque[int] = collections.deque()  # each entry's process
        self.held = 0  # the events in the entries
        self.recorded = 0
        #: Each process's name, by its index, while its timeline lives or its events are held
        #: (see :meth:`prune`).
        self.names = {0: name}
        self.next_pid = 1
        self.gone: set[int] = set()  # processes whose timeline is gone (their names kept)
        self.prune_at = _PRUNE_AT
        self.origin = time.monotonic()
        self.wall_origin = time.time()

    def prune(self) -> None:
        """Forget the names of the processes whose timeline is gone and whose events are all
        dropped: a service that joins an executor per request kept every name it ever had. Done
        when a process joins and many are gone (one pass over the ring each time as many
        again are gone): the recording of an event pays nothing for it."""
        if len(self.gone) < self.prune_at:
            return
        held = set(self.pids)
        for pid in self.gone - held:
            del self.names[pid]
        self.gone &= held
        self.prune_at = max(_PRUNE_AT, 2 * len(self.gone))


#: How many processes may be gone before their names are pruned (see :meth:`_Ring.prune`).
_PRUNE_AT = 64


class Timeline:
    """What an executor's ranks and driver did, and when (see the module's docstring).

    One timeline may hold several executors' (and the pipeline's and router's over them), on
    one clock: pass it to each (``Executor(timeline=shared, name="learner")``); each records into
    a process of its own, named by the executor (:meth:`joined`), and ``shared.export(path)``
    writes them all: one Perfetto process per executor, one PNG section per executor.

    Args:
        capacity: the most events kept, all processes together; older ones are dropped
            (counted in :meth:`statistics`).
        name: the name of its own process (what an export titles it by).
    """

    def __init__(self, capacity: int = CAPACITY, name: str = "asyncexec") -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self._ring = _Ring(capacity, name)
        self._pid = 0  # this timeline's process in the ring
        self._init_state()

    def _init_state(self) -> None:
        #: The restart under way: when it began, and when the function started again.
        self._restart: float | None = None
        self._restarted_fn: float | None = None
        self._restarted_attempt = 0
        #: Start-up phases under way: the end of the previous phase, by the start-up's t0.
        self._phases: dict[float, float] = {}
        #: Deliveries under way: their start, by version.
        self._deliveries: dict[int, float] = {}
        #: The restart policy's wait under way: when it began, and when it is to end.
        self._waiting: tuple[float, float] | None = None

    def joined(self, name: str) -> Timeline:
        """A timeline that records into this one's ring as a process of its own, ``name`` (an
        executor's): on this one's clock, exported with it; its own :meth:`events` are its
        process's."""
        ring = self._ring
        ring.prune()
        view = object.__new__(Timeline)
        view._ring = ring
        view._pid = ring.next_pid
        ring.next_pid += 1
        ring.names[view._pid] = name
        weakref.finalize(view, ring.gone.add, view._pid)
        view._init_state()
        return view

    @property
    def capacity(self) -> int:
        return self._ring.capacity

    @property
    def name(self) -> str:
        """The name of this timeline's process."""
        return self._ring.names[self._pid]

    @property
    def origin(self) -> float:
        """When the timeline (the first of those joined) began, on ``time.monotonic()``."""
        return self._ring.origin

    @property
    def wall_origin(self) -> float:
        return self._ring.wall_origin

    def __repr__(self) -> str:
        return f"<Timeline {self.name!r} events={self._ring.held} capacity={self.capacity}>"

    def statistics(self) -> TimelineStatistics:
        """How many events it holds, its capacity, and how many were dropped (all processes
        together)."""
        ring = self._ring
        return TimelineStatistics(ring.held, ring.capacity, ring.recorded - ring.held)

    def _add(self, entry: Any, events: int) -> None:
        """Keep ``entry`` (of ``events`` events), dropping the oldest entries past the
        capacity."""
        ring = self._ring
        queue = ring.entries
        queue.append(entry)
        ring.pids.append(self._pid)
        ring.recorded += events
        ring.held += events
        while ring.held > ring.capacity:
            old = queue.popleft()
            ring.pids.popleft()
            ring.held -= old[1] if old[0] in "BR" else 1

    # Recording --------------------------------------------------------------------------------

    def span(
        self,
        track: int,
        name: str,
        kind: str,
        start: float,
        end: float,
        args: dict[str, Any] | None = None,
    ) -> None:
        """A span on ``track`` (a rank, or :data:`DRIVER`) from ``start`` to ``end``."""
        self._add(("X", track, name, kind, start, end, args), 1)

    def instant(self, track: int, name: str, kind: str, args: dict[str, Any] | None = None) -> None:
        """Something that happened now on ``track``."""
        now = time.monotonic()
        self._add(("i", track, name, kind, now, now, args), 1)

    def counter(self, track: int, name: str, kind: str, at: float, values: dict[str, Any]) -> None:
        """Counter ``name``'s ``values`` at ``at`` (Perfetto draws each as a track)."""
        self._add(("C", track, name, kind, at, at, values), 1)

    def steps(self, batch: Any) -> None:
        """The ranks' spans of a batch of steps (a ``StepBatch`` with report times; one without,
        of independent ranks, records nothing). One entry a batch, whatever its size: the
        spans are made when the timeline is read."""
        times = batch.times
        if times is None:
            return
        kept, first = times, batch.first
        ranks = len(times.offsets)
        if len(times.calls) > self._ring.capacity and ranks <= self._ring.capacity:
            # More than the ring holds: its last steps that fit are kept (the whole batch went
            # before, the ring's oldest entry the moment it came: a small ring kept no step).
            skip = times.steps - self._ring.capacity // ranks
            kept, first = times.part(skip, times.steps), first + skip
            self._ring.recorded += skip * ranks
        spans = len(kept.calls)  # one a rank and step
        self._add(("B", spans, first, kept), spans)
        if self._restarted_fn is not None and batch.attempt >= self._restarted_attempt:
            self._restarted(times)

    def reports(self, rank: int, first: int, packed: bytes) -> None:
        """Rank ``rank``'s reports of one poll (a run of independent ranks, whose batches hold
        one rank each), their stream indices from ``first``; ``packed``: their
        ``ReportTimes``, as the poll carried them. One entry, its spans made when read."""
        calls, busy = array("d"), array("d")
        offset = time.monotonic() - ReportTimes.unpack_into(packed, calls, busy)
        skip = len(calls) - self._ring.capacity
        if skip > 0:  # more than the ring holds: the last that fit (see :meth:`steps`)
            calls, busy, first = calls[skip:], busy[skip:], first + skip
            self._ring.recorded += skip
        self._add(("R", len(calls), first, rank, calls, busy, offset), len(calls))

    def _restarted(self, times: Any) -> None:
        """The first step after a restart: its span (from the function's start), and the
        restart's, from the failure to that step."""
        on_driver = [c + o for c, o in zip(times.calls[:: times.steps], times.offsets, strict=True)]
        known = [t for t in on_driver if not math.isnan(t)]
        if not known:
            return
        first_step = max(known)
        begun, started = self._restart, self._restarted_fn
        self._restart = self._restarted_fn = None
        if begun is None or started is None:  # (never: a new run forgets both together)
            return
        self.span(DRIVER, "first step", "restart", started, first_step)
        self.span(DRIVER, "restart", "restart", begun, first_step)

    def run_started(self) -> None:
        """A run began: a restart of the run before it that never reached its first step is
        over (a named run that resumes starts at a later attempt, with no failure of its
        own)."""
        self._waited(time.monotonic())
        self._restart = self._restarted_fn = None
        self._restarted_attempt = 0

    def run_ended(self) -> None:
        """The run ended (also when it was stopped during the restart policy's wait)."""
        self._waited(time.monotonic())

    def policy_wait(self, seconds: float) -> None:
        """The restart policy waits ``seconds`` from now before the next attempt: its span is
        recorded when the wait is over (the next start-up begins, or the run ends first), never
        past its end (a span recorded at once, to its planned end, outlasted a run stopped
        during the wait, and the picture with it)."""
        now = time.monotonic()
        self._waited(now)
        self._waiting = (now, now + seconds)

    def _waited(self, until: float, cut: bool = True) -> None:
        """Record the policy's wait under way, if any, as over by ``until`` (``cut=False``:
        only if it was to end by then: another group's start-up, a spare's, may come during
        the wait)."""
        waiting = self._waiting
        if waiting is None or (not cut and until < waiting[1]):
            return
        self._waiting = None
        start, planned = waiting
        self.span(DRIVER, "wait (policy)", "restart", start, max(start, min(planned, until)))

    def failed(self, error: BaseException) -> None:
        """An attempt failed: a restart may follow (its span begins now)."""
        rank = getattr(error, "rank", None)
        args = {"error": type(error).__name__}
        self.instant(DRIVER, f"failed: {type(error).__name__}", "failure", args)
        if isinstance(rank, int):
            self.instant(rank, f"failed: {type(error).__name__}", "failure", args)
        if self._restart is None:
            self._restart = time.monotonic()

    def function_started(self, start: float, end: float, attempt: int) -> None:
        """The function was started on every rank (attempt ``attempt``)."""
        self._waited(start)
        self.span(DRIVER, f"start function (attempt {attempt})", "attempt", start, end)
        if attempt <= 1:  # a new run: a restart the last one never finished is over
            self._restart = self._restarted_fn = None
        if self._restart is not None:
            self._restarted_fn, self._restarted_attempt = end, attempt

    def startup_phase(self, phase: str, t0: float, seconds: float) -> None:
        """A group's start-up phase ``phase`` ended ``seconds`` after the start-up began
        (``t0``: its key)."""
        end = time.monotonic()
        start = self._phases.pop(t0, end - seconds)
        self._waited(start, cut=False)
        if phase not in ("ready", "leased"):
            self._phases[t0] = end
            if len(self._phases) > 64:  # start-ups that never finished
                self._phases.pop(next(iter(self._phases)))
        self.span(DRIVER, _PHASES.get(phase, phase), "startup", start, end)

    def preempted(self, stage: str, ranks: Any = None) -> None:
        """A preemption notice (``noticed``), a move off drained nodes (``moved``) or a restart
        after a drained node went (``restarted``)."""
        args = {"ranks": list(ranks)} if ranks else None
        self.instant(DRIVER, f"preemption {stage}", "preemption", args)
        if stage != "noticed" and self._restart is None:
            self._restart = time.monotonic()

    # Export -----------------------------------------------------------------------------------

    def events(self) -> list[Event]:
        """This process's events held, oldest first: each rank's span of each step (``step N``),
        from the end of its previous ``report()`` (when its worker did not say, from its
        previous report)."""
        return self._process_events(self._pid)

    def processes(self) -> list[tuple[str, list[Event]]]:
        """Each process's name and :meth:`events` (this one's first, then those that joined
        it, in the order they joined; a process with no event left out, unless none has
        any)."""
        ring = self._ring
        # One pass over the ring, however many processes ever joined it (one pass for each
        # made the export of a service that joins an executor per request slower with each).
        held: dict[int, list[Any]] = {}
        for entry, of in zip(ring.entries, ring.pids, strict=True):
            held.setdefault(of, []).append(entry)
        found = [(ring.names[pid], _read(held[pid])) for pid in sorted(held)]
        return found or [(ring.names.get(0, self.name), [])]

    def _process_events(self, pid: int) -> list[Event]:
        ring = self._ring
        return _read([e for e, of in zip(ring.entries, ring.pids, strict=True) if of == pid])

    def trace_events(self, name: str | None = None) -> list[dict[str, Any]]:
        """The events as Chrome trace events (what ui.perfetto.dev and chrome://tracing read):
        one process per executor that recorded into it (this one's named ``name`` when given),
        one thread (track) for its driver and one per rank, concurrent calls on a rank each on
        a lane of their own; times in microseconds since the timeline began."""
        return trace_events(self._named(name), self.origin)

    def _named(self, name: str | None) -> list[tuple[str, list[Event]]]:
        processes = self.processes() if self._pid == 0 else [(self.name, self.events())]
        if name is not None and len(processes) == 1:
            processes[0] = (name, processes[0][1])
        return processes

    def export(self, path: str | os.PathLike[str], name: str | None = None) -> None:
        """Write the timeline as a Chrome trace-event JSON file (open it in ui.perfetto.dev), or
        as a PNG when ``path`` ends with ``.png`` (see :meth:`render`). The timeline that others
        joined writes them all; a joined one, its own process."""
        if os.fspath(path).lower().endswith(".png"):
            self.render(path, name)
            return
        document = {
            "traceEvents": self.trace_events(name),
            "displayTimeUnit": "ms",
            "otherData": {"wall_origin": self.wall_origin, **_counts(self.statistics())},
        }
        with open(path, "w") as f:
            json.dump(document, f)

    def render(
        self, path: str | os.PathLike[str], title: str | None = None, *, startup: bool = False
    ) -> None:
        """Draw the timeline as a PNG: a section per executor (titled by its name when there
        are several), in it one row per rank and one for the driver, colours by kind, each
        rank's calls in flight, the long ones and restarts marked (needs matplotlib: the
        ``timeline`` extra). Its clock starts at the first step, call or pipeline event: what
        came before (the start-up, a first weight push) is folded into a band left of 0,
        labelled with each executor's start-up seconds; ``startup=True`` draws it in full."""
        from ._render import render

        processes = self._named(None)
        render(processes, self.origin, path, title, startup)


def _read(entries: list[Any]) -> list[Event]:
    """The events of one process's ``entries``, oldest first (a batch's spans made here: see
    :meth:`Timeline.events`)."""
    out: list[Event] = []
    last: dict[int, float] = {}
    for entry in entries:
        if entry[0] == "R":
            _, count, first, rank, calls, busy, offset = entry
            previous = _steps(out, rank, first, calls, busy, 0, count, offset, last.get(rank))
            if previous is not None:
                last[rank] = previous
            continue
        if entry[0] != "B":
            out.append(entry)
            continue
        _, _, first, times = entry
        n = times.steps
        for rank, offset in enumerate(times.offsets):
            previous = last.get(rank)
            previous = _steps(
                out, rank, first, times.calls, times.busy, rank * n, n, offset, previous
            )
            if previous is not None:
                last[rank] = previous
    return out


def _steps(
    out: list[Event],
    rank: int,
    first: int,
    calls: Any,
    busy: Any,
    base: int,
    n: int,
    offset: float,
    previous: float | None,
) -> float | None:
    """Append rank ``rank``'s spans of steps ``first ..`` (``n`` of them, at ``base`` in
    ``calls`` and ``busy``, on the worker's clock, ``offset`` from the driver's), each from the
    end of the rank's previous ``report()`` (when its worker did not say, from its previous
    report, ``previous``); return when its last one ended."""
    for i in range(n):
        at = calls[base + i] + offset
        if at != at:  # NaN: not known
            continue
        ran = busy[base + i]
        start = at - ran if ran == ran else (previous if previous is not None else at)
        if previous is not None and start < previous:
            # Two batches place the worker's clock apart (each with its own offset, a
            # millisecond or so off on a loaded machine): a span never starts before the
            # rank's previous one ended, nor ends before it (a report placed before the
            # previous one's end is an empty span there), so a rank's steps never overlap.
            start, at = previous, max(at, previous)
        out.append(("X", rank, f"step {first + i}", "step", start, at, None))
        previous = at
    return previous


def _counts(stats: TimelineStatistics) -> dict[str, int]:
    return {"events": stats.events, "capacity": stats.capacity, "dropped": stats.dropped}


async def timed(
    timeline: Timeline | None,
    track: int,
    name: str,
    kind: str,
    awaitable: Awaitable[T],
    span: str | None = None,
) -> T:
    """Await ``awaitable``; when ``timeline`` is on, record it as a span (also when it
    raises); inside OpenTelemetry span ``span`` when one is named and tracing is on."""
    if span is not None:
        awaitable = _tracing.in_span(span, awaitable)
    if timeline is None:
        return await awaitable
    start = time.monotonic()
    try:
        return await awaitable
    finally:
        timeline.span(track, name, kind, start, time.monotonic())


async def timed_delivery(timeline: Timeline | None, version: int, awaitable: Awaitable[T]) -> T:
    """Await a push's delivery of ``version``; its span, and the start of each target rank's
    install span (see :func:`installed`)."""
    awaitable = _tracing.in_span("asyncexec.push.deliver", awaitable, version=version)
    if timeline is None:
        return await awaitable
    start = timeline._deliveries[version] = time.monotonic()
    try:
        return await awaitable
    finally:
        timeline._deliveries.pop(version, None)
        timeline.span(DRIVER, f"push v{version}", "push", start, time.monotonic())


def installed(timeline: Timeline | None, rank: int, version: int) -> None:
    """Rank ``rank`` installed ``version``: its span since the delivery began."""
    if timeline is None:
        return
    start = timeline._deliveries.get(version)
    now = time.monotonic()
    timeline.span(rank, f"install v{version}", "push", now if start is None else start, now)


def new_timeline(timeline: bool | int | Timeline, name: str = "asyncexec") -> Timeline | None:
    """The timeline an executor (``name``) keeps: ``True`` for the default capacity, an int for
    that capacity, ``False`` (or 0) for none, a :class:`Timeline` to record into with others
    (a process of its own, :meth:`Timeline.joined`).

    Raises:
        ConfigurationError: not a bool or a non-negative int.
    """
    from .._errors import ConfigurationError

    if timeline is False or timeline is None:
        return None
    if isinstance(timeline, Timeline):
        return timeline.joined(name)
    if timeline is True:
        return Timeline(name=name)
    if not isinstance(timeline, int) or timeline < 0:
        raise ConfigurationError(
            f"timeline must be a bool, a number of events or a Timeline, got {timeline!r}"
        )
    return Timeline(timeline, name) if timeline else None
