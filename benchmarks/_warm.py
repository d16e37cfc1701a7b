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

import anyio
from _common import Rows, heartbeat, lag_ms
from _systems import LoopGroup, kill_actors, plain_actors_ready
from _workload import ae_steps

import asyncexec

__all__ = ["measure_warm"]


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
    rows: Rows,
    n: int,
    repeats: int,
    cycles: int,
    floor_steps: int,
    resources: dict[str, float],
    bound: int,
    storage: str,
    warmups: int = 1,
) -> None:
    """Each repeat: one leased enter and first step (recorded, ms), ``n`` plain actors cold, then
    the lag through ``cycles`` lease cycles and one refill, then the floor streaming's lag, each
    filed in ``rows``. The first ``warmups`` rounds are not recorded."""
    loops = LoopGroup(n, resources, bound)
    await loops.start()
    try:
        async with asyncexec.WorkerPool(n + 1, resources_per_worker=resources) as pool:
            for i in range(warmups + repeats):
                record = i >= warmups
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
                    rows.add("warm_enter", "asyncexec", enter * 1e3)
                    rows.add("warm_enter", "floor", seconds * 1e3)
                    rows.add("warm_first", "asyncexec", first * 1e3)
                    for column, lag in (("asyncexec", lags), ("floor", floor_lags)):
                        p99, worst = lag_ms(lag)
                        rows.add("lease_p99", column, p99)
                        rows.add("lease_max", column, worst)
            rows.note("warm_refills", pool.statistics().replaced)
    finally:
        await loops.close()
