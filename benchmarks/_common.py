"""Shared measuring tools of the benchmarks: statistics, the event-loop heartbeat, process memory,
CPU time, garbage collections, where a sampled stack had the event loop, the recorder of
asyncexec's log events, and what is left in the cluster (for the chaos runner and the soak).
The harness, the rows and the table are in ``_harness.py``.

Nothing here starts Ray.
"""

from __future__ import annotations

import asyncio
import bisect
import gc
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, MutableMapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import anyio
import psutil

__all__ = [
    "Events",
    "Frame",
    "LoopBeat",
    "Timer",
    "cpu_seconds",
    "fmt_frame",
    "Collection",
    "Heartbeat",
    "IDLE",
    "StackSample",
    "StallWatchdog",
    "gc_log",
    "heartbeat",
    "lag_ms",
    "live_placement_groups",
    "live_workers",
    "loop_frames",
    "median",
    "percentile",
    "process_memory",
    "progress",
    "rate",
    "stack_of",
    "stack_site",
]

MiB = 1024 * 1024


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


#: A frame of a sampled stack: (file, line, function).
Frame = tuple[str, int, str]


def stack_of(frame: FrameType | None) -> tuple[Frame, ...]:
    """The stack from ``frame`` out (from ``sys._current_frames()``), outermost first."""
    frames: list[Frame] = []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return tuple(reversed(frames))


def _short(path: str) -> str:
    for marker in ("site-packages/", "/lib/python3"):
        i = path.rfind(marker)
        if i >= 0:
            rest = path[i + len(marker) :]
            return rest if marker == "site-packages/" else "python3" + rest
    for marker in ("/asyncexec/", "/benchmarks/"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + 1 :]
    return path


def fmt_frame(frame: Frame) -> str:
    return f"{_short(frame[0])}:{frame[1]} {frame[2]}"


def loop_frames(stack: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """The frames below the event loop's machinery: from the callback or task step it runs.
    A stack that is in the loop's own code (waiting in select) is kept from ``run_forever``."""
    cut = 0
    for i, (path, _, name) in enumerate(stack):
        if path.endswith(os.path.join("asyncio", "events.py")) and name == "_run":
            cut = i + 1
    if cut == 0:
        cut = next((i for i, (_, _, name) in enumerate(stack) if name == "run_forever"), 0)
    return stack[cut:]


def stack_site(stack: tuple[Frame, ...]) -> str:
    """Where a sample of the loop's thread was: an import under way ("import" and the module),
    else the innermost asyncexec frame, else the outermost frame the loop ran (a benchmark task,
    or the loop itself), and the innermost frame when it differs."""
    frames = loop_frames(stack)
    if not frames:
        return "?"
    modules = [f for f in frames if f[2] == "<module>"]
    if modules:
        return f"import {_short(modules[0][0])}"
    own = [f for f in frames if f"{os.sep}asyncexec{os.sep}" in f[0]]
    anchor = own[-1] if own else frames[0]
    leaf = frames[-1]
    return fmt_frame(anchor) if leaf == anchor else f"{fmt_frame(anchor)} > {fmt_frame(leaf)}"


@dataclass(frozen=True)
class StackSample:
    """The event-loop thread's stack while the heartbeat due at ``due`` was overdue, and the
    stacks of the driver's other Python threads that were not idle."""

    due: float
    taken: float
    late_s: float  # how much later than asked the watchdog itself woke (it waited for the GIL)
    stack: tuple[Frame, ...]  # outermost first
    others: tuple[tuple[str, tuple[Frame, ...]], ...] = ()  # (thread name, its stack)


#: Innermost functions of a thread that waits (not running Python, not holding the GIL).
IDLE = {
    "wait",
    "_wait_for_tstate_lock",
    "select",
    "poll",
    "get",
    "sleep",
    "accept",
    "readinto",
    "listen_error_messages",  # Ray's thread, blocked in C++
}


class StallWatchdog(threading.Thread):
    """A thread that wakes every ``period_s`` and samples the event-loop thread's stack while
    the heartbeat is more than ``threshold_s`` overdue, with the stacks of the driver's other
    threads that are not idle; and on every tick the CPU time of the loop's thread and of the
    whole driver process: a stall in which neither ran was the operating system not running the
    driver. Made on the loop's thread."""

    def __init__(self, heartbeat: Heartbeat, threshold_s: float, period_s: float) -> None:
        super().__init__(name="stall-watchdog", daemon=True)
        self.heartbeat = heartbeat
        self.threshold_s, self.period_s = threshold_s, period_s
        self.loop_thread = loop_thread = threading.get_ident()
        self.samples: list[StackSample] = []
        #: (perf_counter, loop thread CPU s, process CPU s) every tick.
        self.ticks: list[tuple[float, float, float]] = []
        self._clock = time.pthread_getcpuclockid(loop_thread)
        self._stop_event = threading.Event()

    def run(self) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        while not self._stop_event.is_set():
            asked = time.perf_counter()
            time.sleep(self.period_s)
            now = time.perf_counter()
            self.ticks.append((now, time.clock_gettime(self._clock), time.process_time()))
            due = self.heartbeat.due
            if now - due < self.threshold_s:
                continue
            frames = sys._current_frames()
            frame = frames.get(self.loop_thread)
            if frame is None:
                continue
            others = []
            for ident, other in frames.items():
                if ident in (self.loop_thread, me):
                    continue
                stack = stack_of(other)
                if stack and stack[-1][2] not in IDLE:
                    if ident not in names:
                        names = {t.ident: t.name for t in threading.enumerate()}
                    others.append((names.get(ident, str(ident)), stack))
            self.samples.append(
                StackSample(
                    due,
                    now,
                    max(0.0, now - asked - self.period_s),
                    stack_of(frame),
                    tuple(others),
                )
            )

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)

    def cpu(self, start: float, end: float) -> tuple[float, float] | None:
        """CPU seconds of the loop's thread and of the driver process from ``start`` to ``end``,
        from the ticks around them (None without a tick on either side)."""
        ticks = self.ticks
        if not ticks:
            return None
        times = [t for t, _, _ in ticks]
        i = max(0, bisect.bisect_right(times, start) - 1)
        j = min(len(ticks) - 1, bisect.bisect_left(times, end))
        if j <= i:
            return None
        return ticks[j][1] - ticks[i][1], ticks[j][2] - ticks[i][2]


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
