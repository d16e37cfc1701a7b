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
logged and dropped.

The events and the sinks of one concept live with it (the pipeline's and the router's in
``pipeline/_events.py`` and ``pipeline/_sinks.py``); this module holds only the fan-out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

__all__ = ["Handler", "Observer", "Sink"]

#: What a sink does with one event of a type it handles.
Handler = Callable[[Any], None]


class Sink(Protocol):
    """Turns events into one form (spans on the timeline, metrics, log lines, counters)."""

    def handlers(self) -> Mapping[type, Handler]:
        """The event types this sink handles, each with its handler."""
        ...


class Observer:
    """The sinks of one object (a pipeline, a router), and :meth:`emit` to them all."""

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

    def emit(self, event: object) -> None:
        """Hand ``event`` to every sink that handles its type (none: nothing happens)."""
        for handler in self._routes.get(type(event), ()):
            handler(event)
