"""Prometheus metrics of the driver, through ``prometheus_client`` (the ``metrics`` extra).

Every figure is known in the driver (runs, restarts and their causes, steps and reports
delivered, the consumer's backlog, start-up phases, restart times), so the driver exports them
itself: nothing runs on the workers, no Ray metrics agent or dashboard is needed (Ray's
``ray.util.metrics`` goes through that agent, which a local Ray started without its dashboard
does not run), and a scrape reads the process's own registry. Labels are low-cardinality only:
the executor's name and, for restarts, the failure's class.

Off by default: :func:`enable_metrics` turns them on (for every executor of the process), and
:func:`start_metrics_server` serves them over HTTP. The hot path pays one counter increment per
batch of steps handed to the iterator, not per step; the backlog is computed when scraped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["Metrics", "enable_metrics", "metrics", "start_metrics_server"]

_metrics: Metrics | None = None


class Metrics:
    """The collectors, in one registry (``prometheus_client.REGISTRY`` by default)."""

    def __init__(self, registry: Any = None) -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise ImportError(
                "asyncexec's metrics need prometheus_client: pip install 'asyncexec[metrics]'"
            ) from exc
        if registry is None:
            registry = prom.REGISTRY
        self.registry = registry
        ex = ["executor"]
        self.runs = prom.Counter(
            "asyncexec_runs",
            "Runs by how they ended (started counts every run).",
            [*ex, "outcome"],
            registry=registry,
        )
        self.restarts = prom.Counter(
            "asyncexec_restarts",
            "Restarts (of the group, or of one independent rank) by the failure's class.",
            [*ex, "cause"],
            registry=registry,
        )
        self.steps = prom.Counter(
            "asyncexec_steps", "Steps handed to runs' iterators.", ex, registry=registry
        )
        self.reports = prom.Counter(
            "asyncexec_reports",
            "Reports handed to runs' iterators (a step of N ranks is N reports).",
            ex,
            registry=registry,
        )
        self.startup = prom.Histogram(
            "asyncexec_startup_seconds",
            "Start-up of a worker group, to the end of each phase.",
            [*ex, "phase"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
            registry=registry,
        )
        self.restart_time = prom.Histogram(
            "asyncexec_restart_seconds",
            "From a failure to the first step after the restart.",
            ex,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
            registry=registry,
        )
        self.backlog = prom.Gauge(
            "asyncexec_backlog_reports",
            "Reports received from the workers that the consumer has not taken.",
            ex,
            registry=registry,
        )
        self._backlogs: dict[str, Callable[[], int]] = {}
        self._backlog_children: set[str] = set()

    def watch_backlog(self, executor: str, read: Callable[[], int]) -> None:
        """Report ``read()`` as ``executor``'s backlog at each scrape."""
        self._backlogs[executor] = read
        if executor not in self._backlog_children:
            self._backlog_children.add(executor)
            self.backlog.labels(executor).set_function(lambda: self._backlog_of(executor))

    def _backlog_of(self, executor: str) -> float:
        read = self._backlogs.get(executor)
        try:
            return float(read()) if read is not None else 0.0
        except Exception:
            return 0.0


def enable_metrics(registry: Any = None) -> Metrics:
    """Turn asyncexec's Prometheus metrics on for this process (idempotent: the first call's
    registry is kept) and return them.

    Raises:
        ImportError: prometheus_client is not installed (the ``metrics`` extra).
    """
    global _metrics
    if _metrics is None:
        _metrics = Metrics(registry)
    return _metrics


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> Any:
    """Turn the metrics on and serve them at ``http://addr:port/metrics`` (a thread of
    prometheus_client's); returns what ``prometheus_client.start_http_server`` returns."""
    import prometheus_client as prom

    enabled = enable_metrics()
    return prom.start_http_server(port, addr=addr, registry=enabled.registry)


def metrics() -> Metrics | None:
    """The process's metrics, or None when they are off."""
    return _metrics


class RunMeter:
    """One run's part: restart times and the backlog. Cheap when metrics are off (None)."""

    def __init__(self, executor: str, backlog: Callable[[], int] | None = None) -> None:
        self.executor = executor
        self.failed_at: float | None = None
        m = _metrics
        if m is not None and backlog is not None:
            m.watch_backlog(executor, backlog)

    def failed(self, exc: BaseException | None) -> None:
        m = _metrics
        if m is not None:
            m.restarts.labels(self.executor, type(exc).__name__ if exc else "unknown").inc()
            self.failed_at = time.perf_counter()

    def stepped(self, steps: int, reports: int) -> None:
        m = _metrics
        if m is None:
            return
        m.steps.labels(self.executor).inc(steps)
        m.reports.labels(self.executor).inc(reports)
        if self.failed_at is not None:
            m.restart_time.labels(self.executor).observe(time.perf_counter() - self.failed_at)
            self.failed_at = None
