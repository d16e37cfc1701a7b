"""A weight channel's metrics, when :func:`asyncexec.enable_metrics` turned metrics on: by the
target executor's name (bounded as every executor label is) and, for the version lag, the
target rank (bounded by the group's size).

The collectors are made once per :class:`~asyncexec._driver._metrics.Metrics` (its registry),
on first use, and by the dashboard's generator (:func:`channel_collectors`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from typing import Any

from .._metrics import Metrics, metrics

__all__ = ["ChannelMeters", "channel_collectors"]

_made: weakref.WeakKeyDictionary[Metrics, dict[str, Any]] = weakref.WeakKeyDictionary()


def channel_collectors(meters: Metrics) -> dict[str, Any]:
    """The channel's collectors in ``meters``' registry."""
    found = _made.get(meters)
    if found is None:
        import prometheus_client as prom

        ex, registry = ["executor"], meters.registry
        found = {
            "push": prom.Histogram(
                "asyncexec_channel_push_seconds",
                "A weight push, from the read of the source to the version installed on every "
                "target rank.",
                ex,
                buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
                registry=registry,
            ),
            "failed": prom.Counter(
                "asyncexec_channel_failed_pushes",
                "Weight pushes that failed (the read or a delivery).",
                ex,
                registry=registry,
            ),
            "lag": prom.Gauge(
                "asyncexec_channel_version_lag",
                "Versions a target rank is behind the channel's latest push.",
                [*ex, "rank"],
                registry=registry,
            ),
        }
        _made[meters] = found
    return found


class ChannelMeters:
    """One channel's view of the metrics (nothing when metrics are off), by its target
    executor's name."""

    def __init__(self, executor: str) -> None:
        self.executor = executor

    def _on(self) -> tuple[dict[str, Any], str] | None:
        meters = metrics()
        if meters is None:
            return None
        return channel_collectors(meters), meters.executors(self.executor)

    def zero(self) -> None:
        """The channel's series at 0 (so that ``rate()`` sees the first push)."""
        on = self._on()
        if on is not None:
            collectors, label = on
            collectors["push"].labels(label)
            collectors["failed"].labels(label)

    def pushed(self, seconds: float) -> None:
        on = self._on()
        if on is not None:
            collectors, label = on
            collectors["push"].labels(label).observe(seconds)

    def failed(self) -> None:
        on = self._on()
        if on is not None:
            collectors, label = on
            collectors["failed"].labels(label).inc()

    def lag(self, rank: int, versions: int) -> None:
        on = self._on()
        if on is not None:
            collectors, label = on
            collectors["lag"].labels(label, str(rank)).set(versions)

    def forget(self, ranks: Iterable[int]) -> None:
        """The version lag series of ``ranks`` go: the channel closed, or they left the
        target's group (a lag no longer updated would be shown for ever)."""
        on = self._on()
        if on is not None:
            collectors, label = on
            for rank in ranks:
                with contextlib.suppress(KeyError):
                    collectors["lag"].remove(label, str(rank))
