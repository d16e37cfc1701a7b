"""Prometheus metrics of the driver, through ``prometheus_client`` (the ``metrics`` extra).

Every figure is known in the driver (runs, restarts and their causes, steps and reports
delivered, the consumer's backlog, start-up phases, restart times), so the driver exports them
itself: nothing runs on the workers, no Ray metrics agent or dashboard is needed (Ray's
``ray.util.metrics`` goes through that agent, which a local Ray started without its dashboard
does not run), and a scrape reads the process's own registry. Labels are low-cardinality only:
the executor's name, for restarts the failure's class, and for a router and its pipeline the
router's name.

Off by default: :func:`enable_metrics` turns them on (for every executor of the process), and
:func:`start_metrics_server` serves them over HTTP. The hot path pays one counter increment per
batch of steps handed to the iterator, not per step.

Bounded labels: whatever names the application gives its executors, the first
``max_executors`` distinct names get a label value each and every later one is counted under
:data:`OVERFLOW` (one warning, ``metrics_labels_capped``, says so); failure classes are capped
the same way at :data:`MAX_CAUSES`, and routers' names at ``max_executors``. A name keeps its
label once it has one (its counters are cumulative), but the backlog gauge has a series only
while a run of the name is active.

The backlog is computed when scraped: the reports the driver holds for the consumer, plus those
still waiting in the workers' buffers for a poll (under backpressure most of them wait there:
the driver polls a rank only once three quarters of its window is free). A scrape asks each
live worker of each active run for its count, on the run's event loop, at most once per
``backlog_refresh_s`` a run, every run at once, and waits for at most ``SCRAPE_WAIT_S`` in all
(however many executor names and event loops it reads); a scrape in between, or one made on
that loop itself (an in-process ASGI metrics route, which cannot wait for it), uses the last
counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from .._logging import get_logger
from ._taskgroups import task_group

__all__ = [
    "OVERFLOW",
    "BoundedLabels",
    "Metrics",
    "RunMeter",
    "PipelineMeters",
    "disable_metrics",
    "enable_metrics",
    "metrics",
    "pipeline_meters",
    "pipeline_collectors",
    "start_metrics_server",
]

_metrics: Metrics | None = None
#: The longest a scrape waits for the workers' counts of the reports they hold.
SCRAPE_WAIT_S = 1.0
#: How many executor names get a label value of their own, unless ``enable_metrics`` says.
MAX_EXECUTORS = 100
#: How many failure classes get a ``cause`` label value of their own.
MAX_CAUSES = 32
#: How often a scrape may ask a run's workers for their counts, unless ``enable_metrics`` says.
BACKLOG_REFRESH_S = 5.0
#: The label value that stands for every name past a cap.
OVERFLOW = "_overflow"

_log = get_logger()


class BoundedLabels:
    """The values one label may take: the first ``limit`` distinct values as they are, every
    later one as :data:`OVERFLOW`, with one warning the first time; ``on_new(value)`` is
    called once for each value let through. Thread-safe."""

    def __init__(self, label: str, limit: int, on_new: Callable[[str], None] | None = None) -> None:
        self.label = label
        self.limit = limit
        self._on_new = on_new
        self._known: set[str] = set()
        self._warned = False
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        with self._lock:
            if value in self._known:
                return value
            new = len(self._known) < self.limit
            if new:
                self._known.add(value)
            else:
                warn, self._warned = not self._warned, True
        if new:
            if self._on_new is not None:  # outside the lock: it makes series
                self._on_new(value)
            return value
        if warn:
            _log.warning(
                "metrics_labels_capped",
                label=self.label,
                limit=self.limit,
                value=value,
                overflow=OVERFLOW,
            )
        return OVERFLOW


class _Bounded:
    """A ``prometheus_client`` collector whose leading label values pass through bounds (the
    executor's name, and for restarts the failure's class); the rest as given."""

    def __init__(self, collector: Any, *bounds: BoundedLabels) -> None:
        self.collector = collector
        self._bounds = bounds

    def labels(self, *values: str) -> Any:
        bounded = [bound(value) for bound, value in zip(self._bounds, values, strict=False)]
        return self.collector.labels(*bounded, *values[len(bounded) :])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.collector, name)


class Metrics:
    """The collectors, in one registry (``prometheus_client.REGISTRY`` by default), with their
    label values bounded (see the module's docstring)."""

    def __init__(
        self,
        registry: Any = None,
        *,
        max_executors: int = MAX_EXECUTORS,
        backlog_refresh_s: float = BACKLOG_REFRESH_S,
    ) -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise ImportError(
                "asyncexec's metrics need prometheus_client: pip install 'asyncexec[metrics]'"
            ) from exc
        if isinstance(max_executors, bool) or not isinstance(max_executors, int):
            raise TypeError(f"max_executors must be an int, got {max_executors!r}")
        if max_executors < 1:
            raise ValueError(f"max_executors must be at least 1, got {max_executors}")
        if not backlog_refresh_s >= 0:  # also refuses NaN
            raise ValueError(f"backlog_refresh_s must be 0 or more, got {backlog_refresh_s!r}")
        if registry is None:
            registry = prom.REGISTRY
        self.registry = registry
        self.backlog_refresh_s = float(backlog_refresh_s)
        #: The executor label's values (the ``max_executors`` first names, then OVERFLOW).
        self.executors = BoundedLabels("executor", max_executors, on_new=self._zero_series)
        self.causes = BoundedLabels("cause", MAX_CAUSES)
        #: The router label's values (of routers and their pipelines), bounded as names are.
        self.routers = BoundedLabels("router", max_executors)
        self._collectors(prom, registry)
        self._straggler_collectors(prom, registry)
        self._dispatch_collectors(prom, registry)
        #: The active runs of each executor label value; an entry goes with its last run.
        self._watched: dict[str, set[RunMeter]] = {}
        self._lock = threading.Lock()  # runs come and go on their loops while a scrape reads

    def _collectors(self, prom: Any, registry: Any) -> None:
        """Make the collectors, each of its labels bounded."""
        by_name = self.executors
        ex = ["executor"]
        self.runs = _Bounded(
            prom.Counter(
                "asyncexec_runs",
                "Runs by how they ended (started counts every run).",
                [*ex, "outcome"],
                registry=registry,
            ),
            by_name,
        )
        self.restarts = _Bounded(
            prom.Counter(
                "asyncexec_restarts",
                "Restarts (of the group, or of one independent rank) by the failure's class.",
                [*ex, "cause"],
                registry=registry,
            ),
            by_name,
            self.causes,
        )
        self.steps = _Bounded(
            prom.Counter(
                "asyncexec_steps", "Steps handed to runs' iterators.", ex, registry=registry
            ),
            by_name,
        )
        self.reports = _Bounded(
            prom.Counter(
                "asyncexec_reports",
                "Reports handed to runs' iterators (a step of N ranks is N reports).",
                ex,
                registry=registry,
            ),
            by_name,
        )
        self.startup = _Bounded(
            prom.Histogram(
                "asyncexec_startup_seconds",
                "Start-up of a worker group, to the end of each phase.",
                [*ex, "phase"],
                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
                registry=registry,
            ),
            by_name,
        )
        self.restart_time = _Bounded(
            prom.Histogram(
                "asyncexec_restart_seconds",
                "From a failure to the first step after the restart.",
                ex,
                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
                registry=registry,
            ),
            by_name,
        )
        self.preemptions = _Bounded(
            prom.Counter(
                "asyncexec_preemptions",
                "Preemptions: notices that nodes of a group are drained (stage noticed), and "
                "restarts after their workers were lost (stage restarted).",
                [*ex, "stage"],
                registry=registry,
            ),
            by_name,
        )
        # Its series are made and removed here, by label value (already bounded). Registered
        # through _Backlog, which asks the workers for their counts once a scrape.
        self.backlog = prom.Gauge(
            "asyncexec_backlog_reports",
            "Reports made by the workers that the consumer has not taken: held by the driver, "
            "or waiting in a worker's buffer for a poll.",
            ex,
            registry=None,
        )
        registry.register(_Backlog(self.backlog, self._ask_workers))

    def _dispatch_collectors(self, prom: Any, registry: Any) -> None:
        """What ``call()``, ``stream()`` and ``execute()`` sent: by executor only (the calls
        in flight per rank are in ``Executor.statistics()``: a rank label would grow with the
        group)."""
        made = {}
        for name, doc in (
            (
                "calls",
                "Calls sent to ranks by call(), stream() and execute() (a call to N ranks "
                "counts N; a call sent again counts again).",
            ),
            (
                "call_resends",
                "Idempotent calls (least_loaded(retry=True)) sent again after their rank died.",
            ),
            ("ranks_renewed", "Dead ranks given a fresh process in their place outside a run."),
        ):
            counter = prom.Counter(f"asyncexec_{name}", doc, ["executor"], registry=registry)
            made[name] = _Bounded(counter, self.executors)
        self.calls, self.call_resends, self.ranks_renewed = made.values()

    def _straggler_collectors(self, prom: Any, registry: Any) -> None:
        """The step skew and the stragglers found: by executor only (no rank label, which
        would grow with the group)."""
        self.skew = _Bounded(
            prom.Histogram(
                "asyncexec_step_skew_seconds",
                "Seconds between the first and the last rank's report of a step, sampled: the "
                "last step of each batch handed to a run's iterator.",
                ["executor"],
                buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
                registry=registry,
            ),
            self.executors,
        )
        self.stragglers = _Bounded(
            prom.Counter(
                "asyncexec_stragglers",
                "Ranks found slower than the others (each straggler event).",
                ["executor"],
                registry=registry,
            ),
            self.executors,
        )

    def _zero_series(self, executor: str) -> None:
        """Make ``executor``'s series at 0 when the name first gets a label value, so that
        Prometheus' ``rate()`` and ``increase()`` see their first increment (a series that
        appears at 1 has nothing before it to differ from) and a dashboard's panel shows 0,
        not "no data", for what has not happened yet."""
        per_executor = (self.steps, self.reports, self.stragglers, self.restart_time, self.skew)
        for collector in (*per_executor, self.calls, self.call_resends, self.ranks_renewed):
            collector.collector.labels(executor)
        for outcome in ("started", "finished", "failed", "cancelled"):
            self.runs.collector.labels(executor, outcome)
        for stage in ("noticed", "moved", "restarted"):
            self.preemptions.collector.labels(executor, stage)

    def watch(self, meter: RunMeter) -> None:
        """Count ``meter``'s run in its executor's backlog until :meth:`unwatch`."""
        label = self.executors(meter.executor)
        with self._lock:
            meter.label = label
            if label not in self._watched:
                self._watched[label] = set()
                self.backlog.labels(label).set_function(lambda: self._backlog_of(label))
            self._watched[label].add(meter)

    def unwatch(self, meter: RunMeter) -> None:
        """Stop counting ``meter``'s run; the label's backlog series goes with its last run."""
        with self._lock:
            label, meter.label = meter.label, None
            meters = self._watched.get(label) if label is not None else None
            if label is None or meters is None:
                return
            meters.discard(meter)
            if not meters:
                del self._watched[label]
                with contextlib.suppress(KeyError):
                    self.backlog.remove(label)

    def _backlog_of(self, label: str) -> float:
        """The backlog of ``label``'s active runs (called by a scrape, in its thread, after
        :meth:`_ask_workers`)."""
        with self._lock:
            meters = list(self._watched.get(label, ()))
        return float(sum(meter.held() + meter.buffered for meter in meters))

    def _ask_workers(self) -> None:
        """Ask the workers of every active run whose last ask is ``backlog_refresh_s`` old for
        their counts, all at once, and wait for them (``SCRAPE_WAIT_S`` at most, in all):
        called once a scrape, before the backlog's series are read. The asks are marked here,
        so that concurrent scrapes make one."""
        now, here = time.monotonic(), _running_loop()
        with self._lock:
            by_loop: dict[asyncio.AbstractEventLoop, list[RunMeter]] = {}
            for meter in [m for meters in self._watched.values() for m in meters]:
                loop = meter.loop
                if loop is None or loop.is_closed() or loop is here:
                    continue  # a scrape on that loop cannot wait for it: the last counts
                if meter.asked is not None and now - meter.asked < self.backlog_refresh_s:
                    continue  # asked recently: the last counts
                meter.asked = now
                by_loop.setdefault(loop, []).append(meter)
        # A coroutine handed to each run's loop from the scrape's thread (no task group
        # reaches across threads); each ends within SCRAPE_WAIT_S on its own.
        futures = [
            asyncio.run_coroutine_threadsafe(_refresh(p), loop) for loop, p in by_loop.items()
        ]
        deadline = now + SCRAPE_WAIT_S + 0.5
        for future in futures:
            try:
                future.result(max(0.0, deadline - time.monotonic()))
            except Exception:
                future.cancel()


class _Backlog:
    """The backlog gauge as the registry collects it: the workers asked for their counts once
    a scrape (``ask``), not once an executor name, then the gauge's series read."""

    def __init__(self, gauge: Any, ask: Callable[[], None]) -> None:
        self.gauge = gauge
        self._labelnames = gauge._labelnames  # (read by the dashboard's generator)
        self._ask = ask

    def describe(self) -> Any:
        return self.gauge.describe()

    def collect(self) -> Any:
        self._ask()
        return self.gauge.collect()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _refresh(meters: list[RunMeter]) -> None:
    async with task_group() as tg:
        for meter in meters:
            tg.start_soon(meter.refresh)


def enable_metrics(
    registry: Any = None,
    *,
    max_executors: int = MAX_EXECUTORS,
    backlog_refresh_s: float = BACKLOG_REFRESH_S,
) -> Metrics:
    """Turn asyncexec's Prometheus metrics on for this process and return them. Idempotent:
    the first call's registry and settings are kept.

    Args:
        registry: the ``prometheus_client`` registry to add the collectors to (its default
            ``REGISTRY`` when None).
        max_executors: how many distinct executor names get a label value of their own; the
            names that come later are counted under ``"_overflow"``, and a warning
            (``metrics_labels_capped``) is logged once. Name executors by role, not by run.
        backlog_refresh_s: a scrape asks a run's workers how many reports they hold at most
            once per this many seconds (0: at every scrape); a scrape in between uses the
            last counts.

    Raises:
        ImportError: prometheus_client is not installed (the ``metrics`` extra).
        ValueError: ``max_executors`` is below 1, or ``backlog_refresh_s`` below 0.
    """
    global _metrics
    if _metrics is None:
        _metrics = Metrics(
            registry, max_executors=max_executors, backlog_refresh_s=backlog_refresh_s
        )
    return _metrics


def start_metrics_server(port: int, addr: str = "127.0.0.1") -> Any:
    """Turn the metrics on and serve them at ``http://addr:port/metrics`` (a thread of
    prometheus_client's); returns what ``prometheus_client.start_http_server`` returns.

    The endpoint has no authentication, so it listens on the loopback interface unless
    ``addr`` says otherwise: ``addr="0.0.0.0"`` (or one interface's address) serves other
    hosts, such as a Prometheus server elsewhere; firewall it.
    """
    import prometheus_client as prom

    enabled = enable_metrics()
    return prom.start_http_server(port, addr=addr, registry=enabled.registry)


def metrics() -> Metrics | None:
    """The process's metrics, or None when they are off."""
    return _metrics


def disable_metrics() -> None:
    """Turn the process's metrics off again (``asyncexec.testing.metrics_enabled`` on its way
    out); their collectors stay in the registry they were added to."""
    global _metrics
    _metrics = None


class RunMeter:
    """One run's part: its backlog, counted when a scrape asks. (What the run's events count,
    restarts, steps and reports, restart times, is the executor's metrics sink's:
    ``_sinks.ExecutorMetrics``.)"""

    def __init__(
        self, executor: str, held: Callable[[], int], buffered: Callable[[], Awaitable[int]]
    ) -> None:
        """``held()`` is what the driver holds for the run's consumer, ``buffered()`` asks the
        run's workers for what waits in them."""
        self.executor = executor
        #: The reports waiting in the run's workers, as counted at the latest ask.
        self.buffered = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        #: The executor label value while watched (set by :meth:`Metrics.watch`).
        self.label: str | None = None
        #: When a scrape last asked the workers for their counts (``time.monotonic()``).
        self.asked: float | None = None
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


#: The pipeline's collectors, made once per registry (on first use).
_pipeline_made: weakref.WeakKeyDictionary[Metrics, dict[str, Any]] = weakref.WeakKeyDictionary()


def pipeline_collectors(m: Metrics) -> dict[str, Any]:
    """The RL pipeline's collectors in ``m``'s registry: by the servers' executor and the
    pipeline's router (both bounded: two pipelines over one executor have a series each), the
    kind of sample event and the update mode (fixed sets); never a sample's id or a prompt."""
    found = _pipeline_made.get(m)
    if found is not None:
        return found
    import prometheus_client as prom

    ex, registry = ["executor", "router"], m.registry
    found = {
        "samples": prom.Counter(
            "asyncexec_pipeline_samples",
            "Samples of a pipeline by event: admitted, consumed, aborted, requeued, "
            "duplicates (dropped).",
            [*ex, "event"],
            registry=registry,
        ),
        "staleness": prom.Histogram(
            "asyncexec_pipeline_staleness",
            "Staleness of each consumed sample: the learner's version less the version of "
            "its oldest chunk.",
            ex,
            buckets=(0, 1, 2, 3, 4, 6, 8, 16),
            registry=registry,
        ),
        "wait": prom.Histogram(
            "asyncexec_pipeline_trainer_wait_seconds",
            "How long the learner waited for each batch.",
            ex,
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=registry,
        ),
        "pause": prom.Histogram(
            "asyncexec_pipeline_pause_seconds",
            "Generation paused for a weight update, by mode (the push itself apart).",
            [*ex, "mode"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=registry,
        ),
        "buffer": prom.Gauge(
            "asyncexec_pipeline_buffer_samples",
            "Finished samples waiting for a batch (at the latest batch).",
            ex,
            registry=registry,
        ),
        "in_flight": prom.Gauge(
            "asyncexec_pipeline_in_flight",
            "Requests of a pipeline in flight on its servers (at the latest batch or update).",
            ex,
            registry=registry,
        ),
    }
    found = {name: _Bounded(collector, m.executors, m.routers) for name, collector in found.items()}
    _pipeline_made[m] = found
    return found


class PipelineMeters:
    """One pipeline's part (nothing when metrics are off), by its servers' executor and its
    router's name: its counters are synced at each batch from the pipeline's own, as deltas,
    and at its close."""

    def __init__(self, executor: str, router: str | None = None) -> None:
        self.executor = executor
        self.router = executor if router is None else router
        self._synced: dict[str, int] = {}

    def batch(
        self,
        staleness: tuple[int, ...],
        waited_s: float,
        depth: int,
        counts: dict[str, int],
        in_flight: int = 0,
    ) -> None:
        m = _metrics
        if m is None:
            return
        made = pipeline_collectors(m)
        for value in staleness:
            made["staleness"].labels(self.executor, self.router).observe(value)
        made["wait"].labels(self.executor, self.router).observe(waited_s)
        made["buffer"].labels(self.executor, self.router).set(depth)
        made["in_flight"].labels(self.executor, self.router).set(in_flight)
        self._sync(made, counts)

    def closed(self, counts: dict[str, int]) -> None:
        """The pipeline closed: its sample events since its last batch are counted, and its
        requests in flight go to 0 (it stopped them)."""
        m = _metrics
        if m is None:
            return
        made = pipeline_collectors(m)
        made["in_flight"].labels(self.executor, self.router).set(0)
        self._sync(made, counts)

    def _sync(self, made: dict[str, Any], counts: dict[str, int]) -> None:
        for event, total in counts.items():
            delta = total - self._synced.get(event, 0)
            if delta > 0:
                made["samples"].labels(self.executor, self.router, event).inc(delta)
            self._synced[event] = total

    def zero(self) -> None:
        """The pipeline's series at 0 (each sample event's, each update mode's, the
        histograms'), so that ``rate()`` sees their first increment and a panel shows 0 for
        what has not happened yet."""
        m = _metrics
        if m is None:
            return
        made = pipeline_collectors(m)
        label = (m.executors(self.executor), m.routers(self.router))
        for event in ("admitted", "consumed", "aborted", "requeued", "duplicates", "expired"):
            made["samples"].collector.labels(*label, event)
        for mode in ("keep", "wait", "abort"):
            made["pause"].collector.labels(*label, mode)
        made["staleness"].collector.labels(*label)
        made["wait"].collector.labels(*label)
        made["in_flight"].collector.labels(*label)

    def paused(self, mode: str, seconds: float, in_flight: int | None = None) -> None:
        """An update paused generation ``seconds`` as ``mode`` says; ``in_flight``: the requests
        in flight after it."""
        m = _metrics
        if m is not None:
            made = pipeline_collectors(m)
            made["pause"].labels(self.executor, self.router, mode).observe(seconds)
            if in_flight is not None:
                made["in_flight"].labels(self.executor, self.router).set(in_flight)


def pipeline_meters(executor: str, router: str | None = None) -> PipelineMeters:
    """The meters of a pipeline whose servers are the executor named ``executor``, through
    the router named ``router`` (None: the executor's name)."""
    return PipelineMeters(executor, router)
