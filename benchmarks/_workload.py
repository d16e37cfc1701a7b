"""What runs in the worker processes: the reporting functions of each system and the plain actors
of the hand-written loops.

Workers import this module by name (the benchmark puts its folder on ``PYTHONPATH``), so it stays
light: ``ray.train`` and ``asyncexec`` are imported inside the functions that need them, and only in
the workers of that system.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque
from typing import Any

import ray

__all__ = [
    "LoopWorker",
    "PlainActor",
    "ae_last_time",
    "ae_lifecycle",
    "ae_resume",
    "ae_steps",
    "rt_last_time",
    "rt_steps",
    "rt_until_killed",
]

# Ray Train v1: train functions take no argument (BackendExecutor calls them as they are), so the
# benchmark binds their parameters with functools.partial.


def rt_steps(steps: int) -> None:
    """Report ``steps`` tiny reports as fast as Ray Train takes them."""
    from ray import train

    report = train.report
    for i in range(steps):
        report({"step": i})


def rt_last_time(steps: int) -> None:
    """Report ``steps`` reports; each carries the wall time it was made."""
    from ray import train

    for i in range(steps):
        train.report({"step": i, "t": time.time()})


def rt_until_killed(max_steps: int, period_s: float) -> None:
    """Report one step every ``period_s`` (the driver kills a worker meanwhile)."""
    from ray import train

    for i in range(max_steps):
        time.sleep(period_s)
        train.report({"step": i})


# asyncexec: functions take the run's config.


def ae_steps(config: dict[str, Any]) -> None:
    """Report ``config["steps"]`` tiny reports as fast as asyncexec takes them."""
    import asyncexec

    report = asyncexec.report
    for i in range(config["steps"]):
        report({"step": i})


def ae_last_time(config: dict[str, Any]) -> None:
    """Report ``config["steps"]`` reports; each carries the wall time it was made."""
    import asyncexec

    for i in range(config["steps"]):
        asyncexec.report({"step": i, "t": time.time()})


def ae_resume(config: dict[str, Any]) -> None:
    """Attempt 1 reports one step every ``period_s`` until a worker is killed; a later attempt
    (the resumed one) reports ``resume_steps`` steps at once and returns."""
    import asyncexec

    if asyncexec.get_context().attempt == 1:
        for i in range(config["max_steps"]):
            time.sleep(config["period_s"])
            asyncexec.report({"step": i})
    else:
        for i in range(config["resume_steps"]):
            asyncexec.report({"step": i, "resumed": True})


def ae_lifecycle(config: dict[str, Any]) -> None:
    """The lifecycle benchmark's function: ``config["steps"]`` tiny reports at full rate.

    On attempt 1 the rank ``config["victim"]`` stops after ``config["kill_at"]`` reports and
    waits (``hold_s`` at most) for the driver to SIGKILL its process; the other ranks go on until
    their buffers are full. The resumed attempt reports the steps from ``kill_at`` on, so the
    consumer sees ``steps`` steps in all."""
    import asyncexec

    report = asyncexec.report
    context = asyncexec.get_context()
    steps, kill_at = config["steps"], config["kill_at"]
    if context.attempt == 1:
        for i in range(kill_at):
            report({"step": i})
        if context.world_rank == config["victim"]:
            time.sleep(config["hold_s"])  # killed meanwhile
            raise RuntimeError("the driver did not kill this worker")
        for i in range(kill_at, steps):
            report({"step": i})
    else:
        for i in range(kill_at, steps):
            report({"step": i})


# Plain actors.


class _Plain:
    """The plainest Ray actor: the baseline of start-up time and worker memory."""

    def ping(self) -> int:
        return os.getpid()


PlainActor: Any = ray.remote(_Plain)


class _LoopWorker:
    """A plain async actor for the two hand-written asyncio loops.

    Lockstep: the driver calls ``step(i)`` on every worker for every step. Batched floor: ``start``
    runs a thread that appends reports to a bounded deque (it waits while the deque is full), and
    ``poll`` is a long poll that drains up to ``max_items`` at once, waiting while the deque is
    empty. It is the least a batched, push-based design can cost: no ranks, no credit window, no
    failure handling.
    """

    def __init__(self) -> None:
        self._buf: deque[dict[str, Any]] = deque()
        self._cond = threading.Condition()
        self._done = False
        self._waiting = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    async def ping(self) -> int:
        return os.getpid()

    async def step(self, i: int) -> dict[str, Any]:
        return {"step": i}

    async def sleep(self, seconds: float) -> None:
        """A call that stays in flight for ``seconds`` (the pipeline's objects-held figure)."""
        await asyncio.sleep(seconds)

    async def start(self, steps: int, bound: int, timed: bool) -> None:
        with self._cond:
            self._buf.clear()
            self._done = False
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        threading.Thread(target=self._produce, args=(steps, bound, timed), daemon=True).start()

    def _notify(self) -> None:
        # Called with the lock held: wake a poll that waits on the actor's loop.
        if self._waiting and self._loop is not None and self._wake is not None:
            self._waiting = False
            self._loop.call_soon_threadsafe(self._wake.set)

    def _produce(self, steps: int, bound: int, timed: bool) -> None:
        buf, cond = self._buf, self._cond
        for i in range(steps):
            item: dict[str, Any] = {"step": i, "t": time.time()} if timed else {"step": i}
            with cond:
                while len(buf) >= bound:
                    cond.wait()
                buf.append(item)
                self._notify()
        with cond:
            self._done = True
            self._notify()

    async def poll(self, max_items: int) -> tuple[list[dict[str, Any]], bool]:
        assert self._wake is not None
        while True:
            with self._cond:
                if self._buf or self._done:
                    n = min(max_items, len(self._buf))
                    items = [self._buf.popleft() for _ in range(n)]
                    self._cond.notify_all()
                    return items, self._done and not self._buf
                self._wake.clear()
                self._waiting = True
            await self._wake.wait()


LoopWorker: Any = ray.remote(_LoopWorker)
