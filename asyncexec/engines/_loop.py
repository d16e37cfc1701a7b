"""Where a :class:`~asyncexec.engines.VLLMServer`'s engine lives, and what outlives it: the
event loop the engine runs on (the worker's own, or a loop of its own in a thread), and a small
process that kills the engine's processes once the server's process has ended, however it
ended."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["EngineLoop", "reaper", "running_loop"]

T = TypeVar("T")


class EngineLoop:
    """The event loop the engine lives on, and the ways to reach it from any thread.

    In a worker, the worker's own loop (the one the server's ``async def`` methods are called
    on), when the server is made in a thread where no loop runs: a request, a pause or a resume
    then reaches the engine with no hop between threads. Otherwise (made by hand, or inside a
    running loop) a loop of its own, run by a daemon thread, which :meth:`stop` ends.
    """

    def __init__(self, worker_loop: asyncio.AbstractEventLoop | None) -> None:
        self.thread: threading.Thread | None = None
        if worker_loop is not None and running_loop() is None:
            self.loop = worker_loop
            return
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="asyncexec-vllm-engine", daemon=True
        )
        self.thread.start()

    @property
    def own(self) -> bool:
        """Whether the loop is the server's own (not the worker's)."""
        return self.thread is not None

    def is_current(self) -> bool:
        """Whether the calling code runs on the engine loop."""
        return running_loop() is self.loop

    def send(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Send ``coroutine`` to the engine loop from another thread."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def spawn(self, coroutine: Coroutine[Any, Any, T]) -> asyncio.Task[T] | Future[T]:
        """Start ``coroutine`` on the engine loop: a task when this is that loop, else sent
        there; either way cancelled by ``.cancel()``."""
        if self.is_current():
            return self.loop.create_task(coroutine)
        return self.send(coroutine)

    async def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the engine loop: awaited here when this is that loop, else sent
        there and awaited here (a caller that stops waiting cancels it there)."""
        if self.is_current():
            return await coroutine
        future = self.send(coroutine)
        try:
            return await asyncio.wrap_future(future)
        except BaseException:
            future.cancel()
            raise

    def stop(self) -> None:
        """End the loop and its thread when the loop is the server's own: its tasks (the
        engine's watch, what the engine left) cancelled and ended first, as ``asyncio.run``
        ends them (a loop stopped with a task pending says "Task was destroyed but it is
        pending!" when the task is collected)."""
        if self.thread is None:
            return
        with contextlib.suppress(RuntimeError):  # closed already: nothing runs there
            asyncio.run_coroutine_threadsafe(_ended(), self.loop)
        self.thread.join(timeout=5.0)
        if not self.loop.is_running():
            self.loop.close()


async def _ended() -> None:
    """On a loop that ends: cancel its other tasks, wait for their ends, stop it."""
    here = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not here]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.get_running_loop().stop()


#: Run by the reaper: wait for this process (its parent) to end, then SIGKILL the engine's.
_REAPER = """
import os, signal, sys, time
parent, pids = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
while os.getppid() == parent:
    time.sleep(0.5)
for pid in pids:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""


def reaper(pids: list[int]) -> subprocess.Popen[bytes]:
    """A small process that kills ``pids`` once this process has ended, however it ended; kill
    it (and wait for it) when they end otherwise: their pids may be another's by then."""
    return subprocess.Popen(
        [sys.executable, "-c", _REAPER, str(os.getpid()), *map(str, pids)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # not in the worker's process group: it outlives a group kill
    )


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
