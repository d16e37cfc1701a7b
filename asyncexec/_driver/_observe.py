"""One observer: an instrumented event is emitted once, as a typed record, and fans out to the
sinks that handle its type (the timeline, the spans, the metrics, the log, the statistics),
each of which turns it into its own form.

::

    observer = Observer(StatisticsSink(meter), MetricsSink(name), LogSink(log))
    ...
    observer.emit(BatchHanded(version=v, ...))     # at the call site: one line

A sink is any object with a ``handlers()`` that maps the event types it wants to a function of
one event; the observer routes by the event's exact type, in the order the sinks were added
(so a sink added after the statistics sees them already counted). An event no sink handles
costs a dict look-up and the record it is: the hot paths (admission, a request's answer) stay
as fast as with the separate calls. A sink that raises makes ``emit`` raise: nothing is
logged and dropped. (The log's sinks call the application's logging, whose processors may
raise: a call site that emits between two changes of state that must go together, such as a
run's start or a batch handed, leaves its state whole first.)

An event that covers a stretch of time (a call, a wait, a teardown) is *span-shaped*: one
record, emitted once when the stretch ends, whose last three fields are its ``start``, its
``end`` (``time.monotonic()``) and the ``error`` it ended with (None: none); :meth:`Observer.timed`
awaits an awaitable and emits it. One record rather than a start and an end event: every sink
that turns it into something (a span on the timeline, a histogram, a log line, a counter) needs
only the finished stretch, so no sink pairs events up or holds state across an await, and a
span-shaped event no sink handles costs what an instant does (:meth:`Observer.timed` awaits the
bare awaitable). What the event does not carry is the OpenTelemetry context a stretch runs in
(the run's, an attempt's, a call's, whose context travels to its worker): that is context the
work needs while it runs, not something observed of it, so it is opened where the work begins.

The events and the sinks of one concept live with it (the pipeline's and the router's in
``pipeline/_events.py`` and ``pipeline/_sinks.py``, the executor's in ``_events.py`` and
``_sinks.py``); this module holds only the fan-out.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

__all__ = ["Handler", "Observer", "Sink"]

T = TypeVar("T")

#: What a sink does with one event of a type it handles.
Handler = Callable[[Any], None]


class Sink(Protocol):
    """Turns events into one form (spans on the timeline, metrics, log lines, counters)."""

    def handlers(self) -> Mapping[type, Handler]:
        """The event types this sink handles, each with its handler."""
        ...


class Observer:
    """The sinks of one object (an executor, a pipeline, a router), and :meth:`emit` to them
    all."""

    __slots__ = ("_routes", "sinks")

    def __init__(self, *sinks: Sink) -> None:
        self.sinks: list[Sink] = []
        self._routes: dict[type, tuple[Handler, ...]] = {}
        for sink in sinks:
            self.add(sink)

    def __repr__(self) -> str:
        names = ", ".join(type(s).__name__ for s in self.sinks)
        return f"<Observer [{names}] {len(self._routes)} event types>"

    def add(self, sink: Sink) -> None:
        """Add ``sink``: it gets every event of its types from now on, after the sinks before."""
        self.sinks.append(sink)
        for kind, handler in sink.handlers().items():
            self._routes[kind] = (*self._routes.get(kind, ()), handler)

    def remove(self, sink: Sink) -> None:
        """Remove ``sink`` (added before): it gets no event from now on."""
        sinks = [s for s in self.sinks if s is not sink]
        self.sinks, self._routes = [], {}
        for kept in sinks:
            self.add(kept)

    def handles(self, kind: type) -> bool:
        """Whether a sink handles events of type ``kind`` (a call site that must do work to
        make one asks first)."""
        return kind in self._routes

    async def timed(self, awaitable: Awaitable[T], kind: type, *fields: Any) -> T:
        """Await ``awaitable``; when a sink handles ``kind`` (a span-shaped event: see the
        module's docstring), emit ``kind(*fields, start, end, error)`` when it ends, also when it
        raises (``error``: what it raised). When none does: the bare await."""
        if kind not in self._routes:
            return await awaitable
        start = time.monotonic()
        error: BaseException | None = None
        try:
            return await awaitable
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.emit(kind(*fields, start, time.monotonic(), error))

    def emit(self, event: object) -> None:
        """Hand ``event`` to every sink that handles its type (none: nothing happens)."""
        for handler in self._routes.get(type(event), ()):
            handler(event)
