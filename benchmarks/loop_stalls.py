"""Event-loop stalls of a service's first asyncexec executors, against its later ones.

    python benchmarks/loop_stalls.py                  # 3 fresh drivers x 6 rounds each
    python benchmarks/loop_stalls.py --drivers 1 --rounds 10 --stacks
    python benchmarks/loop_stalls.py --freeze         # gc.freeze() after start-up

Each driver is a fresh process that does what a service does: imports asyncexec at the top,
starts Ray before its event loop (``ray.init``, pre-started workers off so that every round
starts fresh worker processes alike) and then, in one event loop, serves rounds of requests:
4 executors enter at once (``async with asyncexec.Executor(2, resources_per_worker={"CPU":
0.25})``), each runs a short function (5 reports) and leaves. Nothing of asyncexec's driver side
is touched before the first round: round 1 is a service's first request.

Recording. A 1 ms heartbeat task notes every wake-up more than 10 ms late: a stall, from when it
was due to when it woke. A watchdog thread wakes every 2 ms and, while the heartbeat is more
than 5 ms overdue, samples the loop thread's stack (``sys._current_frames()``); it also notes
the loop thread's CPU time, and ``gc.callbacks`` note every garbage collection. The watchdog
needs the GIL to sample: code that holds it throughout is sampled right after, so a stall with
no sample held the GIL (or was the operating system not running the driver: see its CPU).

Causes, per stall, from its samples: ``import <module>`` when the loop was importing (the
outermost module being imported), ``gc genN`` when a collection covers half of it, else the
innermost asyncexec frame of the commonest sample (and the innermost frame when it differs);
``loop CPU`` is how much of the stall the loop thread spent on the CPU (low: the driver was not
running, other processes were). Each driver's 1 s idle baseline (heartbeat alone, before round
1) shows the machine's own stalls.

The parent prints each driver's stalls per round and then, over all drivers, the median of each
driver's worst stall in round 1 and of its worst stall in any later round.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

import _harness  # sets the environment the drivers and their workers inherit
from _common import Collection, Heartbeat, gc_log

# The watchdog: the loop thread's stack while the heartbeat is overdue ---------------------------


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


#: A heartbeat wake-up this late is a stall (s).
STALL_S = 0.010
#: The watchdog samples the loop's stack while the heartbeat is more overdue than this (s).
WATCH_S = 0.005
#: And wakes this often (s).
PERIOD_S = 0.002
EXECUTORS = 4
WORKERS = 2
RESOURCES = {"CPU": 0.25}
REPORTS = 5


def five_reports() -> None:
    """The short run of each executor."""
    import asyncexec

    for i in range(REPORTS):
        asyncexec.report({"i": i})


# Recording ----------------------------------------------------------------------------------------


class Monitor:
    """The heartbeat, the watchdog (the loop's stack while the heartbeat is more than ``WATCH_S``
    overdue, every ``PERIOD_S``; not with ``watch=False``) and the driver's collections."""

    def __init__(self, watch: bool = True) -> None:
        self.heartbeat = Heartbeat()
        self.watchdog = StallWatchdog(self.heartbeat, WATCH_S, PERIOD_S)
        self.gcs: list[Collection] = []
        self._watch = watch
        self._open = contextlib.AsyncExitStack()

    @property
    def beats(self) -> list[tuple[float, float]]:
        """``(due, woke)`` of the wake-ups later than ``STALL_S``."""
        return [(due, woke) for due, woke in self.heartbeat.beats() if woke - due > STALL_S]

    async def start(self) -> None:
        await self._open.enter_async_context(self.heartbeat)
        if self._watch:
            self.gcs = self._open.enter_context(gc_log())
            self.watchdog.start()
            self._open.callback(self.watchdog.stop)

    async def stop(self) -> None:
        await self._open.aclose()


@dataclass(frozen=True)
class Stall:
    round: int  # 0: the idle baseline
    at_s: float  # from the round's start
    ms: float
    cause: str
    loop_cpu_ms: float
    process_cpu_ms: float
    sites: list[tuple[str, int]]  # the loop thread's commonest sites, with their sample counts
    others: list[tuple[str, int]]  # the other threads' that were running meanwhile


def stalls_of(monitor: Monitor, rounds: list[tuple[int, float, float]]) -> list[Stall]:
    """Each stall, its round and its cause: a garbage collection that covers half of it; else
    the loop's code when the loop thread ran half of it; else the driver's other threads when
    they did; else the operating system running other processes."""
    out = []
    for due, woke in monitor.beats:
        wall = woke - due
        number, t0 = next(((n, a) for n, a, b in rounds if a <= woke <= b), (-1, due))
        samples = [x for x in monitor.watchdog.samples if x.due == due]
        sites = Counter(stack_site(x.stack) for x in samples)
        others = Counter(
            f"{name}: {stack_site(stack)}" for x in samples for name, stack in x.others
        )
        gcs = [c for c in monitor.gcs if c.start < woke and c.end > due]
        gc_s = sum(min(c.end, woke) - max(c.start, due) for c in gcs)
        loop_cpu, process_cpu = monitor.watchdog.cpu(due, woke) or (math.nan, math.nan)
        if gc_s >= wall / 2:
            cause = f"gc gen{max(c.generation for c in gcs)} ({gc_s * 1e3:.0f} ms, "
            cause += f"{sum(c.collected for c in gcs):,} objects collected)"
        elif loop_cpu >= wall / 2:
            cause = sites.most_common(1)[0][0] if sites else "the loop's code (no sample)"
        elif process_cpu - loop_cpu >= wall / 2:
            top = others.most_common(1)[0][0] if others else "no sample"
            cause = f"other driver threads ({top})"
        else:
            cause = "driver not running (other processes had the CPUs)"
        out.append(
            Stall(
                number,
                due - t0,
                wall * 1e3,
                cause,
                loop_cpu * 1e3,
                process_cpu * 1e3,
                sites.most_common(3),
                others.most_common(3),
            )
        )
    return out


# One driver -------------------------------------------------------------------------------------


async def _one(executor: Any) -> None:
    async with executor as ex:
        async for _ in ex.run(five_reports):
            pass


async def serve(rounds: int) -> list[Stall]:
    import asyncexec

    monitor = Monitor()
    await monitor.start()
    marks: list[tuple[int, float, float]] = []
    try:
        t0 = time.perf_counter()
        await asyncio.sleep(1.0)
        marks.append((0, t0, time.perf_counter()))
        for number in range(1, rounds + 1):
            t0 = time.perf_counter()
            async with asyncio.TaskGroup() as tg:
                for _ in range(EXECUTORS):
                    # The first touch of asyncexec.Executor: in round 1, on the loop.
                    ex = asyncexec.Executor(WORKERS, resources_per_worker=RESOURCES)
                    tg.create_task(_one(ex))
            await asyncio.sleep(0.05)  # a stall at the round's very end is still noted
            marks.append((number, t0, time.perf_counter()))
    finally:
        await monitor.stop()
    return stalls_of(monitor, marks)


def driver(rounds: int, freeze: bool) -> None:
    """One fresh driver (a child process): prints its stalls as one JSON line."""

    import asyncexec

    preloaded = "asyncexec._driver._executor" in sys.modules
    with _harness.ray_session(num_cpus=4):
        if freeze:
            gc.collect()
            gc.freeze()  # what start-up made is never walked by a collection again
        tracked = len(gc.get_objects())
        found = asyncio.run(serve(rounds))
    print(
        json.dumps(
            {
                "version": asyncexec.__version__,
                "driver_preloaded": preloaded,
                "tracked": tracked,
                "frozen": gc.get_freeze_count(),
                "stalls": [asdict(s) for s in found],
            }
        )
    )


# The parent: fresh drivers, one after the other ---------------------------------------------------


def _worst(stalls: list[dict[str, Any]], number: int) -> float:
    return max((s["ms"] for s in stalls if s["round"] == number), default=0.0)


def report(results: list[dict[str, Any]], rounds: int, show_sites: bool) -> None:
    for d, result in enumerate(results, 1):
        print(
            f"\ndriver {d}: driver side imported before the loop: {result['driver_preloaded']}; "
            f"objects the collector tracks when the loop starts: {result['tracked']:,} "
            f"(frozen: {result['frozen']:,})"
        )
        for number in range(rounds + 1):
            mine = sorted(
                (s for s in result["stalls"] if s["round"] == number), key=lambda s: -s["ms"]
            )
            name = "idle 1 s" if number == 0 else f"round {number}"
            print(
                f"  {name}: {len(mine)} stall(s) > {STALL_S * 1e3:.0f} ms, "
                f"worst {mine[0]['ms'] if mine else 0:.0f} ms, "
                f"sum {sum(s['ms'] for s in mine):.0f} ms"
            )
            for s in mine[:5]:
                print(
                    f"    {s['ms']:6.1f} ms at +{s['at_s']:5.2f} s  CPU loop "
                    f"{s['loop_cpu_ms']:5.1f} / driver {s['process_cpu_ms']:5.1f} ms  "
                    f"{s['cause']}"
                )
                if show_sites:
                    for where, n in s["sites"]:
                        print(f"        {n:3d} x {where}")
                    for where, n in s["others"]:
                        print(f"        {n:3d} x meanwhile {where}")
    firsts = [_worst(r["stalls"], 1) for r in results]
    idles = [_worst(r["stalls"], 0) for r in results]
    later = "no later round"
    if rounds > 1:
        laters = [max(_worst(r["stalls"], n) for n in range(2, rounds + 1)) for r in results]
        later = f"rounds 2-{rounds} {statistics.median(laters):.0f} ms ({_each(laters)})"
    print(
        f"\nworst stall, median over {len(results)} driver(s) (each driver's): round 1 "
        f"{statistics.median(firsts):.0f} ms ({_each(firsts)}); {later}; idle 1 s "
        f"{statistics.median(idles):.0f} ms ({_each(idles)})"
    )


def _each(values: list[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drivers", type=int, default=3, help="fresh driver processes")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per driver")
    parser.add_argument("--stacks", action="store_true", help="each stall's commonest sites")
    parser.add_argument(
        "--freeze", action="store_true", help="gc.freeze() after start-up, before the loop"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.drivers < 1 or args.rounds < 1:
        parser.error("--drivers and --rounds take 1 or more")
    if args.child:
        driver(args.rounds, args.freeze)
        return 0
    results = []
    for d in range(args.drivers):
        print(f"driver {d + 1} of {args.drivers} ...", file=sys.stderr, flush=True)
        rounds = ["--rounds", str(args.rounds), *(["--freeze"] if args.freeze else [])]
        results.append(_harness.child(os.path.abspath(__file__), "--child", *rounds, timeout_s=600))
    report(results, args.rounds, args.stacks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
