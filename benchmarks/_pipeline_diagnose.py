"""``benchmarks/pipeline.py --diagnose``: what stalls the driver's event loop, figure by figure.

The watchdog of ``loop_stalls.py`` (a thread that samples the loop thread's stack while a 1 ms
heartbeat is overdue, the loop thread's and the process's CPU time, the garbage collections)
runs through the figures; every wake-up more than ``STALL_S`` late is printed with the figure
it fell in, when, its cause (the loop's own code, the driver's other threads, or the operating
system running other processes) and the commonest sites sampled. ``--diagnose debug`` adds
asyncio's debug mode (``slow_callback_duration`` 3 ms: asyncio logs each callback or task step
that ran longer); debug mode costs the loop time of its own, so its figures are not the run's.
``--diagnose turns`` times every callback of the loop instead (``Handle._run``) and prints each
turn of the loop (from one ``select`` to the next) that ran longer than ``STALL_S``, with its
callbacks grouped by what they ran (a task's coroutine, or the callback's function): how many
and how long; it too costs time of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator

import loop_stalls
from loop_stalls import Monitor, stalls_of

__all__ = ["Diagnosis"]

#: A wake-up this late is printed (s); the watchdog samples from 3 ms overdue.
STALL_S = 0.004


class Turns:
    """Each turn of the loop longer than ``STALL_S``: its start, length and its callbacks."""

    def __init__(self) -> None:
        self.turn: list[tuple[str, float]] = []
        self.start = 0.0
        self.long: list[tuple[float, float, list[tuple[str, float]]]] = []
        self.collections: list[tuple[int, float, float]] = []  # (generation, start, end)
        self._collecting = 0.0

    def _on_gc(self, phase: str, info: dict[str, object]) -> None:
        if phase == "start":
            self._collecting = time.perf_counter()
        else:
            generation = info["generation"]
            assert isinstance(generation, int)
            self.collections.append((generation, self._collecting, time.perf_counter()))

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        turns = self
        run = asyncio.events.Handle._run
        selector = loop._selector  # type: ignore[attr-defined]
        select = selector.select

        def timed(handle: asyncio.events.Handle) -> None:
            t0 = time.perf_counter()
            try:
                run(handle)
            finally:
                turns.turn.append((_name(handle), time.perf_counter() - t0))

        def selecting(timeout: float | None = None) -> object:
            now = time.perf_counter()
            if now - turns.start > STALL_S:
                turns.long.append((turns.start, now - turns.start, turns.turn))
            got = select(timeout)
            turns.start = time.perf_counter()
            turns.turn = []
            return got

        asyncio.events.Handle._run = timed  # type: ignore[method-assign]
        selector.select = selecting
        gc.callbacks.append(self._on_gc)

    def print(self, spans: list[tuple[str, float, float]]) -> None:
        print(f"\nturns of the loop over {STALL_S * 1e3:.0f} ms: {len(self.long)}")
        for start, length, calls in self.long:
            where = next((f"{n} +{start - a:.3f} s" for n, a, b in spans if a <= start <= b), "-")
            grouped: dict[str, list[float]] = {}
            for name, took in calls:
                grouped.setdefault(name, []).append(took)
            inside = sum(took for _, took in calls)
            gcs = [
                f"gen{g} {(e - b) * 1e3:.1f} ms"
                for g, b, e in self.collections
                if start <= b <= start + length
            ]
            print(
                f"- {where}: {length * 1e3:.1f} ms, callbacks {inside * 1e3:.1f} ms"
                + (f"; collections: {', '.join(gcs)}" if gcs else "")
            )
            ranked = sorted(grouped.items(), key=lambda kv: -sum(kv[1]))
            for name, took in ranked[:6]:
                print(
                    f"    {len(took)}x {sum(took) * 1e3:.2f} ms (max {max(took) * 1e3:.2f}) {name}"
                )


def _name(handle: asyncio.events.Handle) -> str:
    callback = handle._callback  # type: ignore[attr-defined]
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        coro = owner.get_coro()
        while getattr(coro, "cr_code", None) is not None and "anyio" in coro.cr_code.co_filename:
            inner = getattr(coro, "cr_await", None)
            if inner is None or not hasattr(inner, "cr_code"):
                break
            coro = inner
        frame = getattr(coro, "cr_frame", None)
        where = f" @{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno}" if frame else ""
        return f"task {getattr(coro, '__qualname__', coro)}{where}"
    return f"{getattr(callback, '__qualname__', callback)}"


class Diagnosis:
    """The watchdog through the run; ``figure(name)`` marks the span of one figure."""

    def __init__(self, how: str) -> None:
        loop_stalls.STALL_S = STALL_S
        loop_stalls.WATCH_S = 0.003
        loop_stalls.PERIOD_S = 0.001
        self.debug = how == "debug"
        self.turns = Turns() if how == "turns" else None
        self.monitor: Monitor | None = None
        self.marks: list[tuple[int, float, float]] = []
        self.names: list[str] = []

    async def start(self) -> None:
        self.monitor = Monitor(watch=self.turns is None)
        await self.monitor.start()
        if self.turns is not None:
            self.turns.install(asyncio.get_running_loop())
            return
        if self.debug:
            loop = asyncio.get_running_loop()
            loop.set_debug(True)
            loop.slow_callback_duration = 0.003
            logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
            logging.getLogger("asyncio").setLevel(logging.WARNING)

    @contextlib.asynccontextmanager
    async def figure(self, name: str) -> AsyncIterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            await asyncio.sleep(0.01)
            self.names.append(name)
            self.marks.append((len(self.names), t0, time.perf_counter()))

    async def stop(self) -> None:
        assert self.monitor is not None
        await self.monitor.stop()
        if self.turns is not None:
            names = [(n, a, b) for (_, a, b), n in zip(self.marks, self.names, strict=True)]
            self.turns.print(names)
            return
        tracked = gc.get_objects()
        kinds = Counter(type(o).__qualname__ for o in tracked).most_common(12)
        print(
            f"\nobjects the collector tracks: {len(tracked):,}, frozen {gc.get_freeze_count():,};"
            f" the commonest: {', '.join(f'{k} {n:,}' for k, n in kinds)}"
        )
        del tracked
        threads = sorted(t.name for t in threading.enumerate())
        print(f"\ndriver threads ({len(threads)}): {', '.join(threads)}")
        print(f"switch interval {sys.getswitchinterval() * 1e3:.1f} ms")
        print("\nstalls over", f"{STALL_S * 1e3:.0f} ms:")
        for s in stalls_of(self.monitor, self.marks):
            where = self.names[s.round - 1] if s.round > 0 else "between figures"
            print(
                f"- {where} +{s.at_s:.3f} s: {s.ms:.1f} ms, {s.cause}; loop CPU "
                f"{s.loop_cpu_ms:.1f} ms, process CPU {s.process_cpu_ms:.1f} ms"
            )
            for site, n in s.sites:
                print(f"    loop {n}x {site}")
            for site, n in s.others:
                print(f"    other {n}x {site}")
