"""The asyncio systems measured beside Ray Train: asyncexec, and two hand-written loops over plain
actors (lockstep, and the bare batched floor).

All of them run on the caller's event loop and never block it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import deque
from typing import Any

import psutil
import ray
import tenacity
from _common import MiB, cpu_seconds, rate
from _workload import LoopWorker, PlainActor, ae_last_time, ae_resume, ae_steps

import asyncexec

__all__ = ["AsyncexecGroup", "LoopGroup", "kill_actors", "plain_actors_ready"]

#: How many reports one long poll of the batched floor may drain.
FLOOR_POLL_MAX = 4096


def _num_cpus(resources: dict[str, float]) -> float:
    return resources.get("CPU", 0.0)


async def kill_actors(actors: list[Any]) -> None:
    """Kill plain actors and wait (bounded) until each is gone, so the next figure starts clean."""
    for actor in actors:
        ray.kill(actor, no_restart=True)

    async def gone(actor: Any) -> None:
        while True:
            try:
                await actor.ping.remote()
            except Exception:  # RayActorError once it is dead
                return
            await asyncio.sleep(0.02)

    await asyncio.wait_for(asyncio.gather(*(gone(a) for a in actors)), 30)


async def plain_actors_ready(
    num: int, resources: dict[str, float]
) -> tuple[float, list[int], list[Any]]:
    """Make ``num`` plain actors and await one call on each; return the seconds that took, their
    pids and the actors (for :func:`kill_actors`)."""
    t0 = time.perf_counter()
    actors = [PlainActor.options(num_cpus=_num_cpus(resources)).remote() for _ in range(num)]
    pids = list(await asyncio.gather(*(a.ping.remote() for a in actors)))
    return time.perf_counter() - t0, pids, actors


class LoopGroup:
    """``num`` plain async actors shared by the lockstep loop and the batched floor."""

    def __init__(self, num: int, resources: dict[str, float], bound: int) -> None:
        self.num = num
        self.resources = resources
        self.bound = bound
        self.actors: list[Any] = []
        self.pids: list[int] = []

    async def start(self) -> float:
        t0 = time.perf_counter()
        cpus = _num_cpus(self.resources)
        self.actors = [LoopWorker.options(num_cpus=cpus).remote() for _ in range(self.num)]
        self.pids = list(await asyncio.gather(*(a.ping.remote() for a in self.actors)))
        return time.perf_counter() - t0

    async def lockstep(self, steps: int) -> dict[str, float]:
        """One call per worker per step, ``await asyncio.gather(...)`` of them every step."""
        cpu0 = cpu_seconds([os.getpid()]), cpu_seconds(self.pids)
        first = time.perf_counter()
        for i in range(steps):
            await asyncio.gather(*(a.step.remote(i) for a in self.actors))
        last = time.perf_counter()
        cpu1 = cpu_seconds([os.getpid()]), cpu_seconds(self.pids)
        total = steps * self.num
        return {
            "rate": rate(steps, self.num, first, last),
            "driver_cpu_us": (cpu1[0] - cpu0[0]) / total * 1e6,
            "worker_cpu_us": (cpu1[1] - cpu0[1]) / total * 1e6,
        }

    async def floor(self, steps: int, *, timed: bool = False) -> dict[str, float]:
        """The bare batched floor: each worker's thread fills a bounded deque, one long-poll
        task per worker drains it, and steps are assembled when every worker has reported.

        The bound (``self.bound``) counts only the reports waiting in a worker's deque: a poll
        empties it, and the thread makes as many again while the answer travels and is
        consumed, so up to twice the bound are in flight a worker. asyncexec's ``buffer_size``
        counts every report the consumer has not taken (worker, wire and driver together)."""
        queues: list[deque[dict[str, Any]]] = [deque() for _ in self.actors]
        done = [False] * self.num
        changed = asyncio.Event()

        async def pump(rank: int, actor: Any) -> None:
            while True:
                items, finished = await actor.poll.remote(FLOOR_POLL_MAX)
                queues[rank].extend(items)
                changed.set()
                if finished:
                    done[rank] = True
                    return

        cpu0 = cpu_seconds([os.getpid()]), cpu_seconds(self.pids)
        first = last = time.perf_counter()
        await asyncio.gather(*(a.start.remote(steps, self.bound, timed) for a in self.actors))
        pumps = [asyncio.create_task(pump(r, a)) for r, a in enumerate(self.actors)]
        count = 0
        last_t = 0.0
        try:
            while True:
                ready = min(len(q) for q in queues)
                if ready:
                    for _ in range(ready):
                        step = [q.popleft() for q in queues]
                        if timed:  # the step's last report, as asyncexec's and Ray Train's
                            last_t = max(report["t"] for report in step)
                    last = time.perf_counter()
                    count += ready
                if all(done) and not any(queues):
                    break
                await changed.wait()
                changed.clear()
            ended = time.time()
            await asyncio.gather(*pumps)
        finally:
            for task in pumps:
                task.cancel()
        cpu1 = cpu_seconds([os.getpid()]), cpu_seconds(self.pids)
        assert count == steps, (count, steps)
        total = steps * self.num
        return {
            "rate": rate(count, self.num, first, last),
            "driver_cpu_us": (cpu1[0] - cpu0[0]) / total * 1e6,
            "worker_cpu_us": (cpu1[1] - cpu0[1]) / total * 1e6,
            "run_end": ended - last_t if timed else float("nan"),
        }

    async def close(self) -> None:
        await kill_actors(self.actors)
        self.actors = []


class AsyncexecGroup:
    """One asyncexec Executor with ``num`` workers, and the figures measured on it."""

    def __init__(
        self,
        num: int,
        resources: dict[str, float],
        storage_path: str,
        spares: int = 0,
        *,
        local: bool = False,
    ) -> None:
        self.num = num
        self.executor = asyncexec.Executor(
            num,
            resources_per_worker=resources,
            restart=asyncexec.RestartPolicy(max_restarts=1, wait=tenacity.wait_none()),
            storage_path=storage_path,
            name="bench",
            spares=spares,
            local=local,
        )

    async def start(self) -> float:
        """Enter the executor; return the seconds until it is ready to run."""
        t0 = time.perf_counter()
        await self.executor.__aenter__()
        return time.perf_counter() - t0

    def pids(self) -> list[int]:
        return [w.pid for w in self.executor.workers]

    async def stream(self, steps: int) -> dict[str, float]:
        """``steps`` tiny reports per worker, a consumer that does nothing; the rate from the
        call of ``run()`` to the last step (as the floor's and Ray Train's: the run's end, after
        it, is the run-end row's)."""
        pids = self.pids()
        cpu0 = cpu_seconds([os.getpid()]), cpu_seconds(pids)
        count = 0
        first = last = time.perf_counter()
        async for _ in self.executor.run(ae_steps, {"steps": steps}):
            count += 1
            if count == steps:
                last = time.perf_counter()
        cpu1 = cpu_seconds([os.getpid()]), cpu_seconds(pids)
        assert count == steps, (count, steps)
        total = steps * self.num
        return {
            "rate": rate(count, self.num, first, last),
            "driver_cpu_us": (cpu1[0] - cpu0[0]) / total * 1e6,
            "worker_cpu_us": (cpu1[1] - cpu0[1]) / total * 1e6,
        }

    async def run_end(self, steps: int) -> float:
        """Seconds from the last report (its wall time, taken in the worker) to the end of the
        ``async for`` (the run's result is then available)."""
        last_t = 0.0
        async for step in self.executor.run(ae_last_time, {"steps": steps}):
            last_t = max(r.metrics["t"] for r in step.reports)
        return time.time() - last_t

    async def restart(
        self,
        kill_after: int,
        period_s: float,
        resume_steps: int,
        *,
        reuse: bool = False,
        default_wait: bool = False,
    ) -> dict[str, float]:
        """SIGKILL one worker mid-run; return the seconds from ``os.kill`` to the first step of
        attempt 2. ``reuse``: replace only the killed rank (``reuse_survivors``);
        ``default_wait``: the default policy's wait (backoff, but none after progress) instead
        of none. A spare, when the executor has one, takes the killed rank's place."""
        options: dict[str, Any] = {} if default_wait else {"wait": tenacity.wait_none()}
        self.executor.restart_policy = asyncexec.RestartPolicy(
            max_restarts=1, reuse_survivors=reuse, **options
        )
        config = {"max_steps": 100_000, "period_s": period_s, "resume_steps": resume_steps}
        t0 = t1 = None
        async for step in self.executor.run(ae_resume, config):
            if t0 is None and step.attempt == 1 and step.index + 1 >= kill_after:
                victim = self.pids()[min(1, self.num - 1)]
                t0 = time.perf_counter()
                os.kill(victim, signal.SIGKILL)
            elif t1 is None and step.attempt == 2:
                t1 = time.perf_counter()
        if t0 is None or t1 is None:
            raise RuntimeError("the asyncexec run ended without a restart")
        return {"first_step": t1 - t0, "t_kill": t0, "t_first": t1}

    async def spares_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until the executor's standby spares are all started again (a spare that took a
        rank's place is replaced in the background)."""
        want = self.executor.config.spares
        deadline = time.perf_counter() + timeout_s
        while True:
            group = self.executor._slot.group
            if group is None or len(group.spares) >= want:
                return
            if time.perf_counter() > deadline:
                raise RuntimeError("the executor's spare was not started again in time")
            await asyncio.sleep(0.01)

    async def driver_memory(self, steps: int, every: int, warmup: int) -> list[float]:
        """The driver's RSS (MiB), sampled every ``every`` steps after ``warmup`` steps, over a
        run of ``steps`` steps."""
        proc = psutil.Process()
        samples: list[float] = []
        async for step in self.executor.run(ae_steps, {"steps": steps}):
            if step.index >= warmup and step.index % every == 0:
                samples.append(proc.memory_info().rss / MiB)
        samples.append(proc.memory_info().rss / MiB)
        return samples

    async def close(self) -> None:
        await self.executor.__aexit__(None, None, None)
