"""Prometheus metrics of the driver, through ``prometheus_client`` (the ``metrics`` extra).

Every figure is known in the driver (runs, restarts and their causes, steps and reports
delivered, the consumer's backlog, start-up phases, restart times), so the driver exports them
itself: nothing runs on the workers, no Ray metrics agent or dashboard is needed (Ray's
``ray.util.metrics`` goes through that agent, which a local Ray started without its dashboard
does not run), and a scrape reads the process's own registry. Labels are low-cardinality only:
the executor's name and, for restarts, the failure's class.

Off by default: :func:`enable_metrics` turns them on (for every executor of the process), and
:func:`start_metrics_server` serves them over HTTP. The hot path pays one counter increment per
batch of steps handed to the iterator, not per step.

The backlog is computed when scraped: the reports the driver holds for the consumer, plus those
still waiting in the workers' buffers for a poll (under backpressure most of them wait there:
the driver polls a rank only once three quarters of its window is free). A scrape asks each
live worker of each active run for its count, on the run's event loop, and waits for at most
``SCRAPE_WAIT_S``; a scrape made on that loop itself (an in-process ASGI metrics route) cannot
wait for it and uses the counts of the last scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

__all__ = ["Metrics", "RunMeter", "enable_metrics", "metrics", "start_metrics_server"]

_metrics: Metrics | None = None
#: The longest a scrape waits for the workers' counts of the reports they hold.
SCRAPE_WAIT_S = 1.0


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
            "Reports made by the workers that the consumer has not taken: held by the driver, "
            "or waiting in a worker's buffer for a poll.",
            ex,
            registry=registry,
        )
        self._watched: dict[str, set[RunMeter]] = {}
        self._lock = threading.Lock()  # runs come and go on their loops while a scrape reads

    def watch(self, meter: RunMeter) -> None:
        """Count ``meter``'s run in its executor's backlog until :meth:`unwatch`."""
        name = meter.executor
        with self._lock:
            if name not in self._watched:
                self._watched[name] = set()
                self.backlog.labels(name).set_function(lambda: self._backlog_of(name))
            self._watched[name].add(meter)

    def unwatch(self, meter: RunMeter) -> None:
        with self._lock:
            self._watched.get(meter.executor, set()).discard(meter)

    def _backlog_of(self, executor: str) -> float:
        """The backlog of ``executor``'s active runs (called by a scrape, in its thread)."""
        with self._lock:
            meters = list(self._watched.get(executor, ()))
        by_loop: dict[asyncio.AbstractEventLoop, list[RunMeter]] = {}
        for meter in meters:
            if meter.loop is not None:
                by_loop.setdefault(meter.loop, []).append(meter)
        for loop, part in by_loop.items():
            if loop.is_closed() or _running_loop() is loop:
                continue  # this scrape runs on that loop: it cannot wait for it
            # A coroutine handed to the run's loop from the scrape's thread (no task group
            # reaches across threads); it ends within SCRAPE_WAIT_S on its own.
            future = asyncio.run_coroutine_threadsafe(_refresh(part), loop)
            try:
                future.result(SCRAPE_WAIT_S + 0.5)
            except Exception:
                future.cancel()
        return float(sum(meter.held() + meter.buffered for meter in meters))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _refresh(meters: list[RunMeter]) -> None:
    async with anyio.create_task_group() as tg:
        for meter in meters:
            tg.start_soon(meter.refresh)


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
    """One run's part: restarts, steps and reports, restart times and the backlog. Cheap when
    metrics are off (one check per call)."""

    def __init__(
        self, executor: str, held: Callable[[], int], buffered: Callable[[], Awaitable[int]]
    ) -> None:
        """``held()`` is what the driver holds for the run's consumer, ``buffered()`` asks the
        run's workers for what waits in them."""
        self.executor = executor
        self.failed_at: float | None = None
        #: The reports waiting in the run's workers, as counted at the latest scrape.
        self.buffered = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._held = held
        self._count_buffered = buffered

    def watch(self) -> None:
        """Count this run in the backlog while it is active (called on its event loop)."""
        m = _metrics
        if m is not None:
            self.loop = asyncio.get_running_loop()
            m.watch(self)

    def unwatch(self) -> None:
        m = _metrics
        if m is not None:
            m.unwatch(self)

    def held(self) -> int:
        try:
            return self._held()
        except Exception:  # read from the scrape's thread while the loop changes it
            return 0

    async def refresh(self) -> None:
        with anyio.move_on_after(SCRAPE_WAIT_S), contextlib.suppress(Exception):
            self.buffered = await self._count_buffered()

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
