"""Shared measuring tools of the benchmarks: statistics, the event-loop heartbeat, process memory,
CPU time, garbage collections, the recorder of asyncexec's log events, and what is left in the
cluster (for the chaos runner and the soak).
The harness, the rows and the table are in ``_harness.py``.

Nothing here starts Ray.
"""

from __future__ import annotations

import asyncio
import gc
import math
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator, MutableMapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import psutil

__all__ = [
    "Events",
    "LoopBeat",
    "Timer",
    "cpu_seconds",
    "Collection",
    "Heartbeat",
    "Rows",
    "gc_log",
    "heartbeat",
    "lag_ms",
    "live_placement_groups",
    "live_workers",
    "median",
    "percentile",
    "process_memory",
    "progress",
    "rate",
]

MiB = 1024 * 1024


class Rows(Protocol):
    """Where a measurement files what it measured (``run.py``'s ``Bench``): a sample in a
    figure's column, or a note on where the time goes."""

    def add(self, figure: str, column: str, value: float) -> None: ...

    def note(self, key: str, value: float) -> None: ...


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values."""
    return statistics.median(values) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by the nearest-rank method, or NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def rate(steps: int, workers: int, start: float, last: float) -> float:
    """Reports per second in total: every worker's reports over the time from the run's start to
    its last step."""
    if last <= start:
        return math.nan
    return steps * workers / (last - start)


def progress(message: str) -> None:
    """A progress line on stderr, with the seconds since the benchmark started."""
    print(f"[{time.perf_counter() - _T0:7.1f} s] {message}", file=sys.stderr, flush=True)


_T0 = time.perf_counter()


def process_memory(pid: int) -> tuple[float, float]:
    """(RSS, USS) of process ``pid`` in MiB. USS counts only the pages this process alone holds,
    so shared libraries (mapped by every Ray worker) do not blur the comparison."""
    info = psutil.Process(pid).memory_full_info()
    return info.rss / MiB, info.uss / MiB


def cpu_seconds(pids: Sequence[int]) -> float:
    """User plus system CPU time of the processes ``pids`` (those that are gone count 0)."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


class LoopBeat:
    """Measures the longest event-loop stall while :meth:`run` runs, leaving out the stalls a
    scenario declares with :meth:`excused` (adding a node to the cluster must block the loop:
    Ray's ``Node`` installs signal handlers, which only the main thread may do)."""

    def __init__(self) -> None:
        self.max_gap = 0.0
        self.excused_s = 0.0
        self._skip = False

    @contextmanager
    def excused(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.excused_s += time.perf_counter() - t0
            self._skip = True

    async def run(self) -> None:
        last = anyio.current_time()
        while True:
            await anyio.sleep(0.01)
            now = anyio.current_time()
            if self._skip:
                self._skip = False
            else:
                self.max_gap = max(self.max_gap, now - last - 0.01)
            last = now


class Heartbeat:
    """A task that sleeps ``interval_s`` at a time and records each wake-up: when it was due and
    when it woke (``dues``, ``woke``) and its lag (``lags``: how much later than due, the time the
    event loop was busy, or frozen by a blocking call, when the timer was due); for a wake-up
    later than ``late_s``, the loop thread's CPU time over its sleep (``late``: (lag, CPU)).
    ``due`` is the next wake-up's, for a watchdog thread to see how overdue it is.

    It runs only inside ``async with``, so that it costs the systems nothing while they are not
    watched; on leaving, it yields to the loop for two intervals, so that a wake-up that a
    blocking call made overdue is still recorded."""

    def __init__(self, interval_s: float = 0.001, late_s: float = math.inf) -> None:
        self.interval_s, self.late_s = interval_s, late_s
        self.dues: list[float] = []
        self.woke: list[float] = []
        self.lags: list[float] = []
        self.late: list[tuple[float, float]] = []
        self.due = math.inf
        self._stop = False
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        interval, late_s = self.interval_s, self.late_s
        timed = late_s < math.inf
        while not self._stop:
            cpu0 = time.thread_time() if timed else 0.0
            due = self.due = time.perf_counter() + interval
            await asyncio.sleep(interval)
            woke = time.perf_counter()
            lag = max(0.0, woke - due)
            self.dues.append(due)
            self.woke.append(woke)
            self.lags.append(lag)
            if lag > late_s:
                self.late.append((lag, time.thread_time() - cpu0))
        self.due = math.inf

    def beats(self) -> list[tuple[float, float]]:
        """``(due, woke)`` of each wake-up."""
        return list(zip(self.dues, self.woke, strict=True))

    async def __aenter__(self) -> Heartbeat:
        self._task = asyncio.create_task(self._beat())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.sleep(2 * self.interval_s)
        self._stop = True
        if self._task is not None:
            await self._task


@asynccontextmanager
async def heartbeat(interval_s: float = 0.001) -> AsyncIterator[list[float]]:
    """A :class:`Heartbeat` for the block; yields the list of its lags (seconds)."""
    async with Heartbeat(interval_s) as beat:
        yield beat.lags


@dataclass(frozen=True)
class Collection:
    """One garbage collection of the driver: wall time, and the CPU time of the thread that ran
    it (much less than the wall time: the process was not running meanwhile).

    A full (generation 2) collection walks every tracked object of the process and holds the
    event loop meanwhile, so it is where long event-loop stalls come from."""

    start: float
    end: float
    generation: int
    cpu_s: float
    collected: int


@contextmanager
def gc_log() -> Iterator[list[Collection]]:
    """The driver's garbage collections inside the block."""
    found: list[Collection] = []
    started = [0.0, 0.0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0], started[1] = time.perf_counter(), time.thread_time()
        else:
            found.append(
                Collection(
                    started[0],
                    time.perf_counter(),
                    int(info["generation"]),
                    time.thread_time() - started[1],
                    int(info.get("collected", 0)),
                )
            )

    gc.callbacks.append(callback)
    try:
        yield found
    finally:
        gc.callbacks.remove(callback)


def lag_ms(lags: Sequence[float]) -> tuple[float, float]:
    """(p99, max) of heartbeat lags, in milliseconds."""
    return percentile(lags, 99) * 1e3, max(lags, default=math.nan) * 1e3


@dataclass
class Events:
    """asyncexec's structlog events, recorded with a monotonic timestamp instead of printed.

    Installed as the only structlog processor by the benchmark (an application may configure
    logging; the library never does), so the library's log lines neither clutter the table nor
    cost terminal I/O, and the start-up and restart phases can be read back from them.
    """

    records: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)

    def __call__(self, logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> Any:
        import structlog

        self.records.append((time.perf_counter(), str(event_dict.get("event")), dict(event_dict)))
        raise structlog.DropEvent

    def mark(self) -> int:
        return len(self.records)

    def since(self, mark: int, event: str) -> list[tuple[float, dict[str, Any]]]:
        return [(t, d) for t, e, d in self.records[mark:] if e == event]


class Timer:
    """Wall time of the benchmark's own sections, to print where its time went."""

    def __init__(self) -> None:
        self.sections: dict[str, float] = {}

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sections[name] = self.sections.get(name, 0.0) + time.perf_counter() - t0


def live_workers() -> list[dict[str, Any]]:
    """asyncexec worker actors that are not dead. Blocking (it asks the GCS): call it off the
    event loop."""
    import ray._private.state as ray_state

    return [
        a
        for a in ray_state.actors().values()
        if a["ActorClassName"] == "_Worker" and a["State"] != "DEAD"
    ]


def live_placement_groups() -> list[dict[str, Any]]:
    """Placement groups that are not removed. Blocking, like :func:`live_workers`."""
    import ray

    return [p for p in ray.util.placement_group_table().values() if p["state"] != "REMOVED"]
