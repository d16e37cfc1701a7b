"""Warm workers: an executor leased from a WorkerPool, against cold starts and the floor.

Measured in the caller's Ray (``run.py`` starts it), on the caller's event loop:

- entering an executor of ``n`` workers leased from a warm pool, until it is ready (against
  ``n`` plain actors started cold, the floor of a cold start);
- from ``run()`` to the first step on that executor;
- the event loop's lag (1 ms heartbeat) through cycles of leasing, running, giving back and
  refilling (an idle worker SIGKILLed, so the pool starts a process in the background), against
  the same heartbeat beside the batched floor streaming, interleaved in one run.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

import anyio
from _common import heartbeat, lag_ms
from _systems import LoopGroup, kill_actors, plain_actors_ready
from _workload import ae_steps

import asyncexec

__all__ = ["WarmFigures", "measure_warm"]


@dataclass
class WarmFigures:
    """Samples per repeat (seconds for times, milliseconds for lags)."""

    enter: list[float] = field(default_factory=list)
    cold_actors: list[float] = field(default_factory=list)
    first_step: list[float] = field(default_factory=list)
    lease_p99: list[float] = field(default_factory=list)
    lease_max: list[float] = field(default_factory=list)
    floor_p99: list[float] = field(default_factory=list)
    floor_max: list[float] = field(default_factory=list)
    refills: int = 0


async def _lease_once(pool: asyncexec.WorkerPool, n: int, storage: str) -> tuple[float, float]:
    """Lease an executor of ``n``, run 3 tiny steps, give it back: (enter s, run() to first
    step s)."""
    t0 = time.perf_counter()
    ex = asyncexec.Executor(n, pool=pool, storage_path=storage, name="bench-warm")
    await ex.__aenter__()
    try:
        t1 = time.perf_counter()
        first = None
        async for _ in ex.run(ae_steps, {"steps": 3}):
            if first is None:
                first = time.perf_counter()
        assert first is not None
    finally:
        await ex.__aexit__(None, None, None)
    return t1 - t0, first - t1


async def measure_warm(
    n: int,
    repeats: int,
    cycles: int,
    floor_steps: int,
    resources: dict[str, float],
    bound: int,
    storage: str,
) -> WarmFigures:
    """Each repeat: one leased enter and first step (recorded), ``n`` plain actors cold, then
    the lag through ``cycles`` lease cycles and one refill, then the floor streaming's lag. A
    first round is a warm-up and is not recorded."""
    figures = WarmFigures()
    loops = LoopGroup(n, resources, bound)
    await loops.start()
    try:
        async with asyncexec.WorkerPool(n + 1, resources_per_worker=resources) as pool:
            for i in range(repeats + 1):
                record = i > 0
                enter, first = await _lease_once(pool, n, storage)
                seconds, _, actors = await plain_actors_ready(n, resources)
                await kill_actors(actors)
                async with heartbeat() as lags:
                    for _ in range(cycles):
                        await _lease_once(pool, n, storage)
                    refilled = pool.statistics().replaced + 1
                    victim = next(iter(pool._stock.idle)).metadata.pid
                    os.kill(victim, signal.SIGKILL)
                    with anyio.fail_after(60):
                        while pool.statistics().replaced < refilled or (  # noqa: ASYNC110 - the refill runs in the pool's own tasks
                            pool.statistics().idle < n + 1
                        ):
                            await anyio.sleep(0.005)
                    await _lease_once(pool, n, storage)
                async with heartbeat() as floor_lags:
                    await loops.floor(floor_steps)
                if record:
                    figures.enter.append(enter)
                    figures.first_step.append(first)
                    figures.cold_actors.append(seconds)
                    p99, worst = lag_ms(lags)
                    figures.lease_p99.append(p99)
                    figures.lease_max.append(worst)
                    p99, worst = lag_ms(floor_lags)
                    figures.floor_p99.append(p99)
                    figures.floor_max.append(worst)
            figures.refills = pool.statistics().replaced
    finally:
        await loops.close()
    return figures
