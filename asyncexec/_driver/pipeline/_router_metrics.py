"""The router's metrics, when :func:`asyncexec.enable_metrics` turned metrics on: counters by
the servers' executor name and the router's name (both bounded as every executor label is: two
routers over one executor have series of their own), and the requests in flight per server by
executor, router and rank (a rank label is bounded by the group's size; session keys and
request ids are never labels).

The collectors are made once per :class:`~asyncexec._driver._metrics.Metrics` (its registry),
on first use.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

from .._metrics import Metrics, metrics

__all__ = ["RouterMeters", "router_collectors"]

#: Counter name (as ``RouterStatistics`` names it) -> the metric's help.
_COUNTERS = {
    "requests": "Requests given to a router's generate().",
    "answered": "Requests a router answered with a sample.",
    "retries": "Requests a router sent again to another server (server gone or taken out, "
    "or the attempt's deadline passed).",
    "duplicates_dropped": "Second answers of an answered request, dropped by a router.",
    "late_dropped": "Answers that came after their request gave up, dropped by a router.",
    "timeouts": "Requests that gave up on their deadline.",
    "taken_out": "Servers taken out by a router's health watch.",
    "replaced": "Servers that rejoined a router in a fresh process at the current weights.",
}

_made: weakref.WeakKeyDictionary[Metrics, dict[str, Any]] = weakref.WeakKeyDictionary()


def router_collectors(meters: Metrics) -> dict[str, Any]:
    """The router's collectors in ``meters``' registry."""
    found = _made.get(meters)
    if found is None:
        import prometheus_client as prom

        by = ["executor", "router"]
        found = {
            name: prom.Counter(f"asyncexec_router_{name}", doc, by, registry=meters.registry)
            for name, doc in _COUNTERS.items()
        }
        found["in_flight"] = prom.Gauge(
            "asyncexec_router_in_flight",
            "Requests of a router in flight on each server.",
            [*by, "rank"],
            registry=meters.registry,
        )
        _made[meters] = found
    return found


class RouterMeters:
    """One router's view of the metrics (nothing when metrics are off), by its servers'
    executor name and its own name (``router``; None: the executor's name)."""

    def __init__(self, executor: str, router: str | None = None) -> None:
        self.executor = executor
        self.router = executor if router is None else router
        self._forgotten = False  # the router closed: its in-flight series are gone

    def _on(self) -> tuple[dict[str, Any], tuple[str, str]] | None:
        meters = metrics()
        if meters is None:
            return None
        label = (meters.executors(self.executor), meters.routers(self.router))
        return router_collectors(meters), label

    def zero(self) -> None:
        """The router's counters at 0 (a retry, a timeout, a server taken out that has not
        happened yet shows as 0, and ``rate()`` sees the first one)."""
        on = self._on()
        if on is not None:
            collectors, label = on
            for name in _COUNTERS:
                collectors[name].labels(*label)

    def count(self, name: str) -> None:
        on = self._on()
        if on is not None:
            collectors, label = on
            collectors[name].labels(*label).inc()

    def in_flight(self, rank: int, value: int) -> None:
        """Set server ``rank``'s requests in flight; nothing once the router closed (a slot
        freed after its close, by an attempt that outlived the close's bound, would bring a
        series back for good, or set that of a router of the same name made since)."""
        on = None if self._forgotten else self._on()
        if on is not None:
            collectors, label = on
            collectors["in_flight"].labels(*label, str(rank)).set(value)

    def forget(self, servers: int) -> None:
        """The router closed: its in-flight series go, for good."""
        self._forgotten = True
        on = self._on()
        if on is not None:
            collectors, label = on
            for rank in range(servers):
                with contextlib.suppress(KeyError):
                    collectors["in_flight"].remove(*label, str(rank))
